//! Python class `ShmWindowWriter` of `dataservice._core`: the worker's end of the
//! cross-trainer cache's window, one shared-memory segment ([`crate::shm::window`] has the
//! segment and the writer, [`crate::shm::holds`] the reclaim protocol). The worker's
//! `CrossTrainerCache` owns one writer. It never blocks: it reports "held" and its caller
//! decides (grace period, then `abandon`).
//!
//! One thread at a time (the cache calls it under its own lock; a concurrent call raises
//! `RuntimeError("... in use")` instead of blocking with the GIL held), except `grant` and
//! `ungrant`, which are atomic stores any thread may make.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::error::Error;
use crate::py::decode;
use crate::shm::holds::{Grants, NO_HOLD};
use crate::shm::segment::random_nonce;
use crate::shm::window::WindowWriter;
use crate::transport::codec::{self, DecodeSpec, Encoder, SendPtr};
use crate::transport::frame::{self, FramePlan, LeafDesc, Spec};

fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> PyResult<MutexGuard<'a, T>> {
    super::try_lock(m, what, "one thread at a time")
}

struct WriterState {
    window: WindowWriter,
    encoder: Encoder,
    spec: Option<Arc<Spec>>,
    spec_id: u32,
    /// Encoded specs by id (sent to trainers that have not seen them).
    spec_bodies: HashMap<u32, Vec<u8>>,
    /// Decoders for the worker's own reads (gRPC trainers), built on first use.
    decode_specs: HashMap<u32, DecodeSpec>,
}

/// The worker's end of the cross-trainer cache window: one sealed memfd segment holding
/// the cached elements as frames, written once, read by every same-host trainer.
///
/// Args:
///     capacity_bytes: Data bytes, a power of two in [64 KiB, 4 GiB] (grown for an element
///         bigger than half of it).
#[pyclass(name = "ShmWindowWriter", module = "dataservice._core")]
pub struct PyWindowWriter {
    state: Mutex<WriterState>,
    grants: Arc<Grants>,
}

#[pymethods]
impl PyWindowWriter {
    #[new]
    fn new(py: Python<'_>, capacity_bytes: u64) -> PyResult<Self> {
        let window = py.detach(|| WindowWriter::new(capacity_bytes, random_nonce()))?;
        Ok(PyWindowWriter {
            grants: window.grants().clone(),
            state: Mutex::new(WriterState {
                window,
                encoder: Encoder::default(),
                spec: None,
                spec_id: 0,
                spec_bodies: HashMap::new(),
                decode_specs: HashMap::new(),
            }),
        })
    }

    /// Appends `element` as a frame with sequence number `seq` (its global index). When
    /// the window's oldest frames are in the way, the segment grows (doubles, into a fresh
    /// memfd) while it is smaller than `max_capacity`, and evicts them once it is not.
    ///
    /// Returns:
    ///     (evicted, frame_bytes): how many of the oldest frames were evicted (the caller
    ///     drops as many from its own window), and the new frame's size, or None when a
    ///     trainer's hold or grant is in the way (nothing was written; call again, or
    ///     `abandon()` the segment).
    /// Raises:
    ///     ElementTooLargeError: The element does not fit even a 4 GiB segment.
    fn append(
        &self,
        py: Python<'_>,
        element: &Bound<'_, PyAny>,
        seq: u64,
        max_capacity: u64,
    ) -> PyResult<(usize, Option<u64>)> {
        let mut g = lock(&self.state, "cache window writer")?;
        let s = &mut *g;
        let flat = s.encoder.flatten(element)?;
        if !codec::same_spec(s.spec.as_ref(), &flat.spec) {
            let mut body = Vec::new();
            flat.spec.encode(&mut body);
            s.spec_id = s.spec_id.wrapping_add(1);
            s.spec_bodies.insert(s.spec_id, body);
            s.spec = Some(flat.spec.clone());
        }
        let codec::Flat {
            leaves,
            holders,
            objects,
            ..
        } = flat;
        let mut plan = FramePlan::data(s.spec_id, leaves);
        plan.set_seq(seq);
        let len = plan.total_bytes;
        let align = if plan.page_align {
            frame::LEASE_ALIGN
        } else {
            64
        };
        // Growing copies the window into a fresh segment: GIL released.
        let window = &mut s.window;
        let r = py.detach(|| window.reserve(len, align, max_capacity, random_nonce))?;
        let Some((pos, slot)) = r.at else {
            return Ok((r.evicted, None));
        };
        let dst = SendPtr(
            // SAFETY: slot + len <= capacity (reserve).
            unsafe { s.window.map().data().add(slot as usize) },
        );
        let p = &plan;
        let copy = move || {
            let dst = dst;
            // SAFETY: [slot, slot + len) is free space of the data area (no frame of the
            // window, no hold, no grant covers it: reserve) that only this writer writes;
            // payloads are buffers pinned by `holders` / `objects`.
            unsafe { p.copy_range(0, len, dst.0) }
        };
        codec::copy_detached_if_large(py, plan.payload_bytes as usize, copy);
        drop((holders, objects));
        s.window.commit(pos, len, align, s.spec_id);
        Ok((r.evicted, Some(len)))
    }

    /// Evicts the `n` oldest cached frames.
    fn evict(&self, n: usize) -> PyResult<()> {
        let mut g = lock(&self.state, "cache window writer")?;
        for _ in 0..n {
            g.window.log_mut().evict_oldest();
        }
        Ok(())
    }

    /// Leaves the segment to the trainers holding views into it and moves the window into a
    /// fresh one of the same size. Returns how many of the oldest frames did not fit.
    fn abandon(&self, py: Python<'_>) -> PyResult<usize> {
        let mut g = lock(&self.state, "cache window writer")?;
        let window = &mut g.window;
        Ok(py.detach(|| window.abandon(random_nonce()))?)
    }

    /// `(generation, pos, spec_ids, reclaim_below)` of the cached frames `offset .. offset + n`
    /// (offsets into the window, oldest first): they are contiguous from `pos` (PADs
    /// between them). `reclaim_below` is the position the writer reaches within its next
    /// quarter of the segment: a hold below it stalls the writer soon.
    fn span(&self, offset: usize, n: usize) -> PyResult<(u64, u64, Vec<u32>, u64)> {
        let g = lock(&self.state, "cache window writer")?;
        let log = g.window.log();
        let frames = log.frames();
        if offset + n > frames.len() || n == 0 {
            return Err(Error::RingState(format!(
                "window frames {offset}..{} out of range ({} cached)",
                offset + n,
                frames.len()
            ))
            .into());
        }
        let mut ids: Vec<u32> = frames
            .range(offset..offset + n)
            .map(|f| f.spec_id)
            .collect();
        ids.dedup();
        ids.sort_unstable();
        ids.dedup();
        Ok((
            g.window.generation(),
            frames[offset].pos,
            ids,
            log.reclaim_soon(),
        ))
    }

    /// The encoded spec `spec_id` (for `ShmWindowReader.add_spec`).
    fn spec_bytes<'py>(&self, py: Python<'py>, spec_id: u32) -> PyResult<Bound<'py, PyBytes>> {
        let g = lock(&self.state, "cache window writer")?;
        let body = g
            .spec_bodies
            .get(&spec_id)
            .ok_or_else(|| Error::RingState(format!("no spec {spec_id}")))?;
        Ok(PyBytes::new(py, body))
    }

    /// The cached elements `offset .. offset + n`, decoded (every leaf copied): the
    /// worker's own reads, for trainers on other hosts.
    fn decode<'py>(
        &self,
        py: Python<'py>,
        offset: usize,
        n: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        let mut g = lock(&self.state, "cache window writer")?;
        let s = &mut *g;
        let out = PyList::empty(py);
        let log = s.window.log();
        if offset + n > log.len() {
            return Err(Error::RingState(format!(
                "window frames {offset}..{} out of range ({} cached)",
                offset + n,
                log.len()
            ))
            .into());
        }
        let frames: Vec<_> = log.frames().range(offset..offset + n).copied().collect();
        for f in frames {
            if !s.decode_specs.contains_key(&f.spec_id) {
                let body = s.spec_bodies.get(&f.spec_id).ok_or_else(|| {
                    PyErr::from(Error::RingCorrupted {
                        pos: f.pos,
                        what: "cache window: frame of an unknown spec".into(),
                    })
                })?;
                let spec = Spec::decode(body)?;
                s.decode_specs
                    .insert(f.spec_id, DecodeSpec::new(py, spec, f.pos)?);
            }
            let slot = f.pos & (s.window.log().capacity() - 1);
            // SAFETY: the frame is cached (in the log), so only this writer, which we hold
            // locked, could overwrite it; slot + len <= capacity.
            let bytes = unsafe {
                std::slice::from_raw_parts(s.window.map().data().add(slot as usize), f.len as usize)
            };
            let mut copy = |_: Python<'py>, _: &LeafDesc, _: &[u8], _: u64| Ok(None);
            out.append(decode::decode_element(
                py,
                bytes,
                f.pos,
                &s.decode_specs,
                &mut copy,
            )?)?;
        }
        Ok(out)
    }

    /// Marks trainer slot `slot` as decoding a reply that starts at `pos`.
    fn grant(&self, slot: usize, pos: u64) {
        self.grants.set(slot, pos);
    }

    /// The trainer in `slot` finished decoding its reply (any thread).
    fn ungrant(&self, slot: usize) {
        self.grants.clear(slot);
    }

    /// The trainer in `slot` is gone: clears its grant and its hold word.
    fn release_slot(&self, slot: usize) -> PyResult<()> {
        self.grants.clear(slot);
        lock(&self.state, "cache window writer")?
            .window
            .release_slot(slot);
        Ok(())
    }

    /// The current segment's memfd (owned by this object; send a copy).
    fn fileno(&self) -> PyResult<RawFd> {
        let g = lock(&self.state, "cache window writer")?;
        Ok(g.window.map().fd().as_raw_fd())
    }

    /// (generation, fd, nonce) of the current segment.
    fn segment<'py>(&self, py: Python<'py>) -> PyResult<(u64, RawFd, Bound<'py, PyBytes>)> {
        let g = lock(&self.state, "cache window writer")?;
        let map = g.window.map();
        Ok((
            g.window.generation(),
            map.fd().as_raw_fd(),
            PyBytes::new(py, &map.nonce()),
        ))
    }

    #[getter]
    fn capacity_bytes(&self) -> PyResult<u64> {
        Ok(lock(&self.state, "cache window writer")?
            .window
            .log()
            .capacity())
    }

    /// Counters: generation, abandons, grows, frames and bytes written, cached frames, the
    /// window's span in the segment, and the reclaim limit's holders.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = lock(&self.state, "cache window writer")?;
        let w = &g.window;
        let d = PyDict::new(py);
        d.set_item("generation", w.generation())?;
        d.set_item("abandons", w.abandons)?;
        d.set_item("grows", w.grows)?;
        d.set_item("capacity_bytes", w.log().capacity())?;
        d.set_item("frames_written", w.frames_written)?;
        d.set_item("bytes_written", w.bytes_written)?;
        d.set_item("cached_frames", w.log().len())?;
        d.set_item("window_span_bytes", w.log().end_pos() - w.log().first_pos())?;
        let hold = w.map().min_hold();
        d.set_item("min_hold", if hold == NO_HOLD { None } else { Some(hold) })?;
        d.set_item("held_slots", w.held_slots())?;
        Ok(d)
    }
}
