"""The dispatcher's journal: an append-only log of state updates in `work_dir`.

Layout, under `<work_dir>/journal/`:

* `segment-<n>.tfrecord`: the updates of one dispatcher start (a start never
  appends to an older segment). Each record is one `JournalRecord` protobuf
  (rpc/journal.proto: a format version and one `state.Update`, converted by
  journal_codec.py), framed like a TFRecord (u64 length, masked CRC32C of the
  length, data, masked CRC32C of the data) by the Rust writer, and fsynced
  before `append` returns, so an answered RPC's effect is on disk.
* `snapshot-<n>.tfrecord`: the whole `DispatcherState` as one `Snapshot`
  protobuf record, same framing, written to a `.tmp` file, fsynced and renamed
  into place. It replaces every segment numbered below `n`: after
  SNAPSHOT_EVERY_RECORDS records in one segment the dispatcher writes one,
  then deletes the older segments and snapshots (bounded replay time).

On start-up the newest snapshot is loaded (`load_snapshot`) and `replay`
yields the update of every record of the segments from `n` on, in order. A
torn last record of a segment (the dispatcher died mid-write: cut short, or
failing its CRC with nothing after it) is dropped, and the segment is
truncated to its last whole record. Any other damage stops start-up with
`DataLossError` naming the file and the record's offset, and leaves the file
as it is: a record that fails its CRC with records after it, and a record
whose CRC holds but whose data is not a `JournalRecord` this version reads
(unparseable, another format version, an unknown update kind; also the
pickled updates of a journal written before records were protobuf). A
snapshot that cannot be read is a `DataLossError` naming it.

Registered dataset definitions are stored beside the journal as
`<work_dir>/datasets/<dataset_id>.bin` (opaque bytes: written to a temporary
file, fsynced, renamed).
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator

from dataservice import _core, errors
from dataservice.dispatcher import journal_codec, state

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "segment-"
SEGMENT_SUFFIX = ".tfrecord"
SNAPSHOT_PREFIX = "snapshot-"
SNAPSHOT_SUFFIX = ".tfrecord"
LEGACY_SNAPSHOT_SUFFIX = ".pickle"  # pickled snapshots, before records were protobuf
SNAPSHOT_EVERY_RECORDS = 20_000  # bounds replay: a snapshot, then at most this many records


def _is_torn_tail(path: str, offset: int) -> bool:
    """Whether the damaged record at `offset` is the file's last one: its
    header is cut short, or the length it declares reaches the end of the
    file (appends are sequential, so a crash can only damage the tail)."""
    size = os.path.getsize(path)
    if size - offset < 12:  # u64 length + u32 masked CRC of the length
        return True
    with open(path, "rb") as f:
        f.seek(offset)
        header = f.read(12)
    (length,) = struct.unpack("<Q", header[:8])
    if _core.masked_crc32c(header[:8]) != struct.unpack("<I", header[8:])[0]:
        return False  # a garbled length inside the file: real damage
    return offset + 16 + length >= size


def _pickle_hint(data: bytes) -> str:
    """A hint for a record that is a pickle (protocol 2 to 5): the pickled
    updates of a journal written before records were protobuf."""
    if len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5:
        return (
            "; the record is a pickle: this journal was written by an older dataservice "
            "whose pickle format is no longer read (start with a new work_dir)"
        )
    return ""


class Journal:
    """Appends updates to a new segment under `<work_dir>/journal/`.
    Thread-compatible: the dispatcher calls it under its lock."""

    def __init__(self, work_dir: str) -> None:
        self._dir = work_dir
        self._journal_dir = os.path.join(work_dir, "journal")
        os.makedirs(os.path.join(work_dir, "datasets"), exist_ok=True)
        os.makedirs(self._journal_dir, exist_ok=True)
        self._writer: _core.TFRecordWriter | None = None
        self._segment = -1  # index of the segment being written
        self.records_in_segment = 0
        # Records a restart would replay (after the newest snapshot), over every
        # segment: counted by replay() and append(), reset by snapshot().
        self.records_since_snapshot = 0

    @staticmethod
    def _index(path: str, prefix: str, suffix: str) -> int:
        return int(os.path.basename(path)[len(prefix) : -len(suffix)])

    def _snapshots(self) -> list[str]:
        names = [
            n
            for n in os.listdir(self._journal_dir)
            if n.startswith(SNAPSHOT_PREFIX) and n.endswith(SNAPSHOT_SUFFIX)
        ]
        names.sort(key=lambda n: self._index(n, SNAPSHOT_PREFIX, SNAPSHOT_SUFFIX))
        return [os.path.join(self._journal_dir, n) for n in names]

    def load_snapshot(self) -> state.DispatcherState | None:
        """The newest snapshot's state (segments before it are replaced by it), or None.

        Raises:
            DataLossError: The snapshot cannot be read; names the file.
        """
        legacy = sorted(
            n
            for n in os.listdir(self._journal_dir)
            if n.startswith(SNAPSHOT_PREFIX) and n.endswith(LEGACY_SNAPSHOT_SUFFIX)
        )
        if legacy:
            raise errors.DataLossError(
                f"journal snapshot {os.path.join(self._journal_dir, legacy[-1])} is a pickle "
                "written by an older dataservice, whose journal format is no longer read; "
                "start with a new work_dir"
            )
        snapshots = self._snapshots()
        if not snapshots:
            return None
        path = snapshots[-1]
        try:
            reader = _core.TFRecordReader(path)
            try:
                records = list(reader)
            finally:
                reader.close()
            if len(records) != 1:
                raise journal_codec.CodecError(f"it holds {len(records)} records, not 1")
            return journal_codec.decode_snapshot(records[0])
        except (OSError, errors.DataServiceError, journal_codec.CodecError) as err:
            raise errors.DataLossError(f"journal snapshot {path} cannot be read: {err}") from err

    def snapshot(self, current: state.DispatcherState) -> None:
        """Writes `current` as a snapshot, starts a new segment, and deletes
        the segments and snapshots it replaces (bounded replay time)."""
        data = journal_codec.encode_snapshot(current)
        self.close()
        n = self._segment + 1
        path = os.path.join(self._journal_dir, f"{SNAPSHOT_PREFIX}{n:06d}{SNAPSHOT_SUFFIX}")
        tmp = path + ".tmp"
        writer = _core.TFRecordWriter(tmp)
        try:
            writer.write(data)
            writer.sync()
        finally:
            writer.close()
        os.replace(tmp, path)
        dir_fd = os.open(self._journal_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._segment = n - 1  # the next append opens segment n
        self.records_since_snapshot = 0
        for old in self._segments():
            if self._index(old, SEGMENT_PREFIX, SEGMENT_SUFFIX) < n:
                os.remove(old)
        for old in self._snapshots()[:-1]:
            os.remove(old)

    def _segments(self) -> list[str]:
        names = [
            n
            for n in os.listdir(self._journal_dir)
            if n.startswith(SEGMENT_PREFIX) and n.endswith(SEGMENT_SUFFIX)
        ]
        names.sort(key=lambda n: int(n[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)]))
        return [os.path.join(self._journal_dir, n) for n in names]

    def replay(self) -> Iterator[state.Update]:
        """Yields the journaled updates in order, dropping a torn last record
        of each segment.

        Raises:
            DataLossError: A record cannot be decoded; names the file and offset.
        """
        snapshots = self._snapshots()
        first = self._index(snapshots[-1], SNAPSHOT_PREFIX, SNAPSHOT_SUFFIX) if snapshots else 0
        for path in self._segments():
            if self._index(path, SEGMENT_PREFIX, SEGMENT_SUFFIX) < first:
                continue  # replaced by the snapshot
            reader = _core.TFRecordReader(path)
            good_offset = 0
            records: list[bytes] = []
            try:
                for record in reader:
                    records.append(record)
                    good_offset = reader.offset
            except errors.DataLossError as err:
                if not _is_torn_tail(path, good_offset):
                    raise errors.DataLossError(
                        f"journal {path}: damaged record at offset {good_offset}, and it is "
                        f"not the last one (so not a torn write): {err}. The dispatcher "
                        "cannot replay its state past it; restore the work_dir or start "
                        "with a new one"
                    ) from err
                # The last record is incomplete or garbled: the torn write of a crash.
                log.warning(
                    "journal %s: dropping a torn tail of %d bytes at offset %d (%s)",
                    path,
                    os.path.getsize(path) - good_offset,
                    good_offset,
                    err,
                )
                with open(path, "r+b") as f:
                    f.truncate(good_offset)
                    os.fsync(f.fileno())
            finally:
                reader.close()
            offset = 0
            for record in records:
                try:
                    update = journal_codec.decode_update(record)
                except journal_codec.CodecError as err:
                    # Its CRC holds, so it is not a torn write: damage, or another format.
                    raise errors.DataLossError(
                        f"journal {path}: damaged record at offset {offset}: {err}"
                        f"{_pickle_hint(record)}. The dispatcher cannot replay its state "
                        "past it; restore the work_dir or start with a new one"
                    ) from err
                self.records_since_snapshot += 1
                yield update
                offset += len(record) + 16

    def append(self, update: state.Update) -> None:
        """Writes `update` and fsyncs it before returning."""
        if self._writer is None:
            segments = self._segments()
            last = self._index(segments[-1], SEGMENT_PREFIX, SEGMENT_SUFFIX) if segments else -1
            self._segment = max(self._segment, last) + 1
            path = os.path.join(
                self._journal_dir, f"{SEGMENT_PREFIX}{self._segment:06d}{SEGMENT_SUFFIX}"
            )
            self._writer = _core.TFRecordWriter(path)
            self.records_in_segment = 0
        self._writer.write(journal_codec.encode_update(update))
        self._writer.sync()
        self.records_in_segment += 1
        self.records_since_snapshot += 1

    def dataset_path(self, dataset_id: str) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else f"%{ord(c):02x}" for c in dataset_id)
        return os.path.join(self._dir, "datasets", f"{safe}.bin")

    def write_dataset(self, dataset_id: str, data: bytes) -> None:
        path = self.dataset_path(dataset_id)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def read_dataset(self, dataset_id: str) -> bytes:
        with open(self.dataset_path(dataset_id), "rb") as f:
            return f.read()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
