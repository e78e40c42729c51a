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
//! - Grants (worker-private, [`Grants`](crate::shm::holds::Grants)): when the worker answers a trainer's request with a
//!   run of frames starting at `pos`, it first sets that connection's grant to `pos`; the
//!   trainer decodes the frames (copying small leaves, registering holds for leased ones,
//!   all stored before its next message) and then sends a DONE message, on which the worker
//!   clears the grant. The socket round trip orders the trainer's hold stores before the
//!   grant's clearing; the writer loads the grants before the holds. So a frame handed out is
//!   covered by a grant or a hold from the reply until the trainer's last view of it drops.
//! - The writer may reuse space only below `reclaim_limit = min(first_pos, every hold_pos,
//!   every grant)` ([`reclaim_limit`](crate::shm::holds::reclaim_limit)); it places a frame only if `end_pos + pad + len <=
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

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::error::Error;
use crate::shm::holds::{FrameHold, Grants, HoldTable, HoldWords, Place, WindowLeaf, WindowLog};
use crate::shm::ring::{check_frame, FRAME_MAGIC, KIND_PAD};
use crate::shm::segment::{page_bytes, Segment, SegmentHeader};
use crate::sync::{AtomicU64, Ordering};

pub use crate::shm::holds::{HOLD_SLOTS, NO_HOLD};

pub const MAGIC: [u8; 8] = *b"DSWIND01";
pub const LAYOUT_VERSION: u32 = 1;
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
    assert!(std::mem::size_of::<AtomicU64>() == 8);
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

/// One mapping of a window segment: header page + data area (peers map the data area
/// read-only and write only their hold words).
pub type WindowMap = Segment<WindowHeader>;

// SAFETY: WindowHeader is #[repr(C, align(128))] and at most 4096 bytes (asserted above);
// init writes the constants and every hold word, check validates the constants.
unsafe impl SegmentHeader for WindowHeader {
    const MEMFD_NAME: &'static str = "dataservice-cache-window";
    const WHAT: &'static str = "window";
    const IO_PATH: &'static str = "cross-trainer cache segment";
    const PEER_WRITES_DATA: bool = false;

    fn valid_capacity(capacity_bytes: u64) -> bool {
        valid_capacity(capacity_bytes)
    }

    unsafe fn init(ptr: *mut u8, header_bytes: u64, capacity_bytes: u64, nonce: [u8; 16]) {
        let constants = Constants {
            magic: MAGIC,
            layout_version: LAYOUT_VERSION,
            header_bytes: header_bytes as u32,
            capacity_bytes,
            hold_slots: HOLD_SLOTS as u32,
            creator_pid: std::process::id(),
            nonce,
        };
        // SAFETY: the caller's contract: page-aligned, a whole header page, unshared; the
        // hold words are initialised through their atomics right after.
        unsafe { std::ptr::write(ptr as *mut Constants, constants) };
        // SAFETY: as above; the words are naturally aligned at offset 128.
        let header = unsafe { &*(ptr as *const WindowHeader) };
        for h in &header.holds {
            h.store(NO_HOLD, Ordering::Relaxed);
        }
    }

    unsafe fn check(ptr: *const u8, page: u64, size: u64) -> Result<(u64, [u8; 16]), Error> {
        // SAFETY: the caller maps a whole page; the constants are plain data written before
        // the fd was sent and never changed.
        let c = unsafe { std::ptr::read(ptr as *const Constants) };
        let mismatch = |what: String| Error::LayoutMismatch { what };
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
        Ok((c.capacity_bytes, c.nonce))
    }
}

impl HoldWords for Segment<WindowHeader> {
    fn holds(&self) -> &[AtomicU64] {
        &self.header().holds
    }
}

impl Segment<WindowHeader> {
    pub fn nonce(&self) -> [u8; 16] {
        self.header().constants.nonce
    }

    /// The lowest hold over every slot (Acquire: SYNC(hold)).
    pub fn min_hold(&self) -> u64 {
        crate::shm::holds::min_hold(&self.header().holds)
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

/// Where [`WindowWriter::reserve`] put a frame, or why it did not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    /// The frame's position, and its slot in the current segment's data area; None when a
    /// trainer's hold or grant is in the way (nothing was reserved).
    pub at: Option<(u64, u64)>,
    /// How many of the oldest cached frames were evicted meanwhile.
    pub evicted: usize,
}

/// The worker's side of the window: the current segment, the log of cached frames in it,
/// and the grants. Thread-compatible (the pyclass locks it), except [`Grants`], which any
/// thread may change.
pub struct WindowWriter {
    map: Arc<WindowMap>,
    log: WindowLog,
    grants: Arc<Grants>,
    generation: u64,
    pub grows: u64,
    pub abandons: u64,
    pub frames_written: u64,
    pub bytes_written: u64,
}

impl WindowWriter {
    pub fn new(capacity_bytes: u64, nonce: [u8; 16]) -> Result<Self, Error> {
        Ok(WindowWriter {
            map: WindowMap::create(capacity_bytes, nonce)?,
            log: WindowLog::new(capacity_bytes),
            grants: Arc::new(Grants::default()),
            generation: 0,
            grows: 0,
            abandons: 0,
            frames_written: 0,
            bytes_written: 0,
        })
    }

    pub fn map(&self) -> &Arc<WindowMap> {
        &self.map
    }

    pub fn log(&self) -> &WindowLog {
        &self.log
    }

    pub fn log_mut(&mut self) -> &mut WindowLog {
        &mut self.log
    }

    pub fn grants(&self) -> &Arc<Grants> {
        &self.grants
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Moves the window into a fresh segment of `capacity` bytes: the old one is left to
    /// the trainers still holding views into it (their mappings keep it alive), and the
    /// grants, which name positions of the old one, are cleared. Returns how many of the
    /// oldest cached frames did not fit and were evicted.
    pub fn migrate(&mut self, capacity: u64, nonce: [u8; 16]) -> Result<usize, Error> {
        let fresh = WindowMap::create(capacity, nonce)?;
        let mut log = WindowLog::new(capacity);
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
                            unsafe { write_pad(fresh.data(), pad_slot, pad) };
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
        for (from, to, len) in copies {
            // SAFETY: both ranges are frames inside their data areas (from the logs); the
            // old frames are cached (not reused: we are their only writer) and the fresh
            // segment is not shared yet.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.map.data().add(from as usize),
                    fresh.data().add(to as usize),
                    len as usize,
                )
            }
        }
        self.map = fresh;
        self.log = log;
        self.generation += 1;
        self.grants.clear_all();
        Ok(evicted)
    }

    /// Leaves the segment to the trainers holding views into it and moves the window into a
    /// fresh one of the same size. Returns how many of the oldest frames did not fit.
    pub fn abandon(&mut self, nonce: [u8; 16]) -> Result<usize, Error> {
        let evicted = self.migrate(self.log.capacity(), nonce)?;
        self.abandons += 1;
        Ok(evicted)
    }

    /// Reserves `len` bytes (aligned to `align`) for a frame. When the window's oldest
    /// frames are in the way, the segment grows (doubles, into a fresh memfd) while it is
    /// smaller than `max_capacity`, and evicts them once it is not; a frame bigger than
    /// half the segment grows it first. The caller copies the frame to the returned slot,
    /// then calls [`WindowWriter::commit`].
    ///
    /// Raises `ElementTooLarge` when the frame does not fit even a 4 GiB segment.
    pub fn reserve(
        &mut self,
        len: u64,
        align: u64,
        max_capacity: u64,
        nonce: impl Fn() -> [u8; 16],
    ) -> Result<Reserved, Error> {
        let mut evicted = 0;
        if len > max_frame_bytes(self.log.capacity()) {
            let want = (len * 2).next_power_of_two();
            if want > MAX_CAPACITY {
                return Err(Error::ElementTooLarge {
                    element_bytes: len,
                    limit_bytes: max_frame_bytes(MAX_CAPACITY),
                    what: "the cross-trainer cache's shared-memory window".into(),
                });
            }
            evicted += self.migrate(want, nonce())?;
            self.grows += 1;
        }
        loop {
            // Grants first, then holds: see the module docs (a trainer's hold is stored
            // before the DONE message that clears its grant).
            let held = self.grants.min().min(self.map.min_hold());
            match self.log.try_place(len, align, held) {
                Place::Write {
                    pos,
                    slot,
                    pad,
                    pad_slot,
                } => {
                    if pad > 0 {
                        // SAFETY: try_place proved [pad_slot, pad_slot + pad) free (below
                        // the reclaim limit plus capacity) and inside the data area.
                        unsafe { write_pad(self.map.data(), pad_slot, pad) };
                    }
                    return Ok(Reserved {
                        at: Some((pos, slot)),
                        evicted,
                    });
                }
                Place::EvictOldest if self.log.capacity() < max_capacity => {
                    // The window has not reached its bound: grow instead of evicting.
                    let want = (self.log.capacity() * 2).min(MAX_CAPACITY);
                    evicted += self.migrate(want, nonce())?;
                    self.grows += 1;
                }
                Place::EvictOldest => {
                    self.log.evict_oldest();
                    evicted += 1;
                }
                Place::Held => return Ok(Reserved { at: None, evicted }),
            }
        }
    }

    /// Records the frame written at `pos` (from [`WindowWriter::reserve`]).
    pub fn commit(&mut self, pos: u64, len: u64, align: u64, spec_id: u32) {
        self.log.push(pos, len, align, spec_id);
        self.frames_written += 1;
        self.bytes_written += len;
    }

    /// The trainer in `slot` is gone: clears its grant and its hold word (it was that
    /// word's only other writer).
    pub fn release_slot(&self, slot: usize) {
        self.grants.clear(slot);
        if let Some(h) = self.map.header().holds.get(slot) {
            // SYNC(hold): Acquire in holds::min_hold (the trainer, its only other writer,
            // is gone).
            h.store(NO_HOLD, Ordering::Release);
        }
    }

    /// The slots whose hold word is set.
    pub fn held_slots(&self) -> Vec<usize> {
        (self.map.header().holds.iter().enumerate())
            .filter(|(_, h)| h.load(Ordering::Relaxed) != NO_HOLD)
            .map(|(i, _)| i)
            .collect()
    }
}

fn corrupted(pos: u64, what: &str) -> Error {
    Error::RingCorrupted {
        pos,
        what: format!("cache window: {what}"),
    }
}

/// A trainer's mapping of one window segment and its holds there (its hold slot's
/// [`HoldTable`]). Thread-compatible; the hold table is thread-safe.
pub struct SegmentReader {
    map: Arc<WindowMap>,
    table: Arc<HoldTable>,
}

impl SegmentReader {
    /// Maps the segment `fd` (received from the worker) and takes hold slot `slot`.
    ///
    /// Raises `LayoutMismatch` for a slot out of range or a segment that is not a window of
    /// this layout (or whose nonce differs from `nonce`).
    pub fn attach(fd: OwnedFd, slot: usize, nonce: Option<[u8; 16]>) -> Result<Self, Error> {
        if slot >= HOLD_SLOTS {
            return Err(Error::LayoutMismatch {
                what: format!("hold slot {slot} out of range"),
            });
        }
        let map = WindowMap::attach(fd, nonce)?;
        let table = HoldTable::new(map.clone(), slot)?;
        Ok(SegmentReader { map, table })
    }

    pub fn map(&self) -> &Arc<WindowMap> {
        &self.map
    }

    pub fn table(&self) -> &Arc<HoldTable> {
        &self.table
    }

    /// The frame with sequence number `seq` at `pos` (after at most one PAD: at the wrap,
    /// or before a page-aligned frame): its position and bytes. The worker's grant (set
    /// before its reply, cleared by the trainer's DONE after decoding) keeps it from being
    /// rewritten while the caller reads it.
    ///
    /// Raises `RingCorrupted` ("cache window: ...") when the bytes are not that frame.
    pub fn frame(&self, pos: u64, seq: u64) -> Result<(u64, &[u8]), Error> {
        let cap = self.map.capacity();
        let mut p = pos;
        let mut pads = 0;
        let f = loop {
            let avail = cap - (p & (cap - 1));
            // SAFETY: the data area holds `cap` bytes while `map` lives; the worker wrote
            // the frame before naming it and does not reuse it while the grant or a hold
            // covers it (shm::holds' reclaim protocol).
            let f =
                unsafe { check_frame(self.map.data(), cap, p, avail) }.map_err(|e| match e {
                    Error::RingCorrupted { pos, what } => corrupted(pos, &what),
                    e => e,
                })?;
            if f.kind != KIND_PAD {
                break f;
            }
            pads += 1;
            if pads > 1 {
                return Err(corrupted(p, "two PAD frames in a row"));
            }
            p += f.len;
        };
        // SAFETY: check_frame validated [slot, slot + len) inside the data area; the grant
        // keeps it unchanged while `self` is borrowed by the caller's decode.
        let bytes = unsafe {
            std::slice::from_raw_parts(self.map.data().add(f.slot as usize), f.len as usize)
        };
        let got = crate::transport::frame::FrameHeader::parse(bytes)?.seq;
        if got != seq {
            return Err(corrupted(
                p,
                &format!("frame seq {got} where {seq} was expected"),
            ));
        }
        Ok((p, bytes))
    }

    /// The lease policy for the frame of `len` bytes at `pos`: its leaves may be leased
    /// while this trainer's holds span at most `max_pinned` bytes and the frame lies at or
    /// above `reclaim_below` (the writer reuses what is below soon); else they are copied
    /// (copy on pressure).
    pub fn frame_leases(
        &self,
        pos: u64,
        len: u64,
        max_pinned: u64,
        reclaim_below: Option<u64>,
    ) -> FrameLeases<'_> {
        FrameLeases {
            reader: self,
            pos,
            end: pos + len,
            max_pinned,
            reclaim_below,
            hold: None,
            pressure: false,
        }
    }
}

/// The leases of one frame's leaves (see [`SegmentReader::frame_leases`]).
pub struct FrameLeases<'a> {
    reader: &'a SegmentReader,
    pos: u64,
    end: u64,
    max_pinned: u64,
    reclaim_below: Option<u64>,
    hold: Option<Arc<FrameHold>>,
    /// True once a leaf was copied because of pressure.
    pub pressure: bool,
}

impl FrameLeases<'_> {
    /// A leased leaf of `nbytes` at `offset` from the frame's start (a private mapping of
    /// the segment, the frame held until its last leaf drops), or None to copy it: not
    /// page-aligned, copy on pressure, or the mapping failed.
    pub fn leaf(&mut self, offset: u64, nbytes: u64) -> Option<Arc<WindowLeaf>> {
        let map = &self.reader.map;
        let slot = (self.pos & (map.capacity() - 1)) + offset;
        if slot % page_bytes() != 0 {
            return None;
        }
        if self.hold.is_none() {
            let table = &self.reader.table;
            let low = table.min().unwrap_or(self.pos).min(self.pos);
            if self.end - low > self.max_pinned || self.reclaim_below.is_some_and(|l| self.pos < l)
            {
                self.pressure = true;
                return None;
            }
            self.hold = Some(table.acquire(self.pos));
        }
        let pm = map.map_private(slot, nbytes)?;
        let hold = self.hold.clone().expect("taken above");
        Some(self.reader.table.lease(Box::new(pm), self.pos, hold))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::holds::LeafMapping;

    fn nonce() -> [u8; 16] {
        [7; 16]
    }

    fn fill(w: &mut WindowWriter, len: u64, byte: u8, max_capacity: u64) -> Reserved {
        let r = w.reserve(len, 64, max_capacity, nonce).unwrap();
        if let Some((pos, slot)) = r.at {
            // SAFETY: reserve handed [slot, slot + len) of the data area to us.
            unsafe {
                let p = w.map().data().add(slot as usize);
                std::ptr::write_bytes(p, byte, len as usize);
                std::ptr::write_unaligned(p as *mut u32, FRAME_MAGIC | 1);
                std::ptr::write_unaligned(p.add(8) as *mut u64, len);
                std::ptr::write_unaligned(p.add(16) as *mut u64, 0); // seq
            }
            w.commit(pos, len, 64, 1);
        }
        r
    }

    #[test]
    fn attach_checks_the_header_and_nonce() {
        let w = WindowWriter::new(MIN_CAPACITY, nonce()).unwrap();
        let dup = || w.map().fd().try_clone().unwrap();
        let peer = WindowMap::attach(dup(), Some(nonce())).unwrap();
        assert_eq!(peer.capacity(), MIN_CAPACITY);
        assert_eq!(peer.min_hold(), NO_HOLD);
        let e = WindowMap::attach(dup(), Some([0; 16])).err().unwrap();
        assert!(e.to_string().contains("nonce"), "{e}");
        // A ring fd is not a window.
        let ring = crate::shm::segment::Mapping::create(MIN_CAPACITY, nonce()).unwrap();
        let e = WindowMap::attach(ring.fd().try_clone().unwrap(), None)
            .err()
            .unwrap();
        assert!(e.to_string().contains("magic"), "{e}");
    }

    #[test]
    fn a_peer_hold_blocks_reuse_until_lifted() {
        let cap = MIN_CAPACITY;
        let mut w = WindowWriter::new(cap, nonce()).unwrap();
        let peer = WindowMap::attach(w.map().fd().try_clone().unwrap(), None).unwrap();
        let table = HoldTable::new(peer.clone(), 3).unwrap();
        let half = cap / 2;
        assert_eq!(fill(&mut w, half, 1, cap).at, Some((0, 0)));
        let hold = table.acquire(0);
        assert_eq!(w.held_slots(), vec![3]);
        assert_eq!(fill(&mut w, half, 2, cap).at, Some((half, half)));
        // The third frame needs the first one's bytes, which the peer holds.
        assert_eq!(
            fill(&mut w, half, 3, cap),
            Reserved {
                at: None,
                evicted: 1
            }
        );
        drop(hold);
        assert_eq!(fill(&mut w, half, 3, cap).at, Some((cap, 0)));
        assert_eq!(w.generation(), 0);
    }

    #[test]
    fn migrate_keeps_the_cached_frames_and_grows_when_allowed() {
        let cap = MIN_CAPACITY;
        let mut w = WindowWriter::new(cap, nonce()).unwrap();
        let quarter = cap / 4;
        for b in 1..=3u8 {
            fill(&mut w, quarter, b, 4 * cap);
        }
        w.grants().set(0, 0);
        let old = w.map().clone();
        // A fourth quarter fits; a fifth needs space: the window grows (no eviction).
        fill(&mut w, quarter, 4, 4 * cap);
        let r = fill(&mut w, quarter, 5, 4 * cap);
        assert_eq!(r.evicted, 0);
        assert_eq!(
            (w.generation(), w.grows, w.log().capacity()),
            (1, 1, 2 * cap)
        );
        assert_eq!(w.grants().min(), NO_HOLD, "grants named the old segment");
        assert_eq!(w.log().len(), 5);
        for (i, f) in w.log().frames().iter().enumerate() {
            let slot = f.pos & (w.log().capacity() - 1);
            // SAFETY: a cached frame inside the data area.
            let byte = unsafe { *w.map().data().add((slot + 100) as usize) };
            assert_eq!(byte, i as u8 + 1);
        }
        // The old segment stays intact for whoever still maps it.
        // SAFETY: the old mapping lives (we hold an Arc) and no one writes it any more.
        assert_eq!(unsafe { *old.data().add(100) }, 1);
        // Abandoning keeps the size; a too-big element grows up to its double.
        assert_eq!(w.abandon(nonce()).unwrap(), 0);
        assert_eq!((w.generation(), w.abandons), (2, 1));
        let big = 3 * cap;
        assert!(fill(&mut w, big, 9, 4 * cap).at.is_some());
        assert_eq!(w.log().capacity(), 8 * cap);
        let e = w
            .reserve(MAX_CAPACITY, 64, MAX_CAPACITY, nonce)
            .err()
            .unwrap();
        assert!(matches!(e, Error::ElementTooLarge { .. }), "{e}");
    }

    #[test]
    fn private_leaf_mapping_detaches_and_keeps_its_bytes() {
        let mut w = WindowWriter::new(MIN_CAPACITY, nonce()).unwrap();
        fill(&mut w, 8192, 5, MIN_CAPACITY);
        let peer = WindowMap::attach(w.map().fd().try_clone().unwrap(), None).unwrap();
        let leaf = peer.map_private(4096, 4096).expect("page-aligned leaf");
        assert!(peer.map_private(100, 64).is_none(), "unaligned leaf");
        // SAFETY: the leaf maps 4096 bytes.
        let before = unsafe { *leaf.ptr().add(10) };
        assert_eq!(before, 5);
        leaf.detach().unwrap();
        // The writer may now reuse the bytes: the detached leaf keeps its copy.
        // SAFETY: the writer owns its data area (no holds in this test).
        unsafe { std::ptr::write_bytes(w.map().data().add(4096), 0, 4096) };
        // SAFETY: as above.
        assert_eq!(unsafe { *leaf.ptr().add(10) }, 5);
    }

    #[test]
    fn a_reader_finds_frames_across_a_pad_and_leases_page_aligned_leaves() {
        let cap = MIN_CAPACITY;
        let mut w = WindowWriter::new(cap, nonce()).unwrap();
        // Frames of 3/8 of the segment: the third does not fit before the end (a PAD first,
        // after evicting the first).
        let len = 3 * cap / 8;
        fill(&mut w, len, 1, cap);
        fill(&mut w, len, 2, cap);
        let r = fill(&mut w, len, 3, cap);
        assert_eq!(r.evicted, 1);
        let second = r.at.unwrap().0;
        assert_eq!(second, cap, "the third frame starts after the PAD");
        let fd = w.map().fd().try_clone().unwrap();
        assert!(
            SegmentReader::attach(fd, HOLD_SLOTS, None).is_err(),
            "slot out of range"
        );
        let fd = w.map().fd().try_clone().unwrap();
        let reader = SegmentReader::attach(fd, 5, Some(nonce())).unwrap();
        // `fill` gives every frame seq 0.
        let (pos, bytes) = reader.frame(2 * len, 0).unwrap();
        assert_eq!((pos, bytes.len() as u64), (second, len));
        let e = reader.frame(2 * len, 7).err().unwrap();
        assert!(e.to_string().contains("frame seq 0 where 7"), "{e}");
        let e = reader.frame(100, 0).err().unwrap();
        assert!(e.to_string().contains("cache window"), "{e}");
        // Leases: page-aligned only, held while alive, copied under pressure.
        let mut leases = reader.frame_leases(pos, len, cap, None);
        assert!(leases.leaf(64, 4096).is_none(), "not page-aligned");
        let leaf = leases.leaf(4096, 4096).expect("leased");
        assert_eq!(w.map().min_hold(), second);
        assert_eq!(w.held_slots(), vec![5]);
        // SAFETY: the leaf maps 4096 bytes of the frame.
        assert_eq!(unsafe { *leaf.ptr().add(10) }, 3);
        let mut pressured = reader.frame_leases(pos, len, cap, Some(pos + 1));
        assert!(pressured.leaf(4096, 4096).is_none() && pressured.pressure);
        let mut pinned = reader.frame_leases(pos, len, cap / 4, None);
        assert!(pinned.leaf(4096, 4096).is_none() && pinned.pressure);
        drop(leaves_of(leases));
        drop(leaf);
        assert_eq!(w.map().min_hold(), NO_HOLD);
    }

    fn leaves_of(l: FrameLeases<'_>) -> Option<Arc<FrameHold>> {
        l.hold
    }
}
