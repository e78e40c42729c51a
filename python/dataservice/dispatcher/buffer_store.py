"""Files holding the big buffers of registered datasets, which workers on the
dispatcher's host map instead of each keeping a copy (CASES C-19).

A registered `DatasetDef` (rpc/dataset.proto, data/serialize.py) carries its
out-of-band buffers (`MIN_SHARED_BUFFER_BYTES` and more) inline. `put` moves
each into a file named by the SHA-256 of its bytes and leaves the file's path
and digest in the definition: equal buffers of several datasets share one
file. A file is written under a temporary name (mode 0600) and renamed, so a
file under its final name is complete, and it is never changed afterwards; a
worker that mapped one keeps valid pages even once it is deleted.

Every path here is made by the store, under its own directory, from a
digest: a definition whose buffer names a path (`DatasetBuffer.path` or
`sha256` set) is refused, as a client could name any file with it
(`/etc/shadow`, a FIFO that blocks the reader). A file read back (`inline`,
an existing file `put` reuses) is opened as work_dir.py's `open_regular`
does and checked against its digest.

Where the files live:

* A fault-tolerant dispatcher: `work_dir/dataset_buffers` (mode 0700), kept
  across restarts. The journal holds every definition with its buffers
  inline, so the files are rebuilt from it at start when missing, and files
  no recovered dataset refers to are deleted then (`retain_only`). A file
  that is there but damaged (another size or digest, a symlink, a FIFO)
  stops start-up with `DataLossError` naming it (`put(..., repair=False)`).
* Otherwise: a private temporary directory `dataservice-dispatcher-<pid>-*`
  under `tempfile.gettempdir()`, made on the first big buffer and deleted by
  `close()` (the dispatcher's `stop()`) or at interpreter exit. Should the
  process die without either (SIGKILL), `LocalCluster` deletes it by its pid
  (`remove_private_dirs`).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import weakref
from typing import Any

from dataservice import errors
from dataservice.dispatcher import work_dir as files
from dataservice.rpc import dataset_pb2

log = logging.getLogger(__name__)

PRIVATE_DIR_PREFIX = "dataservice-dispatcher-"


def _private_dir_prefix(pid: int) -> str:
    return f"{PRIVATE_DIR_PREFIX}{pid}-"


def remove_private_dirs(pid: int) -> None:
    """Deletes the private directories that the dispatcher process `pid` left
    behind (it died without stopping). Call it once that process is reaped."""
    pattern = os.path.join(tempfile.gettempdir(), glob.escape(_private_dir_prefix(pid)) + "*")
    for path in glob.glob(pattern):
        shutil.rmtree(path, ignore_errors=True)


def _remove_in_owner(path: str, owner_pid: int) -> None:
    """Deletes the private folder in the process that made it, never in a
    forked child (its exit would delete the parent's buffers)."""
    if os.getpid() == owner_pid:
        shutil.rmtree(path, True)


class BufferStore:
    """The buffer files of one dispatcher. Thread-safe (files are written
    outside any dispatcher lock: `put` may take seconds for a big dataset).

    Args:
        directory: Where to keep the files (made if missing, kept by `close`);
            None: a private temporary directory, deleted by `close`.
    """

    def __init__(self, directory: str | None) -> None:
        self._mu = threading.Lock()
        self._persistent = directory is not None
        self._dir = os.path.abspath(directory) if directory is not None else None  # guarded
        self._cleanup: weakref.finalize | None = None  # guarded by self._mu

    def _directory(self) -> str:
        with self._mu:
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix=_private_dir_prefix(os.getpid()))
                self._cleanup = weakref.finalize(self, _remove_in_owner, self._dir, os.getpid())
            elif self._persistent:
                files.private_dir(self._dir, "the dataset buffers folder", strict=False)
            return self._dir

    def put(self, definition: Any, repair: bool = True, field: str = "DatasetDef") -> Any:
        """`definition` (a `DatasetDef`) with each inline buffer written to its
        file and replaced by the file's path and digest. A buffer whose file
        cannot be written (disk full, read-only directory) stays inline:
        workers then get it inline, one copy each.

        Args:
            definition: A `DatasetDef` whose buffers are all inline.
            repair: A file already there that does not hold the buffer is
                replaced (logged); else it is a `DataLossError` (start-up).
            field: What holds `definition`, for messages (see `check_inline`).

        Raises:
            InvalidArgumentError: A buffer names a file (`path` or `sha256`
                set) or its `size_bytes` is not `len(data)`; the message
                names the field (see `check_inline`).
            DataLossError: With `repair=False`, a file of this name is damaged.
        """
        check_inline(definition, field, sizes=False)
        stored = dataset_pb2.DatasetDef(pickle=definition.pickle, code_paths=definition.code_paths)
        for i, buffer in enumerate(definition.buffers):
            data = buffer.data  # a copy of its bytes on each read: read once
            _check_size(buffer.size_bytes, len(data), f"{field}.buffers[{i}]")
            digest = hashlib.sha256(data).hexdigest()
            try:
                path = self._write(data, digest, repair)
            except OSError as err:
                log.warning(
                    "cannot keep a %d-byte dataset buffer in a file (%s): workers on this "
                    "host get it inline, one copy each",
                    len(data),
                    err,
                )
                stored.buffers.add(data=data, size_bytes=len(data))
            else:
                stored.buffers.add(path=path, size_bytes=len(data), sha256=digest)
        return stored

    def _write(self, data: bytes, digest: str, repair: bool) -> str:
        directory = self._directory()
        path = os.path.join(directory, digest)
        if os.path.lexists(path):
            try:
                files.verify(path, "dataset buffer file", digest, len(data))
                return path  # written before (this dataset, or another with equal bytes)
            except errors.DataLossError as err:
                if not repair:
                    raise errors.DataLossError(
                        f"{err}. It is a copy of bytes the journal holds: delete it and the "
                        "dispatcher writes it again at start"
                    ) from err
                log.warning("replacing a damaged dataset buffer file: %s", err)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        try:
            os.fchmod(fd, files.FILE_MODE)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if self._persistent:  # it must not be torn after a crash of the host
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return path

    def inline(self, definition: Any) -> Any:
        """`definition` with every file buffer read back inline, for a worker
        on another host; each file is checked against its digest.

        Raises:
            DataLossError: A buffer's file is gone, not a regular file, or holds
                other bytes (someone deleted or changed the dispatcher's
                directory); names the file.
        """
        inlined = dataset_pb2.DatasetDef(pickle=definition.pickle, code_paths=definition.code_paths)
        for buffer in definition.buffers:
            if not buffer.path:
                inlined.buffers.add().CopyFrom(buffer)
                continue
            try:
                data = files.read_verified(
                    buffer.path, "dataset buffer file", buffer.sha256, buffer.size_bytes
                )
            except errors.DataLossError as err:
                raise errors.DataLossError(
                    f"a buffer file of a registered dataset is unreadable: {err}"
                ) from err
            inlined.buffers.add(data=data, size_bytes=len(data))
        return inlined

    def retain_only(self, definitions: list[Any]) -> None:
        """Deletes every file of the directory that none of `definitions` refers
        to (files of datasets a previous run did not journal, torn `.tmp` files)."""
        with self._mu:
            directory = self._dir
        if directory is None or not os.path.isdir(directory):
            return
        keep = {b.path for d in definitions for b in d.buffers if b.path}
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if path not in keep:
                try:
                    os.unlink(path)
                except OSError as err:
                    log.warning("cannot delete the stale buffer file %s: %s", path, err)

    def close(self) -> None:
        """Deletes a private directory and its files (a persistent one stays).
        Processes that mapped a file keep their pages. Idempotent."""
        with self._mu:
            cleanup, self._cleanup = self._cleanup, None
            if not self._persistent:
                self._dir = None
        if cleanup is not None:
            cleanup()


def check_inline(definition: Any, field: str, sizes: bool = True) -> None:
    """Checks that every buffer of the `DatasetDef` `definition` is inline:
    the dispatcher opens no file that a client names.

    Args:
        definition: The `DatasetDef` a client sent.
        field: The request field that holds it, for messages
            ("RegisterDatasetRequest.dataset").
        sizes: Also check each `size_bytes` against its data, which reads
            (copies) every buffer's bytes; `BufferStore.put` checks them as it
            reads them anyway.

    Raises:
        InvalidArgumentError: A buffer sets `path` or `sha256`, or its
            `size_bytes` is not `len(data)`; the message names the field.
    """
    for i, buffer in enumerate(definition.buffers):
        name = f"{field}.buffers[{i}]"
        if buffer.path:
            raise errors.InvalidArgumentError(
                f"{name}.path is set ({buffer.path[:200]!r}): the dispatcher opens no file "
                "that a client names; send the buffer's bytes in `data` (serialize() does)"
            )
        if buffer.sha256:
            raise errors.InvalidArgumentError(
                f"{name}.sha256 is set: it is the dispatcher's name for its own file, "
                "never sent by a client; send the buffer's bytes in `data`"
            )
        if sizes:
            _check_size(buffer.size_bytes, len(buffer.data), name)


def _check_size(size_bytes: int, length: int, name: str) -> None:
    if size_bytes != length:
        raise errors.InvalidArgumentError(
            f"{name}.size_bytes is {size_bytes}, not the {length} bytes of its data"
        )
