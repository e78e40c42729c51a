//! The one DATA-frame decoder of `_core`, used by the ring's consumer (`py::consumer`) and
//! the cache window's classes (`py::window_reader`, `py::window_writer`): leaf descriptors are parsed and checked by
//! `transport::frame`, numpy scalars are gathered column-wise (one `frombuffer` per leaf per
//! batch), small leaves are copied (`transport::codec`), and large numpy leaves become views
//! of a `RingLease` when the caller's `lease` function hands one out.

use std::collections::HashMap;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::error::Error;
use crate::py::lease::PyLease;
use crate::transport::codec::{self, DecodeSpec};
use crate::transport::frame::{self, FrameHeader, LeafDesc, LeafKind, Spec};

/// Makes a lease for an array leaf (its descriptor and payload bytes), or None to copy it.
pub(crate) type LeaseFn<'a, 'py> =
    dyn FnMut(Python<'py>, &LeafDesc, &[u8]) -> PyResult<Option<Bound<'py, PyLease>>> + 'a;

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

/// Decodes the DATA frame `bytes` (at ring or window position `pos`) of spec `spec` into
/// `batch`. Array leaves `lease` hands a lease for become views of it; the rest is copied.
/// Returns how many leaves were leased.
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
    let mut leased = 0;
    let mut vals = Vec::with_capacity(descs.len());
    for (i, d) in descs.iter().enumerate() {
        let payload = &bytes[d.offset as usize..(d.offset + d.nbytes) as usize];
        match d.kind {
            LeafKind::Scalar => {
                batch.columns[i].extend_from_slice(payload);
                vals.push(Val::Col(i));
            }
            LeafKind::Array => match lease(py, d, payload)? {
                Some(buf) => {
                    let api = codec::api(py)?;
                    let dtype = spec.dtypes[i].as_ref().expect("array has dtype");
                    let arr = api.frombuffer.bind(py).call1((buf, dtype.bind(py)))?;
                    let arr =
                        arr.call_method1(intern!(py, "reshape"), (PyTuple::new(py, &d.dims)?,))?;
                    leased += 1;
                    vals.push(Val::Obj(arr.unbind()));
                }
                None => vals.push(Val::Obj(codec::copy_leaf(py, spec, i, d, payload, pos)?)),
            },
            _ => vals.push(Val::Obj(codec::copy_leaf(py, spec, i, d, payload, pos)?)),
        }
    }
    batch.elements.push(vals);
    Ok(leased)
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
