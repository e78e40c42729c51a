"""`WebDataset`: the samples of WebDataset-style tar shards, read with the stdlib `tarfile`.

A shard is a tar file (optionally gzip, bzip2 or xz compressed) whose files are grouped
into samples by key, as the `webdataset` package does (`tariterators.group_by_keys`):
a file's key is its path up to the first dot of its base name, its extension the rest
(`train/0001.seg.png` -> key `train/0001`, extension `seg.png`, lower-cased). Adjacent
files with the same key make one sample, a dict {"__key__": key, "__url__": shard,
extension: bytes, ...}; files without a dot in their base name, non-regular members and
metadata (a member `__name__` or anything under a `__name__/` directory) are skipped.
A key whose files are not adjacent gives several samples, and two files of one sample
with the same extension are an error, as in webdataset.

Shards are the splits: under DYNAMIC sharding the dispatcher hands out shard names
(`FileSplitProvider`), so each sample is produced once per epoch across the workers;
FILE sharding gives each worker every n-th shard.

Source: webdataset's tariterators.py (grouping), autodecode.py (`basichandlers`, the
default decoders below).
"""

from __future__ import annotations

import bz2
import collections
import copy
import gzip
import io
import logging
import lzma
import os
import re
import tarfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from dataservice.data.dataset import UNKNOWN_CARDINALITY, Dataset, Element, IterContext
from dataservice.data.ops import parallelism
from dataservice.data.runtime import close_iterator, interleave
from dataservice.data.splits import FileSplitProvider, SplitProvider
from dataservice.errors import DataLossError, InvalidArgumentError, NotFoundError

__all__ = ["DEFAULT_DECODERS", "WebDataset"]

log = logging.getLogger(__name__)

_OP = "WebDataset"
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
_BLOCK = 512  # tar block size: the archive ends with a block of zeros
_READ_BYTES = 1 << 18  # bytes tarfile reads from a shard at a time (streaming mode)


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _int(data: bytes) -> np.int64:
    return np.int64(int(data))


def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _npz(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


DEFAULT_DECODERS: Mapping[str, Callable[[bytes], Any]] = {
    **dict.fromkeys(("txt", "text", "transcript"), _text),
    **dict.fromkeys(("cls", "cls2", "class", "count", "index", "inx", "id"), _int),
    "npy": _npy,
    "npz": _npz,
}
"""`decode=True`'s decoders, by the last part of the extension (webdataset's
`basichandlers`, less those whose values are not numpy values: json, pickle, msgpack,
torch): text -> `str`, class/count/index/id -> `np.int64`, npy -> `np.ndarray`, npz ->
dict of arrays. Other extensions (images: jpg, png, ...) stay `bytes`."""


class _TailReader(io.RawIOBase):
    """A file object reading `stream`, keeping the last chunks read and where they start,
    so that the bytes where tarfile stopped can be looked at (tarfile reads `_READ_BYTES`
    at a time in streaming mode, so the header it stopped at is in the last chunks)."""

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self._stream = stream
        self.pos = 0
        self._chunks: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=3)

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        data = bytes(self._stream.read(size if size is not None else -1))
        if data:
            self._chunks.append((self.pos, data))
            self.pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def block_at(self, offset: int) -> bytes | None:
        """The `_BLOCK` bytes of the stream at `offset` (fewer at its end), reading on
        as needed; None if they are no longer kept."""
        while self.pos < offset + _BLOCK and self.read(offset + _BLOCK - self.pos):
            pass
        if not self._chunks:
            return b""
        start = self._chunks[0][0]
        if offset < start:
            return None
        kept = b"".join(chunk for _, chunk in self._chunks)
        return kept[offset - start : offset - start + _BLOCK]


def _decompressed(raw: Any) -> Any:
    """`raw` (a binary file), decompressed if it starts with a gzip, bzip2 or xz magic.
    The decompressors raise EOFError on a truncated stream."""
    head = raw.peek(6)[:6] if hasattr(raw, "peek") else b""
    if head.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head.startswith(b"BZh"):
        return bz2.BZ2File(raw, mode="rb")
    if head.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(raw, mode="rb")
    return raw


_DAMAGE = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError)


def _tar_files(shard: str) -> Iterator[tuple[str, bytes]]:
    """(member name, contents) of the regular files of tar `shard`, in archive order,
    read in one pass (tarfile's streaming mode).

    Raises:
        NotFoundError: `shard` does not exist.
        DataLossError: `shard` is not a tar file, or is truncated or damaged (also a
            truncation that tarfile itself takes for the end: the archive must end with
            its end-of-archive block).
    """
    try:
        raw = open(shard, "rb")  # noqa: SIM115 (closed in the finally below)
    except FileNotFoundError:
        raise NotFoundError(f"{_OP}: shard {shard}: no such file") from None
    except OSError as e:
        raise NotFoundError(f"{_OP}: shard {shard}: cannot open it: {e}") from None
    last = None
    try:
        stream = _TailReader(_decompressed(raw))
        try:
            archive = tarfile.open(fileobj=stream, mode="r|", bufsize=_READ_BYTES)
            for member in archive:
                if not member.isreg():
                    continue
                extracted = archive.extractfile(member)
                assert extracted is not None  # a regular file
                data = extracted.read()
                if len(data) != member.size:
                    raise tarfile.ReadError("unexpected end of data")
                last = member.name
                yield member.name, data
            # tarfile ends quietly at a truncated or garbled header after the first one;
            # a complete archive has an end-of-archive block (zeros) right there.
            end = stream.block_at(archive.offset)
        except _DAMAGE as e:
            after = f" after member {last!r}" if last is not None else ""
            raise DataLossError(
                f"{_OP}: shard {shard} is not a tar file or is damaged{after}: "
                f"{type(e).__name__}: {e}"
            ) from None
        if end is not None and end != bytes(_BLOCK):
            after = f" after member {last!r}" if last is not None else ""
            raise DataLossError(
                f"{_OP}: shard {shard} is truncated or damaged{after}: no end-of-archive "
                f"block at byte {archive.offset} of the archive"
            )
    finally:
        raw.close()


def _group(shard: str, files: Iterator[tuple[str, bytes]]) -> Iterator[dict[str, Any]]:
    """Adjacent files with the same key as one sample (webdataset's group_by_keys).

    Raises:
        InvalidArgumentError: Two files of a sample have the same extension.
    """
    sample: dict[str, Any] | None = None
    try:
        for name, data in files:
            if _META.match(name):
                continue
            match = _KEY_EXT.match(name)
            if match is None:
                continue
            key, ext = match.group(1), match.group(2).lower()
            if sample is None or key != sample["__key__"]:
                if sample is not None and len(sample) > 2:
                    yield sample
                sample = {"__key__": key, "__url__": shard}
            if ext in sample:
                raise InvalidArgumentError(
                    f"{_OP}: shard {shard}: {name!r} has the extension {ext!r} of another "
                    f"file of sample {key!r} (a sample has one file per extension)"
                )
            sample[ext] = data
        if sample is not None and len(sample) > 2:
            yield sample
    finally:
        close_iterator(files)


def _shard_names(urls_or_paths: Any) -> tuple[str, ...]:
    if isinstance(urls_or_paths, str | bytes | os.PathLike):
        return (os.fsdecode(urls_or_paths),)
    if isinstance(urls_or_paths, list | tuple | np.ndarray):
        names = tuple(os.fsdecode(p) for p in urls_or_paths)
        if not names:
            raise InvalidArgumentError(f"{_OP}: no shards given")
        return names
    if isinstance(urls_or_paths, Dataset):
        raise TypeError(
            f"{_OP} reads a list of shard names, not a Dataset of them; use "
            "WebDataset(names) (e.g. sorted(glob.glob('shards/*.tar'))), or "
            "Dataset.list_files(pattern).interleave(lambda s: WebDataset(s)) for names only "
            "known at run time"
        )
    raise TypeError(
        f"{_OP}: `urls_or_paths` must be a str or a list of str, got {type(urls_or_paths).__name__}"
    )


def _for_url(name: str) -> str:
    if "://" in name and not name.startswith("file://"):
        raise InvalidArgumentError(
            f"{_OP}: {name!r}: only local paths (or file:// URLs) are read; fetch remote "
            "shards to a local or mounted file system first"
        )
    return name[len("file://") :] if name.startswith("file://") else name


class WebDataset(Dataset):
    """The samples of WebDataset-style tar shards: dicts of extension -> file contents.

    >>> import tarfile, tempfile, os, io
    >>> shard = os.path.join(tempfile.mkdtemp(), "shard-000.tar")
    >>> with tarfile.open(shard, "w") as tar:
    ...     for name, data in [("s1.txt", b"cat"), ("s1.cls", b"3"), ("s2.txt", b"dog"),
    ...                        ("s2.cls", b"5")]:
    ...         info = tarfile.TarInfo(name); info.size = len(data)
    ...         tar.addfile(info, io.BytesIO(data))
    >>> [(s["__key__"], s["txt"], int(s["cls"])) for s in WebDataset(shard, decode=True)]
    [('s1', 'cat', 3), ('s2', 'dog', 5)]

    Args:
        urls_or_paths: A shard's path or a list of them (or `file://` URLs), read in
            this order. Tar, or tar compressed with gzip, bzip2 or xz (by magic bytes).
        decode: Apply `DEFAULT_DECODERS` (text to `str`, class ids to `np.int64`, npy
            to arrays; images and other extensions stay `bytes`). False: every value
            is the file's `bytes` (webdataset without `.decode()`).
        decoders: Extension -> function(bytes) -> value, used for the files whose
            extension's last part (lower-cased, `seg.png` -> `png`) it names, before
            `DEFAULT_DECODERS`: e.g. {"jpg": lambda b: np.asarray(PIL.Image.open(
            io.BytesIO(b)))}. An exception it raises is raised as it is, with a note
            naming the shard, sample and file.
        ignore_errors: Like tf.data's `ignore_errors()` and webdataset's
            `warn_and_continue`: a missing, truncated or damaged shard logs a warning
            and its remaining samples are skipped (the samples read before the damage
            are kept); a sample a decoder fails on is skipped with a warning.
        num_parallel_reads: None or 1: shards one after another. >1 or AUTOTUNE: that
            many shards (the CPU count) are read at once on daemon threads and their
            samples interleaved one at a time (as `TFRecordDataset`).

    Each element is {"__key__": str, "__url__": str (the shard as given), ext: bytes or
    decoded value, ...}. The element spec is that of the first sample (samples may
    differ: a `map` can make them uniform); the cardinality is unknown.

    Raises:
        TypeError: `urls_or_paths` or `decoders` has the wrong type.
        InvalidArgumentError: No shards, a remote URL, or `num_parallel_reads` neither
            None, AUTOTUNE nor positive.
        (when iterated) NotFoundError: A shard does not exist.
        (when iterated) DataLossError: A shard is not a tar file or is truncated or
            damaged; the message names the shard and the last member read.
        (when iterated) InvalidArgumentError: A sample has two files with one extension.
    """

    _op_name = _OP
    _is_splittable_source = True
    _fn_attrs = ("_decoders",)

    def __init__(
        self,
        urls_or_paths: Any,
        decode: bool = False,
        decoders: Mapping[str, Callable[[bytes], Any]] | None = None,
        ignore_errors: bool = False,
        num_parallel_reads: int | None = None,
    ) -> None:
        names = _shard_names(urls_or_paths)
        for name in names:
            _for_url(name)
        if decoders is not None:
            if not isinstance(decoders, Mapping) or not all(
                isinstance(k, str) and callable(v) for k, v in decoders.items()
            ):
                raise TypeError(
                    f"{_OP}: `decoders` must map extensions (str) to functions, got {decoders!r}"
                )
            decoders = {k.lower().rsplit(".", 1)[-1]: v for k, v in decoders.items()}
        self._shards = names
        self._decode = bool(decode)
        self._decoders = dict(decoders) if decoders else None
        self._ignore_errors = bool(ignore_errors)
        parallelism(num_parallel_reads, _OP)  # checks it; resolved where it is read
        self._num_parallel_reads = num_parallel_reads

    def _user_functions(self) -> list[tuple[str, Callable[..., Any]]]:
        return [(f"decoder for {ext!r}", fn) for ext, fn in (self._decoders or {}).items()]

    @property
    def filenames(self) -> tuple[str, ...]:
        """The shards, in reading order."""
        return self._shards

    def _with_files(self, files: tuple[str, ...]) -> WebDataset:
        """A copy reading `files` (FILE sharding, `graph.with_source_files`)."""
        new = copy.copy(self)
        new._shards = tuple(files)
        return new

    def _compute_cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _split_provider(self, seed: int | None) -> SplitProvider:
        return FileSplitProvider(self._shards, shuffle=False)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        from dataservice.data.sources import _split_source, _splits  # see "Modules"

        source = _split_source(ctx, self._op_name)
        names: Iterator[Any] = iter(self._shards) if source is None else _splits(source)
        reads = parallelism(self._num_parallel_reads, _OP)
        if reads > 1:
            return interleave(names, self._shard_samples, reads, 1, parallel=True)
        return self._sequential(names)

    def _sequential(self, names: Iterator[Any]) -> Iterator[Element]:
        try:
            for name in names:
                samples = self._shard_samples(name)
                try:
                    yield from samples
                finally:
                    close_iterator(samples)
        finally:
            close_iterator(names)

    def _shard_samples(self, name: Any) -> Iterator[Element]:
        """The (decoded) samples of shard `name`; under `ignore_errors`, those read
        before a damage, with a warning."""
        shard = os.fsdecode(name)
        samples = _group(shard, _tar_files(_for_url(shard)))
        try:
            while True:
                try:
                    sample = next(samples, None)
                except (NotFoundError, DataLossError, InvalidArgumentError) as e:
                    if not self._ignore_errors:
                        raise
                    log.warning("%s (ignore_errors: skipping the rest of it)", e)
                    return
                if sample is None:
                    return
                decoded = self._decoded(sample)
                if decoded is not None:
                    yield decoded
        finally:
            close_iterator(samples)

    def _decoded(self, sample: dict[str, Any]) -> dict[str, Any] | None:
        """`sample` with its decoders applied; None if one failed under ignore_errors."""
        if not self._decode and not self._decoders:
            return sample
        out = {}
        for ext, value in sample.items():
            if ext.startswith("__"):
                out[ext] = value
                continue
            last = ext.rsplit(".", 1)[-1]
            fn = (self._decoders or {}).get(last)
            if fn is None and self._decode:
                fn = DEFAULT_DECODERS.get(last)
            if fn is None:
                out[ext] = value
                continue
            try:
                out[ext] = fn(value)
            except Exception as e:
                where = (
                    f"{_OP}: decoding {ext!r} of sample {sample['__key__']!r} in shard "
                    f"{sample['__url__']}"
                )
                if self._ignore_errors:
                    log.warning("%s failed (ignore_errors: skipping it): %r", where, e)
                    return None
                e.add_note(where)
                raise
        return out
