"""Source datasets: range, from_tensor_slices, from_tensors, from_generator, list_files
and TFRecordDataset.

Splittable sources (everything but `from_generator`) also read DYNAMIC-sharding splits
from the split source that `IterContext.split_sources` routes to them (a 1-tuple once
it reaches a source; see "Split hooks" in dataset.py), and build the matching
dispatcher-side `SplitProvider` (see `splits.py` for what a split is for each).
"""

from __future__ import annotations

import copy
import glob
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np

from dataservice.data import structure
from dataservice.data.arena import BytesArena, arena_of
from dataservice.data.dataset import (
    AUTOTUNE,
    UNKNOWN_CARDINALITY,
    Dataset,
    Element,
    IterContext,
)
from dataservice.data.ops import as_index, node_epoch_rng, parallelism
from dataservice.data.runtime import close_iterator, interleave
from dataservice.data.splits import (
    FileSplitProvider,
    IndexSplitProvider,
    SplitProvider,
    SplitSource,
)
from dataservice.data.structure import TensorSpec, normalize_element
from dataservice.errors import InvalidArgumentError

__all__ = [
    "GeneratorDataset",
    "ListFilesDataset",
    "RangeDataset",
    "TFRecordDataset",
    "TensorDataset",
    "TensorSliceDataset",
]


def _split_source(ctx: IterContext, op: str) -> SplitSource | None:
    """The split source `ctx` gives this one splittable source, or None.

    Raises:
        InvalidArgumentError: `ctx` has several split sources (they were not routed).
    """
    sources = ctx.split_sources
    if sources is None:
        return None
    if len(sources) != 1:
        raise InvalidArgumentError(
            f"`{op}` is one splittable source but was given {len(sources)} split sources"
        )
    return sources[0]


def _splits(source: SplitSource) -> Iterator[Any]:
    """The splits handed out by `source`, until it returns None."""
    while True:
        split = source.get_next()
        if split is None:
            return
        yield split


def _index_batches(source: SplitSource, n: int, op: str) -> Iterator[np.ndarray] | None:
    """The splits of `source` as int64 arrays of indices in [0, n), a batch at a
    time, if `source` hands out batches (`get_next_batch`, as a worker's DYNAMIC
    split fetcher does); else None. Checked as `_split_index` checks one."""
    get_batch = getattr(source, "get_next_batch", None)
    if get_batch is None:
        return None

    def batches() -> Iterator[np.ndarray]:
        while True:
            batch = get_batch()
            if batch is None:
                return
            try:
                indices = np.asarray(batch, dtype=np.int64)
            except (TypeError, ValueError, OverflowError):
                for split in batch:  # names the offending split
                    _split_index(split, n, op)
                raise
            if indices.size and (indices.min() < 0 or indices.max() >= n):
                bad = int(indices[(indices < 0) | (indices >= n)][0])
                raise InvalidArgumentError(f"`{op}` got split {bad}, outside [0, {n})")
            yield indices

    return batches()


def _split_index(split: Any, n: int, op: str) -> int:
    try:
        i = int(split)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"`{op}` got a split {split!r} that is not an index") from None
    if not 0 <= i < n:
        raise InvalidArgumentError(f"`{op}` got split {i}, outside [0, {n})")
    return i


# ---------------------------------------------------------------------------- range


class RangeDataset(Dataset):
    """`Dataset.range(...)`: `np.int64` scalars. Split i is `start + i * step`."""

    _op_name = "range"
    _is_splittable_source = True

    def __init__(self, *args: int) -> None:
        if not 1 <= len(args) <= 3:
            raise InvalidArgumentError(
                f"range takes 1 to 3 arguments (stop | start, stop[, step]), got {len(args)}"
            )
        values = [as_index(a, "range argument") for a in args]
        if len(values) == 1:
            values = [0, values[0], 1]
        elif len(values) == 2:
            values.append(1)
        self._start, self._stop, self._step = values
        if self._step == 0:
            raise InvalidArgumentError("range: step must be a non-zero integer")

    def _len(self) -> int:
        return len(range(self._start, self._stop, self._step))

    def _compute_cardinality(self) -> int:
        return self._len()

    def _static_element_spec(self) -> Any:
        return TensorSpec((), np.int64)

    def _split_provider(self, seed: int | None) -> SplitProvider:
        return IndexSplitProvider(self._len())

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = _split_source(ctx, self._op_name)
        if source is not None:
            return self._from_splits(source)
        return self._all()

    def _all(self) -> Iterator[Element]:
        yield from map(np.int64, range(self._start, self._stop, self._step))

    def _from_splits(self, source: SplitSource) -> Iterator[Element]:
        n = self._len()
        batches = _index_batches(source, n, "range")
        if batches is not None:  # a batch at a time: no Python work per element
            for indices in batches:
                yield from indices * self._step + self._start  # np.int64 elements
            return
        for split in _splits(source):
            yield np.int64(self._start + _split_index(split, n, "range") * self._step)


# ---------------------------------------------------------------------------- tensors


def _to_array(value: Any) -> np.ndarray:
    """A list (or other array-like) as a numpy array; `bytes` lists as object arrays."""
    arr = np.asarray(value)
    if arr.dtype.kind == "S":  # numpy's bytes dtype strips trailing NULs: keep `bytes`
        obj = np.empty(arr.shape, dtype=object)
        obj[...] = value if isinstance(value, list | tuple) else arr.tolist()
        arr = obj
    return arr


def _to_tensor_nest(
    value: Any, leaf: Callable[[Any], Any], list_leaf: Callable[[list[Any]], Any] = _to_array
) -> Any:
    """`value` with lists turned into arrays (`list_leaf`) and `leaf` applied to other
    leaves."""
    if isinstance(value, list):
        return list_leaf(value)
    if isinstance(value, tuple | dict):
        children = [_to_tensor_nest(c, leaf, list_leaf) for c in structure._children(value)]
        return structure._sequence_like(value, children)
    return leaf(value)


def _slice_leaf(arr: np.ndarray, i: int) -> Any:
    row = arr[i]
    return row.copy() if isinstance(row, np.ndarray) else row


def _slice_nested(value: Any, i: int) -> Any:
    """Row `i` of every array (or arena) in the nest `value`, in the same structure."""
    if isinstance(value, np.ndarray):
        return _slice_leaf(value, i)
    if type(value) is BytesArena:
        return value[i]
    if type(value) is dict:
        return {k: _slice_nested(v, i) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(_slice_nested(v, i) for v in value)
    children = [_slice_nested(v, i) for v in structure._children(value)]
    return structure._sequence_like(value, children)


def _slice_spec(arr: np.ndarray | BytesArena) -> TensorSpec:
    if isinstance(arr, BytesArena):
        return TensorSpec((), arr.item_type)
    if arr.ndim == 1 and arr.dtype == object and arr.size:
        return structure._leaf_spec(arr[0])
    return TensorSpec(arr.shape[1:], arr.dtype)


class TensorSliceDataset(Dataset):
    """`Dataset.from_tensor_slices(value)`: one element per row. Split i is row i.

    A component that is a list of `bytes` (or a 1-D object array of `bytes` or of
    `str`) is held as a `BytesArena`, not as an object array: its items are in one
    buffer that goes out of band, shared by the workers of a host (CASES C-19).
    """

    _op_name = "from_tensor_slices"
    _is_splittable_source = True

    def __init__(self, value: Any) -> None:
        def leaf(x: Any) -> np.ndarray | BytesArena:
            arena = arena_of(x)
            if arena is not None:
                return arena
            return x if isinstance(x, np.ndarray) else _to_array(x)

        def list_leaf(x: list[Any]) -> np.ndarray | BytesArena:
            arena = arena_of(x)
            return arena if arena is not None else _to_array(x)

        value = _to_tensor_nest(value, leaf, list_leaf)
        leaves = structure.flatten(value)
        if not leaves:
            raise InvalidArgumentError("from_tensor_slices: the value has no components")
        sizes = []
        for k, arr in enumerate(leaves):
            if isinstance(arr, BytesArena):
                sizes.append(len(arr))
                continue
            if arr.ndim == 0:
                raise InvalidArgumentError(
                    f"from_tensor_slices: component {k} is a scalar ({arr!r}); slicing "
                    "needs rank >= 1"
                )
            sizes.append(arr.shape[0])
        if len(set(sizes)) != 1:
            raise InvalidArgumentError(
                "from_tensor_slices: all components must have the same size in the 0th "
                f"dimension, got sizes {sizes}"
            )
        self._value = value
        self._n = int(sizes[0])

    def _compute_cardinality(self) -> int:
        return self._n

    def _static_element_spec(self) -> Any:
        return structure.map_structure(_slice_spec, self._value)

    def _split_provider(self, seed: int | None) -> SplitProvider:
        return IndexSplitProvider(self._n)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = _split_source(ctx, self._op_name)
        if source is not None:
            indices: Iterator[int] = (
                _split_index(s, self._n, self._op_name) for s in _splits(source)
            )
        else:
            indices = iter(range(self._n))
        return self._rows(indices)

    def _rows(self, indices: Iterator[int]) -> Iterator[Element]:
        value = self._value
        if type(value) is BytesArena:  # a bare list of bytes: no nest to walk
            yield from map(value.__getitem__, indices)
            return
        for i in indices:
            yield _slice_nested(value, i)


def _tensor_leaf(x: Any) -> Any:
    if isinstance(x, np.ndarray | np.generic | bytes | str):
        return x
    if isinstance(x, bool | int | float | complex):
        return normalize_element(x)
    return np.asarray(x)


def _copy_leaf(x: Any) -> Any:
    return x.copy() if isinstance(x, np.ndarray) else x


class TensorDataset(Dataset):
    """`Dataset.from_tensors(value)`: the one element `value`. Its one split is 0."""

    _op_name = "from_tensors"
    _is_splittable_source = True

    def __init__(self, value: Any) -> None:
        self._value = _to_tensor_nest(value, _tensor_leaf)

    def _compute_cardinality(self) -> int:
        return 1

    def _static_element_spec(self) -> Any:
        return structure.spec_of(self._value)

    def _split_provider(self, seed: int | None) -> SplitProvider:
        return IndexSplitProvider(1)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = _split_source(ctx, self._op_name)
        if source is not None:
            return self._from_splits(source)
        return self._one()

    def _one(self) -> Iterator[Element]:
        yield structure.map_structure(_copy_leaf, self._value)

    def _from_splits(self, source: SplitSource) -> Iterator[Element]:
        for split in _splits(source):
            _split_index(split, 1, self._op_name)
            yield structure.map_structure(_copy_leaf, self._value)


# ---------------------------------------------------------------------------- generator


def _conform(signature: Any, value: Any) -> Any:
    """`value` converted to the nest of TensorSpec `signature`.

    Raises:
        InvalidArgumentError: The structure, a shape or a dtype does not fit.
    """
    if isinstance(signature, TensorSpec):
        if signature.dtype is bytes or signature.dtype is str:
            if not isinstance(value, signature.dtype):
                raise InvalidArgumentError(
                    f"expected {signature.dtype.__name__}, got {type(value).__name__}"
                )
            return cast(type, signature.dtype)(value)
        try:
            arr = np.asarray(value, dtype=signature.dtype)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"cannot convert {value!r} to {signature}: {e}") from e
        if not signature.is_compatible_with(TensorSpec(arr.shape, arr.dtype)):
            raise InvalidArgumentError(f"shape {arr.shape} does not fit {signature}")
        return arr[()] if arr.ndim == 0 else arr
    if isinstance(signature, dict):
        if not isinstance(value, dict) or set(value) != set(signature):
            raise InvalidArgumentError(f"expected a dict with keys {sorted(signature)}")
        children = [_conform(signature[k], value[k]) for k in structure._sorted_keys(signature)]
        return structure._sequence_like(signature, children)
    if isinstance(signature, tuple | list):
        if not isinstance(value, tuple | list) or len(value) != len(signature):
            raise InvalidArgumentError(f"expected a sequence of length {len(signature)}")
        children = [_conform(s, v) for s, v in zip(signature, value, strict=True)]
        return structure._sequence_like(signature, children)
    raise InvalidArgumentError(f"output_signature leaf {signature!r} is not a TensorSpec")


class GeneratorDataset(Dataset):
    """`Dataset.from_generator(generator, args)`: not splittable."""

    _op_name = "from_generator"
    _fn_attrs = ("_generator",)
    _split_unsupported_reason = " (a Python generator)"

    def __init__(
        self, generator: Callable[..., Any], args: Any = (), output_signature: Any = None
    ) -> None:
        if not callable(generator):
            raise TypeError(
                "`from_generator` expects a callable that returns an iterable (e.g. a "
                f"generator function), got {type(generator).__name__}: {generator!r}"
            )
        if output_signature is not None:
            for leaf in structure.flatten(output_signature):
                if not isinstance(leaf, TensorSpec):
                    raise TypeError(f"output_signature leaves must be TensorSpec, got {leaf!r}")
        self._generator = generator
        self._args = tuple(args) if isinstance(args, list | tuple) else (args,)
        self._output_signature = output_signature

    def _static_element_spec(self) -> Any:
        return self._output_signature

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        if ctx.split_sources is not None:
            raise InvalidArgumentError(
                "Cannot read splits: `from_generator` (a Python generator) has no split "
                "provider; use ShardingPolicy.OFF"
            )
        return self._generate()

    def _generate(self) -> Iterator[Element]:
        it = iter(self._generator(*self._args))
        signature = self._output_signature
        try:
            for element in it:
                if signature is None:
                    yield normalize_element(element)
                    continue
                try:
                    converted = _conform(signature, element)
                except InvalidArgumentError as e:
                    raise InvalidArgumentError(
                        f"`from_generator`: the generator yielded an element that does not "
                        f"match output_signature {signature}: {e}"
                    ) from None
                yield converted
        finally:
            close_iterator(it)


# ---------------------------------------------------------------------------- files


def _patterns(file_pattern: Any) -> tuple[str, ...]:
    if isinstance(file_pattern, str | bytes | os.PathLike):
        return (os.fsdecode(file_pattern),)
    if isinstance(file_pattern, list | tuple | np.ndarray):
        return tuple(os.fsdecode(p) for p in file_pattern)
    raise TypeError(f"Expected a file pattern or a list of them, got {type(file_pattern).__name__}")


class ListFilesDataset(Dataset):
    """`Dataset.list_files(...)`: file names as `str`, globbed at construction.

    Splits are file names; its provider shuffles with the dataset's seed, or the
    dispatcher's when the dataset has none.
    """

    _op_name = "list_files"
    _is_splittable_source = True

    def __init__(self, file_pattern: Any, shuffle: bool | None, seed: int | None) -> None:
        patterns = _patterns(file_pattern)
        files: list[str] = []
        for pattern in patterns:
            files.extend(sorted(glob.glob(pattern)))
        if not files:
            raise InvalidArgumentError(f"No files matched pattern: {', '.join(patterns)}")
        self._patterns = patterns
        self._files = tuple(files)
        self._shuffle = True if shuffle is None else bool(shuffle)
        self._seed = None if seed is None else as_index(seed, "seed")

    def _unseeded_randomness(self) -> str | None:
        if not self._shuffle or self._seed is not None or len(self._files) < 2:
            return None
        return (
            "list_files(shuffle=True) without a seed (fix: list_files(..., seed=...), "
            "or shuffle=False)"
        )

    @property
    def files(self) -> tuple[str, ...]:
        """The matched file names, unshuffled."""
        return self._files

    def _with_files(self, files: tuple[str, ...]) -> ListFilesDataset:
        """A copy reading `files` (FILE sharding, `graph.with_source_files`)."""
        new = copy.copy(self)
        new._files = files
        return new

    def _compute_cardinality(self) -> int:
        return len(self._files)

    def _static_element_spec(self) -> Any:
        return TensorSpec((), str)

    def _split_provider(self, seed: int | None) -> SplitProvider:
        return FileSplitProvider(
            self._files, self._shuffle, self._seed if self._seed is not None else seed
        )

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = _split_source(ctx, self._op_name)
        if source is not None:
            return (os.fsdecode(s) for s in _splits(source))
        if not self._shuffle:
            return (f for f in self._files)
        order = node_epoch_rng(self, self._seed, True, ctx).permutation(len(self._files))
        files = self._files
        return (files[i] for i in order)


_COMPRESSION_TYPES = {None: None, "": None, "GZIP": "GZIP", "ZLIB": "ZLIB"}


class TFRecordDataset(Dataset):
    """The records (`bytes`) of TFRecord files, read and CRC-checked in Rust.

    Args:
        filenames: A file name, a list of them, or a Dataset of file names (`str` or
            `bytes`) whose files are read in order (as tf.data).
        compression_type: None or "" (none), "GZIP" or "ZLIB".
        buffer_size: Accepted for tf.data compatibility; the reader buffers itself.
        num_parallel_reads: None or 1: files one after another. >1 or AUTOTUNE: that
            many files (CPU count) are read at once on daemon threads and their records
            interleaved one at a time (tf.data's order).

    Iterating raises `DataLossError` on a damaged record (naming file and offset).
    A list of file names is splittable (one split = one file name); with a Dataset of
    names the splits are that dataset's.

    Raises:
        TypeError: `filenames` is none of the above.
        ValueError: An unknown `compression_type`.
    """

    _op_name = "TFRecordDataset"
    _input_attrs = ("_input",)

    def __init__(
        self,
        filenames: Any,
        compression_type: str | None = None,
        buffer_size: int | None = None,
        num_parallel_reads: int | None = None,
    ) -> None:
        self._input: Dataset | None = None
        self._filenames: tuple[str, ...] | None = None
        if isinstance(filenames, Dataset):
            self._input = filenames
        elif isinstance(filenames, str | bytes | os.PathLike):
            self._filenames = (os.fsdecode(filenames),)
        elif isinstance(filenames, list | tuple | np.ndarray):
            self._filenames = tuple(os.fsdecode(f) for f in filenames)
        else:
            raise TypeError(
                "TFRecordDataset: `filenames` must be a str, a list of str or a Dataset of "
                f"file names, got {type(filenames).__name__}"
            )
        key = compression_type.upper() if isinstance(compression_type, str) else compression_type
        if key not in _COMPRESSION_TYPES:
            raise ValueError(
                "TFRecordDataset: compression_type must be None, '', 'GZIP' or 'ZLIB', got "
                f"{compression_type!r}"
            )
        self._compression_type = _COMPRESSION_TYPES[key]
        parallelism(num_parallel_reads, "TFRecordDataset")
        self._num_parallel_reads = num_parallel_reads

    @property
    def _is_splittable_source(self) -> bool:  # type: ignore[override]
        return self._input is None

    @property
    def _passes_splits(self) -> bool:  # type: ignore[override]
        return self._input is not None

    @property
    def filenames(self) -> tuple[str, ...] | None:
        """The file names given as a list, or None when they come from a Dataset."""
        return self._filenames

    def _with_files(self, files: tuple[str, ...]) -> TFRecordDataset:
        """A copy reading `files` (FILE sharding, `graph.with_source_files`)."""
        new = copy.copy(self)
        new._filenames = files
        return new

    def _compute_cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _static_element_spec(self) -> Any:
        return TensorSpec((), bytes)

    def _split_provider(self, seed: int | None) -> SplitProvider:
        if self._filenames is not None:
            return FileSplitProvider(self._filenames, shuffle=False)
        return super()._split_provider(seed)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        names: Iterator[Any]
        if self._input is not None:
            names = self._input._make_iterator(ctx)
        else:
            source = _split_source(ctx, self._op_name)
            if source is not None:
                names = _splits(source)
            else:
                assert self._filenames is not None
                names = iter(self._filenames)
        reads = self._num_parallel_reads
        if reads is not None and reads != 1:
            cycle = (os.cpu_count() or 1) if reads == AUTOTUNE else int(reads)
            return interleave(names, self._read, cycle, 1, parallel=True)
        return self._sequential(names)

    def _sequential(self, names: Iterator[Any]) -> Iterator[Element]:
        try:
            for name in names:
                records = self._read(name)
                try:
                    yield from records
                finally:
                    close_iterator(records)
        finally:
            close_iterator(names)

    def _read(self, name: Any) -> Iterator[bytes]:
        # The Rust extension (built by maturin) is imported only when a file is read.
        _core = importlib.import_module("dataservice._core")

        if isinstance(name, np.ndarray) and name.shape == ():
            name = name[()]
        if not isinstance(name, str | bytes | os.PathLike):
            raise InvalidArgumentError(
                f"TFRecordDataset: a file name must be a str or bytes, got {type(name).__name__}"
            )
        reader = _core.TFRecordReader(os.fsdecode(name), self._compression_type)
        try:
            yield from reader
        finally:
            close_iterator(reader)
