//! Python classes `TFRecordReader` and `TFRecordWriter` and functions `read_tfrecord_file`,
//! `crc32c`, `masked_crc32c` of `dataservice._core`, over [`crate::tfrecord`].

use std::path::PathBuf;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::error::Error;
use crate::tfrecord::{self, Compression, RecordReader, RecordWriter};

/// Calls `f` with the bytes of a bytes-like object: `bytes` without a copy, anything else
/// with the buffer protocol (`bytearray`, `memoryview`, uint8 numpy arrays) as a copy, so
/// that `f` may run without the GIL while other threads mutate the original.
fn with_bytes<R>(data: &Bound<'_, PyAny>, f: impl FnOnce(&[u8]) -> R) -> PyResult<R> {
    if let Ok(bytes) = data.cast::<PyBytes>() {
        return Ok(f(bytes.as_bytes()));
    }
    let buffer = PyBuffer::<u8>::get(data)?;
    let copy = buffer.to_vec(data.py())?;
    Ok(f(&copy))
}

/// Iterator over the records of one TFRecord file, as `bytes`; checks both CRCs of each.
/// Thread-compatible: one thread at a time (a concurrent call raises `RuntimeError`).
#[pyclass(name = "TFRecordReader", module = "dataservice._core")]
pub struct PyTFRecordReader {
    path: String,
    /// `None` once closed.
    reader: Option<RecordReader>,
    /// The reader's offset when it was closed.
    closed_offset: u64,
}

impl PyTFRecordReader {
    fn reader(&mut self) -> Result<&mut RecordReader, Error> {
        self.reader.as_mut().ok_or_else(|| Error::Closed {
            what: "TFRecordReader",
            path: self.path.clone(),
        })
    }
}

#[pymethods]
impl PyTFRecordReader {
    #[new]
    #[pyo3(signature = (path, compression_type = None, buffer_bytes = 262144))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        compression_type: Option<&str>,
        buffer_bytes: usize,
    ) -> PyResult<Self> {
        let compression = Compression::parse(compression_type)?;
        let reader = py.detach(|| RecordReader::open(&path, compression, buffer_bytes))?;
        Ok(PyTFRecordReader {
            path: reader.path().to_string(),
            reader: Some(reader),
            closed_offset: 0,
        })
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next record; reads the header, allocates the `bytes`, then reads the data into it,
    /// each read without the GIL. A record of a compressed file over 16 MiB is read first,
    /// into a buffer that grows as the stream produces it, then copied into the `bytes`.
    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let reader = self.reader()?;
        let Some(len) = py.detach(|| reader.read_header())? else {
            return Ok(None);
        };
        if !reader.may_allocate_declared_length(len) {
            // A compressed stream's record over 16 MiB: its length is not trusted to size the
            // `bytes` before the stream has produced the data (one more copy).
            let data = py.detach(|| reader.read_body_incrementally())?;
            return Ok(Some(PyBytes::new(py, &data)));
        }
        let record = PyBytes::new_with(py, len, |buf| {
            py.detach(|| reader.read_body(buf)).map_err(PyErr::from)
        });
        if record.is_err() && reader.has_pending_record() {
            // The bytes object could not be allocated: the reader cannot go on.
            reader.abandon_pending_record();
        }
        record.map(Some)
    }

    /// Bytes of the uncompressed stream consumed by the records returned so far.
    #[getter]
    fn offset(&self) -> u64 {
        self.reader
            .as_ref()
            .map_or(self.closed_offset, RecordReader::offset)
    }

    /// The file being read.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// Closes the file; later reads raise ValueError. Closing twice is a no-op.
    fn close(&mut self) {
        if let Some(reader) = self.reader.take() {
            self.closed_offset = reader.offset();
        }
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[pyo3(signature = (_exc_type = None, _exc_value = None, _traceback = None))]
    fn __exit__(
        &mut self,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc_value: Option<&Bound<'_, PyAny>>,
        _traceback: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close();
        false
    }

    fn __repr__(&self) -> String {
        let state = if self.reader.is_some() { "" } else { " closed" };
        format!(
            "<TFRecordReader {:?} offset={}{state}>",
            self.path,
            self.offset()
        )
    }
}

/// Writes records in TFRecord framing, optionally GZIP or ZLIB compressed.
/// Thread-compatible: one thread at a time (a concurrent call raises `RuntimeError`).
#[pyclass(name = "TFRecordWriter", module = "dataservice._core")]
pub struct PyTFRecordWriter {
    writer: RecordWriter,
}

#[pymethods]
impl PyTFRecordWriter {
    #[new]
    #[pyo3(signature = (path, compression_type = None))]
    fn new(py: Python<'_>, path: PathBuf, compression_type: Option<&str>) -> PyResult<Self> {
        let compression = Compression::parse(compression_type)?;
        let writer = py.detach(|| RecordWriter::create(&path, compression))?;
        Ok(PyTFRecordWriter { writer })
    }

    /// Appends one record (a bytes-like object), without the GIL.
    fn write(&mut self, py: Python<'_>, record: &Bound<'_, PyAny>) -> PyResult<()> {
        let writer = &mut self.writer;
        with_bytes(record, |data| py.detach(|| writer.write(data)))?.map_err(PyErr::from)
    }

    /// Hands buffered records to the operating system (a compressed stream is sync-flushed).
    fn flush(&mut self, py: Python<'_>) -> PyResult<()> {
        let writer = &mut self.writer;
        Ok(py.detach(|| writer.flush())?)
    }

    /// `flush()`, then `fdatasync` the file: records written so far survive a crash.
    fn sync(&mut self, py: Python<'_>) -> PyResult<()> {
        let writer = &mut self.writer;
        Ok(py.detach(|| writer.sync())?)
    }

    /// Ends the compressed stream and closes the file. Closing twice is a no-op.
    fn close(&mut self, py: Python<'_>) -> PyResult<()> {
        let writer = &mut self.writer;
        Ok(py.detach(|| writer.close())?)
    }

    /// True once `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.writer.is_closed()
    }

    /// The file being written.
    #[getter]
    fn path(&self) -> &str {
        self.writer.path()
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[pyo3(signature = (_exc_type = None, _exc_value = None, _traceback = None))]
    fn __exit__(
        &mut self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc_value: Option<&Bound<'_, PyAny>>,
        _traceback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let state = if self.writer.is_closed() {
            " closed"
        } else {
            ""
        };
        format!("<TFRecordWriter {:?}{state}>", self.writer.path())
    }
}

/// Every record of a TFRecord file as a list of `bytes`, read without the GIL.
#[pyfunction]
#[pyo3(signature = (path, compression_type = None))]
pub fn read_tfrecord_file<'py>(
    py: Python<'py>,
    path: PathBuf,
    compression_type: Option<&str>,
) -> PyResult<Bound<'py, PyList>> {
    let compression = Compression::parse(compression_type)?;
    let records = py.detach(|| tfrecord::read_file(&path, compression))?;
    PyList::new(py, records.iter().map(|record| PyBytes::new(py, record)))
}

/// CRC32C (Castagnoli) of a bytes-like object.
#[pyfunction]
pub fn crc32c(data: &Bound<'_, PyAny>) -> PyResult<u32> {
    with_bytes(data, tfrecord::crc32c)
}

/// The masked CRC32C TFRecord stores: `mask(crc32c(data))`.
#[pyfunction]
pub fn masked_crc32c(data: &Bound<'_, PyAny>) -> PyResult<u32> {
    with_bytes(data, tfrecord::masked_crc32c)
}
