//! Python class `RingLease` of `dataservice._core`: a writeable buffer over one leaf of a
//! ring frame, of a reassembled chunked element, or of the cache window; numpy views made
//! from it keep it, and so the memory under them, alive. Shared by `py::consumer`
//! and `py::window_reader`, which depend on it and not on each other.

use std::sync::Arc;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::shm::holds::WindowLeaf;
use crate::shm::ring::FrameLease;
use crate::transport::chunk::HeapBuf;

/// What keeps a lease's bytes valid.
pub(crate) enum LeaseOwner {
    /// A ring frame (and the ring's mapping).
    Frame(#[allow(dead_code)] Arc<FrameLease>),
    /// A chunked element rebuilt in private memory.
    Heap(#[allow(dead_code)] Arc<HeapBuf>),
    /// A leaf of the cross-trainer cache's window segment.
    Window(#[allow(dead_code)] Arc<WindowLeaf>),
}

/// A writable buffer over one leaf of a ring frame (or of a reassembled element, or of the
/// cache window); numpy views made from it keep it, and so the frame, alive. Frozen; any
/// thread.
#[pyclass(name = "RingLease", module = "dataservice._core", frozen)]
pub struct PyLease {
    _owner: LeaseOwner,
    ptr: usize,
    len: usize,
}

impl PyLease {
    /// A lease over `len` bytes at `ptr`, which `owner` keeps valid.
    pub(crate) fn new(owner: LeaseOwner, ptr: *const u8, len: usize) -> Self {
        PyLease {
            _owner: owner,
            ptr: ptr as usize,
            len,
        }
    }
}

#[pymethods]
impl PyLease {
    /// # Safety
    /// Called by CPython with a valid `view`.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: std::ffi::c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        // SAFETY: view is valid (CPython's duty); ptr/len stay valid while `slf` lives, and
        // PyBuffer_FillInfo takes a reference to slf for the view's life. Writable: a
        // consumer writing into its own frame cannot harm the protocol (TRANSPORT.md §5).
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                this.ptr as *mut std::ffi::c_void,
                this.len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::take(slf.py())
                .unwrap_or_else(|| PyBufferError::new_err("buffer request refused")));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.len
    }
}
