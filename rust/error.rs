//! The one error type of the Rust core, and its single mapping to Python exceptions.
//!
//! Rust code returns `Result<T, Error>`; only [`From<Error> for PyErr`] below decides which
//! Python class a failure becomes. Classes of `dataservice.errors` are looked up by name at
//! raise time, so this crate never duplicates the Python hierarchy.

use std::io;
use std::path::Path;

/// Everything that can go wrong in the Rust core.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A record's length or data does not match its masked CRC32C.
    #[error("corrupted record at offset {offset} of {path}: {what}")]
    CorruptedRecord {
        path: String,
        /// Byte offset of the record's first header byte, in the uncompressed stream.
        offset: u64,
        what: String,
    },
    /// The file (or the decompressed stream) ends inside a record.
    #[error("truncated record at offset {offset} of {path}: {what}")]
    TruncatedRecord {
        path: String,
        /// Byte offset of the record's first header byte, in the uncompressed stream.
        offset: u64,
        what: String,
    },
    /// The GZIP or ZLIB stream itself is damaged, so no record can be recovered from it.
    #[error("corrupted {compression} stream at offset {offset} of {path}: {what}")]
    CorruptedStream {
        path: String,
        compression: &'static str,
        /// Offset, in the uncompressed stream, of the record being read when it failed.
        offset: u64,
        what: String,
    },
    /// `compression_type` is not one of None, "", "GZIP", "ZLIB".
    #[error("unknown compression_type {0:?}: expected None, \"\", \"GZIP\" or \"ZLIB\"")]
    UnknownCompression(String),
    /// The file (or a directory on its path) does not exist.
    #[error("{path}: no such file or directory")]
    NotFound { path: String },
    /// Any other operating-system error while `op` (e.g. "reading") `path`.
    #[error("error {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
    /// A method was called on a reader or writer after `close()`.
    #[error("I/O operation on closed {what} for {path}")]
    Closed { what: &'static str, path: String },
    /// The bytes of a shared-memory ring are not well-formed frames (never trusted).
    #[error("shared-memory ring corrupted at position {pos}: {what}")]
    RingCorrupted { pos: u64, what: String },
    /// A self-contained element (the gRPC path's) that is not well-formed (never trusted).
    #[error("damaged element of {len} bytes (at byte {offset}): {what}")]
    ElementCorrupted { offset: u64, len: u64, what: String },
    /// A ring size that is not a power of two in [64 KiB, 4 GiB].
    #[error("shm ring size {capacity_bytes} bytes is not a power of two between 64 KiB and 4 GiB")]
    InvalidRingSize { capacity_bytes: u64 },
    /// Reserving the ring's memory failed (full tmpfs, memory cgroup limit).
    #[error(
        "cannot reserve {requested_bytes} bytes of shared memory for a ring \
         ({available_bytes} bytes available to this process): {source}"
    )]
    ShmExhausted {
        requested_bytes: u64,
        available_bytes: u64,
        #[source]
        source: io::Error,
    },
    /// A received ring does not have the layout this build expects.
    #[error("shared-memory ring layout mismatch: {what}")]
    LayoutMismatch { what: String },
    /// An element does not fit the transport's limit.
    #[error("element of {element_bytes} bytes exceeds the limit of {limit_bytes} bytes ({what})")]
    ElementTooLarge {
        element_bytes: u64,
        limit_bytes: u64,
        what: String,
    },
    /// The process at the other end of a ring died or closed its end.
    #[error("ring peer gone: {what}")]
    PeerDied { what: String },
    /// A blocking ring call ran out of time.
    #[error("{what} timed out after {timeout_ms} ms")]
    RingTimeout { what: &'static str, timeout_ms: u64 },
    /// A ring end is used by another thread, closed, or used from a forked child.
    #[error("{0}")]
    RingState(String),
}

impl Error {
    /// Wraps an OS error that happened while `op` the file at `path`; a missing file becomes
    /// [`Error::NotFound`].
    pub fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        let path = path.display().to_string();
        if source.kind() == io::ErrorKind::NotFound {
            Error::NotFound { path }
        } else {
            Error::Io { op, path, source }
        }
    }

    /// True for the errors TensorFlow reports as `DataLossError`.
    pub fn is_data_loss(&self) -> bool {
        matches!(
            self,
            Error::CorruptedRecord { .. }
                | Error::TruncatedRecord { .. }
                | Error::CorruptedStream { .. }
        )
    }
}

impl Clone for Error {
    /// A copy with the same variant and message (an `io::Error` is rebuilt from its kind and
    /// text), so a failed reader can report its first error again.
    fn clone(&self) -> Self {
        match self {
            Error::CorruptedRecord { path, offset, what } => Error::CorruptedRecord {
                path: path.clone(),
                offset: *offset,
                what: what.clone(),
            },
            Error::TruncatedRecord { path, offset, what } => Error::TruncatedRecord {
                path: path.clone(),
                offset: *offset,
                what: what.clone(),
            },
            Error::CorruptedStream {
                path,
                compression,
                offset,
                what,
            } => Error::CorruptedStream {
                path: path.clone(),
                compression,
                offset: *offset,
                what: what.clone(),
            },
            Error::UnknownCompression(name) => Error::UnknownCompression(name.clone()),
            Error::NotFound { path } => Error::NotFound { path: path.clone() },
            Error::Io { op, path, source } => Error::Io {
                op,
                path: path.clone(),
                source: match source.raw_os_error() {
                    Some(code) => io::Error::from_raw_os_error(code),
                    None => io::Error::new(source.kind(), source.to_string()),
                },
            },
            Error::Closed { what, path } => Error::Closed {
                what,
                path: path.clone(),
            },
            Error::ShmExhausted {
                requested_bytes,
                available_bytes,
                source,
            } => Error::ShmExhausted {
                requested_bytes: *requested_bytes,
                available_bytes: *available_bytes,
                source: io::Error::new(source.kind(), source.to_string()),
            },
            Error::RingCorrupted { pos, what } => Error::RingCorrupted {
                pos: *pos,
                what: what.clone(),
            },
            Error::ElementCorrupted { offset, len, what } => Error::ElementCorrupted {
                offset: *offset,
                len: *len,
                what: what.clone(),
            },
            Error::InvalidRingSize { capacity_bytes } => Error::InvalidRingSize {
                capacity_bytes: *capacity_bytes,
            },
            Error::LayoutMismatch { what } => Error::LayoutMismatch { what: what.clone() },
            Error::ElementTooLarge {
                element_bytes,
                limit_bytes,
                what,
            } => Error::ElementTooLarge {
                element_bytes: *element_bytes,
                limit_bytes: *limit_bytes,
                what: what.clone(),
            },
            Error::PeerDied { what } => Error::PeerDied { what: what.clone() },
            Error::RingTimeout { what, timeout_ms } => Error::RingTimeout {
                what,
                timeout_ms: *timeout_ms,
            },
            Error::RingState(what) => Error::RingState(what.clone()),
        }
    }
}

#[cfg(feature = "python")]
mod python {
    use super::Error;
    use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTimeoutError, PyValueError};
    use pyo3::prelude::*;
    use pyo3::types::PyType;

    /// An instance of `dataservice.errors.<class_name>(message)`; if that module cannot be
    /// imported (a broken install), a `RuntimeError` saying so, with the message.
    fn dataservice_error(class_name: &str, message: String) -> PyErr {
        Python::attach(|py| {
            let class = py
                .import("dataservice.errors")
                .and_then(|module| module.getattr(class_name))
                .and_then(|class| class.cast_into::<PyType>().map_err(PyErr::from));
            match class {
                Ok(class) => PyErr::from_type(class, message),
                Err(import_error) => PyRuntimeError::new_err(format!(
                    "{message} (and dataservice.errors.{class_name} is unavailable: \
                     {import_error})"
                )),
            }
        })
    }

    impl From<Error> for PyErr {
        fn from(error: Error) -> PyErr {
            let message = error.to_string();
            match error {
                Error::CorruptedRecord { .. }
                | Error::TruncatedRecord { .. }
                | Error::CorruptedStream { .. } => dataservice_error("DataLossError", message),
                Error::NotFound { .. } => dataservice_error("NotFoundError", message),
                Error::UnknownCompression(_) | Error::Closed { .. } => {
                    PyValueError::new_err(message)
                }
                Error::RingCorrupted { .. } | Error::ElementCorrupted { .. } => {
                    dataservice_error("DataLossError", message)
                }
                Error::ShmExhausted { .. } => dataservice_error("ResourceExhaustedError", message),
                Error::ElementTooLarge { .. } => dataservice_error("ElementTooLargeError", message),
                Error::PeerDied { .. } => dataservice_error("UnavailableError", message),
                Error::LayoutMismatch { .. } => {
                    dataservice_error("FailedPreconditionError", message)
                }
                Error::InvalidRingSize { .. } => PyValueError::new_err(message),
                Error::RingTimeout { .. } => PyTimeoutError::new_err(message),
                Error::RingState(_) => PyRuntimeError::new_err(message),
                Error::Io { source, .. } => match source.raw_os_error() {
                    // OSError(errno, strerror) picks the subclass (PermissionError, ...).
                    Some(code) => PyOSError::new_err((code, message)),
                    None => PyOSError::new_err(message),
                },
            }
        }
    }
}
