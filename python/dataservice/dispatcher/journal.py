"""The dispatcher's journal: an append-only log of state updates in `work_dir`.

The journal is a sequence of segments, `journal/segment-<n>.tfrecord`, one per
dispatcher start (a start never appends to an older segment). Each record is
one `state.Update`, pickled, framed like a TFRecord (length, masked CRC32C of
the length, data, masked CRC32C of the data) by the Rust writer, and fsynced
before `append` returns, so an answered RPC's effect is on disk. On start-up
`replay` applies every record in order. A torn last record (the dispatcher
died mid-write) fails its checksum and is dropped; the segment is truncated
to its last whole record.

Registered dataset definitions are stored beside it as
`datasets/<dataset_id>.bin` (written to a temporary file, fsynced, renamed).
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Iterator

from dataservice import _core, errors
from dataservice.dispatcher import state

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "segment-"
SEGMENT_SUFFIX = ".tfrecord"


class Journal:
    """Appends updates to a new segment under `<work_dir>/journal/`.
    Thread-compatible: the dispatcher calls it under its lock."""

    def __init__(self, work_dir: str) -> None:
        self._dir = work_dir
        self._journal_dir = os.path.join(work_dir, "journal")
        os.makedirs(os.path.join(work_dir, "datasets"), exist_ok=True)
        os.makedirs(self._journal_dir, exist_ok=True)
        self._writer: _core.TFRecordWriter | None = None

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
        for path in self._segments():
            reader = _core.TFRecordReader(path)
            good_offset = 0
            records: list[bytes] = []
            try:
                for record in reader:
                    records.append(record)
                    good_offset = reader.offset
            except errors.DataLossError as err:
                # TFRecord framing cannot resynchronise after damage: what
                # follows the last whole record is the torn write of a crash.
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
                    yield pickle.loads(record)
                except Exception as err:
                    raise errors.DataLossError(
                        f"journal {path}: cannot decode the record after offset {offset}: {err}"
                    ) from err
                offset += len(record) + 16

    def append(self, update: state.Update) -> None:
        """Writes `update` and fsyncs it before returning."""
        if self._writer is None:
            segments = self._segments()
            last = segments[-1] if segments else None
            n = 0
            if last:
                n = int(os.path.basename(last)[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)]) + 1
            path = os.path.join(self._journal_dir, f"{SEGMENT_PREFIX}{n:06d}{SEGMENT_SUFFIX}")
            self._writer = _core.TFRecordWriter(path)
        self._writer.write(pickle.dumps(update, protocol=5))
        self._writer.sync()

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
