//! Python classes `ShmRingProducer`, `ShmRingConsumer` and `RingLease` of `dataservice._core`:
//! the two ends of a shared-memory ring (TRANSPORT.md), over [`crate::shm`] and
//! [`crate::transport`]. Each end is used by one thread at a time (a concurrent call raises
//! `RuntimeError("ring in use")` instead of blocking with the GIL held). Every wait runs in
//! slices of at most 50 ms with the GIL released; between slices the caller's signals are
//! checked (Ctrl-C works) and the peer's liveness (control socket HUP, pidfd).

use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::error::Error;
use crate::py::decode::{self, Batch};
use crate::py::lease::{LeaseOwner, PyLease};
use crate::shm::detach::{detach_pinned, StallBreaker};
use crate::shm::ring::{Consumer, Producer, Region};
use crate::shm::segment::{random_nonce, Mapping};
use crate::transport::chunk::{self, Reassembly};
use crate::transport::codec::{self, DecodeSpec, Encoder, SendPtr};
use crate::transport::frame::{self, FrameHeader, FramePlan, Spec};
use crate::transport::peer::{check_pid, deadline, dup_fd, wait_slice, Peer};

/// `put_many` publishes early for a waiting consumer once this many elements or bytes are
/// written (not after every element: one wake-up, a futex syscall, per small element would
/// cost more than the element), and always at its end.
const PUBLISH_EVERY_ELEMENTS: u32 = 64;
const PUBLISH_EVERY_BYTES: u64 = 64 << 10;
/// The producer copies an element of at least this many payload bytes into the ring with
/// the GIL released (the consumer's threshold, `GIL_FREE_COPY_BYTES`, is higher): on a
/// worker the task's pipeline thread runs meanwhile; a 64 KiB copy takes ~5 µs, far more
/// than a release and re-acquire of an uncontended GIL.
const PRODUCER_GIL_FREE_COPY_BYTES: usize = 64 << 10;

const RING_END: &str = "a ring end";

fn lock<'a, T>(m: &'a Mutex<Option<T>>, what: &str) -> PyResult<MutexGuard<'a, Option<T>>> {
    super::try_lock(m, what, "one thread per ring end")
}

fn closed(what: &str) -> PyErr {
    Error::RingState(format!("{what} is closed")).into()
}

// ------------------------------------------------------------------------------------------
// Producer
// ------------------------------------------------------------------------------------------

struct ProducerState {
    ring: Producer,
    encoder: Encoder,
    spec: Option<Spec>,
    spec_id: u32,
    seq: u64,
    peer: Peer,
    pid: u32,
    max_frame: u64,
    max_element_bytes: u64,
    elements: u64,
}

/// The producer (worker) end of a ring: creates the sealed memfd. One producer thread.
///
/// Args:
///     capacity_bytes: Data bytes, a power of two in [64 KiB, 4 GiB].
///     max_element_bytes: Largest element accepted (bigger ones raise
///         `ElementTooLargeError`); elements above capacity/4 travel in chunks.
///
/// Raises:
///     ResourceExhaustedError: The memory could not be reserved (full tmpfs, cgroup).
#[pyclass(name = "ShmRingProducer", module = "dataservice._core")]
pub struct PyRingProducer {
    state: Mutex<Option<ProducerState>>,
    fd: RawFd,
    capacity: u64,
    nonce: [u8; 16],
    _mapping: Arc<Mapping>,
}

impl ProducerState {
    fn next_seq(&mut self) -> u64 {
        let s = self.seq;
        self.seq += 1;
        s
    }

    /// Waits (GIL released, in slices) until `need` bytes are free or `deadline` passes.
    /// Err on peer death or a signal; Ok(false) on timeout.
    fn wait_space(
        &mut self,
        py: Python<'_>,
        need: u64,
        deadline: Option<Instant>,
    ) -> PyResult<bool> {
        self.ring.publish();
        loop {
            let Some(slice) = wait_slice(deadline) else {
                return Ok(false);
            };
            let ring = &mut self.ring;
            if py.detach(|| ring.wait_for_space(need, slice)) {
                return Ok(true);
            }
            py.check_signals()?;
            self.peer.check()?;
        }
    }

    /// Reserves a slot for `plan` (and gives it its sequence number) if the ring has room
    /// now; the caller copies the frame in before anything is published.
    fn try_reserve_plan(&mut self, plan: &mut FramePlan<'_>) -> Option<u64> {
        let align = if plan.page_align {
            frame::LEASE_ALIGN
        } else {
            64
        };
        let slot = self.ring.try_reserve(plan.total_bytes, align)?;
        plan.set_seq(self.next_seq());
        Some(slot)
    }

    /// Writes one whole frame; Ok(false) if `deadline` passed first (nothing written).
    fn write_plan(
        &mut self,
        py: Python<'_>,
        plan: &mut FramePlan<'_>,
        deadline: Option<Instant>,
    ) -> PyResult<bool> {
        let len = plan.total_bytes;
        let align = if plan.page_align {
            frame::LEASE_ALIGN
        } else {
            64
        };
        let slot = loop {
            if let Some(slot) = self.ring.try_reserve(len, align) {
                break slot;
            }
            let need = self.ring.need_for(len, align);
            if !self.wait_space(py, need, deadline)? {
                return Ok(false);
            }
        };
        plan.set_seq(self.next_seq());
        let dst = SendPtr(self.ring.slot_ptr(slot));
        if plan.payload_bytes as usize >= PRODUCER_GIL_FREE_COPY_BYTES {
            let p: &FramePlan<'_> = plan;
            py.detach(move || {
                let dst = dst;
                // SAFETY: [slot, slot+len) was just reserved (free, inside the data area) and
                // only this producer writes it until publish; payloads are pinned buffers.
                unsafe { p.copy_range(0, len, dst.0) }
            });
        } else {
            // SAFETY: as above.
            unsafe { plan.copy_range(0, len, dst.0) };
        }
        Ok(true)
    }

    /// Writes a frame bigger than max_frame as CHUNK frames (no timeout: once started, an
    /// element is finished unless the peer dies).
    fn write_chunked(&mut self, py: Python<'_>, plan: &FramePlan<'_>) -> PyResult<()> {
        let total = plan.total_bytes;
        for piece in chunk::pieces(total, self.max_frame) {
            let len = piece.frame_bytes;
            let slot = loop {
                if let Some(slot) = self.ring.try_reserve(len, 64) {
                    break slot;
                }
                let need = self.ring.need_for(len, 64);
                self.wait_space(py, need, None)?;
            };
            let prefix = chunk::prefix(&piece, total, self.next_seq(), self.spec_id);
            let dst = SendPtr(self.ring.slot_ptr(slot));
            py.detach(move || {
                let dst = dst;
                // SAFETY: [slot, slot+len) is reserved for us; the prefix (56 B) and n bytes
                // of the plan fit in len by construction (chunk::pieces).
                unsafe {
                    std::ptr::copy_nonoverlapping(prefix.as_ptr(), dst.0, prefix.len());
                    plan.copy_range(
                        piece.offset,
                        piece.offset + piece.n,
                        dst.0.add(prefix.len()),
                    );
                }
            });
            self.ring.publish();
        }
        Ok(())
    }

    fn write_simple(
        &mut self,
        py: Python<'_>,
        kind: u32,
        body: &[u8],
        deadline: Option<Instant>,
    ) -> PyResult<bool> {
        let mut plan = FramePlan::simple(kind, self.spec_id, body);
        if plan.total_bytes > self.max_frame {
            return Err(Error::ElementTooLarge {
                element_bytes: plan.total_bytes,
                limit_bytes: self.max_frame,
                what: "a spec or error frame must fit the ring's largest frame".into(),
            }
            .into());
        }
        self.write_plan(py, &mut plan, deadline)
    }
}

#[pymethods]
impl PyRingProducer {
    #[new]
    #[pyo3(signature = (capacity_bytes, max_element_bytes = 1u64 << 40))]
    fn new(py: Python<'_>, capacity_bytes: u64, max_element_bytes: u64) -> PyResult<Self> {
        let nonce = random_nonce();
        let mapping = py.detach(|| Mapping::create(capacity_bytes, nonce))?;
        let region: Arc<dyn Region> = mapping.clone();
        let ring = Producer::new(region);
        let max_frame = crate::shm::layout::max_frame_bytes(capacity_bytes);
        use std::os::fd::AsRawFd;
        Ok(PyRingProducer {
            fd: mapping.fd().as_raw_fd(),
            capacity: capacity_bytes,
            nonce,
            _mapping: mapping,
            state: Mutex::new(Some(ProducerState {
                ring,
                encoder: Encoder::default(),
                spec: None,
                spec_id: 0,
                seq: 0,
                peer: Peer::none("consumer"),
                pid: std::process::id(),
                max_frame,
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
        s.peer = Peer::new(control_fd, pid, "consumer")?;
        Ok(())
    }

    /// True while the consumer may be asleep waiting for data.
    fn consumer_waiting(&self) -> PyResult<bool> {
        let g = lock(&self.state, "ring producer")?;
        Ok(g.as_ref().is_some_and(|s| s.ring.consumer_waiting()))
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
        let mut written = 0;
        let mut unpublished = 0u32;
        // Frames reserved but not yet copied: copied together, with one release of the GIL
        // for the batch (not one per element), always before anything is published.
        let mut pending = PendingFrames::default();
        let result = (|| -> PyResult<()> {
            for element in elements.try_iter()? {
                let element = element?;
                let flat = s.encoder.flatten(&element)?;
                if s.spec.as_ref() != Some(&flat.spec) {
                    pending.flush(py, s);
                    let mut spec_bytes = Vec::new();
                    flat.spec.encode(&mut spec_bytes);
                    let mut body = (spec_bytes.len() as u32).to_le_bytes().to_vec();
                    body.extend_from_slice(&spec_bytes);
                    s.spec_id = s.spec_id.wrapping_add(1);
                    if !s.write_simple(py, frame::KIND_SPEC, &body, deadline)? {
                        s.spec_id = s.spec_id.wrapping_sub(1);
                        return Ok(());
                    }
                    s.spec = Some(flat.spec.clone());
                }
                let Flat3 {
                    leaves,
                    holders,
                    objects,
                } = Flat3::from(flat);
                let mut plan = FramePlan::data(s.spec_id, leaves);
                if plan.total_bytes > s.max_element_bytes {
                    return Err(Error::ElementTooLarge {
                        element_bytes: plan.total_bytes,
                        limit_bytes: s.max_element_bytes,
                        what: "max_element_bytes of the shared-memory ring".into(),
                    }
                    .into());
                }
                if plan.total_bytes <= s.max_frame {
                    match s.try_reserve_plan(&mut plan) {
                        Some(slot) => pending.push(plan, slot, holders, objects),
                        None => {
                            // No room now: copy what is pending, then wait as one frame does.
                            pending.flush(py, s);
                            if !s.write_plan(py, &mut plan, deadline)? {
                                return Ok(());
                            }
                        }
                    }
                } else {
                    pending.flush(py, s);
                    s.write_chunked(py, &plan)?;
                }
                written += 1;
                s.elements += 1;
                unpublished += 1;
                if pending.frames.len() >= PENDING_MAX_FRAMES
                    || pending.payload_bytes >= PENDING_MAX_BYTES
                {
                    pending.flush(py, s);
                }
                if (unpublished >= PUBLISH_EVERY_ELEMENTS
                    || s.ring.unpublished_bytes() >= PUBLISH_EVERY_BYTES)
                    && s.ring.consumer_waiting()
                {
                    pending.flush(py, s);
                    s.ring.publish();
                    unpublished = 0;
                }
            }
            Ok(())
        })();
        pending.flush(py, s);
        s.ring.publish();
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
        let deadline = deadline(timeout_ms);
        let mut message = message.to_string();
        let limit = (s.max_frame as usize).saturating_sub(256 + type_name.len());
        if message.len() > limit {
            let mut cut = limit;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        let ok = s.write_simple(
            py,
            frame::KIND_ERROR,
            &frame::error_body(type_name, &message),
            deadline,
        )?;
        s.ring.publish();
        Ok(ok)
    }

    /// Writes the END frame and marks the ring closed. Returns False on timeout.
    #[pyo3(signature = (timeout_ms = None))]
    fn put_end(&self, py: Python<'_>, timeout_ms: Option<u64>) -> PyResult<bool> {
        let mut g = lock(&self.state, "ring producer")?;
        let s = g.as_mut().ok_or_else(|| closed("ring producer"))?;
        let deadline = deadline(timeout_ms);
        let ok = s.write_simple(py, frame::KIND_END, &[], deadline)?;
        if ok {
            s.ring.close();
        }
        Ok(ok)
    }

    /// Counters: elements, bytes published, waits for space, consumer detaches, and
    /// `buffered_bytes` (published but not yet freed by the consumer). Any thread: it
    /// reads only the shared header.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use crate::sync::Ordering::Relaxed;
        let d = PyDict::new(py);
        let h = self._mapping.header();
        let write = h.producer.write_pos.load(Relaxed);
        let read = h.consumer.read_pos.load(Relaxed);
        d.set_item("frames_bytes", h.producer_counters.bytes.load(Relaxed))?;
        d.set_item("bytes", h.producer_counters.bytes.load(Relaxed))?;
        d.set_item("full_waits", h.producer_counters.waits.load(Relaxed))?;
        d.set_item("detaches", h.consumer_counters.detaches.load(Relaxed))?;
        d.set_item("buffered_bytes", write.saturating_sub(read))?;
        if let Ok(g) = self.state.try_lock() {
            if let Some(s) = g.as_ref() {
                d.set_item("elements", s.elements)?;
            }
        }
        Ok(d)
    }

    /// Frees this end (the memory goes once the consumer unmaps too). Idempotent.
    fn close(&self) -> PyResult<()> {
        let mut g = lock(&self.state, "ring producer")?;
        if let Some(mut s) = g.take() {
            s.ring.publish();
        }
        Ok(())
    }
}

/// `Flat` split into its parts (leaves must drop before holders).
/// Frames `put_many` reserved in the ring and has not copied yet, with the buffers their
/// payloads point into (kept alive, and pinned, until the copy).
#[derive(Default)]
struct PendingFrames {
    frames: Vec<(FramePlan<'static>, u64)>,
    holders: Vec<codec::HeldBuffer>,
    objects: Vec<Py<PyAny>>,
    payload_bytes: u64,
}

/// Most frames / payload bytes `put_many` reserves before copying them.
const PENDING_MAX_FRAMES: usize = 64;
const PENDING_MAX_BYTES: u64 = 4 << 20;

impl PendingFrames {
    fn push(
        &mut self,
        plan: FramePlan<'static>,
        slot: u64,
        holders: Vec<codec::HeldBuffer>,
        objects: Vec<Py<PyAny>>,
    ) {
        self.payload_bytes += plan.payload_bytes;
        self.frames.push((plan, slot));
        self.holders.extend(holders);
        self.objects.extend(objects);
    }

    /// Copies every pending frame into its slot (GIL released when they are big enough to
    /// be worth it). Must run before the producer publishes or waits for space.
    fn flush(&mut self, py: Python<'_>, s: &mut ProducerState) {
        if self.frames.is_empty() {
            return;
        }
        let jobs: Vec<(SendPtr, &FramePlan<'static>)> = self
            .frames
            .iter()
            .map(|(plan, slot)| (SendPtr(s.ring.slot_ptr(*slot)), plan))
            .collect();
        let copy = move || {
            for (dst, plan) in jobs {
                // SAFETY: each slot was reserved by `try_reserve_plan` for exactly
                // `plan.total_bytes` (free, inside the data area, disjoint from the others)
                // and nothing is published until this copy is done; payloads are buffers
                // pinned by `self.holders` / `self.objects`, which outlive the copy.
                unsafe { plan.copy_range(0, plan.total_bytes, dst.0) }
            }
        };
        if self.payload_bytes as usize >= PRODUCER_GIL_FREE_COPY_BYTES {
            py.detach(copy);
        } else {
            copy();
        }
        self.frames.clear();
        self.holders.clear();
        self.objects.clear();
        self.payload_bytes = 0;
    }
}

struct Flat3 {
    leaves: Vec<frame::LeafIn<'static>>,
    holders: Vec<codec::HeldBuffer>,
    objects: Vec<Py<PyAny>>,
}

impl From<codec::Flat> for Flat3 {
    fn from(f: codec::Flat) -> Self {
        Flat3 {
            leaves: f.leaves,
            holders: f.holders,
            objects: f.objects,
        }
    }
}

// ------------------------------------------------------------------------------------------
// Consumer
// ------------------------------------------------------------------------------------------

struct ConsumerState {
    ring: Consumer,
    mapping: Arc<Mapping>,
    spec: Option<(u32, DecodeSpec)>,
    expect_seq: u64,
    peer: Peer,
    pid: u32,
    zero_copy: bool,
    copy_threshold: u64,
    max_pinned: u64,
    chunks: Reassembly,
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

    fn handle_spec(&mut self, py: Python<'_>, bytes: &[u8], pos: u64) -> PyResult<()> {
        let header = FrameHeader::parse(bytes)?;
        let mut r = frame::Reader::new(bytes, frame::HEADER_BYTES);
        let n = r.u32()? as usize;
        let spec = Spec::decode(r.bytes(n)?)?;
        let ds = DecodeSpec::new(py, spec, pos)?;
        self.spec = Some((header.spec_id, ds));
        Ok(())
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
            let Some(f) = self.ring.next_frame()? else {
                break;
            };
            let _keep = self.ring.region().clone();
            // SAFETY: next_frame validated [slot, slot+len) inside the data area and below
            // the Acquire-loaded write_pos; `_keep` keeps the mapping alive for this
            // iteration, and the frame is not freed (reclaim push) until we are done reading
            // it (leased views hold their own lease). No detach runs inside drain.
            let bytes: &[u8] =
                unsafe { std::slice::from_raw_parts(self.ring.frame_ptr(&f), f.len as usize) };
            let header = FrameHeader::parse(bytes)?;
            if header.seq != self.expect_seq {
                return Err(corrupted(
                    f.pos,
                    &format!(
                        "frame seq {} where {} was expected",
                        header.seq, self.expect_seq
                    ),
                ));
            }
            self.expect_seq += 1;
            if self.chunks.in_progress() && f.kind != frame::KIND_CHUNK {
                return Err(corrupted(f.pos, "chunked element interrupted"));
            }
            match f.kind {
                frame::KIND_DATA => {
                    self.data_bytes += f.len;
                    let frame_end = f.pos + f.len;
                    // The frame's lease, made at its first leased leaf (copy on pressure:
                    // only while pinned bytes stay under the cap), or None to copy it all.
                    let mut owner: Option<Option<LeaseOwner>> = None;
                    let (zero_copy, threshold, max_pinned) =
                        (self.zero_copy, self.copy_threshold, self.max_pinned);
                    let ring = &mut self.ring;
                    let mut lease = |py: Python<'py>,
                                     d: &frame::LeafDesc,
                                     payload: &[u8]|
                     -> PyResult<Option<Bound<'py, PyLease>>> {
                        if !zero_copy || d.nbytes < threshold {
                            return Ok(None);
                        }
                        let owner = owner.get_or_insert_with(|| {
                            let (pinned_start, _) = ring.reclaim.pinned();
                            (frame_end - pinned_start <= max_pinned)
                                .then(|| LeaseOwner::Frame(Arc::new(ring.lease(frame_end))))
                        });
                        match owner {
                            Some(o) => Ok(Some(Bound::new(
                                py,
                                PyLease::new(o.clone_ref(), payload.as_ptr(), payload.len()),
                            )?)),
                            None => Ok(None),
                        }
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
                    self.handle_spec(py, bytes, f.pos)?;
                    self.ring.mark_free(f.pos + f.len);
                }
                frame::KIND_CHUNK => {
                    self.data_bytes += f.len;
                    let copy = self.chunks.accept(bytes, f.pos)?;
                    py.detach(move || copy.run());
                    if let Some(buf) = self.chunks.finish(header.flags, f.pos)? {
                        let whole = buf.as_slice();
                        let (zero_copy, threshold) = (self.zero_copy, self.copy_threshold);
                        let mut lease =
                            |py: Python<'py>,
                             d: &frame::LeafDesc,
                             payload: &[u8]|
                             -> PyResult<Option<Bound<'py, PyLease>>> {
                                if !zero_copy || d.nbytes < threshold {
                                    return Ok(None);
                                }
                                let owner = LeaseOwner::Heap(buf.clone());
                                let lease = PyLease::new(owner, payload.as_ptr(), payload.len());
                                Ok(Some(Bound::new(py, lease)?))
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
                    let e = frame::parse_error_body(&bytes[frame::HEADER_BYTES..], f.pos)?;
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
///     zero_copy: Hand out numpy leaves >= `copy_threshold_bytes` as views of the ring.
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
                expect_seq: 0,
                peer: Peer::new(control_fd, pid, "producer")?,
                pid: std::process::id(),
                zero_copy,
                copy_threshold: copy_threshold_bytes.max(1),
                max_pinned: (capacity as f64 * fraction) as u64,
                chunks: Reassembly::default(),
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
            s.elements += out.len() as u64;
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
