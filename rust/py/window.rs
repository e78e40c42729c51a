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

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::error::Error;
use crate::py::ring::{dup_fd, random_nonce, PyLease};
use crate::shm::window::{self, Grants, Place, PrivateMap, WindowLog, WindowMap, NO_HOLD};
use crate::transport::codec::{self, DecodeSpec, Encoder, SendPtr};
use crate::transport::frame::{self, FrameHeader, FramePlan, LeafDesc, LeafKind, Spec};

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
    let slot = pos & (cap - 1);
    if slot % 64 != 0 || cap - slot < 64 {
        return Err(corrupted(pos, "frame position is not 64-byte aligned"));
    }
    // SAFETY: [slot, slot + 16) lies inside the data area (checked); the worker wrote the
    // frame before it named it to us and does not reuse it while our grant or hold covers
    // it (shm::window's reclaim protocol); unaligned-safe reads.
    let (word0, total) = unsafe {
        let p = map.data().add(slot as usize);
        (
            std::ptr::read_unaligned(p as *const u32),
            std::ptr::read_unaligned(p.add(8) as *const u64),
        )
    };
    if word0 & 0xFFFF_FF00 != crate::shm::ring::FRAME_MAGIC {
        return Err(corrupted(pos, &format!("bad frame magic {word0:#010x}")));
    }
    if total < 64 || total % 64 != 0 || total > cap - slot {
        return Err(corrupted(
            pos,
            &format!("frame length {total} out of range"),
        ));
    }
    Ok((slot, total, word0 & 0xFF))
}

/// Makes a lease for a leaf, or None to copy it.
type LeaseFn<'a, 'py> =
    dyn FnMut(Python<'py>, &LeafDesc) -> PyResult<Option<Bound<'py, PyLease>>> + 'a;

/// Decodes one DATA frame into an element. `lease(desc)` may return a buffer object for a
/// leaf (a zero-copy view is made of it); None copies the leaf.
fn decode_frame<'py>(
    py: Python<'py>,
    bytes: &[u8],
    pos: u64,
    specs: &HashMap<u32, DecodeSpec>,
    lease: &mut LeaseFn<'_, 'py>,
) -> PyResult<Py<PyAny>> {
    let header = FrameHeader::parse(bytes)?;
    if header.kind != frame::KIND_DATA {
        return Err(corrupted(
            pos,
            &format!("frame kind {} is not DATA", header.kind),
        ));
    }
    let spec = specs
        .get(&header.spec_id)
        .ok_or_else(|| corrupted(pos, &format!("unknown spec id {}", header.spec_id)))?;
    let spec_leaves: Vec<&frame::LeafSpec> = spec.leaves.iter().collect();
    let descs = frame::parse_leaves(bytes, &header, &spec_leaves, pos)?;
    let api = codec::api(py)?;
    let mut vals = Vec::with_capacity(descs.len());
    for (i, d) in descs.iter().enumerate() {
        let payload = &bytes[d.offset as usize..(d.offset + d.nbytes) as usize];
        let v = match d.kind {
            LeafKind::Scalar => {
                let dtype = spec.dtypes[i].as_ref().expect("scalar leaf has a dtype");
                api.frombuffer
                    .bind(py)
                    .call1((PyBytes::new(py, payload), dtype.bind(py)))?
                    .get_item(0)?
                    .unbind()
            }
            LeafKind::Array => match lease(py, d)? {
                Some(buf) => {
                    let dtype = spec.dtypes[i].as_ref().expect("array has dtype");
                    let arr = api.frombuffer.bind(py).call1((buf, dtype.bind(py)))?;
                    arr.call_method1(intern!(py, "reshape"), (PyTuple::new(py, &d.dims)?,))?
                        .unbind()
                }
                None => codec::copy_leaf(py, spec, i, d, payload, pos)?,
            },
            _ => codec::copy_leaf(py, spec, i, d, payload, pos)?,
        };
        vals.push(v);
    }
    spec.build(py, &mut vals.into_iter())
}

// ------------------------------------------------------------------------------------------
// Writer (worker)
// ------------------------------------------------------------------------------------------

struct WriterState {
    map: Arc<WindowMap>,
    log: WindowLog,
    generation: u64,
    encoder: Encoder,
    spec: Option<Spec>,
    spec_id: u32,
    /// Encoded specs by id (sent to trainers that have not seen them).
    spec_bodies: HashMap<u32, Vec<u8>>,
    /// Decoders for the worker's own reads (gRPC trainers), built on first use.
    decode_specs: HashMap<u32, DecodeSpec>,
    abandons: u64,
    grows: u64,
    frames_written: u64,
    bytes_written: u64,
}

impl WriterState {
    /// Moves the window into a fresh segment of `capacity` bytes: the old one is left to
    /// the trainers still holding views into it (their mappings keep it alive). Returns how
    /// many of the oldest cached frames did not fit and were evicted.
    fn migrate(&mut self, py: Python<'_>, capacity: u64) -> PyResult<usize> {
        let fresh = py.detach(|| WindowMap::create(capacity, random_nonce()))?;
        let mut log = WindowLog::new(capacity);
        let old = self.map.clone();
        let mut copies: Vec<(u64, u64, u64)> = Vec::new(); // (from slot, to slot, len)
        let mut evicted = 0;
        for f in self.log.frames() {
            loop {
                match log.try_place(f.len, f.align, NO_HOLD) {
                    Place::Write {
                        pos,
                        slot,
                        pad,
                        pad_slot,
                    } => {
                        if pad > 0 {
                            // SAFETY: try_place put [pad_slot, pad_slot + pad) inside the
                            // fresh data area, which no one else writes or reads yet.
                            unsafe { window::write_pad(fresh.data(), pad_slot, pad) };
                        }
                        copies.push((f.pos & (self.log.capacity() - 1), slot, f.len));
                        log.push(pos, f.len, f.align, f.spec_id);
                        break;
                    }
                    Place::EvictOldest => {
                        log.evict_oldest();
                        evicted += 1;
                    }
                    Place::Held => unreachable!("a fresh segment has no holds"),
                }
            }
        }
        let (src, dst) = (SendPtr(old.data()), SendPtr(fresh.data()));
        py.detach(move || {
            let (src, dst) = (src, dst);
            for (from, to, len) in copies {
                // SAFETY: both ranges are frames inside their data areas (from the logs);
                // the old frames are cached (not reused: we are their only writer) and the
                // fresh segment is not shared yet.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.0.add(from as usize),
                        dst.0.add(to as usize),
                        len as usize,
                    )
                }
            }
        });
        // Frames of a freshly copied window that were evicted in the copy are the oldest:
        // drop as many from the front (the copy evicted them from `log`'s front too).
        self.map = fresh;
        self.log = log;
        self.generation += 1;
        Ok(evicted)
    }
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
        let map = py.detach(|| WindowMap::create(capacity_bytes, random_nonce()))?;
        Ok(PyWindowWriter {
            grants: Arc::new(Grants::default()),
            state: Mutex::new(WriterState {
                log: WindowLog::new(capacity_bytes),
                map,
                generation: 0,
                encoder: Encoder::default(),
                spec: None,
                spec_id: 0,
                spec_bodies: HashMap::new(),
                decode_specs: HashMap::new(),
                abandons: 0,
                grows: 0,
                frames_written: 0,
                bytes_written: 0,
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
        let mut evicted = 0;
        if len > window::max_frame_bytes(s.log.capacity()) {
            let want = (len * 2).next_power_of_two();
            if want > window::MAX_CAPACITY {
                return Err(Error::ElementTooLarge {
                    element_bytes: len,
                    limit_bytes: window::max_frame_bytes(window::MAX_CAPACITY),
                    what: "the cross-trainer cache's shared-memory window".into(),
                }
                .into());
            }
            evicted += s.migrate(py, want)?;
            s.grows += 1;
            self.grants_reset();
        }
        loop {
            // Grants first, then holds: see shm::window (a trainer's hold is stored before
            // the DONE message that clears its grant).
            let held = self.grants.min().min(s.map.min_hold());
            match s.log.try_place(len, align, held) {
                Place::Write {
                    pos,
                    slot,
                    pad,
                    pad_slot,
                } => {
                    if pad > 0 {
                        // SAFETY: try_place proved [pad_slot, pad_slot + pad) free (below
                        // the reclaim limit plus capacity) and inside the data area.
                        unsafe { window::write_pad(s.map.data(), pad_slot, pad) };
                    }
                    let dst = SendPtr(
                        // SAFETY: slot + len <= capacity (try_place).
                        unsafe { s.map.data().add(slot as usize) },
                    );
                    let p = &plan;
                    let copy = move || {
                        let dst = dst;
                        // SAFETY: [slot, slot + len) is free space of the data area (no frame
                        // of the window, no hold, no grant covers it) that only this writer
                        // writes; payloads are buffers pinned by `holders` / `objects`.
                        unsafe { p.copy_range(0, len, dst.0) }
                    };
                    if plan.payload_bytes >= GIL_FREE_COPY_BYTES {
                        py.detach(copy);
                    } else {
                        copy();
                    }
                    drop((holders, objects));
                    s.log.push(pos, len, align, s.spec_id);
                    s.frames_written += 1;
                    s.bytes_written += len;
                    return Ok((evicted, Some(len)));
                }
                Place::EvictOldest if s.log.capacity() < max_capacity => {
                    // The window has not reached its bound: grow instead of evicting.
                    let want = (s.log.capacity() * 2).min(window::MAX_CAPACITY);
                    evicted += s.migrate(py, want)?;
                    s.grows += 1;
                    self.grants_reset();
                }
                Place::EvictOldest => {
                    s.log.evict_oldest();
                    evicted += 1;
                }
                Place::Held => return Ok((evicted, None)),
            }
        }
    }

    /// Evicts the `n` oldest cached frames.
    fn evict(&self, n: usize) -> PyResult<()> {
        let mut g = lock(&self.state, "cache window writer")?;
        for _ in 0..n {
            g.log.evict_oldest();
        }
        Ok(())
    }

    /// Leaves the segment to the trainers holding views into it and moves the window into a
    /// fresh one of the same size. Returns how many of the oldest frames did not fit.
    fn abandon(&self, py: Python<'_>) -> PyResult<usize> {
        let mut g = lock(&self.state, "cache window writer")?;
        let cap = g.log.capacity();
        let evicted = g.migrate(py, cap)?;
        g.abandons += 1;
        self.grants_reset();
        Ok(evicted)
    }

    /// `(generation, pos, spec_ids, reclaim_below)` of the cached frames `offset .. offset + n`
    /// (offsets into the window, oldest first): they are contiguous from `pos` (PADs
    /// between them). `reclaim_below` is the position the writer reaches within its next
    /// quarter of the segment: a hold below it stalls the writer soon.
    fn span(&self, offset: usize, n: usize) -> PyResult<(u64, u64, Vec<u32>, u64)> {
        let g = lock(&self.state, "cache window writer")?;
        let frames = g.log.frames();
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
        let cap = g.log.capacity();
        let reclaim_below = g.log.end_pos().saturating_sub(cap - cap / 4);
        Ok((g.generation, frames[offset].pos, ids, reclaim_below))
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
        let frames: Vec<_> = s.log.frames().range(offset..offset + n).copied().collect();
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
            let slot = f.pos & (s.log.capacity() - 1);
            // SAFETY: the frame is cached (in the log), so only this writer, which we hold
            // locked, could overwrite it; slot + len <= capacity.
            let bytes = unsafe {
                std::slice::from_raw_parts(s.map.data().add(slot as usize), f.len as usize)
            };
            let mut copy = |_: Python<'py>, _: &LeafDesc| Ok(None);
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
        let g = lock(&self.state, "cache window writer")?;
        if let Some(h) = g.map.header().holds.get(slot) {
            h.store(NO_HOLD, Ordering::Release);
        }
        Ok(())
    }

    /// The current segment's memfd (owned by this object; send a copy).
    fn fileno(&self) -> PyResult<RawFd> {
        use std::os::fd::AsRawFd;
        let g = lock(&self.state, "cache window writer")?;
        Ok(g.map.fd().as_raw_fd())
    }

    /// (generation, fd, nonce) of the current segment.
    fn segment<'py>(&self, py: Python<'py>) -> PyResult<(u64, RawFd, Bound<'py, PyBytes>)> {
        use std::os::fd::AsRawFd;
        let g = lock(&self.state, "cache window writer")?;
        Ok((
            g.generation,
            g.map.fd().as_raw_fd(),
            PyBytes::new(py, &g.map.nonce()),
        ))
    }

    #[getter]
    fn capacity_bytes(&self) -> PyResult<u64> {
        Ok(lock(&self.state, "cache window writer")?.log.capacity())
    }

    /// Counters: generation, abandons, grows, frames and bytes written, cached frames, the
    /// window's span in the segment, and the reclaim limit's holders.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = lock(&self.state, "cache window writer")?;
        let d = PyDict::new(py);
        d.set_item("generation", g.generation)?;
        d.set_item("abandons", g.abandons)?;
        d.set_item("grows", g.grows)?;
        d.set_item("capacity_bytes", g.log.capacity())?;
        d.set_item("frames_written", g.frames_written)?;
        d.set_item("bytes_written", g.bytes_written)?;
        d.set_item("cached_frames", g.log.len())?;
        d.set_item("window_span_bytes", g.log.end_pos() - g.log.first_pos())?;
        let hold = g.map.min_hold();
        d.set_item("min_hold", if hold == NO_HOLD { None } else { Some(hold) })?;
        let held: Vec<usize> = (g.map.header().holds.iter().enumerate())
            .filter(|(_, h)| h.load(Ordering::Relaxed) != NO_HOLD)
            .map(|(i, _)| i)
            .collect();
        d.set_item("held_slots", held)?;
        Ok(d)
    }
}

impl PyWindowWriter {
    /// Grants name positions of the segment being replaced; its frames stay readable by
    /// the trainers decoding them (the worker no longer writes there).
    fn grants_reset(&self) {
        for slot in 0..window::HOLD_SLOTS {
            self.grants.clear(slot);
        }
    }
}

// ------------------------------------------------------------------------------------------
// Reader (trainer)
// ------------------------------------------------------------------------------------------

/// A trainer's holds in one segment: how many leased frames start at each position, and
/// the live leaf mappings (to detach them before the holds go).
pub struct HoldTable {
    map: Arc<WindowMap>,
    slot: usize,
    inner: Mutex<HoldInner>,
}

struct HoldInner {
    counts: BTreeMap<u64, u32>,
    leaves: Vec<Weak<WindowLeaf>>,
    /// False once this trainer gave the slot up (closed, or moved to a new segment): its
    /// hold word is no longer its to write.
    active: bool,
}

impl HoldTable {
    fn lock(&self) -> MutexGuard<'_, HoldInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn store_min(&self, g: &HoldInner) {
        if !g.active {
            return;
        }
        let min = g.counts.keys().next().copied().unwrap_or(NO_HOLD);
        if let Some(h) = self.map.header().holds.get(self.slot) {
            // SYNC(hold): Acquire in WindowMap::min_hold.
            h.store(min, Ordering::Release);
        }
    }

    fn acquire(self: &Arc<Self>, pos: u64) -> Arc<FrameHold> {
        let mut g = self.lock();
        *g.counts.entry(pos).or_insert(0) += 1;
        self.store_min(&g);
        Arc::new(FrameHold {
            table: self.clone(),
            pos,
        })
    }

    fn release(&self, pos: u64) {
        let mut g = self.lock();
        if let Some(c) = g.counts.get_mut(&pos) {
            *c -= 1;
            if *c == 0 {
                g.counts.remove(&pos);
            }
        }
        self.store_min(&g);
    }

    /// The lowest held position, if any.
    fn min(&self) -> Option<u64> {
        self.lock().counts.keys().next().copied()
    }

    /// Gives the slot up: every live leaf mapping becomes private anonymous memory (its
    /// views keep their addresses and contents), then the hold word is cleared. Returns the
    /// number of leaves detached.
    fn deactivate(&self) -> usize {
        let leaves: Vec<Arc<WindowLeaf>> = {
            let mut g = self.lock();
            if !g.active {
                return 0;
            }
            g.leaves.drain(..).filter_map(|w| w.upgrade()).collect()
        };
        // Outside the table's lock: dropping a leaf may release a hold (which locks it).
        let n = leaves.iter().filter(|l| l.detach()).count();
        // The detached leaves no longer need their holds, nor (through them) this table's
        // mapping of the whole segment: taking the holds lets the segment go.
        let released: Vec<_> = leaves
            .iter()
            .filter_map(|l| l.hold.lock().unwrap_or_else(|e| e.into_inner()).take())
            .collect();
        let mut g = self.lock();
        g.active = false;
        if let Some(h) = self.map.header().holds.get(self.slot) {
            h.store(NO_HOLD, Ordering::Release);
        }
        drop(g);
        drop(released);
        drop(leaves);
        n
    }

    /// Detaches (copies into private memory) the live leaves of frames below `limit`, the
    /// window's oldest cached frame, and lifts their holds: the writer is about to need
    /// that space, and waiting for this trainer's views would stall everyone. A trainer
    /// that keeps views that long pays for their copy. Returns the number of leaves.
    fn detach_below(&self, limit: u64) -> usize {
        let leaves: Vec<Arc<WindowLeaf>> = {
            let mut g = self.lock();
            if !g.active || g.counts.keys().next().is_none_or(|&m| m >= limit) {
                return 0;
            }
            g.leaves.retain(|w| w.strong_count() > 0);
            g.leaves
                .iter()
                .filter_map(|w| w.upgrade())
                .filter(|l| l.pos < limit && !l.detached.load(Ordering::Acquire))
                .collect()
        };
        let mut released = Vec::new();
        for leaf in &leaves {
            // The hold stays until the copy is done, so the writer cannot overwrite the
            // pages being copied.
            if leaf.detach() {
                if let Some(h) = leaf.hold.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    released.push(h);
                }
            }
        }
        let n = released.len();
        drop(released); // lifts the holds (FrameHold::drop)
        drop(leaves);
        n
    }

    fn track(&self, leaf: &Arc<WindowLeaf>) {
        let mut g = self.lock();
        if g.leaves.len() >= 64 && g.leaves.len().is_power_of_two() {
            g.leaves.retain(|w| w.strong_count() > 0);
        }
        g.leaves.push(Arc::downgrade(leaf));
    }
}

/// One frame's hold; dropped with the last leaf view of the frame.
pub struct FrameHold {
    table: Arc<HoldTable>,
    pos: u64,
}

impl Drop for FrameHold {
    fn drop(&mut self) {
        self.table.release(self.pos);
    }
}

/// A leased leaf: its private mapping, then the frame's hold (fields drop in order, so the
/// pages are unmapped before the hold is lifted).
pub struct WindowLeaf {
    map: PrivateMap,
    /// The frame's position, and its hold (taken away once the leaf is detached).
    pos: u64,
    hold: Mutex<Option<Arc<FrameHold>>>,
    detached: std::sync::atomic::AtomicBool,
}

impl WindowLeaf {
    /// Makes the leaf's pages private anonymous memory (once); true if it did so now.
    fn detach(&self) -> bool {
        if self.detached.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.map.detach().is_ok()
    }
}

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
    let nonce: Option<[u8; 16]> = match nonce {
        Some(n) => Some(n.try_into().map_err(|_| {
            PyErr::from(Error::LayoutMismatch {
                what: "nonce must be 16 bytes".into(),
            })
        })?),
        None => None,
    };
    let map = WindowMap::attach(dup_fd(fd)?, nonce)?;
    let table = Arc::new(HoldTable {
        map: map.clone(),
        slot,
        inner: Mutex::new(HoldInner {
            counts: BTreeMap::new(),
            leaves: Vec::new(),
            active: true,
        }),
    });
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
        if s.pid != std::process::id() {
            return Err(Error::RingState(
                "a cache window reader cannot be used in a forked child".into(),
            )
            .into());
        }
        let out = PyList::empty(py);
        let cap = s.map.capacity();
        let max_pinned = (cap as f64 * s.max_pinned_fraction) as u64;
        let page = crate::shm::segment::page_bytes();
        let detach_limit = reclaim_below;
        let mut p = pos;
        let mut nbytes = 0;
        for i in 0..count {
            let mut pads = 0;
            let (slot, total) = loop {
                let (slot, total, kind) = frame_at(&s.map, p)?;
                if kind == crate::shm::ring::KIND_PAD {
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
                             d: &LeafDesc|
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
                let ptr = pm.ptr();
                let leaf = Arc::new(WindowLeaf {
                    map: pm,
                    pos: frame_pos,
                    hold: Mutex::new(hold.clone()),
                    detached: Default::default(),
                });
                table.track(&leaf);
                leased += 1;
                Ok(Some(Bound::new(
                    py,
                    PyLease::window(leaf, ptr, d.nbytes as usize),
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
