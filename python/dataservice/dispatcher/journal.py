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
torn last record of the newest segment (the dispatcher died mid-write: cut
short, or failing its CRC with nothing after it) is dropped, and the segment
is truncated to its last whole record (an older segment was truncated so by
the start that made the next one: a torn tail there is damage). Any other damage stops start-up with
`DataLossError` naming the file and the record's offset, and leaves the file
as it is: a record that fails its CRC with records after it, and a record
whose CRC holds but whose data is not a `JournalRecord` this version reads
(unparseable, another format version, an unknown update kind; also the
pickled updates of a journal written before records were protobuf). A
snapshot that cannot be read is a `DataLossError` naming it.

Segments are numbered without gaps from the newest snapshot's `n` (from 0
without one), and `<work_dir>/journal.head` names the newest segment made
(written once per new segment, with a CRC), so a missing snapshot or segment
is a `DataLossError` naming the file that should be there, not a replay that
fails on an id it never heard of, nor a silently older state. Without
`journal.head` (deleted, or an older work_dir) only the newest segment's
deletion goes unnoticed.

Registered dataset definitions are stored beside the journal as
`<work_dir>/datasets/<sha256>.def`: named by the hex SHA-256 of their bytes
(equal definitions share a file; no two dataset ids can map to one name),
which the `RegisterDataset` record holds (`definition_sha256`), written to a
temporary file, fsynced and renamed before that record. `read_dataset` checks
the file against it. A journal written before that holds no digest and named
the file `<escaped dataset_id>.bin` (an escaping under which "run 14" and
"run\u2014" had one name): such a file is checked against the record's
`fingerprint` (the client's SHA-256 of the same bytes), copied to its new name
and deleted once start-up is done; one that does not match is a
`DataLossError` (it may hold the colliding id's definition).

Every file is read as work_dir.py's `open_regular` reads (no symlink, no
FIFO, nothing that can block) and written mode 0600 in folders of mode 0700.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
from collections.abc import Iterable, Iterator

from dataservice import _core, errors
from dataservice.dispatcher import journal_codec, state
from dataservice.dispatcher import work_dir as files

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "segment-"
SEGMENT_SUFFIX = ".tfrecord"
SNAPSHOT_PREFIX = "snapshot-"
SNAPSHOT_SUFFIX = ".tfrecord"
LEGACY_SNAPSHOT_SUFFIX = ".pickle"  # pickled snapshots, before records were protobuf
SNAPSHOT_EVERY_RECORDS = 20_000  # bounds replay: a snapshot, then at most this many records
DATASETS_SUBDIR = "datasets"
HEAD_NAME = "journal.head"  # of work_dir: "<newest segment index> <masked CRC32C hex>"
DEFINITION_SUFFIX = ".def"
LEGACY_DEFINITION_SUFFIX = ".bin"  # <escaped dataset_id>.bin, before definitions were digests
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _fd_path(fd: int) -> str:
    """A path that opens the very file `fd` holds open (for the Rust TFRecord
    reader, which takes a path): the file checked by `open_regular`, even if
    the name was replaced since."""
    return f"/proc/self/fd/{fd}"


def _is_torn_tail(fd: int, offset: int) -> bool:
    """Whether the damaged record at `offset` of the file open as `fd` is its
    last one: its header is cut short, or the length it declares reaches the
    end of the file (appends are sequential, so a crash can only damage the
    tail)."""
    size = os.fstat(fd).st_size
    if size - offset < 12:  # u64 length + u32 masked CRC of the length
        return True
    header = os.pread(fd, 12, offset)
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
        self._datasets_dir = os.path.join(work_dir, DATASETS_SUBDIR)
        self._head_path = os.path.join(work_dir, HEAD_NAME)
        if not os.path.exists(work_dir):
            os.makedirs(work_dir, mode=files.DIR_MODE)
        files.private_dir(self._datasets_dir, "the dataset definitions folder")
        files.private_dir(self._journal_dir, "the journal folder")
        # Old-named definition files read by this start, deleted by retain_datasets.
        self._migrated: list[str] = []
        self._writer: _core.TFRecordWriter | None = None
        self._segment = -1  # index of the segment being written
        self.records_in_segment = 0
        # Records a restart would replay (after the newest snapshot), over every
        # segment: counted by replay() and append(), reset by snapshot().
        self.records_since_snapshot = 0

    @staticmethod
    def _index(path: str, prefix: str, suffix: str) -> int:
        return int(os.path.basename(path)[len(prefix) : -len(suffix)])

    def _numbered(self, prefix: str, suffix: str) -> list[str]:
        """The paths of the journal folder named `<prefix><n><suffix>`, by `n`.

        Raises:
            DataLossError: A name has the prefix and suffix but no number
                between them (`segment-x.tfrecord`); names it.
        """
        names = [
            n for n in os.listdir(self._journal_dir) if n.startswith(prefix) and n.endswith(suffix)
        ]
        for n in names:
            if not n[len(prefix) : -len(suffix)].isdigit():
                raise errors.DataLossError(
                    f"journal file {os.path.join(self._journal_dir, n)} has no number in its "
                    "name (a dispatcher never writes one: remove it)"
                )
        names.sort(key=lambda n: self._index(n, prefix, suffix))
        return [os.path.join(self._journal_dir, n) for n in names]

    def _snapshots(self) -> list[str]:
        return self._numbered(SNAPSHOT_PREFIX, SNAPSHOT_SUFFIX)

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
        fd = files.open_regular(path, "journal snapshot")
        try:
            reader = _core.TFRecordReader(_fd_path(fd))
            try:
                records = list(reader)
            finally:
                reader.close()
            if len(records) != 1:
                raise journal_codec.CodecError(f"it holds {len(records)} records, not 1")
            return journal_codec.decode_snapshot(records[0])
        except (OSError, errors.DataServiceError, journal_codec.CodecError) as err:
            raise errors.DataLossError(f"journal snapshot {path} cannot be read: {err}") from err
        finally:
            os.close(fd)

    def snapshot(self, current: state.DispatcherState) -> None:
        """Writes `current` as a snapshot, starts a new segment, and deletes
        the segments and snapshots it replaces (bounded replay time)."""
        data = journal_codec.encode_snapshot(current)
        self.close()
        n = self._segment + 1
        path = os.path.join(self._journal_dir, f"{SNAPSHOT_PREFIX}{n:06d}{SNAPSHOT_SUFFIX}")
        tmp = path + ".tmp"
        try:
            os.unlink(tmp)  # torn by a crash
        except FileNotFoundError:
            pass
        os.close(files.create_private(tmp))  # mode 0600: the writer keeps it
        writer = _core.TFRecordWriter(tmp)
        try:
            writer.write(data)
            writer.sync()
        finally:
            writer.close()
        os.replace(tmp, path)
        files.fsync_dir(self._journal_dir)
        self._segment = n - 1  # the next append opens segment n
        self.records_since_snapshot = 0
        for old in self._segments():
            if self._index(old, SEGMENT_PREFIX, SEGMENT_SUFFIX) < n:
                os.remove(old)
        for old in self._snapshots()[:-1]:
            os.remove(old)

    def _segments(self) -> list[str]:
        return self._numbered(SEGMENT_PREFIX, SEGMENT_SUFFIX)

    def _base(self) -> int:
        """The index of the first segment replayed: the newest snapshot's, or 0."""
        snapshots = self._snapshots()
        return self._index(snapshots[-1], SNAPSHOT_PREFIX, SNAPSHOT_SUFFIX) if snapshots else 0

    def _check_layout(self) -> None:
        """Checks that the segments from the newest snapshot's index on (from 0
        without one) are numbered without a gap, as `append` and `snapshot`
        make them.

        Raises:
            DataLossError: A snapshot or segment is missing; names it.
        """
        base = self._base()
        indices = [
            self._index(p, SEGMENT_PREFIX, SEGMENT_SUFFIX)
            for p in self._segments()
            if self._index(p, SEGMENT_PREFIX, SEGMENT_SUFFIX) >= base
        ]
        for expected, index in enumerate(indices, start=base):
            if index == expected:
                continue
            if expected == base and not self._snapshots() and index > 0:
                missing = f"{SNAPSHOT_PREFIX}{index:06d}{SNAPSHOT_SUFFIX}"
                why = (
                    f"the first segment is {index}, so the snapshot that replaced the "
                    "segments before it should be there"
                )
            else:
                missing = f"{SEGMENT_PREFIX}{expected:06d}{SEGMENT_SUFFIX}"
                why = f"the segments after it ({index} and on) are there"
            raise errors.DataLossError(
                f"journal file {os.path.join(self._journal_dir, missing)} is missing: {why}. "
                "The dispatcher cannot replay its state without it; restore the work_dir "
                "or start with a new one"
            )
        head = self._read_head()
        if head is None:
            if indices:
                log.warning(
                    "%s is missing (deleted, or a work_dir of an older dataservice): a "
                    "deleted newest journal segment would go unnoticed this start",
                    self._head_path,
                )
            return
        if head >= base and (not indices or indices[-1] < head):
            missing = f"{SEGMENT_PREFIX}{head:06d}{SEGMENT_SUFFIX}"
            raise errors.DataLossError(
                f"journal file {os.path.join(self._journal_dir, missing)} is missing: "
                f"{self._head_path} says it was made (or, had a snapshot replaced it, that "
                "snapshot is missing). The dispatcher cannot replay its state without it; "
                "restore the work_dir or start with a new one"
            )

    def _read_head(self) -> int | None:
        """The newest segment's index that `_write_head` recorded, or None
        without the file.

        Raises:
            DataLossError: It is not what `_write_head` writes; names it.
        """
        if not os.path.lexists(self._head_path):
            return None
        data = files.read_verified(self._head_path, "journal head")
        try:
            index_text, crc_text = data.decode("ascii").split()
            index = int(index_text)
            if int(crc_text, 16) != _core.masked_crc32c(index_text.encode("ascii")):
                raise ValueError("its CRC32C does not match")
        except ValueError as err:
            raise errors.DataLossError(
                f"journal head {self._head_path} is damaged ({data[:40]!r}: {err}); it "
                "only names the newest segment: delete it to start without that check"
            ) from err
        return index

    def _write_head(self, index: int) -> None:
        """Records that segment `index` was made, so that a start can tell
        a deleted newest segment from one never written."""
        text = str(index).encode("ascii")
        files.write_atomic(self._head_path, b"%s %08x\n" % (text, _core.masked_crc32c(text)))

    def replay(self) -> Iterator[state.Update]:
        """Yields the journaled updates in order, dropping a torn last record
        of each segment.

        Raises:
            DataLossError: A record cannot be decoded, or a file cannot be read
                (missing, not a regular file); names the file (and offset).
        """
        self._check_layout()
        first = self._base()
        segments = self._segments()
        for path in segments:
            if self._index(path, SEGMENT_PREFIX, SEGMENT_SUFFIX) < first:
                continue  # replaced by the snapshot
            yield from self._replay_segment(path, newest=path == segments[-1])

    def _replay_segment(self, path: str, newest: bool) -> Iterator[state.Update]:
        fd = files.open_regular(path, "journal segment")
        try:
            records = self._read_segment(path, fd, newest)
        finally:
            os.close(fd)
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

    @staticmethod
    def _read_segment(path: str, fd: int, newest: bool) -> list[bytes]:
        """The whole records of the segment open as `fd`, truncating a torn
        tail if it is the `newest` segment. An older one cannot have one: the
        start that made the next segment replayed it and truncated its tail."""
        reader = _core.TFRecordReader(_fd_path(fd))
        good_offset = 0
        records: list[bytes] = []
        try:
            try:
                for record in reader:
                    records.append(record)
                    good_offset = reader.offset
            except errors.DataLossError as err:
                if not _is_torn_tail(fd, good_offset):
                    raise errors.DataLossError(
                        f"journal {path}: damaged record at offset {good_offset}, and it is "
                        f"not the last one (so not a torn write): {err}. The dispatcher "
                        "cannot replay its state past it; restore the work_dir or start "
                        "with a new one"
                    ) from err
                if not newest:
                    raise errors.DataLossError(
                        f"journal {path}: its last record (offset {good_offset}) is cut short "
                        f"or garbled ({err}), and it is not the newest segment, whose tail "
                        "alone a crash can tear: the file was truncated or changed. The "
                        "dispatcher cannot replay its state past it; restore the work_dir "
                        "or start with a new one"
                    ) from err
                # The last record is incomplete or garbled: the torn write of a crash.
                log.warning(
                    "journal %s: dropping a torn tail of %d bytes at offset %d (%s)",
                    path,
                    os.fstat(fd).st_size - good_offset,
                    good_offset,
                    err,
                )
                write_fd = files.open_regular(path, "journal segment", write=True)
                try:
                    os.ftruncate(write_fd, good_offset)
                    os.fsync(write_fd)
                finally:
                    os.close(write_fd)
        finally:
            reader.close()
        return records

    def append(self, update: state.Update) -> None:
        """Writes `update` and fsyncs it before returning."""
        if self._writer is None:
            segments = self._segments()
            last = self._index(segments[-1], SEGMENT_PREFIX, SEGMENT_SUFFIX) if segments else -1
            # At least the newest snapshot's index: a start after a snapshot
            # that no segment followed yet must not reuse a replaced number.
            self._segment = max(self._segment, last, self._base() - 1) + 1
            path = os.path.join(
                self._journal_dir, f"{SEGMENT_PREFIX}{self._segment:06d}{SEGMENT_SUFFIX}"
            )
            os.close(files.create_private(path))  # mode 0600: the writer keeps it
            files.fsync_dir(self._journal_dir)
            self._write_head(self._segment)
            self._writer = _core.TFRecordWriter(path)
            self.records_in_segment = 0
        self._writer.write(journal_codec.encode_update(update))
        self._writer.sync()
        self.records_in_segment += 1
        self.records_since_snapshot += 1

    def dataset_path(self, sha256_hex: str) -> str:
        """Where the definition whose bytes have SHA-256 `sha256_hex` is kept."""
        return os.path.join(self._datasets_dir, f"{sha256_hex}{DEFINITION_SUFFIX}")

    def _legacy_dataset_path(self, dataset_id: str) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else f"%{ord(c):02x}" for c in dataset_id)
        return os.path.join(self._datasets_dir, f"{safe}{LEGACY_DEFINITION_SUFFIX}")

    def write_dataset(self, data: bytes) -> str:
        """Keeps the definition `data` (fsynced) and returns its hex SHA-256,
        for `RegisterDataset.definition_sha256`: write it before that record.
        Thread-safe, also for one definition written by two threads at once (a
        registration writes it outside the dispatcher's lock)."""
        digest = hashlib.sha256(data).hexdigest()
        files.write_atomic(self.dataset_path(digest), data, concurrent=True)
        return digest

    def read_dataset(self, dataset: state.Dataset) -> bytes:
        """The definition bytes of the journaled `dataset`, checked against
        the SHA-256 its record holds.

        Raises:
            DataLossError: The file is missing, truncated, changed, replaced by
                a symlink or FIFO (see work_dir.py), or, for a journal written
                before the digest, cannot be checked; names the file.
        """
        what = f"the definition of dataset {dataset.dataset_id!r}"
        if dataset.definition_sha256:
            return files.read_verified(
                self.dataset_path(dataset.definition_sha256), what, dataset.definition_sha256
            )
        # A journal written before definition_sha256: the client's fingerprint
        # is the SHA-256 of the same bytes (client/api.py), and the file has the
        # old, non-injective name until it is copied to the new one.
        legacy = self._legacy_dataset_path(dataset.dataset_id)
        if not _SHA256_HEX.fullmatch(dataset.fingerprint):
            raise errors.DataLossError(
                f"{what} ({legacy}) was journaled by an older dataservice with the "
                f"fingerprint {dataset.fingerprint!r}, not a SHA-256 of its bytes, so it "
                "cannot be checked; start with a new work_dir"
            )
        new = self.dataset_path(dataset.fingerprint)
        if os.path.lexists(new):
            return files.read_verified(new, what, dataset.fingerprint)
        data = files.read_verified(legacy, what, dataset.fingerprint)
        files.write_atomic(new, data)
        self._migrated.append(legacy)
        return data

    def retain_datasets(self, datasets: Iterable[state.Dataset]) -> None:
        """Deletes the files of the definitions folder that none of `datasets`
        uses (old-named files copied by `read_dataset`, files of datasets that
        a crashed run did not journal, torn `.tmp` files). Call it once every
        definition was read."""
        keep = set()
        for d in datasets:
            digest = d.definition_sha256 or d.fingerprint
            keep.add(f"{digest}{DEFINITION_SUFFIX}")
        for name in os.listdir(self._datasets_dir):
            if name in keep:
                continue
            try:
                os.unlink(os.path.join(self._datasets_dir, name))
            except OSError as err:
                log.warning("cannot delete the stale definition file %s: %s", name, err)
        self._migrated.clear()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
