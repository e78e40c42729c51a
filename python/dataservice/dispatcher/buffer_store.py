"""Files holding the big buffers of registered datasets, which workers on the
dispatcher's host map instead of each keeping a copy (CASES C-19).

A registered `DatasetDef` (rpc/dataset.proto, data/serialize.py) carries its
out-of-band buffers (`MIN_SHARED_BUFFER_BYTES` and more) inline. `put` moves
each into a file named by the SHA-256 of its bytes and leaves the file's path
in the definition: equal buffers of several datasets share one file. A file
is written under a temporary name and renamed, so a file under its final name
is complete, and it is never changed afterwards; a worker that mapped one
keeps valid pages even once it is deleted.

Where the files live:

* A fault-tolerant dispatcher: `work_dir/dataset_buffers`, kept across
  restarts. The journal holds every definition with its buffers inline, so the
  files are rebuilt from it at start when missing, and files no recovered
  dataset refers to are deleted then (`retain_only`).
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
                self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)
            elif self._persistent:
                os.makedirs(self._dir, exist_ok=True)
            return self._dir

    def put(self, definition: Any) -> Any:
        """`definition` (a `DatasetDef`) with each inline buffer written to its
        file and replaced by the file's path. A buffer whose file cannot be
        written (disk full, read-only directory) stays inline: workers then get
        it inline, one copy each."""
        stored = dataset_pb2.DatasetDef(pickle=definition.pickle)
        for buffer in definition.buffers:
            if buffer.path:
                stored.buffers.add().CopyFrom(buffer)
                continue
            data = buffer.data
            try:
                path = self._write(data)
            except OSError as err:
                log.warning(
                    "cannot keep a %d-byte dataset buffer in a file (%s): workers on this "
                    "host get it inline, one copy each",
                    len(data),
                    err,
                )
                stored.buffers.add(data=data, size_bytes=len(data))
            else:
                stored.buffers.add(path=path, size_bytes=len(data))
        return stored

    def _write(self, data: bytes) -> str:
        directory = self._directory()
        path = os.path.join(directory, hashlib.sha256(data).hexdigest())
        try:
            if os.stat(path).st_size == len(data):
                return path  # written before (this dataset, or another with equal bytes)
        except FileNotFoundError:
            pass
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        try:
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
        on another host.

        Raises:
            DataLossError: A buffer's file is gone or has another size (someone
                deleted or changed the dispatcher's directory).
        """
        inlined = dataset_pb2.DatasetDef(pickle=definition.pickle)
        for buffer in definition.buffers:
            if not buffer.path:
                inlined.buffers.add().CopyFrom(buffer)
                continue
            try:
                with open(buffer.path, "rb") as f:
                    data = f.read()
            except OSError as err:
                raise errors.DataLossError(
                    f"a buffer file of a registered dataset is unreadable: {err}"
                ) from err
            if len(data) != buffer.size_bytes:
                raise errors.DataLossError(
                    f"the buffer file {buffer.path} holds {len(data)} bytes, not "
                    f"{buffer.size_bytes}"
                )
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
