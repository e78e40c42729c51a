//! SPSC byte ring over any byte region (a shared mapping, or a heap buffer under loom).
//!
//! Invariant: `read_pos <= write_pos <= read_pos + capacity`; positions are monotonic u64
//! byte counts that never wrap (`slot = pos & (capacity - 1)`). Bytes in
//! `[read_pos, write_pos)` belong to the consumer, the rest to the producer. Frames start
//! 64-byte aligned and never straddle the end: a frame that does not fit before the end is
//! preceded by a PAD frame over the remainder (always >= 64 B, since both are multiples of
//! 64), so every frame is one contiguous range a numpy view can alias.
//!
//! Who may call what: one [`Producer`] (one thread at a time) and one [`Consumer`] (one
//! thread at a time) per ring; [`Reclaim`] is the consumer's lease table, callable from any
//! thread of the consumer's process.
//!
//! Atomics protocol (each Release store and its Acquire load share a SYNC tag):
//! - SYNC(published): producer writes frame bytes with plain stores, then
//!   `write_pos.store(Release)`; the consumer's `write_pos.load(Acquire)` makes those bytes
//!   visible before it reads them.
//! - SYNC(freed): consumer finishes reading (or copying out of) a frame, then
//!   `read_pos.store(Release)`; the producer's `read_pos.load(Acquire)` orders its later
//!   overwrite after those reads.
//! - SYNC(eventcount): a side about to sleep reads `futex.seq`, sets its `waiting` flag,
//!   `fence(SeqCst)`, re-checks the ring, then futex-waits on `seq`. The other side stores its
//!   cursor, `fence(SeqCst)`, loads the flag and, if set, bumps `seq` and wakes. The two SeqCst
//!   fences make "the waker saw the flag" or "the sleeper saw the new cursor" unavoidable; the
//!   kernel's compare-and-sleep on `seq` closes the rest (a bump between the load of `seq`
//!   and the wait makes the wait return at once).
//!
//! A crashed peer leaves only its half-written bytes beyond `write_pos` (never published) or
//! a stale `read_pos`; nothing is locked, so the survivor drains what was published and stops.

use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
use crate::shm::layout::{RingHeader, FRAME_ALIGN};
use crate::sync::{fence, spin_loop, Mutex, MutexGuard, Ordering, Woken};

/// PAD bytes to write at data-area offset `slot` before a frame of `len` bytes aligned
/// to `align`, in a data area of `cap` bytes: up to the end when the frame would
/// straddle it (frames never wrap), else up to the next `align` boundary (to the end
/// if the aligned frame would straddle). Shared by the ring and the cache window.
pub(crate) fn pad_before(slot: u64, len: u64, align: u64, cap: u64) -> u64 {
    if slot + len > cap {
        cap - slot
    } else if align > FRAME_ALIGN && slot % align != 0 {
        let aligned = slot.next_multiple_of(align);
        if aligned + len > cap {
            cap - slot
        } else {
            aligned - slot
        }
    } else {
        0
    }
}

/// Frame-header words the ring itself reads (the rest is `transport::frame`'s).
pub const FRAME_MAGIC: u32 = 0xD5 << 8;
pub const KIND_PAD: u32 = 2;
/// Smallest frame: the 32-B header rounded to `FRAME_ALIGN`.
pub const MIN_FRAME: u64 = 64;

/// Storage of one ring: the header and `capacity` data bytes, alive while the value is.
///
/// # Safety
/// `header()` and `data()` must stay valid (and `data()..data()+capacity()` mapped and
/// writeable) for the value's whole life; `capacity()` must equal the header's.
pub unsafe trait Region: Send + Sync {
    fn header(&self) -> &RingHeader;
    fn data(&self) -> *mut u8;
    fn capacity(&self) -> u64;

    /// Data-area bytes, from the start, whose memory is allocated (all of a region that
    /// does not grow).
    fn reserved_bytes(&self) -> u64 {
        self.capacity()
    }

    /// Allocates the data area up to at least `end` bytes (a segment allocated in parts,
    /// `Segment::reserve`); the producer calls it before writing past `reserved_bytes`.
    fn reserve(&self, end: u64) -> Result<(), Error> {
        let _ = end;
        Ok(())
    }
}

/// Bytes needed for a frame of `len` bytes, rounded to the frame alignment.
#[inline]
pub fn frame_len(len: u64) -> u64 {
    len.div_ceil(FRAME_ALIGN) * FRAME_ALIGN
}

fn write_pad(data: *mut u8, slot: u64, len: u64) {
    let word0 = FRAME_MAGIC | KIND_PAD;
    // SAFETY: the producer owns [slot, slot + len) (checked free by its caller) and len >= 64,
    // so the 16 header bytes lie inside the data area; unaligned-safe writes.
    unsafe {
        let p = data.add(slot as usize);
        std::ptr::write_unaligned(p as *mut u32, word0);
        std::ptr::write_unaligned(p.add(4) as *mut u32, 0);
        std::ptr::write_unaligned(p.add(8) as *mut u64, len);
    }
}

/// The producer end. Thread-compatible: one thread at a time.
pub struct Producer {
    region: Arc<dyn Region>,
    cap: u64,
    /// Position after the last reserved frame (published or not).
    write: u64,
    /// Last `write_pos` stored.
    published: u64,
    /// Last `read_pos` seen (a lower bound of the real one).
    cached_read: u64,
    /// The region's `reserved_bytes` as of the last reserve (only this producer grows it).
    reserved: u64,
    /// Why allocating more of the region failed, once it did: from then on the ring runs
    /// within the `reserved` bytes it has (`try_reserve`).
    capped: Option<Error>,
}

impl Producer {
    pub fn new(region: Arc<dyn Region>) -> Self {
        let cap = region.capacity();
        let write = region.header().producer.write_pos.load(Ordering::Relaxed);
        Producer {
            reserved: region.reserved_bytes(),
            capped: None,
            region,
            cap,
            write,
            published: write,
            cached_read: write.saturating_sub(cap),
        }
    }

    pub fn region(&self) -> &Arc<dyn Region> {
        &self.region
    }

    pub fn capacity(&self) -> u64 {
        self.cap
    }

    fn hdr(&self) -> &RingHeader {
        self.region.header()
    }

    fn free_bytes(&mut self, need: u64) -> u64 {
        // Saturating: a consumer is not trusted either. If its read_pos ever went backwards
        // (a bug, or a dying process), the producer only stalls; it never writes beyond
        // what it was once told is free (cached_read only grows).
        let mut free = (self.cached_read + self.cap).saturating_sub(self.write);
        if free < need {
            // SYNC(freed): Release in Reclaim::store_read_pos_locked.
            let read = self.hdr().consumer.read_pos.load(Ordering::Acquire);
            if read <= self.write {
                self.cached_read = self.cached_read.max(read);
            }
            free = (self.cached_read + self.cap).saturating_sub(self.write);
        }
        free
    }

    /// Reserves a frame of `len` bytes (a multiple of 64, at most capacity/2) and returns
    /// its slot, or None if the ring has no room now. If the frame would straddle the end
    /// (or `align` > 64 and the slot is not aligned), PAD frames fill the gap first.
    ///
    /// On the first lap of a region allocated in parts, the memory under the frame is
    /// allocated first (up to `storage_end`; a caller that must not block here allocates
    /// it beforehand, without its lock, and hands the outcome to
    /// [`Producer::after_reserve`]). Should allocating fail, the ring runs on within the
    /// memory it has: a PAD over the rest of the lap, and the frame at the start (the
    /// consumer skips PADs, as at any lap's end), so a worker short of memory serves on,
    /// only with less buffered.
    ///
    /// Raises `ShmExhausted` when allocating failed and the frame cannot fit the memory
    /// the ring has (nothing reserved).
    pub fn try_reserve(&mut self, len: u64, align: u64) -> Result<Option<u64>, Error> {
        debug_assert!(len % FRAME_ALIGN == 0 && len >= MIN_FRAME && len <= self.cap / 2);
        let slot = self.write & (self.cap - 1);
        let mut pad = pad_before(slot, len, align, self.cap);
        let end = self.storage_end(len, align);
        if end > self.reserved && self.capped.is_none() {
            let reserved = self.region.reserve(end);
            self.after_reserve(reserved);
        }
        if end > self.reserved {
            // Allocating failed: restart the lap at slot 0, which needs `len` bytes of
            // this lap read (`slot >= len`), and the next PAD's header room after it.
            // `slot + MIN_FRAME <= reserved` holds: every frame left that much after it.
            if slot < len || len + MIN_FRAME > self.reserved {
                let err = self.capped.clone().unwrap_or(Error::ShmExhausted {
                    requested_bytes: end,
                    available_bytes: self.reserved,
                    source: std::io::Error::other("ring memory not allocated"),
                });
                return Err(err);
            }
            pad = self.cap - slot;
        }
        if self.free_bytes(pad + len) < pad + len {
            return Ok(None);
        }
        if pad > 0 {
            write_pad(self.region.data(), slot, pad);
            self.write += pad;
        }
        let slot = self.write & (self.cap - 1);
        self.write += len;
        Ok(Some(slot))
    }

    /// Data-area bytes, from the start, that must be allocated before the next frame of
    /// `len` (aligned to `align`) is written: its end, plus a PAD header's room after it
    /// (so a lap can always be cut short there, `try_reserve`), at most the capacity.
    pub fn storage_end(&self, len: u64, align: u64) -> u64 {
        let slot = self.write & (self.cap - 1);
        let pad = pad_before(slot, len, align, self.cap);
        let frame_slot = (self.write + pad) & (self.cap - 1);
        (frame_slot + len + MIN_FRAME).min(self.cap)
    }

    /// True when the next frame of `len` would first have to allocate ring memory (never
    /// once allocating failed: the ring runs within what it has).
    pub fn needs_storage(&self, len: u64, align: u64) -> bool {
        self.capped.is_none() && self.storage_end(len, align) > self.reserved
    }

    /// Takes in the outcome of a `Region::reserve` for the next frame (run by
    /// `try_reserve`, or by a caller that released its lock for it): the memory now
    /// allocated, and on failure that the ring runs within it from now on.
    pub fn after_reserve(&mut self, result: Result<(), Error>) {
        if let (None, Err(err)) = (&self.capped, result) {
            self.capped = Some(err);
        }
        self.reserved = self.region.reserved_bytes();
    }

    /// Pointer to `slot` in the data area; only `[slot, slot+len)` of a frame just reserved
    /// may be written through it.
    pub fn slot_ptr(&self, slot: u64) -> *mut u8 {
        debug_assert!(slot < self.cap);
        // SAFETY: slot < capacity, inside the region's data area.
        unsafe { self.region.data().add(slot as usize) }
    }

    /// Frames reserved but not yet published.
    pub fn unpublished(&self) -> bool {
        self.write != self.published
    }

    /// Makes every reserved frame visible to the consumer and wakes it if it sleeps.
    pub fn publish(&mut self) {
        if self.write == self.published {
            return;
        }
        let hdr = self.region.header();
        hdr.producer_counters
            .bytes
            .fetch_add(self.write - self.published, Ordering::Relaxed);
        // SYNC(published): Acquire in Consumer::next_frame.
        hdr.producer.write_pos.store(self.write, Ordering::Release);
        self.published = self.write;
        // SYNC(eventcount): pairs with the fence in Consumer::wait_for_data.
        fence(Ordering::SeqCst);
        if hdr.consumer.waiting.load(Ordering::Relaxed) != 0 {
            hdr.producer.data.bump_and_wake();
        }
    }

    /// Bytes reserved and written but not yet published.
    pub fn unpublished_bytes(&self) -> u64 {
        self.write - self.published
    }

    /// True while the consumer may be asleep waiting for data (a cheap load): a batching
    /// producer flushes at once then.
    pub fn consumer_waiting(&self) -> bool {
        self.hdr().consumer.waiting.load(Ordering::Relaxed) != 0
    }

    /// Waits up to `slice` for `need` bytes (frame plus any PAD) to be free: spins briefly,
    /// then sleeps on the shared futex. Returns true if they are free.
    pub fn wait_for_space(&mut self, need: u64, slice: Duration) -> bool {
        for _ in 0..SPIN_ROUNDS {
            if self.free_bytes(need) >= need {
                return true;
            }
            spin_loop();
        }
        let region = self.region.clone();
        let hdr = region.header();
        let seq = hdr.consumer.space.load();
        hdr.producer.waiting.store(1, Ordering::Relaxed);
        // SYNC(eventcount): pairs with the fence in Reclaim::store_read_pos_locked.
        fence(Ordering::SeqCst);
        if self.free_bytes(need) >= need {
            hdr.producer.waiting.store(0, Ordering::Relaxed);
            return true;
        }
        hdr.producer_counters.waits.fetch_add(1, Ordering::Relaxed);
        let woken = hdr.consumer.space.wait(seq, slice);
        hdr.producer.waiting.store(0, Ordering::Relaxed);
        let _ = woken;
        self.free_bytes(need) >= need
    }

    /// Bytes a frame of `len` needs now, PAD included (for `wait_for_space`).
    pub fn need_for(&self, len: u64, align: u64) -> u64 {
        let slot = self.write & (self.cap - 1);
        if slot + len > self.cap {
            return self.cap - slot + len;
        }
        if align > FRAME_ALIGN && slot % align != 0 {
            let aligned = slot.next_multiple_of(align);
            return if aligned + len > self.cap {
                self.cap - slot + len
            } else {
                aligned - slot + len
            };
        }
        len
    }

    /// Marks the ring closed (after the END frame was published).
    pub fn close(&mut self) {
        self.publish();
        self.hdr()
            .producer
            .state
            .store(crate::shm::layout::STATE_CLOSED, Ordering::Release);
    }
}

#[cfg(not(loom))]
const SPIN_ROUNDS: u32 = 64;
#[cfg(loom)]
const SPIN_ROUNDS: u32 = 1;

/// One complete frame the consumer may read: `[pos, pos + len)`, at `slot` in the data area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameRef {
    pub pos: u64,
    pub slot: u64,
    pub len: u64,
    /// The frame's kind (low byte of its first word).
    pub kind: u32,
}

/// The consumer end. Thread-compatible: one thread at a time.
pub struct Consumer {
    region: Arc<dyn Region>,
    cap: u64,
    /// Position after the last frame handed out by `next_frame`.
    next_read: u64,
    /// Last `write_pos` seen.
    cached_write: u64,
    /// Frames handed out and done with, up to here, not yet pushed to `reclaim`.
    pending_free: Option<u64>,
    pub reclaim: Arc<Reclaim>,
}

impl Consumer {
    pub fn new(region: Arc<dyn Region>) -> Self {
        let cap = region.capacity();
        let read = region.header().consumer.read_pos.load(Ordering::Acquire);
        Consumer {
            reclaim: Arc::new(Reclaim::new(region.clone(), read)),
            region,
            cap,
            next_read: read,
            cached_write: read,
            pending_free: None,
        }
    }

    pub fn region(&self) -> &Arc<dyn Region> {
        &self.region
    }

    pub fn capacity(&self) -> u64 {
        self.cap
    }

    pub fn next_read(&self) -> u64 {
        self.next_read
    }

    /// Replaces the region (after a detach: a fresh mapping of the same memory).
    pub fn set_region(&mut self, region: Arc<dyn Region>) {
        self.reclaim.set_region(region.clone());
        self.region = region;
    }

    /// True if a frame (or PAD) is published beyond `next_read`.
    pub fn has_data(&mut self) -> bool {
        if self.next_read < self.cached_write {
            return true;
        }
        // SYNC(published): Release in Producer::publish.
        self.cached_write = self
            .region
            .header()
            .producer
            .write_pos
            .load(Ordering::Acquire);
        self.next_read < self.cached_write
    }

    /// The next published frame, skipping PADs (which are released at once), or None.
    /// The frame is handed out but not released: the caller must `mark_free` it (copied) or
    /// `push_leased` it, in ring order; PADs are marked free here.
    ///
    /// Raises `RingCorrupted` if the bytes at `next_read` are not a well-formed frame that
    /// lies inside `[next_read, write_pos)` and inside the data area.
    pub fn next_frame(&mut self) -> Result<Option<FrameRef>, Error> {
        loop {
            if !self.has_data() {
                return Ok(None);
            }
            let pos = self.next_read;
            let avail = self.cached_write - pos;
            if avail > self.cap {
                return Err(corrupted(
                    pos,
                    "write_pos is more than a ring ahead of read_pos",
                ));
            }
            // SAFETY: the data area holds `cap` bytes for the region's life; [pos, pos +
            // avail) lies below write_pos, which we loaded with Acquire, so the producer
            // finished writing it.
            let f = unsafe { check_frame(self.region.data(), self.cap, pos, avail) }?;
            self.next_read = pos + f.len;
            if f.kind == KIND_PAD {
                self.mark_free(pos + f.len);
                continue;
            }
            return Ok(Some(f));
        }
    }

    /// Records that every frame handed out up to `end` is done with (copied out); pushed to
    /// the lease table in one step by [`Consumer::flush_free`] (fewer `read_pos` stores).
    pub fn mark_free(&mut self, end: u64) {
        debug_assert!(self.pending_free.is_none_or(|p| p <= end));
        self.pending_free = Some(end);
    }

    /// Pushes the frames marked free so far (their bytes may be reused now).
    pub fn flush_free(&mut self) {
        if let Some(end) = self.pending_free.take() {
            self.reclaim.push(end, 0);
        }
    }

    /// Records a handed-out frame ending at `end` that stays pinned by one lease; frames
    /// marked free before it are pushed first, so the table stays in ring order.
    pub fn push_leased(&mut self, end: u64) -> Ticket {
        self.flush_free();
        self.reclaim.push(end, 1)
    }

    /// Records a handed-out frame ending at `end` that stays pinned until the returned
    /// lease drops (on any thread); the lease also keeps the ring's memory mapped.
    pub fn lease(&mut self, end: u64) -> FrameLease {
        let ticket = self.push_leased(end);
        FrameLease {
            reclaim: self.reclaim.clone(),
            ticket,
            _region: self.region.clone(),
        }
    }

    /// Pointer to the frame's first byte.
    pub fn frame_ptr(&self, frame: &FrameRef) -> *const u8 {
        // SAFETY: frame.slot + frame.len <= capacity (checked in next_frame).
        unsafe { self.region.data().add(frame.slot as usize) }
    }

    /// True if the producer closed the ring (END published) or may be waiting for space.
    pub fn producer_waiting(&self) -> bool {
        self.region
            .header()
            .producer
            .waiting
            .load(Ordering::Relaxed)
            != 0
    }

    /// Waits up to `slice` for a frame: spins briefly, then sleeps on the shared futex.
    pub fn wait_for_data(&mut self, slice: Duration) -> bool {
        for _ in 0..SPIN_ROUNDS {
            if self.has_data() {
                return true;
            }
            spin_loop();
        }
        let region = self.region.clone();
        let hdr = region.header();
        let seq = hdr.producer.data.load();
        hdr.consumer.waiting.store(1, Ordering::Relaxed);
        // SYNC(eventcount): pairs with the fence in Producer::publish.
        fence(Ordering::SeqCst);
        if self.has_data() {
            hdr.consumer.waiting.store(0, Ordering::Relaxed);
            return true;
        }
        hdr.consumer_counters.waits.fetch_add(1, Ordering::Relaxed);
        let woken = hdr.producer.data.wait(seq, slice);
        hdr.consumer.waiting.store(0, Ordering::Relaxed);
        let _ = woken == Woken::TimedOut;
        self.has_data()
    }
}

/// Checks the frame at position `pos` of a data area of `cap` bytes (a power of two), of
/// which `avail` bytes from `pos` on are written (at most `cap`): 64-byte aligned, the frame
/// magic, and a length that is a multiple of 64 inside both `avail` and the data area
/// (frames never straddle the end). Shared by the ring's consumer and the cache window's
/// reader; every length read from shared memory is untrusted.
///
/// Raises `RingCorrupted` naming what is wrong.
///
/// # Safety
/// `data` must point to `cap` readable bytes, of which `[pos, pos + avail)` (slot-wise) no
/// one writes during the call.
pub unsafe fn check_frame(
    data: *const u8,
    cap: u64,
    pos: u64,
    avail: u64,
) -> Result<FrameRef, Error> {
    let slot = pos & (cap - 1);
    if slot % FRAME_ALIGN != 0 || avail < MIN_FRAME || cap - slot < MIN_FRAME {
        return Err(corrupted(
            pos,
            "frame position is not a published 64-byte frame",
        ));
    }
    // SAFETY: [slot, slot + 64) lies inside the data area and inside the written bytes
    // (checked above; the caller's contract); reads are unaligned-safe.
    let (word0, total) = unsafe {
        let p = data.add(slot as usize);
        (
            std::ptr::read_unaligned(p as *const u32),
            std::ptr::read_unaligned(p.add(8) as *const u64),
        )
    };
    if word0 & 0xFFFF_FF00 != FRAME_MAGIC {
        return Err(corrupted(pos, &format!("bad frame magic {word0:#010x}")));
    }
    if total < MIN_FRAME || total % FRAME_ALIGN != 0 || total > avail || total > cap - slot {
        return Err(corrupted(
            pos,
            &format!("frame length {total} outside the {avail} published bytes"),
        ));
    }
    Ok(FrameRef {
        pos,
        slot,
        len: total,
        kind: word0 & 0xFF,
    })
}

fn corrupted(pos: u64, what: &str) -> Error {
    Error::RingCorrupted {
        pos,
        what: what.to_string(),
    }
}

/// The consumer's table of handed-out frames in ring order, and the only writer of
/// `read_pos`: a frame is freed when its last lease drops (any thread), and `read_pos`
/// advances over the freed prefix. Thread-safe (its own mutex, never held across Python).
pub struct Reclaim {
    inner: Mutex<ReclaimInner>,
}

struct ReclaimInner {
    region: Arc<dyn Region>,
    read_pos: u64,
    /// (end position, live leases) of frames in `[read_pos, ...)`, in order.
    entries: std::collections::VecDeque<(u64, u32)>,
    /// Sequence number of `entries[0]`.
    base_seq: u64,
    /// Bumped by a detach: leases of older generations no longer count.
    generation: u64,
}

/// Keeps one handed-out frame from being reused while views into it live, and the memory
/// it lies in mapped. Any thread may drop it.
pub struct FrameLease {
    reclaim: Arc<Reclaim>,
    ticket: Ticket,
    _region: Arc<dyn Region>,
}

impl Drop for FrameLease {
    fn drop(&mut self) {
        self.reclaim.release(self.ticket);
    }
}

/// A claim on one handed-out frame, released by [`Reclaim::release`].
#[derive(Debug, Clone, Copy)]
pub struct Ticket {
    pub seq: u64,
    pub generation: u64,
}

impl Reclaim {
    fn new(region: Arc<dyn Region>, read_pos: u64) -> Self {
        Reclaim {
            inner: Mutex::new(ReclaimInner {
                region,
                read_pos,
                entries: Default::default(),
                base_seq: 0,
                generation: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ReclaimInner> {
        // A poisoned lock only means a panic elsewhere; the table itself stays consistent.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_region(&self, region: Arc<dyn Region>) {
        self.lock().region = region;
    }

    /// Records a handed-out frame ending at `end` with `live` leases (0: free now).
    pub fn push(&self, end: u64, live: u32) -> Ticket {
        let mut g = self.lock();
        let last = g.entries.back().map_or(g.read_pos, |e| e.0);
        debug_assert!(end >= last, "frames pushed out of ring order");
        let end = end.max(last);
        let seq = g.base_seq + g.entries.len() as u64;
        g.entries.push_back((end, live));
        if live == 0 {
            g.advance_locked();
        }
        Ticket {
            seq,
            generation: g.generation,
        }
    }

    /// Drops one lease of the frame `ticket` names; frees the released prefix.
    pub fn release(&self, ticket: Ticket) {
        let mut g = self.lock();
        if ticket.generation != g.generation || ticket.seq < g.base_seq {
            return; // detached: the frame's bytes were copied away already
        }
        let index = (ticket.seq - g.base_seq) as usize;
        if let Some(entry) = g.entries.get_mut(index) {
            entry.1 = entry.1.saturating_sub(1);
            if index == 0 && entry.1 == 0 {
                g.advance_locked();
            }
        }
    }

    /// `[read_pos, end)`: bytes held by frames handed out but not freed.
    pub fn pinned(&self) -> (u64, u64) {
        let g = self.lock();
        let end = g.entries.back().map_or(g.read_pos, |e| e.0);
        (g.read_pos, end)
    }

    /// Forgets every handed-out frame (their bytes are private copies now) and frees the
    /// ring up to `next_read`. Returns the pinned span that was released.
    pub fn detach_all(&self, next_read: u64) -> (u64, u64) {
        let mut g = self.lock();
        let start = g.read_pos;
        g.generation += 1;
        g.base_seq += g.entries.len() as u64;
        g.entries.clear();
        g.store_read_pos_locked(next_read);
        g.region
            .header()
            .consumer_counters
            .detaches
            .fetch_add(1, Ordering::Relaxed);
        (start, next_read)
    }
}

impl ReclaimInner {
    fn advance_locked(&mut self) {
        let mut pos = self.read_pos;
        while let Some(&(end, 0)) = self.entries.front() {
            pos = end;
            self.entries.pop_front();
            self.base_seq += 1;
        }
        if pos != self.read_pos {
            self.store_read_pos_locked(pos);
        }
    }

    fn store_read_pos_locked(&mut self, pos: u64) {
        self.read_pos = pos;
        let hdr = self.region.header();
        // SYNC(freed): Acquire in Producer::free_bytes.
        hdr.consumer.read_pos.store(pos, Ordering::Release);
        // SYNC(eventcount): pairs with the fence in Producer::wait_for_space.
        fence(Ordering::SeqCst);
        if hdr.producer.waiting.load(Ordering::Relaxed) != 0 {
            hdr.consumer.space.bump_and_wake();
        }
    }
}

/// A heap-backed region, for tests and loom models.
pub struct HeapRegion {
    header: Box<RingHeader>,
    data: Box<[std::cell::UnsafeCell<u8>]>,
}

// SAFETY: the data bytes are only touched through raw pointers under the ring protocol
// (one writer per byte range at a time, ordered by the cursors); the header is atomics.
unsafe impl Sync for HeapRegion {}
// SAFETY: as above; nothing in it is tied to a thread.
unsafe impl Send for HeapRegion {}

impl HeapRegion {
    pub fn new(capacity: u64) -> Arc<Self> {
        assert!(capacity.is_power_of_two() && capacity >= 2 * MIN_FRAME);
        Arc::new(HeapRegion {
            header: Box::new(RingHeader::new(capacity, 4096, [0; 16], 0)),
            data: (0..capacity)
                .map(|_| std::cell::UnsafeCell::new(0))
                .collect(),
        })
    }
}

// SAFETY: header and data are owned boxes, alive as long as self; capacity matches.
unsafe impl Region for HeapRegion {
    fn header(&self) -> &RingHeader {
        &self.header
    }
    fn data(&self) -> *mut u8 {
        self.data.as_ptr() as *mut u8
    }
    fn capacity(&self) -> u64 {
        self.data.len() as u64
    }
}
