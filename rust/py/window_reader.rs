//! Python class `ShmWindowReader` of `dataservice._core`: a same-host trainer's end of the
//! cross-trainer cache's window ([`crate::shm::window::SegmentReader`] maps the segment,
//! finds frames and decides leases; [`crate::shm::holds`] has the hold table). It maps the
//! worker's memfd and decodes the frames the worker names in its replies; it never blocks
//! and only reads frames the worker granted it.
//!
//! One thread at a time (a concurrent call raises `RuntimeError("... in use")` instead of
//! blocking with the GIL held).

use std::collections::HashMap;
use std::os::fd::{OwnedFd, RawFd};
use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::error::Error;
use crate::py::decode;
use crate::py::lease::{LeaseOwner, PyLease};
use crate::shm::window::{self, SegmentReader};
use crate::transport::codec::DecodeSpec;
use crate::transport::frame::{LeafDesc, Spec};
use crate::transport::peer::{check_pid, dup_fd};

fn lock<'a, T>(m: &'a Mutex<T>, what: &str) -> PyResult<MutexGuard<'a, T>> {
    super::try_lock(m, what, "one thread at a time")
}

struct ReaderState {
    segment: SegmentReader,
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

fn attach_segment(fd: RawFd, slot: usize, nonce: Option<&[u8]>) -> PyResult<SegmentReader> {
    if slot >= window::HOLD_SLOTS {
        // Checked before the fd is touched (as SegmentReader::attach does after).
        return Err(Error::LayoutMismatch {
            what: format!("hold slot {slot} out of range"),
        }
        .into());
    }
    let nonce = super::nonce(nonce)?;
    Ok(SegmentReader::attach(dup_fd(fd)?, slot, nonce)?)
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
        self.detached += self.segment.table().deactivate() as u64;
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
        let segment = attach_segment(fd, slot, nonce)?;
        Ok(PyWindowReader {
            state: Mutex::new(Some(ReaderState {
                segment,
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
        let segment = attach_segment(fd, s.slot, nonce)?;
        s.detached += s.segment.table().deactivate() as u64;
        s.segment = segment;
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
        let cap = s.segment.map().capacity();
        let max_pinned = (cap as f64 * s.max_pinned_fraction) as u64;
        let (zero_copy, threshold) = (s.zero_copy, s.copy_threshold);
        let mut p = pos;
        let mut nbytes = 0;
        for i in 0..count {
            let (frame_pos, bytes) = s.segment.frame(p, first_seq + i as u64)?;
            let total = bytes.len() as u64;
            let mut leases = s
                .segment
                .frame_leases(frame_pos, total, max_pinned, reclaim_below);
            let mut leased = 0u64;
            let mut lease = |py: Python<'py>,
                             d: &LeafDesc,
                             _: &[u8],
                             _: u64|
             -> PyResult<Option<(Bound<'py, PyAny>, *const u8)>> {
                if !zero_copy || d.nbytes < threshold {
                    return Ok(None);
                }
                let Some(leaf) = leases.leaf(d.offset, d.nbytes) else {
                    return Ok(None);
                };
                let ptr = leaf.ptr();
                leased += 1;
                let owner = LeaseOwner::Window(leaf);
                let lease = PyLease::new(owner, ptr, d.nbytes as usize);
                Ok(Some((Bound::new(py, lease)?.into_any(), ptr)))
            };
            let element = decode::decode_element(py, bytes, frame_pos, &s.specs, &mut lease)?;
            s.leased += leased;
            if leases.pressure {
                s.copied_on_pressure += 1;
            }
            out.append(element)?;
            nbytes += total;
            p = frame_pos + total;
        }
        s.elements += count as u64;
        if let Some(limit) = reclaim_below {
            s.detached += s.segment.table().detach_below(limit) as u64;
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
            d.set_item("min_hold", s.segment.table().min())?;
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
