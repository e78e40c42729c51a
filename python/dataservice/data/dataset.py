"""The lazy `Dataset` pipeline graph and its in-process semantics (tf.data's).

A `Dataset` is an immutable node of a graph: sources (`sources.py`) at the leaves,
transformations above them. Nothing runs until it is iterated; every `iter(ds)` starts
a fresh epoch. Pipelines are plain Python, serialised with cloudpickle
(`serialize.py`) and run unchanged on workers.

What a node implements (the abstract surface; everything else is derived):

* `_make_iterator(ctx: IterContext) -> Iterator` (required): a fresh iterator over
  one epoch. Iterators have `close()`; closing or dropping one stops any thread it
  started. A node passes `ctx` on to the iterators of its `_inputs()`, and
  `ctx.for_user_dataset()` (never the split source) to datasets built by user
  functions (`flat_map`/`interleave` bodies).
* `_inputs() -> list[Dataset]`: the datasets this one reads from as inputs (not those
  created by user functions). Default: the attributes named in `_input_attrs`.
* `_op_name: str`: the op's name in messages, e.g. "map", "from_generator".
* `_compute_cardinality() -> int`: default `UNKNOWN_CARDINALITY`.
* `_static_element_spec() -> spec | None`: the element spec when it is known without
  running the pipeline; default None (then `element_spec` runs the pipeline for its
  first element), or the subclass's own `element_spec` if it overrides that property.

Split hooks (DYNAMIC sharding, see `splits.py`):

* Split sources are numbered in one fixed order, the *split-source order*: depth-first
  and pre-order from the root over split-passing edges, visiting a node's inputs in
  `_inputs()` order (for `a.concatenate(b)` all of a's sources before b's; for `zip`
  its inputs in `structure.flatten` order, dict keys sorted; `TFRecordDataset(ds)`:
  ds's). It is the order in which `_walk()` meets the splittable sources. Datasets
  built by user functions are not in the graph and never count.
* `_passes_splits`: the op lets the splits of its inputs through (unary ops, the input
  side of flat_map/interleave, both inputs of concatenate, every input of zip). An op
  that neither passes splits nor is a splittable source (`from_generator`,
  `distribute`, ...) makes the pipeline unsplittable.
* `IterContext.split_sources`: when set, the k-th splittable source in split-source
  order reads its splits from `split_sources[k]` instead of enumerating itself. The
  mapping is fixed by the graph: an op with several inputs (`_route_contexts`) gives
  each input the slice for its own sources, whether or not that input is iterated.
  `IterContext.split_source` is the one-source form (a 1-tuple).
* `_split_providers(seed) -> list[SplitProvider]`: the dispatcher-side providers, one
  per splittable source in split-source order, each wrapped for the `repeat`s above
  it; source k's provider is built with seed `seed + k` (None stays None), so the
  list is replayable from `seed`. `ValueError` naming the first op that has none.
  Sources build theirs in `_split_provider(seed)`; an op that changes the providers
  of the sources below it (`repeat`) overrides `_add_split_providers`.
* `_split_provider(seed) -> SplitProvider`: the single-source form (the one element of
  `_split_providers(seed)`); `ValueError` for a pipeline with several sources.
* `_num_split_sources()`: how many providers `_split_providers` builds, without
  building them (no globbing); the same `ValueError`.
* `_split_op_name` (default None: use `_op_name`) is the op name used in those errors.

Datasets are thread-safe (immutable; iterating one from several threads gives
independent epochs). Iterators are for one consumer thread.
"""

from __future__ import annotations

import copy
import itertools
import operator
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from dataservice.data import structure
from dataservice.data.runtime import BackgroundIterator, close_iterator, interleave, parallel_map
from dataservice.data.splits import RepeatSplitProvider, SplitProvider, SplitSource, epoch_rng
from dataservice.data.structure import TensorSpec, normalize_element
from dataservice.errors import InvalidArgumentError
from dataservice.sharding import SHARD_HINT

if TYPE_CHECKING:
    from dataservice.data.sources import TFRecordDataset  # noqa: F401

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "Dataset",
    "IterContext",
]

AUTOTUNE = -1
"""For `num_parallel_calls`, `cycle_length` and `prefetch`: let the library choose."""
INFINITE_CARDINALITY = -1
"""`cardinality()` of a dataset that never ends."""
UNKNOWN_CARDINALITY = -2
"""`cardinality()` of a dataset whose length is not known without running it."""

_AUTOTUNE_PREFETCH = 8  # elements buffered by prefetch(AUTOTUNE)
POLL_S = 0.05  # how often a blocked background thread checks whether it was stopped

Element = Any


@dataclass(frozen=True, init=False)
class IterContext:
    """How an iterator is being run.

    Args:
        split_source: The one split source of a single-source pipeline; the same as
            `split_sources=(split_source,)`.
        peek: See the attribute.
        split_sources: See the attribute. Give either this or `split_source`.

    Attributes:
        split_sources: None to enumerate sources normally. Otherwise one object per
            splittable source of the pipeline, in split-source order (module
            docstring), each with `get_next() -> split | None` (None: no more splits,
            may block): the k-th splittable source yields the elements of each split
            it pulls from `split_sources[k]`, instead of its own elements (DYNAMIC
            sharding on a worker). An empty tuple is stored as None.
        peek: True when the iterator is made only to look at the first element (to
            compute `element_spec`): seeded shuffles then do not use up an epoch, so
            asking for the spec does not change later orders. A dataset reading from
            elsewhere (e.g. a data service) may refuse to be peeked.

    Raises:
        ValueError: Both `split_source` and a different `split_sources` were given.
    """

    split_sources: tuple[SplitSource, ...] | None
    peek: bool

    def __init__(
        self,
        split_source: SplitSource | None = None,
        peek: bool = False,
        split_sources: tuple[SplitSource, ...] | None = None,
    ) -> None:
        sources = None if split_sources is None else tuple(split_sources)
        if split_source is not None:
            if sources is not None and sources != (split_source,):
                raise ValueError("IterContext: give split_source or split_sources, not both")
            sources = (split_source,)
        object.__setattr__(self, "split_sources", sources or None)
        object.__setattr__(self, "peek", bool(peek))

    @property
    def split_source(self) -> SplitSource | None:
        """The first split source (the only one of a single-source pipeline), or None."""
        return None if self.split_sources is None else self.split_sources[0]

    def with_split_sources(self, split_sources: tuple[SplitSource, ...] | None) -> IterContext:
        """This context with `split_sources` instead (None: enumerate normally)."""
        return IterContext(peek=self.peek, split_sources=split_sources)

    def for_user_dataset(self) -> IterContext:
        """The context for a dataset built by a user function (flat_map/interleave
        bodies): never any split source."""
        return IterContext(peek=self.peek)


# ---------------------------------------------------------------------------- helpers


def _call(fn: Callable[..., Any], element: Element) -> Any:
    """tf.data's calling convention: a plain tuple is unpacked, anything else is one arg."""
    if type(element) is tuple:
        return fn(*element)
    return fn(element)


def _index(value: Any, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}: {value!r}") from None


def _check_callable(fn: Any, op: str) -> None:
    if not callable(fn):
        raise TypeError(f"`{op}` expects a function, got {type(fn).__name__}: {fn!r}")


def _parallelism(num_parallel_calls: int | None, op: str) -> int:
    """Threads to use: 1 (sequential) for None/1, CPU count for AUTOTUNE."""
    if num_parallel_calls is None:
        return 1
    n = _index(num_parallel_calls, "num_parallel_calls")
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


def _stack_leaves(values: list[Any], component: int) -> Any:
    """Stacks one leaf of each element of a batch along a new axis 0."""
    first = values[0]
    if isinstance(first, np.ndarray):
        shape = first.shape
        for k, v in enumerate(values):
            vshape = getattr(v, "shape", None)
            if vshape != shape:
                raise InvalidArgumentError(
                    f"Cannot batch tensors with different shapes in component {component}. "
                    f"First element had shape {shape} and element {k} had shape {vshape}."
                )
        return np.stack(values)
    if isinstance(first, str | np.str_) and all(isinstance(v, str) for v in values):
        return np.array(values, dtype=str)
    if isinstance(first, np.generic | bool | int | float | complex):
        arr = np.array(values)
        if arr.ndim != 1:
            raise InvalidArgumentError(
                f"Cannot batch component {component}: its elements are not all scalars"
            )
        return arr
    arr = np.empty(len(values), dtype=object)  # bytes and other objects, kept as they are
    arr[:] = values
    return arr


def _stack(elements: list[Element]) -> Element:
    """Stacks a batch of elements leaf by leaf (leaves numbered in flatten order).

    Raises:
        InvalidArgumentError: The elements' structures or a leaf's shapes differ.
    """
    return _stack_nested(elements, [0])


def _stack_nested(elements: list[Element], component: list[int]) -> Element:
    first = elements[0]
    if not structure.is_nested(first):
        index = component[0]
        component[0] += 1
        return _stack_leaves(elements, index)
    kind = type(first)
    if isinstance(first, dict):
        keys = first.keys()
        for e in elements:
            if type(e) is not kind or e.keys() != keys:
                structure.assert_same_structure(first, e)
        by_key = {
            k: _stack_nested([e[k] for e in elements], component)
            for k in structure._sorted_keys(first)
        }
        if kind is dict:
            return {k: by_key[k] for k in first}
        return structure._sequence_like(first, [by_key[k] for k in sorted(by_key)])
    n = len(first)
    for e in elements:
        if type(e) is not kind or len(e) != n:
            structure.assert_same_structure(first, e)
    children = [_stack_nested([e[i] for e in elements], component) for i in range(n)]
    return structure._sequence_like(first, children)


def _batched_spec(spec: Any, batch_dim: int | None) -> Any:
    def leaf(s: TensorSpec) -> TensorSpec:
        dtype: Any = s.dtype
        if dtype is bytes:
            dtype = np.dtype(object)
        elif dtype is str:
            dtype = np.dtype(str)
        return TensorSpec((batch_dim, *s.shape), dtype)

    return structure.map_structure(leaf, spec)


def _node_epoch_rng(
    node: Dataset, seed: int | None, reshuffle: bool, ctx: IterContext
) -> np.random.Generator:
    """The RNG for the next epoch of a shuffling node, tf.data's seeding rules.

    seed given: reproducible; with `reshuffle` each new iterator of this node object
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
    state = node.__dict__.get("_t_epoch")
    if state is None:
        state = node.__dict__.setdefault("_t_epoch", [threading.Lock(), 0])
    with state[0]:
        epoch = state[1]
        if not ctx.peek:
            state[1] = epoch + 1
    return epoch_rng(seed, epoch)


class Dataset:
    """A lazy, serialisable input pipeline whose elements are numpy values.

    Build one with the static constructors (`range`, `from_tensor_slices`,
    `from_tensors`, `from_generator`, `list_files`, `zip`) or `TFRecordDataset`, chain
    transformations, and iterate: each `iter(ds)` is a fresh epoch.

    >>> ds = Dataset.range(6).map(lambda x: x * 2).filter(lambda x: x % 4 == 0)
    >>> [int(x) for x in ds]
    [0, 4, 8]
    >>> [b.tolist() for b in Dataset.range(5).batch(2)]
    [[0, 1], [2, 3], [4]]

    Thread-safe; its iterators are for one consumer thread.
    """

    _op_name: ClassVar[str] = "dataset"
    _split_op_name: ClassVar[str | None] = None
    _input_attrs: ClassVar[tuple[str, ...]] = ()  # attributes holding input Datasets
    _fn_attrs: ClassVar[tuple[str, ...]] = ()  # attributes holding user functions
    _passes_splits: ClassVar[bool] = False  # the splits of all inputs flow through this op
    _is_splittable_source: ClassVar[bool] = False
    _split_unsupported_reason: ClassVar[str] = ""

    # ------------------------------------------------------------ abstract surface

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        """A fresh iterator over one epoch (see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _make_iterator")

    def _inputs(self) -> list[Dataset]:
        """The datasets this one reads from (not those built by user functions)."""
        out = []
        for attr in self._input_attrs:
            value = getattr(self, attr, None)
            if value is not None:
                out.append(value)
        return out

    def _compute_cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _static_element_spec(self) -> Any:
        """The element spec if known without running the pipeline, else None."""
        if type(self).element_spec is not _BASE_ELEMENT_SPEC:  # a subclass knows its spec
            return self.element_spec
        return None

    # ------------------------------------------------------------ graph helpers

    def _walk(self) -> Iterator[Dataset]:
        """Yields this dataset, then its inputs' graphs depth-first, in `_inputs()` order."""
        yield self
        for d in self._inputs():
            yield from d._walk()

    def _splittable_source(self) -> Dataset | None:
        """The first splittable source reached through `_inputs()`, or None."""
        for node in self._walk():
            if node._is_splittable_source:
                return node
        return None

    def _has_splittable_source(self) -> bool:
        return self._splittable_source() is not None

    def _user_functions(self) -> list[tuple[str, Callable[..., Any]]]:
        """(attribute, function) for each user function this node holds."""
        out = []
        for attr in self._fn_attrs:
            fn = getattr(self, attr, None)
            if fn is not None:
                out.append((attr, fn))
        return out

    def _with_inputs(self, inputs: list[Dataset]) -> Dataset:
        """A shallow copy of this node reading from `inputs` instead (same order/count).

        Raises:
            ValueError: `inputs` has the wrong length.
        """
        names = [a for a in self._input_attrs if getattr(self, a, None) is not None]
        if len(inputs) != len(names):
            raise ValueError(f"`{self._op_name}` has {len(names)} inputs, {len(inputs)} were given")
        new = copy.copy(self)
        for attr, d in zip(names, inputs, strict=True):
            setattr(new, attr, d)
        return new

    def _map_graph(self, fn: Callable[[Dataset], Dataset]) -> Dataset:
        """Rebuilds the graph bottom-up, replacing each node `n` (with its inputs already
        rebuilt) by `fn(n)`; nodes whose inputs did not change are reused."""
        old = self._inputs()
        new = [d._map_graph(fn) for d in old]
        node = self
        if any(a is not b for a, b in zip(old, new, strict=True)):
            node = self._with_inputs(new)
        return fn(node)

    def _with_shard_hints_resolved(self, num_workers: int, worker_index: int) -> Dataset:
        """This graph with `SHARD_HINT` in `shard()` replaced: num_shards -> num_workers,
        index -> worker_index (ShardingPolicy.HINT on a worker)."""

        def resolve(node: Dataset) -> Dataset:
            if isinstance(node, ShardDataset) and node._has_hint:
                n = num_workers if node._num_shards == SHARD_HINT else node._num_shards
                i = worker_index if node._index == SHARD_HINT else node._index
                return ShardDataset(node._input, n, i)
            return node

        return self._map_graph(resolve)

    def _split_provider(self, seed: int | None) -> SplitProvider:
        """The dispatcher's provider of splits of this pipeline's one splittable source.

        Args:
            seed: Shuffles file order for `list_files` without its own seed; a given
                seed makes the provider replayable.
        Raises:
            ValueError: An op on the way to the source cannot be split (a message with
                "split" and the op's name, e.g. `from_generator`, `distribute`), or the
                pipeline has several splittable sources (naming the op that joins
                them, e.g. `concatenate`, `zip`; use `_split_providers`).
        """
        if self._passes_splits:
            inputs = self._inputs()
            if len(inputs) == 1:
                return inputs[0]._split_provider(seed)
            providers = self._split_providers(seed)
            if len(providers) == 1:
                return providers[0]
            name = self._split_op_name or self._op_name
            raise ValueError(
                f"Cannot split the pipeline with one split provider: `{name}` reads "
                f"{len(providers)} splittable sources (one split provider per source: "
                "_split_providers)"
            )
        raise self._no_split_provider_error()

    def _split_providers(self, seed: int | None) -> list[SplitProvider]:
        """The dispatcher's split providers: one per splittable source of this pipeline,
        in split-source order (module docstring), each wrapped for the `repeat`s above
        its source. Source k's provider gets seed `seed + k` (None for None), so the
        same `seed` rebuilds the same providers. A single-source pipeline gives
        `[self._split_provider(seed)]`.

        Args:
            seed: See `_split_provider`.
        Raises:
            ValueError: An op on the way to a source cannot be split (a message with
                "split" and the op's name, e.g. `from_generator`, `distribute`).
        """
        providers: list[SplitProvider] = []
        self._add_split_providers(seed, providers)
        return providers

    def _add_split_providers(self, seed: int | None, out: list[SplitProvider]) -> None:
        """Appends the providers of this subgraph's splittable sources to `out`, in
        split-source order; `len(out)` on entry is the index of its first source."""
        if self._is_splittable_source:
            out.append(self._split_provider(None if seed is None else seed + len(out)))
        elif self._passes_splits:
            for d in self._inputs():
                d._add_split_providers(seed, out)
        else:
            raise self._no_split_provider_error()

    def _num_split_sources(self) -> int:
        """`len(self._split_providers(seed))`, without building the providers.

        Raises:
            ValueError: As `_split_providers`.
        """
        if self._is_splittable_source:
            return 1
        if not self._passes_splits:
            raise self._no_split_provider_error()
        return sum(d._num_split_sources() for d in self._inputs())

    def _split_source_count(self) -> int:
        """The split sources this subgraph takes from an `IterContext`: its splittable
        sources reached through split-passing ops (0 below any other op)."""
        if self._is_splittable_source:
            return 1
        if not self._passes_splits:
            return 0
        return sum(d._split_source_count() for d in self._inputs())

    def _no_split_provider_error(self) -> ValueError:
        name = self._split_op_name or self._op_name
        reason = self._split_unsupported_reason
        if not reason and name == "distribute":
            reason = " (it reads from a data service)"
        return ValueError(
            f"Cannot split the pipeline for DYNAMIC sharding: `{name}`{reason} has no split "
            "provider; use ShardingPolicy.OFF"
        )

    def _route_contexts(self, inputs: list[Dataset], ctx: IterContext) -> list[IterContext]:
        """For several inputs: input i gets the slice of `ctx.split_sources` for its own
        splittable sources, in split-source order (None if it has none).

        Raises:
            InvalidArgumentError: `ctx` has a different number of split sources than
                the inputs have splittable sources.
        """
        sources = ctx.split_sources
        if sources is None:
            return [ctx] * len(inputs)
        counts = [d._split_source_count() for d in inputs]
        if sum(counts) != len(sources):
            raise InvalidArgumentError(
                f"`{self._op_name}` reads {sum(counts)} splittable sources but was given "
                f"{len(sources)} split sources"
            )
        out = []
        start = 0
        for n in counts:
            out.append(ctx.with_split_sources(sources[start : start + n] if n else None))
            start += n
        return out

    # ------------------------------------------------------------ serialization

    def __getstate__(self) -> dict[str, Any]:
        # Transient per-process state (`_t_*`: epoch counters, cached specs) is never
        # serialised, so equal pipelines serialise to equal bytes.
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_t_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # ------------------------------------------------------------ public surface

    def __iter__(self) -> Iterator[Element]:
        """A fresh epoch. The iterator has `close()`; dropping it stops its threads."""
        return self._make_iterator(IterContext())

    def as_numpy_iterator(self) -> Iterator[Element]:
        """Same as `iter(self)` (elements are numpy values already); for tf.data users."""
        return iter(self)

    def cardinality(self) -> int:
        """The number of elements, or `INFINITE_CARDINALITY` (-1) /
        `UNKNOWN_CARDINALITY` (-2), by tf.data's static propagation rules."""
        return self._compute_cardinality()

    def __len__(self) -> int:
        """The cardinality. Raises TypeError if it is infinite or unknown."""
        n = self.cardinality()
        if n == INFINITE_CARDINALITY:
            raise TypeError("The dataset is infinite.")
        if n == UNKNOWN_CARDINALITY:
            raise TypeError("The dataset length is unknown.")
        return n

    def __bool__(self) -> bool:
        return True

    @property
    def element_spec(self) -> Any:
        """The nested `TensorSpec(shape, dtype)` of each element.

        Computed statically where tf.data can (sources, `batch`, `zip`, ...); otherwise
        from the first element, by running the pipeline in-process once (cached).

        Raises:
            InvalidArgumentError: The spec is not static and the dataset is empty.
        """
        spec = self._static_element_spec()
        if spec is not None:
            return spec
        cached = self.__dict__.get("_t_element_spec")
        if cached is not None:
            return cached
        it = self._make_iterator(IterContext(peek=True))
        try:
            first = next(it)
        except StopIteration:
            raise InvalidArgumentError(
                f"Cannot infer the element_spec of this `{self._op_name}` dataset: its spec "
                "depends on its elements and it produced none"
            ) from None
        finally:
            close_iterator(it)
        spec = structure.spec_of(first)
        self.__dict__["_t_element_spec"] = spec
        return spec

    def __repr__(self) -> str:
        return f"<{type(self).__name__} op={self._op_name}>"

    # ------------------------------------------------------------ sources

    @staticmethod
    def range(*args: int) -> Dataset:
        """`range(stop)`, `range(start, stop)` or `range(start, stop, step)`.

        Returns:
            A dataset of `int64[]` scalars (`np.int64`), as Python's `range`. Splittable.
        Raises:
            InvalidArgumentError: `step` is 0, or not 1 to 3 arguments.
        """
        from dataservice.data.sources import RangeDataset

        return RangeDataset(*args)

    @staticmethod
    def from_tensor_slices(value: Any) -> Dataset:
        """The slices of `value` along axis 0, one element per row.

        Args:
            value: An array, or a tuple / dict / namedtuple nest of arrays, all with the
                same size n in axis 0. Python lists are turned into numpy arrays, except
                lists of `bytes`: these (and 1-D object arrays of `bytes` or of `str`)
                are held as one `uint8` buffer of the items plus their `int64`
                offsets (`arena.BytesArena`), whose elements are `bytes` (`str`).
        Returns:
            n elements shaped like `value` with axis 0 removed (e.g. `float32[h, w]` from
            `float32[n, h, w]`; 1-D leaves give numpy scalars). Each element is a copy of
            its row, never a view of `value`. Splittable.
        Raises:
            InvalidArgumentError: A leaf is a scalar, or sizes in axis 0 differ.

        With the data service, the arrays are not copied once per worker process. A
        contiguous numpy array of 1 MiB or more (`serialize.MIN_SHARED_BUFFER_BYTES`;
        any such array in the pipeline, e.g. one a `map` function captures) travels
        out of band when the dataset is registered, and the dispatcher keeps it in a
        file named by its SHA-256 (in `work_dir/dataset_buffers` with
        `fault_tolerant_mode`, else in a temporary directory deleted when the
        dispatcher stops). A worker on the dispatcher's host maps that file
        copy-on-write: its array is a view of page-cache pages shared by every worker
        process of the host (one copy in memory however many workers read it), which
        stays shared unless a pipeline writes into it; it is writable exactly when the
        array given here was. A worker on another host gets the bytes with the
        definition and holds its own copy. A list of `bytes` (e.g. encoded images) is
        shared the same way: its items and offsets are two such arrays. Smaller
        arrays, other object arrays and other Python objects are pickled with the
        definition and copied into each worker.
        """
        from dataservice.data.sources import TensorSliceDataset

        return TensorSliceDataset(value)

    @staticmethod
    def from_tensors(value: Any) -> Dataset:
        """A dataset with the single element `value` (lists become numpy arrays)."""
        from dataservice.data.sources import TensorDataset

        return TensorDataset(value)

    @staticmethod
    def from_generator(
        generator: Callable[..., Any], args: Any = (), output_signature: Any = None
    ) -> Dataset:
        """The elements yielded by `generator(*args)`, called anew for each epoch.

        Args:
            generator: A callable returning an iterable (e.g. a generator function).
                Pickled with the pipeline, so it must not capture unpicklable state.
            args: Positional arguments for `generator`.
            output_signature: Optional nest of `TensorSpec`: each element is converted
                to it (`np.asarray(leaf, dtype)`) and checked; also gives a static
                `element_spec`. Without it, Python scalars become numpy scalars.
        Returns:
            A dataset that is not splittable (ShardingPolicy.OFF only).
        Raises:
            TypeError: `generator` is not callable.
        """
        from dataservice.data.sources import GeneratorDataset

        return GeneratorDataset(generator, args, output_signature)

    @staticmethod
    def list_files(
        file_pattern: str | list[str] | tuple[str, ...],
        shuffle: bool | None = None,
        seed: int | None = None,
    ) -> Dataset:
        """The file names (`str`) matching glob pattern(s), globbed now.

        Args:
            file_pattern: A glob pattern or a list of them.
            shuffle: None or True: a new random order in each epoch (as tf.data);
                False: sorted per pattern, patterns in the order given.
            seed: Makes the shuffled orders reproducible.
        Returns:
            A splittable dataset, one split per file.
        Raises:
            InvalidArgumentError: No file matched; the message names the pattern(s).
        """
        from dataservice.data.sources import ListFilesDataset

        return ListFilesDataset(file_pattern, shuffle, seed)

    @staticmethod
    def zip(*datasets: Any) -> Dataset:
        """Elements of several datasets side by side: `zip(a, b)` or `zip((a, {"x": c}))`.

        Args:
            datasets: Datasets, or one tuple / dict / namedtuple nest of datasets (a list
                is taken as a tuple).
        Returns:
            Elements shaped like that nest, holding one element of each input; it ends
            with the shortest input.
        Raises:
            TypeError: A leaf of the nest is not a Dataset.
        """
        if len(datasets) == 1 and not isinstance(datasets[0], Dataset):
            nest = datasets[0]
            if type(nest) is list:
                nest = tuple(nest)
        else:
            nest = tuple(datasets)
        return ZipDataset(nest)

    # ------------------------------------------------------------ transformations

    def map(
        self,
        map_func: Callable[..., Any],
        num_parallel_calls: int | None = None,
        deterministic: bool | None = True,
    ) -> Dataset:
        """`map_func` applied to each element (`map_func(*element)` for a tuple).

        Args:
            num_parallel_calls: None or 1: call in the iterating thread. >1 or AUTOTUNE
                (-1): up to that many (CPU count) calls at once on daemon threads.
            deterministic: With parallel calls, keep input order (default); False
                yields results as they finish.
        Returns:
            A dataset of the function's results (Python scalars become numpy scalars).
        Raises:
            TypeError: `map_func` is not callable.
            InvalidArgumentError: `num_parallel_calls` is 0 or below -1.
        """
        return MapDataset(self, map_func, num_parallel_calls, deterministic)

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """The elements for which `predicate` returns True (a scalar bool, numpy or not).

        Iterating raises InvalidArgumentError if the predicate returns anything else.
        """
        return FilterDataset(self, predicate)

    def flat_map(self, map_func: Callable[..., Dataset]) -> Dataset:
        """The elements of `map_func(element)` (a Dataset) for each element, in order."""
        return FlatMapDataset(self, map_func)

    def interleave(
        self,
        map_func: Callable[..., Dataset],
        cycle_length: int | None = None,
        block_length: int | None = 1,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
    ) -> Dataset:
        """Interleaves the datasets `map_func(element)`, tf.data's cycle/block order.

        `cycle_length` inputs are open at once; `block_length` consecutive elements are
        taken from each in turn; an exhausted one is replaced (in its slot) by the next
        input element's dataset.

        Args:
            cycle_length: None or AUTOTUNE: the number of CPUs.
            block_length: None means 1.
            num_parallel_calls: >1 or AUTOTUNE: every open dataset runs ahead on its own
                daemon thread (at most `cycle_length` threads). The order is unchanged.
            deterministic: Accepted for tf.data compatibility; the order is always
                deterministic.
        Raises:
            InvalidArgumentError: cycle_length or block_length <= 0 (other than AUTOTUNE).
        """
        return InterleaveDataset(
            self, map_func, cycle_length, block_length, num_parallel_calls, deterministic
        )

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Consecutive elements stacked into batches along a new axis 0.

        Each leaf becomes an array `dtype[batch_size, ...]`: numeric leaves with
        `np.stack`, `str` leaves a numpy str array, `bytes` (and other objects) an object
        array. The last batch is smaller unless `drop_remainder` drops it.

        Raises:
            InvalidArgumentError: `batch_size` <= 0; while iterating, elements whose
                structures or leaf shapes differ.
        """
        return BatchDataset(self, batch_size, drop_remainder)

    def shuffle(
        self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True
    ) -> Dataset:
        """Randomly shuffled elements, tf.data's buffer algorithm.

        A buffer of `buffer_size` elements is filled; each output is a uniformly chosen
        buffer element, whose slot is refilled from the input. Output k is therefore
        one of the first k + buffer_size input elements.

        Args:
            seed: None: fresh randomness for every iterator. Given: reproducible orders
                (with `reshuffle_each_iteration`, epoch e of this dataset object has
                its own order, the same in every run).
            reshuffle_each_iteration: False: every epoch has the same order.
        Raises:
            InvalidArgumentError: `buffer_size` <= 0.
        """
        return ShuffleDataset(self, buffer_size, seed, reshuffle_each_iteration)

    def repeat(self, count: int | None = None) -> Dataset:
        """The input `count` times over (None or -1: forever).

        Repeating forever ends at the first epoch that yields nothing (so
        `range(0).repeat()` ends), unless that epoch's iterator has a truthy attribute
        `skip_empty_epoch`.
        """
        return RepeatDataset(self, count)

    def take(self, count: int) -> Dataset:
        """The first `count` elements (-1: all)."""
        return TakeDataset(self, count)

    def skip(self, count: int) -> Dataset:
        """All but the first `count` elements (-1: skip everything)."""
        return SkipDataset(self, count)

    def enumerate(self, start: int = 0) -> Dataset:
        """Elements `(i, element)` with `i` an `int64[]` counting from `start`."""
        return EnumerateDataset(self, start)

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every `num_shards`-th element starting at `index`.

        Either argument may be `SHARD_HINT`: only ShardingPolicy.HINT on the service
        resolves it (num_shards = workers, index = worker index); iterating it
        in-process raises InvalidArgumentError.

        Raises:
            InvalidArgumentError: num_shards <= 0 or index not in [0, num_shards).
        """
        return ShardDataset(self, num_shards, index)

    def prefetch(self, buffer_size: int) -> Dataset:
        """Produces up to `buffer_size` elements ahead on a daemon thread (AUTOTUNE: 8;
        0: no prefetching). The thread stops when the iterator is closed or dropped."""
        return PrefetchDataset(self, buffer_size)

    def concatenate(self, dataset: Dataset) -> Dataset:
        """This dataset's elements, then `dataset`'s.

        Raises:
            TypeError: Both element specs are static and incompatible.
        """
        return ConcatenateDataset(self, dataset)

    def apply(self, transformation_func: Callable[[Dataset], Dataset]) -> Dataset:
        """`transformation_func(self)`, which must return a Dataset (else TypeError)."""
        result = transformation_func(self)
        if not isinstance(result, Dataset):
            raise TypeError(
                f"`apply` expects a function returning a Dataset, got {type(result).__name__}"
            )
        return result


_BASE_ELEMENT_SPEC = Dataset.__dict__["element_spec"]


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
        _parallelism(num_parallel_calls, "map")  # validate now
        self._fn = fn
        self._num_parallel_calls = None if num_parallel_calls is None else int(num_parallel_calls)
        self._deterministic = deterministic is None or bool(deterministic)

    def _static_element_spec(self) -> Any:
        return None

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        n = _parallelism(self._num_parallel_calls, "map")
        fn = self._fn

        def apply(element: Element) -> Element:
            return normalize_element(_call(fn, element))

        source = self._input._make_iterator(ctx)
        if n > 1:
            return parallel_map(source, apply, n, self._deterministic)
        return self._sequential(source, apply)

    @staticmethod
    def _sequential(
        source: Iterator[Element], apply: Callable[[Element], Element]
    ) -> Iterator[Element]:
        try:
            for element in source:
                yield apply(element)
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
        try:
            for element in source:
                if _as_bool(_call(predicate, element), "filter"):
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
        try:
            for element in source:
                inner = _as_dataset(_call(fn, element), "flat_map")._make_iterator(user_ctx)
                try:
                    yield from inner
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
            cycle_length = _index(cycle_length, "cycle_length")
            if cycle_length <= 0 and cycle_length != AUTOTUNE:
                raise InvalidArgumentError(f"cycle_length must be > 0, got {cycle_length}")
        block_length = 1 if block_length is None else _index(block_length, "block_length")
        if block_length <= 0:
            raise InvalidArgumentError(f"block_length must be > 0, got {block_length}")
        _parallelism(num_parallel_calls, "interleave")
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

        def open_fn(element: Element) -> Iterator[Element]:
            return _as_dataset(_call(fn, element), "interleave")._make_iterator(user_ctx)

        parallel = _parallelism(self._num_parallel_calls, "interleave") > 1
        return interleave(
            self._input._make_iterator(ctx), open_fn, cycle_length, self._block_length, parallel
        )


class BatchDataset(_UnaryDataset):
    _op_name = "batch"

    def __init__(self, input_dataset: Dataset, batch_size: int, drop_remainder: bool) -> None:
        super().__init__(input_dataset)
        batch_size = _index(batch_size, "batch_size")
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
        return _batched_spec(spec, self._batch_size if self._drop_remainder else None)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = self._input._make_iterator(ctx)
        size = self._batch_size
        try:
            while True:
                chunk = list(itertools.islice(source, size))
                if not chunk or (self._drop_remainder and len(chunk) < size):
                    return
                yield _stack(chunk)
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
        buffer_size = _index(buffer_size, "buffer_size")
        if buffer_size <= 0:
            raise InvalidArgumentError(f"buffer_size must be greater than zero, got {buffer_size}")
        self._buffer_size = buffer_size
        self._seed = None if seed is None else _index(seed, "seed")
        self._reshuffle = bool(reshuffle_each_iteration)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        rng = _node_epoch_rng(self, self._seed, self._reshuffle, ctx)
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
        count = None if count is None else _index(count, "count")
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
        self._count = _index(count, "count")

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
        self._count = _index(count, "count")

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
        self._start = _index(start, "start")

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
        num_shards = _index(num_shards, "num_shards")
        index = _index(index, "index")
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
        buffer_size = _index(buffer_size, "buffer_size")
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


def allows_pickled_elements(dataset: Dataset) -> bool:
    """Whether `dataset`'s graph opted in to elements that are not numpy values."""
    return any(isinstance(d, AllowPickledElementsDataset) for d in dataset._walk())


# ------------------------------------------------------------ several inputs


class ZipDataset(Dataset):
    """`Dataset.zip(datasets)`: tuples (nests) of one element of each input.

    Under DYNAMIC sharding each input's splittable sources read their own split
    providers, so on a worker element k pairs the k-th element of each input *on that
    worker*: inputs are not aligned by split index across workers (tf.data service's
    rule). It ends when any input ends; the other inputs' splits already taken by that
    worker are not seen again in this epoch.
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
