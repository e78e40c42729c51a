//! The Rust core of dataservice, imported as `dataservice._core` (private: users import
//! `dataservice`). This file only registers; logic lives in the modules below.

pub mod error;
#[cfg(feature = "python")]
mod py;
pub mod shm;
pub mod sync;
pub mod tfrecord;
pub mod transport;

#[cfg(feature = "python")]
#[pyo3::pymodule]
fn _core(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
    use pyo3::prelude::*;

    m.add_class::<py::tfrecord::PyTFRecordReader>()?;
    m.add_class::<py::tfrecord::PyTFRecordWriter>()?;
    m.add_function(wrap_pyfunction!(py::tfrecord::read_tfrecord_file, m)?)?;
    m.add_function(wrap_pyfunction!(py::tfrecord::crc32c, m)?)?;
    m.add_function(wrap_pyfunction!(py::tfrecord::masked_crc32c, m)?)?;
    m.add_function(wrap_pyfunction!(py::element::encode_element, m)?)?;
    m.add_function(wrap_pyfunction!(py::element::decode_element, m)?)?;
    m.add_function(wrap_pyfunction!(py::element::encode_element_later, m)?)?;
    m.add_class::<py::element::PyEncoding>()?;
    m.add_function(wrap_pyfunction!(py::element::join_encoded, m)?)?;
    m.add_function(wrap_pyfunction!(py::element::bytearray_to_fill, m)?)?;
    m.add_function(wrap_pyfunction!(py::element::copy_if_plain, m)?)?;
    m.add_class::<py::element::PyElementCheck>()?;
    m.add_class::<py::producer::PyRingProducer>()?;
    m.add_class::<py::consumer::PyRingConsumer>()?;
    m.add_class::<py::lease::PyLease>()?;
    m.add_class::<py::window_writer::PyWindowWriter>()?;
    m.add_class::<py::window_reader::PyWindowReader>()?;
    Ok(())
}
