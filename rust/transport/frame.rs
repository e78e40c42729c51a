//! Element frames (TRANSPORT.md §6), little-endian, independent of Python.
//!
//! Frame header, 32 B: `u32 kind | 0xD5 << 8`, `u32 flags`, `u64 total_bytes` (to the next
//! frame, a multiple of 64), `u64 seq` (consecutive over non-PAD frames), `u32 spec_id`,
//! `u16 n_leaves`, `u16 reserved`.
//! - DATA: header, `n_leaves` leaf descriptors (24 B + 8 B per dim: `u8 kind`, `u8 ndim`,
//!   `u16 flags`, `u32 itemsize`, `u64 data_offset` from the frame start, `u64 nbytes`, `u64
//!   dims[ndim]`), then the payloads (64-B aligned; 4096-B aligned from [`LEASE_ALIGN_MIN`]
//!   bytes, and such a frame starts on a 4096-B slot, so leased views are page-aligned).
//! - SPEC: header, then the element structure in the binary form of [`Spec::encode`].
//! - END: header only. ERROR: header, then `str type_name`, `str message`.
//! - CHUNK: header, `u64 total_bytes` of the whole (virtual) DATA frame, `u64 offset`, `u64
//!   len`, then `len` bytes of it; flags bit 0 = first, bit 1 = last. An element bigger than the ring's
//!   max frame travels as consecutive CHUNK frames and is rebuilt in private memory.
//!
//! Everything read back is untrusted: every length and offset is checked with checked
//! arithmetic against the frame before a slice is formed; violations are `RingCorrupted`.

use crate::error::Error;

pub const KIND_DATA: u32 = 1;
pub const KIND_PAD: u32 = 2;
pub const KIND_SPEC: u32 = 3;
pub const KIND_END: u32 = 4;
pub const KIND_ERROR: u32 = 5;
pub const KIND_CHUNK: u32 = 6;

pub const HEADER_BYTES: usize = 32;
pub const CHUNK_PREFIX_BYTES: usize = HEADER_BYTES + 24;
pub const CHUNK_FIRST: u32 = 1;
pub const CHUNK_LAST: u32 = 2;
/// Payloads of at least this many bytes start 4096-aligned (they may be leased).
pub const LEASE_ALIGN_MIN: u64 = 64 << 10;
pub const LEASE_ALIGN: u64 = 4096;
/// Most dims a leaf may have (numpy's limit is 64).
pub const MAX_NDIM: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: u32,
    pub flags: u32,
    pub total_bytes: u64,
    pub seq: u64,
    pub spec_id: u32,
    pub n_leaves: u16,
}

impl FrameHeader {
    pub fn to_bytes(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&(self.kind | crate::shm::ring::FRAME_MAGIC).to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.total_bytes.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..28].copy_from_slice(&self.spec_id.to_le_bytes());
        b[28..30].copy_from_slice(&self.n_leaves.to_le_bytes());
        b
    }

    /// Parses the first 32 bytes of `frame` (whose length the ring already validated).
    pub fn parse(frame: &[u8]) -> Result<Self, Error> {
        let mut r = Reader::new(frame, 0);
        let word0 = r.u32()?;
        if word0 & 0xFFFF_FF00 != crate::shm::ring::FRAME_MAGIC {
            return Err(corrupt(0, "bad frame magic"));
        }
        Ok(FrameHeader {
            kind: word0 & 0xFF,
            flags: r.u32()?,
            total_bytes: r.u64()?,
            seq: r.u64()?,
            spec_id: r.u32()?,
            n_leaves: r.u16()?,
        })
    }
}

pub(crate) fn corrupt(pos: u64, what: &str) -> Error {
    Error::RingCorrupted {
        pos,
        what: what.to_string(),
    }
}

/// Bounds-checked little-endian reader over untrusted bytes.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], pos: usize) -> Self {
        Reader { buf, pos }
    }
    pub fn pos(&self) -> usize {
        self.pos
    }
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| corrupt(self.pos as u64, "length runs past the frame"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.bytes(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, Error> {
        Ok(u16::from_le_bytes(self.bytes(2)?.try_into().unwrap()))
    }
    pub fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64, Error> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().unwrap()))
    }
    pub fn str(&mut self) -> Result<&'a str, Error> {
        let n = self.u32()? as usize;
        let b = self.bytes(n)?;
        std::str::from_utf8(b).map_err(|_| corrupt(self.pos as u64, "string is not UTF-8"))
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// What a leaf is, on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum LeafKind {
    /// numpy array of a fixed-size dtype (`dtype` = numpy `dtype.str`, or `dtype.name` for a
    /// user-defined dtype such as ml_dtypes' bfloat16, whose `str` is only "<V2").
    Array = 1,
    /// numpy scalar (`np.generic`) of a fixed-size dtype.
    Scalar = 2,
    Bytes = 3,
    Str = 4,
    /// numpy object array of `bytes`: `u64 offsets[n+1]` then the data.
    VarBytes = 5,
    PyInt = 6,
    PyFloat = 7,
    PyBool = 8,
    None = 9,
    /// Anything else, pickled (protocol 5).
    Pickle = 10,
}

impl LeafKind {
    pub fn from_u8(v: u8) -> Option<Self> {
        use LeafKind::*;
        Some(match v {
            1 => Array,
            2 => Scalar,
            3 => Bytes,
            4 => Str,
            5 => VarBytes,
            6 => PyInt,
            7 => PyFloat,
            8 => PyBool,
            9 => None,
            10 => Pickle,
            _ => return Option::None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LeafSpec {
    pub kind: LeafKind,
    /// numpy `dtype.str` for Array / Scalar (`dtype.name` for a user-defined dtype: numpy's
    /// `dtype.num` >= 256), else empty.
    pub dtype: String,
    /// ndim for Array / VarBytes, else 0.
    pub ndim: u8,
    /// bytes per item for Array / Scalar (from the dtype), else 0.
    pub itemsize: u32,
}

/// An element's structure, sent once (SPEC frame) and reused for every DATA frame.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Spec {
    Leaf(LeafSpec),
    Tuple(Vec<Spec>),
    List(Vec<Spec>),
    /// Keys sorted, as tf.nest flattens dicts.
    Dict(Vec<(String, Spec)>),
    NamedTuple {
        module: String,
        name: String,
        fields: Vec<String>,
        items: Vec<Spec>,
    },
}

const TAG_LEAF: u8 = 0;
const TAG_TUPLE: u8 = 1;
const TAG_LIST: u8 = 2;
const TAG_DICT: u8 = 3;
const TAG_NAMEDTUPLE: u8 = 4;
const MAX_SPEC_DEPTH: usize = 64;

impl Spec {
    /// Appends the binary form: pre-order, `u8 tag` then per tag: leaf `u8 kind, u8 ndim,
    /// u32 itemsize, str dtype`; tuple/list `u32 n, items`; dict `u32 n, (str key, item)*`;
    /// namedtuple `str module, str name, u32 n, (str field, item)*`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Spec::Leaf(l) => {
                out.extend_from_slice(&[TAG_LEAF, l.kind as u8, l.ndim]);
                out.extend_from_slice(&l.itemsize.to_le_bytes());
                put_str(out, &l.dtype);
            }
            Spec::Tuple(items) | Spec::List(items) => {
                out.push(if matches!(self, Spec::Tuple(_)) {
                    TAG_TUPLE
                } else {
                    TAG_LIST
                });
                out.extend_from_slice(&(items.len() as u32).to_le_bytes());
                for i in items {
                    i.encode(out);
                }
            }
            Spec::Dict(items) => {
                out.push(TAG_DICT);
                out.extend_from_slice(&(items.len() as u32).to_le_bytes());
                for (k, v) in items {
                    put_str(out, k);
                    v.encode(out);
                }
            }
            Spec::NamedTuple {
                module,
                name,
                fields,
                items,
            } => {
                out.push(TAG_NAMEDTUPLE);
                put_str(out, module);
                put_str(out, name);
                out.extend_from_slice(&(items.len() as u32).to_le_bytes());
                for (f, v) in fields.iter().zip(items) {
                    put_str(out, f);
                    v.encode(out);
                }
            }
        }
    }

    pub fn decode(bytes: &[u8]) -> Result<Spec, Error> {
        let mut r = Reader::new(bytes, 0);
        let spec = Spec::decode_from(&mut r, 0)?;
        if r.pos() != bytes.len() {
            return Err(corrupt(r.pos() as u64, "trailing bytes after the spec"));
        }
        Ok(spec)
    }

    fn decode_from(r: &mut Reader<'_>, depth: usize) -> Result<Spec, Error> {
        if depth > MAX_SPEC_DEPTH {
            return Err(corrupt(r.pos() as u64, "spec nested too deeply"));
        }
        let count = |r: &mut Reader<'_>| -> Result<usize, Error> {
            let n = r.u32()? as usize;
            // Each item takes at least 4 bytes: a count beyond the rest is garbage.
            if n > r.buf.len() {
                return Err(corrupt(r.pos() as u64, "spec item count too large"));
            }
            Ok(n)
        };
        Ok(match r.u8()? {
            TAG_LEAF => {
                let kind = LeafKind::from_u8(r.u8()?)
                    .ok_or_else(|| corrupt(r.pos() as u64, "unknown leaf kind"))?;
                let ndim = r.u8()?;
                if ndim as usize > MAX_NDIM {
                    return Err(corrupt(r.pos() as u64, "leaf ndim too large"));
                }
                let itemsize = r.u32()?;
                let dtype = r.str()?.to_string();
                Spec::Leaf(LeafSpec {
                    kind,
                    dtype,
                    ndim,
                    itemsize,
                })
            }
            tag @ (TAG_TUPLE | TAG_LIST) => {
                let n = count(r)?;
                let mut items = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    items.push(Spec::decode_from(r, depth + 1)?);
                }
                if tag == TAG_TUPLE {
                    Spec::Tuple(items)
                } else {
                    Spec::List(items)
                }
            }
            TAG_DICT => {
                let n = count(r)?;
                let mut items = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    let k = r.str()?.to_string();
                    items.push((k, Spec::decode_from(r, depth + 1)?));
                }
                Spec::Dict(items)
            }
            TAG_NAMEDTUPLE => {
                let module = r.str()?.to_string();
                let name = r.str()?.to_string();
                let n = count(r)?;
                let mut fields = Vec::with_capacity(n.min(1024));
                let mut items = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    fields.push(r.str()?.to_string());
                    items.push(Spec::decode_from(r, depth + 1)?);
                }
                Spec::NamedTuple {
                    module,
                    name,
                    fields,
                    items,
                }
            }
            _ => return Err(corrupt(r.pos() as u64, "unknown spec tag")),
        })
    }

    /// The leaves in flatten order.
    pub fn leaves(&self) -> Vec<&LeafSpec> {
        let mut out = Vec::new();
        self.collect(&mut out);
        out
    }

    fn collect<'a>(&'a self, out: &mut Vec<&'a LeafSpec>) {
        match self {
            Spec::Leaf(l) => out.push(l),
            Spec::Tuple(items) | Spec::List(items) | Spec::NamedTuple { items, .. } => {
                items.iter().for_each(|i| i.collect(out))
            }
            Spec::Dict(items) => items.iter().for_each(|(_, v)| v.collect(out)),
        }
    }
}

/// One leaf of a DATA frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafDesc {
    pub kind: LeafKind,
    pub itemsize: u32,
    pub offset: u64,
    pub nbytes: u64,
    pub dims: Dims,
}

/// A leaf's dims: up to [`INLINE_DIMS`] held inline (no allocation per leaf of an element
/// of many small arrays), more on the heap. Derefs to `[u64]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Dims {
    len: usize,
    inline: [u64; INLINE_DIMS],
    heap: Vec<u64>,
}

pub const INLINE_DIMS: usize = 4;

impl Dims {
    pub fn push(&mut self, d: u64) {
        if self.len < INLINE_DIMS {
            self.inline[self.len] = d;
        } else {
            if self.heap.is_empty() {
                self.heap.extend_from_slice(&self.inline);
            }
            self.heap.push(d);
        }
        self.len += 1;
    }
}

impl From<Vec<u64>> for Dims {
    fn from(v: Vec<u64>) -> Self {
        v.into_iter().collect()
    }
}

impl FromIterator<u64> for Dims {
    fn from_iter<I: IntoIterator<Item = u64>>(iter: I) -> Self {
        let mut d = Dims::default();
        for x in iter {
            d.push(x);
        }
        d
    }
}

impl std::ops::Deref for Dims {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        if self.len <= INLINE_DIMS {
            &self.inline[..self.len]
        } else {
            &self.heap
        }
    }
}

impl LeafDesc {
    pub fn encoded_len(ndim: usize) -> u64 {
        24 + 8 * ndim as u64
    }
}

/// Where a payload's bytes come from while a frame is being written.
pub enum Payload<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
}

impl Payload<'_> {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Payload::Borrowed(s) => s,
            Payload::Owned(v) => v,
        }
    }
}

/// A DATA frame laid out but not yet written: header + descriptors in `head`, payloads at
/// their offsets. The frame is "virtual" until copied into the ring (whole, or in CHUNKs).
pub struct FramePlan<'a> {
    pub head: Vec<u8>,
    pub payloads: Vec<(u64, Payload<'a>)>,
    /// Total frame bytes (a multiple of 64).
    pub total_bytes: u64,
    /// The frame must start 4096-aligned (it has page-aligned payloads).
    pub page_align: bool,
    /// Sum of payload bytes.
    pub payload_bytes: u64,
}

/// A leaf to be framed: its descriptor fields and payload.
pub struct LeafIn<'a> {
    pub kind: LeafKind,
    pub itemsize: u32,
    pub dims: Dims,
    pub payload: Payload<'a>,
}

impl<'a> FramePlan<'a> {
    /// Lays out a DATA frame of `leaves` (seq filled in at write time).
    pub fn data(spec_id: u32, leaves: Vec<LeafIn<'a>>) -> Self {
        Self::data_aligned(spec_id, leaves, true)
    }

    /// As [`FramePlan::data`]; `page_align_large` false keeps every payload 64-B aligned
    /// (a self-contained element, which is never leased page by page, wastes no padding).
    pub fn data_aligned(spec_id: u32, leaves: Vec<LeafIn<'a>>, page_align_large: bool) -> Self {
        let descs_len: u64 = leaves
            .iter()
            .map(|l| LeafDesc::encoded_len(l.dims.len()))
            .sum();
        let mut off = HEADER_BYTES as u64 + descs_len;
        let mut head = Vec::with_capacity(off as usize);
        head.extend_from_slice(
            &FrameHeader {
                kind: KIND_DATA,
                flags: 0,
                total_bytes: 0,
                seq: 0,
                spec_id,
                n_leaves: leaves.len() as u16,
            }
            .to_bytes(),
        );
        let mut payloads = Vec::with_capacity(leaves.len());
        let mut page_align = false;
        let mut payload_bytes = 0;
        for leaf in leaves {
            let n = leaf.payload.as_slice().len() as u64;
            let align = if page_align_large && n >= LEASE_ALIGN_MIN {
                page_align = true;
                LEASE_ALIGN
            } else {
                64
            };
            off = off.next_multiple_of(align);
            head.push(leaf.kind as u8);
            head.push(leaf.dims.len() as u8);
            head.extend_from_slice(&0u16.to_le_bytes());
            head.extend_from_slice(&leaf.itemsize.to_le_bytes());
            head.extend_from_slice(&off.to_le_bytes());
            head.extend_from_slice(&n.to_le_bytes());
            for d in leaf.dims.iter() {
                head.extend_from_slice(&d.to_le_bytes());
            }
            payloads.push((off, leaf.payload));
            off += n;
            payload_bytes += n;
        }
        let total = off.next_multiple_of(64).max(64);
        head[8..16].copy_from_slice(&total.to_le_bytes());
        FramePlan {
            head,
            payloads,
            total_bytes: total,
            page_align,
            payload_bytes,
        }
    }

    /// A frame that is only `head` (SPEC, END, ERROR), padded to 64 bytes.
    pub fn simple(kind: u32, spec_id: u32, body: &[u8]) -> FramePlan<'static> {
        let mut head = FrameHeader {
            kind,
            flags: 0,
            total_bytes: 0,
            seq: 0,
            spec_id,
            n_leaves: 0,
        }
        .to_bytes()
        .to_vec();
        head.extend_from_slice(body);
        let total = (head.len() as u64).next_multiple_of(64);
        head[8..16].copy_from_slice(&total.to_le_bytes());
        FramePlan {
            head,
            payloads: Vec::new(),
            total_bytes: total,
            page_align: false,
            payload_bytes: 0,
        }
    }

    pub fn set_seq(&mut self, seq: u64) {
        self.head[16..24].copy_from_slice(&seq.to_le_bytes());
    }

    /// Copies bytes `[from, to)` of the virtual frame to `dst` (which must hold `to - from`
    /// bytes); gaps between payloads are zeroed.
    ///
    /// # Safety
    /// `dst` must be valid for `to - from` bytes of writes, and not overlap any payload.
    pub unsafe fn copy_range(&self, from: u64, to: u64, dst: *mut u8) {
        debug_assert!(from <= to && to <= self.total_bytes);
        let mut segments: Vec<(u64, &[u8])> = Vec::with_capacity(self.payloads.len() + 1);
        segments.push((0, &self.head));
        for (off, p) in &self.payloads {
            segments.push((*off, p.as_slice()));
        }
        let mut cursor = from;
        for (start, bytes) in segments {
            let end = start + bytes.len() as u64;
            if end <= from || start >= to {
                continue;
            }
            let a = start.max(from);
            let b = end.min(to);
            if a > cursor {
                // SAFETY: [cursor - from, a - from) lies within dst's to - from bytes.
                unsafe {
                    std::ptr::write_bytes(
                        dst.add((cursor - from) as usize),
                        0,
                        (a - cursor) as usize,
                    )
                };
            }
            // SAFETY: [a, b) is inside both the segment and [from, to); dst is valid for
            // to - from bytes and does not overlap the source (caller's duty).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr().add((a - start) as usize),
                    dst.add((a - from) as usize),
                    (b - a) as usize,
                )
            };
            cursor = b;
        }
        if cursor < to {
            // SAFETY: as above, the tail of dst.
            unsafe {
                std::ptr::write_bytes(dst.add((cursor - from) as usize), 0, (to - cursor) as usize)
            };
        }
    }
}

/// Parses and validates the leaf descriptors of a DATA frame against its spec's leaves.
/// `frame` is the whole frame (`total_bytes` long).
pub fn parse_leaves(
    frame: &[u8],
    header: &FrameHeader,
    spec_leaves: &[&LeafSpec],
    pos: u64,
) -> Result<Vec<LeafDesc>, Error> {
    if header.n_leaves as usize != spec_leaves.len() {
        return Err(corrupt(
            pos,
            &format!(
                "frame has {} leaves, its spec {}",
                header.n_leaves,
                spec_leaves.len()
            ),
        ));
    }
    let mut r = Reader::new(frame, HEADER_BYTES);
    let mut out = Vec::with_capacity(spec_leaves.len());
    for spec in spec_leaves {
        let kind = r.u8()?;
        let ndim = r.u8()? as usize;
        let _flags = r.u16()?;
        let itemsize = r.u32()?;
        let offset = r.u64()?;
        let nbytes = r.u64()?;
        if kind != spec.kind as u8 {
            return Err(corrupt(pos, "leaf kind differs from the spec"));
        }
        let expected_ndim = match spec.kind {
            LeafKind::Array | LeafKind::VarBytes => spec.ndim as usize,
            _ => 0,
        };
        if ndim != expected_ndim {
            return Err(corrupt(pos, "leaf ndim differs from the spec"));
        }
        let mut dims = Dims::default();
        for _ in 0..ndim {
            dims.push(r.u64()?);
        }
        let end = offset
            .checked_add(nbytes)
            .ok_or_else(|| corrupt(pos, "leaf extent overflows"))?;
        if offset < r.pos() as u64 && nbytes > 0 || end > frame.len() as u64 {
            return Err(corrupt(pos, "leaf payload lies outside its frame"));
        }
        let items = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| corrupt(pos, "leaf shape overflows"))?;
        match spec.kind {
            LeafKind::Array | LeafKind::Scalar
                if itemsize != spec.itemsize
                    || items.checked_mul(u64::from(itemsize)) != Some(nbytes) =>
            {
                return Err(corrupt(pos, "leaf size does not match its shape and dtype"));
            }
            LeafKind::PyInt | LeafKind::PyFloat if nbytes != 8 => {
                return Err(corrupt(pos, "number leaf is not 8 bytes"));
            }
            LeafKind::PyBool if nbytes != 1 => {
                return Err(corrupt(pos, "bool leaf is not 1 byte"));
            }
            LeafKind::VarBytes => {
                let need = items
                    .checked_add(1)
                    .and_then(|n| n.checked_mul(8))
                    .ok_or_else(|| corrupt(pos, "varbytes leaf overflows"))?;
                if need > nbytes {
                    return Err(corrupt(pos, "varbytes offsets run past the leaf"));
                }
            }
            _ => {}
        }
        out.push(LeafDesc {
            kind: spec.kind,
            itemsize,
            offset,
            nbytes,
            dims,
        });
    }
    Ok(out)
}

/// Splits a VARBYTES payload (`u64 offsets[n+1]` then data) into its `n` items.
pub fn varbytes_items(payload: &[u8], n: usize, pos: u64) -> Result<Vec<&[u8]>, Error> {
    let mut r = Reader::new(payload, 0);
    let mut offsets = Vec::with_capacity(n + 1);
    for _ in 0..=n {
        offsets.push(r.u64()?);
    }
    let data = &payload[r.pos()..];
    let mut out = Vec::with_capacity(n);
    for w in offsets.windows(2) {
        let (a, b) = (w[0] as usize, w[1] as usize);
        if a > b || b > data.len() {
            return Err(corrupt(
                pos,
                "varbytes offsets out of order or out of range",
            ));
        }
        out.push(&data[a..b]);
    }
    Ok(out)
}

/// Builds a VARBYTES payload from items.
pub fn varbytes_payload(items: &[&[u8]]) -> Vec<u8> {
    let data_len: usize = items.iter().map(|i| i.len()).sum();
    let mut out = Vec::with_capacity(8 * (items.len() + 1) + data_len);
    let mut off = 0u64;
    out.extend_from_slice(&off.to_le_bytes());
    for i in items {
        off += i.len() as u64;
        out.extend_from_slice(&off.to_le_bytes());
    }
    for i in items {
        out.extend_from_slice(i);
    }
    out
}

/// ERROR frame body.
pub fn error_body(type_name: &str, message: &str) -> Vec<u8> {
    let mut out = Vec::new();
    put_str(&mut out, type_name);
    put_str(&mut out, message);
    out
}

pub fn parse_error_body(body: &[u8], pos: u64) -> Result<(String, String), Error> {
    let mut r = Reader::new(body, 0);
    let t = r.str().map_err(|_| corrupt(pos, "bad ERROR frame"))?;
    let m = r.str().map_err(|_| corrupt(pos, "bad ERROR frame"))?;
    Ok((t.to_string(), m.to_string()))
}

/// First bytes of a self-contained element: the form the gRPC path sends, which has no SPEC
/// frames of its own. Layout: `b"DSF1"`, `u32 spec_bytes`, the spec ([`Spec::encode`]), zero
/// padding to a multiple of 64, then one DATA frame (`spec_id` 0) to the end.
pub const ELEMENT_MAGIC: [u8; 4] = *b"DSF1";

/// The bytes of a self-contained element before its DATA frame (see [`ELEMENT_MAGIC`]).
pub fn element_prefix(spec: &[u8]) -> Vec<u8> {
    let len = (8 + spec.len()).next_multiple_of(64);
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&ELEMENT_MAGIC);
    out.extend_from_slice(&(spec.len() as u32).to_le_bytes());
    out.extend_from_slice(spec);
    out.resize(len, 0);
    out
}

/// Splits a self-contained element into its spec bytes and the offset of its DATA frame,
/// checking the magic, the spec's length and the frame's header (kind DATA, `total_bytes`
/// reaching exactly to the end). Errors are `ElementCorrupted` naming the byte offset.
pub fn split_element(buf: &[u8]) -> Result<(&[u8], usize), Error> {
    let bad = |offset: usize, what: &str| Error::ElementCorrupted {
        offset: offset as u64,
        len: buf.len() as u64,
        what: what.to_string(),
    };
    if buf.len() < 8 || buf[..4] != ELEMENT_MAGIC {
        return Err(bad(0, "not a dataservice element (bad magic)"));
    }
    let spec_len = u32::from_le_bytes(buf[4..8].try_into().unwrap()) as usize;
    let frame_start = (8 + spec_len).next_multiple_of(64);
    if frame_start > buf.len() {
        return Err(bad(
            4,
            &format!("its {spec_len}-byte spec runs past the end"),
        ));
    }
    if buf.len() - frame_start < HEADER_BYTES {
        return Err(bad(frame_start, "the element's frame is truncated"));
    }
    let header =
        FrameHeader::parse(&buf[frame_start..]).map_err(|_| bad(frame_start, "bad frame magic"))?;
    if header.kind != KIND_DATA {
        return Err(bad(
            frame_start,
            &format!("frame kind {} is not DATA", header.kind),
        ));
    }
    if header.total_bytes != (buf.len() - frame_start) as u64 {
        return Err(bad(
            frame_start,
            &format!(
                "the frame declares {} bytes, {} follow",
                header.total_bytes,
                buf.len() - frame_start
            ),
        ));
    }
    Ok((&buf[8..8 + spec_len], frame_start))
}

#[cfg(test)]
mod tests;
