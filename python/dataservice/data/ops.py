"""The transformation ops of a pipeline: one `Dataset` subclass per tf.data transformation.

Owns the op classes that `Dataset`'s transformation methods build (`map`, `filter`,
`flat_map`, `interleave`, `batch`, `shuffle`, `repeat`, `take`, `skip`, `enumerate`,
`shard`, `prefetch`, `zip`, `concatenate`, and the client's `allow_pickled_elements`
marker), each implementing the op surface described in dataset.py's docstring
(`_make_iterator`, `_compute_cardinality`, `_static_element_spec`, split hooks), and the
argument checks and calling conventions they share with the sources (`sources.py`):
`as_index`, `parallelism`, `node_epoch_rng`. Threads are `runtime.py`'s. Walks and
rewrites of a whole graph are in `graph.py` and `static_sharding.py`. The other ops
have modules by concern: `batching_ops.py` (unbatch, padded_batch, rebatch, window,
bucket_by_sequence_length), `mixing_ops.py` (sample/choose_from_datasets),
`cache_ops.py`, `error_ops.py` (ignore_errors).

Op classes are pickled by reference (module path `dataservice.data.ops`) with the
pipeline, so a worker needs this same module layout, i.e. the same version; pipelines
pickled when these classes were in dataset.py still load (`serialize._MOVED_CLASSES`).
"""

from __future__ import annotations

import copy
import itertools
import operator
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from dataservice.data import structure
from dataservice.data.batching import batched_spec, stack
from dataservice.data.dataset import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
    Element,
    IterContext,
)
from dataservice.data.runtime import (
    SKIPPED,
    BackgroundIterator,
    close_iterator,
    guard,
    interleave,
    parallel_map,
)
from dataservice.data.splits import RepeatSplitProvider, SplitProvider, epoch_rng
from dataservice.data.structure import TensorSpec, normalize_element
from dataservice.errors import InvalidArgumentError
from dataservice.sharding import SHARD_HINT

__all__ = [
    "AllowPickledElementsDataset",
    "BatchDataset",
    "ConcatenateDataset",
    "EnumerateDataset",
    "FilterDataset",
    "FlatMapDataset",
    "InterleaveDataset",
    "MapDataset",
    "PrefetchDataset",
    "RepeatDataset",
    "ShardDataset",
    "ShuffleDataset",
    "SkipDataset",
    "TakeDataset",
    "ZipDataset",
    "as_index",
    "node_epoch_rng",
    "parallelism",
]

_AUTOTUNE_PREFETCH = 8  # elements buffered by prefetch(AUTOTUNE)

# ---------------------------------------------------------------------------- helpers


def _call(fn: Callable[..., Any], element: Element) -> Any:
    """tf.data's calling convention: a plain tuple is unpacked, anything else is one arg."""
    if type(element) is tuple:
        return fn(*element)
    return fn(element)


def as_index(value: Any, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}: {value!r}") from None


def _check_callable(fn: Any, op: str) -> None:
    if not callable(fn):
        raise TypeError(f"`{op}` expects a function, got {type(fn).__name__}: {fn!r}")


def parallelism(num_parallel_calls: int | None, op: str) -> int:
    """Threads to use: 1 (sequential) for None/1, CPU count for AUTOTUNE."""
    if num_parallel_calls is None:
        return 1
    n = as_index(num_parallel_calls, "num_parallel_calls")
    if n == AUTOTUNE:
        return max(os.cpu_count() or 1, 2)
    if n <= 0:
        raise InvalidArgumentError(
            f"`{op}`: num_parallel_calls must be positive or AUTOTUNE (-1), got {n}"
        )
    return n


def _as_bool(value: Any, op: str) -> bool:
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    arr = np.asarray(value)
    if arr.shape == () and arr.dtype == np.bool_:
        return bool(arr)
    raise InvalidArgumentError(
        f"The `{op}` predicate must return a scalar bool, got {type(value).__name__} "
        f"with shape {arr.shape} and dtype {arr.dtype}"
    )


def _as_dataset(value: Any, op: str) -> Dataset:
    if not isinstance(value, Dataset):
        raise TypeError(
            f"The function given to `{op}` must return a Dataset, got {type(value).__name__}"
        )
    return value


def node_epoch_rng(
    node: Dataset, seed: int | None, reshuffle: bool, ctx: IterContext
) -> np.random.Generator:
    """The RNG for the next epoch of a shuffling node, tf.data's seeding rules.

    seed given: reproducible; with `reshuffle` each new iterator of this node object
    (or, with `ctx.epoch`, of this node within the run: `IterContext.epoch`)
    gets the next epoch's order (a `ctx.peek` iterator reuses the next one without
    using it up), else every epoch has the same order. seed None: fresh randomness per
    iterator with `reshuffle`, else one random seed drawn on first use. The per-node
    state is transient (`_t_` attributes are never serialised).
    """
    if not reshuffle:
        if seed is None:
            seed = node.__dict__.setdefault("_t_fixed_seed", secrets.randbits(63))
        return epoch_rng(seed, 0)
    if seed is None:
        return epoch_rng(None, 0)
    if ctx.epoch is not None and ctx.epoch_counts is not None:
        # A service job's epoch: the same orders on every worker and on a resumed read.
        return epoch_rng(seed, ctx.epoch_counts.next(node, ctx.peek), ctx.epoch)
    state = node.__dict__.get("_t_epoch")
    if state is None:
        state = node.__dict__.setdefault("_t_epoch", [threading.Lock(), 0])
    with state[0]:
        epoch = state[1]
        if not ctx.peek:
            state[1] = epoch + 1
    return epoch_rng(seed, epoch)


# ------------------------------------------------------------ unary transformations


class _UnaryDataset(Dataset):
    """A transformation of one input whose splits flow through it."""

    _input_attrs = ("_input",)
    _passes_splits = True

    def __init__(self, input_dataset: Dataset) -> None:
        if not isinstance(input_dataset, Dataset):
            raise TypeError(f"Expected a Dataset, got {type(input_dataset).__name__}")
        self._input = input_dataset

    def _compute_cardinality(self) -> int:
        return self._input.cardinality()

    def _static_element_spec(self) -> Any:
        return self._input._static_element_spec()


class MapDataset(_UnaryDataset):
    _op_name = "map"
    _fn_attrs = ("_fn",)

    def __init__(
        self,
        input_dataset: Dataset,
        fn: Callable[..., Any],
        num_parallel_calls: int | None,
        deterministic: bool | None,
    ) -> None:
        super().__init__(input_dataset)
        _check_callable(fn, "map")
        parallelism(num_parallel_calls, "map")  # validate now
        self._fn = fn
        self._num_parallel_calls = None if num_parallel_calls is None else int(num_parallel_calls)
        self._deterministic = deterministic is None or bool(deterministic)

    def _static_element_spec(self) -> Any:
        return None

    def _unseeded_randomness(self) -> str | None:
        n = self._num_parallel_calls
        if self._deterministic or n is None or n == 1:
            return None
        return (
            f"map(num_parallel_calls={n}, deterministic=False) (its output order varies "
            "from run to run; fix: deterministic=True)"
        )

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        n = parallelism(self._num_parallel_calls, "map")
        fn = self._fn

        def call(element: Element) -> Element:
            return normalize_element(_call(fn, element))

        apply = guard(call, ctx.error_sink, "map")
        source = self._input._make_iterator(ctx)
        if n > 1:
            out = parallel_map(source, apply, n, self._deterministic)
            return out if ctx.error_sink is None else self._sequential(out, None)
        return self._sequential(source, apply)

    @staticmethod
    def _sequential(
        source: Iterator[Element], apply: Callable[[Element], Element] | None
    ) -> Iterator[Element]:
        """`apply` over `source` (None: as they are), less `SKIPPED` results."""
        try:
            for element in source:
                out = element if apply is None else apply(element)
                if out is not SKIPPED:
                    yield out
        finally:
            close_iterator(source)


class FilterDataset(_UnaryDataset):
    _op_name = "filter"
    _fn_attrs = ("_predicate",)

    def __init__(self, input_dataset: Dataset, predicate: Callable[..., Any]) -> None:
        super().__init__(input_dataset)
        _check_callable(predicate, "filter")
        self._predicate = predicate

    def _compute_cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = self._input._make_iterator(ctx)
        predicate = self._predicate
        keep = guard(lambda e: _as_bool(_call(predicate, e), "filter"), ctx.error_sink, "filter")
        try:
            for element in source:
                if keep(element) is True:
                    yield element
        finally:
            close_iterator(source)


class FlatMapDataset(_UnaryDataset):
    _op_name = "flat_map"
    _fn_attrs = ("_fn",)

    def __init__(self, input_dataset: Dataset, fn: Callable[..., Dataset]) -> None:
        super().__init__(input_dataset)
        _check_callable(fn, "flat_map")
        self._fn = fn

    def _compute_cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _static_element_spec(self) -> Any:
        return None

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = self._input._make_iterator(ctx)
        fn = self._fn
        user_ctx = ctx.for_user_dataset()
        open_fn = guard(
            lambda e: _as_dataset(_call(fn, e), "flat_map")._make_iterator(user_ctx),
            ctx.error_sink,
            "flat_map",
        )
        try:
            for element in source:
                inner = open_fn(element)
                if inner is SKIPPED:
                    continue
                try:
                    yield from inner
                except Exception as err:
                    if ctx.error_sink is None:
                        raise
                    ctx.error_sink("flat_map", err)  # ignore_errors: that body ends
                finally:
                    close_iterator(inner)
        finally:
            close_iterator(source)


class InterleaveDataset(_UnaryDataset):
    _op_name = "interleave"
    _fn_attrs = ("_fn",)

    def __init__(
        self,
        input_dataset: Dataset,
        fn: Callable[..., Dataset],
        cycle_length: int | None,
        block_length: int | None,
        num_parallel_calls: int | None,
        deterministic: bool | None,
    ) -> None:
        super().__init__(input_dataset)
        _check_callable(fn, "interleave")
        if cycle_length is not None:
            cycle_length = as_index(cycle_length, "cycle_length")
            if cycle_length <= 0 and cycle_length != AUTOTUNE:
                raise InvalidArgumentError(f"cycle_length must be > 0, got {cycle_length}")
        block_length = 1 if block_length is None else as_index(block_length, "block_length")
        if block_length <= 0:
            raise InvalidArgumentError(f"block_length must be > 0, got {block_length}")
        parallelism(num_parallel_calls, "interleave")
        self._fn = fn
        self._cycle_length = cycle_length
        self._block_length = block_length
        self._num_parallel_calls = num_parallel_calls
        self._deterministic = deterministic

    def _compute_cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _static_element_spec(self) -> Any:
        return None

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        cycle_length = self._cycle_length
        if cycle_length is None or cycle_length == AUTOTUNE:
            cycle_length = os.cpu_count() or 1
        fn = self._fn
        user_ctx = ctx.for_user_dataset()

        def open_dataset(element: Element) -> Iterator[Element]:
            return _as_dataset(_call(fn, element), "interleave")._make_iterator(user_ctx)

        guarded = guard(open_dataset, ctx.error_sink, "interleave")

        def open_fn(element: Element) -> Iterator[Element]:
            inner = guarded(element)
            return iter(()) if inner is SKIPPED else inner

        parallel = parallelism(self._num_parallel_calls, "interleave") > 1
        sink = ctx.error_sink
        return interleave(
            self._input._make_iterator(ctx),
            open_fn,
            cycle_length,
            self._block_length,
            parallel,
            None if sink is None else (lambda err: sink("interleave", err)),
        )


class BatchDataset(_UnaryDataset):
    _op_name = "batch"

    def __init__(self, input_dataset: Dataset, batch_size: int, drop_remainder: bool) -> None:
        super().__init__(input_dataset)
        batch_size = as_index(batch_size, "batch_size")
        if batch_size <= 0:
            raise InvalidArgumentError(f"Batch size must be greater than zero, got {batch_size}")
        self._batch_size = batch_size
        self._drop_remainder = bool(drop_remainder)

    def _compute_cardinality(self) -> int:
        n = self._input.cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        if self._drop_remainder:
            return n // self._batch_size
        return -(-n // self._batch_size)

    def _static_element_spec(self) -> Any:
        spec = self._input._static_element_spec()
        if spec is None:
            return None
        return batched_spec(spec, self._batch_size if self._drop_remainder else None)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = self._input._make_iterator(ctx)
        size = self._batch_size
        try:
            while True:
                chunk = list(itertools.islice(source, size))
                if not chunk or (self._drop_remainder and len(chunk) < size):
                    return
                yield stack(chunk)
                if len(chunk) < size:
                    return
        finally:
            close_iterator(source)


class ShuffleDataset(_UnaryDataset):
    _op_name = "shuffle"

    def __init__(
        self,
        input_dataset: Dataset,
        buffer_size: int,
        seed: int | None,
        reshuffle_each_iteration: bool,
    ) -> None:
        super().__init__(input_dataset)
        buffer_size = as_index(buffer_size, "buffer_size")
        if buffer_size <= 0:
            raise InvalidArgumentError(f"buffer_size must be greater than zero, got {buffer_size}")
        self._buffer_size = buffer_size
        self._seed = None if seed is None else as_index(seed, "seed")
        self._reshuffle = bool(reshuffle_each_iteration)

    def _unseeded_randomness(self) -> str | None:
        if self._seed is not None:
            return None
        return (
            f"shuffle(buffer_size={self._buffer_size}) without a seed (fix: "
            f"shuffle({self._buffer_size}, seed=...))"
        )

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        rng = node_epoch_rng(self, self._seed, self._reshuffle, ctx)
        return self._shuffled(self._input._make_iterator(ctx), rng)

    def _shuffled(self, source: Iterator[Element], rng: np.random.Generator) -> Iterator[Element]:
        buffer: list[Element] = []
        size = self._buffer_size
        exhausted = False
        uniforms = rng.random(256)
        u = 0
        try:
            while True:
                while not exhausted and len(buffer) < size:
                    try:
                        buffer.append(next(source))
                    except StopIteration:
                        exhausted = True
                if not buffer:
                    return
                if u == len(uniforms):
                    uniforms, u = rng.random(256), 0
                i = min(int(uniforms[u] * len(buffer)), len(buffer) - 1)
                u += 1
                element = buffer[i]
                buffer[i] = buffer[-1]
                buffer.pop()
                yield element
                del element
        finally:
            close_iterator(source)


class RepeatDataset(_UnaryDataset):
    _op_name = "repeat"

    def __init__(self, input_dataset: Dataset, count: int | None) -> None:
        super().__init__(input_dataset)
        count = None if count is None else as_index(count, "count")
        self._count = None if count is None or count < 0 else count

    def _compute_cardinality(self) -> int:
        n = self._input.cardinality()
        if self._count is None:
            return 0 if n == 0 else INFINITE_CARDINALITY
        if self._count == 0:
            return 0
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        return n * self._count

    def _split_provider(self, seed: int | None) -> SplitProvider:
        return RepeatSplitProvider(self._input._split_provider(seed), self._count)

    def _add_split_providers(self, seed: int | None, out: list[SplitProvider]) -> None:
        start = len(out)
        self._input._add_split_providers(seed, out)
        out[start:] = [RepeatSplitProvider(p, self._count) for p in out[start:]]

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        count = self._count
        epoch = 0
        while count is None or epoch < count:
            it = self._input._make_iterator(ctx)
            produced = False
            skip_empty = False
            try:
                for element in it:
                    produced = True
                    yield element
                skip_empty = bool(getattr(it, "skip_empty_epoch", False))
            finally:
                close_iterator(it)
            if count is None and not produced and not skip_empty:
                return  # tf.data: repeat() of an epoch without elements ends
            epoch += 1


class TakeDataset(_UnaryDataset):
    _op_name = "take"

    def __init__(self, input_dataset: Dataset, count: int) -> None:
        super().__init__(input_dataset)
        self._count = as_index(count, "count")

    def _compute_cardinality(self) -> int:
        n = self._input.cardinality()
        count = self._count
        if n == UNKNOWN_CARDINALITY:
            return UNKNOWN_CARDINALITY
        if n == INFINITE_CARDINALITY:
            return count if count >= 0 else INFINITE_CARDINALITY
        if count < 0:
            return n
        return min(n, count)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        count = self._count
        if count == 0:
            return
        source = self._input._make_iterator(ctx)
        try:
            if count < 0:
                yield from source
                return
            taken = 0
            for element in source:
                taken += 1
                yield element
                if taken >= count:
                    return
        finally:
            close_iterator(source)


class SkipDataset(_UnaryDataset):
    _op_name = "skip"

    def __init__(self, input_dataset: Dataset, count: int) -> None:
        super().__init__(input_dataset)
        self._count = as_index(count, "count")

    def _compute_cardinality(self) -> int:
        n = self._input.cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        return 0 if self._count < 0 else max(0, n - self._count)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = self._input._make_iterator(ctx)
        try:
            if self._count < 0:
                for _ in source:
                    pass
                return
            for _ in range(self._count):
                try:
                    next(source)
                except StopIteration:
                    return
            yield from source
        finally:
            close_iterator(source)


class EnumerateDataset(_UnaryDataset):
    _op_name = "enumerate"

    def __init__(self, input_dataset: Dataset, start: int) -> None:
        super().__init__(input_dataset)
        self._start = as_index(start, "start")

    def _static_element_spec(self) -> Any:
        spec = self._input._static_element_spec()
        if spec is None:
            return None
        return (TensorSpec((), np.int64), spec)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = self._input._make_iterator(ctx)
        try:
            for i, element in zip(itertools.count(self._start), source):
                yield (np.int64(i), element)
        finally:
            close_iterator(source)


class ShardDataset(_UnaryDataset):
    _op_name = "shard"

    def __init__(self, input_dataset: Dataset, num_shards: int, index: int) -> None:
        super().__init__(input_dataset)
        num_shards = as_index(num_shards, "num_shards")
        index = as_index(index, "index")
        if num_shards != SHARD_HINT and num_shards <= 0:
            raise InvalidArgumentError(f"num_shards must be > 0 (or SHARD_HINT), got {num_shards}")
        if index != SHARD_HINT and (
            index < 0 or (num_shards != SHARD_HINT and index >= num_shards)
        ):
            raise InvalidArgumentError(
                f"index must be in [0, num_shards) (or SHARD_HINT), got index={index}, "
                f"num_shards={num_shards}"
            )
        self._num_shards = num_shards
        self._index = index

    @property
    def _has_hint(self) -> bool:
        return SHARD_HINT in (self._num_shards, self._index)

    def _compute_cardinality(self) -> int:
        n = self._input.cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY) or self._has_hint:
            return n if not self._has_hint else UNKNOWN_CARDINALITY
        return n // self._num_shards + (1 if self._index < n % self._num_shards else 0)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        if self._has_hint:
            raise InvalidArgumentError(
                "shard(SHARD_HINT, ...) is a placeholder that only the data service's "
                "ShardingPolicy.HINT resolves (to the number of workers and the worker "
                "index); it cannot be iterated in-process. Use concrete num_shards/index."
            )
        source = self._input._make_iterator(ctx)
        n, index = self._num_shards, self._index
        try:
            for i, element in enumerate(source):
                if i % n == index:
                    yield element
        finally:
            close_iterator(source)


class PrefetchDataset(_UnaryDataset):
    _op_name = "prefetch"

    def __init__(self, input_dataset: Dataset, buffer_size: int) -> None:
        super().__init__(input_dataset)
        buffer_size = as_index(buffer_size, "buffer_size")
        if buffer_size < 0 and buffer_size != AUTOTUNE:
            raise InvalidArgumentError(
                f"buffer_size must be >= 0 or AUTOTUNE (-1), got {buffer_size}"
            )
        self._buffer_size = buffer_size

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = self._input._make_iterator(ctx)
        if self._buffer_size == 0:
            return source
        size = _AUTOTUNE_PREFETCH if self._buffer_size == AUTOTUNE else self._buffer_size
        return BackgroundIterator(source, size, "prefetch")


class AllowPickledElementsDataset(_UnaryDataset):
    """Its input's elements, which may hold leaves that are not numpy values
    (a dataclass instance, a set, a PIL image): the service pickles those
    instead of refusing them. Added by `distribute(..., allow_pickled_elements=True)`
    and `register_dataset(..., allow_pickled_elements=True)`; being part of the
    graph, it travels to the workers and changes the dataset's fingerprint."""

    _op_name = "allow_pickled_elements"

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        return self._input._make_iterator(ctx)


# ------------------------------------------------------------ several inputs


class ZipDataset(Dataset):
    """`Dataset.zip(datasets)`: tuples (nests) of one element of each input.

    Under DYNAMIC sharding each input's splittable sources read their own split
    providers, so on a worker element k pairs the k-th element of each input *on that
    worker*: inputs are not aligned by split index across workers (tf.data service's
    rule). It ends when any input ends. A worker takes the inputs' splits in joint
    grants (the same count of each; `worker.splits.JointSplitFetch`), so inputs with
    the same number of splits run out together on every worker and each element of
    each input is produced once; of inputs with more splits, the excess is dropped
    (as a local zip drops the longer input's tail, but not necessarily its tail).
    """

    _op_name = "zip"
    _passes_splits = True

    def __init__(self, datasets: Any) -> None:
        flat = structure.flatten(datasets)
        if not flat or not all(isinstance(d, Dataset) for d in flat):
            raise TypeError(
                "`zip` expects Datasets or a (nested) tuple/dict of Datasets, got "
                f"{structure._structure_repr(datasets)} with leaves "
                f"{[type(d).__name__ for d in flat]}"
            )
        self._structure = datasets

    def _inputs(self) -> list[Dataset]:
        return structure.flatten(self._structure)

    def _with_inputs(self, inputs: list[Dataset]) -> Dataset:
        new = copy.copy(self)
        new._structure = structure.pack_sequence_as(self._structure, inputs)
        return new

    def _compute_cardinality(self) -> int:
        result = INFINITE_CARDINALITY
        for d in self._inputs():
            n = d.cardinality()
            if n == UNKNOWN_CARDINALITY:
                return UNKNOWN_CARDINALITY
            if n != INFINITE_CARDINALITY and (result == INFINITE_CARDINALITY or n < result):
                result = n
        return result

    def _static_element_spec(self) -> Any:
        specs = [d._static_element_spec() for d in self._inputs()]
        if any(s is None for s in specs):
            return None
        return structure.pack_sequence_as(self._structure, specs)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        inputs = self._inputs()
        contexts = self._route_contexts(inputs, ctx)
        iterators = [d._make_iterator(c) for d, c in zip(inputs, contexts, strict=True)]
        try:
            while True:
                values = []
                for it in iterators:
                    try:
                        values.append(next(it))
                    except StopIteration:
                        return
                yield structure.pack_sequence_as(self._structure, values)
        finally:
            for it in iterators:
                close_iterator(it)


class ConcatenateDataset(Dataset):
    """`a.concatenate(b)`: all of a, then all of b.

    Under DYNAMIC sharding a's sources and b's sources read their own split providers
    (a's first in split-source order): a worker reads a's splits until a's providers
    run dry, then b's.
    """

    _op_name = "concatenate"
    _input_attrs = ("_input", "_other")
    _passes_splits = True

    def __init__(self, input_dataset: Dataset, other: Dataset) -> None:
        if not isinstance(other, Dataset):
            raise TypeError(f"`concatenate` expects a Dataset, got {type(other).__name__}")
        self._input = input_dataset
        self._other = other
        a, b = input_dataset._static_element_spec(), other._static_element_spec()
        if a is not None and b is not None and _common_spec(a, b) is None:
            raise TypeError(f"Incompatible dataset elements for `concatenate`: {a} and {b}")

    def _compute_cardinality(self) -> int:
        n1, n2 = self._input.cardinality(), self._other.cardinality()
        if INFINITE_CARDINALITY in (n1, n2):
            return INFINITE_CARDINALITY
        if UNKNOWN_CARDINALITY in (n1, n2):
            return UNKNOWN_CARDINALITY
        return n1 + n2

    def _static_element_spec(self) -> Any:
        a, b = self._input._static_element_spec(), self._other._static_element_spec()
        if a is None or b is None:
            return None
        return _common_spec(a, b)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        inputs = [self._input, self._other]
        for d, c in zip(inputs, self._route_contexts(inputs, ctx), strict=True):
            it = d._make_iterator(c)
            try:
                yield from it
            finally:
                close_iterator(it)


def _common_spec(a: Any, b: Any) -> Any:
    """The most specific spec both nests fit, or None if they are incompatible."""
    try:
        structure.assert_same_structure(a, b)
    except InvalidArgumentError:
        return None
    merged = []
    for x, y in zip(structure.flatten(a), structure.flatten(b), strict=True):
        m = x.most_specific_common_supertype(y)
        if m is None:
            return None
        merged.append(m)
    return structure.pack_sequence_as(a, merged)
