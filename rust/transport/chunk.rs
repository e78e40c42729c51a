//! Elements bigger than a ring's largest frame travel as consecutive CHUNK frames
//! (`transport::frame`): the producer cuts the element's (virtual) DATA frame into pieces
//! ([`pieces`], [`prefix`]), the consumer rebuilds it in private memory ([`Reassembly`])
//! and decodes it like any DATA frame. Everything read back is untrusted: a chunk out of
//! order, a size out of range or a missing piece is `RingCorrupted`.

use std::sync::Arc;

use crate::error::Error;
use crate::transport::frame::{self, FrameHeader};

/// Largest element a chunked frame may rebuild (16 TiB: any bigger size is garbage).
const MAX_CHUNKED_BYTES: u64 = 1 << 44;

/// One CHUNK frame of an element: `n` bytes at `offset` of its frame, in a ring frame of
/// `frame_bytes` bytes with `flags` (`CHUNK_FIRST`, `CHUNK_LAST`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub offset: u64,
    pub n: u64,
    pub frame_bytes: u64,
    pub flags: u32,
}

/// The CHUNK frames carrying a frame of `total` bytes through a ring whose largest frame
/// is `max_frame` bytes, in order.
pub fn pieces(total: u64, max_frame: u64) -> impl Iterator<Item = Piece> {
    let chunk_data = ((max_frame - frame::CHUNK_PREFIX_BYTES as u64) / 64) * 64;
    let mut off = 0u64;
    std::iter::from_fn(move || {
        if off >= total {
            return None;
        }
        let n = chunk_data.min(total - off);
        let mut flags = 0;
        if off == 0 {
            flags |= frame::CHUNK_FIRST;
        }
        if off + n == total {
            flags |= frame::CHUNK_LAST;
        }
        let piece = Piece {
            offset: off,
            n,
            frame_bytes: crate::shm::ring::frame_len(frame::CHUNK_PREFIX_BYTES as u64 + n),
            flags,
        };
        off += n;
        Some(piece)
    })
}

/// The header and chunk prefix (`CHUNK_PREFIX_BYTES`) of `piece` of a `total`-byte frame.
pub fn prefix(piece: &Piece, total: u64, seq: u64, spec_id: u32) -> Vec<u8> {
    let header = FrameHeader {
        kind: frame::KIND_CHUNK,
        flags: piece.flags,
        total_bytes: piece.frame_bytes,
        seq,
        spec_id,
        n_leaves: 0,
    };
    let mut out = header.to_bytes().to_vec();
    out.extend_from_slice(&total.to_le_bytes());
    out.extend_from_slice(&piece.offset.to_le_bytes());
    out.extend_from_slice(&piece.n.to_le_bytes());
    out
}

/// Private memory holding a reassembled chunked element; leases of its leaves keep it.
pub struct HeapBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain heap memory; writes only through views handed to numpy (the Python
// program's own data race, as with any numpy array) and by the one reassembling thread.
unsafe impl Send for HeapBuf {}
// SAFETY: as above.
unsafe impl Sync for HeapBuf {}

impl HeapBuf {
    /// `len` (> 0) zeroed bytes, or None if they cannot be allocated. Zeroed by the
    /// allocator (`calloc`: fresh pages of a big allocation are not touched), so a chunked
    /// element's declared size costs address space only, and memory only as its chunks
    /// arrive: a first chunk that declares far more than ever follows does not make this
    /// process write (and keep resident) that many zeros.
    pub fn new(len: usize) -> Option<Self> {
        Self::allocate(len, true)
    }

    /// `len` (> 0) bytes the caller must write, every one, before any is read (no
    /// zeroing pass: a decoder's copy of many small leaves writes them all), or None if
    /// they cannot be allocated.
    pub fn new_unfilled(len: usize) -> Option<Self> {
        Self::allocate(len, false)
    }

    fn allocate(len: usize, zeroed: bool) -> Option<Self> {
        let layout = std::alloc::Layout::array::<u8>(len).ok()?;
        if len == 0 {
            return None;
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe {
            if zeroed {
                std::alloc::alloc_zeroed(layout)
            } else {
                std::alloc::alloc(layout)
            }
        };
        if ptr.is_null() {
            return None;
        }
        Some(HeapBuf { ptr, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr/len is our own live allocation.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The start of the `len` bytes, for the one writer that fills them before sharing.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for HeapBuf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::array::<u8>(self.len).expect("checked in new()");
        // SAFETY: ptr came from alloc_zeroed or alloc with this layout (new, new_unfilled).
        unsafe { std::alloc::dealloc(self.ptr, layout) };
    }
}

/// A validated copy of one chunk's bytes into the element being rebuilt; [`Copy::run`]
/// may run on another thread (the consumer runs it with the GIL released).
pub struct Copy {
    dst: *mut u8,
    src: *const u8,
    n: usize,
    _buf: Arc<HeapBuf>,
}

// SAFETY: the destination is private heap memory kept alive by `_buf`; the source is a
// ring frame the consumer holds (it frees the frame only after the copy ran).
unsafe impl Send for Copy {}

impl Copy {
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Copies the chunk's bytes into place.
    pub fn run(self) {
        // SAFETY: [dst, dst + n) lies inside the private buffer and [src, src + n) inside
        // the frame (both checked by Reassembly::accept); they are distinct allocations.
        unsafe { std::ptr::copy_nonoverlapping(self.src, self.dst, self.n) }
    }
}

/// The consumer's element being rebuilt from CHUNK frames. Thread-compatible.
#[derive(Default)]
pub struct Reassembly {
    current: Option<(Arc<HeapBuf>, u64)>,
}

impl Reassembly {
    /// True between the first and the last chunk of an element (no other frame may come).
    pub fn in_progress(&self) -> bool {
        self.current.is_some()
    }

    /// Checks the CHUNK frame `bytes` at ring position `pos` against the element being
    /// rebuilt (starting one at a first chunk) and returns the copy of its bytes. The caller
    /// runs the copy, then calls [`Reassembly::finish`].
    ///
    /// Raises `RingCorrupted` for a chunk out of order or out of range, `ElementTooLarge`
    /// when the element's memory cannot be allocated.
    pub fn accept(&mut self, bytes: &[u8], pos: u64) -> Result<Copy, Error> {
        let header = FrameHeader::parse(bytes)?;
        let mut r = frame::Reader::new(bytes, frame::HEADER_BYTES);
        let total = r.u64()?;
        let off = r.u64()?;
        let n = r.u64()? as usize;
        // Bounded by the frame (Reader::bytes checks), so a garbage length is an error.
        let data = r.bytes(n)?;
        if header.flags & frame::CHUNK_FIRST != 0 {
            if self.current.is_some() || off != 0 {
                return Err(frame::corrupt(pos, "unexpected first chunk"));
            }
            if total < 64 || total % 64 != 0 || total > MAX_CHUNKED_BYTES {
                return Err(frame::corrupt(pos, "chunked element size out of range"));
            }
            let buf = HeapBuf::new(total as usize).ok_or_else(|| Error::ElementTooLarge {
                element_bytes: total,
                limit_bytes: 0,
                what: "cannot allocate memory to reassemble a chunked element".into(),
            })?;
            self.current = Some((Arc::new(buf), 0));
        }
        let Some((buf, filled)) = self.current.as_mut() else {
            return Err(frame::corrupt(pos, "chunk without a first chunk"));
        };
        if off != *filled || buf.len as u64 != total || off + n as u64 > total {
            return Err(frame::corrupt(pos, "chunk out of order"));
        }
        *filled += n as u64;
        Ok(Copy {
            // SAFETY: off + n <= total = buf.len (checked above).
            dst: unsafe { buf.ptr.add(off as usize) },
            src: data.as_ptr(),
            n,
            _buf: buf.clone(),
        })
    }

    /// After the copy of a chunk with `flags`: the whole element's frame once the last
    /// chunk is in, else None.
    ///
    /// Raises `RingCorrupted` when the last chunk comes before the element is complete or
    /// the rebuilt frame's length differs from the chunks' total.
    pub fn finish(&mut self, flags: u32, pos: u64) -> Result<Option<Arc<HeapBuf>>, Error> {
        if flags & frame::CHUNK_LAST == 0 {
            return Ok(None);
        }
        let Some((buf, filled)) = self.current.take() else {
            return Err(frame::corrupt(pos, "chunk without a first chunk"));
        };
        if filled != buf.len as u64 {
            return Err(frame::corrupt(
                pos,
                "last chunk before the element is complete",
            ));
        }
        if FrameHeader::parse(buf.as_slice())?.total_bytes != buf.len as u64 {
            return Err(frame::corrupt(pos, "chunked frame length mismatch"));
        }
        Ok(Some(buf))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DATA-frame-like element of `total` bytes whose header names its own length.
    fn element(total: u64) -> Vec<u8> {
        let mut v: Vec<u8> = (0..total).map(|i| (i * 7 % 251) as u8).collect();
        let h = FrameHeader {
            kind: frame::KIND_DATA,
            flags: 0,
            total_bytes: total,
            seq: 0,
            spec_id: 1,
            n_leaves: 0,
        };
        v[..frame::HEADER_BYTES].copy_from_slice(&h.to_bytes());
        v
    }

    fn chunk_frames(el: &[u8], max_frame: u64) -> Vec<Vec<u8>> {
        pieces(el.len() as u64, max_frame)
            .enumerate()
            .map(|(i, p)| {
                let mut f = prefix(&p, el.len() as u64, i as u64, 1);
                f.extend_from_slice(&el[p.offset as usize..(p.offset + p.n) as usize]);
                assert!(f.len() as u64 <= p.frame_bytes && p.frame_bytes <= max_frame);
                f.resize(p.frame_bytes as usize, 0);
                f
            })
            .collect()
    }

    fn feed(r: &mut Reassembly, f: &[u8]) -> Result<Option<Arc<HeapBuf>>, Error> {
        r.accept(f, 0)?.run();
        r.finish(FrameHeader::parse(f)?.flags, 0)
    }

    #[test]
    fn split_and_rebuild_round_trip() {
        for total in [64u64, 4096, 16384 + 64, 100 * 1024] {
            let el = element(total);
            let frames = chunk_frames(&el, 16384);
            assert_eq!(frames.len() as u64, total.div_ceil(16384 - 64));
            let mut r = Reassembly::default();
            let mut out = None;
            for (i, f) in frames.iter().enumerate() {
                assert_eq!(r.in_progress(), i > 0);
                let got = feed(&mut r, f).unwrap();
                assert_eq!(got.is_some(), i + 1 == frames.len());
                out = got.or(out);
            }
            assert!(!r.in_progress());
            assert_eq!(out.unwrap().as_slice(), &el[..]);
        }
    }

    #[test]
    fn out_of_order_or_missing_chunks_are_corruption() {
        let el = element(64 * 1024);
        let frames = chunk_frames(&el, 16384);
        assert!(frames.len() >= 3);
        let corrupt = |e: Error| matches!(e, Error::RingCorrupted { .. });
        // Skipping a chunk.
        let mut r = Reassembly::default();
        feed(&mut r, &frames[0]).unwrap();
        assert!(corrupt(feed(&mut r, &frames[2]).err().unwrap()));
        // A middle chunk first.
        let mut r = Reassembly::default();
        assert!(corrupt(feed(&mut r, &frames[1]).err().unwrap()));
        // Two first chunks.
        let mut r = Reassembly::default();
        feed(&mut r, &frames[0]).unwrap();
        assert!(corrupt(feed(&mut r, &frames[0]).err().unwrap()));
        // A chunk whose length runs past its frame.
        let mut bad = frames[0].clone();
        bad[frame::HEADER_BYTES + 16..frame::HEADER_BYTES + 24]
            .copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(corrupt(
            Reassembly::default().accept(&bad, 0).err().unwrap()
        ));
        // An absurd total.
        let mut bad = frames[0].clone();
        bad[frame::HEADER_BYTES..frame::HEADER_BYTES + 8].copy_from_slice(&100u64.to_le_bytes());
        assert!(corrupt(
            Reassembly::default().accept(&bad, 0).err().unwrap()
        ));
    }

    /// Resident bytes of this process (`/proc/self/statm`, pages).
    fn resident_bytes() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        pages * 4096
    }

    #[test]
    fn chunk_reassembly_buffer_costs_memory_only_as_it_is_written() {
        // A first CHUNK may declare up to 16 TiB; the buffer for a 1 GiB claim must not
        // be written (made resident) before chunks arrive: zeroing it with a memset would
        // add 1 GiB of RSS here.
        let before = resident_bytes();
        let buf = HeapBuf::new(1 << 30).expect("1 GiB of address space");
        let grown = resident_bytes().saturating_sub(before);
        assert!(grown < 64 << 20, "RSS grew by {grown} bytes");
        let s = buf.as_slice();
        assert_eq!(s.len(), 1 << 30);
        assert!([0usize, 4096, 1 << 29, (1 << 30) - 1]
            .iter()
            .all(|&i| s[i] == 0));
        drop(buf);
        assert!(HeapBuf::new(0).is_none());
        // More than any address space: refused, not a crash.
        assert!(HeapBuf::new(usize::MAX / 2).is_none());
    }

    #[test]
    fn a_rebuilt_frame_must_name_its_length() {
        let mut el = element(4096);
        el[8..16].copy_from_slice(&8192u64.to_le_bytes());
        let frames = chunk_frames(&el, 1024);
        let mut r = Reassembly::default();
        let mut last = Ok(None);
        for f in &frames {
            last = feed(&mut r, f);
        }
        assert!(matches!(last, Err(Error::RingCorrupted { .. })));
    }
}
