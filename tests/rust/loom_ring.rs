//! loom models of the ring protocol (TRANSPORT.md §8): publish/consume across a PAD wrap, the
//! eventcount (no lost wake-up, both directions), and lease releases out of order. Run:
//!   .ci/loom, or: RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test --release --no-default-features --test loom_ring
//! Payload bytes are modelled as Relaxed atomics next to the heap ring, so a missing
//! Release/Acquire pairing shows up as a stale read.
#![cfg(loom)]

use std::sync::Arc;
use std::time::Duration;

use _core::shm::ring::{Consumer, HeapRegion, Producer, Region, FRAME_MAGIC};
use loom::sync::atomic::{AtomicU64, Ordering};

const KIND_DATA: u32 = 1;

struct Ring {
    region: Arc<HeapRegion>,
    /// One payload word per 64-byte slot.
    payload: Vec<AtomicU64>,
}

fn ring(cap: u64) -> Arc<Ring> {
    Arc::new(Ring {
        region: HeapRegion::new(cap),
        payload: (0..cap / 64).map(|_| AtomicU64::new(0)).collect(),
    })
}

fn push(p: &mut Producer, r: &Ring, len: u64, value: u64) -> bool {
    let Some(slot) = p.try_reserve(len, 64).unwrap() else {
        return false;
    };
    let ptr = p.slot_ptr(slot);
    // SAFETY: [slot, slot+len) was just reserved for the producer.
    unsafe {
        std::ptr::write_unaligned(ptr as *mut u32, FRAME_MAGIC | KIND_DATA);
        std::ptr::write_unaligned(ptr.add(8) as *mut u64, len);
    }
    r.payload[(slot / 64) as usize].store(value, Ordering::Relaxed);
    true
}

#[test]
fn publish_and_consume_across_the_wrap() {
    loom::model(|| {
        let r = ring(256); // frames of 128 B: the third wraps with a PAD when 64 B are used
        let dynr: Arc<dyn Region> = r.region.clone();
        let mut p = Producer::new(dynr.clone());
        let mut c = Consumer::new(dynr);
        let r2 = r.clone();
        let producer = loom::thread::spawn(move || {
            let sizes = [64u64, 128, 128];
            for (i, &len) in sizes.iter().enumerate() {
                while !push(&mut p, &r2, len, i as u64 + 1) {
                    p.publish();
                    p.wait_for_space(p.need_for(len, 64), Duration::from_millis(50));
                }
                p.publish();
            }
        });
        let mut seen = 0;
        while seen < 3 {
            match c.next_frame().unwrap() {
                Some(f) => {
                    let v = r.payload[(f.slot / 64) as usize].load(Ordering::Relaxed);
                    assert_eq!(
                        v,
                        seen + 1,
                        "stale payload: publish/consume ordering broken"
                    );
                    c.reclaim.push(f.pos + f.len, 0);
                    seen += 1;
                }
                None => {
                    c.wait_for_data(Duration::from_millis(50));
                }
            }
        }
        producer.join().unwrap();
    });
}

#[test]
fn consumer_sleeping_on_empty_is_always_woken() {
    loom::model(|| {
        let r = ring(256);
        let dynr: Arc<dyn Region> = r.region.clone();
        let mut p = Producer::new(dynr.clone());
        let mut c = Consumer::new(dynr);
        let r2 = r.clone();
        let producer = loom::thread::spawn(move || {
            assert!(push(&mut p, &r2, 64, 7));
            p.publish();
        });
        // Under loom the futex wait has no timeout: a lost wake-up is a deadlock loom reports.
        while !c.wait_for_data(Duration::from_secs(3600)) {}
        let f = c.next_frame().unwrap().unwrap();
        assert_eq!(r.payload[(f.slot / 64) as usize].load(Ordering::Relaxed), 7);
        producer.join().unwrap();
    });
}

#[test]
fn producer_sleeping_on_full_is_always_woken() {
    loom::model(|| {
        let r = ring(256);
        let dynr: Arc<dyn Region> = r.region.clone();
        let mut p = Producer::new(dynr.clone());
        let mut c = Consumer::new(dynr);
        assert!(push(&mut p, &r, 128, 1));
        p.publish();
        let consumer = loom::thread::spawn(move || {
            let f = c.next_frame().unwrap().unwrap();
            c.reclaim.push(f.pos + f.len, 0);
        });
        // 128 more bytes fit only once the consumer frees the first frame... after 128 free.
        assert!(push(&mut p, &r, 64, 2));
        while !p.wait_for_space(p.need_for(128, 64), Duration::from_secs(3600)) {}
        assert!(push(&mut p, &r, 128, 3));
        consumer.join().unwrap();
    });
}

#[test]
fn leases_released_out_of_order_free_the_prefix() {
    loom::model(|| {
        let r = ring(256);
        let dynr: Arc<dyn Region> = r.region.clone();
        let mut p = Producer::new(dynr.clone());
        let mut c = Consumer::new(dynr);
        assert!(push(&mut p, &r, 64, 1));
        assert!(push(&mut p, &r, 64, 2));
        p.publish();
        let f1 = c.next_frame().unwrap().unwrap();
        let t1 = c.reclaim.push(f1.pos + f1.len, 1);
        let f2 = c.next_frame().unwrap().unwrap();
        let t2 = c.reclaim.push(f2.pos + f2.len, 1);
        let reclaim = c.reclaim.clone();
        let other = loom::thread::spawn(move || reclaim.release(t2));
        c.reclaim.release(t1);
        other.join().unwrap();
        let read = r
            .region
            .header()
            .consumer
            .read_pos
            .load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(read, 128);
    });
}
