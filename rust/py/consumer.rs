//! Python class `ShmRingConsumer` of `dataservice._core`: the trainer's end of a
//! shared-memory ring (TRANSPORT.md), over [`crate::shm::ring`], [`crate::shm::detach`] and
//! [`crate::transport::chunk`], decoding through [`crate::py::decode`]. One thread at a time
//! (a concurrent call raises `RuntimeError("... in use")` instead of blocking with the GIL
//! held). Every wait runs in slices of at most 50 ms with the GIL released; between slices
//! the caller's signals are checked (Ctrl-C works) and the producer's liveness.

use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::error::Error;
use crate::py::decode::{self, Batch};
use crate::py::lease::{LeaseOwner, PyLease};
use crate::py::{closed, ring_lock as lock, RING_END};
use crate::shm::detach::{detach_pinned, StallBreaker};
use crate::shm::ring::{Consumer, Region};
use crate::shm::segment::Mapping;
use crate::transport::codec::DecodeSpec;
use crate::transport::frame;
use crate::transport::peer::{check_pid, deadline, dup_fd, wait_slice, Peer};
use crate::transport::reader::FrameStream;

struct ConsumerState {
    ring: Consumer,
    mapping: Arc<Mapping>,
    spec: Option<(u32, DecodeSpec)>,
    stream: FrameStream,
    peer: Peer,
    pid: u32,
    zero_copy: bool,
    copy_threshold: u64,
    max_pinned: u64,
    /// An ERROR frame's (type, message), reported after the elements before it.
    error: Option<(String, String)>,
    end: bool,
    elements: u64,
    leased: u64,
    detaches: u64,
    /// Frame bytes of the elements decoded since the last `get_many` returned.
    data_bytes: u64,
}

fn corrupted(pos: u64, what: &str) -> PyErr {
    Error::RingCorrupted {
        pos,
        what: what.to_string(),
    }
    .into()
}

impl ConsumerState {
    fn take_bytes(&mut self) -> u64 {
        std::mem::take(&mut self.data_bytes)
    }

    fn spec(&self, pos: u64) -> PyResult<(u32, &DecodeSpec)> {
        match &self.spec {
            Some((id, s)) => Ok((*id, s)),
            None => Err(corrupted(pos, "data frame before any spec")),
        }
    }

    fn flush_batch(
        &mut self,
        py: Python<'_>,
        batch: &mut Batch,
        out: &Bound<'_, PyList>,
    ) -> PyResult<()> {
        if batch.len() == 0 {
            return Ok(());
        }
        let (_, spec) = self.spec(self.ring.next_read())?;
        decode::flush_batch(py, spec, batch, out)
    }

    /// Reads frames into `out` until `max` elements, an END/ERROR, or no more data.
    /// Returns true if it stopped at END or ERROR.
    fn drain<'py>(
        &mut self,
        py: Python<'py>,
        max: usize,
        out: &Bound<'py, PyList>,
    ) -> PyResult<bool> {
        let mut batch = Batch::default();
        let mut stop = false;
        while out.len() + batch.len() < max {
            let Some(rf) = self.stream.next(&mut self.ring)? else {
                break;
            };
            let (f, header, bytes) = (rf.frame, rf.header, rf.bytes());
            match f.kind {
                frame::KIND_DATA => {
                    self.data_bytes += f.len;
                    let frame_end = f.pos + f.len;
                    // The frame's lease, made at its first leased leaf (copy on pressure:
                    // only while pinned bytes stay under the cap), or None to copy it all.
                    // One RingLease spans the frame; each leased leaf is a view of it at
                    // its offset. Leased: every array leaf of a frame whose array bytes
                    // reach the threshold, so many small leaves cost a view each, not a copy.
                    let mut owner: Option<Option<Bound<'py, PyAny>>> = None;
                    let (zero_copy, threshold, max_pinned) =
                        (self.zero_copy, self.copy_threshold, self.max_pinned);
                    let (frame_ptr, frame_len) = (bytes.as_ptr(), bytes.len());
                    let ring = &mut self.ring;
                    let mut lease = |py: Python<'py>,
                                     _: &frame::LeafDesc,
                                     payload: &[u8],
                                     array_bytes: u64|
                     -> PyResult<Option<(Bound<'py, PyAny>, *const u8)>> {
                        if !zero_copy || array_bytes < threshold {
                            return Ok(None);
                        }
                        if owner.is_none() {
                            let (pinned_start, _) = ring.reclaim.pinned();
                            owner = Some(if frame_end - pinned_start <= max_pinned {
                                let o = LeaseOwner::Frame(Arc::new(ring.lease(frame_end)));
                                let l = PyLease::new(o, frame_ptr, frame_len);
                                Some(Bound::new(py, l)?.into_any())
                            } else {
                                None
                            });
                        }
                        let buf = owner.as_ref().and_then(|o| o.as_ref());
                        Ok(buf.map(|b| (b.clone(), payload.as_ptr())))
                    };
                    let r = match &self.spec {
                        Some((id, spec)) => {
                            decode::decode_data(py, bytes, f.pos, *id, spec, &mut batch, &mut lease)
                        }
                        None => Err(corrupted(f.pos, "data frame before any spec")),
                    };
                    let leased = owner.is_some_and(|o| o.is_some());
                    if !leased {
                        self.ring.mark_free(frame_end);
                    }
                    self.leased += r?;
                }
                frame::KIND_SPEC => {
                    self.flush_batch(py, &mut batch, out)?;
                    let (spec_id, spec) = rf.spec()?;
                    self.spec = Some((spec_id, DecodeSpec::new(py, spec, f.pos)?));
                    self.ring.mark_free(rf.end());
                }
                frame::KIND_CHUNK => {
                    self.data_bytes += f.len;
                    let copy = self.stream.chunks.accept(bytes, f.pos)?;
                    py.detach(move || copy.run());
                    if let Some(buf) = self.stream.chunks.finish(header.flags, f.pos)? {
                        let whole = buf.as_slice();
                        let (zero_copy, threshold) = (self.zero_copy, self.copy_threshold);
                        // One RingLease over the rebuilt element, as for a DATA frame.
                        let mut whole_lease: Option<Bound<'py, PyAny>> = None;
                        let mut lease = |py: Python<'py>,
                                         _: &frame::LeafDesc,
                                         payload: &[u8],
                                         array_bytes: u64|
                         -> PyResult<Option<(Bound<'py, PyAny>, *const u8)>> {
                            if !zero_copy || array_bytes < threshold {
                                return Ok(None);
                            }
                            if whole_lease.is_none() {
                                let owner = LeaseOwner::Heap(buf.clone());
                                let l = PyLease::new(owner, whole.as_ptr(), whole.len());
                                whole_lease = Some(Bound::new(py, l)?.into_any());
                            }
                            Ok(whole_lease.clone().map(|b| (b, payload.as_ptr())))
                        };
                        let (id, spec) = self.spec(f.pos)?;
                        self.leased += decode::decode_data(
                            py, whole, f.pos, id, spec, &mut batch, &mut lease,
                        )?;
                    }
                    self.ring.mark_free(f.pos + f.len);
                }
                frame::KIND_END => {
                    self.ring.mark_free(f.pos + f.len);
                    self.end = true;
                    stop = true;
                    break;
                }
                frame::KIND_ERROR => {
                    let e = rf.error()?;
                    self.ring.mark_free(f.pos + f.len);
                    self.error = Some(e);
                    stop = true;
                    break;
                }
                _ => return Err(corrupted(f.pos, &format!("unknown frame kind {}", f.kind))),
            }
        }
        self.flush_batch(py, &mut batch, out)?;
        self.ring.flush_free();
        Ok(stop)
    }

    /// The stall breaker (TRANSPORT.md §5): the producer waits for space held by leases
    /// while we have nothing to read, so copy the pinned pages away and free them.
    fn detach(&mut self, py: Python<'_>) -> PyResult<()> {
        let (mapping, ring) = (&self.mapping, &mut self.ring);
        if let Some(fresh) = py.detach(|| detach_pinned(mapping, ring))? {
            self.mapping = fresh;
            self.detaches += 1;
        }
        Ok(())
    }
}

/// `get_many`'s result: (elements, frame bytes, end_of_sequence, worker error).
type GetMany<'py> = (Bound<'py, PyList>, u64, bool, Option<(String, String)>);

/// The consumer (trainer) end of a ring: maps a received memfd. One consumer thread.
///
/// Args:
///     fd: The ring's memfd (duplicated here; the caller may close its copy).
///     control_fd: The handshake socket, watched for HUP (duplicated here).
///     pid: The producer's pid (a pidfd is watched).
///     nonce: The handshake's nonce; the ring's header must carry the same.
///     zero_copy: Hand out the numpy leaves of an element whose array leaves hold
///         >= `copy_threshold_bytes` in all as views of the ring (one lease per frame).
///     max_pinned_fraction: Lease only while the held span stays under this share of the
///         ring; beyond it frames are copied (copy on pressure).
///
/// Raises:
///     FailedPreconditionError: The fd is not a ring of this layout.
#[pyclass(name = "ShmRingConsumer", module = "dataservice._core")]
pub struct PyRingConsumer {
    state: Mutex<Option<ConsumerState>>,
    capacity: u64,
}

#[pymethods]
impl PyRingConsumer {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (fd, control_fd = None, pid = None, nonce = None, zero_copy = true, copy_threshold_bytes = 65536, max_pinned_fraction = 0.5))]
    fn new(
        py: Python<'_>,
        fd: RawFd,
        control_fd: Option<RawFd>,
        pid: Option<i32>,
        nonce: Option<&[u8]>,
        zero_copy: bool,
        copy_threshold_bytes: u64,
        max_pinned_fraction: f64,
    ) -> PyResult<Self> {
        let nonce = super::nonce(nonce)?;
        let owned = dup_fd(fd)?;
        let mapping = py.detach(|| Mapping::attach(owned, nonce))?;
        let region: Arc<dyn Region> = mapping.clone();
        let ring = Consumer::new(region);
        let capacity = ring.capacity();
        mapping
            .header()
            .consumer
            .consumer_pid
            .store(std::process::id(), crate::sync::Ordering::Relaxed);
        let fraction = max_pinned_fraction.clamp(0.0, 1.0);
        Ok(PyRingConsumer {
            capacity,
            state: Mutex::new(Some(ConsumerState {
                ring,
                mapping,
                spec: None,
                stream: FrameStream::default(),
                peer: Peer::new(control_fd, pid, "producer")?,
                pid: std::process::id(),
                zero_copy,
                copy_threshold: copy_threshold_bytes.max(1),
                max_pinned: (capacity as f64 * fraction) as u64,
                error: None,
                end: false,
                elements: 0,
                leased: 0,
                detaches: 0,
                data_bytes: 0,
            })),
        })
    }

    #[getter]
    fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    /// Takes up to `max_elements` elements, waiting (GIL released) up to `timeout_ms` for
    /// the first one (None: no limit).
    ///
    /// Returns:
    ///     (elements, nbytes, end_of_sequence, error): `nbytes` is the size of the
    ///     elements' frames; `error` is a worker-side (type name, message), reported once
    ///     the elements before it were returned. An empty list with end_of_sequence False
    ///     means the time ran out.
    /// Raises:
    ///     UnavailableError: The producer died; every element published before was returned.
    ///     DataLossError: The ring's bytes are not valid frames.
    #[pyo3(signature = (max_elements = 256, timeout_ms = None))]
    fn get_many<'py>(
        &self,
        py: Python<'py>,
        max_elements: usize,
        timeout_ms: Option<u64>,
    ) -> PyResult<GetMany<'py>> {
        let mut g = lock(&self.state, "ring consumer")?;
        let s = g.as_mut().ok_or_else(|| closed("ring consumer"))?;
        check_pid(s.pid, RING_END)?;
        let out = PyList::empty(py);
        let max = max_elements.max(1);
        let deadline = deadline(timeout_ms);
        let mut stall = StallBreaker::default();
        loop {
            if s.end {
                return Ok((out, s.take_bytes(), true, None));
            }
            if let Some(e) = s.error.clone() {
                if out.is_empty() {
                    return Ok((out, s.take_bytes(), true, Some(e)));
                }
                return Ok((out, s.take_bytes(), false, None));
            }
            let stopped = s.drain(py, max, &out)?;
            if !out.is_empty() {
                s.elements += out.len() as u64;
                // For the producer (`consumer_elements`): what a consumer that goes away
                // had not taken yet goes back to its task (transfer/shm.py).
                let taken = &s.mapping.header().consumer_counters.frames;
                taken.store(s.elements, crate::sync::Ordering::Relaxed);
            }
            if stopped {
                if s.end {
                    return Ok((out, s.take_bytes(), true, None));
                }
                continue; // report the error (now, or after these elements)
            }
            if !out.is_empty() {
                return Ok((out, s.take_bytes(), false, None));
            }
            // Nothing to read: is the producer stuck behind our leases?
            let (pinned_start, pinned_end) = s.ring.reclaim.pinned();
            let pinned = pinned_end > pinned_start;
            if stall.should_detach(pinned, s.ring.producer_waiting()) {
                s.detach(py)?;
                continue;
            }
            let Some(slice) = wait_slice(deadline) else {
                return Ok((out, s.take_bytes(), false, None));
            };
            let slice = StallBreaker::slice(pinned, slice);
            let ring = &mut s.ring;
            if py.detach(|| ring.wait_for_data(slice)) {
                continue;
            }
            py.check_signals()?;
            if let Err(e) = s.peer.check() {
                if s.ring.has_data() {
                    continue; // drain what was published before the death
                }
                return Err(e.into());
            }
        }
    }

    /// Counters: elements, leased frames, detaches, pinned bytes.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = lock(&self.state, "ring consumer")?;
        let d = PyDict::new(py);
        if let Some(s) = g.as_ref() {
            let (a, b) = s.ring.reclaim.pinned();
            d.set_item("elements", s.elements)?;
            d.set_item("leased", s.leased)?;
            d.set_item("detaches", s.detaches)?;
            d.set_item("pinned_bytes", b - a)?;
            let h = s.mapping.header();
            d.set_item(
                "empty_waits",
                h.consumer_counters
                    .waits
                    .load(crate::sync::Ordering::Relaxed),
            )?;
        }
        Ok(d)
    }

    /// Frees this end; views handed out stay valid (they hold the mapping). Idempotent.
    fn close(&self) -> PyResult<()> {
        let mut g = lock(&self.state, "ring consumer")?;
        if let Some(s) = g.take() {
            s.mapping.header().consumer.state.store(
                crate::shm::layout::STATE_CLOSED,
                crate::sync::Ordering::Release,
            );
        }
        Ok(())
    }
}
