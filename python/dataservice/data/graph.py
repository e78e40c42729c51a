"""Walking a pipeline graph and running it with splits: the interface the service uses.

The dispatcher, the worker and the client reach a `Dataset`'s graph only through this
module and `static_sharding.py` (the rewrites of a static `ShardingPolicy`), never
through the `_`-names of the op surface (dataset.py's docstring), so that surface can
change without touching the service.

Owns:

* walking a graph (`walk`) and rebuilding it bottom-up (`map_graph`);
* the file sources of a graph (`file_sources`, `source_files`, `with_source_files`):
  `list_files`, `TFRecordDataset` of file names, `ParquetDataset` and `WebDataset`,
  the nodes FILE sharding rewrites;
* DYNAMIC sharding's two ends: the dispatcher's split providers (`num_split_sources`,
  `split_providers`) and a worker's iterator reading splits (`make_iterator`);
* what the client needs before registering a pipeline (`static_element_spec`,
  `check_splittable`, `unseeded_random_ops`), and whether a pipeline opted in to
  elements that are not numpy values (`allows_pickled_elements`, read by the worker).

Every function is thread-safe and leaves the `Dataset` it is given unchanged (a rewrite
returns a new graph, sharing the nodes it did not change).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from dataservice.data.dataset import Dataset, IterContext, IterStats
from dataservice.data.ops import AllowPickledElementsDataset, ShardDataset
from dataservice.data.parquet import ParquetDataset
from dataservice.data.sources import ListFilesDataset, TFRecordDataset
from dataservice.data.splits import SplitProvider, SplitSource
from dataservice.data.webdataset import WebDataset

__all__ = [
    "allows_pickled_elements",
    "check_splittable",
    "file_sources",
    "make_iterator",
    "map_graph",
    "new_iter_stats",
    "num_split_sources",
    "op_name",
    "source_files",
    "split_providers",
    "static_element_spec",
    "unseeded_random_ops",
    "walk",
    "with_source_files",
]


def walk(dataset: Dataset) -> Iterator[Dataset]:
    """Yields `dataset`, then its inputs' graphs depth-first (pre-order), each node's
    inputs in their order (`a.concatenate(b)`: a's graph before b's). Datasets built by
    user functions (`flat_map`/`interleave` bodies) are not in the graph."""
    return dataset._walk()


def map_graph(dataset: Dataset, fn: Callable[[Dataset], Dataset]) -> Dataset:
    """The graph rebuilt bottom-up: each node `n`, its inputs already rebuilt, is
    replaced by `fn(n)`. A node whose inputs did not change is reused as it is, so
    `map_graph(ds, lambda n: n)` is `ds`."""
    return dataset._map_graph(fn)


def op_name(node: Dataset) -> str:
    """The op's name as messages write it, e.g. "map", "list_files", "TFRecordDataset"."""
    return node._op_name


def source_files(node: Dataset) -> tuple[str, ...] | None:
    """The file names `node` reads if it is a file source (`list_files`, or a
    `TFRecordDataset` given file names, not a Dataset of them; a `ParquetDataset` or
    `WebDataset`: its files or shards), else None."""
    if isinstance(node, ListFilesDataset):
        return node.files
    if isinstance(node, TFRecordDataset | ParquetDataset | WebDataset):
        return node.filenames
    return None


def file_sources(dataset: Dataset) -> list[Dataset]:
    """The file sources of `dataset`'s graph (see `source_files`), in `walk` order."""
    return [node for node in walk(dataset) if source_files(node) is not None]


def with_source_files(node: Dataset, files: tuple[str, ...]) -> Dataset:
    """A copy of the file source `node` reading `files` instead of its own, in that
    order (a `list_files` keeps its shuffle and seed).

    Raises:
        TypeError: `node` is not a file source (`source_files(node)` is None).
    """
    if (
        isinstance(node, ListFilesDataset | TFRecordDataset | ParquetDataset | WebDataset)
        and source_files(node) is not None
    ):
        return node._with_files(tuple(files))
    raise TypeError(
        f"`{op_name(node)}` is not a file source (list_files, TFRecordDataset, ParquetDataset "
        "or WebDataset)"
    )


def num_split_sources(dataset: Dataset) -> int:
    """How many split providers `split_providers` builds (one per splittable source),
    without building them (no globbing, no file access).

    Raises:
        ValueError: An op on the way to a source cannot be split; the message names
            it (e.g. `from_generator`, `distribute`).
    """
    return dataset._num_split_sources()


def check_splittable(dataset: Dataset) -> None:
    """Checks that `dataset` can be read under DYNAMIC sharding, as tf.data service
    does when a dataset is registered.

    Raises:
        ValueError: As `num_split_sources`.
    """
    num_split_sources(dataset)


def split_providers(dataset: Dataset, seed: int | None) -> list[SplitProvider]:
    """The dispatcher's split providers of one iteration: one per splittable source,
    in split-source order (dataset.py's docstring), each wrapped for the `repeat`s
    above its source. Source k's provider gets seed `seed + k`, so the same `seed`
    rebuilds the same providers (a dispatcher replays them after a restart).

    Args:
        seed: Orders the files of a `list_files` that has no seed of its own; None
            for fresh randomness.
    Raises:
        ValueError: As `num_split_sources`.
    """
    return dataset._split_providers(seed)


def new_iter_stats() -> IterStats:
    """Counters for `make_iterator(..., stats=...)`: `errors_ignored` (elements
    `ignore_errors` skipped), thread-safe to read while the pipeline runs."""
    return IterStats()


def make_iterator(
    dataset: Dataset,
    split_sources: tuple[SplitSource, ...] | None = None,
    stats: IterStats | None = None,
    epoch: int | None = None,
) -> Iterator[Any]:
    """A fresh iterator over one epoch of `dataset`. With `split_sources` (one per
    splittable source, in split-source order, each with `get_next() -> split | None`)
    the k-th source reads the splits `split_sources[k]` hands out instead of
    enumerating itself: a worker's side of DYNAMIC sharding. `stats` (from
    `new_iter_stats`) counts what the pipeline skipped (`ignore_errors`). `epoch`:
    the service job's epoch (its iteration's repetition), which fixes the orders
    of seeded reshuffling ops (`IterContext.epoch`); None: as in-process.

    The iterator has `close()`; closing or dropping it stops the threads it started.

    Raises:
        InvalidArgumentError: (when iterated) `split_sources` does not have one entry
            per splittable source.
    """
    return dataset._make_iterator(
        IterContext(split_sources=split_sources, stats=stats, epoch=epoch)
    )


def static_element_spec(dataset: Dataset) -> Any:
    """The element spec if it is known without running the pipeline, else None
    (`Dataset.element_spec` would then run it for its first element)."""
    return dataset._static_element_spec()


def allows_pickled_elements(dataset: Dataset) -> bool:
    """Whether `dataset`'s graph opted in to elements that are not numpy values
    (`distribute`/`register_dataset(..., allow_pickled_elements=True)`, which add an
    `allow_pickled_elements` op to the graph)."""
    return any(isinstance(d, AllowPickledElementsDataset) for d in walk(dataset))


def unseeded_random_ops(dataset: Dataset, *, under_shard_hints: bool = False) -> list[str]:
    """The ops of `dataset`'s graph whose output differs from one process (or run) to
    the next because they have no seed: `shuffle` without `seed`, `list_files` that
    shuffles without `seed`, `map(..., deterministic=False)` with parallel calls. Each
    entry names the op and its fix (e.g. "shuffle(buffer_size=10) without a seed (fix:
    shuffle(10, seed=...))"), in `walk` order, each node once. User functions' own
    randomness (a `map` calling `random`) is not seen.

    Static sharding that shards elements (DATA, FILE_OR_DATA without file sources,
    HINT) has each worker run the whole pipeline and keep every n-th element: such an
    op gives each worker another order, so the shards overlap (elements duplicated,
    others never read), as in tf.data.

    Args:
        under_shard_hints: Only the ops below a `shard(SHARD_HINT, ...)` (those whose
            output HINT sharding splits between workers).
    """
    if under_shard_hints:
        roots = [
            node._input
            for node in walk(dataset)
            if isinstance(node, ShardDataset) and node._has_hint
        ]
    else:
        roots = [dataset]
    seen: set[int] = set()
    out = []
    for root in roots:
        for node in walk(root):
            if id(node) in seen:
                continue
            seen.add(id(node))
            why = node._unseeded_randomness()
            if why is not None:
                out.append(why)
    return out
