//! Property tests of the ring protocol against a `VecDeque` model, and of the frame format
//! (spec round trips; random bytes never panic). Pure Rust:
//!   cargo test --no-default-features --test ring_model
#![cfg(not(loom))]

use std::collections::VecDeque;
use std::sync::Arc;

use _core::shm::ring::{frame_len, Consumer, HeapRegion, Producer, Region, FRAME_MAGIC};
use _core::transport::frame::{self, FrameHeader, LeafKind, LeafSpec, Spec};
use proptest::prelude::*;

const KIND_DATA: u32 = 1;

fn write_frame(p: &mut Producer, len: u64, tag: u8) -> bool {
    let Some(slot) = p.try_reserve(len, 64).unwrap() else {
        return false;
    };
    let ptr = p.slot_ptr(slot);
    // SAFETY: [slot, slot+len) was just reserved for the producer.
    unsafe {
        std::ptr::write_bytes(ptr, tag, len as usize);
        std::ptr::write_unaligned(ptr as *mut u32, FRAME_MAGIC | KIND_DATA);
        std::ptr::write_unaligned(ptr.add(8) as *mut u64, len);
    }
    true
}

#[derive(Debug, Clone)]
enum Op {
    Push(u64),
    Pop,
    Publish,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            3 => (1u64..=1024).prop_map(Op::Push),
            2 => Just(Op::Pop),
            1 => Just(Op::Publish),
        ],
        1..200,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Frames come out in order, intact, exactly when published; PAD frames are invisible;
    /// the ring never claims to be fuller or emptier than the model allows.
    #[test]
    fn ring_matches_a_deque(ops in ops(), cap_log in 12u32..14) {
        let cap = 1u64 << cap_log;
        let region = HeapRegion::new(cap);
        let dynr: Arc<dyn Region> = region.clone();
        let mut p = Producer::new(dynr.clone());
        let mut c = Consumer::new(dynr);
        let mut published: VecDeque<(u64, u8)> = VecDeque::new();
        let mut pending: Vec<(u64, u8)> = Vec::new();
        let mut tag = 0u8;
        for op in ops {
            match op {
                Op::Push(n) => {
                    let len = frame_len(n.max(16)).min(cap / 4);
                    tag = tag.wrapping_add(1).max(1);
                    if write_frame(&mut p, len, tag) {
                        pending.push((len, tag));
                    } else {
                        // Full: the unfreed bytes plus this frame (and any PAD) exceed cap.
                        let used: u64 = published.iter().chain(pending.iter()).map(|f| f.0).sum();
                        prop_assert!(used + len > cap / 2 || used > 0);
                    }
                }
                Op::Publish => {
                    p.publish();
                    published.extend(pending.drain(..));
                }
                Op::Pop => {
                    let got = c.next_frame().unwrap();
                    match published.pop_front() {
                        None => prop_assert!(got.is_none()),
                        Some((len, t)) => {
                            let f = got.expect("a published frame");
                            prop_assert_eq!(f.len, len);
                            // SAFETY: the consumer owns the frame until it pushes it.
                            let bytes = unsafe { std::slice::from_raw_parts(c.frame_ptr(&f), len as usize) };
                            prop_assert!(bytes[16..].iter().all(|&b| b == t));
                            c.reclaim.push(f.pos + f.len, 0);
                        }
                    }
                }
            }
            let h = region.header();
            let w = h.producer.write_pos.load(std::sync::atomic::Ordering::Relaxed);
            let r = h.consumer.read_pos.load(std::sync::atomic::Ordering::Relaxed);
            prop_assert!(r <= w && w <= r + cap);
        }
    }

    /// Out-of-order lease releases free exactly the released prefix.
    #[test]
    fn reclaim_frees_only_the_released_prefix(order in Just((0..8usize).collect::<Vec<_>>()).prop_shuffle()) {
        let region = HeapRegion::new(4096);
        let dynr: Arc<dyn Region> = region.clone();
        let mut p = Producer::new(dynr.clone());
        let mut c = Consumer::new(dynr);
        for i in 0..8 {
            prop_assert!(write_frame(&mut p, 64, i as u8 + 1));
        }
        p.publish();
        let mut tickets = Vec::new();
        for _ in 0..8 {
            let f = c.next_frame().unwrap().unwrap();
            tickets.push(c.reclaim.push(f.pos + f.len, 1));
        }
        let mut released = [false; 8];
        for i in order {
            c.reclaim.release(tickets[i]);
            released[i] = true;
            let prefix = released.iter().take_while(|&&r| r).count() as u64;
            let r = region.header().consumer.read_pos.load(std::sync::atomic::Ordering::Relaxed);
            prop_assert_eq!(r, prefix * 64);
        }
    }

    #[test]
    fn spec_round_trips(spec in spec_strategy()) {
        let mut buf = Vec::new();
        spec.encode(&mut buf);
        prop_assert_eq!(Spec::decode(&buf).unwrap(), spec);
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = Spec::decode(&bytes);
        if bytes.len() >= 32 {
            if let Ok(h) = FrameHeader::parse(&bytes) {
                let leaf = LeafSpec { kind: LeafKind::Array, dtype: "<f4".into(), ndim: 2, itemsize: 4 };
                let _ = frame::parse_leaves(&bytes, &h, &[&leaf], 0);
                let _ = frame::parse_error_body(&bytes[32..], 0);
                let _ = frame::varbytes_items(&bytes[32..], 3, 0);
            }
        }
    }

    /// Random bytes published as ring contents give errors, never a panic.
    #[test]
    fn garbage_in_the_ring_is_an_error(bytes in prop::collection::vec(any::<u8>(), 64..1024), keep_magic in any::<bool>()) {
        let region = HeapRegion::new(4096);
        let dynr: Arc<dyn Region> = region.clone();
        let mut bytes = bytes;
        if keep_magic {
            bytes[0] = 1;
            bytes[1] = 0xD5;
            bytes[2] = 0;
            bytes[3] = 0;
        }
        // SAFETY: nobody else touches the heap region in this test.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), region.data(), bytes.len()) };
        region.header().producer.write_pos.store(bytes.len() as u64, std::sync::atomic::Ordering::Release);
        let mut c = Consumer::new(dynr);
        for _ in 0..32 {
            match c.next_frame() {
                Ok(Some(f)) => {
                    prop_assert!(f.slot + f.len <= 4096 && f.pos + f.len <= bytes.len() as u64);
                    c.reclaim.push(f.pos + f.len, 0);
                }
                Ok(None) | Err(_) => break,
            }
        }
    }
}

fn leaf_strategy() -> impl Strategy<Value = Spec> {
    (1u8..=10, 0u8..5, "[<|][a-zA-Z][0-9]{0,2}").prop_map(|(k, ndim, dtype)| {
        Spec::Leaf(LeafSpec {
            kind: LeafKind::from_u8(k).unwrap(),
            dtype,
            ndim,
            itemsize: u32::from(ndim) * 4,
        })
    })
}

fn spec_strategy() -> impl Strategy<Value = Spec> {
    leaf_strategy().prop_recursive(4, 32, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Spec::Tuple),
            prop::collection::vec(inner.clone(), 0..5).prop_map(Spec::List),
            prop::collection::vec(("[a-z]{0,4}", inner.clone()), 0..5).prop_map(Spec::Dict),
            prop::collection::vec(("[a-z]{1,4}", inner), 0..5).prop_map(|items| {
                let (fields, items): (Vec<_>, Vec<_>) = items.into_iter().unzip();
                Spec::NamedTuple {
                    module: "m".into(),
                    name: "N".into(),
                    fields,
                    items,
                }
            }),
        ]
    })
}
