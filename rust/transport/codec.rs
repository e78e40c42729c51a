//! Python elements <-> frames (TRANSPORT.md §6): numpy arrays of any fixed-size dtype,
//! numpy scalars, bytes, str, int/float/bool/None, numpy object arrays of bytes (VARBYTES),
//! nested tuple/list/dict/namedtuple; anything else becomes a pickled leaf.
//!
//! The producer ([`Encoder`]) reads payloads through the buffer protocol without a copy
//! (C-contiguous arrays; others are made contiguous first). The consumer ([`Decoder`]) builds
//! numpy scalars column-wise (one `frombuffer` per leaf per batch), copies small leaves and
//! hands out large ones as views kept alive by a lease (see `rust/py/decode.rs`).

use std::collections::HashMap;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};
use pyo3::{ffi, intern};

use crate::error::Error;
use crate::transport::frame::{self, Dims, LeafDesc, LeafIn, LeafKind, LeafSpec, Payload, Spec};
use crate::transport::npy;

mod decode;
mod dict_keys;
mod plain;

pub use decode::{copy_leaf, DecodeSpec};
use dict_keys::DictKeys;
pub use plain::PlainStructure;

/// numpy, pickle and collections callables, imported once.
pub struct Api {
    pub ndarray: Py<PyType>,
    /// numpy.ma.MaskedArray: pickled whole, as a plain array would lose its mask.
    pub masked_array: Py<PyType>,
    pub generic: Py<PyType>,
    pub empty: Py<PyAny>,
    pub frombuffer: Py<PyAny>,
    pub dtype: Py<PyAny>,
    pub array: Py<PyAny>,
    pub ascontiguousarray: Py<PyAny>,
    pub object_dtype: Py<PyAny>,
    pub dumps: Py<PyAny>,
    pub loads: Py<PyAny>,
    pub namedtuple: Py<PyAny>,
}

static API: PyOnceLock<Api> = PyOnceLock::new();

pub fn api(py: Python<'_>) -> PyResult<&Api> {
    API.get_or_try_init(py, || {
        let np = py.import("numpy")?;
        let pickle = py.import("pickle")?;
        let dtype = np.getattr("dtype")?;
        Ok::<_, PyErr>(Api {
            ndarray: np.getattr("ndarray")?.cast_into::<PyType>()?.unbind(),
            masked_array: py
                .import("numpy.ma")?
                .getattr("MaskedArray")?
                .cast_into::<PyType>()?
                .unbind(),
            generic: np.getattr("generic")?.cast_into::<PyType>()?.unbind(),
            empty: np.getattr("empty")?.unbind(),
            frombuffer: np.getattr("frombuffer")?.unbind(),
            array: np.getattr("array")?.unbind(),
            ascontiguousarray: np.getattr("ascontiguousarray")?.unbind(),
            object_dtype: dtype.call1(("O",))?.unbind(),
            dtype: dtype.unbind(),
            dumps: pickle.getattr("dumps")?.unbind(),
            loads: pickle.getattr("loads")?.unbind(),
            namedtuple: py.import("collections")?.getattr("namedtuple")?.unbind(),
        })
    })
}

/// A buffer-protocol view held while a frame is written; released (with the GIL) on drop.
pub struct HeldBuffer {
    view: Box<ffi::Py_buffer>,
}

impl HeldBuffer {
    /// `PyObject_GetBuffer(obj, flags)`, or None (error cleared) if `obj` refuses.
    pub fn get(obj: &Bound<'_, PyAny>, flags: std::ffi::c_int) -> Option<Self> {
        let mut view = Box::new(ffi::Py_buffer::new());
        // SAFETY: obj is a live object (we hold the GIL via Bound); view is a valid,
        // zeroed Py_buffer we own.
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc != 0 {
            // SAFETY: GIL held; clears the error PyObject_GetBuffer set.
            unsafe { ffi::PyErr_Clear() };
            return None;
        }
        Some(HeldBuffer { view })
    }

    pub fn bytes(&self) -> &[u8] {
        if self.view.len == 0 || self.view.buf.is_null() {
            return &[];
        }
        // SAFETY: a successful PyObject_GetBuffer with a contiguous request gives `len`
        // readable bytes at `buf`, valid until PyBuffer_Release (our drop).
        unsafe { std::slice::from_raw_parts(self.view.buf as *const u8, self.view.len as usize) }
    }

    fn shape(&self) -> Vec<u64> {
        let ndim = self.view.ndim.max(0) as usize;
        if self.view.shape.is_null() {
            return if ndim == 0 {
                vec![]
            } else {
                vec![self.view.len as u64]
            };
        }
        // SAFETY: with PyBUF_ND the exporter fills `shape` with `ndim` entries.
        (0..ndim)
            .map(|i| unsafe { *self.view.shape.add(i) } as u64)
            .collect()
    }
}

impl Drop for HeldBuffer {
    fn drop(&mut self) {
        // SAFETY: the view came from a successful PyObject_GetBuffer and is released once;
        // HeldBuffers are only created and dropped while the GIL is held (put_many).
        unsafe { ffi::PyBuffer_Release(&mut *self.view) };
    }
}

// SAFETY: a HeldBuffer never leaves the thread that holds the GIL for its creation and drop;
// only its byte slice (plain memory, pinned by the view) is read from a detached section.
unsafe impl Send for HeldBuffer {}

#[derive(Clone)]
struct DtypeInfo {
    /// Kept alive so its address is never reused by another dtype.
    _obj: std::sync::Arc<Py<PyAny>>,
    str_: String,
    itemsize: u32,
    /// 'O' objects, structured or otherwise unsuitable for raw bytes.
    raw_ok: bool,
    native: bool,
    kind: char,
}

/// Producer side: flattens elements into leaves and tracks the current spec.
///
/// The structures of the last few elements are kept compiled ([`Compiled`]): an element of
/// one of them is flattened by walking it along that structure (a dict's items read in one
/// pass while it lists the learnt keys in the learnt order, else looked up by key: see
/// `DictKeys`; arrays read through numpy's struct), without building or
/// comparing a `Spec`; any difference sends it down the general walk, which compiles its
/// structure in turn.
#[derive(Default)]
pub struct Encoder {
    dtypes: HashMap<usize, DtypeInfo>,
    scalar_types: HashMap<usize, DtypeInfo>,
    /// Most recently used first, at most `MAX_COMPILED`.
    compiled: Vec<Compiled>,
}

/// Structures an encoder keeps compiled: a stream's, and a few more for an encoder shared
/// by several streams (the gRPC path's).
const MAX_COMPILED: usize = 4;
/// numpy's `NPY_USERDEF`: dtypes numbered from here are registered by other modules.
const USER_DEFINED_DTYPE_NUM: i64 = 256;
/// Most leaves a frame holds (its header counts them in a u16); an element with more is
/// pickled whole, as one leaf.
pub const MAX_LEAVES: usize = u16::MAX as usize;

/// A structure seen before, with the Python objects that identify its parts.
struct Compiled {
    spec: Arc<Spec>,
    node: CNode,
}

/// One node of a compiled structure: what an element's value there must be.
enum CNode {
    /// An exact numpy.ndarray of this dtype object (native, raw), C-contiguous, of `ndim`.
    Array {
        dtype: Py<PyAny>,
        ndim: usize,
        itemsize: u32,
    },
    /// A numpy scalar of this exact type.
    Scalar {
        ty: Py<PyType>,
        itemsize: u32,
    },
    Bytes,
    Str,
    PyInt,
    PyFloat,
    PyBool,
    None,
    Tuple(Vec<CNode>),
    List(Vec<CNode>),
    /// An exact dict of these keys; its values' nodes, in the keys' order.
    Dict(DictKeys, Vec<CNode>),
    NamedTuple(Py<PyType>, Vec<CNode>),
}

/// One flattened element: its structure, leaves, and the buffers pinning the leaves' bytes.
pub struct Flat {
    pub spec: Arc<Spec>,
    pub leaves: Vec<LeafIn<'static>>,
    /// Must outlive every use of `leaves` (their Borrowed slices point into these).
    pub holders: Vec<HeldBuffer>,
    pub objects: Vec<Py<PyAny>>,
}

impl Encoder {
    fn dtype_info(&mut self, dtype: &Bound<'_, PyAny>) -> PyResult<DtypeInfo> {
        let key = dtype.as_ptr() as usize;
        if let Some(info) = self.dtypes.get(&key) {
            return Ok(info.clone());
        }
        let py = dtype.py();
        // ml_dtypes' bfloat16 & co. have `str` "<V2": sent by name instead (see decode.rs).
        let num: i64 = dtype.getattr(intern!(py, "num"))?.extract()?;
        let str_: String = if num >= USER_DEFINED_DTYPE_NUM {
            dtype.getattr(intern!(py, "name"))?.extract()?
        } else {
            dtype.getattr(intern!(py, "str"))?.extract()?
        };
        let itemsize: u32 = dtype.getattr(intern!(py, "itemsize"))?.extract()?;
        let hasobject: bool = dtype.getattr(intern!(py, "hasobject"))?.extract()?;
        let has_fields = !dtype.getattr(intern!(py, "fields"))?.is_none();
        let kind: char = dtype.getattr(intern!(py, "kind"))?.extract()?;
        let byteorder: String = dtype.getattr(intern!(py, "byteorder"))?.extract()?;
        let info = DtypeInfo {
            _obj: std::sync::Arc::new(dtype.clone().unbind()),
            str_,
            itemsize,
            raw_ok: !hasobject && !has_fields && itemsize > 0,
            native: byteorder != ">",
            kind,
        };
        if self.dtypes.len() > 1024 {
            self.dtypes.clear();
        }
        self.dtypes.insert(key, info.clone());
        Ok(info)
    }

    /// Flattens `obj` into leaves (tf.nest order: dicts by sorted key).
    pub fn flatten(&mut self, obj: &Bound<'_, PyAny>) -> PyResult<Flat> {
        let mut flat = Flat {
            spec: Arc::new(Spec::Tuple(vec![])),
            leaves: Vec::new(),
            holders: Vec::new(),
            objects: Vec::new(),
        };
        // Taken out for the walk, which may use the general path for a leaf (&mut self).
        let mut compiled = std::mem::take(&mut self.compiled);
        let mut hit = None;
        for i in 0..compiled.len() {
            match self.fast_walk(obj, &compiled[i].node, &mut flat) {
                Ok(true) => {
                    hit = Some(i);
                    break;
                }
                Ok(false) => {
                    flat.leaves.clear();
                    flat.holders.clear();
                    flat.objects.clear();
                }
                Err(e) => {
                    self.compiled = compiled;
                    return Err(e);
                }
            }
        }
        if let Some(i) = hit {
            let c = compiled.remove(i);
            flat.spec = c.spec.clone();
            compiled.insert(0, c);
            self.compiled = compiled;
            return Ok(flat);
        }
        self.compiled = compiled;
        let spec = self.walk(obj, &mut flat, 0)?;
        if flat.leaves.len() > MAX_LEAVES {
            flat.leaves.clear();
            flat.holders.clear();
            flat.objects.clear();
            let spec = self.pickle_leaf(obj, &mut flat)?;
            flat.spec = Arc::new(spec);
            return Ok(flat);
        }
        let spec = Arc::new(spec);
        if let Some(node) = self.compile(obj, &spec)? {
            self.compiled.retain(|c| *c.spec != *spec);
            self.compiled.truncate(MAX_COMPILED - 1);
            self.compiled.insert(
                0,
                Compiled {
                    spec: spec.clone(),
                    node,
                },
            );
        }
        flat.spec = spec;
        Ok(flat)
    }

    /// The compiled form of `spec`, the structure the general walk found for `obj`; None if
    /// a leaf has no fast form (pickled, object array, byte-swapped, a subclass, ...).
    fn compile(&mut self, obj: &Bound<'_, PyAny>, spec: &Spec) -> PyResult<Option<CNode>> {
        let py = obj.py();
        Ok(Some(match spec {
            Spec::Leaf(leaf) => match leaf.kind {
                LeafKind::Array => {
                    if !npy::is_exact_ndarray(obj)? {
                        return Ok(None);
                    }
                    let dtype = obj.getattr(intern!(py, "dtype"))?;
                    let info = self.dtype_info(&dtype)?;
                    if !info.raw_ok || !info.native || info.str_ != leaf.dtype {
                        return Ok(None);
                    }
                    CNode::Array {
                        dtype: dtype.unbind(),
                        ndim: leaf.ndim as usize,
                        itemsize: info.itemsize,
                    }
                }
                LeafKind::Scalar => CNode::Scalar {
                    ty: obj.get_type().unbind(),
                    itemsize: leaf.itemsize,
                },
                LeafKind::Bytes => CNode::Bytes,
                LeafKind::Str => CNode::Str,
                LeafKind::PyInt => CNode::PyInt,
                LeafKind::PyFloat => CNode::PyFloat,
                LeafKind::PyBool => CNode::PyBool,
                LeafKind::None => CNode::None,
                LeafKind::Pickle | LeafKind::VarBytes => return Ok(None),
            },
            Spec::Tuple(items) | Spec::List(items) | Spec::NamedTuple { items, .. } => {
                let seq = obj.cast::<PyTuple>().map(|t| t.iter().collect::<Vec<_>>());
                let seq = match seq {
                    Ok(v) => v,
                    Err(_) => obj.cast::<PyList>()?.iter().collect(),
                };
                let mut nodes = Vec::with_capacity(items.len());
                for (item, s) in seq.iter().zip(items) {
                    match self.compile(item, s)? {
                        Some(n) => nodes.push(n),
                        None => return Ok(None),
                    }
                }
                match spec {
                    Spec::Tuple(_) => CNode::Tuple(nodes),
                    Spec::List(_) => CNode::List(nodes),
                    _ => CNode::NamedTuple(obj.get_type().unbind(), nodes),
                }
            }
            Spec::Dict(items) => {
                let d = obj.cast::<PyDict>()?;
                let names = items.iter().map(|(k, _)| k.as_str());
                let Some((keys, values)) = DictKeys::learn(d, names)? else {
                    return Ok(None);
                };
                let mut nodes = Vec::with_capacity(items.len());
                for (item, (_, s)) in values.iter().zip(items) {
                    match self.compile(item, s)? {
                        Some(n) => nodes.push(n),
                        None => return Ok(None),
                    }
                }
                CNode::Dict(keys, nodes)
            }
        }))
    }

    fn walk(&mut self, obj: &Bound<'_, PyAny>, flat: &mut Flat, depth: usize) -> PyResult<Spec> {
        let py = obj.py();
        let api = api(py)?;
        if depth > 32 {
            return self.pickle_leaf(obj, flat);
        }
        let ty = obj.get_type();
        // numpy scalars first (np.str_ / np.bytes_ are also str / bytes).
        if let Some(info) = self.scalar_types.get(&(ty.as_ptr() as usize)) {
            let info = info.clone();
            return self.scalar_leaf(obj, &info, flat);
        }
        if obj.is_instance(api.generic.bind(py))? {
            let info = self.dtype_info(&obj.getattr(intern!(py, "dtype"))?)?;
            if !info.raw_ok || !info.native {
                return self.pickle_leaf(obj, flat);
            }
            if matches!(info.kind, 'b' | 'i' | 'u' | 'f' | 'c') {
                // Numeric scalar types map to one dtype each: cache by type.
                self.scalar_types.insert(ty.as_ptr() as usize, info.clone());
            }
            return self.scalar_leaf(obj, &info, flat);
        }
        if obj.is_instance(api.ndarray.bind(py))? {
            if !ty.is(api.ndarray.bind(py)) && obj.is_instance(api.masked_array.bind(py))? {
                return self.pickle_leaf(obj, flat);
            }
            return self.array_leaf(obj, flat);
        }
        if let Ok(b) = obj.cast::<PyBytes>() {
            let bytes = b.as_bytes();
            // SAFETY: the bytes object is kept alive in flat.objects, and bytes are immutable.
            let s: &'static [u8] =
                unsafe { std::slice::from_raw_parts(bytes.as_ptr(), bytes.len()) };
            flat.objects.push(obj.clone().unbind());
            return Ok(self.push(flat, LeafKind::Bytes, "", 0, vec![], Payload::Borrowed(s)));
        }
        if let Ok(s) = obj.cast::<PyString>() {
            return match s.to_str() {
                Ok(text) => {
                    // SAFETY: the UTF-8 buffer is cached inside the str object, which
                    // flat.objects keeps alive; str is immutable.
                    let b: &'static [u8] =
                        unsafe { std::slice::from_raw_parts(text.as_ptr(), text.len()) };
                    flat.objects.push(obj.clone().unbind());
                    Ok(self.push(flat, LeafKind::Str, "", 0, vec![], Payload::Borrowed(b)))
                }
                Err(_) => self.pickle_leaf(obj, flat), // lone surrogates
            };
        }
        if obj.is_exact_instance_of::<PyBool>() {
            let v = u8::from(obj.extract::<bool>()?);
            return Ok(self.push(
                flat,
                LeafKind::PyBool,
                "",
                0,
                vec![],
                Payload::Owned(vec![v]),
            ));
        }
        if obj.is_exact_instance_of::<PyInt>() {
            return match obj.extract::<i64>() {
                Ok(v) => Ok(self.push(
                    flat,
                    LeafKind::PyInt,
                    "",
                    0,
                    vec![],
                    Payload::Owned(v.to_le_bytes().to_vec()),
                )),
                Err(_) => self.pickle_leaf(obj, flat),
            };
        }
        if obj.is_exact_instance_of::<PyFloat>() {
            let v: f64 = obj.extract()?;
            return Ok(self.push(
                flat,
                LeafKind::PyFloat,
                "",
                0,
                vec![],
                Payload::Owned(v.to_le_bytes().to_vec()),
            ));
        }
        if obj.is_none() {
            return Ok(self.push(flat, LeafKind::None, "", 0, vec![], Payload::Owned(vec![])));
        }
        if let Ok(t) = obj.cast::<PyTuple>() {
            if obj.is_exact_instance_of::<PyTuple>() {
                let mut items = Vec::with_capacity(t.len());
                for item in t.iter() {
                    items.push(self.walk(&item, flat, depth + 1)?);
                }
                return Ok(Spec::Tuple(items));
            }
            if let Ok(fields) = ty.getattr(intern!(py, "_fields")) {
                let fields: Vec<String> = match fields.extract() {
                    Ok(f) => f,
                    Err(_) => return self.pickle_leaf(obj, flat),
                };
                if fields.len() == t.len() {
                    let module: String = ty.getattr(intern!(py, "__module__"))?.extract()?;
                    let name: String = ty.getattr(intern!(py, "__qualname__"))?.extract()?;
                    let mut items = Vec::with_capacity(t.len());
                    for item in t.iter() {
                        items.push(self.walk(&item, flat, depth + 1)?);
                    }
                    return Ok(Spec::NamedTuple {
                        module,
                        name,
                        fields,
                        items,
                    });
                }
            }
            return self.pickle_leaf(obj, flat);
        }
        if obj.is_exact_instance_of::<PyList>() {
            let l = obj.cast::<PyList>()?;
            let mut items = Vec::with_capacity(l.len());
            for item in l.iter() {
                items.push(self.walk(&item, flat, depth + 1)?);
            }
            return Ok(Spec::List(items));
        }
        if obj.is_exact_instance_of::<PyDict>() {
            let d = obj.cast::<PyDict>()?;
            let mut keyed: Vec<(String, Bound<'_, PyAny>)> = Vec::with_capacity(d.len());
            for (k, v) in d.iter() {
                match k.cast::<PyString>() {
                    Ok(k) if k.is_exact_instance_of::<PyString>() => {
                        keyed.push((k.to_str()?.to_string(), v))
                    }
                    _ => return self.pickle_leaf(obj, flat),
                }
            }
            keyed.sort_by(|a, b| a.0.cmp(&b.0));
            let mut items = Vec::with_capacity(keyed.len());
            for (k, v) in keyed {
                let s = self.walk(&v, flat, depth + 1)?;
                items.push((k, s));
            }
            return Ok(Spec::Dict(items));
        }
        self.pickle_leaf(obj, flat)
    }

    fn push(
        &mut self,
        flat: &mut Flat,
        kind: LeafKind,
        dtype: &str,
        itemsize: u32,
        dims: Vec<u64>,
        payload: Payload<'static>,
    ) -> Spec {
        let ndim = match kind {
            LeafKind::Array | LeafKind::VarBytes => dims.len() as u8,
            _ => 0,
        };
        flat.leaves.push(LeafIn {
            kind,
            itemsize,
            dims: dims.into(),
            payload,
        });
        Spec::Leaf(LeafSpec {
            kind,
            dtype: dtype.to_string(),
            ndim,
            itemsize,
        })
    }

    fn pickle_leaf(&mut self, obj: &Bound<'_, PyAny>, flat: &mut Flat) -> PyResult<Spec> {
        let py = obj.py();
        let data = api(py)?.dumps.bind(py).call1((obj, 5))?;
        let bytes = data.cast::<PyBytes>()?.as_bytes().to_vec();
        Ok(self.push(flat, LeafKind::Pickle, "", 0, vec![], Payload::Owned(bytes)))
    }

    fn scalar_leaf(
        &mut self,
        obj: &Bound<'_, PyAny>,
        info: &DtypeInfo,
        flat: &mut Flat,
    ) -> PyResult<Spec> {
        let bytes: Vec<u8> = match HeldBuffer::get(obj, ffi::PyBUF_SIMPLE) {
            Some(b) if b.bytes().len() == info.itemsize as usize => b.bytes().to_vec(),
            _ => {
                let b = obj.call_method0(intern!(obj.py(), "tobytes"))?;
                b.cast::<PyBytes>()?.as_bytes().to_vec()
            }
        };
        if bytes.len() != info.itemsize as usize {
            return self.pickle_leaf(obj, flat);
        }
        Ok(self.push(
            flat,
            LeafKind::Scalar,
            &info.str_,
            info.itemsize,
            vec![],
            Payload::Owned(bytes),
        ))
    }

    fn array_leaf(&mut self, obj: &Bound<'_, PyAny>, flat: &mut Flat) -> PyResult<Spec> {
        let py = obj.py();
        let info = self.dtype_info(&obj.getattr(intern!(py, "dtype"))?)?;
        if info.kind == 'O' {
            return self.varbytes_leaf(obj, flat);
        }
        if !info.raw_ok {
            return self.pickle_leaf(obj, flat);
        }
        let mut arr = obj.clone();
        let mut info = info;
        if !info.native {
            let native = obj
                .getattr(intern!(py, "dtype"))?
                .call_method1(intern!(py, "newbyteorder"), ("=",))?;
            arr = obj.call_method1(intern!(py, "astype"), (native,))?;
            info = self.dtype_info(&arr.getattr(intern!(py, "dtype"))?)?;
        }
        let held = match HeldBuffer::get(&arr, ffi::PyBUF_C_CONTIGUOUS) {
            Some(h) => h,
            None => {
                arr = api(py)?.ascontiguousarray.bind(py).call1((&arr,))?;
                match HeldBuffer::get(&arr, ffi::PyBUF_C_CONTIGUOUS) {
                    Some(h) => h,
                    None => return self.pickle_leaf(obj, flat),
                }
            }
        };
        let dims = held.shape();
        let bytes = held.bytes();
        // SAFETY: the slice points into the exporter's memory, pinned by `held`, which is
        // stored in flat.holders and outlives every use of flat.leaves (Flat's contract).
        let s: &'static [u8] = unsafe { std::slice::from_raw_parts(bytes.as_ptr(), bytes.len()) };
        flat.holders.push(held);
        flat.objects.push(arr.unbind());
        Ok(self.push(
            flat,
            LeafKind::Array,
            &info.str_,
            info.itemsize,
            dims,
            Payload::Borrowed(s),
        ))
    }

    fn varbytes_leaf(&mut self, obj: &Bound<'_, PyAny>, flat: &mut Flat) -> PyResult<Spec> {
        let py = obj.py();
        let shape: Vec<u64> = obj.getattr(intern!(py, "shape"))?.extract()?;
        let items = obj
            .call_method0(intern!(py, "ravel"))?
            .call_method0(intern!(py, "tolist"))?;
        let items = items.cast::<PyList>()?;
        let mut parts: Vec<Vec<u8>> = Vec::with_capacity(items.len());
        for item in items.iter() {
            match item.cast::<PyBytes>() {
                Ok(b) => parts.push(b.as_bytes().to_vec()),
                Err(_) => return self.pickle_leaf(obj, flat),
            }
        }
        let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
        let payload = frame::varbytes_payload(&refs);
        Ok(self.push(
            flat,
            LeafKind::VarBytes,
            "",
            0,
            shape,
            Payload::Owned(payload),
        ))
    }
}

impl Encoder {
    /// Flattens `obj` along the compiled structure `node` into `flat`'s leaves; false (leaves
    /// partly filled, for the caller to clear) as soon as `obj` differs from it.
    fn fast_walk(
        &mut self,
        obj: &Bound<'_, PyAny>,
        node: &CNode,
        flat: &mut Flat,
    ) -> PyResult<bool> {
        let py = obj.py();
        let leaf = |flat: &mut Flat, kind, itemsize, dims, payload| {
            flat.leaves.push(LeafIn {
                kind,
                itemsize,
                dims,
                payload,
            });
            true
        };
        Ok(match node {
            CNode::Array {
                dtype,
                ndim,
                itemsize,
            } => {
                if !npy::is_exact_ndarray(obj)? {
                    return Ok(false);
                }
                let Some(info) = npy::array_info(obj)? else {
                    return Ok(false);
                };
                if info.descr != dtype.as_ptr() || info.dims.len() != *ndim {
                    return Ok(false);
                }
                if !info.c_contiguous {
                    // A strided view: the general path makes it contiguous; the leaf is the same.
                    let spec = self.array_leaf(obj, flat)?;
                    return Ok(matches!(spec, Spec::Leaf(l) if l.kind == LeafKind::Array));
                }
                let dims: Dims = info.dims.iter().map(|&d| d as u64).collect();
                let n = dims.iter().product::<u64>() * u64::from(*itemsize);
                let bytes: &'static [u8] = if n == 0 || info.data.is_null() {
                    &[]
                } else {
                    // SAFETY: a C-contiguous ndarray of these dims and dtype holds n bytes at
                    // `data`. The array is kept alive in flat.objects until the frame is copied;
                    // its bytes can move only through `ndarray.resize(refcheck=False)`, which
                    // numpy documents as unsafe while other references exist (we hold one).
                    unsafe { std::slice::from_raw_parts(info.data, n as usize) }
                };
                flat.objects.push(obj.clone().unbind());
                leaf(
                    flat,
                    LeafKind::Array,
                    *itemsize,
                    dims,
                    Payload::Borrowed(bytes),
                )
            }
            CNode::Scalar { ty, itemsize } => {
                if !obj.get_type().is(ty.bind(py)) {
                    return Ok(false);
                }
                match HeldBuffer::get(obj, ffi::PyBUF_SIMPLE) {
                    Some(b) if b.bytes().len() == *itemsize as usize => leaf(
                        flat,
                        LeafKind::Scalar,
                        *itemsize,
                        Dims::default(),
                        Payload::Owned(b.bytes().to_vec()),
                    ),
                    _ => false,
                }
            }
            CNode::Bytes => match obj.cast_exact::<PyBytes>() {
                Ok(b) => {
                    let bytes = b.as_bytes();
                    // SAFETY: the bytes object is kept alive in flat.objects; bytes are immutable.
                    let s: &'static [u8] =
                        unsafe { std::slice::from_raw_parts(bytes.as_ptr(), bytes.len()) };
                    flat.objects.push(obj.clone().unbind());
                    leaf(
                        flat,
                        LeafKind::Bytes,
                        0,
                        Dims::default(),
                        Payload::Borrowed(s),
                    )
                }
                Err(_) => false,
            },
            CNode::Str => match obj.cast_exact::<PyString>().map(|s| s.to_str()) {
                Ok(Ok(text)) => {
                    // SAFETY: the UTF-8 buffer is cached inside the str object, which
                    // flat.objects keeps alive; str is immutable.
                    let b: &'static [u8] =
                        unsafe { std::slice::from_raw_parts(text.as_ptr(), text.len()) };
                    flat.objects.push(obj.clone().unbind());
                    leaf(
                        flat,
                        LeafKind::Str,
                        0,
                        Dims::default(),
                        Payload::Borrowed(b),
                    )
                }
                _ => false,
            },
            CNode::PyInt => {
                if !obj.is_exact_instance_of::<PyInt>() {
                    return Ok(false);
                }
                match obj.extract::<i64>() {
                    Ok(v) => leaf(
                        flat,
                        LeafKind::PyInt,
                        0,
                        Dims::default(),
                        Payload::Owned(v.to_le_bytes().to_vec()),
                    ),
                    Err(_) => false,
                }
            }
            CNode::PyFloat => {
                if !obj.is_exact_instance_of::<PyFloat>() {
                    return Ok(false);
                }
                let v: f64 = obj.extract()?;
                leaf(
                    flat,
                    LeafKind::PyFloat,
                    0,
                    Dims::default(),
                    Payload::Owned(v.to_le_bytes().to_vec()),
                )
            }
            CNode::PyBool => {
                if !obj.is_exact_instance_of::<PyBool>() {
                    return Ok(false);
                }
                let v = u8::from(obj.extract::<bool>()?);
                leaf(
                    flat,
                    LeafKind::PyBool,
                    0,
                    Dims::default(),
                    Payload::Owned(vec![v]),
                )
            }
            CNode::None => {
                if !obj.is_none() {
                    return Ok(false);
                }
                leaf(
                    flat,
                    LeafKind::None,
                    0,
                    Dims::default(),
                    Payload::Owned(vec![]),
                )
            }
            CNode::Tuple(items) => match obj.cast_exact::<PyTuple>() {
                Ok(t) if t.len() == items.len() => self.walk_items(t.iter(), items, flat)?,
                _ => false,
            },
            CNode::NamedTuple(ty, items) => {
                if !obj.get_type().is(ty.bind(py)) {
                    return Ok(false);
                }
                match obj.cast::<PyTuple>() {
                    Ok(t) if t.len() == items.len() => self.walk_items(t.iter(), items, flat)?,
                    _ => false,
                }
            }
            CNode::List(items) => match obj.cast_exact::<PyList>() {
                Ok(l) if l.len() == items.len() => self.walk_items(l.iter(), items, flat)?,
                _ => false,
            },
            CNode::Dict(keys, nodes) => match obj.cast_exact::<PyDict>() {
                // Same length and every compiled key present: the same keys.
                Ok(d) if d.len() == nodes.len() => {
                    let mark = (flat.leaves.len(), flat.holders.len(), flat.objects.len());
                    match keys.visit_in_order(d, |i, v| self.fast_walk(v, &nodes[i], flat))? {
                        Some(same) => same,
                        None => {
                            // Another order: undo what was walked, and look the keys up.
                            flat.leaves.truncate(mark.0);
                            flat.holders.truncate(mark.1);
                            flat.objects.truncate(mark.2);
                            match keys.looked_up(d)? {
                                Some(values) => self.walk_items(values.into_iter(), nodes, flat)?,
                                None => false,
                            }
                        }
                    }
                }
                _ => false,
            },
        })
    }

    fn walk_items<'py>(
        &mut self,
        values: impl Iterator<Item = Bound<'py, PyAny>>,
        nodes: &[CNode],
        flat: &mut Flat,
    ) -> PyResult<bool> {
        for (v, n) in values.zip(nodes) {
            if !self.fast_walk(&v, n, flat)? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// Whether `current` (a stream's spec so far) is `spec`: the same compiled structure (one
/// pointer compare) or an equal one.
pub fn same_spec(current: Option<&Arc<Spec>>, spec: &Arc<Spec>) -> bool {
    current.is_some_and(|c| Arc::ptr_eq(c, spec) || **c == **spec)
}

/// Copies at least this many bytes with the GIL released ([`copy_detached_if_large`]).
pub const GIL_FREE_COPY_BYTES: usize = 256 << 10;

/// Runs `copy`, a copy of `bytes` bytes, with the GIL released when it is at least
/// [`GIL_FREE_COPY_BYTES`], so the caller's other threads run meanwhile; a smaller copy
/// keeps the GIL: releasing it costs little, but taking it back from a thread running
/// Python waits up to that thread's switch interval (5 ms), far longer than the copy.
pub fn copy_detached_if_large<R: Send>(
    py: Python<'_>,
    bytes: usize,
    copy: impl FnOnce() -> R + Send,
) -> R {
    if bytes >= GIL_FREE_COPY_BYTES {
        py.detach(copy)
    } else {
        copy()
    }
}

#[derive(Clone, Copy)]
pub struct SendPtr(pub *mut u8);
// SAFETY: used only to move a pointer into a GIL-free section whose memory the caller pins.
unsafe impl Send for SendPtr {}
