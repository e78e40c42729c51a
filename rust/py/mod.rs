//! Thin #[pyclass] wrappers over the pure-Rust modules; the GIL is released while they block.

pub mod ring;
pub mod tfrecord;
pub mod window;
