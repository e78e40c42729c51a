//! Python classes `ShmWindowWriter` and `ShmWindowReader` of `dataservice._core`: the
//! cross-trainer cache's window as one shared-memory segment ([`crate::shm::window`] has the
//! layout and the reclaim protocol). The worker's `CrossTrainerCache` owns one writer; each
//! same-host trainer connection owns one reader, which maps the same memfd and decodes the
//! frames the worker names in its replies. Neither end blocks: the writer reports "held"
//! and its caller decides (grace period, then `abandon`), the reader only reads frames the
//! worker granted it.
//!
//! One thread at a time per object (the cache calls its writer under its own lock; a
//! concurrent call raises `RuntimeError("... in use")` instead of blocking with the GIL
//! held), except `ShmWindowWriter.ungrant`, which is an atomic store any thread may make.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::error::Error;
use crate::py::decode::{self, Batch};
use crate::py::lease::{LeaseOwner, PyLease};
use crate::shm::holds::{FrameHold, Grants, HoldTable, NO_HOLD};
use crate::shm::ring::{check_frame, KIND_PAD};
use crate::shm::segment::{page_bytes, random_nonce, PrivateMap};
use crate::shm::window::{self, WindowMap, WindowWriter};
use crate::transport::codec::{self, DecodeSpec, Encoder, SendPtr};
use crate::transport::frame::{self, FrameHeader, FramePlan, LeafDesc, Spec};
use crate::transport::peer::{check_pid, dup_fd};

/// Copies of at least this many bytes run with the GIL released.
const GIL_FREE_COPY_BYTES: u64 = 64 << 10;

fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> PyResult<MutexGuard<'a, T>> {
    super::try_lock(m, what, "one thread at a time")
}

fn corrupted(pos: u64, what: &str) -> PyErr {
    Error::RingCorrupted {
        pos,
        what: format!("cache window: {what}"),
    }
    .into()
}

/// Validates the frame at `pos` of a segment's data area and returns (slot, total, kind).
fn frame_at(map: &WindowMap, pos: u64) -> PyResult<(u64, u64, u32)> {
    let cap = map.capacity();
    let avail = cap - (pos & (cap - 1));
    // SAFETY: the data area holds `cap` bytes while `map` lives; the worker wrote the frame
    // before it named it to us and does not reuse it while our grant or hold covers it
    // (shm::holds' reclaim protocol).
    let f = unsafe { check_frame(map.data(), cap, pos, avail) }.map_err(|e| match e {
        Error::RingCorrupted { pos, what } => corrupted(pos, &what),
        e => e.into(),
    })?;
    Ok((f.slot, f.len, f.kind))
}

/// Decodes one DATA frame into an element (`lease` as in `decode::decode_data`).
fn decode_frame<'py>(
    py: Python<'py>,
    bytes: &[u8],
    pos: u64,
    specs: &HashMap<u32, DecodeSpec>,
    lease: &mut decode::LeaseFn<'_, 'py>,
) -> PyResult<Bound<'py, PyAny>> {
    let header = FrameHeader::parse(bytes)?;
    let spec = specs
        .get(&header.spec_id)
        .ok_or_else(|| corrupted(pos, &format!("unknown spec id {}", header.spec_id)))?;
    let mut batch = Batch::default();
    decode::decode_data(py, bytes, pos, header.spec_id, spec, &mut batch, lease)?;
    let out = PyList::empty(py);
    decode::flush_batch(py, spec, &mut batch, &out)?;
    out.get_item(0)
}

// ------------------------------------------------------------------------------------------
// Writer (worker)
// ------------------------------------------------------------------------------------------

struct WriterState {
    window: WindowWriter,
    encoder: Encoder,
    spec: Option<Spec>,
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
        if s.spec.as_ref() != Some(&flat.spec) {
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
        if plan.payload_bytes >= GIL_FREE_COPY_BYTES {
            py.detach(copy);
        } else {
            copy();
        }
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
                let body = s
                    .spec_bodies
                    .get(&f.spec_id)
                    .ok_or_else(|| corrupted(f.pos, "frame of an unknown spec"))?;
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
            let mut copy = |_: Python<'py>, _: &LeafDesc, _: &[u8]| Ok(None);
            out.append(decode_frame(py, bytes, f.pos, &s.decode_specs, &mut copy)?)?;
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

// ------------------------------------------------------------------------------------------
// Reader (trainer)
// ------------------------------------------------------------------------------------------

struct ReaderState {
    map: Arc<WindowMap>,
    table: Arc<HoldTable>,
    generation: u64,
    slot: usize,
    specs: HashMap<u32, DecodeSpec>,
    zero_copy: bool,
    copy_threshold: u64,
    max_pinned_fraction: f64,
    /// A duplicate of the control socket: the worker sees this trainer hang up only once the
    /// reader is closed (after its views were detached).
    _control: Option<OwnedFd>,
    pid: u32,
    elements: u64,
    leased: u64,
    copied_on_pressure: u64,
    detached: u64,
    segments: u64,
}

fn attach_segment(
    fd: RawFd,
    slot: usize,
    nonce: Option<&[u8]>,
) -> PyResult<(Arc<WindowMap>, Arc<HoldTable>)> {
    if slot >= window::HOLD_SLOTS {
        return Err(Error::LayoutMismatch {
            what: format!("hold slot {slot} out of range"),
        }
        .into());
    }
    let nonce = super::nonce(nonce)?;
    let map = WindowMap::attach(dup_fd(fd)?, nonce)?;
    let table = HoldTable::new(map.clone(), slot)?;
    Ok((map, table))
}

/// A trainer's end of the cross-trainer cache window: maps the worker's segment (shared,
/// read-only but for its hold word) and decodes the frames the worker's replies name.
/// Numpy leaves of >= `copy_threshold_bytes` become writeable views of private
/// (copy-on-write) mappings of the segment, held by this trainer's hold slot; smaller
/// leaves, and every leaf once this trainer's holds span more than `max_pinned_fraction` of
/// the segment, are copied.
///
/// Args:
///     fd: The segment's memfd (duplicated here).
///     slot: This connection's hold slot (from the handshake).
///     generation: The segment's generation (from the handshake).
///     control_fd: The connection's socket, duplicated so that the worker sees the hang-up
///         only after `close()` detached the views.
#[pyclass(name = "ShmWindowReader", module = "dataservice._core")]
pub struct PyWindowReader {
    state: Mutex<Option<ReaderState>>,
}

impl ReaderState {
    fn shutdown(&mut self) {
        self.detached += self.table.deactivate() as u64;
    }
}

impl Drop for PyWindowReader {
    fn drop(&mut self) {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mut s) = g.take() {
            s.shutdown();
        }
    }
}

#[pymethods]
impl PyWindowReader {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (fd, slot, generation, nonce = None, control_fd = None, zero_copy = true, copy_threshold_bytes = 65536, max_pinned_fraction = 0.25))]
    fn new(
        fd: RawFd,
        slot: usize,
        generation: u64,
        nonce: Option<&[u8]>,
        control_fd: Option<RawFd>,
        zero_copy: bool,
        copy_threshold_bytes: u64,
        max_pinned_fraction: f64,
    ) -> PyResult<Self> {
        let (map, table) = attach_segment(fd, slot, nonce)?;
        Ok(PyWindowReader {
            state: Mutex::new(Some(ReaderState {
                map,
                table,
                generation,
                slot,
                specs: HashMap::new(),
                zero_copy,
                copy_threshold: copy_threshold_bytes.max(1),
                max_pinned_fraction: max_pinned_fraction.clamp(0.0, 1.0),
                _control: control_fd.map(dup_fd).transpose()?,
                pid: std::process::id(),
                elements: 0,
                leased: 0,
                copied_on_pressure: 0,
                detached: 0,
                segments: 1,
            })),
        })
    }

    #[getter]
    fn generation(&self) -> PyResult<u64> {
        let g = lock(&self.state, "cache window reader")?;
        Ok(g.as_ref().map_or(0, |s| s.generation))
    }

    /// Switches to the worker's fresh segment `fd` (after it abandoned or grew the old
    /// one): views into the old one are detached first (copied into private memory, the
    /// hoarder's own cost), so the old segment's memory goes with the worker's last use.
    #[pyo3(signature = (fd, generation, nonce = None))]
    fn set_segment(&self, fd: RawFd, generation: u64, nonce: Option<&[u8]>) -> PyResult<()> {
        let mut g = lock(&self.state, "cache window reader")?;
        let s = g
            .as_mut()
            .ok_or_else(|| Error::RingState("cache window reader is closed".into()))?;
        let (map, table) = attach_segment(fd, s.slot, nonce)?;
        s.detached += s.table.deactivate() as u64;
        s.map = map;
        s.table = table;
        s.generation = generation;
        s.segments += 1;
        Ok(())
    }

    /// Registers the encoded spec `spec_id` (from the worker's reply).
    fn add_spec(&self, py: Python<'_>, spec_id: u32, body: &[u8]) -> PyResult<()> {
        let mut g = lock(&self.state, "cache window reader")?;
        let s = g
            .as_mut()
            .ok_or_else(|| Error::RingState("cache window reader is closed".into()))?;
        let spec = Spec::decode(body)?;
        s.specs.insert(spec_id, DecodeSpec::new(py, spec, 0)?);
        Ok(())
    }

    /// Decodes `count` DATA frames from position `pos` on (PADs skipped); the first one's
    /// sequence number must be `first_seq` and the rest consecutive. Frames below
    /// `reclaim_below` (from the reply: the space the writer reuses within its next quarter
    /// of the segment) are copied, not leased, and views still alive of such frames are
    /// detached now (copied into private memory), which lifts their holds before they stall
    /// the writer.
    ///
    /// Returns:
    ///     (elements, frame bytes).
    /// Raises:
    ///     DataLossError: The segment's bytes are not the frames named.
    #[pyo3(signature = (pos, count, first_seq, reclaim_below = None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        pos: u64,
        count: usize,
        first_seq: u64,
        reclaim_below: Option<u64>,
    ) -> PyResult<(Bound<'py, PyList>, u64)> {
        let mut g = lock(&self.state, "cache window reader")?;
        let s = g
            .as_mut()
            .ok_or_else(|| Error::RingState("cache window reader is closed".into()))?;
        check_pid(s.pid, "a cache window reader")?;
        let out = PyList::empty(py);
        let cap = s.map.capacity();
        let max_pinned = (cap as f64 * s.max_pinned_fraction) as u64;
        let page = page_bytes();
        let detach_limit = reclaim_below;
        let mut p = pos;
        let mut nbytes = 0;
        for i in 0..count {
            let mut pads = 0;
            let (slot, total) = loop {
                let (slot, total, kind) = frame_at(&s.map, p)?;
                if kind == KIND_PAD {
                    // One PAD at the wrap, or before a page-aligned frame, never two in a row.
                    pads += 1;
                    if pads > 1 {
                        return Err(corrupted(p, "two PAD frames in a row"));
                    }
                    p += total;
                    continue;
                }
                break (slot, total);
            };
            // SAFETY: frame_at validated [slot, slot + total) inside the data area; the
            // worker's grant (set before its reply, cleared by our DONE after this call)
            // keeps it from being rewritten while we read.
            let bytes: &[u8] = unsafe {
                std::slice::from_raw_parts(s.map.data().add(slot as usize), total as usize)
            };
            let seq = FrameHeader::parse(bytes)?.seq;
            if seq != first_seq + i as u64 {
                return Err(corrupted(
                    p,
                    &format!(
                        "frame seq {seq} where {} was expected",
                        first_seq + i as u64
                    ),
                ));
            }
            let frame_pos = p;
            let frame_end = p + total;
            let mut hold: Option<Arc<FrameHold>> = None;
            let mut pressure = false;
            let (zero_copy, threshold, table, map) = (
                s.zero_copy,
                s.copy_threshold,
                s.table.clone(),
                s.map.clone(),
            );
            let mut leased = 0u64;
            let mut lease = |py: Python<'py>,
                             d: &LeafDesc,
                             _: &[u8]|
             -> PyResult<Option<Bound<'py, PyLease>>> {
                if !zero_copy || d.nbytes < threshold || (slot + d.offset) % page != 0 {
                    return Ok(None);
                }
                if hold.is_none() {
                    // Copy on pressure: lease only while this trainer's holds span at most
                    // its share of the segment, and no frame the writer reclaims next.
                    let low = table.min().unwrap_or(frame_pos).min(frame_pos);
                    if frame_end - low > max_pinned || detach_limit.is_some_and(|l| frame_pos < l) {
                        pressure = true;
                        return Ok(None);
                    }
                    hold = Some(table.acquire(frame_pos));
                }
                let Some(pm) = map.map_private(slot + d.offset, d.nbytes) else {
                    return Ok(None);
                };
                let pm: Box<PrivateMap> = Box::new(pm);
                let leaf = table.lease(pm, frame_pos, hold.clone().expect("taken above"));
                let ptr = leaf.ptr();
                leased += 1;
                Ok(Some(Bound::new(
                    py,
                    PyLease::new(LeaseOwner::Window(leaf), ptr, d.nbytes as usize),
                )?))
            };
            let element = decode_frame(py, bytes, frame_pos, &s.specs, &mut lease)?;
            s.leased += leased;
            if pressure {
                s.copied_on_pressure += 1;
            }
            out.append(element)?;
            nbytes += total;
            p = frame_end;
        }
        s.elements += count as u64;
        if let Some(limit) = detach_limit {
            s.detached += s.table.detach_below(limit) as u64;
        }
        Ok((out, nbytes))
    }

    /// Counters: elements, leased leaves, frames copied on pressure, leaves detached,
    /// segments seen, and this trainer's lowest hold.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = lock(&self.state, "cache window reader")?;
        let d = PyDict::new(py);
        if let Some(s) = g.as_ref() {
            d.set_item("elements", s.elements)?;
            d.set_item("leased", s.leased)?;
            d.set_item("copied_on_pressure", s.copied_on_pressure)?;
            d.set_item("detached", s.detached)?;
            d.set_item("segments", s.segments)?;
            d.set_item("generation", s.generation)?;
            d.set_item("min_hold", s.table.min())?;
        }
        Ok(d)
    }

    /// Detaches the views still alive (private copies) and gives the hold slot up; the
    /// views stay valid. Idempotent.
    fn close(&self) -> PyResult<()> {
        let mut g = lock(&self.state, "cache window reader")?;
        if let Some(mut s) = g.take() {
            s.shutdown();
        }
        Ok(())
    }
}
