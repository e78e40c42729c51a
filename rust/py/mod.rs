//! Thin #[pyclass] wrappers over the pure-Rust modules; the GIL is released while they block.

pub mod ring;
pub mod tfrecord;
pub mod window;

use std::sync::{Mutex, MutexGuard, TryLockError};

use pyo3::PyResult;

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
