//! The one DATA-frame decoder of `_core`, used by the ring's consumer (`py::consumer`) and
//! the cache window's classes (`py::window_reader`, `py::window_writer`): leaf descriptors are parsed and checked by
//! `transport::frame`, numpy scalars are gathered column-wise (one `frombuffer` per leaf per
//! batch), array leaves become numpy views (`transport::npy`) of what the caller's `lease`
//! function hands out (a `RingLease` over the frame) or else of one private copy of the
//! frame's small array leaves, and the other leaves are decoded by `transport::codec`.

use std::collections::HashMap;
use std::sync::Arc;

use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::error::Error;
use crate::py::lease::{LeaseOwner, PyLease};
use crate::transport::chunk::HeapBuf;
use crate::transport::codec::{self, DecodeSpec};
use crate::transport::frame::{self, FrameHeader, LeafDesc, LeafKind, Spec};
use crate::transport::npy;

/// Makes a view source for an array leaf (its descriptor, its payload bytes, and the
/// bytes of all the frame's array leaves): an object that keeps the leaf's bytes valid and
/// writable (a `RingLease`, a caller's bytearray), and the address of those bytes, or None
/// to copy the leaf.
pub(crate) type LeaseFn<'a, 'py> = dyn FnMut(Python<'py>, &LeafDesc, &[u8], u64) -> PyResult<Option<(Bound<'py, PyAny>, *const u8)>>
    + 'a;

/// A decoded leaf, or a numpy scalar still in its column.
enum Val {
    Obj(Py<PyAny>),
    Col(usize),
}

/// Elements decoded but not yet built, all of one spec. Thread-compatible.
#[derive(Default)]
pub(crate) struct Batch {
    /// Per element: its leaves.
    elements: Vec<Vec<Val>>,
    /// Per spec leaf: raw scalar bytes.
    columns: Vec<Vec<u8>>,
}

impl Batch {
    pub(crate) fn len(&self) -> usize {
        self.elements.len()
    }
}

fn corrupted(pos: u64, what: &str) -> PyErr {
    Error::RingCorrupted {
        pos,
        what: what.to_string(),
    }
    .into()
}

/// Copied array leaves smaller than this share one private buffer per frame (one
/// allocation and one Python object for all of them, then a numpy view each): an element of
/// many small leaves costs a view per leaf, not an allocation and a copy call per leaf. A
/// view kept alive keeps that buffer (at most the frame's copied bytes) alive.
pub const SHARED_COPY_MAX_BYTES: u64 = 64 << 10;
/// Offsets of leaves in the shared buffer are multiples of this (numpy's own allocations
/// are 16-aligned: any dtype's alignment).
const SHARED_COPY_ALIGN: u64 = 16;

/// A writeable numpy view of leaf `desc`'s bytes at `data`, which `base` keeps valid.
///
/// # Safety
/// `data` must point to `desc.nbytes` writable bytes that stay valid while `base` lives, and
/// `desc` must have been checked by `frame::parse_leaves` (nbytes = prod(dims) * itemsize).
unsafe fn view_of<'py>(
    py: Python<'py>,
    spec: &DecodeSpec,
    index: usize,
    desc: &LeafDesc,
    data: *const u8,
    base: &Bound<'py, PyAny>,
) -> PyResult<Py<PyAny>> {
    let dtype = spec.dtypes[index].as_ref().expect("array leaf has a dtype");
    // SAFETY: the caller's duties; DecodeSpec::new checked that the dtype's itemsize is the
    // spec's, which parse_leaves matched against nbytes and dims.
    Ok(unsafe { npy::view(py, dtype.bind(py), &desc.dims, data, true, base)? }.unbind())
}

/// Decodes the DATA frame `bytes` (at ring or window position `pos`) of spec `spec` into
/// `batch`. Array leaves `lease` hands a buffer for become views of it; other array leaves
/// are copied (those under [`SHARED_COPY_MAX_BYTES`] into one buffer shared by the frame's
/// leaves); the rest is decoded from its bytes. Returns how many leaves were leased.
///
/// Raises `DataLossError` (RingCorrupted) when the frame is not a valid DATA frame of
/// `spec_id`.
pub(crate) fn decode_data<'py>(
    py: Python<'py>,
    bytes: &[u8],
    pos: u64,
    spec_id: u32,
    spec: &DecodeSpec,
    batch: &mut Batch,
    lease: &mut LeaseFn<'_, 'py>,
) -> PyResult<u64> {
    let header = FrameHeader::parse(bytes)?;
    if header.kind != frame::KIND_DATA {
        return Err(corrupted(
            pos,
            &format!("frame kind {} is not DATA", header.kind),
        ));
    }
    if header.spec_id != spec_id {
        return Err(corrupted(pos, "data frame names an unknown spec"));
    }
    let spec_leaves: Vec<&frame::LeafSpec> = spec.leaves.iter().collect();
    let descs = frame::parse_leaves(bytes, &header, &spec_leaves, pos)?;
    if batch.columns.len() != spec.leaves.len() {
        batch.columns = vec![Vec::new(); spec.leaves.len()];
    }
    let array_bytes: u64 = descs
        .iter()
        .filter(|d| d.kind == LeafKind::Array)
        .map(|d| d.nbytes)
        .sum();
    let mut leased = 0;
    let mut vals = Vec::with_capacity(descs.len());
    // Array leaves to copy into the shared buffer: (leaf index, offset in the buffer).
    let mut shared: Vec<(usize, u64)> = Vec::new();
    let mut shared_bytes = 0u64;
    for (i, d) in descs.iter().enumerate() {
        let payload = &bytes[d.offset as usize..(d.offset + d.nbytes) as usize];
        match d.kind {
            LeafKind::Scalar => {
                batch.columns[i].extend_from_slice(payload);
                vals.push(Val::Col(i));
            }
            LeafKind::Array => match lease(py, d, payload, array_bytes)? {
                Some((base, data)) => {
                    leased += 1;
                    // SAFETY: `lease` returns the address of this leaf's bytes and an object
                    // keeping them valid and writable (LeaseFn's contract); parse_leaves
                    // checked the descriptor.
                    vals.push(Val::Obj(unsafe { view_of(py, spec, i, d, data, &base)? }));
                }
                None if d.nbytes > 0 && d.nbytes < SHARED_COPY_MAX_BYTES => {
                    shared_bytes = shared_bytes.next_multiple_of(SHARED_COPY_ALIGN);
                    if shared_bytes + d.nbytes > SHARED_COPY_MAX_BYTES {
                        // The buffer is full: the leaves so far get theirs (glibc maps
                        // bigger blocks afresh, each a round of page faults).
                        flush_shared(py, spec, bytes, &descs, &shared, shared_bytes, &mut vals)?;
                        shared.clear();
                        shared_bytes = 0;
                    }
                    shared.push((i, shared_bytes));
                    shared_bytes += d.nbytes;
                    vals.push(Val::Col(usize::MAX)); // filled by flush_shared
                }
                None => vals.push(Val::Obj(codec::copy_leaf(py, spec, i, d, payload, pos)?)),
            },
            _ => vals.push(Val::Obj(codec::copy_leaf(py, spec, i, d, payload, pos)?)),
        }
    }
    flush_shared(py, spec, bytes, &descs, &shared, shared_bytes, &mut vals)?;
    batch.elements.push(vals);
    Ok(leased)
}

/// Copies the array leaves `shared` ((leaf index, offset)) of the frame `bytes` into one new
/// writeable buffer of `len` bytes and puts a numpy view of it for each into `vals`. The
/// copies are small (each under [`SHARED_COPY_MAX_BYTES`]): they run with the GIL held.
fn flush_shared(
    py: Python<'_>,
    spec: &DecodeSpec,
    bytes: &[u8],
    descs: &[LeafDesc],
    shared: &[(usize, u64)],
    len: u64,
    vals: &mut [Val],
) -> PyResult<()> {
    if shared.is_empty() {
        return Ok(());
    }
    // Rust-owned memory behind a frozen RingLease: Python code can neither resize nor free
    // it while a view lives (a bytearray base could be cleared through `arr.base`).
    let heap = Arc::new(HeapBuf::new_unfilled(len as usize).ok_or_else(|| {
        PyMemoryError::new_err(format!(
            "cannot allocate {len} bytes for an element's leaves"
        ))
    })?);
    let start = heap.as_mut_ptr();
    // Every byte is written: the leaves (in increasing offsets), zeros in the alignment
    // gaps between them (a zeroing pass over all of it cost ~4% of a consumer's CPU on
    // elements of 100 small leaves).
    let mut written = 0u64;
    for &(i, off) in shared {
        let d = &descs[i];
        let src = &bytes[d.offset as usize..(d.offset + d.nbytes) as usize];
        // SAFETY: written <= off and [off, off + nbytes) lies within the buffer's `len`
        // bytes (the offsets were laid out in this order from these leaves' sizes);
        // nothing else has the buffer yet.
        unsafe {
            std::ptr::write_bytes(start.add(written as usize), 0, (off - written) as usize);
            std::ptr::copy_nonoverlapping(src.as_ptr(), start.add(off as usize), src.len());
        }
        written = off + d.nbytes;
    }
    // SAFETY: written <= len: the rest of the buffer, if any.
    unsafe { std::ptr::write_bytes(start.add(written as usize), 0, (len - written) as usize) };
    let base = Bound::new(
        py,
        PyLease::new(LeaseOwner::Heap(heap), start, len as usize),
    )?
    .into_any();
    for &(i, off) in shared {
        // SAFETY: as above, off + nbytes is within the buffer's len bytes.
        let data = unsafe { start.add(off as usize) };
        // SAFETY: `data` holds the leaf's nbytes (copied above); the lease over the heap
        // buffer keeps them valid and writable; parse_leaves checked the descriptor.
        vals[i] = Val::Obj(unsafe { view_of(py, spec, i, &descs[i], data, &base)? });
    }
    Ok(())
}

/// Builds the batch's elements (of spec `spec`) as Python objects, appending to `out`.
pub(crate) fn flush_batch(
    py: Python<'_>,
    spec: &DecodeSpec,
    batch: &mut Batch,
    out: &Bound<'_, PyList>,
) -> PyResult<()> {
    if batch.elements.is_empty() {
        return Ok(());
    }
    let api = codec::api(py)?;
    let mut cols: Vec<Option<Vec<Py<PyAny>>>> = Vec::with_capacity(batch.columns.len());
    for (i, col) in batch.columns.iter().enumerate() {
        if col.is_empty() {
            cols.push(None);
            continue;
        }
        let dtype = spec.dtypes[i].as_ref().expect("scalar leaf has a dtype");
        let arr = api
            .frombuffer
            .bind(py)
            .call1((PyBytes::new(py, col), dtype.bind(py)))?;
        let items: Vec<Py<PyAny>> = arr
            .try_iter()?
            .map(|x| x.map(|x| x.unbind()))
            .collect::<PyResult<_>>()?;
        cols.push(Some(items));
    }
    let mut rows = vec![0usize; cols.len()];
    for leaves in batch.elements.drain(..) {
        let mut vals = Vec::with_capacity(leaves.len());
        for v in leaves {
            vals.push(match v {
                Val::Obj(o) => o,
                Val::Col(i) => {
                    let col = cols[i].as_ref().expect("column filled");
                    let o = col[rows[i]].clone_ref(py);
                    rows[i] += 1;
                    o
                }
            });
        }
        let element = if matches!(spec.spec, Spec::Leaf(_)) {
            vals.pop().expect("one leaf")
        } else {
            spec.build(py, &mut vals.into_iter())?
        };
        out.append(element)?;
    }
    for c in batch.columns.iter_mut() {
        c.clear();
    }
    Ok(())
}

/// Decodes the DATA frame `bytes` at position `pos` of the cache window into one element,
/// its spec looked up in `specs` (`lease` as in [`decode_data`]).
///
/// Raises `DataLossError` (RingCorrupted) for an unknown spec id or an invalid frame.
pub(crate) fn decode_element<'py>(
    py: Python<'py>,
    bytes: &[u8],
    pos: u64,
    specs: &HashMap<u32, DecodeSpec>,
    lease: &mut LeaseFn<'_, 'py>,
) -> PyResult<Bound<'py, PyAny>> {
    let header = FrameHeader::parse(bytes)?;
    let spec = specs.get(&header.spec_id).ok_or_else(|| {
        corrupted(
            pos,
            &format!("cache window: unknown spec id {}", header.spec_id),
        )
    })?;
    let mut batch = Batch::default();
    decode_data(py, bytes, pos, header.spec_id, spec, &mut batch, lease)?;
    let out = PyList::empty(py);
    flush_batch(py, spec, &mut batch, &out)?;
    out.get_item(0)
}
