//! The few numpy C-API calls the codec makes per leaf, without a Python-level call each:
//! reading an array's data pointer, shape, dtype and flags (the public `PyArrayObject_fields`
//! layout, unchanged since numpy 1.7 and the same in numpy 2) and making an array view of a
//! buffer (`PyArray_NewFromDescr` + `PyArray_SetBaseObject`, slots 94 and 282 of numpy's
//! `_ARRAY_API` table, the same in numpy 1 and 2). What rust-numpy does, for two functions.
//!
//! Source: numpy/_core/include/numpy/ndarraytypes.h (`PyArrayObject_fields`, flag values)
//! and `__multiarray_api.h` (table slots).

use std::ffi::{c_int, c_void};

use pyo3::exceptions::PyRuntimeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyCapsuleMethods, PyType};

/// `NPY_ARRAY_C_CONTIGUOUS`.
const C_CONTIGUOUS: c_int = 0x0001;
/// `NPY_ARRAY_WRITEABLE`.
const WRITEABLE: c_int = 0x0400;
/// Slot of `PyArray_NewFromDescr` in `_ARRAY_API`.
const SLOT_NEW_FROM_DESCR: usize = 94;
/// Slot of `PyArray_SetBaseObject` in `_ARRAY_API`.
const SLOT_SET_BASE_OBJECT: usize = 282;
/// `NPY_MAXDIMS` of numpy 2 (numpy 1: 32); frames allow no more either (`frame::MAX_NDIM`).
const MAX_DIMS: usize = 64;

/// `PyArrayObject_fields` up to `flags`: the part of the layout read here.
#[repr(C)]
struct ArrayFields {
    ob_base: ffi::PyObject,
    data: *mut u8,
    nd: c_int,
    dimensions: *const isize,
    strides: *const isize,
    base: *mut ffi::PyObject,
    descr: *mut ffi::PyObject,
    flags: c_int,
}

type NewFromDescr = unsafe extern "C" fn(
    *mut ffi::PyTypeObject,
    *mut ffi::PyObject,
    c_int,
    *const isize,
    *const isize,
    *mut c_void,
    c_int,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;
type SetBaseObject = unsafe extern "C" fn(*mut ffi::PyObject, *mut ffi::PyObject) -> c_int;

struct Table {
    ndarray: Py<PyType>,
    new_from_descr: NewFromDescr,
    set_base_object: SetBaseObject,
}

// SAFETY: the table holds a type object (a Py, Send) and two function pointers into numpy's
// extension module, which stays loaded for the life of the process.
unsafe impl Send for Table {}
// SAFETY: as above; the function pointers are only called with the GIL held.
unsafe impl Sync for Table {}

static TABLE: PyOnceLock<Table> = PyOnceLock::new();

fn table(py: Python<'_>) -> PyResult<&Table> {
    TABLE.get_or_try_init(py, || {
        // numpy 2 keeps the table in numpy._core, numpy 1 in numpy.core.
        let module = py
            .import("numpy._core._multiarray_umath")
            .or_else(|_| py.import("numpy.core.multiarray"))?;
        let capsule = module.getattr("_ARRAY_API")?.cast_into::<PyCapsule>()?;
        let api = capsule.pointer_checked(None)?.as_ptr() as *const *const c_void;
        // SAFETY: `api` is numpy's C-API table (an array of function pointers far longer
        // than slot 282 in every numpy since 1.7); the slots hold the functions named in
        // the constants' comments, with the signatures of `NewFromDescr` and `SetBaseObject`.
        let (new_from_descr, set_base_object) = unsafe {
            (
                std::mem::transmute::<*const c_void, NewFromDescr>(*api.add(SLOT_NEW_FROM_DESCR)),
                std::mem::transmute::<*const c_void, SetBaseObject>(*api.add(SLOT_SET_BASE_OBJECT)),
            )
        };
        let ndarray = py
            .import("numpy")?
            .getattr("ndarray")?
            .cast_into::<PyType>()?
            .unbind();
        Ok(Table {
            ndarray,
            new_from_descr,
            set_base_object,
        })
    })
}

/// An ndarray's fields as the encoder needs them; valid while the array is alive and not
/// resized (the encoder holds a reference, and a buffer export for arrays it copies with
/// the GIL released).
pub struct ArrayInfo<'a> {
    pub data: *const u8,
    pub dims: &'a [isize],
    /// The dtype object (borrowed from the array).
    pub descr: *mut ffi::PyObject,
    pub c_contiguous: bool,
}

/// The fields of `obj` if it is a numpy.ndarray (or a subclass), else None.
pub fn array_info<'a>(obj: &'a Bound<'_, PyAny>) -> PyResult<Option<ArrayInfo<'a>>> {
    let t = table(obj.py())?;
    if !obj.is_instance(t.ndarray.bind(obj.py()))? {
        return Ok(None);
    }
    let fields = obj.as_ptr() as *const ArrayFields;
    // SAFETY: `obj` is an ndarray instance (checked above), so its object starts with
    // `PyArrayObject_fields`; the GIL is held and `obj` is borrowed for 'a, so the fields
    // and the `dimensions` array (nd entries, owned by the array) stay valid for 'a.
    unsafe {
        let nd = (*fields).nd.max(0) as usize;
        let dims = if nd == 0 || (*fields).dimensions.is_null() {
            &[][..]
        } else {
            std::slice::from_raw_parts((*fields).dimensions, nd.min(MAX_DIMS))
        };
        Ok(Some(ArrayInfo {
            data: (*fields).data,
            dims,
            descr: (*fields).descr,
            c_contiguous: (*fields).flags & C_CONTIGUOUS != 0,
        }))
    }
}

/// A C-ordered array of `dtype` and `dims` over the bytes at `data`, which `base` keeps
/// alive (the array holds a reference to it): `numpy.ndarray(dims, dtype, base, offset)`
/// without parsing arguments. Writeable if `writeable`.
///
/// # Safety
/// `data` must point to at least `prod(dims) * dtype.itemsize` bytes that stay valid (and,
/// if `writeable`, writable) for as long as `base` is alive; `dtype` must be a numpy dtype.
pub unsafe fn view<'py>(
    py: Python<'py>,
    dtype: &Bound<'py, PyAny>,
    dims: &[u64],
    data: *const u8,
    writeable: bool,
    base: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let t = table(py)?;
    if dims.len() > MAX_DIMS {
        return Err(PyRuntimeError::new_err("array has more than 64 dimensions"));
    }
    let mut shape = [0isize; MAX_DIMS];
    for (s, &d) in shape.iter_mut().zip(dims) {
        *s = isize::try_from(d)
            .map_err(|_| PyRuntimeError::new_err("array dimension out of range"))?;
    }
    let flags = if writeable { WRITEABLE } else { 0 };
    // SAFETY: the GIL is held; PyArray_NewFromDescr steals a reference to the dtype, so one
    // is added first; `shape` holds dims.len() entries; strides NULL means C order; the
    // caller guarantees `data` holds the array's bytes for as long as `base` lives.
    let arr = unsafe {
        ffi::Py_INCREF(dtype.as_ptr());
        (t.new_from_descr)(
            t.ndarray.as_ptr() as *mut ffi::PyTypeObject,
            dtype.as_ptr(),
            dims.len() as c_int,
            shape.as_ptr(),
            std::ptr::null(),
            data as *mut c_void,
            flags,
            std::ptr::null_mut(),
        )
    };
    // SAFETY: a new reference, or NULL with a Python error set.
    let arr = unsafe { Bound::from_owned_ptr_or_err(py, arr)? };
    // SAFETY: `arr` is a fresh ndarray without a base; SetBaseObject steals the reference
    // added here (on failure too) and makes the array keep `base` alive.
    let rc = unsafe {
        ffi::Py_INCREF(base.as_ptr());
        (t.set_base_object)(arr.as_ptr(), base.as_ptr())
    };
    if rc != 0 {
        return Err(PyErr::take(py)
            .unwrap_or_else(|| PyRuntimeError::new_err("PyArray_SetBaseObject failed")));
    }
    Ok(arr)
}

/// numpy.ndarray, the exact type (numpy.ndarray subclasses are not "plain" arrays).
pub fn is_exact_ndarray(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let t = table(obj.py())?;
    Ok(obj.get_type().is(t.ndarray.bind(obj.py())))
}
