//! The ring consumer's frame stream (TRANSPORT.md §4, §6): the frames of a ring in order,
//! PADs skipped, with the checks every consumer makes before decoding: consecutive
//! sequence numbers, and no other frame inside a chunked element. The frame's bytes stay
//! readable through the [`RingFrame`] handle (it keeps the mapping) until the consumer frees
//! or leases the frame. Independent of Python.

use std::sync::Arc;

use crate::error::Error;
use crate::shm::ring::{Consumer, FrameRef, Region};
use crate::transport::chunk::Reassembly;
use crate::transport::frame::{self, FrameHeader, Spec};

/// One frame handed out by [`FrameStream::next`]; its bytes are the producer's until the
/// consumer marks it free (`Consumer::mark_free`) or leases it, which it does only after it
/// is done reading them.
pub struct RingFrame {
    pub frame: FrameRef,
    pub header: FrameHeader,
    ptr: *const u8,
    _keep: Arc<dyn Region>,
}

impl RingFrame {
    /// The frame's bytes (`frame.len` of them).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: Consumer::next_frame validated [slot, slot + len) inside the data area and
        // below the Acquire-loaded write_pos; `_keep` keeps the mapping alive, and the
        // producer does not reuse the bytes before the consumer frees them (after reading).
        unsafe { std::slice::from_raw_parts(self.ptr, self.frame.len as usize) }
    }

    /// Position after the frame (what freeing or leasing it names).
    pub fn end(&self) -> u64 {
        self.frame.pos + self.frame.len
    }

    /// A SPEC frame's (spec_id, spec).
    ///
    /// Raises `RingCorrupted` when the body is not an encoded spec.
    pub fn spec(&self) -> Result<(u32, Spec), Error> {
        let mut r = frame::Reader::new(self.bytes(), frame::HEADER_BYTES);
        let n = r.u32()? as usize;
        Ok((self.header.spec_id, Spec::decode(r.bytes(n)?)?))
    }

    /// An ERROR frame's (type name, message).
    pub fn error(&self) -> Result<(String, String), Error> {
        frame::parse_error_body(&self.bytes()[frame::HEADER_BYTES..], self.frame.pos)
    }
}

/// The consumer's reading state over a ring. Thread-compatible.
#[derive(Default)]
pub struct FrameStream {
    expect_seq: u64,
    /// The chunked element being rebuilt.
    pub chunks: Reassembly,
}

impl FrameStream {
    /// The next frame of `ring` (PADs skipped), or None when nothing more is published.
    ///
    /// Raises `RingCorrupted` for a malformed frame, a sequence gap, or a frame inside a
    /// chunked element.
    pub fn next(&mut self, ring: &mut Consumer) -> Result<Option<RingFrame>, Error> {
        let Some(f) = ring.next_frame()? else {
            return Ok(None);
        };
        let rf = RingFrame {
            frame: f,
            header: FrameHeader {
                kind: 0,
                flags: 0,
                total_bytes: 0,
                seq: 0,
                spec_id: 0,
                n_leaves: 0,
            },
            ptr: ring.frame_ptr(&f),
            _keep: ring.region().clone(),
        };
        let header = FrameHeader::parse(rf.bytes())?;
        if header.seq != self.expect_seq {
            return Err(frame::corrupt(
                f.pos,
                &format!(
                    "frame seq {} where {} was expected",
                    header.seq, self.expect_seq
                ),
            ));
        }
        self.expect_seq += 1;
        if self.chunks.in_progress() && f.kind != frame::KIND_CHUNK {
            return Err(frame::corrupt(f.pos, "chunked element interrupted"));
        }
        Ok(Some(RingFrame { header, ..rf }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::ring::{HeapRegion, Producer};
    use crate::transport::frame::FramePlan;

    fn ring() -> (Producer, Consumer) {
        let r: Arc<dyn Region> = HeapRegion::new(1 << 12);
        (Producer::new(r.clone()), Consumer::new(r))
    }

    fn put(p: &mut Producer, kind: u32, seq: u64, body: &[u8]) {
        let mut plan = FramePlan::simple(kind, 3, body);
        plan.set_seq(seq);
        let slot = p.try_reserve(plan.total_bytes, 64).unwrap().unwrap();
        // SAFETY: the slot was just reserved for plan.total_bytes.
        unsafe { plan.copy_range(0, plan.total_bytes, p.slot_ptr(slot)) };
        p.publish();
    }

    #[test]
    fn frames_come_in_order_with_their_bodies() {
        let (mut p, mut c) = ring();
        let spec = Spec::Leaf(frame::LeafSpec {
            kind: frame::LeafKind::Bytes,
            dtype: String::new(),
            ndim: 0,
            itemsize: 0,
        });
        let mut enc = Vec::new();
        spec.encode(&mut enc);
        let mut body = (enc.len() as u32).to_le_bytes().to_vec();
        body.extend_from_slice(&enc);
        put(&mut p, frame::KIND_SPEC, 0, &body);
        put(
            &mut p,
            frame::KIND_ERROR,
            1,
            &frame::error_body("E", "boom"),
        );
        let mut s = FrameStream::default();
        let f = s.next(&mut c).unwrap().unwrap();
        assert_eq!(f.spec().unwrap(), (3, spec));
        c.mark_free(f.end());
        let f = s.next(&mut c).unwrap().unwrap();
        assert_eq!(f.error().unwrap(), ("E".into(), "boom".into()));
        c.mark_free(f.end());
        assert!(s.next(&mut c).unwrap().is_none());
    }

    #[test]
    fn a_sequence_gap_or_an_interrupted_chunk_is_corruption() {
        let (mut p, mut c) = ring();
        put(&mut p, frame::KIND_END, 1, &[]);
        let e = FrameStream::default().next(&mut c).err().unwrap();
        assert!(e.to_string().contains("frame seq 1 where 0"), "{e}");

        let (mut p, mut c) = ring();
        let mut s = FrameStream::default();
        // A first chunk of a 4 KiB element, then an END.
        let piece = crate::transport::chunk::pieces(4096, 1024).next().unwrap();
        let mut chunk = crate::transport::chunk::prefix(&piece, 4096, 0, 3);
        chunk.extend(std::iter::repeat_n(0u8, piece.n as usize));
        let slot = p.try_reserve(piece.frame_bytes, 64).unwrap().unwrap();
        // SAFETY: reserved for piece.frame_bytes >= chunk.len().
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), p.slot_ptr(slot), chunk.len()) };
        p.publish();
        put(&mut p, frame::KIND_END, 1, &[]);
        let f = s.next(&mut c).unwrap().unwrap();
        s.chunks.accept(f.bytes(), f.frame.pos).unwrap().run();
        assert!(s
            .chunks
            .finish(f.header.flags, f.frame.pos)
            .unwrap()
            .is_none());
        c.mark_free(f.end());
        let e = s.next(&mut c).err().unwrap();
        assert!(e.to_string().contains("chunked element interrupted"), "{e}");
    }
}
