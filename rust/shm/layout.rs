//! The ring's header page, shared between two processes (TRANSPORT.md §4).
//!
//! Shared memory holds offsets, never pointers. Each cache-line pair (128 B, as crossbeam's
//! `CachePadded` on x86-64/aarch64) has one writer: the creator's constants, the producer's
//! `write_pos` line, the consumer's `read_pos` line, then one counter line per side.

use crate::sync::{AtomicU32, AtomicU64, Futex};

pub const MAGIC: [u8; 8] = *b"DSRING01";
pub const LAYOUT_VERSION: u32 = 1;
/// Frames start on this boundary (bytes).
pub const FRAME_ALIGN: u64 = 64;
/// Smallest and largest ring capacities (bytes, powers of two).
pub const MIN_CAPACITY: u64 = 64 << 10;
pub const MAX_CAPACITY: u64 = 4 << 30;

/// `producer_state` / `consumer_state` values.
pub const STATE_OPEN: u32 = 0;
pub const STATE_CLOSED: u32 = 1;

/// Written once by the creator before the fd leaves the process; read-only afterwards.
#[repr(C)]
pub struct Constants {
    pub magic: [u8; 8],
    pub layout_version: u32,
    pub header_bytes: u32,
    pub capacity_bytes: u64,
    pub max_frame_bytes: u64,
    pub nonce: [u8; 16],
    pub producer_pid: u32,
    pub _reserved: u32,
}

#[repr(C, align(128))]
pub struct ProducerLine {
    /// SYNC(published): stored with Release by the producer, loaded with Acquire by the
    /// consumer; every byte below it is a complete frame.
    pub write_pos: AtomicU64,
    pub state: AtomicU32,
    /// 1 while the producer may sleep on `space` (eventcount flag, TRANSPORT.md §4).
    pub waiting: AtomicU32,
    /// The consumer sleeps here; the producer bumps it after publishing.
    pub data: Futex,
}

#[repr(C, align(128))]
pub struct ConsumerLine {
    /// SYNC(freed): stored with Release by the consumer, loaded with Acquire by the producer;
    /// bytes below it may be overwritten.
    pub read_pos: AtomicU64,
    pub state: AtomicU32,
    /// 1 while the consumer may sleep on `data`.
    pub waiting: AtomicU32,
    /// The producer sleeps here; the consumer bumps it after freeing space.
    pub space: Futex,
    pub consumer_pid: AtomicU32,
}

/// Statistics for `bench/` and debugging, one line per side (Relaxed: no ordering).
#[repr(C, align(128))]
pub struct Counters {
    /// On the consumer's line: elements it has taken out (stored after each take), so a
    /// producer whose consumer went away knows which of its elements it never took.
    pub frames: AtomicU64,
    pub bytes: AtomicU64,
    pub waits: AtomicU64,
    pub detaches: AtomicU64,
}

#[repr(C)]
pub struct RingHeader {
    pub constants: Constants,
    pub _pad: [u8; 128 - std::mem::size_of::<Constants>()],
    pub producer: ProducerLine,
    pub consumer: ConsumerLine,
    pub producer_counters: Counters,
    pub consumer_counters: Counters,
}

#[cfg(not(loom))]
const _: () = {
    assert!(std::mem::size_of::<Constants>() <= 128);
    assert!(std::mem::offset_of!(RingHeader, producer) == 128);
    assert!(std::mem::offset_of!(RingHeader, consumer) == 256);
    assert!(std::mem::offset_of!(RingHeader, producer_counters) == 384);
    assert!(std::mem::offset_of!(RingHeader, consumer_counters) == 512);
    assert!(std::mem::size_of::<RingHeader>() <= 4096);
};

impl RingHeader {
    /// A fresh header for a ring of `capacity_bytes` (heap or shared memory).
    pub fn new(capacity_bytes: u64, header_bytes: u32, nonce: [u8; 16], pid: u32) -> Self {
        let line = |state| ProducerLine {
            write_pos: AtomicU64::new(0),
            state: AtomicU32::new(state),
            waiting: AtomicU32::new(0),
            data: Futex::new(),
        };
        let counters = || Counters {
            frames: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            detaches: AtomicU64::new(0),
        };
        RingHeader {
            constants: Constants {
                magic: MAGIC,
                layout_version: LAYOUT_VERSION,
                header_bytes,
                capacity_bytes,
                max_frame_bytes: max_frame_bytes(capacity_bytes),
                nonce,
                producer_pid: pid,
                _reserved: 0,
            },
            _pad: [0; 128 - std::mem::size_of::<Constants>()],
            producer: line(STATE_OPEN),
            consumer: ConsumerLine {
                read_pos: AtomicU64::new(0),
                state: AtomicU32::new(STATE_OPEN),
                waiting: AtomicU32::new(0),
                space: Futex::new(),
                consumer_pid: AtomicU32::new(0),
            },
            producer_counters: counters(),
            consumer_counters: counters(),
        }
    }
}

/// The largest frame a ring of `capacity_bytes` takes in one piece: a quarter, so a frame
/// plus the PAD before it always fits once the ring is drained, with room to pipeline.
/// Bigger elements travel as CHUNK frames (see `transport::frame`).
pub fn max_frame_bytes(capacity_bytes: u64) -> u64 {
    capacity_bytes / 4
}

/// True if `capacity_bytes` is a supported ring size.
pub fn valid_capacity(capacity_bytes: u64) -> bool {
    capacity_bytes.is_power_of_two() && (MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity_bytes)
}
