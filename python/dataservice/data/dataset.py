"""The lazy `Dataset` pipeline graph and its in-process semantics (tf.data's).

Owns the `Dataset` base class (its public API and the op surface every node
implements), `IterContext`, and the cardinality/`AUTOTUNE` constants.

A `Dataset` is an immutable node of a graph: sources (`sources.py`) at the leaves,
transformations (`ops.py`) above them. Nothing runs until it is iterated; every `iter(ds)` starts
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

Modules. The package `data/` is layered: `structure.py`, `arena.py`, `splits.py`,
`runtime.py` (threads) and `batching.py` know nothing of `Dataset`; this module
defines it; `ops.py` (transformations) and `sources.py` subclass it, as do
`batching_ops.py`, `mixing_ops.py`, `cache_ops.py` and `error_ops.py`, whose
methods `Dataset` inherits from `ops_api.MoreOpsMixin`; `graph.py` (the
walks and rewrites the service uses) and `static_sharding.py` sit on top. Because the
op classes subclass `Dataset`, `ops.py` and `sources.py` import this module, so the
constructors and transformation methods below import their op class when called
(each such import is marked `see "Modules" above`), as tf.data's `dataset_ops.py`
does with its op modules. Code outside `data/` reaches a pipeline's graph only
through `graph.py`, never through the `_`-names of this surface.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from dataservice.data import structure
from dataservice.data.ops_api import MoreOpsMixin
from dataservice.data.runtime import IterStats, close_iterator
from dataservice.data.splits import SplitProvider, SplitSource
from dataservice.errors import InvalidArgumentError

if TYPE_CHECKING:
    from dataservice.data.sources import TFRecordDataset  # noqa: F401

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "Dataset",
    "IterContext",
    "IterStats",
]

AUTOTUNE = -1
"""For `num_parallel_calls`, `cycle_length` and `prefetch`: let the library choose."""
INFINITE_CARDINALITY = -1
"""`cardinality()` of a dataset that never ends."""
UNKNOWN_CARDINALITY = -2
"""`cardinality()` of a dataset whose length is not known without running it."""


Element = Any


class RunEpochs:
    """How many iterators of each node one run (`IterContext.epoch`) made: the
    k in a seeded op's order (E, k). Keyed by the node object, weakly (a
    flat_map body's datasets come and go; an id could be reused)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # made on first use: most runs (one per exactly-once split) have no seeded shuffle
        self._counts: weakref.WeakKeyDictionary[Any, int] | None = None

    def next(self, node: Any, peek: bool) -> int:
        """The count of `node`'s iterators so far in this run; one more unless `peek`."""
        with self._lock:
            if self._counts is None:
                self._counts = weakref.WeakKeyDictionary()
            k = self._counts.get(node, 0)
            if not peek:
                self._counts[node] = k + 1
            return k


@dataclass(frozen=True, init=False)
class IterContext:
    """How an iterator is being run.

    Args:
        split_source: The one split source of a single-source pipeline; the same as
            `split_sources=(split_source,)`.
        peek: See the attribute.
        split_sources: See the attribute. Give either this or `split_source`.
        stats: See the attribute.
        error_sink: See the attribute.
        epoch: See the attribute.
        epoch_counts: Internal: shared by the contexts derived from one run.

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
        stats: The counters of the whole iterator tree (`IterStats`), or None:
            `ignore_errors` counts what it skipped there, and a data service read
            adds its `stats()`. Kept for user datasets and every input.
        error_sink: Set by `ignore_errors` for its input subtree (error_ops.py):
            `error_sink(op_name, error)` takes an exception an element-wise user
            function raised, and that element is skipped. None: exceptions propagate.
        epoch: None: a seeded op that reshuffles each iteration (`shuffle`,
            `list_files`, `sample_from_datasets`) takes its next order from the
            count of iterators made of its node object (tf.data's rule in one
            process). An int E: the run is epoch E of a service job (the
            iteration's repetition): the k-th iterator of a node within this run
            takes order (E, k), whatever the node object made before, so every
            worker, a restarted worker and a resumed read get the same orders
            (E = 0: those of a fresh object's first iteration).
        epoch_counts: The per-run iterator counts behind `epoch` (None without).

    Raises:
        ValueError: Both `split_source` and a different `split_sources` were given.
    """

    split_sources: tuple[SplitSource, ...] | None
    peek: bool
    stats: IterStats | None
    error_sink: Callable[[str, BaseException], None] | None
    epoch: int | None
    epoch_counts: RunEpochs | None

    def __init__(
        self,
        split_source: SplitSource | None = None,
        peek: bool = False,
        split_sources: tuple[SplitSource, ...] | None = None,
        stats: IterStats | None = None,
        error_sink: Callable[[str, BaseException], None] | None = None,
        epoch: int | None = None,
        epoch_counts: RunEpochs | None = None,
    ) -> None:
        sources = None if split_sources is None else tuple(split_sources)
        if split_source is not None:
            if sources is not None and sources != (split_source,):
                raise ValueError("IterContext: give split_source or split_sources, not both")
            sources = (split_source,)
        object.__setattr__(self, "split_sources", sources or None)
        object.__setattr__(self, "peek", bool(peek))
        object.__setattr__(self, "stats", stats)
        object.__setattr__(self, "error_sink", error_sink)
        object.__setattr__(self, "epoch", None if epoch is None else int(epoch))
        if epoch is not None and epoch_counts is None:
            epoch_counts = RunEpochs()
        object.__setattr__(self, "epoch_counts", epoch_counts)

    @property
    def split_source(self) -> SplitSource | None:
        """The first split source (the only one of a single-source pipeline), or None."""
        return None if self.split_sources is None else self.split_sources[0]

    def with_split_sources(self, split_sources: tuple[SplitSource, ...] | None) -> IterContext:
        """This context with `split_sources` instead (None: enumerate normally)."""
        return dataclasses.replace(self, split_sources=split_sources)

    def for_user_dataset(self) -> IterContext:
        """The context for a dataset built by a user function (flat_map/interleave
        bodies): never any split source (stats and error sink are kept)."""
        return dataclasses.replace(self, split_sources=None)

    def with_error_sink(self, sink: Callable[[str, BaseException], None] | None) -> IterContext:
        """This context whose element-wise user functions report a raised exception
        to `sink(op_name, error)` and skip that element (`ignore_errors`)."""
        return dataclasses.replace(self, error_sink=sink)


class Dataset(MoreOpsMixin):
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

    def _unseeded_randomness(self) -> str | None:
        """What makes this op's output differ between runs without a seed (its
        order or contents), as a message names it with the fix; None when it is
        the same in every process (graph.unseeded_random_ops)."""
        return None

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
        """A fresh epoch. The iterator has `close()`; dropping it stops its threads.
        For a pipeline with `ignore_errors`, or with ops after a data service read,
        it also has `stats()`: the service read's `stats()` keys (`elements`,
        `wait_ms`, ...), and `errors_ignored` counting the elements skipped so far
        (here and on the workers); with ops after a data service read, also
        `state_dict()` (see `load_state_dict`)."""
        stats = IterStats()
        it = self._make_iterator(IterContext(stats=stats))
        reads_service = self._op_name != "distribute" and self._has_op("distribute")
        if not self._has_op("ignore_errors") and not reads_service:
            return it
        from dataservice.data.error_ops import StatsIterator  # see "Modules" above

        error = (
            self._checkpoint_path()[1] if reads_service else "this pipeline reads no data service"
        )
        return StatsIterator(it, stats, error)

    # Ops after a data service read that hold no element between two next() calls and
    # read no further ahead than what they return: the read's position is theirs.
    _CHECKPOINT_OPS = frozenset({"map", "filter", "batch", "padded_batch", "ignore_errors", "take"})

    def _has_op(self, op_name: str) -> bool:
        """Whether this graph has an op named `op_name` ("distribute": it reads a
        data service; "ignore_errors": it counts skipped elements), cached per
        name: graphs are immutable."""
        cached = self.__dict__.setdefault("_t_has_op", {})
        if op_name not in cached:
            cached[op_name] = any(d._op_name == op_name for d in self._walk())
        return bool(cached[op_name])

    def _checkpoint_path(self) -> tuple[Any, str | None]:
        """The data service read whose position is this pipeline's, or None and
        why not (the op at fault)."""
        node: Dataset = self
        while node._op_name != "distribute":
            name = node._op_name
            parallel = getattr(node, "_num_parallel_calls", None)
            if name not in self._CHECKPOINT_OPS or parallel not in (None, 1):
                why = f"`{name}`" + (
                    f" with num_parallel_calls={parallel} reads ahead" if parallel else ""
                )
                return None, (
                    f"cannot checkpoint this pipeline: {why} after `distribute` holds or "
                    "reads ahead elements that next() has not returned, so the service "
                    "read's position is not the pipeline's. Ops after distribute that keep "
                    "it: sequential map and filter, batch, padded_batch, ignore_errors, "
                    "take; apply the others inside the distributed pipeline"
                )
            inputs = node._inputs()
            if len(inputs) != 1:
                return None, (
                    f"cannot checkpoint this pipeline: `{name}` combines {len(inputs)} inputs"
                )
            node = inputs[0]
        return node, None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """For a pipeline of ops after a data service read (see
        `_CHECKPOINT_OPS`): the next `iter()` continues where the iterator whose
        `state_dict()` gave `state` was, as `DistributedDataset.load_state_dict`.

        Raises:
            ValueError: The pipeline reads no data service, or an op after
                `distribute` reads ahead or holds elements (named).
            InvalidArgumentError: As `DistributedDataset.load_state_dict`.
        """
        if not self._has_op("distribute"):
            raise ValueError("load_state_dict: this pipeline reads no data service")
        node, error = self._checkpoint_path()
        if error is not None:
            raise ValueError(error)
        node.load_state_dict(state)

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
        from dataservice.data.sources import RangeDataset  # see "Modules" above

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
        from dataservice.data.sources import TensorSliceDataset  # see "Modules" above

        return TensorSliceDataset(value)

    @staticmethod
    def from_tensors(value: Any) -> Dataset:
        """A dataset with the single element `value` (lists become numpy arrays)."""
        from dataservice.data.sources import TensorDataset  # see "Modules" above

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
        from dataservice.data.sources import GeneratorDataset  # see "Modules" above

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
        from dataservice.data.sources import ListFilesDataset  # see "Modules" above

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
        from dataservice.data.ops import ZipDataset  # see "Modules" above

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
        from dataservice.data.ops import MapDataset  # see "Modules" above

        return MapDataset(self, map_func, num_parallel_calls, deterministic)

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """The elements for which `predicate` returns True (a scalar bool, numpy or not).

        Iterating raises InvalidArgumentError if the predicate returns anything else.
        """
        from dataservice.data.ops import FilterDataset  # see "Modules" above

        return FilterDataset(self, predicate)

    def flat_map(self, map_func: Callable[..., Dataset]) -> Dataset:
        """The elements of `map_func(element)` (a Dataset) for each element, in order."""
        from dataservice.data.ops import FlatMapDataset  # see "Modules" above

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
        from dataservice.data.ops import InterleaveDataset  # see "Modules" above

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
                structures, leaf shapes or leaf dtypes differ (as tf.data's batch: an
                int64 and a float32 leaf are refused, not cast to float64).
        """
        from dataservice.data.ops import BatchDataset  # see "Modules" above

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
        from dataservice.data.ops import ShuffleDataset  # see "Modules" above

        return ShuffleDataset(self, buffer_size, seed, reshuffle_each_iteration)

    def repeat(self, count: int | None = None) -> Dataset:
        """The input `count` times over (None or -1: forever).

        Repeating forever ends at the first epoch that yields nothing (so
        `range(0).repeat()` ends), unless that epoch's iterator has a truthy attribute
        `skip_empty_epoch`.
        """
        from dataservice.data.ops import RepeatDataset  # see "Modules" above

        return RepeatDataset(self, count)

    def take(self, count: int) -> Dataset:
        """The first `count` elements (-1: all)."""
        from dataservice.data.ops import TakeDataset  # see "Modules" above

        return TakeDataset(self, count)

    def skip(self, count: int) -> Dataset:
        """All but the first `count` elements (-1: skip everything)."""
        from dataservice.data.ops import SkipDataset  # see "Modules" above

        return SkipDataset(self, count)

    def enumerate(self, start: int = 0) -> Dataset:
        """Elements `(i, element)` with `i` an `int64[]` counting from `start`."""
        from dataservice.data.ops import EnumerateDataset  # see "Modules" above

        return EnumerateDataset(self, start)

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every `num_shards`-th element starting at `index`.

        Either argument may be `SHARD_HINT`: only ShardingPolicy.HINT on the service
        resolves it (num_shards = workers, index = worker index); iterating it
        in-process raises InvalidArgumentError.

        Raises:
            InvalidArgumentError: num_shards <= 0 or index not in [0, num_shards).
        """
        from dataservice.data.ops import ShardDataset  # see "Modules" above

        return ShardDataset(self, num_shards, index)

    def prefetch(self, buffer_size: int) -> Dataset:
        """Produces up to `buffer_size` elements ahead on a daemon thread (AUTOTUNE: 8;
        0: no prefetching). The thread stops when the iterator is closed or dropped."""
        from dataservice.data.ops import PrefetchDataset  # see "Modules" above

        return PrefetchDataset(self, buffer_size)

    def concatenate(self, dataset: Dataset) -> Dataset:
        """This dataset's elements, then `dataset`'s.

        Raises:
            TypeError: Both element specs are static and incompatible.
        """
        from dataservice.data.ops import ConcatenateDataset  # see "Modules" above

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
