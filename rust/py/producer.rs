//! Python class `ShmRingProducer` of `dataservice._core`: the worker's end of a
//! shared-memory ring (TRANSPORT.md), over [`crate::transport::writer`]. One thread at a
//! time (a concurrent call raises `RuntimeError("... in use")` instead of blocking with the
//! GIL held). Every wait runs in slices of at most 50 ms with the GIL released; between
//! slices the caller's signals are checked (Ctrl-C works) and the consumer's liveness.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::error::Error;
use crate::py::{closed, ring_lock as lock, RING_END};
use crate::shm::ring::Producer;
use crate::shm::segment::{random_nonce, Mapping};
use crate::transport::codec::{self, Encoder};
use crate::transport::frame::{self, FramePlan, Spec};
use crate::transport::peer::{check_pid, deadline, Peer};
use crate::transport::writer::{FrameWriter, Unlock};

/// The GIL as the writer's lock: released for waits and big copies, signals checked
/// between wait slices.
struct Gil<'py>(Python<'py>);

impl Unlock for Gil<'_> {
    type Err = PyErr;
    fn unlocked<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.0.detach(f)
    }
    fn check(&self) -> PyResult<()> {
        self.0.check_signals()
    }
}

struct ProducerState {
    writer: FrameWriter,
    encoder: Encoder,
    spec: Option<Arc<Spec>>,
    pid: u32,
    max_element_bytes: u64,
    elements: u64,
}

/// Ring memory allocated when a ring is made (bytes); the rest is allocated as the first
/// lap of frames reaches it, in steps that double (`Segment::reserve`).
const FIRST_RESERVE_BYTES: u64 = 1 << 20;

/// The producer (worker) end of a ring: creates the sealed memfd, with its first 1 MiB
/// allocated; the rest is allocated (zeroed by the kernel, ~1 ms per MiB) as frames first
/// reach it, so making a ring costs ~1 ms, not one per MiB of its capacity. Should a step
/// not fit the memory cgroup, the ring runs on within what it has.
///
/// Args:
///     capacity_bytes: Data bytes, a power of two in [64 KiB, 4 GiB].
///     max_element_bytes: Largest element accepted (bigger ones raise
///         `ElementTooLargeError`); elements above capacity/4 travel in chunks.
///
/// Raises:
///     ResourceExhaustedError: The whole capacity does not fit the memory cgroup's free
///         bytes, or the first 1 MiB cannot be allocated (full tmpfs).
#[pyclass(name = "ShmRingProducer", module = "dataservice._core")]
pub struct PyRingProducer {
    state: Mutex<Option<ProducerState>>,
    fd: RawFd,
    capacity: u64,
    nonce: [u8; 16],
    mapping: Arc<Mapping>,
}

#[pymethods]
impl PyRingProducer {
    #[new]
    #[pyo3(signature = (capacity_bytes, max_element_bytes = 1u64 << 40))]
    fn new(py: Python<'_>, capacity_bytes: u64, max_element_bytes: u64) -> PyResult<Self> {
        let nonce = random_nonce();
        let mapping =
            py.detach(|| Mapping::create_reserving(capacity_bytes, nonce, FIRST_RESERVE_BYTES))?;
        let writer = FrameWriter::new(Producer::new(mapping.clone()), Peer::none("consumer"));
        Ok(PyRingProducer {
            fd: mapping.fd().as_raw_fd(),
            capacity: capacity_bytes,
            nonce,
            mapping,
            state: Mutex::new(Some(ProducerState {
                writer,
                encoder: Encoder::default(),
                spec: None,
                pid: std::process::id(),
                max_element_bytes,
                elements: 0,
            })),
        })
    }

    /// The ring's memfd (owned by this object: send a copy, e.g. with `socket.send_fds`).
    fn fileno(&self) -> RawFd {
        self.fd
    }

    #[getter]
    fn capacity_bytes(&self) -> u64 {
        self.capacity
    }

    /// Data bytes of the ring allocated so far (from the start; `capacity_bytes` once the
    /// first lap reached the end).
    #[getter]
    fn reserved_bytes(&self) -> u64 {
        self.mapping.reserved_bytes()
    }

    #[getter]
    fn max_frame_bytes(&self) -> u64 {
        crate::shm::layout::max_frame_bytes(self.capacity)
    }

    #[getter]
    fn nonce<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.nonce)
    }

    /// Watches the consumer: `control_fd` (a socket, duplicated here) reporting HUP, and
    /// process `pid` (a pidfd) exiting; checked every wait slice.
    #[pyo3(signature = (control_fd = None, pid = None))]
    fn set_peer(&self, control_fd: Option<RawFd>, pid: Option<i32>) -> PyResult<()> {
        let mut g = lock(&self.state, "ring producer")?;
        let s = g.as_mut().ok_or_else(|| closed("ring producer"))?;
        s.writer.peer = Peer::new(control_fd, pid, "consumer")?;
        Ok(())
    }

    /// True while the consumer may be asleep waiting for data.
    fn consumer_waiting(&self) -> PyResult<bool> {
        let g = lock(&self.state, "ring producer")?;
        Ok(g.as_ref().is_some_and(|s| s.writer.ring.consumer_waiting()))
    }

    /// Writes `elements` in order, publishing once (and whenever it must wait).
    ///
    /// Blocks (GIL released) while the ring is full, up to `timeout_ms` (None: no limit).
    ///
    /// Returns:
    ///     How many elements were written: all of them, unless the time ran out.
    /// Raises:
    ///     UnavailableError: The consumer is gone.
    ///     ElementTooLargeError: An element exceeds `max_element_bytes` (nothing of it is
    ///         written; the elements before it are).
    ///     ResourceExhaustedError: The ring could not allocate more memory and a frame
    ///         does not fit what it has (nothing of it is written).
    #[pyo3(signature = (elements, timeout_ms = None))]
    fn put_many(
        &self,
        py: Python<'_>,
        elements: &Bound<'_, PyAny>,
        timeout_ms: Option<u64>,
    ) -> PyResult<usize> {
        let mut g = lock(&self.state, "ring producer")?;
        let s = g.as_mut().ok_or_else(|| closed("ring producer"))?;
        check_pid(s.pid, RING_END)?;
        let deadline = deadline(timeout_ms);
        let gil = Gil(py);
        let mut written = 0;
        let mut unpublished = 0u32;
        // The buffers pending frames point into, kept (and pinned) until they are copied:
        // frames are reserved and copied in batches, with one release of the GIL per batch.
        let mut holders: Vec<codec::HeldBuffer> = Vec::new();
        let mut objects: Vec<Py<PyAny>> = Vec::new();
        let flush = |w: &mut FrameWriter, h: &mut Vec<_>, o: &mut Vec<_>| {
            w.flush(&gil);
            h.clear();
            o.clear();
        };
        let result = (|| -> PyResult<()> {
            for element in elements.try_iter()? {
                let element = element?;
                let flat = s.encoder.flatten(&element)?;
                if !codec::same_spec(s.spec.as_ref(), &flat.spec) {
                    flush(&mut s.writer, &mut holders, &mut objects);
                    let mut spec_bytes = Vec::new();
                    flat.spec.encode(&mut spec_bytes);
                    if !s.writer.write_spec(&gil, &spec_bytes, deadline)? {
                        return Ok(());
                    }
                    s.spec = Some(flat.spec.clone());
                }
                let codec::Flat {
                    leaves,
                    holders: h,
                    objects: o,
                    ..
                } = flat;
                let plan = FramePlan::data(s.writer.spec_id, leaves);
                if plan.total_bytes > s.max_element_bytes {
                    return Err(Error::ElementTooLarge {
                        element_bytes: plan.total_bytes,
                        limit_bytes: s.max_element_bytes,
                        what: "max_element_bytes of the shared-memory ring".into(),
                    }
                    .into());
                }
                if plan.total_bytes <= s.writer.max_frame() {
                    match s.writer.try_push(plan) {
                        Ok(()) => {
                            holders.extend(h);
                            objects.extend(o);
                        }
                        Err(mut plan) => {
                            // No room now: copy what is pending, then wait as one frame does.
                            flush(&mut s.writer, &mut holders, &mut objects);
                            if !s.writer.write(&gil, &mut plan, deadline)? {
                                return Ok(());
                            }
                        }
                    }
                } else {
                    flush(&mut s.writer, &mut holders, &mut objects);
                    s.writer.write_chunked(&gil, &plan)?;
                }
                written += 1;
                s.elements += 1;
                unpublished += 1;
                if s.writer.pending_full() {
                    flush(&mut s.writer, &mut holders, &mut objects);
                }
                if s.writer.publish_for_waiting_consumer(&gil, unpublished) {
                    holders.clear();
                    objects.clear();
                    unpublished = 0;
                }
            }
            Ok(())
        })();
        s.writer.publish(&gil);
        drop((holders, objects));
        result.map(|()| written)
    }

    /// Writes an ERROR frame carrying a worker-side exception (type name, message).
    #[pyo3(signature = (type_name, message, timeout_ms = None))]
    fn put_error(
        &self,
        py: Python<'_>,
        type_name: &str,
        message: &str,
        timeout_ms: Option<u64>,
    ) -> PyResult<bool> {
        let mut g = lock(&self.state, "ring producer")?;
        let s = g.as_mut().ok_or_else(|| closed("ring producer"))?;
        s.writer
            .write_error(&Gil(py), type_name, message, deadline(timeout_ms))
    }

    /// Writes the END frame and marks the ring closed. Returns False on timeout.
    #[pyo3(signature = (timeout_ms = None))]
    fn put_end(&self, py: Python<'_>, timeout_ms: Option<u64>) -> PyResult<bool> {
        let mut g = lock(&self.state, "ring producer")?;
        let s = g.as_mut().ok_or_else(|| closed("ring producer"))?;
        let ok = s
            .writer
            .write_simple(&Gil(py), frame::KIND_END, &[], deadline(timeout_ms))?;
        if ok {
            s.writer.ring.close();
        }
        Ok(ok)
    }

    /// Counters: elements, bytes published, waits for space, consumer detaches,
    /// `consumer_elements` (elements the consumer has taken out, as it last stored) and
    /// `buffered_bytes` (published but not yet freed by the consumer). Any thread: it
    /// reads only the shared header.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use crate::sync::Ordering::Relaxed;
        let d = PyDict::new(py);
        let h = self.mapping.header();
        let write = h.producer.write_pos.load(Relaxed);
        let read = h.consumer.read_pos.load(Relaxed);
        d.set_item("frames_bytes", h.producer_counters.bytes.load(Relaxed))?;
        d.set_item("bytes", h.producer_counters.bytes.load(Relaxed))?;
        d.set_item("full_waits", h.producer_counters.waits.load(Relaxed))?;
        d.set_item("detaches", h.consumer_counters.detaches.load(Relaxed))?;
        d.set_item(
            "consumer_elements",
            h.consumer_counters.frames.load(Relaxed),
        )?;
        d.set_item("buffered_bytes", write.saturating_sub(read))?;
        if let Ok(g) = self.state.try_lock() {
            if let Some(s) = g.as_ref() {
                d.set_item("elements", s.elements)?;
            }
        }
        Ok(d)
    }

    /// Frees this end (the memory goes once the consumer unmaps too). Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let mut g = lock(&self.state, "ring producer")?;
        if let Some(mut s) = g.take() {
            s.writer.publish(&Gil(py));
        }
        Ok(())
    }
}
