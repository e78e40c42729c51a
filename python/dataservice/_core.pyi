"""Stubs for `dataservice._core`, the Rust extension (rust/py/). Private: import `dataservice`.

TFRecord framing (TensorFlow's): each record is a little-endian uint64 length, the masked
CRC32C of those 8 bytes (uint32 LE), the data, and the masked CRC32C of the data (uint32 LE);
a file is records back to back, optionally inside one GZIP or ZLIB stream.
"""

import sys
from os import PathLike
from types import TracebackType
from typing import Any, Self, final

from typing_extensions import Buffer

__all__ = [
    "ElementCheck",
    "Encoding",
    "RingLease",
    "ShmRingConsumer",
    "ShmRingProducer",
    "ShmWindowReader",
    "ShmWindowWriter",
    "TFRecordReader",
    "TFRecordWriter",
    "bytearray_to_fill",
    "copy_if_plain",
    "crc32c",
    "decode_element",
    "encode_element",
    "encode_element_later",
    "join_encoded",
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

def encode_element(element: Any) -> bytes:
    """`element` as one self-contained buffer (the gRPC path's form): its structure, then
    one DATA frame of its leaves, encoded as the shared-memory ring encodes them (numpy
    arrays of any fixed-size dtype, numpy scalars, bytes, str, int/float/bool/None, object
    arrays of bytes, nested tuple/list/dict/namedtuple; anything else pickled). Structures
    of recent elements stay compiled, so an element of a known structure is walked once,
    with no Python call per leaf.

    Raises:
        Exception: What pickling a leaf raises (e.g. TypeError for a lock).
    """

def encode_element_later(element: Any) -> Encoding:
    """`element` walked and laid out as `encode_element` lays it out, with nothing copied
    yet: `Encoding.piece` makes any range of `encode_element(element)`'s bytes. The
    encoding holds `element` and a buffer export of each of its array and bytes leaves
    (a bytearray leaf cannot be resized) until it is freed.

    Raises:
        Exception: What pickling a leaf raises (e.g. TypeError for a lock).
    """

@final
class Encoding:
    """An element's encoding made on demand (`encode_element_later`). Thread-safe:
    pieces may be made from several threads; the copy of a piece of 256 KiB or more
    runs with the GIL released."""

    def __len__(self) -> int:
        """The encoding's size in bytes (`len(encode_element(element))`)."""

    @property
    def element(self) -> Any:
        """The element this is the encoding of (the very object)."""

    def piece(self, start: int, end: int) -> bytes:
        """Bytes `[start, end)` of the encoding, as a new `bytes` object.

        Raises:
            IndexError: `start > end` or `end > len(self)`.
        """

    def __bytes__(self) -> bytes:
        """The whole encoding (`piece(0, len(self))`)."""

def join_encoded(parts: list[bytes] | list[bytes | Encoding]) -> bytes:
    """`parts` (each `bytes` or an `Encoding`) back to back in one new `bytes` object,
    each copied once; the copy runs with the GIL released from 256 KiB on.

    Raises:
        TypeError: A part is neither `bytes` nor an `Encoding`.
    """

def bytearray_to_fill(size: int) -> bytearray:
    """A new `bytearray` of `size` bytes whose contents are whatever memory the allocator
    handed out (`bytearray(size)` zeroes them): for a caller that writes every byte
    before any is read, as the gRPC client filling an element from its pieces.

    Raises:
        OverflowError: `size` does not fit a Py_ssize_t.
        MemoryError: The allocation failed.
    """

def copy_if_plain(value: Any, keep: set[type]) -> Any | None:
    """`value` copied one level deep when nothing in it needs normalizing, else None: an
    exact dict whose keys are all str and whose values' exact types are all in `keep` (a
    new dict, same order), such a list (a new list), or such a tuple (`value` itself). The
    fast path of `data.structure.normalize_element`, one walk with no Python call per leaf.
    """

def decode_element(data: Buffer) -> Any:
    """Rebuilds an element from `encode_element`'s bytes. Numpy leaves come back
    writeable: views of `data` (through a memoryview) when it is a bytearray, else copied
    out of it (small array leaves into one shared buffer, each a view of it).

    Raises:
        dataservice.errors.DataLossError: `data` is not an encoded element or is damaged
            (the message says what and at which byte).
        TypeError: `data` is not a buffer.
    """

@final
class ElementCheck:
    """A stream's element structure, learnt from one element, that later elements are
    checked against in one walk, without a Python call per leaf. An element matches when
    its containers have the same exact types, lengths and dict keys and each leaf the
    same exact type (arrays: the same dtype object and rank); a match has the learnt
    element's `dataservice.transfer.codec.signature`. Thread-compatible."""

    def __new__(cls) -> Self: ...
    def learn(self, element: Any) -> bool:
        """Learns `element`'s structure; False (and nothing learnt) if it holds anything
        but plain numpy values (numpy arrays without objects and numeric numpy scalars,
        bytes, str, int, float, bool, None; exact tuples, lists, dicts with str keys and
        namedtuples), is nested deeper than 32 or holds more than 10,000 values."""
    def nbytes_if_same(self, element: Any) -> int | None:
        """The element's bytes as `codec.element_nbytes` counts them if it has the learnt
        structure, else None."""

@final
class ShmRingProducer:
    """The producer (worker) end of a shared-memory ring: creates a sealed memfd (nothing
    in /dev/shm) with its first 1 MiB allocated and pre-faulted; the rest is allocated
    (with the GIL released) as the first lap of frames reaches it, in doubling steps, and
    should a step not fit the memory cgroup, the ring runs on within what it has. One
    producer thread (a concurrent call raises RuntimeError "in use"); the GIL is released
    for every wait and for copies of at least 256 KiB.

    Args:
        capacity_bytes: Data bytes, a power of two in [64 KiB, 4 GiB]. Frames up to a
            quarter of it go in one piece; bigger elements travel as CHUNK frames.
        max_element_bytes: Largest element accepted (bytes).

    Raises:
        ValueError: `capacity_bytes` is not a supported size.
        dataservice.errors.ResourceExhaustedError: The whole capacity does not fit the
            memory cgroup's free bytes, or the first 1 MiB cannot be allocated (full
            tmpfs): never a later SIGBUS.
    """

    def __new__(cls, capacity_bytes: int, max_element_bytes: int = 1 << 40) -> Self: ...
    def fileno(self) -> int:
        """The ring's memfd, owned by this object (send a copy with `socket.send_fds`)."""
    @property
    def capacity_bytes(self) -> int: ...
    @property
    def reserved_bytes(self) -> int:
        """Data bytes allocated so far, from the start (`capacity_bytes` once the first
        lap reached the end)."""
    @property
    def max_frame_bytes(self) -> int: ...
    @property
    def nonce(self) -> bytes:
        """16 random bytes the consumer checks against the ring's header."""
    def set_peer(self, control_fd: int | None = None, pid: int | None = None) -> None:
        """Watches the consumer: HUP on `control_fd` (duplicated) or exit of `pid`."""
    def consumer_waiting(self) -> bool:
        """True while the consumer may be asleep waiting for data."""
    def put_many(self, elements: Any, timeout_ms: int | None = None) -> int:
        """Writes elements (numpy arrays of any fixed-size dtype, numpy scalars, bytes,
        str, int/float/bool/None, object arrays of bytes, nested tuple/list/dict/
        namedtuple; anything else pickled), in order, blocking while the ring is full up
        to `timeout_ms` (None: no limit).

        Returns:
            How many elements were written: all of them unless the time ran out.
        Raises:
            dataservice.errors.UnavailableError: The consumer is gone.
            dataservice.errors.ElementTooLargeError: An element exceeds
                `max_element_bytes` (the message names both sizes).
            dataservice.errors.ResourceExhaustedError: The ring could not allocate
                more memory and a frame does not fit what it has (none of it written).
        """
    def put_error(self, type_name: str, message: str, timeout_ms: int | None = None) -> bool:
        """Writes an ERROR frame (a worker-side exception); False on timeout."""
    def put_end(self, timeout_ms: int | None = None) -> bool:
        """Writes the END frame and closes the ring; False on timeout."""
    def stats(self) -> dict[str, int]:
        """`bytes`, `full_waits`, `detaches`, `buffered_bytes`, `elements` (written),
        `consumer_elements` (taken out by the consumer, as it last stored); any thread."""
    def close(self) -> None:
        """Frees this end (the memory goes once the consumer unmaps too). Idempotent."""

@final
class ShmRingConsumer:
    """The consumer (trainer) end of a shared-memory ring: maps a received memfd after
    checking its seals, size, magic, layout version and nonce. One consumer thread.

    The numpy array leaves of an element whose array leaves hold at least
    `copy_threshold_bytes` in all come back as writeable views of the ring (those of at
    least 64 KiB page-aligned), kept valid by one `RingLease` over the element's frame: an
    element of many small leaves costs a view per leaf, not a copy. Smaller elements are
    copied (their small array leaves into one private buffer, each a view of it). While
    leased frames would pin more than `max_pinned_fraction` of the ring, frames are copied
    instead; if the producer still stalls on leased frames, they are moved to private
    memory (detach), so keeping every element never deadlocks.

    Args:
        fd: The ring's memfd (duplicated here).
        control_fd: The handshake socket, watched for HUP (duplicated here).
        pid: The producer's pid, watched with a pidfd.
        nonce: The 16 bytes from the handshake.
        zero_copy: False copies every leaf.
        copy_threshold_bytes: Smallest total of an element's array bytes handed out as
            views (bytes).
        max_pinned_fraction: Share of the ring leases may pin before frames are copied.

    Raises:
        dataservice.errors.FailedPreconditionError: `fd` is not a ring of this layout.
    """

    def __new__(
        cls,
        fd: int,
        control_fd: int | None = None,
        pid: int | None = None,
        nonce: bytes | None = None,
        zero_copy: bool = True,
        copy_threshold_bytes: int = 65536,
        max_pinned_fraction: float = 0.5,
    ) -> Self: ...
    @property
    def capacity_bytes(self) -> int: ...
    def get_many(
        self, max_elements: int = 256, timeout_ms: int | None = None
    ) -> tuple[list[Any], int, bool, tuple[str, str] | None]:
        """Takes up to `max_elements` elements, waiting up to `timeout_ms` for the first.

        Returns:
            (elements, nbytes, end_of_sequence, error): `nbytes` is the size of their
            frames; `error` is a worker-side (type name, message) reported once the
            elements before it were returned; an empty list without end means the time
            ran out.
        Raises:
            dataservice.errors.UnavailableError: The producer died; every element it
                published before was returned first.
            dataservice.errors.DataLossError: The ring's bytes are not valid frames.
        """
    def stats(self) -> dict[str, int]:
        """`elements`, `leased`, `detaches`, `pinned_bytes`, `empty_waits`."""
    def close(self) -> None:
        """Frees this end; views handed out stay valid. Idempotent."""

@final
class RingLease:
    """A writeable buffer over one leaf of a ring frame; numpy views of it keep the frame
    from being reused. Created by `ShmRingConsumer.get_many`."""

    # CPython 3.12+ exposes the buffer slot (`__getbuffer__` in rust/py/lease.rs) as
    # `__buffer__`; on 3.11 the slot exists without the Python-level method.
    if sys.version_info >= (3, 12):
        def __buffer__(self, flags: int, /) -> memoryview: ...

    def __len__(self) -> int: ...

@final
class ShmWindowWriter:
    """The worker's end of the cross-trainer cache window: one sealed memfd segment holding
    the cached elements as frames, written once and read by every same-host trainer (each
    through a `ShmWindowReader`). Never blocks: when a trainer's hold or grant is in the way
    `append` reports it and the caller decides (grace period, then `abandon`).

    Thread-compatible: one thread at a time (a concurrent call raises RuntimeError "in
    use"), except `grant`/`ungrant`, which any thread may call.

    Args:
        capacity_bytes: Data bytes, a power of two in [64 KiB, 4 GiB] (grown for an element
            bigger than half of it).

    Raises:
        ValueError: `capacity_bytes` is not a supported size.
        dataservice.errors.ResourceExhaustedError: The memory cannot be reserved.
    """

    def __new__(cls, capacity_bytes: int) -> Self: ...
    def append(self, element: Any, seq: int, max_capacity: int) -> tuple[int, int | None]:
        """Appends `element` as a frame with sequence number `seq` (its global index),
        growing the segment (doubling, into a fresh memfd) while it is smaller than
        `max_capacity` bytes and evicting the oldest frames once it is not.

        Returns:
            (evicted, frame_bytes): how many of the oldest frames were evicted, and the new
            frame's size in bytes, or None when a trainer's hold or grant is in the way
            (nothing was written).
        Raises:
            dataservice.errors.ElementTooLargeError: The element does not fit even a 4 GiB
                segment.
        """
    def evict(self, n: int) -> None:
        """Evicts the `n` oldest cached frames."""
    def abandon(self) -> int:
        """Leaves the segment to the trainers holding views into it and moves the window
        into a fresh one of the same size; returns how many of the oldest frames did not
        fit."""
    def span(self, offset: int, n: int) -> tuple[int, int, list[int], int]:
        """(generation, pos, spec_ids, reclaim_below) of the cached frames `offset ..
        offset + n` (oldest first).

        Raises:
            RuntimeError: The range is not cached.
        """
    def spec_bytes(self, spec_id: int) -> bytes:
        """The encoded spec `spec_id` (for `ShmWindowReader.add_spec`)."""
    def decode(self, offset: int, n: int) -> list[Any]:
        """The cached elements `offset .. offset + n`, decoded (every leaf copied)."""
    def grant(self, slot: int, pos: int) -> None:
        """Marks trainer slot `slot` as decoding a reply that starts at position `pos`."""
    def ungrant(self, slot: int) -> None:
        """The trainer in `slot` finished decoding its reply (any thread)."""
    def release_slot(self, slot: int) -> None:
        """The trainer in `slot` is gone: clears its grant and its hold word."""
    def fileno(self) -> int:
        """The current segment's memfd (owned by this object; send a copy)."""
    def segment(self) -> tuple[int, int, bytes]:
        """(generation, fd, nonce) of the current segment."""
    @property
    def capacity_bytes(self) -> int: ...
    def stats(self) -> dict[str, Any]:
        """`generation`, `abandons`, `grows`, `capacity_bytes`, `frames_written`,
        `bytes_written`, `cached_frames`, `window_span_bytes`, `min_hold` (None if no
        hold), `held_slots` (list of slots)."""

@final
class ShmWindowReader:
    """A trainer's end of the cross-trainer cache window: maps the worker's segment
    (read-only but for its hold word) and decodes the frames the worker's replies name.
    Numpy leaves of at least `copy_threshold_bytes` become writeable views of private
    (copy-on-write) mappings of the segment, held by this trainer's hold slot; smaller
    leaves, and every leaf once this trainer's holds span more than `max_pinned_fraction`
    of the segment, are copied. One thread at a time.

    Args:
        fd: The segment's memfd (duplicated here).
        slot: This connection's hold slot (from the handshake), in [0, 64).
        generation: The segment's generation (from the handshake).
        nonce: The 16 bytes from the handshake.
        control_fd: The connection's socket, duplicated so that the worker sees the
            hang-up only after `close()` detached the views.
        zero_copy: False copies every leaf.
        copy_threshold_bytes: Smallest leaf handed out as a view (bytes).
        max_pinned_fraction: Share of the segment this trainer's holds may span.

    Raises:
        dataservice.errors.FailedPreconditionError: `fd` is not a window segment of this
            layout, the nonce differs, or `slot` is out of range.
    """

    def __new__(
        cls,
        fd: int,
        slot: int,
        generation: int,
        nonce: bytes | None = None,
        control_fd: int | None = None,
        zero_copy: bool = True,
        copy_threshold_bytes: int = 65536,
        max_pinned_fraction: float = 0.25,
    ) -> Self: ...
    @property
    def generation(self) -> int: ...
    def set_segment(self, fd: int, generation: int, nonce: bytes | None = None) -> None:
        """Switches to the worker's fresh segment `fd`; views into the old one are detached
        (copied into private memory) first."""
    def add_spec(self, spec_id: int, body: bytes) -> None:
        """Registers the encoded spec `spec_id` (from the worker's reply)."""
    def read(
        self, pos: int, count: int, first_seq: int, reclaim_below: int | None = None
    ) -> tuple[list[Any], int]:
        """Decodes `count` DATA frames from position `pos` on (PADs skipped), the first
        with sequence number `first_seq`. Frames below `reclaim_below` are copied, and live
        views of such frames are detached.

        Returns:
            (elements, frame bytes).
        Raises:
            dataservice.errors.DataLossError: The segment's bytes are not the frames named.
        """
    def stats(self) -> dict[str, Any]:
        """`elements`, `leased`, `copied_on_pressure`, `detached`, `segments`,
        `generation`, `min_hold` (None if no hold)."""
    def close(self) -> None:
        """Detaches the views still alive and gives the hold slot up; the views stay valid.
        Idempotent."""
