//! The ring consumer's stall breaker (TRANSPORT.md §5): when the ring is empty, the
//! producer waits for space and leases pin it, the consumer copies the pinned pages into
//! private memory at the same addresses, maps the memfd afresh for later reads and frees
//! the ring up to what it has handed out. Outstanding views keep their addresses and
//! contents; the old mapping lives until its last lease drops.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::shm::ring::{Consumer, Region};
use crate::shm::segment::Mapping;

/// How long the producer must stay stalled on leased frames before a detach.
pub const STALL_BEFORE_DETACH: Duration = Duration::from_millis(2);

/// Decides when the consumer detaches. Thread-compatible.
#[derive(Debug, Default)]
pub struct StallBreaker {
    since: Option<Instant>,
}

impl StallBreaker {
    /// Called each time the consumer found nothing to read: true once leases have pinned
    /// the ring (`pinned`) while the producer waited (`producer_waiting`) for
    /// [`STALL_BEFORE_DETACH`]; the caller detaches then.
    pub fn should_detach(&mut self, pinned: bool, producer_waiting: bool) -> bool {
        if !(pinned && producer_waiting) {
            self.since = None;
            return false;
        }
        let since = *self.since.get_or_insert_with(Instant::now);
        if since.elapsed() >= STALL_BEFORE_DETACH {
            self.since = None;
            return true;
        }
        false
    }

    /// The wait slice to use: short while leases pin the ring, so the stall is seen soon.
    pub fn slice(pinned: bool, slice: Duration) -> Duration {
        if pinned {
            slice.min(STALL_BEFORE_DETACH)
        } else {
            slice
        }
    }
}

/// Detaches every frame `ring` handed out and has not freed: their pages in `mapping` become
/// private copies, `ring` moves to a fresh mapping of the same memfd (returned), and the ring
/// is freed up to `ring.next_read()`. None if nothing is pinned.
///
/// `mapping` must be the mapping `ring` reads through; the caller must not read frames
/// through it (other than by views already handed out) afterwards.
pub fn detach_pinned(
    mapping: &Arc<Mapping>,
    ring: &mut Consumer,
) -> Result<Option<Arc<Mapping>>, Error> {
    let (start, end) = ring.reclaim.pinned();
    if end <= start {
        return Ok(None);
    }
    let cap = ring.capacity();
    let slot = start & (cap - 1);
    let len = end - start;
    // SAFETY: [start, end) is handed out to the consumer (the producer does not write it
    // until read_pos passes it, which happens only below), and the ring never reads
    // through this mapping again (the fresh mapping replaces it).
    unsafe {
        if slot + len <= cap {
            mapping.privatize(slot, len)?;
        } else {
            mapping.privatize(slot, cap - slot)?;
            mapping.privatize(0, len - (cap - slot))?;
        }
    }
    let fresh = mapping.remap()?;
    let region: Arc<dyn Region> = fresh.clone();
    ring.set_region(region);
    ring.reclaim.detach_all(ring.next_read());
    Ok(Some(fresh))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::layout::MIN_CAPACITY;
    use crate::shm::ring::{Producer, FRAME_MAGIC};

    fn push(p: &mut Producer, len: u64, byte: u8) -> bool {
        let Some(slot) = p.try_reserve(len, 64).unwrap() else {
            return false;
        };
        let ptr = p.slot_ptr(slot);
        // SAFETY: [slot, slot + len) was just reserved for the producer.
        unsafe {
            std::ptr::write_bytes(ptr, byte, len as usize);
            std::ptr::write_unaligned(ptr as *mut u32, FRAME_MAGIC | 1);
            std::ptr::write_unaligned(ptr.add(8) as *mut u64, len);
        }
        p.publish();
        true
    }

    #[test]
    fn detach_frees_the_ring_and_keeps_leased_bytes() {
        let cap = MIN_CAPACITY;
        let mapping = Mapping::create(cap, [1; 16]).unwrap();
        let mut p = Producer::new(mapping.clone());
        let peer = Mapping::attach(mapping.fd().try_clone().unwrap(), Some([1; 16])).unwrap();
        let mut c = Consumer::new(peer.clone());
        let quarter = cap / 4;
        for b in 1..=3u8 {
            assert!(push(&mut p, quarter, b));
        }
        let mut leases = Vec::new();
        let mut ptrs = Vec::new();
        while let Some(f) = c.next_frame().unwrap() {
            ptrs.push(c.frame_ptr(&f) as usize);
            leases.push(c.lease(f.pos + f.len));
        }
        assert_eq!(ptrs.len(), 3);
        assert!(push(&mut p, quarter, 4));
        assert!(!push(&mut p, quarter, 5), "leases pin the ring");
        let fresh = detach_pinned(&peer, &mut c)
            .unwrap()
            .expect("pinned frames");
        // The ring is free up to what was handed out: the producer writes over the frames.
        assert!(push(&mut p, quarter, 5));
        assert!(push(&mut p, quarter, 6));
        for (i, ptr) in ptrs.iter().enumerate() {
            // SAFETY: the old mapping stays alive (`peer`), its pinned pages are private.
            let byte = unsafe { *((*ptr + 100) as *const u8) };
            assert_eq!(byte, i as u8 + 1, "leased frame {i} kept its bytes");
        }
        drop(leases); // stale tickets: ignored
        let f = c.next_frame().unwrap().expect("the fourth frame");
        // SAFETY: a published frame in the fresh mapping.
        assert_eq!(unsafe { *c.frame_ptr(&f).add(100) }, 4);
        let _lease = c.lease(f.pos + f.len);
        assert!(detach_pinned(&fresh, &mut c).unwrap().is_some());
    }

    #[test]
    fn nothing_pinned_means_no_detach() {
        let mapping = Mapping::create(MIN_CAPACITY, [2; 16]).unwrap();
        let mut c = Consumer::new(mapping.clone());
        assert!(detach_pinned(&mapping, &mut c).unwrap().is_none());
    }

    #[test]
    fn the_stall_breaker_waits_for_a_lasting_stall() {
        let mut s = StallBreaker::default();
        assert!(!s.should_detach(true, false));
        assert!(!s.should_detach(true, true), "just started");
        let t = Instant::now();
        while !s.should_detach(true, true) {
            assert!(t.elapsed() < Duration::from_secs(5), "never fired");
            std::thread::yield_now();
        }
        assert!(t.elapsed() >= STALL_BEFORE_DETACH - Duration::from_millis(1));
        assert!(!s.should_detach(true, true), "reset after firing");
        assert_eq!(
            StallBreaker::slice(true, Duration::from_millis(50)),
            STALL_BEFORE_DETACH
        );
        assert_eq!(
            StallBreaker::slice(false, Duration::from_millis(50)),
            Duration::from_millis(50)
        );
    }
}
