//! The cross-trainer cache's window as one shared-memory segment (issue 4): the worker
//! writes each cached element once, as a DATA frame (`transport::frame`), into a sealed
//! memfd; every same-host trainer maps the same memfd and reads (or leases) the frames, so
//! N trainers cost one copy of the window instead of one ring each.
//!
//! Layout: one header page, then `capacity` data bytes (a power of two). Frames are laid
//! out as in the ring (`shm::ring`): 64-B aligned, 4096-B aligned when they carry leasable
//! leaves, contiguous in position order, with a PAD frame where one would straddle the end.
//! Positions are monotonic u64 byte counts (`slot = pos & (capacity - 1)`); the window is
//! the position range `[first_pos, end_pos)` of the frames still cached.
//!
//! Header page: the creator's constants (written once before the fd leaves the process),
//! then the hold table: [`HOLD_SLOTS`] `AtomicU64` words, one per attached trainer
//! connection. A slot's `hold_pos` is the lowest position of a frame that trainer still has
//! views into, `u64::MAX` when none.
//!
//! Reclaim protocol (who may overwrite what):
//! - `hold_pos[slot]` is written only by the trainer owning the slot (Release store, after it
//!   registered or dropped a lease) and by the worker when that trainer's socket hung up
//!   (the trainer is gone then, so there is still one writer at a time). The writer (the
//!   worker's cache) loads every slot with Acquire before it reuses space.
//!   SYNC(hold): a trainer's reads of a frame happen before its Release store that lifts
//!   the hold; the writer's Acquire load of that store happens before it overwrites.
//! - Grants (worker-private, [`Grants`]): when the worker answers a trainer's request with a
//!   run of frames starting at `pos`, it first sets that connection's grant to `pos`; the
//!   trainer decodes the frames (copying small leaves, registering holds for leased ones,
//!   all stored before its next message) and then sends a DONE message, on which the worker
//!   clears the grant. The socket round trip orders the trainer's hold stores before the
//!   grant's clearing; the writer loads the grants before the holds. So a frame handed out is
//!   covered by a grant or a hold from the reply until the trainer's last view of it drops.
//! - The writer may reuse space only below `reclaim_limit = min(first_pos, every hold_pos,
//!   every grant)` ([`reclaim_limit`]); it places a frame only if `end_pos + pad + len <=
//!   reclaim_limit + capacity` ([`WindowLog::try_place`]). When the window's own oldest frame
//!   is the limit it evicts that frame (the window is byte-bounded anyway); when a hold or a
//!   grant is, the caller waits a short grace period and then abandons the segment to its
//!   holders and starts a fresh one, so the worker never waits on a trainer for long.
//!
//! Trainers map the segment read-only and shared (headers, small leaves copied out) and map
//! each leased leaf separately, `MAP_PRIVATE`: a trainer writing into its view gets private
//! copies of those pages (numpy views stay writeable for DLPack) and other trainers never see
//! the write, while pages it did not write follow the file, which is why the hold must stay
//! until the view is gone.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rustix::fs::{FallocateFlags, MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, MremapFlags, ProtFlags};

use crate::error::Error;
use crate::shm::layout::FRAME_ALIGN;
use crate::shm::ring::{pad_before, FRAME_MAGIC, KIND_PAD, MIN_FRAME};
use crate::shm::segment::page_bytes;

pub const MAGIC: [u8; 8] = *b"DSWIND01";
pub const LAYOUT_VERSION: u32 = 1;
/// Trainer connections one segment serves at once.
pub const HOLD_SLOTS: usize = 64;
/// `hold_pos` of a slot with no holds.
pub const NO_HOLD: u64 = u64::MAX;
pub const MIN_CAPACITY: u64 = 64 << 10;
pub const MAX_CAPACITY: u64 = 4 << 30;

/// Written once by the creator before the fd leaves the process; read-only afterwards.
#[repr(C)]
pub struct Constants {
    pub magic: [u8; 8],
    pub layout_version: u32,
    pub header_bytes: u32,
    pub capacity_bytes: u64,
    pub hold_slots: u32,
    pub creator_pid: u32,
    pub nonce: [u8; 16],
}

#[repr(C, align(128))]
pub struct WindowHeader {
    pub constants: Constants,
    pub _pad: [u8; 128 - std::mem::size_of::<Constants>()],
    /// SYNC(hold): one word per trainer connection (see the module docs).
    pub holds: [AtomicU64; HOLD_SLOTS],
}

const _: () = {
    assert!(std::mem::size_of::<Constants>() <= 128);
    assert!(std::mem::offset_of!(WindowHeader, holds) == 128);
    assert!(std::mem::size_of::<WindowHeader>() <= 4096);
};

/// True if `capacity_bytes` is a supported segment size.
pub fn valid_capacity(capacity_bytes: u64) -> bool {
    capacity_bytes.is_power_of_two() && (MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity_bytes)
}

/// The largest frame a segment of `capacity_bytes` takes: half, so a frame and the PAD
/// before it always fit once the rest is reclaimed.
pub fn max_frame_bytes(capacity_bytes: u64) -> u64 {
    capacity_bytes / 2
}

fn os_error(op: &'static str, err: rustix::io::Errno) -> Error {
    Error::Io {
        op,
        path: "cross-trainer cache segment".to_string(),
        source: err.into(),
    }
}

/// One mapping of a window segment: header page + data area. Unmapped on drop.
pub struct WindowMap {
    ptr: *mut u8,
    len: usize,
    header_bytes: u64,
    capacity: u64,
    fd: Arc<OwnedFd>,
}

// SAFETY: the mapping is plain shared memory; concurrent access follows the reclaim
// protocol above (atomics in the header; data bytes written only by the creator, only in
// space no hold, grant or cached frame covers).
unsafe impl Send for WindowMap {}
// SAFETY: as above.
unsafe impl Sync for WindowMap {}

impl Drop for WindowMap {
    fn drop(&mut self) {
        // SAFETY: ptr/len is the range mmap returned to us and nobody else unmaps it; the
        // last Arc<WindowMap> is gone, so no reference into it is live.
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.cast(), self.len);
        }
    }
}

impl WindowMap {
    fn map(
        fd: Arc<OwnedFd>,
        header_bytes: u64,
        capacity: u64,
        writer: bool,
    ) -> Result<Self, Error> {
        let len = (header_bytes + capacity) as usize;
        let (prot, flags) = if writer {
            (
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::POPULATE,
            )
        } else {
            // A trainer writes only hold words: the header page is remapped writeable below.
            (ProtFlags::READ, MapFlags::SHARED)
        };
        // SAFETY: a fresh shared mapping of a sealed, fully allocated memfd at an address the
        // kernel picks; nothing aliases it yet.
        let ptr =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, flags, fd.as_fd(), 0) }
                .map_err(|e| os_error("mapping", e))?;
        if !writer {
            // SAFETY: the first header_bytes of our own fresh mapping (page-aligned, inside
            // it); the hold words are the only thing a trainer stores into the segment.
            let r = unsafe {
                rustix::mm::mprotect(
                    ptr,
                    header_bytes as usize,
                    rustix::mm::MprotectFlags::READ | rustix::mm::MprotectFlags::WRITE,
                )
            };
            if let Err(e) = r {
                // SAFETY: our own mapping of len bytes, not handed out yet.
                unsafe {
                    let _ = rustix::mm::munmap(ptr, len);
                }
                return Err(os_error("mapping", e));
            }
        }
        Ok(WindowMap {
            ptr: ptr.cast(),
            len,
            header_bytes,
            capacity,
            fd,
        })
    }

    /// A new sealed, pre-faulted memfd segment of `capacity_bytes`; the worker's side.
    pub fn create(capacity_bytes: u64, nonce: [u8; 16]) -> Result<Arc<Self>, Error> {
        if !valid_capacity(capacity_bytes) {
            return Err(Error::InvalidRingSize { capacity_bytes });
        }
        let header_bytes = page_bytes().max(4096);
        let total = header_bytes + capacity_bytes;
        let fd = rustix::fs::memfd_create(
            "dataservice-cache-window",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| os_error("creating", e))?;
        if let Some(free) = crate::shm::segment::cgroup_free_bytes() {
            if total > free {
                return Err(Error::ShmExhausted {
                    requested_bytes: total,
                    available_bytes: free,
                    source: std::io::Error::from_raw_os_error(
                        rustix::io::Errno::NOMEM.raw_os_error(),
                    ),
                });
            }
        }
        if let Err(err) = rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, total) {
            return Err(Error::ShmExhausted {
                requested_bytes: total,
                available_bytes: crate::shm::segment::mem_available_bytes(),
                source: err.into(),
            });
        }
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| os_error("sealing", e))?;
        let map = WindowMap::map(Arc::new(fd), header_bytes, capacity_bytes, true)?;
        let constants = Constants {
            magic: MAGIC,
            layout_version: LAYOUT_VERSION,
            header_bytes: header_bytes as u32,
            capacity_bytes,
            hold_slots: HOLD_SLOTS as u32,
            creator_pid: std::process::id(),
            nonce,
        };
        // SAFETY: the mapping starts page-aligned with a whole header page; no other process
        // has the fd yet, so plain writes are unobserved. The hold words are initialised
        // through their atomics right after.
        unsafe { std::ptr::write(map.ptr as *mut Constants, constants) };
        for h in &map.header().holds {
            h.store(NO_HOLD, Ordering::Relaxed);
        }
        Ok(Arc::new(map))
    }

    /// Maps a segment fd received from the worker (read-only data, writeable hold words),
    /// after checking its seals, size and header.
    pub fn attach(fd: OwnedFd, nonce: Option<[u8; 16]>) -> Result<Arc<Self>, Error> {
        let mismatch = |what: String| Error::LayoutMismatch { what };
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| os_error("checking", e))?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(mismatch(
                "the window fd is not sealed against resizing".into(),
            ));
        }
        let size = rustix::fs::fstat(&fd)
            .map_err(|e| os_error("checking", e))?
            .st_size as u64;
        let page = page_bytes().max(4096);
        if size < page + MIN_CAPACITY {
            return Err(mismatch(format!("the window fd is only {size} bytes")));
        }
        let fd = Arc::new(fd);
        let probe = WindowMap::map(fd.clone(), page, 0, false)?;
        // SAFETY: the probe maps a whole page, page-aligned; the constants are plain data
        // written before the fd was sent and never changed.
        let c = unsafe { std::ptr::read(probe.ptr as *const Constants) };
        drop(probe);
        if c.magic != MAGIC || c.layout_version != LAYOUT_VERSION {
            return Err(mismatch(format!(
                "magic {:?} layout_version {}, expected {:?} {LAYOUT_VERSION}",
                c.magic, c.layout_version, MAGIC
            )));
        }
        if u64::from(c.header_bytes) != page
            || !valid_capacity(c.capacity_bytes)
            || page + c.capacity_bytes != size
            || c.hold_slots as usize != HOLD_SLOTS
        {
            return Err(mismatch(format!(
                "header {} + capacity {} bytes does not match the {size}-byte segment",
                c.header_bytes, c.capacity_bytes
            )));
        }
        if nonce.is_some_and(|n| n != c.nonce) {
            return Err(mismatch(
                "the window's nonce differs from the handshake's".into(),
            ));
        }
        Ok(Arc::new(WindowMap::map(fd, page, c.capacity_bytes, false)?))
    }

    pub fn header(&self) -> &WindowHeader {
        // SAFETY: page-aligned header initialised by create (or validated by attach); after
        // creation only its atomics are touched through shared references.
        unsafe { &*(self.ptr as *const WindowHeader) }
    }

    pub fn data(&self) -> *mut u8 {
        // SAFETY: header_bytes < len.
        unsafe { self.ptr.add(self.header_bytes as usize) }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn header_bytes(&self) -> u64 {
        self.header_bytes
    }

    pub fn fd(&self) -> &Arc<OwnedFd> {
        &self.fd
    }

    pub fn nonce(&self) -> [u8; 16] {
        self.header().constants.nonce
    }

    /// The lowest hold over every slot (Acquire: SYNC(hold)).
    pub fn min_hold(&self) -> u64 {
        self.header()
            .holds
            .iter()
            .map(|h| h.load(Ordering::Acquire))
            .min()
            .unwrap_or(NO_HOLD)
    }

    /// A private (copy-on-write) writeable mapping of `len` data bytes at `slot`, which must
    /// be page-aligned; None if it is not, or the mapping fails (the caller copies instead).
    pub fn map_private(&self, slot: u64, len: u64) -> Option<PrivateMap> {
        let page = page_bytes();
        let offset = self.header_bytes + slot;
        if offset % page != 0 || len == 0 || slot.checked_add(len)? > self.capacity {
            return None;
        }
        let maplen = len.next_multiple_of(page) as usize;
        // SAFETY: a fresh private mapping of our memfd at a page-aligned offset inside the
        // file (slot + len <= capacity, so offset + maplen <= the file size rounded to a
        // page, which the file has: header + capacity are both page multiples).
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                maplen,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
                self.fd.as_fd(),
                offset,
            )
        }
        .ok()?;
        Some(PrivateMap {
            ptr: ptr.cast(),
            len: maplen,
        })
    }
}

/// A private, copy-on-write mapping of one leased leaf (unmapped on drop).
pub struct PrivateMap {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a mapping of our own; writes only through numpy views (the Python program's data
// race, as with any array).
unsafe impl Send for PrivateMap {}
// SAFETY: as above.
unsafe impl Sync for PrivateMap {}

impl PrivateMap {
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Replaces the mapping's pages by anonymous copies at the same addresses, so it no
    /// longer follows (nor keeps alive) the segment's file: done before a trainer gives up
    /// its hold while views live (closing, or the worker moved to a fresh segment).
    pub fn detach(&self) -> Result<(), Error> {
        // SAFETY: a fresh private anonymous mapping; nothing aliases it.
        let anon = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                self.len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(|e| os_error("detaching", e))?;
        // SAFETY: both ranges are len bytes and mapped, distinct mappings; our source is only
        // written by the user's own views (a concurrent write may be lost: TRANSPORT.md §5).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, anon.cast::<u8>(), self.len) };
        // SAFETY: moves the anonymous pages over our own page-aligned mapping of the same
        // length; MREMAP_FIXED replaces it atomically (readers see equal bytes before and
        // after).
        let moved = unsafe {
            rustix::mm::mremap_fixed(
                anon,
                self.len,
                self.len,
                MremapFlags::MAYMOVE,
                self.ptr.cast(),
            )
        };
        if let Err(err) = moved {
            // SAFETY: anon is our own unused mapping of len bytes.
            unsafe {
                let _ = rustix::mm::munmap(anon, self.len);
            }
            return Err(os_error("detaching", err));
        }
        Ok(())
    }
}

impl Drop for PrivateMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping; the last view into it is gone (the lease owning it drops).
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Worker-private grants: per slot, the first position of a reply a trainer is still
/// decoding (`NO_HOLD` when none). Set before the reply is sent, cleared on the trainer's
/// DONE message or hang-up, read by the writer before the shared holds (SeqCst: all in one
/// process, no ordering subtleties worth saving).
pub struct Grants([AtomicU64; HOLD_SLOTS]);

impl Default for Grants {
    fn default() -> Self {
        Grants(std::array::from_fn(|_| AtomicU64::new(NO_HOLD)))
    }
}

impl Grants {
    pub fn set(&self, slot: usize, pos: u64) {
        if let Some(g) = self.0.get(slot) {
            g.store(pos, Ordering::SeqCst);
        }
    }

    pub fn clear(&self, slot: usize) {
        self.set(slot, NO_HOLD);
    }

    pub fn min(&self) -> u64 {
        self.0
            .iter()
            .map(|g| g.load(Ordering::SeqCst))
            .min()
            .unwrap_or(NO_HOLD)
    }
}

/// The reclaim rule: space below the returned position may be overwritten.
pub fn reclaim_limit(first_pos: u64, end_pos: u64, holds: impl IntoIterator<Item = u64>) -> u64 {
    holds
        .into_iter()
        .fold(first_pos.min(end_pos), |limit, h| limit.min(h))
}

/// One cached frame: `[pos, pos + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedFrame {
    pub pos: u64,
    pub len: u64,
    pub align: u64,
    pub spec_id: u32,
}

/// What [`WindowLog::try_place`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// Write the frame at `slot` (position `pos`); if `pad` > 0, a PAD frame of `pad` bytes
    /// goes at `pad_slot` first.
    Write {
        pos: u64,
        slot: u64,
        pad: u64,
        pad_slot: u64,
    },
    /// The window's oldest frame is in the way: evict it and try again.
    EvictOldest,
    /// A hold or grant is in the way.
    Held,
}

/// The writer's bookkeeping of the window (pure: no memory, so the rule can be model-tested).
#[derive(Debug, Clone)]
pub struct WindowLog {
    cap: u64,
    end: u64,
    frames: VecDeque<CachedFrame>,
}

impl WindowLog {
    pub fn new(cap: u64) -> Self {
        WindowLog {
            cap,
            end: 0,
            frames: VecDeque::new(),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.cap
    }

    pub fn end_pos(&self) -> u64 {
        self.end
    }

    pub fn first_pos(&self) -> u64 {
        self.frames.front().map_or(self.end, |f| f.pos)
    }

    pub fn frames(&self) -> &VecDeque<CachedFrame> {
        &self.frames
    }

    pub fn len(&self) -> usize {
        self.frames.len()
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Drops the oldest frame.
    pub fn evict_oldest(&mut self) -> Option<CachedFrame> {
        self.frames.pop_front()
    }

    /// Where a frame of `len` bytes (a multiple of 64, at most capacity/2) aligned to
    /// `align` would go, given `held` = the lowest hold or grant (`NO_HOLD`: none).
    pub fn try_place(&self, len: u64, align: u64, held: u64) -> Place {
        debug_assert!(len % FRAME_ALIGN == 0 && len >= MIN_FRAME && len <= self.cap / 2);
        let slot = self.end & (self.cap - 1);
        let pad = pad_before(slot, len, align, self.cap);
        let first = self.first_pos();
        let limit = reclaim_limit(first, self.end, [held]);
        if self.end + pad + len <= limit + self.cap {
            return Place::Write {
                pos: self.end + pad,
                slot: (self.end + pad) & (self.cap - 1),
                pad,
                pad_slot: slot,
            };
        }
        if !self.frames.is_empty() && first <= held {
            Place::EvictOldest
        } else {
            Place::Held
        }
    }

    /// Records a frame written where [`WindowLog::try_place`] said.
    pub fn push(&mut self, pos: u64, len: u64, align: u64, spec_id: u32) {
        debug_assert!(pos >= self.end);
        self.end = pos + len;
        self.frames.push_back(CachedFrame {
            pos,
            len,
            align,
            spec_id,
        });
    }
}

/// Writes a PAD frame header of `len` bytes at `slot` of `data`.
///
/// # Safety
/// `[slot, slot + 16)` must lie inside the data area and be writeable by the caller.
pub unsafe fn write_pad(data: *mut u8, slot: u64, len: u64) {
    // SAFETY: the caller's contract; unaligned-safe writes.
    unsafe {
        let p = data.add(slot as usize);
        std::ptr::write_unaligned(p as *mut u32, FRAME_MAGIC | KIND_PAD);
        std::ptr::write_unaligned(p.add(4) as *mut u32, 0);
        std::ptr::write_unaligned(p.add(8) as *mut u64, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A model of the writer and of trainers holding frames: the writer never overwrites a
    /// byte a hold covers or one of a cached frame, and frames stay inside the segment.
    #[derive(Debug, Clone)]
    enum Op {
        Append(u64, bool),
        Hold(usize, usize),
        Release(usize),
        Evict,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u64..40, any::<bool>()).prop_map(|(n, a)| Op::Append(n * 64, a)),
            2 => (0usize..4, 0usize..16).prop_map(|(t, i)| Op::Hold(t, i)),
            2 => (0usize..4).prop_map(Op::Release),
            1 => Just(Op::Evict),
        ]
    }

    proptest! {
        #[test]
        fn writer_never_overwrites_held_or_cached_bytes(ops in proptest::collection::vec(op(), 1..200)) {
            let cap = 8192u64;
            let mut log = WindowLog::new(cap);
            // Every byte's owner (position that wrote it), to check overwrites.
            let mut owner: Vec<Option<u64>> = vec![None; cap as usize];
            let mut holds: [u64; 4] = [NO_HOLD; 4];
            for op in ops {
                match op {
                    Op::Append(len, page) => {
                        let align = if page { 4096 } else { 64 };
                        let len = len.min(cap / 2);
                        loop {
                            let held = holds.iter().copied().min().unwrap();
                            match log.try_place(len, align, held) {
                                Place::Write { pos, slot, pad, pad_slot } => {
                                    prop_assert_eq!(pos % align.min(cap), 0);
                                    prop_assert!(slot + len <= cap);
                                    // Nothing written may be held or cached.
                                    let limit = reclaim_limit(log.first_pos(), log.end_pos(), holds);
                                    for b in (pad_slot..pad_slot + pad).chain(slot..slot + len) {
                                        if let Some(p) = owner[b as usize] {
                                            prop_assert!(p < limit, "byte of frame at {} overwritten, limit {}", p, limit);
                                        }
                                    }
                                    for b in slot..slot + len {
                                        owner[b as usize] = Some(pos);
                                    }
                                    for b in pad_slot..pad_slot + pad {
                                        owner[b as usize] = Some(pos - pad);
                                    }
                                    log.push(pos, len, align, 0);
                                    break;
                                }
                                Place::EvictOldest => { log.evict_oldest(); }
                                Place::Held => {
                                    prop_assert!(held < log.first_pos() || log.is_empty());
                                    break;
                                }
                            }
                        }
                    }
                    Op::Hold(t, i) => {
                        if let Some(f) = log.frames().get(i) {
                            holds[t] = holds[t].min(f.pos);
                        }
                    }
                    Op::Release(t) => holds[t] = NO_HOLD,
                    Op::Evict => { log.evict_oldest(); }
                }
                // The window's frames never exceed the segment.
                prop_assert!(log.end_pos() - log.first_pos() <= cap);
            }
        }
    }

    #[test]
    fn reclaim_limit_is_the_minimum() {
        assert_eq!(reclaim_limit(100, 200, [NO_HOLD, 50]), 50);
        assert_eq!(reclaim_limit(100, 200, [NO_HOLD]), 100);
        assert_eq!(reclaim_limit(300, 200, []), 200);
    }
}
