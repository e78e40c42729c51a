//! Python classes `ShmRingProducer`, `ShmRingConsumer` and `RingLease` of `dataservice._core`:
//! the two ends of a shared-memory ring (TRANSPORT.md), over [`crate::shm`] and
//! [`crate::transport`]. Each end is used by one thread at a time (a concurrent call raises
//! `RuntimeError("ring in use")` instead of blocking with the GIL held). Every wait runs in
//! slices of at most 50 ms with the GIL released; between slices the caller's signals are
//! checked (Ctrl-C works) and the peer's liveness (control socket HUP, pidfd).

use std::os::fd::{BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use pyo3::{ffi, intern};

use crate::error::Error;
use crate::shm::ring::{Consumer, Producer, Reclaim, Region, Ticket};
use crate::shm::segment::Mapping;
use crate::transport::codec::{self, DecodeSpec, Encoder, SendPtr};
use crate::transport::frame::{self, FrameHeader, FramePlan, LeafKind, Spec};

const SLICE: Duration = Duration::from_millis(50);
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

pub(crate) fn dup_fd(fd: RawFd) -> PyResult<OwnedFd> {
    // SAFETY: the caller passes an fd it owns and keeps open for this call; we only borrow it
    // to duplicate it (F_DUPFD_CLOEXEC), so ownership of the original stays with the caller.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    rustix::io::fcntl_dupfd_cloexec(borrowed, 3).map_err(|e| {
        PyErr::from(Error::Io {
            op: "duplicating",
            path: format!("fd {fd}"),
            source: e.into(),
        })
    })
}

/// The other end's liveness: its control socket (HUP/ERR once it is gone) and a pidfd of
/// its process (readable once it exits; catches a dead peer whose children hold the socket).
struct Peer {
    socket: Option<OwnedFd>,
    pidfd: Option<OwnedFd>,
    what: &'static str,
}

impl Peer {
    fn new(control_fd: Option<RawFd>, pid: Option<i32>, what: &'static str) -> PyResult<Self> {
        let socket = control_fd.map(dup_fd).transpose()?;
        let pidfd = pid.and_then(|p| {
            rustix::process::Pid::from_raw(p).and_then(|p| {
                rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
            })
        });
        Ok(Peer {
            socket,
            pidfd,
            what,
        })
    }

    /// Some(reason) if the peer is gone.
    fn dead(&self) -> Option<String> {
        use rustix::event::{poll, PollFd, PollFlags};
        if let Some(sock) = &self.socket {
            let mut fds = [PollFd::new(sock, PollFlags::RDHUP)];
            if poll(&mut fds, Some(&rustix::event::Timespec::default())).is_ok() {
                let r = fds[0].revents();
                if r.intersects(
                    PollFlags::HUP | PollFlags::ERR | PollFlags::RDHUP | PollFlags::NVAL,
                ) {
                    return Some(format!("the {} closed its control socket", self.what));
                }
            }
        }
        if let Some(pidfd) = &self.pidfd {
            let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
            if poll(&mut fds, Some(&rustix::event::Timespec::default())).is_ok()
                && fds[0].revents().contains(PollFlags::IN)
            {
                return Some(format!("the {} process exited", self.what));
            }
        }
        None
    }
}

fn check_pid(pid: u32) -> PyResult<()> {
    if std::process::id() != pid {
        return Err(Error::RingState(
            "a ring end cannot be used in a forked child; open a new connection".into(),
        )
        .into());
    }
    Ok(())
}

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

pub(crate) fn random_nonce() -> [u8; 16] {
    let mut n = [0u8; 16];
    if rustix::rand::getrandom(&mut n, rustix::rand::GetRandomFlags::empty()).is_err() {
        let t = Instant::now().elapsed().as_nanos() ^ u128::from(std::process::id());
        n = t.to_le_bytes();
    }
    n
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
            let slice = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(false);
                    }
                    (d - now).min(SLICE)
                }
                None => SLICE,
            };
            let ring = &mut self.ring;
            if py.detach(|| ring.wait_for_space(need, slice)) {
                return Ok(true);
            }
            py.check_signals()?;
            if let Some(why) = self.peer.dead() {
                return Err(Error::PeerDied { what: why }.into());
            }
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
        let chunk_data = ((self.max_frame - frame::CHUNK_PREFIX_BYTES as u64) / 64) * 64;
        let total = plan.total_bytes;
        let mut off = 0u64;
        while off < total {
            let n = chunk_data.min(total - off);
            let len = crate::shm::ring::frame_len(frame::CHUNK_PREFIX_BYTES as u64 + n);
            let slot = loop {
                if let Some(slot) = self.ring.try_reserve(len, 64) {
                    break slot;
                }
                let need = self.ring.need_for(len, 64);
                self.wait_space(py, need, None)?;
            };
            let mut flags = 0;
            if off == 0 {
                flags |= frame::CHUNK_FIRST;
            }
            if off + n == total {
                flags |= frame::CHUNK_LAST;
            }
            let header = FrameHeader {
                kind: frame::KIND_CHUNK,
                flags,
                total_bytes: len,
                seq: self.next_seq(),
                spec_id: self.spec_id,
                n_leaves: 0,
            };
            let mut prefix = header.to_bytes().to_vec();
            prefix.extend_from_slice(&total.to_le_bytes());
            prefix.extend_from_slice(&off.to_le_bytes());
            prefix.extend_from_slice(&n.to_le_bytes());
            let dst = SendPtr(self.ring.slot_ptr(slot));
            py.detach(move || {
                let dst = dst;
                // SAFETY: [slot, slot+len) is reserved for us; the prefix (56 B) and n bytes
                // of the plan fit in len by construction.
                unsafe {
                    std::ptr::copy_nonoverlapping(prefix.as_ptr(), dst.0, prefix.len());
                    plan.copy_range(off, off + n, dst.0.add(prefix.len()));
                }
            });
            self.ring.publish();
            off += n;
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
                peer: Peer {
                    socket: None,
                    pidfd: None,
                    what: "consumer",
                },
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
        check_pid(s.pid)?;
        let deadline = timeout_ms.map(|t| Instant::now() + Duration::from_millis(t));
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
        let deadline = timeout_ms.map(|t| Instant::now() + Duration::from_millis(t));
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
        let deadline = timeout_ms.map(|t| Instant::now() + Duration::from_millis(t));
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
// Leases
// ------------------------------------------------------------------------------------------

/// Keeps one ring frame from being reused while views into it live.
struct FrameLease {
    reclaim: Arc<Reclaim>,
    ticket: Ticket,
    _region: Arc<dyn Region>,
}

impl Drop for FrameLease {
    fn drop(&mut self) {
        self.reclaim.release(self.ticket);
    }
}

/// Private memory holding a reassembled chunked element.
struct HeapBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain heap memory; writes only through views handed to numpy (the Python
// program's own data race, as with any numpy array).
unsafe impl Send for HeapBuf {}
// SAFETY: as above.
unsafe impl Sync for HeapBuf {}

impl HeapBuf {
    /// `len` (> 0) zeroed bytes, or None if they cannot be allocated. Zeroed by the
    /// allocator (`calloc`: fresh pages of a big allocation are not touched), so a chunked
    /// element's declared size costs address space only, and memory only as its chunks
    /// arrive: a first chunk that declares far more than ever follows does not make this
    /// process write (and keep resident) that many zeros.
    fn new(len: usize) -> Option<Self> {
        let layout = std::alloc::Layout::array::<u8>(len).ok()?;
        if len == 0 {
            return None;
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return None;
        }
        Some(HeapBuf { ptr, len })
    }
    fn slice(&self) -> &[u8] {
        // SAFETY: ptr/len is our own live allocation.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for HeapBuf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::array::<u8>(self.len).expect("checked in new()");
        // SAFETY: ptr came from alloc_zeroed with this layout in new().
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

enum LeaseOwner {
    Frame(#[allow(dead_code)] Arc<FrameLease>),
    Heap(#[allow(dead_code)] Arc<HeapBuf>),
    /// A leaf of the cross-trainer cache's window segment (`py::window`).
    Window(#[allow(dead_code)] Arc<crate::py::window::WindowLeaf>),
}

/// A writable buffer over one leaf of a ring frame (or of a reassembled element); numpy
/// views made from it keep it, and so the frame, alive. Frozen; any thread.
#[pyclass(name = "RingLease", module = "dataservice._core", frozen)]
pub struct PyLease {
    _owner: LeaseOwner,
    ptr: usize,
    len: usize,
}

impl PyLease {
    /// A lease over a window leaf's private mapping: `len` bytes at `ptr`, which the leaf
    /// keeps mapped.
    pub(crate) fn window(
        leaf: Arc<crate::py::window::WindowLeaf>,
        ptr: *mut u8,
        len: usize,
    ) -> Self {
        PyLease {
            _owner: LeaseOwner::Window(leaf),
            ptr: ptr as usize,
            len,
        }
    }
}

#[pymethods]
impl PyLease {
    /// # Safety
    /// Called by CPython with a valid `view`.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: std::ffi::c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        // SAFETY: view is valid (CPython's duty); ptr/len stay valid while `slf` lives, and
        // PyBuffer_FillInfo takes a reference to slf for the view's life. Writable: a
        // consumer writing into its own frame cannot harm the protocol (TRANSPORT.md §5).
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                this.ptr as *mut std::ffi::c_void,
                this.len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::take(slf.py())
                .unwrap_or_else(|| PyBufferError::new_err("buffer request refused")));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.len
    }
}

// ------------------------------------------------------------------------------------------
// Consumer
// ------------------------------------------------------------------------------------------

struct Chunks {
    buf: Arc<HeapBuf>,
    filled: u64,
}

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
    chunks: Option<Chunks>,
    /// An ERROR frame's (type, message), reported after the elements before it.
    error: Option<(String, String)>,
    end: bool,
    elements: u64,
    leased: u64,
    detaches: u64,
    /// Frame bytes of the elements decoded since the last `get_many` returned.
    data_bytes: u64,
}

/// A decoded leaf, or a numpy scalar still in its column.
enum Val {
    Obj(Py<PyAny>),
    Col(usize),
}

struct Batch {
    /// Per element: its leaves.
    elements: Vec<Vec<Val>>,
    /// Per spec leaf: raw scalar bytes, and the next row to hand out.
    columns: Vec<Vec<u8>>,
}

impl ConsumerState {
    fn take_bytes(&mut self) -> u64 {
        std::mem::take(&mut self.data_bytes)
    }

    fn flush_free(&mut self) {
        self.ring.flush_free();
    }

    fn mark_free(&mut self, end: u64) {
        self.ring.mark_free(end);
    }

    fn corrupted(pos: u64, what: &str) -> PyErr {
        Error::RingCorrupted {
            pos,
            what: what.to_string(),
        }
        .into()
    }

    /// Turns the batch's pending elements into Python objects, appending to `out`.
    fn flush_batch(
        &mut self,
        py: Python<'_>,
        batch: &mut Batch,
        out: &Bound<'_, PyList>,
    ) -> PyResult<()> {
        if batch.elements.is_empty() {
            return Ok(());
        }
        let Some((_, spec)) = &self.spec else {
            return Err(Self::corrupted(
                self.ring.next_read(),
                "data before any spec",
            ));
        };
        let api = codec::api(py)?;
        let mut cols: Vec<Option<Vec<Py<PyAny>>>> = Vec::with_capacity(batch.columns.len());
        for (i, col) in batch.columns.iter().enumerate() {
            if col.is_empty() {
                cols.push(None);
                continue;
            }
            let dtype = spec.dtypes[i].as_ref().expect("scalar leaf has a dtype");
            let arr = api
                .frombuffer
                .bind(py)
                .call1((PyBytes::new(py, col), dtype.bind(py)))?;
            let items: Vec<Py<PyAny>> = arr
                .try_iter()?
                .map(|x| x.map(|x| x.unbind()))
                .collect::<PyResult<_>>()?;
            cols.push(Some(items));
        }
        let mut rows = vec![0usize; cols.len()];
        for leaves in batch.elements.drain(..) {
            let mut vals = Vec::with_capacity(leaves.len());
            for v in leaves {
                vals.push(match v {
                    Val::Obj(o) => o,
                    Val::Col(i) => {
                        let col = cols[i].as_ref().expect("column filled");
                        let o = col[rows[i]].clone_ref(py);
                        rows[i] += 1;
                        o
                    }
                });
            }
            let element = if matches!(spec.spec, Spec::Leaf(_)) {
                vals.pop().expect("one leaf")
            } else {
                spec.build(py, &mut vals.into_iter())?
            };
            out.append(element)?;
        }
        for c in batch.columns.iter_mut() {
            c.clear();
        }
        Ok(())
    }

    /// Decodes the DATA frame `bytes` into the batch. `lease` makes a view's owner if the
    /// frame's large leaves may be leased (None: copy everything).
    fn decode_data(
        &mut self,
        py: Python<'_>,
        bytes: &[u8],
        pos: u64,
        batch: &mut Batch,
        lease: &mut dyn FnMut(&mut Self) -> Option<LeaseOwnerRef>,
    ) -> PyResult<()> {
        let header = FrameHeader::parse(bytes)?;
        let (spec_id, spec) = match &self.spec {
            Some((id, s)) => (*id, s),
            None => return Err(Self::corrupted(pos, "data frame before any spec")),
        };
        if header.spec_id != spec_id {
            return Err(Self::corrupted(pos, "data frame names an unknown spec"));
        }
        let spec_leaves: Vec<&frame::LeafSpec> = spec.leaves.iter().collect();
        let descs = frame::parse_leaves(bytes, &header, &spec_leaves, pos)?;
        if batch.columns.len() != spec.leaves.len() {
            batch.columns = vec![Vec::new(); spec.leaves.len()];
        }
        let mut owner: Option<LeaseOwnerRef> = None;
        let mut vals = Vec::with_capacity(descs.len());
        let wants_lease = self.zero_copy
            && descs
                .iter()
                .any(|d| d.kind == LeafKind::Array && d.nbytes >= self.copy_threshold);
        if wants_lease {
            owner = lease(self);
        }
        let spec = &self.spec.as_ref().expect("checked").1;
        for (i, d) in descs.iter().enumerate() {
            let payload = &bytes[d.offset as usize..(d.offset + d.nbytes) as usize];
            match d.kind {
                LeafKind::Scalar => {
                    batch.columns[i].extend_from_slice(payload);
                    vals.push(Val::Col(i));
                }
                LeafKind::Array if d.nbytes >= self.copy_threshold && owner.is_some() => {
                    let lease = PyLease {
                        _owner: owner.as_ref().expect("checked").make(),
                        ptr: payload.as_ptr() as usize,
                        len: payload.len(),
                    };
                    let api = codec::api(py)?;
                    let dtype = spec.dtypes[i].as_ref().expect("array has dtype");
                    let arr = api
                        .frombuffer
                        .bind(py)
                        .call1((Bound::new(py, lease)?, dtype.bind(py)))?;
                    let arr =
                        arr.call_method1(intern!(py, "reshape"), (PyTuple::new(py, &d.dims)?,))?;
                    self.leased += 1;
                    vals.push(Val::Obj(arr.unbind()));
                }
                _ => vals.push(Val::Obj(codec::copy_leaf(py, spec, i, d, payload, pos)?)),
            }
        }
        batch.elements.push(vals);
        Ok(())
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
    fn drain(&mut self, py: Python<'_>, max: usize, out: &Bound<'_, PyList>) -> PyResult<bool> {
        let mut batch = Batch {
            elements: Vec::new(),
            columns: Vec::new(),
        };
        let mut stop = false;
        while out.len() + batch.elements.len() < max {
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
                return Err(Self::corrupted(
                    f.pos,
                    &format!(
                        "frame seq {} where {} was expected",
                        header.seq, self.expect_seq
                    ),
                ));
            }
            self.expect_seq += 1;
            if self.chunks.is_some() && f.kind != frame::KIND_CHUNK {
                return Err(Self::corrupted(f.pos, "chunked element interrupted"));
            }
            match f.kind {
                frame::KIND_DATA => {
                    self.data_bytes += f.len;
                    let frame_end = f.pos + f.len;
                    let mut leased = false;
                    let region = self.ring.region().clone();
                    let mut lease_fn = |s: &mut ConsumerState| -> Option<LeaseOwnerRef> {
                        // Copy on pressure: lease only while pinned bytes stay under the cap.
                        let (pinned_start, _) = s.ring.reclaim.pinned();
                        if frame_end - pinned_start > s.max_pinned {
                            return None;
                        }
                        let ticket = s.ring.push_leased(frame_end);
                        leased = true;
                        Some(LeaseOwnerRef::Frame(Arc::new(FrameLease {
                            reclaim: s.ring.reclaim.clone(),
                            ticket,
                            _region: region.clone(),
                        })))
                    };
                    let r = self.decode_data(py, bytes, f.pos, &mut batch, &mut lease_fn);
                    if !leased {
                        self.mark_free(frame_end);
                    }
                    r?;
                }
                frame::KIND_SPEC => {
                    self.flush_batch(py, &mut batch, out)?;
                    self.handle_spec(py, bytes, f.pos)?;
                    self.mark_free(f.pos + f.len);
                }
                frame::KIND_CHUNK => {
                    self.data_bytes += f.len;
                    self.handle_chunk(py, bytes, &header, f.pos, &mut batch)?;
                    self.mark_free(f.pos + f.len);
                }
                frame::KIND_END => {
                    self.mark_free(f.pos + f.len);
                    self.end = true;
                    stop = true;
                    break;
                }
                frame::KIND_ERROR => {
                    let e = frame::parse_error_body(&bytes[frame::HEADER_BYTES..], f.pos)?;
                    self.mark_free(f.pos + f.len);
                    self.error = Some(e);
                    stop = true;
                    break;
                }
                _ => {
                    return Err(Self::corrupted(
                        f.pos,
                        &format!("unknown frame kind {}", f.kind),
                    ))
                }
            }
        }
        self.flush_batch(py, &mut batch, out)?;
        self.flush_free();
        Ok(stop)
    }

    fn handle_chunk(
        &mut self,
        py: Python<'_>,
        bytes: &[u8],
        header: &FrameHeader,
        pos: u64,
        batch: &mut Batch,
    ) -> PyResult<()> {
        let mut r = frame::Reader::new(bytes, frame::HEADER_BYTES);
        let total = r.u64()?;
        let off = r.u64()?;
        let n = r.u64()? as usize;
        // Bounded by the frame (Reader::bytes checks), so a garbage length is an error.
        let data = r.bytes(n)?;
        if header.flags & frame::CHUNK_FIRST != 0 {
            if self.chunks.is_some() || off != 0 {
                return Err(Self::corrupted(pos, "unexpected first chunk"));
            }
            if total < 64 || total % 64 != 0 || total > (1 << 44) {
                return Err(Self::corrupted(pos, "chunked element size out of range"));
            }
            let buf = HeapBuf::new(total as usize).ok_or_else(|| Error::ElementTooLarge {
                element_bytes: total,
                limit_bytes: 0,
                what: "cannot allocate memory to reassemble a chunked element".into(),
            })?;
            self.chunks = Some(Chunks {
                buf: Arc::new(buf),
                filled: 0,
            });
        }
        let Some(ch) = self.chunks.as_mut() else {
            return Err(Self::corrupted(pos, "chunk without a first chunk"));
        };
        if off != ch.filled || ch.buf.len as u64 != total || off + n as u64 > total {
            return Err(Self::corrupted(pos, "chunk out of order"));
        }
        let dst = SendPtr(ch.buf.ptr);
        let src = SendPtr(data.as_ptr() as *mut u8);
        py.detach(move || {
            let (dst, src) = (dst, src);
            // SAFETY: [off, off+n) lies inside the private buffer (checked); src is n
            // validated bytes of the current frame.
            unsafe { std::ptr::copy_nonoverlapping(src.0, dst.0.add(off as usize), n) }
        });
        ch.filled += n as u64;
        if header.flags & frame::CHUNK_LAST != 0 {
            if ch.filled != total {
                return Err(Self::corrupted(
                    pos,
                    "last chunk before the element is complete",
                ));
            }
            let ch = self.chunks.take().expect("checked");
            let buf = ch.buf.clone();
            let whole: &[u8] = {
                let s = buf.slice();
                // SAFETY: the buffer lives in `buf` (and in every lease made from it).
                unsafe { std::slice::from_raw_parts(s.as_ptr(), s.len()) }
            };
            if FrameHeader::parse(whole)?.total_bytes != total {
                return Err(Self::corrupted(pos, "chunked frame length mismatch"));
            }
            let mut lease = |_: &mut ConsumerState| Some(LeaseOwnerRef::Heap(buf.clone()));
            self.decode_data(py, whole, pos, batch, &mut lease)?;
        }
        Ok(())
    }

    /// The stall breaker (TRANSPORT.md §5): the producer waits for space held by leases
    /// while we have nothing to read, so copy the pinned pages away and free them.
    fn detach(&mut self, py: Python<'_>) -> PyResult<()> {
        let (start, end) = self.ring.reclaim.pinned();
        if end <= start {
            return Ok(());
        }
        let cap = self.ring.capacity();
        let slot = start & (cap - 1);
        let len = end - start;
        let mapping = self.mapping.clone();
        let fresh = py.detach(move || -> Result<Arc<Mapping>, Error> {
            // SAFETY: [start, end) is handed out to us (the producer does not write it until
            // read_pos passes it, which happens only below), and we never use this mapping
            // for ring traffic again (the fresh mapping replaces it).
            unsafe {
                if slot + len <= cap {
                    mapping.privatize(slot, len)?;
                } else {
                    mapping.privatize(slot, cap - slot)?;
                    mapping.privatize(0, len - (cap - slot))?;
                }
            }
            mapping.remap()
        })?;
        self.mapping = fresh.clone();
        self.ring.set_region(fresh);
        self.ring.reclaim.detach_all(self.ring.next_read());
        self.detaches += 1;
        Ok(())
    }
}

enum LeaseOwnerRef {
    Frame(Arc<FrameLease>),
    Heap(Arc<HeapBuf>),
}

impl LeaseOwnerRef {
    fn make(&self) -> LeaseOwner {
        match self {
            LeaseOwnerRef::Frame(f) => LeaseOwner::Frame(f.clone()),
            LeaseOwnerRef::Heap(h) => LeaseOwner::Heap(h.clone()),
        }
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
        let nonce: Option<[u8; 16]> = match nonce {
            Some(n) => Some(n.try_into().map_err(|_| {
                PyErr::from(Error::LayoutMismatch {
                    what: "nonce must be 16 bytes".into(),
                })
            })?),
            None => None,
        };
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
                chunks: None,
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
        check_pid(s.pid)?;
        let out = PyList::empty(py);
        let max = max_elements.max(1);
        let deadline = timeout_ms.map(|t| Instant::now() + Duration::from_millis(t));
        let mut stalled_since: Option<Instant> = None;
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
            if pinned_end > pinned_start && s.ring.producer_waiting() {
                let since = *stalled_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= Duration::from_millis(2) {
                    s.detach(py)?;
                    stalled_since = None;
                    continue;
                }
            } else {
                stalled_since = None;
            }
            let slice = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok((out, s.take_bytes(), false, None));
                    }
                    (d - now).min(SLICE)
                }
                None => SLICE,
            };
            let slice = if pinned_end > pinned_start {
                slice.min(Duration::from_millis(2))
            } else {
                slice
            };
            let ring = &mut s.ring;
            if py.detach(|| ring.wait_for_data(slice)) {
                continue;
            }
            py.check_signals()?;
            if let Some(why) = s.peer.dead() {
                if s.ring.has_data() {
                    continue; // drain what was published before the death
                }
                return Err(Error::PeerDied { what: why }.into());
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Resident bytes of this process (`/proc/self/statm`, pages).
    fn resident_bytes() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        pages * 4096
    }

    #[test]
    fn chunk_reassembly_buffer_costs_memory_only_as_it_is_written() {
        // A first CHUNK may declare up to 16 TiB; the buffer for a 1 GiB claim must not
        // be written (made resident) before chunks arrive: zeroing it with a memset would
        // add 1 GiB of RSS here.
        let before = resident_bytes();
        let buf = HeapBuf::new(1 << 30).expect("1 GiB of address space");
        let grown = resident_bytes().saturating_sub(before);
        assert!(grown < 64 << 20, "RSS grew by {grown} bytes");
        let s = buf.slice();
        assert_eq!(s.len(), 1 << 30);
        assert!([0usize, 4096, 1 << 29, (1 << 30) - 1]
            .iter()
            .all(|&i| s[i] == 0));
        drop(buf);
        assert!(HeapBuf::new(0).is_none());
        // More than any address space: refused, not a crash.
        assert!(HeapBuf::new(usize::MAX / 2).is_none());
    }
}
