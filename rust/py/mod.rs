//! Thin #[pyclass] wrappers over the pure-Rust modules: they convert Python <-> Rust and
//! forward; the GIL is released while they block. `lease` is shared by `ring` and
//! `window`, which do not use each other.

pub mod decode;
pub mod lease;
pub mod ring;
pub mod tfrecord;
pub mod window;

use std::sync::{Mutex, MutexGuard, TryLockError};

use pyo3::{PyErr, PyResult};

use crate::error::Error;

/// Takes `m` without blocking (a poisoned lock is taken as is): a pyclass used from
/// two Python threads at once raises `RingState` ("`what` in use by another thread
/// (`rule`)") instead of blocking while it holds the GIL.
pub(crate) fn try_lock<'a, T>(
    m: &'a Mutex<T>,
    what: &str,
    rule: &str,
) -> PyResult<MutexGuard<'a, T>> {
    match m.try_lock() {
        Ok(g) => Ok(g),
        Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
        Err(TryLockError::WouldBlock) => {
            Err(Error::RingState(format!("{what} in use by another thread ({rule})")).into())
        }
    }
}

/// A handshake's nonce: 16 bytes, or `LayoutMismatch`.
pub(crate) fn nonce(n: Option<&[u8]>) -> PyResult<Option<[u8; 16]>> {
    n.map(|n| {
        n.try_into().map_err(|_| {
            PyErr::from(Error::LayoutMismatch {
                what: "nonce must be 16 bytes".into(),
            })
        })
    })
    .transpose()
}
