//! Thin #[pyclass] wrappers over the pure-Rust modules: they convert Python <-> Rust and
//! forward; the GIL is released while they block. `lease` and `decode` are shared by
//! `consumer` and the window classes; no two of `producer`, `consumer`, `window_writer`,
//! `window_reader` use each other.

pub mod consumer;
pub mod decode;
pub mod element;
pub mod lease;
pub mod producer;
pub mod tfrecord;
pub mod window_reader;
pub mod window_writer;

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

/// What a forked child's misuse of a ring end is called (`peer::check_pid`).
pub(crate) const RING_END: &str = "a ring end";

/// [`try_lock`] for a ring end (one thread per end).
pub(crate) fn ring_lock<'a, T>(
    m: &'a Mutex<Option<T>>,
    what: &str,
) -> PyResult<MutexGuard<'a, Option<T>>> {
    try_lock(m, what, "one thread per ring end")
}

/// `RingState` "`what` is closed".
pub(crate) fn closed(what: &str) -> PyErr {
    Error::RingState(format!("{what} is closed")).into()
}
