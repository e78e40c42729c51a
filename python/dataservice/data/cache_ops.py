"""`cache(filename="")`: the elements of a first full pass, kept in memory or in a file
and produced from there by later passes (tf.data's `CacheDataset`).

In memory (`filename=""`): the first iterator that reads its input to the end keeps
every element, in this process, with the `Dataset` object; later iterators of that
object produce those. In a file: the first full pass writes `<filename>.data`; later
passes, in this process or any other (a later run), read it.

The rules that keep a cache whole (tf.data's):

* Only a full pass completes a cache. An iterator closed or dropped before the end
  (`take(3)`, a `break`) discards what it wrote and logs a WARNING; the next pass
  reads the input again.
* A file cache is written to `<filename>.data.tmp-<pid>-<n>` and renamed to
  `<filename>.data` only once complete, so a crash never leaves a partial file that a
  later pass would take for a cache. While one iterator writes, `<filename>.lockfile`
  (its host and pid) says so. tf.data raises `AlreadyExistsError` for a second
  writer; here the second iterator reads its input without caching (logging a
  WARNING once), so several workers of one host can share a path. A lockfile whose
  process is gone (it crashed) is removed by the next writer on its host, with that
  process's temporary file; one written on another host is never taken for stale
  (delete it by hand if its writer is gone).
* A complete `<filename>.data` is used as it is, whatever the input is now: delete it
  to rebuild the cache. A damaged one (truncated, not a cache) raises `DataLossError`.
* Elements are written with pickle (protocol 5): read only caches you wrote.

With the data service. A pipeline with `cache` runs on every worker: each worker
process keeps its own memory cache (the worker keeps the registered dataset, so its
second epoch reads it), and a file cache is written on each worker's host, by the
first of its workers that gets there (the others read their input meanwhile, then
the file). Under ShardingPolicy.DYNAMIC a worker's elements are those of the splits
it is handed, which differ from epoch to epoch: caching them would make later epochs
repeat this epoch's share. There, `cache` lets its input's elements through without
caching (one WARNING per worker), so every element is still produced once per epoch;
put the cache in the OFF-sharded pipeline, or below the service, to have one.
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
import pickle
import socket
import threading
from collections.abc import Iterator
from typing import Any

import psutil

from dataservice.data.dataset import Dataset, Element, IterContext
from dataservice.data.ops import _UnaryDataset
from dataservice.data.runtime import close_iterator
from dataservice.errors import DataLossError

__all__ = ["CacheDataset"]

log = logging.getLogger("dataservice.data")

_FORMAT = "dataservice.cache/1"
_tmp_ids = itertools.count()


class _MemoryCache:
    """The memory cache of one `CacheDataset` object in this process. Thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.elements: list[Any] | None = None  # guarded by lock; set once complete
        self.writing = False  # guarded by lock


class CacheDataset(_UnaryDataset):
    """`ds.cache(filename)` (module docstring)."""

    _op_name = "cache"

    def __init__(self, input_dataset: Dataset, filename: str) -> None:
        super().__init__(input_dataset)
        if not isinstance(filename, str | os.PathLike):
            raise TypeError(
                f'`cache`: filename must be a str path ("" for memory), got '
                f"{type(filename).__name__}"
            )
        self._filename = os.fspath(filename)

    @property
    def data_path(self) -> str:
        """Where a complete file cache is."""
        return self._filename + ".data"

    @property
    def lock_path(self) -> str:
        """The lockfile of the iterator writing the file cache."""
        return self._filename + ".lockfile"

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        warned = self.__dict__.setdefault("_t_warned", set())
        if key not in warned:
            warned.add(key)
            log.warning(message, *args)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        if ctx.split_sources is not None:
            self._warn_once(
                "dynamic",
                "cache(%r) under DYNAMIC sharding: this worker's elements differ from epoch "
                "to epoch, so they pass through without being cached",
                self._filename,
            )
            return self._input._make_iterator(ctx)
        if self._filename:
            return self._file_iterator(ctx)
        return self._memory_iterator(ctx)

    # ------------------------------------------------------------ memory

    def _memory_iterator(self, ctx: IterContext) -> Iterator[Element]:
        # A generator: nothing is decided (or locked) until the first next(), so an
        # iterator made and dropped unread leaves no state behind.
        cache = self.__dict__.get("_t_cache")
        if cache is None:
            cache = self.__dict__.setdefault("_t_cache", _MemoryCache())
        with cache.lock:
            elements = cache.elements
            write = elements is None and not cache.writing and not ctx.peek
            if write:
                cache.writing = True
        if elements is not None:
            yield from elements
            return
        source = self._input._make_iterator(ctx)
        if not write:  # another iterator is filling it (or a peek): read the input
            try:
                yield from source
            finally:
                close_iterator(source)
            return
        yield from self._fill_memory(source, cache)

    def _fill_memory(self, source: Iterator[Element], cache: _MemoryCache) -> Iterator[Element]:
        kept: list[Any] = []
        complete = False
        try:
            for element in source:
                kept.append(element)
                yield element
            complete = True
        finally:
            close_iterator(source)
            with cache.lock:
                cache.writing = False
                if complete:
                    cache.elements = kept
            if not complete:
                log.warning(
                    "cache(): the iterator did not read the dataset being cached to its end; "
                    "the %d elements cached so far are discarded, and the next pass reads "
                    "the input again",
                    len(kept),
                )

    # ------------------------------------------------------------ file

    def _file_iterator(self, ctx: IterContext) -> Iterator[Element]:
        # A generator, as `_memory_iterator`: the lockfile is taken at the first next().
        if os.path.exists(self.data_path):
            yield from self._read_file()
            return
        source = self._input._make_iterator(ctx)
        if ctx.peek or not self._take_lock():
            try:
                yield from source
            finally:
                close_iterator(source)
            return
        yield from self._fill_file(source)

    def _take_lock(self) -> bool:
        """Creates the lockfile; False if a live iterator holds it (a stale one, whose
        process on this host is gone, is replaced)."""
        host = socket.gethostname()
        for _ in range(2):
            try:
                fd = os.open(self.lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._lock_owner()
                if owner is not None and owner[0] == host and not psutil.pid_exists(owner[1]):
                    log.warning(
                        "cache(%r): removing the lockfile of process %d, which is gone",
                        self._filename,
                        owner[1],
                    )
                    for path in [self.lock_path, *glob.glob(f"{self.data_path}.tmp-{owner[1]}-*")]:
                        try:
                            os.unlink(path)
                        except FileNotFoundError:
                            pass
                    continue
                self._warn_once(
                    "locked",
                    "cache(%r): another iterator (%s) is writing this cache (lockfile %s); "
                    "this one reads its input without caching",
                    self._filename,
                    "unknown" if owner is None else f"pid {owner[1]} on {owner[0]}",
                    self.lock_path,
                )
                return False
            with os.fdopen(fd, "w") as f:
                f.write(f"{host} {os.getpid()}\n")
            return True
        return False

    def _lock_owner(self) -> tuple[str, int] | None:
        try:
            with open(self.lock_path) as f:
                host, pid = f.read().split()
            return host, int(pid)
        except (OSError, ValueError):
            return None

    def _fill_file(self, source: Iterator[Element]) -> Iterator[Element]:
        tmp = f"{self.data_path}.tmp-{os.getpid()}-{next(_tmp_ids)}"
        complete = False
        count = 0
        try:
            with open(tmp, "wb") as f:
                pickler = pickle.Pickler(f, protocol=pickle.HIGHEST_PROTOCOL)
                pickler.dump(_FORMAT)
                for element in source:
                    pickler.dump(("e", element))
                    pickler.clear_memo()
                    count += 1
                    yield element
                pickler.dump(("end", count))
            os.replace(tmp, self.data_path)
            complete = True
        finally:
            close_iterator(source)
            if not complete:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                log.warning(
                    "cache(%r): the iterator did not read the dataset being cached to its "
                    "end; the %d elements cached so far are discarded, and the next pass "
                    "reads the input again",
                    self._filename,
                    count,
                )
            try:
                os.unlink(self.lock_path)
            except FileNotFoundError:
                pass

    def _read_file(self) -> Iterator[Element]:
        path = self.data_path
        with open(path, "rb") as f:
            unpickler = pickle.Unpickler(f)
            try:
                header = unpickler.load()
            except Exception as err:
                raise DataLossError(f"cache file {path} is not a cache: {err!r}") from None
            if header != _FORMAT:
                raise DataLossError(f"cache file {path} is not a cache ({header!r}); delete it")
            count = 0
            while True:
                try:
                    kind, value = unpickler.load()
                except Exception as err:
                    raise DataLossError(
                        f"cache file {path} is damaged after {count} elements ({err!r}); "
                        "delete it to rebuild the cache"
                    ) from None
                if kind == "end":
                    if value != count:
                        raise DataLossError(
                            f"cache file {path} says {value} elements but holds {count}"
                        )
                    return
                count += 1
                yield value
