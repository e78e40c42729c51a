"""Stubs for `dataservice._core`, the Rust extension (rust/py/). Private: import `dataservice`.

TFRecord framing (TensorFlow's): each record is a little-endian uint64 length, the masked
CRC32C of those 8 bytes (uint32 LE), the data, and the masked CRC32C of the data (uint32 LE);
a file is records back to back, optionally inside one GZIP or ZLIB stream.
"""

from os import PathLike
from types import TracebackType
from typing import Self, final

from typing_extensions import Buffer

__all__ = [
    "TFRecordReader",
    "TFRecordWriter",
    "crc32c",
    "masked_crc32c",
    "read_tfrecord_file",
]

@final
class TFRecordReader:
    """Iterator over the records of one TFRecord file, as `bytes`.

    Checks the length CRC and the data CRC of every record. Records returned before damage
    are good; damage raises `DataLossError` and every later `next()` raises it again. The
    GIL is released while reading and decompressing each record.

    Thread-compatible: use from one thread at a time (a concurrent call raises
    RuntimeError).

    Args:
        path: The file to read.
        compression_type: None or "" (uncompressed), "GZIP" or "ZLIB".
        buffer_bytes: Read buffer size in bytes (for the file and for the decompressed
            stream); at least 4096 is used.

    Raises:
        ValueError: `compression_type` is not one of the above (the message names it).
        dataservice.errors.NotFoundError: The file does not exist (the message names it).
        OSError: Another error opening the file.
    """

    def __new__(
        cls,
        path: str | PathLike[str],
        compression_type: str | None = None,
        buffer_bytes: int = 262144,
    ) -> Self: ...
    def __iter__(self) -> Self: ...
    def __next__(self) -> bytes:
        """Returns the next record.

        Raises:
            StopIteration: The file ended cleanly after the previous record.
            dataservice.errors.DataLossError: A length or data CRC mismatch, a record cut
                short by the end of the file (also a partial header), or a damaged GZIP/ZLIB
                stream; the message names the file and the offset of the bad record in the
                uncompressed stream, e.g. "corrupted record at offset 0 of /x/a.tfrecord:
                data CRC mismatch".
            ValueError: The reader is closed.
            OSError: Reading the file failed.
        """
    @property
    def offset(self) -> int:
        """Bytes of the uncompressed stream consumed by the records returned so far."""
    @property
    def path(self) -> str:
        """The file being read."""
    def close(self) -> None:
        """Closes the file; later reads raise ValueError. Closing twice is a no-op."""
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        _exc_type: type[BaseException] | None = None,
        _exc_value: BaseException | None = None,
        _traceback: TracebackType | None = None,
    ) -> bool: ...

@final
class TFRecordWriter:
    """Writes records in TFRecord framing that TensorFlow reads (GZIP/ZLIB too).

    Creates or truncates `path`. Writes are buffered: `flush()` hands them to the OS,
    `sync()` also waits for stable storage, `close()` (or leaving the `with` block) ends the
    compressed stream. The GIL is released while writing. Thread-compatible: use from one
    thread at a time (a concurrent call raises RuntimeError).

    Args:
        path: The file to write.
        compression_type: None or "" (uncompressed), "GZIP" or "ZLIB".

    Raises:
        ValueError: Unknown `compression_type`.
        dataservice.errors.NotFoundError: The directory does not exist.
        OSError: Another error creating the file.
    """

    def __new__(cls, path: str | PathLike[str], compression_type: str | None = None) -> Self: ...
    def write(self, record: Buffer) -> None:
        """Appends one record: `bytes`, or any object with the buffer protocol of uint8.

        Raises:
            ValueError: The writer is closed.
            OSError: Writing failed.
        """
    def flush(self) -> None:
        """Hands buffered records to the OS (a compressed stream is sync-flushed, so a
        reader sees every record written so far)."""
    def sync(self) -> None:
        """`flush()`, then fdatasync the file: the records written so far survive a crash."""
    def close(self) -> None:
        """Ends the compressed stream and closes the file. Closing twice is a no-op."""
    @property
    def closed(self) -> bool:
        """True once `close()` was called."""
    @property
    def path(self) -> str:
        """The file being written."""
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        _exc_type: type[BaseException] | None = None,
        _exc_value: BaseException | None = None,
        _traceback: TracebackType | None = None,
    ) -> bool: ...

def read_tfrecord_file(
    path: str | PathLike[str], compression_type: str | None = None
) -> list[bytes]:
    """Every record of a TFRecord file, read with the GIL released.

    Raises:
        The errors of `TFRecordReader` and its `__next__` (all or nothing: a damaged file
        returns no records).
    """

def crc32c(data: Buffer) -> int:
    """CRC32C (Castagnoli) of `data`, as an unsigned 32-bit int."""

def masked_crc32c(data: Buffer) -> int:
    """The masked CRC32C TFRecord stores: ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2**32)."""
