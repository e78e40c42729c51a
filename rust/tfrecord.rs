//! TFRecord files: reading and writing the record framing TensorFlow uses, checked with
//! masked CRC32C; also the format of the dispatcher's journal.
//!
//! A record is `u64 length (LE) | u32 masked_crc32c(length bytes) (LE) | data |
//! u32 masked_crc32c(data) (LE)`. A file is records back to back, optionally inside one
//! GZIP or ZLIB stream (offsets then count bytes of the uncompressed stream).
//!
//! Source: tensorflow/tsl/lib/io/record_reader.cc, record_writer.cc, tsl/lib/hash/crc32c.h.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::Path;

use flate2::bufread::{MultiGzDecoder, ZlibDecoder};
use flate2::write::{GzEncoder, ZlibEncoder};

use crate::error::Error;

/// Bytes before a record's data: the length and its masked CRC.
pub const HEADER_BYTES: usize = 12;
/// Bytes after a record's data: its masked CRC.
pub const FOOTER_BYTES: usize = 4;
/// Read buffer used when the caller asks for less (a zero-sized `BufReader` would read as EOF).
const MIN_BUFFER_BYTES: usize = 4096;
/// Write buffer between the encoder and the file.
const WRITE_BUFFER_BYTES: usize = 256 * 1024;
/// Records longer than this are damage, not data (TensorFlow: "record size too large").
const MAX_RECORD_BYTES: u64 = (isize::MAX as u64) - (HEADER_BYTES + FOOTER_BYTES) as u64;
const MASK_DELTA: u32 = 0xa282_ead8;
/// A compressed record's declared length sizes its buffer up to this many bytes; a longer
/// one is not trusted: its data is read into a buffer that starts at this size and doubles
/// as the stream produces bytes (so a claim of 1 GiB over a 47-byte file costs 16 MiB).
const UNTRUSTED_LENGTH_BYTES: usize = 16 << 20;

/// CRC32C (Castagnoli) of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// Masks a CRC the way TFRecord stores it (rotate right by 15, add a constant), so that the
/// CRC of data that itself contains CRCs is not degenerate.
pub fn mask(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// Inverse of [`mask`].
pub fn unmask(masked: u32) -> u32 {
    masked.wrapping_sub(MASK_DELTA).rotate_left(15)
}

/// `mask(crc32c(data))`: the checksum TFRecord stores after a length and after data.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    mask(crc32c(data))
}

/// The 12-byte header of a record of `len` bytes.
pub fn encode_header(len: u64) -> [u8; HEADER_BYTES] {
    let mut header = [0u8; HEADER_BYTES];
    header[..8].copy_from_slice(&len.to_le_bytes());
    let crc = masked_crc32c(&header[..8]);
    header[8..].copy_from_slice(&crc.to_le_bytes());
    header
}

/// How the record stream is stored in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zlib,
}

impl Compression {
    /// Parses TensorFlow's `compression_type`: None or "" (no compression), "GZIP", "ZLIB".
    pub fn parse(name: Option<&str>) -> Result<Self, Error> {
        match name {
            None | Some("") => Ok(Compression::None),
            Some("GZIP") => Ok(Compression::Gzip),
            Some("ZLIB") => Ok(Compression::Zlib),
            Some(other) => Err(Error::UnknownCompression(other.to_string())),
        }
    }

    /// The name TensorFlow uses ("" for none).
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "",
            Compression::Gzip => "GZIP",
            Compression::Zlib => "ZLIB",
        }
    }
}

/// Reads as many bytes as fit in `buf`, stopping early only at end of stream.
///
/// A compressed stream that stops without its end marker (flate2 reports `UnexpectedEof`
/// once everything decodable was returned) ends there like a file does: so records written
/// before a writer's `flush()` read back while it is still open, and a stream cut inside a
/// record reads as a truncated record.
fn read_full(input: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match input.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Reads the records of one TFRecord file in order, checking both CRCs of every record.
///
/// Either call [`RecordReader::next_record`], or split each record into
/// [`RecordReader::read_header`] then [`RecordReader::read_body`] to read the data straight
/// into a caller-owned buffer (the Python wrapper reads into a new `bytes`).
/// After the first error every call returns that error again: no record past damage is
/// ever returned. Thread-compatible (`&mut self`; the caller serialises access).
pub struct RecordReader {
    path: String,
    compression: Compression,
    input: Box<dyn Read + Send + Sync>,
    /// Bytes of the uncompressed stream consumed by the records returned so far.
    offset: u64,
    /// Size of an uncompressed file: a header whose record would end past it is truncation.
    file_bytes: Option<u64>,
    /// Data length of the record whose header was read and whose body was not, if any.
    pending_len: Option<usize>,
    failed: Option<Error>,
}

impl RecordReader {
    /// Opens `path` for reading, buffering `buffer_bytes` of the file (and as much of the
    /// decompressed stream).
    ///
    /// Errors: [`Error::NotFound`] if the file does not exist, [`Error::Io`] otherwise.
    pub fn open(path: &Path, compression: Compression, buffer_bytes: usize) -> Result<Self, Error> {
        let buffer_bytes = buffer_bytes.max(MIN_BUFFER_BYTES);
        let file = File::open(path).map_err(|e| Error::io("opening", path, e))?;
        let file_bytes = match compression {
            Compression::None => Some(
                file.metadata()
                    .map_err(|e| Error::io("reading", path, e))?
                    .len(),
            ),
            _ => None,
        };
        let buffered = BufReader::with_capacity(buffer_bytes, file);
        let input: Box<dyn Read + Send + Sync> = match compression {
            Compression::None => Box::new(buffered),
            Compression::Gzip => Box::new(BufReader::with_capacity(
                buffer_bytes,
                MultiGzDecoder::new(buffered),
            )),
            Compression::Zlib => Box::new(BufReader::with_capacity(
                buffer_bytes,
                ZlibDecoder::new(buffered),
            )),
        };
        Ok(RecordReader {
            path: path.display().to_string(),
            compression,
            input,
            offset: 0,
            file_bytes,
            pending_len: None,
            failed: None,
        })
    }

    /// The file this reader reads, as given to [`RecordReader::open`].
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Bytes of the uncompressed stream consumed by the records returned so far; the offset
    /// of the next record.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Reads the next record's header and returns its data length, or `None` at a clean end
    /// of file (zero bytes left where a header would start).
    ///
    /// Errors: [`Error::TruncatedRecord`] if the stream ends inside the header (or, for an
    /// uncompressed file, the record would end past the file), [`Error::CorruptedRecord`]
    /// if the length's CRC does not match, [`Error::CorruptedStream`] / [`Error::Io`] if
    /// decompressing or reading fails.
    pub fn read_header(&mut self) -> Result<Option<usize>, Error> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        assert!(
            self.pending_len.is_none(),
            "read_header called twice without read_body"
        );
        let mut header = [0u8; HEADER_BYTES];
        let got = read_full(&mut *self.input, &mut header).map_err(|e| self.stream_error(e))?;
        if got == 0 {
            return Ok(None);
        }
        if got < HEADER_BYTES {
            let what = format!("stream ends after {got} of the {HEADER_BYTES} header bytes");
            return Err(self.truncated(what));
        }
        let len_bytes: [u8; 8] = header[..8].try_into().expect("8 bytes");
        let len_crc = u32::from_le_bytes(header[8..].try_into().expect("4 bytes"));
        if unmask(len_crc) != crc32c(&len_bytes) {
            return Err(self.corrupted("length CRC mismatch".to_string()));
        }
        let len = u64::from_le_bytes(len_bytes);
        if len > MAX_RECORD_BYTES {
            return Err(self.corrupted(format!("record length {len} is too large")));
        }
        if let Some(file_bytes) = self.file_bytes {
            let end = self.offset + (HEADER_BYTES + FOOTER_BYTES) as u64 + len;
            if end > file_bytes {
                let what = format!(
                    "record of {len} bytes ends at byte {end}, past the end of the file \
                     ({file_bytes} bytes)"
                );
                return Err(self.truncated(what));
            }
        }
        let len = usize::try_from(len).expect("len <= isize::MAX");
        self.pending_len = Some(len);
        Ok(Some(len))
    }

    /// Reads the data of the record whose header [`RecordReader::read_header`] just returned
    /// into `buf` (exactly that many bytes) and checks its CRC. Only when this returns `Ok`
    /// does `buf` hold a good record.
    ///
    /// Errors: [`Error::TruncatedRecord`], [`Error::CorruptedRecord`] (data CRC mismatch),
    /// [`Error::CorruptedStream`] or [`Error::Io`].
    ///
    /// Panics if no header is pending or `buf` has another length (a bug in the caller).
    pub fn read_body(&mut self, buf: &mut [u8]) -> Result<(), Error> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        let len = self
            .pending_len
            .take()
            .expect("read_body called without read_header");
        assert_eq!(buf.len(), len, "read_body buffer length");
        let got = read_full(&mut *self.input, buf).map_err(|e| self.stream_error(e))?;
        if got < len {
            let what = format!("stream ends after {got} of the {len} data bytes");
            return Err(self.truncated(what));
        }
        self.finish_body(buf)
    }

    /// Whether a buffer of `len` bytes (the length [`RecordReader::read_header`] just
    /// returned) may be allocated before the data is read: for an uncompressed file the
    /// header was checked against the file's size; a compressed stream's length is known
    /// only once it has been decompressed, so only lengths up to 16 MiB are taken on trust
    /// (else [`RecordReader::read_body_incrementally`]).
    pub fn may_allocate_declared_length(&self, len: usize) -> bool {
        self.file_bytes.is_some() || len <= UNTRUSTED_LENGTH_BYTES
    }

    /// Reads the data of the record whose header [`RecordReader::read_header`] just
    /// returned into a new `Vec`, growing it only as the stream produces bytes (16 MiB,
    /// then doubling), and checks its CRC. So a damaged or hostile header that declares a
    /// huge length over a short stream costs what the stream holds, not what it claims:
    /// the stream's end is reported as [`Error::TruncatedRecord`] before more is allocated.
    ///
    /// Errors: as [`RecordReader::read_body`]; [`Error::Io`] (out of memory) if a piece
    /// cannot be allocated.
    ///
    /// Panics if no header is pending (a bug in the caller).
    pub fn read_body_incrementally(&mut self) -> Result<Vec<u8>, Error> {
        self.read_body_growing(UNTRUSTED_LENGTH_BYTES)
    }

    /// [`RecordReader::read_body_incrementally`] with a first piece of `first_piece` bytes.
    fn read_body_growing(&mut self, first_piece: usize) -> Result<Vec<u8>, Error> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        let len = self
            .pending_len
            .expect("read_body_incrementally called without read_header");
        let mut data: Vec<u8> = Vec::new();
        while data.len() < len {
            let filled = data.len();
            // Double what the stream has produced so far (amortised copies), never past
            // the declared length: at most twice the bytes the stream really holds.
            let piece = (len - filled).min(filled.max(first_piece));
            if data.try_reserve_exact(piece).is_err() {
                self.abandon_pending_record();
                return Err(self.failed.clone().expect("abandoned"));
            }
            data.resize(filled + piece, 0);
            let got = read_full(&mut *self.input, &mut data[filled..])
                .map_err(|e| self.stream_error(e))?;
            if got < piece {
                let got = filled + got;
                let what = format!("stream ends after {got} of the {len} data bytes");
                return Err(self.truncated(what));
            }
        }
        self.pending_len = None;
        self.finish_body(&data)?;
        Ok(data)
    }

    /// Reads and checks the data CRC of the record whose `data` was just read; then the
    /// record is consumed.
    fn finish_body(&mut self, buf: &[u8]) -> Result<(), Error> {
        let len = buf.len();
        let mut footer = [0u8; FOOTER_BYTES];
        let got = read_full(&mut *self.input, &mut footer).map_err(|e| self.stream_error(e))?;
        if got < FOOTER_BYTES {
            let what = format!("stream ends after {got} of the {FOOTER_BYTES} data CRC bytes");
            return Err(self.truncated(what));
        }
        if unmask(u32::from_le_bytes(footer)) != crc32c(buf) {
            return Err(self.corrupted("data CRC mismatch".to_string()));
        }
        self.offset += (HEADER_BYTES + len + FOOTER_BYTES) as u64;
        Ok(())
    }

    /// The next record, or `None` at the end of the file. Errors as
    /// [`RecordReader::read_header`] and [`RecordReader::read_body`].
    pub fn next_record(&mut self) -> Result<Option<Vec<u8>>, Error> {
        let Some(len) = self.read_header()? else {
            return Ok(None);
        };
        if !self.may_allocate_declared_length(len) {
            return self.read_body_incrementally().map(Some);
        }
        let mut data = Vec::new();
        if data.try_reserve_exact(len).is_err() {
            self.pending_len = None;
            return Err(self.corrupted(format!("record length {len} cannot be allocated")));
        }
        data.resize(len, 0);
        self.read_body(&mut data)?;
        Ok(Some(data))
    }

    /// True between a successful [`RecordReader::read_header`] and its
    /// [`RecordReader::read_body`].
    pub fn has_pending_record(&self) -> bool {
        self.pending_len.is_some()
    }

    /// Gives up on the record whose header was read (e.g. its buffer could not be
    /// allocated): the reader fails from here on, since the stream is mid-record.
    pub fn abandon_pending_record(&mut self) {
        if let Some(len) = self.pending_len {
            let error = Error::Io {
                op: "allocating a record buffer for",
                path: self.path.clone(),
                source: io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    format!("record at offset {} has {len} bytes", self.offset),
                ),
            };
            self.fail(error);
        }
    }

    fn fail(&mut self, error: Error) -> Error {
        self.pending_len = None;
        self.failed = Some(error.clone());
        error
    }

    fn corrupted(&mut self, what: String) -> Error {
        let (path, offset) = (self.path.clone(), self.offset);
        self.fail(Error::CorruptedRecord { path, offset, what })
    }

    fn truncated(&mut self, what: String) -> Error {
        let (path, offset) = (self.path.clone(), self.offset);
        self.fail(Error::TruncatedRecord { path, offset, what })
    }

    /// A read error: damage if the decompressor rejected its input, an OS error otherwise.
    fn stream_error(&mut self, source: io::Error) -> Error {
        let decoder_error = matches!(
            source.kind(),
            io::ErrorKind::InvalidData | io::ErrorKind::InvalidInput
        );
        let error = if self.compression != Compression::None && decoder_error {
            Error::CorruptedStream {
                path: self.path.clone(),
                compression: self.compression.name(),
                offset: self.offset,
                what: source.to_string(),
            }
        } else {
            Error::Io {
                op: "reading",
                path: self.path.clone(),
                source,
            }
        };
        self.fail(error)
    }
}

/// Every record of the file at `path`, in order; fails on the first damaged record.
pub fn read_file(path: &Path, compression: Compression) -> Result<Vec<Vec<u8>>, Error> {
    let mut reader = RecordReader::open(path, compression, 256 * 1024)?;
    let mut records = Vec::new();
    while let Some(record) = reader.next_record()? {
        records.push(record);
    }
    Ok(records)
}

enum Sink {
    Plain(BufWriter<File>),
    Gzip(GzEncoder<BufWriter<File>>),
    Zlib(ZlibEncoder<BufWriter<File>>),
}

impl Sink {
    fn writer(&mut self) -> &mut dyn Write {
        match self {
            Sink::Plain(w) => w,
            Sink::Gzip(w) => w,
            Sink::Zlib(w) => w,
        }
    }

    fn file(&self) -> &File {
        match self {
            Sink::Plain(w) => w.get_ref(),
            Sink::Gzip(w) => w.get_ref().get_ref(),
            Sink::Zlib(w) => w.get_ref().get_ref(),
        }
    }

    /// Ends the compressed stream (if any) and flushes everything to the file.
    fn finish(self) -> io::Result<File> {
        let buffered = match self {
            Sink::Plain(w) => w,
            Sink::Gzip(w) => w.finish()?,
            Sink::Zlib(w) => w.finish()?,
        };
        buffered
            .into_inner()
            .map_err(io::IntoInnerError::into_error)
    }
}

/// Writes records in TFRecord framing that TensorFlow reads (with the same compression name).
///
/// Thread-compatible (`&mut self`; the caller serialises access). Dropping an open writer
/// finishes the file but ignores errors: call [`RecordWriter::close`] to see them.
pub struct RecordWriter {
    path: String,
    sink: Option<Sink>,
}

impl RecordWriter {
    /// Creates (or truncates) the file at `path`.
    ///
    /// Errors: [`Error::NotFound`] if its directory does not exist, [`Error::Io`] otherwise.
    pub fn create(path: &Path, compression: Compression) -> Result<Self, Error> {
        let file = File::create(path).map_err(|e| Error::io("creating", path, e))?;
        let buffered = BufWriter::with_capacity(WRITE_BUFFER_BYTES, file);
        let level = flate2::Compression::default();
        let sink = match compression {
            Compression::None => Sink::Plain(buffered),
            Compression::Gzip => Sink::Gzip(GzEncoder::new(buffered, level)),
            Compression::Zlib => Sink::Zlib(ZlibEncoder::new(buffered, level)),
        };
        Ok(RecordWriter {
            path: path.display().to_string(),
            sink: Some(sink),
        })
    }

    /// The file this writer writes.
    pub fn path(&self) -> &str {
        &self.path
    }

    fn sink(&mut self) -> Result<&mut Sink, Error> {
        match &mut self.sink {
            Some(sink) => Ok(sink),
            None => Err(Error::Closed {
                what: "TFRecordWriter",
                path: self.path.clone(),
            }),
        }
    }

    fn io_error(&self, op: &'static str, source: io::Error) -> Error {
        Error::io(op, Path::new(&self.path), source)
    }

    /// Appends one record (buffered: see [`RecordWriter::flush`]).
    pub fn write(&mut self, data: &[u8]) -> Result<(), Error> {
        let header = encode_header(data.len() as u64);
        let footer = masked_crc32c(data).to_le_bytes();
        let out = self.sink()?.writer();
        let result = out
            .write_all(&header)
            .and_then(|()| out.write_all(data))
            .and_then(|()| out.write_all(&footer));
        result.map_err(|e| self.io_error("writing", e))
    }

    /// Hands everything written so far to the operating system; a compressed stream is
    /// sync-flushed, so a reader sees every record written before the flush.
    pub fn flush(&mut self) -> Result<(), Error> {
        let result = self.sink()?.writer().flush();
        result.map_err(|e| self.io_error("flushing", e))
    }

    /// [`RecordWriter::flush`], then waits until the file's data is on stable storage
    /// (`fdatasync`).
    pub fn sync(&mut self) -> Result<(), Error> {
        self.flush()?;
        let result = self.sink()?.file().sync_data();
        result.map_err(|e| self.io_error("syncing", e))
    }

    /// Ends the compressed stream, flushes and closes the file. Closing twice is a no-op.
    pub fn close(&mut self) -> Result<(), Error> {
        match self.sink.take() {
            Some(sink) => sink
                .finish()
                .map(drop)
                .map_err(|e| self.io_error("closing", e)),
            None => Ok(()),
        }
    }

    /// True once [`RecordWriter::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.sink.is_none()
    }
}

impl Drop for RecordWriter {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

#[cfg(test)]
mod tests;
