//! The ring producer's frame writer (TRANSPORT.md §4, §7): reserves slots for frames, copies
//! them in (big copies with the caller's lock released), waits for space in slices while
//! watching the consumer, writes elements bigger than the largest frame as CHUNK frames, and
//! batches reserved frames so that one release of the caller's lock (the GIL) covers many
//! copies. Independent of Python: the caller supplies an [`Unlock`] (the Python bindings
//! release the GIL and check signals; tests run inline).

use std::time::Instant;

use crate::error::Error;
use crate::shm::ring::Producer;
use crate::transport::chunk;
use crate::transport::frame::{self, FramePlan};
use crate::transport::peer::{wait_slice, Peer};

/// Frames of at least this many payload bytes are copied into the ring with the caller's
/// lock released: on a worker the task's pipeline thread runs meanwhile; a 64 KiB copy
/// takes ~5 µs, far more than a release and re-acquire of an uncontended GIL.
pub const UNLOCKED_COPY_BYTES: u64 = 64 << 10;
/// A writer publishes early for a waiting consumer once this many elements or bytes are
/// written (not after every element: one wake-up, a futex syscall, per small element would
/// cost more than the element), and always at the end of a batch.
pub const PUBLISH_EVERY_ELEMENTS: u32 = 64;
pub const PUBLISH_EVERY_BYTES: u64 = 64 << 10;
/// Most frames / payload bytes reserved before they are copied.
pub const PENDING_MAX_FRAMES: usize = 64;
pub const PENDING_MAX_BYTES: u64 = 4 << 20;

/// How the writer's caller runs slow work and learns it must stop.
pub trait Unlock {
    type Err: From<Error>;
    /// Runs `f` with the caller's lock (the GIL) released.
    fn unlocked<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R;
    /// Called between wait slices: Err stops the wait (a signal, Ctrl-C).
    fn check(&self) -> Result<(), Self::Err>;
}

/// Runs everything inline (tests, and callers that hold no lock).
pub struct Inline;

impl Unlock for Inline {
    type Err = Error;
    fn unlocked<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }
    fn check(&self) -> Result<(), Error> {
        Ok(())
    }
}

/// A destination pointer moved into an unlocked copy.
struct Dst(*mut u8);
// SAFETY: the pointer names ring bytes reserved for the one writer, which waits for the copy.
unsafe impl Send for Dst {}

/// The producer end of a ring as a frame writer. Thread-compatible: one thread at a time.
pub struct FrameWriter {
    pub ring: Producer,
    /// The consumer, checked between wait slices.
    pub peer: Peer,
    seq: u64,
    /// The spec id of the frames written now.
    pub spec_id: u32,
    max_frame: u64,
    /// Frames reserved and not yet copied (`flush` copies them): nothing is published or
    /// waited for while any is pending.
    pending: Vec<(FramePlan<'static>, u64)>,
    pending_bytes: u64,
}

fn align_of(plan: &FramePlan<'_>) -> u64 {
    if plan.page_align {
        frame::LEASE_ALIGN
    } else {
        64
    }
}

impl FrameWriter {
    pub fn new(ring: Producer, peer: Peer) -> Self {
        let max_frame = crate::shm::layout::max_frame_bytes(ring.capacity());
        FrameWriter {
            ring,
            peer,
            seq: 0,
            spec_id: 0,
            max_frame,
            pending: Vec::new(),
            pending_bytes: 0,
        }
    }

    /// The largest frame written in one piece (bigger ones travel as chunks).
    pub fn max_frame(&self) -> u64 {
        self.max_frame
    }

    fn next_seq(&mut self) -> u64 {
        let s = self.seq;
        self.seq += 1;
        s
    }

    /// Waits (unlocked, in slices) until `need` bytes are free or `deadline` passes; the
    /// frames written so far are published first. Ok(false) on timeout.
    ///
    /// Raises `PeerDied` when the consumer is gone, or the caller's `check` error.
    pub fn wait_space<U: Unlock>(
        &mut self,
        u: &U,
        need: u64,
        deadline: Option<Instant>,
    ) -> Result<bool, U::Err> {
        debug_assert!(self.pending.is_empty(), "flush before waiting");
        self.ring.publish();
        loop {
            let Some(slice) = wait_slice(deadline) else {
                return Ok(false);
            };
            let ring = &mut self.ring;
            if u.unlocked(|| ring.wait_for_space(need, slice)) {
                return Ok(true);
            }
            u.check()?;
            self.peer.check()?;
        }
    }

    /// Allocates the ring memory the next frame of `len` needs (its first lap) with the
    /// caller's lock released, so that `try_reserve` finds it allocated (or knows it
    /// cannot be, and runs the ring within what it has).
    fn reserve_storage<U: Unlock>(&mut self, u: &U, len: u64, align: u64) {
        if !self.ring.needs_storage(len, align) {
            return;
        }
        let end = self.ring.storage_end(len, align);
        let region = self.ring.region().clone();
        let reserved = u.unlocked(move || region.reserve(end));
        self.ring.after_reserve(reserved);
    }

    /// Reserves a slot for `plan` (and gives it its sequence number) if the ring has room
    /// now, and queues its copy; None (nothing reserved) when it has not. The caller keeps
    /// the plan's payload buffers alive and pinned until the next [`FrameWriter::flush`].
    pub fn try_push(&mut self, mut plan: FramePlan<'static>) -> Result<(), FramePlan<'static>> {
        let (len, align) = (plan.total_bytes, align_of(&plan));
        if self.ring.needs_storage(len, align) {
            return Err(plan); // `write` allocates it unlocked (and raises what that fails with)
        }
        let Ok(Some(slot)) = self.ring.try_reserve(len, align) else {
            return Err(plan);
        };
        plan.set_seq(self.next_seq());
        self.pending_bytes += plan.payload_bytes;
        self.pending.push((plan, slot));
        Ok(())
    }

    /// True when enough is pending that it should be copied now.
    pub fn pending_full(&self) -> bool {
        self.pending.len() >= PENDING_MAX_FRAMES || self.pending_bytes >= PENDING_MAX_BYTES
    }

    /// Copies every pending frame into its slot (unlocked when big enough to be worth
    /// it). Must run before the writer publishes or waits.
    pub fn flush<U: Unlock>(&mut self, u: &U) {
        if self.pending.is_empty() {
            return;
        }
        let jobs: Vec<(Dst, &FramePlan<'static>)> = self
            .pending
            .iter()
            .map(|(plan, slot)| (Dst(self.ring.slot_ptr(*slot)), plan))
            .collect();
        let copy = move || {
            for (dst, plan) in jobs {
                // SAFETY: each slot was reserved by `try_push` for exactly
                // `plan.total_bytes` (free, inside the data area, disjoint from the others)
                // and nothing is published until this copy is done; the caller keeps the
                // payloads alive and pinned until the flush (try_push's contract).
                unsafe { plan.copy_range(0, plan.total_bytes, dst.0) }
            }
        };
        if self.pending_bytes >= UNLOCKED_COPY_BYTES {
            u.unlocked(copy);
        } else {
            copy();
        }
        self.pending.clear();
        self.pending_bytes = 0;
    }

    /// Writes one whole frame, waiting for space up to `deadline`; Ok(false) if it passed
    /// first (nothing written). Pending frames are flushed first.
    pub fn write<U: Unlock>(
        &mut self,
        u: &U,
        plan: &mut FramePlan<'_>,
        deadline: Option<Instant>,
    ) -> Result<bool, U::Err> {
        self.flush(u);
        let (len, align) = (plan.total_bytes, align_of(plan));
        self.reserve_storage(u, len, align);
        let slot = loop {
            if let Some(slot) = self.ring.try_reserve(len, align)? {
                break slot;
            }
            let need = self.ring.need_for(len, align);
            if !self.wait_space(u, need, deadline)? {
                return Ok(false);
            }
        };
        plan.set_seq(self.next_seq());
        let dst = Dst(self.ring.slot_ptr(slot));
        let p: &FramePlan<'_> = plan;
        // SAFETY (both arms): [slot, slot+len) was just reserved (free, inside the data
        // area) and only this producer writes it until publish; payloads are pinned by the
        // caller.
        if p.payload_bytes >= UNLOCKED_COPY_BYTES {
            u.unlocked(move || {
                let dst = dst;
                // SAFETY: see above.
                unsafe { p.copy_range(0, len, dst.0) }
            });
        } else {
            // SAFETY: see above.
            unsafe { p.copy_range(0, len, dst.0) };
        }
        Ok(true)
    }

    /// Writes a frame bigger than the largest frame as CHUNK frames, publishing each (no
    /// timeout: once started, an element is finished unless the consumer dies).
    pub fn write_chunked<U: Unlock>(&mut self, u: &U, plan: &FramePlan<'_>) -> Result<(), U::Err> {
        self.flush(u);
        let total = plan.total_bytes;
        for piece in chunk::pieces(total, self.max_frame) {
            let len = piece.frame_bytes;
            self.reserve_storage(u, len, 64);
            let slot = loop {
                if let Some(slot) = self.ring.try_reserve(len, 64)? {
                    break slot;
                }
                let need = self.ring.need_for(len, 64);
                self.wait_space(u, need, None)?;
            };
            let prefix = chunk::prefix(&piece, total, self.next_seq(), self.spec_id);
            let dst = Dst(self.ring.slot_ptr(slot));
            u.unlocked(move || {
                let dst = dst;
                // SAFETY: [slot, slot+len) is reserved for us; the prefix (56 B) and n bytes
                // of the plan fit in len by construction (chunk::pieces).
                unsafe {
                    std::ptr::copy_nonoverlapping(prefix.as_ptr(), dst.0, prefix.len());
                    plan.copy_range(
                        piece.offset,
                        piece.offset + piece.n,
                        dst.0.add(prefix.len()),
                    );
                }
            });
            self.ring.publish();
        }
        Ok(())
    }

    /// After `unpublished` more elements: publishes (copying what is pending) when enough
    /// is unpublished and the consumer may be asleep waiting for it; true if it did.
    pub fn publish_for_waiting_consumer<U: Unlock>(&mut self, u: &U, unpublished: u32) -> bool {
        if (unpublished >= PUBLISH_EVERY_ELEMENTS
            || self.ring.unpublished_bytes() >= PUBLISH_EVERY_BYTES)
            && self.ring.consumer_waiting()
        {
            self.flush(u);
            self.ring.publish();
            return true;
        }
        false
    }

    /// Copies what is pending and publishes everything written.
    pub fn publish<U: Unlock>(&mut self, u: &U) {
        self.flush(u);
        self.ring.publish();
    }

    /// Writes a SPEC, END or ERROR frame of `body`; Ok(false) on timeout.
    ///
    /// Raises `ElementTooLarge` when the frame exceeds the largest frame.
    pub fn write_simple<U: Unlock>(
        &mut self,
        u: &U,
        kind: u32,
        body: &[u8],
        deadline: Option<Instant>,
    ) -> Result<bool, U::Err> {
        let mut plan = FramePlan::simple(kind, self.spec_id, body);
        if plan.total_bytes > self.max_frame {
            return Err(Error::ElementTooLarge {
                element_bytes: plan.total_bytes,
                limit_bytes: self.max_frame,
                what: "a spec or error frame must fit the ring's largest frame".into(),
            }
            .into());
        }
        self.write(u, &mut plan, deadline)
    }

    /// Writes a SPEC frame for the encoded spec `spec` under a new spec id; Ok(false) on
    /// timeout (the spec id is not taken then).
    pub fn write_spec<U: Unlock>(
        &mut self,
        u: &U,
        spec: &[u8],
        deadline: Option<Instant>,
    ) -> Result<bool, U::Err> {
        let mut body = (spec.len() as u32).to_le_bytes().to_vec();
        body.extend_from_slice(spec);
        self.spec_id = self.spec_id.wrapping_add(1);
        let ok = self.write_simple(u, frame::KIND_SPEC, &body, deadline)?;
        if !ok {
            self.spec_id = self.spec_id.wrapping_sub(1);
        }
        Ok(ok)
    }

    /// Writes an ERROR frame of a worker-side exception, its message cut (at a character
    /// boundary) to fit the largest frame; Ok(false) on timeout.
    pub fn write_error<U: Unlock>(
        &mut self,
        u: &U,
        type_name: &str,
        message: &str,
        deadline: Option<Instant>,
    ) -> Result<bool, U::Err> {
        let mut message = message.to_string();
        let limit = (self.max_frame as usize).saturating_sub(256 + type_name.len());
        if message.len() > limit {
            let mut cut = limit;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        let body = frame::error_body(type_name, &message);
        let ok = self.write_simple(u, frame::KIND_ERROR, &body, deadline)?;
        self.ring.publish();
        Ok(ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::ring::{Consumer, HeapRegion, Region};
    use crate::transport::chunk::Reassembly;
    use crate::transport::frame::{FrameHeader, LeafIn, LeafKind, Payload};
    use std::sync::Arc;
    use std::time::Duration;

    fn ring(cap: u64) -> (FrameWriter, Consumer) {
        let r: Arc<dyn Region> = HeapRegion::new(cap);
        (
            FrameWriter::new(Producer::new(r.clone()), Peer::none("consumer")),
            Consumer::new(r),
        )
    }

    fn plan(n: usize, byte: u8) -> FramePlan<'static> {
        FramePlan::data(
            1,
            vec![LeafIn {
                kind: LeafKind::Bytes,
                itemsize: 1,
                dims: vec![].into(),
                payload: Payload::Owned(vec![byte; n]),
            }],
        )
    }

    /// Every frame the consumer sees: (kind, seq, bytes), freeing each.
    fn drain(c: &mut Consumer) -> Vec<(u32, u64, Vec<u8>)> {
        let mut out = Vec::new();
        while let Some(f) = c.next_frame().unwrap() {
            // SAFETY: a published frame, freed only below.
            let b = unsafe { std::slice::from_raw_parts(c.frame_ptr(&f), f.len as usize) };
            out.push((f.kind, FrameHeader::parse(b).unwrap().seq, b.to_vec()));
            c.mark_free(f.pos + f.len);
        }
        c.flush_free();
        out
    }

    #[test]
    fn pending_frames_are_copied_before_they_are_published() {
        let (mut w, mut c) = ring(1 << 16);
        assert!(w.write_spec(&Inline, b"spec", None).unwrap());
        for i in 0..3u8 {
            assert!(w.try_push(plan(100, i)).is_ok());
        }
        assert!(!w.pending_full());
        w.flush(&Inline);
        w.ring.publish();
        let frames = drain(&mut c);
        let kinds: Vec<u32> = frames.iter().map(|f| f.0).collect();
        assert_eq!(kinds, [frame::KIND_SPEC, 1, 1, 1]);
        let seqs: Vec<u64> = frames.iter().map(|f| f.1).collect();
        assert_eq!(seqs, [0, 1, 2, 3], "consecutive sequence numbers");
        assert!(frames[3].2.windows(100).any(|w| w.iter().all(|&b| b == 2)));
    }

    #[cfg(not(loom))]
    #[test]
    fn a_ring_allocated_in_parts_allocates_as_its_first_lap_reaches_it() {
        use crate::shm::segment::Mapping;
        use std::os::fd::AsFd;
        let cap = 8u64 << 20;
        let m = Mapping::create_reserving(cap, [3; 16], 1 << 20).unwrap();
        let header = m.header_bytes();
        let allocated = || rustix::fs::fstat(m.fd().as_fd()).unwrap().st_blocks as u64 * 512;
        assert_eq!(m.reserved_bytes(), 1 << 20);
        assert_eq!(
            allocated(),
            header + (1 << 20),
            "only the first MiB is allocated"
        );
        let r: Arc<dyn Region> = m.clone();
        let mut w = FrameWriter::new(Producer::new(r.clone()), Peer::none("consumer"));
        let mut c = Consumer::new(r);
        let frame = plan(100_000, 0).total_bytes;
        // Frames that fit in the allocated part go the batched way; the first past it is
        // refused there (its memory is allocated by `write`, with the lock released).
        let mut batched = 0u64;
        while w.try_push(plan(100_000, 0)).is_ok() {
            batched += 1;
        }
        assert!(batched >= 8 && batched * frame <= 1 << 20, "{batched}");
        assert_eq!(m.reserved_bytes(), 1 << 20);
        w.flush(&Inline);
        w.ring.publish();
        drain(&mut c);
        let written = || {
            m.header()
                .producer
                .write_pos
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        let mut steps = vec![m.reserved_bytes()];
        for i in 1..=(2 * cap / frame) {
            let byte = (i % 251) as u8;
            assert!(w.write(&Inline, &mut plan(100_000, byte), None).unwrap());
            w.ring.publish();
            let reserved = m.reserved_bytes();
            if written() < cap - frame {
                // Never more than twice what the first lap reached, rounded to 1 MiB.
                assert!(
                    reserved <= (2 * written()).next_multiple_of(1 << 20),
                    "{reserved}"
                );
            }
            if reserved != *steps.last().unwrap() {
                steps.push(reserved);
            }
            let frames = drain(&mut c);
            let data: Vec<_> = frames.iter().filter(|f| f.0 == 1).collect();
            assert_eq!(data.len(), 1);
            assert!(data[0].2[64..]
                .windows(4096)
                .any(|x| x.iter().all(|&b| b == byte)));
        }
        assert_eq!(
            steps,
            [1 << 20, 2 << 20, 4 << 20, 8 << 20],
            "doubling steps"
        );
        assert_eq!(m.reserved_bytes(), cap);
        assert_eq!(allocated(), header + cap, "after the first lap, all of it");
    }

    /// A heap region whose memory can be allocated only up to `limit` data bytes.
    struct Limited {
        heap: Arc<HeapRegion>,
        reserved: std::sync::atomic::AtomicU64,
        limit: u64,
        /// Calls of `reserve`.
        calls: std::sync::atomic::AtomicU64,
    }

    // SAFETY: forwards to the heap region, which stays alive with self.
    unsafe impl Region for Limited {
        fn header(&self) -> &crate::shm::layout::RingHeader {
            self.heap.header()
        }
        fn data(&self) -> *mut u8 {
            self.heap.data()
        }
        fn capacity(&self) -> u64 {
            self.heap.capacity()
        }
        fn reserved_bytes(&self) -> u64 {
            self.reserved.load(std::sync::atomic::Ordering::Relaxed)
        }
        fn reserve(&self, end: u64) -> Result<(), Error> {
            self.calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if end > self.limit {
                return Err(Error::ShmExhausted {
                    requested_bytes: end,
                    available_bytes: 0,
                    source: std::io::Error::from_raw_os_error(28), // ENOSPC
                });
            }
            let want = end.max(self.reserved_bytes()).next_multiple_of(4096);
            self.reserved
                .fetch_max(want, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        }
    }

    #[test]
    fn a_ring_that_cannot_allocate_more_runs_within_what_it_has() {
        let cap = 1u64 << 20;
        let limited = Arc::new(Limited {
            heap: HeapRegion::new(cap),
            reserved: 4096.into(),
            limit: 200_000,
            calls: 0.into(),
        });
        let r: Arc<dyn Region> = limited.clone();
        let mut w = FrameWriter::new(Producer::new(r.clone()), Peer::none("consumer"));
        let mut c = Consumer::new(r);
        let mut seen = Vec::new();
        for i in 0..40u8 {
            // 30 KB frames: the sixth needs memory past the 200 KB limit.
            assert!(w.write(&Inline, &mut plan(30_000, i), None).unwrap());
            w.ring.publish();
            for (kind, _, bytes) in drain(&mut c) {
                if kind == 1 {
                    let frame_slot = c.next_read().wrapping_sub(bytes.len() as u64) & (cap - 1);
                    assert!(frame_slot + bytes.len() as u64 <= limited.reserved_bytes());
                    seen.push(bytes[200]);
                }
            }
        }
        assert_eq!(seen, (0..40u8).collect::<Vec<_>>(), "every frame, in order");
        let reserved = limited.reserved_bytes();
        assert!((150_000..=200_000).contains(&reserved), "{reserved}");
        // One failed allocation, then no more tries.
        let calls = limited.calls.load(std::sync::atomic::Ordering::Relaxed);
        w.write(&Inline, &mut plan(30_000, 0), None).unwrap();
        assert_eq!(
            limited.calls.load(std::sync::atomic::Ordering::Relaxed),
            calls
        );
        // A frame bigger than the memory the ring has is a clear error, nothing written.
        let before = w.ring.unpublished_bytes();
        let e = w.write(&Inline, &mut plan(250_000, 1), None).err().unwrap();
        assert!(matches!(e, Error::ShmExhausted { .. }), "{e}");
        assert_eq!(w.ring.unpublished_bytes(), before);
    }

    #[test]
    fn a_full_ring_times_out_and_a_dead_consumer_is_reported() {
        let (mut w, _c) = ring(1 << 16);
        let mut n = 0;
        while w.try_push(plan(100, 1)).is_ok() {
            n += 1;
        }
        let frame = plan(100, 1).total_bytes;
        assert_eq!(n, (1 << 16) / frame, "the ring holds as many frames as fit");
        w.flush(&Inline);
        let soon = Some(Instant::now() + Duration::from_millis(20));
        assert!(!w.write(&Inline, &mut plan(100, 1), soon).unwrap());
        // The consumer's socket hangs up: the wait stops with PeerDied.
        let (a, b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        use std::os::fd::AsRawFd;
        w.peer = Peer::new(Some(a.as_raw_fd()), None, "consumer").unwrap();
        drop((a, b));
        let e = w.write(&Inline, &mut plan(100, 1), None).err().unwrap();
        assert!(matches!(e, Error::PeerDied { .. }), "{e}");
    }

    #[test]
    fn a_big_element_travels_in_chunks_and_is_rebuilt() {
        let (mut w, mut c) = ring(1 << 16);
        let big = plan(100_000, 9);
        let total = big.total_bytes;
        let consumer = std::thread::spawn(move || {
            let mut r = Reassembly::default();
            loop {
                for (kind, _, bytes) in drain(&mut c) {
                    assert_eq!(kind, frame::KIND_CHUNK);
                    r.accept(&bytes, 0).unwrap().run();
                    let flags = FrameHeader::parse(&bytes).unwrap().flags;
                    if let Some(buf) = r.finish(flags, 0).unwrap() {
                        return buf.as_slice().to_vec();
                    }
                }
                c.wait_for_data(Duration::from_millis(50));
            }
        });
        w.write_chunked(&Inline, &big).unwrap();
        let whole = consumer.join().unwrap();
        assert_eq!(whole.len() as u64, total);
        let mut expect = vec![0u8; total as usize];
        // SAFETY: expect holds total bytes.
        unsafe { big.copy_range(0, total, expect.as_mut_ptr()) };
        assert_eq!(whole, expect);
    }

    #[test]
    fn error_messages_are_cut_to_fit_and_oversized_frames_refused() {
        let (mut w, mut c) = ring(1 << 16);
        let long = "é".repeat(20_000);
        assert!(w.write_error(&Inline, "ValueError", &long, None).unwrap());
        let frames = drain(&mut c);
        assert_eq!(frames[0].0, frame::KIND_ERROR);
        let (t, m) = frame::parse_error_body(&frames[0].2[frame::HEADER_BYTES..], 0).unwrap();
        assert_eq!(t, "ValueError");
        assert!(m.len() < long.len() && long.starts_with(&m));
        let body = vec![0u8; 1 << 15];
        let e = w.write_simple(&Inline, frame::KIND_SPEC, &body, None);
        assert!(matches!(e, Err(Error::ElementTooLarge { .. })));
    }
}
