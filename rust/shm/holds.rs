//! The cross-trainer cache window's reclaim protocol (see [`crate::shm::window`] for the
//! segment): the writer's log of cached frames and where the next one may go
//! ([`WindowLog`]), the worker-private grants ([`Grants`]), and a trainer's hold table
//! ([`HoldTable`]) that publishes the lowest frame it still has views into.
//!
//! Independent of the mapping: the hold words are any [`HoldWords`] (the segment's header
//! in production, a heap array in tests and in the loom model `tests/rust/loom_window.rs`),
//! and a leased leaf's memory is any [`LeafMapping`]. Atomics and locks come from
//! [`crate::sync`], so loom checks this code as written.
//!
//! Atomics protocol (each Release store and its Acquire load share a SYNC tag):
//! - SYNC(hold): a trainer's reads of a frame happen before the Release store of its hold
//!   word that lifts (or raises past) the frame's position ([`HoldTable`]); the writer's
//!   Acquire load of that word ([`min_hold`]) happens before it overwrites the frame.
//! - Grants are SeqCst (all in the worker's process): set before the worker's reply names a
//!   frame, cleared after the trainer's DONE, which it sends after storing its holds; the
//!   writer loads grants before holds, so a frame is covered by one or the other throughout.
//!
//! A crashed trainer leaves its hold word set; the worker clears it when the trainer's
//! socket hangs up (`release_slot`), when it is the only writer of that word.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Weak};

use crate::error::Error;
use crate::shm::layout::FRAME_ALIGN;
use crate::shm::ring::{pad_before, MIN_FRAME};
use crate::sync::{AtomicBool, AtomicU64, Mutex, MutexGuard, Ordering};

/// Trainer connections one segment serves at once.
pub const HOLD_SLOTS: usize = 64;
/// `hold_pos` of a slot with no holds.
pub const NO_HOLD: u64 = u64::MAX;

/// The shared hold words of one segment, one per trainer connection.
pub trait HoldWords: Send + Sync {
    fn holds(&self) -> &[AtomicU64];
}

/// The lowest hold over every word (Acquire: SYNC(hold)); `NO_HOLD` if none.
pub fn min_hold(words: &[AtomicU64]) -> u64 {
    words
        .iter()
        // SYNC(hold): Release in HoldTable::store_min.
        .map(|h| h.load(Ordering::Acquire))
        .min()
        .unwrap_or(NO_HOLD)
}

/// Hold words on the heap (tests and loom models).
pub struct HeapHolds(pub Vec<AtomicU64>);

impl HeapHolds {
    pub fn new(n: usize) -> Arc<Self> {
        Arc::new(HeapHolds((0..n).map(|_| AtomicU64::new(NO_HOLD)).collect()))
    }
}

impl HoldWords for HeapHolds {
    fn holds(&self) -> &[AtomicU64] {
        &self.0
    }
}

/// Worker-private grants: per slot, the first position of a reply a trainer is still
/// decoding (`NO_HOLD` when none). Set before the reply is sent, cleared on the trainer's
/// DONE message or hang-up, read by the writer before the shared holds (SeqCst: all in one
/// process, no ordering subtleties worth saving). Thread-safe.
pub struct Grants(Vec<AtomicU64>);

impl Default for Grants {
    fn default() -> Self {
        Grants((0..HOLD_SLOTS).map(|_| AtomicU64::new(NO_HOLD)).collect())
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

    /// Clears every slot (the segment they name is being replaced).
    pub fn clear_all(&self) {
        for g in &self.0 {
            g.store(NO_HOLD, Ordering::SeqCst);
        }
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
/// Thread-compatible.
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

    /// The reclaim limit the writer reaches within its next quarter of the segment: a hold
    /// below it stalls the writer soon (trainers copy such frames instead of leasing them).
    pub fn reclaim_soon(&self) -> u64 {
        self.end.saturating_sub(self.cap - self.cap / 4)
    }
}

/// The memory of one leased leaf (a private mapping of the segment in production).
pub trait LeafMapping: Send + Sync {
    /// First byte of the leaf.
    fn ptr(&self) -> *mut u8;
    /// Makes the leaf's pages private memory at the same address, so that they no longer
    /// follow (nor keep alive) the segment.
    fn detach(&self) -> Result<(), Error>;
}

/// A trainer's holds in one segment: how many leased frames start at each position, and
/// the live leaves (to detach them before the holds go). Thread-safe: leaves drop on any
/// thread.
pub struct HoldTable {
    words: Arc<dyn HoldWords>,
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
    /// The table of hold slot `slot` (which must be < `words.holds().len()`).
    pub fn new(words: Arc<dyn HoldWords>, slot: usize) -> Result<Arc<Self>, Error> {
        if slot >= words.holds().len() {
            return Err(Error::LayoutMismatch {
                what: format!("hold slot {slot} out of range"),
            });
        }
        Ok(Arc::new(HoldTable {
            words,
            slot,
            inner: Mutex::new(HoldInner {
                counts: BTreeMap::new(),
                leaves: Vec::new(),
                active: true,
            }),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, HoldInner> {
        // A poisoned lock only means a panic elsewhere; the table stays consistent.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn store_min(&self, g: &HoldInner) {
        if !g.active {
            return;
        }
        let min = g.counts.keys().next().copied().unwrap_or(NO_HOLD);
        // SYNC(hold): Acquire in min_hold.
        self.words.holds()[self.slot].store(min, Ordering::Release);
    }

    /// Holds the frame at `pos` until the returned value drops.
    pub fn acquire(self: &Arc<Self>, pos: u64) -> Arc<FrameHold> {
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
    pub fn min(&self) -> Option<u64> {
        self.lock().counts.keys().next().copied()
    }

    /// A leased leaf of the frame at `pos` over `map`, covered by `hold` and tracked here
    /// (so [`HoldTable::deactivate`] and [`HoldTable::detach_below`] find it).
    pub fn lease(
        &self,
        map: Box<dyn LeafMapping>,
        pos: u64,
        hold: Arc<FrameHold>,
    ) -> Arc<WindowLeaf> {
        let leaf = Arc::new(WindowLeaf {
            map,
            pos,
            hold: Mutex::new(Some(hold)),
            detached: AtomicBool::new(false),
        });
        let mut g = self.lock();
        if g.leaves.len() >= 64 && g.leaves.len().is_power_of_two() {
            g.leaves.retain(|w| w.strong_count() > 0);
        }
        g.leaves.push(Arc::downgrade(&leaf));
        leaf
    }

    /// Gives the slot up: every live leaf becomes private memory (its views keep their
    /// addresses and contents), then the hold word is cleared. Returns the number of
    /// leaves detached. Idempotent.
    pub fn deactivate(&self) -> usize {
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
        let released: Vec<_> = leaves.iter().filter_map(|l| l.take_hold()).collect();
        let mut g = self.lock();
        g.active = false;
        // SYNC(hold): Acquire in min_hold; the detaches' reads of the frames come first.
        self.words.holds()[self.slot].store(NO_HOLD, Ordering::Release);
        drop(g);
        drop(released);
        drop(leaves);
        n
    }

    /// Detaches (copies into private memory) the live leaves of frames below `limit` and
    /// lifts their holds: the writer is about to need that space, and waiting for this
    /// trainer's views would stall everyone. A trainer that keeps views that long pays for
    /// their copy. Returns the number of leaves.
    pub fn detach_below(&self, limit: u64) -> usize {
        let leaves: Vec<Arc<WindowLeaf>> = {
            let mut g = self.lock();
            if !g.active || g.counts.keys().next().is_none_or(|&m| m >= limit) {
                return 0;
            }
            g.leaves.retain(|w| w.strong_count() > 0);
            g.leaves
                .iter()
                .filter_map(|w| w.upgrade())
                .filter(|l| l.pos < limit && !l.is_detached())
                .collect()
        };
        let mut released = Vec::new();
        for leaf in &leaves {
            // The hold stays until the copy is done, so the writer cannot overwrite the
            // pages being copied.
            if leaf.detach() {
                if let Some(h) = leaf.take_hold() {
                    released.push(h);
                }
            }
        }
        let n = released.len();
        drop(released); // lifts the holds (FrameHold::drop)
        drop(leaves);
        n
    }
}

/// One frame's hold; dropped with the last leaf of the frame.
pub struct FrameHold {
    table: Arc<HoldTable>,
    pos: u64,
}

impl Drop for FrameHold {
    fn drop(&mut self) {
        self.table.release(self.pos);
    }
}

/// A leased leaf: its memory, then the frame's hold (fields drop in order, so the pages are
/// unmapped before the hold is lifted).
pub struct WindowLeaf {
    map: Box<dyn LeafMapping>,
    /// The frame's position, and its hold (taken away once the leaf is detached).
    pos: u64,
    hold: Mutex<Option<Arc<FrameHold>>>,
    detached: AtomicBool,
}

impl WindowLeaf {
    pub fn ptr(&self) -> *mut u8 {
        self.map.ptr()
    }

    pub fn is_detached(&self) -> bool {
        // SYNC(detached): AcqRel swap in WindowLeaf::detach.
        self.detached.load(Ordering::Acquire)
    }

    /// Makes the leaf's pages private memory (once); true if it did so now.
    fn detach(&self) -> bool {
        // SYNC(detached): Acquire in WindowLeaf::is_detached; one detach per leaf.
        if self.detached.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.map.detach().is_ok()
    }

    fn take_hold(&self) -> Option<Arc<FrameHold>> {
        self.hold.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

#[cfg(all(test, not(loom)))]
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

    /// Heap memory standing in for a private mapping; counts detaches.
    struct HeapLeaf {
        buf: Box<[u8]>,
        detaches: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl LeafMapping for HeapLeaf {
        fn ptr(&self) -> *mut u8 {
            self.buf.as_ptr() as *mut u8
        }
        fn detach(&self) -> Result<(), Error> {
            self.detaches
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        }
    }

    fn leaf(
        table: &Arc<HoldTable>,
        pos: u64,
        hold: &Arc<FrameHold>,
        detaches: &Arc<std::sync::atomic::AtomicUsize>,
    ) -> Arc<WindowLeaf> {
        let map = Box::new(HeapLeaf {
            buf: vec![0u8; 64].into_boxed_slice(),
            detaches: detaches.clone(),
        });
        table.lease(map, pos, hold.clone())
    }

    #[test]
    fn hold_word_follows_the_lowest_live_frame() {
        let words = HeapHolds::new(4);
        let table = HoldTable::new(words.clone(), 2).unwrap();
        let word = || words.0[2].load(Ordering::Acquire);
        assert_eq!(word(), NO_HOLD);
        let a = table.acquire(128);
        let b = table.acquire(64);
        let b2 = table.acquire(64);
        assert_eq!(word(), 64);
        assert_eq!(min_hold(words.holds()), 64);
        drop(b);
        assert_eq!(word(), 64, "a second leaf still holds frame 64");
        drop(b2);
        assert_eq!(word(), 128);
        assert_eq!(table.min(), Some(128));
        drop(a);
        assert_eq!(word(), NO_HOLD);
        assert_eq!(table.min(), None);
        assert!(HoldTable::new(words, 4).is_err(), "slot past the words");
    }

    #[test]
    fn detach_below_lifts_only_the_old_holds() {
        let words = HeapHolds::new(1);
        let table = HoldTable::new(words.clone(), 0).unwrap();
        let detaches = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (h1, h2) = (table.acquire(0), table.acquire(4096));
        let l1 = leaf(&table, 0, &h1, &detaches);
        let l2 = leaf(&table, 4096, &h2, &detaches);
        drop((h1, h2)); // the leaves keep the holds
        assert_eq!(min_hold(words.holds()), 0);
        assert_eq!(table.detach_below(4096), 1);
        assert!(l1.is_detached() && !l2.is_detached());
        assert_eq!(min_hold(words.holds()), 4096);
        assert_eq!(table.detach_below(4096), 0, "nothing left below the limit");
        drop(l2);
        assert_eq!(min_hold(words.holds()), NO_HOLD);
        assert_eq!(detaches.load(std::sync::atomic::Ordering::Relaxed), 1);
        drop(l1);
    }

    #[test]
    fn deactivate_detaches_live_leaves_and_clears_the_word_once() {
        let words = HeapHolds::new(2);
        let table = HoldTable::new(words.clone(), 1).unwrap();
        let detaches = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let h = table.acquire(640);
        let live = leaf(&table, 640, &h, &detaches);
        let gone = leaf(&table, 640, &h, &detaches);
        drop(gone);
        drop(h);
        assert_eq!(min_hold(words.holds()), 640);
        assert_eq!(table.deactivate(), 1);
        assert_eq!(min_hold(words.holds()), NO_HOLD);
        // The slot is no longer the table's: new holds leave the word alone.
        let again = table.acquire(64);
        assert_eq!(words.0[1].load(Ordering::Acquire), NO_HOLD);
        assert_eq!(table.deactivate(), 0, "idempotent");
        drop((again, live));
    }

    #[test]
    fn grants_cover_until_cleared() {
        let g = Grants::default();
        assert_eq!(g.min(), NO_HOLD);
        g.set(3, 500);
        g.set(7, 200);
        assert_eq!(g.min(), 200);
        g.clear(7);
        assert_eq!(g.min(), 500);
        g.set(HOLD_SLOTS, 1); // out of range: ignored
        g.clear_all();
        assert_eq!(g.min(), NO_HOLD);
    }

    #[test]
    fn held_frame_blocks_the_writer_until_released() {
        let mut log = WindowLog::new(256);
        log.push(0, 128, 64, 1);
        log.push(128, 128, 64, 1);
        assert_eq!(log.try_place(128, 64, NO_HOLD), Place::EvictOldest);
        log.evict_oldest();
        assert_eq!(
            log.try_place(128, 64, 0),
            Place::Held,
            "a hold below the window"
        );
        assert_eq!(
            log.try_place(128, 64, NO_HOLD),
            Place::Write {
                pos: 256,
                slot: 0,
                pad: 0,
                pad_slot: 0
            }
        );
        assert_eq!(log.reclaim_soon(), 256 - 192);
    }
}
