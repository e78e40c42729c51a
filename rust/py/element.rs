//! Functions of `dataservice._core` over one element at a time, for the gRPC path (which has
//! no ring and no SPEC frames) and the worker's structure check: `encode_element` /
//! `decode_element` (a self-contained element, `transport::frame::ELEMENT_MAGIC`),
//! `copy_if_plain` (`data.structure.normalize_element`'s walk) and
//! `ElementCheck` (`transport::codec::PlainStructure`). They convert and forward.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PySet, PyString, PyTuple};

use crate::error::Error;
use crate::py::decode::{self, Batch};
use crate::transport::codec::{self, DecodeSpec, Encoder, PlainStructure, SendPtr};
use crate::transport::frame::{self, FramePlan, Spec};

/// The encoder `encode_element` uses: it keeps the structures of recent elements compiled.
/// Taken with `try_lock` only (a pickled leaf may run Python code that lets another thread
/// in, which must not wait on it holding the GIL): a busy encoder means a fresh one.
static ENCODER: Mutex<Option<Encoder>> = Mutex::new(None);

/// Specs `decode_element` has resolved, by their bytes; cleared when it holds too many.
static SPECS: Mutex<Option<HashMap<Vec<u8>, Arc<DecodeSpec>>>> = Mutex::new(None);
const MAX_SPECS: usize = 64;

/// The bytes of `element` as one self-contained element (see `_core.pyi`): its
/// `Encoding`, copied whole into a new `bytes` object that is not zeroed first
/// (`PyBytes::new_with` zeroes: a wasted pass, ~12% of a worker's CPU on 9.6 MB elements).
#[pyfunction]
pub fn encode_element<'py>(
    py: Python<'py>,
    element: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let encoding = encode_element_later(element)?;
    encoding.piece(py, 0, encoding.__len__())
}

/// An element's encoding, flattened now and copied later, one piece at a time (see
/// `_core.pyi`): a large element crosses gRPC in pieces of about 1 MiB, each made just
/// before it is sent, so a worker never holds the whole encoding and its allocator
/// reuses the same few blocks instead of mapping fresh pages for every element.
#[pyclass(name = "Encoding", module = "dataservice._core", frozen)]
pub struct PyEncoding {
    prefix: Vec<u8>,
    // Declared before `_pinned`: the plan's borrowed payloads point into its buffers.
    plan: FramePlan<'static>,
    _pinned: Pinned,
    element: Py<PyAny>,
}

/// The buffers and objects an encoding's payloads point into.
struct Pinned {
    _holders: Vec<codec::HeldBuffer>,
    _objects: Vec<Py<PyAny>>,
}

// SAFETY: after construction nothing writes to a `PyEncoding`'s fields: the plan and
// prefix are only read (also from detached sections, through `piece`), and the held
// buffer views are released once, when Python deallocates the object (the GIL held).
unsafe impl Sync for Pinned {}

#[pymethods]
impl PyEncoding {
    fn __len__(&self) -> usize {
        self.prefix.len() + self.plan.total_bytes as usize
    }

    /// The element this is the encoding of.
    #[getter]
    fn element(&self, py: Python<'_>) -> Py<PyAny> {
        self.element.clone_ref(py)
    }

    /// Bytes `[start, end)` of the encoding, as a new `bytes` object.
    fn piece<'py>(
        &self,
        py: Python<'py>,
        start: usize,
        end: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let total = self.__len__();
        if start > end || end > total {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "piece [{start}, {end}) of an encoding of {total} bytes"
            )));
        }
        new_bytes_filled(py, end - start, |out| {
            let dst = SendPtr(out);
            let copy = move || {
                let dst = dst;
                // SAFETY: `dst` is the new bytes object's end - start bytes, not shared yet.
                unsafe { self.write_range(start, end, dst.0) }
            };
            codec::copy_detached_if_large(py, end - start, copy);
        })
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.piece(py, 0, self.__len__())
    }
}

impl PyEncoding {
    /// Writes bytes `[start, end)` of the encoding (`start <= end <= len`) to `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for `end - start` bytes of writes and overlap neither the
    /// prefix nor a payload (a new object's memory).
    unsafe fn write_range(&self, start: usize, end: usize, dst: *mut u8) {
        let prefix_len = self.prefix.len();
        let head_end = end.min(prefix_len);
        if start < head_end {
            // SAFETY: [start, head_end) lies inside both the prefix and [start, end), whose
            // end - start bytes `dst` holds; they do not overlap (caller's duty).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.prefix.as_ptr().add(start),
                    dst,
                    head_end - start,
                )
            };
        }
        let from = start.max(prefix_len);
        if from < end {
            // SAFETY: the plan's bytes [from - prefix_len, end - prefix_len) go to dst's last
            // end - from bytes; copy_range writes each of them; the payloads are pinned by
            // `self._pinned` (alive as long as `self`) and do not overlap dst.
            unsafe {
                self.plan.copy_range(
                    (from - prefix_len) as u64,
                    (end - prefix_len) as u64,
                    dst.add(from - start),
                )
            };
        }
    }
}

/// One `bytes` object of `parts` (each `bytes` or an `Encoding`) back to back (see
/// `_core.pyi`): one copy of each, where joining `bytes(encoding)`s would make two.
#[pyfunction]
pub fn join_encoded<'py>(
    py: Python<'py>,
    parts: &Bound<'py, PyList>,
) -> PyResult<Bound<'py, PyBytes>> {
    enum Part<'a> {
        Bytes(&'a [u8]),
        Later(&'a PyEncoding),
    }
    let mut held = Vec::with_capacity(parts.len());
    for part in parts.iter() {
        held.push(part);
    }
    let mut plan = Vec::with_capacity(held.len());
    let mut total = 0usize;
    for part in &held {
        if let Ok(b) = part.cast::<PyBytes>() {
            let bytes = b.as_bytes();
            total += bytes.len();
            plan.push(Part::Bytes(bytes));
        } else if let Ok(e) = part.cast::<PyEncoding>() {
            let e: &PyEncoding = e.get();
            total += e.__len__();
            plan.push(Part::Later(e));
        } else {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "join_encoded takes bytes and Encoding objects, not {}",
                part.get_type().name()?
            )));
        }
    }
    new_bytes_filled(py, total, |out| {
        let dst = SendPtr(out);
        let plan = &plan;
        let copy = move || {
            let dst = dst;
            let mut at = 0usize;
            for part in plan {
                match part {
                    Part::Bytes(bytes) => {
                        // SAFETY: `dst` holds `total` bytes, the sum of the parts' lengths, so
                        // [at, at + len) is inside it; a bytes object's buffer (kept alive
                        // by `held`, immutable) does not overlap a new object.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                bytes.as_ptr(),
                                dst.0.add(at),
                                bytes.len(),
                            )
                        };
                        at += bytes.len();
                    }
                    Part::Later(e) => {
                        let n = e.__len__();
                        // SAFETY: as above: [at, at + n) is inside the new object's bytes.
                        unsafe { e.write_range(0, n, dst.0.add(at)) };
                        at += n;
                    }
                }
            }
        };
        codec::copy_detached_if_large(py, total, copy);
    })
}

/// `element` flattened for `Encoding.piece` (see `_core.pyi`); nothing is copied yet.
#[pyfunction]
pub fn encode_element_later(element: &Bound<'_, PyAny>) -> PyResult<PyEncoding> {
    let flat = match ENCODER.try_lock() {
        Ok(mut guard) => guard
            .get_or_insert_with(Encoder::default)
            .flatten(element)?,
        Err(_) => Encoder::default().flatten(element)?,
    };
    let mut spec_bytes = Vec::new();
    flat.spec.encode(&mut spec_bytes);
    let codec::Flat {
        leaves,
        holders,
        objects,
        ..
    } = flat;
    Ok(PyEncoding {
        prefix: frame::element_prefix(&spec_bytes),
        plan: FramePlan::data_aligned(0, leaves, false),
        _pinned: Pinned {
            _holders: holders,
            _objects: objects,
        },
        element: element.clone().unbind(),
    })
}

/// A new `bytearray` of `size` bytes that are not zeroed first (see `_core.pyi`).
#[pyfunction]
pub fn bytearray_to_fill(py: Python<'_>, size: usize) -> PyResult<Bound<'_, PyByteArray>> {
    let size = ffi::Py_ssize_t::try_from(size)
        .map_err(|_| pyo3::exceptions::PyOverflowError::new_err("bytearray too large"))?;
    // SAFETY: the GIL is held (`py`); with a NULL source, PyByteArray_FromStringAndSize
    // returns a new reference to a bytearray of `size` bytes it did not initialise (the
    // caller's to overwrite before reading them), or NULL with an exception set.
    let obj = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            ffi::PyByteArray_FromStringAndSize(std::ptr::null(), size),
        )?
    };
    // SAFETY: PyByteArray_FromStringAndSize made a bytearray.
    Ok(unsafe { obj.cast_into_unchecked::<PyByteArray>() })
}

/// A new `bytes` object of `len` bytes, which `fill` must write, every one of them,
/// through the pointer it is given (the buffer is not zeroed first, and no Rust
/// reference to it exists while it holds uninitialised bytes).
fn new_bytes_filled<'py>(
    py: Python<'py>,
    len: usize,
    fill: impl FnOnce(*mut u8),
) -> PyResult<Bound<'py, PyBytes>> {
    let size = ffi::Py_ssize_t::try_from(len)
        .map_err(|_| pyo3::exceptions::PyOverflowError::new_err("element too large"))?;
    // SAFETY: the GIL is held (`py`); with a NULL source, PyBytes_FromStringAndSize
    // returns a new reference to a bytes object of `size` uninitialised bytes (NUL
    // terminated), or NULL with an exception set, which from_owned_ptr_or_err raises.
    let obj = unsafe {
        Bound::from_owned_ptr_or_err(py, ffi::PyBytes_FromStringAndSize(std::ptr::null(), size))?
    };
    // SAFETY: `obj` is a bytes object (just made) that no other code has seen yet;
    // PyBytes_AS_STRING is its `len`-byte buffer, which `fill` writes before anyone reads.
    let data = unsafe { ffi::PyBytes_AsString(obj.as_ptr()) }.cast::<u8>();
    fill(data);
    // SAFETY: PyBytes_FromStringAndSize made a bytes object.
    Ok(unsafe { obj.cast_into_unchecked::<PyBytes>() })
}

fn decode_spec(py: Python<'_>, spec_bytes: &[u8], frame_start: u64) -> PyResult<Arc<DecodeSpec>> {
    if let Ok(guard) = SPECS.lock() {
        if let Some(s) = guard.as_ref().and_then(|m| m.get(spec_bytes)) {
            return Ok(s.clone());
        }
    }
    // Resolving imports namedtuple classes (Python code): outside the lock.
    let spec = Spec::decode(spec_bytes)?;
    let spec = Arc::new(DecodeSpec::new(py, spec, frame_start)?);
    let mut evicted = None;
    if let Ok(mut guard) = SPECS.lock() {
        let map = guard.get_or_insert_with(HashMap::new);
        if map.len() >= MAX_SPECS {
            evicted = Some(std::mem::take(map));
        }
        map.insert(spec_bytes.to_vec(), spec.clone());
    }
    drop(evicted); // its Python objects go after the lock is released
    Ok(spec)
}

/// Rebuilds an element from `encode_element`'s bytes (see `_core.pyi`).
#[pyfunction]
pub fn decode_element<'py>(py: Python<'py>, data: &Bound<'py, PyAny>) -> PyResult<Py<PyAny>> {
    // A buffer export for the whole decode: a bytearray cannot be resized under it.
    let held = codec::HeldBuffer::get(data, ffi::PyBUF_SIMPLE)
        .ok_or_else(|| pyo3::exceptions::PyTypeError::new_err("data is not a buffer"))?;
    let bytes = held.bytes();
    let len = bytes.len() as u64;
    let (spec_bytes, frame_start) = frame::split_element(bytes)?;
    let spec = decode_spec(py, spec_bytes, frame_start as u64)
        .map_err(|e| damaged(py, e, frame_start as u64, len))?;
    // A bytearray is the caller's to hand over: array leaves become views of it (through a
    // memoryview, as numpy.frombuffer does); other buffers are copied from.
    let view_base = if data.is_exact_instance_of::<PyByteArray>() {
        // SAFETY: `data` is a live bytearray; the GIL is held.
        let mv = unsafe { ffi::PyMemoryView_FromObject(data.as_ptr()) };
        // SAFETY: a new reference, or NULL with an error set.
        Some(unsafe { Bound::from_owned_ptr_or_err(py, mv)? })
    } else {
        None
    };
    let mut lease = |_: Python<'py>,
                     _: &frame::LeafDesc,
                     payload: &[u8],
                     _: u64|
     -> PyResult<Option<(Bound<'py, PyAny>, *const u8)>> {
        Ok(view_base.as_ref().map(|b| (b.clone(), payload.as_ptr())))
    };
    let frame_bytes = &bytes[frame_start..];
    let mut batch = Batch::default();
    let out = PyList::empty(py);
    decode::decode_data(
        py,
        frame_bytes,
        frame_start as u64,
        0,
        &spec,
        &mut batch,
        &mut lease,
    )
    .and_then(|_| decode::flush_batch(py, &spec, &mut batch, &out))
    .map_err(|e| damaged(py, e, frame_start as u64, len))?;
    drop(held);
    Ok(out.get_item(0)?.unbind())
}

/// `value` copied one level deep, or None (see `_core.pyi`): an exact dict whose keys are all
/// str and whose values' exact types are all in `keep` (a dict copy), such a list (a list
/// copy), or such a tuple (itself). What `structure.normalize_element` does to an element of
/// many leaves that needs no change, in one walk without a Python call per leaf.
#[pyfunction]
pub fn copy_if_plain<'py>(
    value: &Bound<'py, PyAny>,
    keep: &Bound<'py, PySet>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    // The last type found in `keep`: most leaves of an element share one (ndarray).
    let mut last: *mut ffi::PyTypeObject = std::ptr::null_mut();
    let mut kept = |v: &Bound<'py, PyAny>| -> PyResult<bool> {
        // SAFETY: `v` is a live object; its type pointer is read, never dereferenced here.
        let ty = unsafe { ffi::Py_TYPE(v.as_ptr()) };
        if ty == last {
            return Ok(true);
        }
        let found = keep.contains(v.get_type())?;
        if found {
            last = ty;
        }
        Ok(found)
    };
    if let Ok(d) = value.cast_exact::<PyDict>() {
        for (k, v) in d.iter() {
            if !k.is_exact_instance_of::<PyString>() || !kept(&v)? {
                return Ok(None);
            }
        }
        return Ok(Some(d.copy()?.into_any()));
    }
    if let Ok(l) = value.cast_exact::<PyList>() {
        for v in l.iter() {
            if !kept(&v)? {
                return Ok(None);
            }
        }
        return Ok(Some(l.get_slice(0, l.len()).into_any()));
    }
    if let Ok(t) = value.cast_exact::<PyTuple>() {
        for v in t.iter() {
            if !kept(&v)? {
                return Ok(None);
            }
        }
        return Ok(Some(value.clone()));
    }
    Ok(None)
}

/// A frame-level DataLossError (worded for the ring) reworded for a self-contained element.
fn damaged(py: Python<'_>, err: PyErr, frame_start: u64, len: u64) -> PyErr {
    let is_data_loss = err.get_type(py).name().is_ok_and(|n| n == "DataLossError");
    if !is_data_loss {
        return err;
    }
    let message = err.value(py).to_string();
    let what = match message.split_once(": ") {
        Some((head, rest)) if head.starts_with("shared-memory ring corrupted") => rest.to_string(),
        _ => message,
    };
    Error::ElementCorrupted {
        offset: frame_start,
        len,
        what,
    }
    .into()
}

/// A stream's element structure, learnt from one element, that the next ones are checked
/// against in one walk (see `_core.pyi`). Thread-compatible (the worker's producer thread).
#[pyclass(name = "ElementCheck", module = "dataservice._core")]
#[derive(Default)]
pub struct PyElementCheck {
    structure: Option<PlainStructure>,
}

#[pymethods]
impl PyElementCheck {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Learns `element`'s structure; False (and nothing learnt) if it holds anything but
    /// plain numpy values.
    fn learn(&mut self, element: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.structure = PlainStructure::learn(element)?;
        Ok(self.structure.is_some())
    }

    /// The element's bytes (as `element_nbytes` counts them) if it has the learnt
    /// structure, else None.
    fn nbytes_if_same(&self, element: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        match &self.structure {
            Some(s) => s.nbytes_if_same(element),
            None => Ok(None),
        }
    }
}
