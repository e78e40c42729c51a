"""The rewrites of a pipeline graph under a static `ShardingPolicy` (FILE, DATA,
FILE_OR_DATA, HINT), as tf.data service's auto-sharding does on each worker.

Owns `apply_static_sharding` and the rewrites it is made of: FILE sharding of the
file sources (`shard_files`), DATA sharding (a `shard` at the end), and resolving
`SHARD_HINT` placeholders (`resolve_shard_hints`). What each policy means is
`dataservice.sharding`'s (`ShardingPolicy`); this module is where a policy meets the
graph, through `graph.py`. A worker calls it on the dataset of each static task.
"""

from __future__ import annotations

import logging
import os
import threading

from dataservice import errors
from dataservice.data import graph
from dataservice.data.dataset import Dataset
from dataservice.data.ops import ShardDataset
from dataservice.sharding import SHARD_HINT, ShardingPolicy

__all__ = ["apply_static_sharding", "resolve_shard_hints", "shard_files"]

# The FILE_OR_DATA fallback is a decision about the sharding policy: it logs under the
# policy module's logger, where users who tune sharding logs look for it.
log = logging.getLogger("dataservice.sharding")


def resolve_shard_hints(dataset: Dataset, num_workers: int, worker_index: int) -> Dataset:
    """The graph with `SHARD_HINT` in `shard()` replaced: num_shards -> `num_workers`,
    index -> `worker_index` (ShardingPolicy.HINT on a worker). Other shards stay."""

    def resolve(node: Dataset) -> Dataset:
        if isinstance(node, ShardDataset) and node._has_hint:
            n = num_workers if node._num_shards == SHARD_HINT else node._num_shards
            i = worker_index if node._index == SHARD_HINT else node._index
            return ShardDataset(node._input, n, i)
        return node

    return graph.map_graph(dataset, resolve)


def shard_files(
    dataset: Dataset, policy: ShardingPolicy, num_workers: int, worker_index: int
) -> Dataset:
    """The pipeline with each file source reading only files `worker_index`,
    `worker_index + num_workers`, ... (tf.data's FILE auto-sharding).

    Args:
        policy: The policy asking (FILE or FILE_OR_DATA), named in errors.
    Raises:
        FailedPreconditionError: A file source has fewer files than workers.
    """

    def rewrite(node: Dataset) -> Dataset:
        files = graph.source_files(node)
        if files is None:
            return node
        if len(files) < num_workers:
            raise errors.FailedPreconditionError(
                f"{policy.name} sharding: not enough files to shard: `{graph.op_name(node)}` "
                f"has {len(files)} files for {num_workers} workers (FILE sharding needs at "
                "least one file per worker); use ShardingPolicy.DATA, or FILE_OR_DATA (which "
                "falls back to DATA sharding when there are fewer files than workers)"
            )
        return graph.with_source_files(node, files[worker_index::num_workers])

    return graph.map_graph(dataset, rewrite)


_fallback_logged: set[tuple[int, tuple[tuple[str, ...], ...]]] = set()
_fallback_logged_mu = threading.Lock()


def _renew_fallback_logged_mu_after_fork() -> None:
    """A forked child gets a fresh `_fallback_logged_mu`: a thread of the parent may have held
    it at fork, and no thread here would ever release it."""
    global _fallback_logged_mu
    _fallback_logged_mu = threading.Lock()


os.register_at_fork(after_in_child=_renew_fallback_logged_mu_after_fork)


def _log_data_fallback_once(num_workers: int, file_lists: list[tuple[str, ...]]) -> None:
    key = (num_workers, tuple(file_lists))
    with _fallback_logged_mu:
        if key in _fallback_logged:
            return
        _fallback_logged.add(key)
    counts = ", ".join(str(len(files)) for files in file_lists)
    log.info(
        "FILE_OR_DATA sharding: the pipeline's file source has %s files for %d workers "
        "(FILE sharding needs at least one file per worker); using DATA sharding instead",
        counts,
        num_workers,
    )


def apply_static_sharding(
    dataset: Dataset, policy: ShardingPolicy, num_workers: int, worker_index: int
) -> Dataset:
    """Rewrites `dataset` for worker `worker_index` of `num_workers` under a
    static sharding policy, as tf.data service's auto-sharding does:

    * FILE: each file source (`list_files`, `TFRecordDataset` of names) reads
      every `num_workers`-th file from `worker_index` on;
    * DATA: the whole stream is `shard(num_workers, worker_index)`-ed at the end;
    * FILE_OR_DATA: FILE when every file source has at least `num_workers`
      files, else DATA (no file source, or fewer files than workers: the
      latter departs from tf.data, see `ShardingPolicy`);
    * HINT: `shard(SHARD_HINT, SHARD_HINT)` becomes `shard(num_workers, worker_index)`.

    Other policies (OFF, DYNAMIC) return `dataset` unchanged.

    Source: tensorflow/core/grappler/optimizers/data/auto_shard.cc.

    Raises:
        InvalidArgumentError: FILE sharding of a pipeline without a file source.
        FailedPreconditionError: Fewer files than workers under FILE sharding.
    """
    if policy == ShardingPolicy.FILE:
        if not graph.file_sources(dataset):
            raise errors.InvalidArgumentError(
                "FILE sharding: the pipeline is unshardable by files: it has no file source "
                "(`list_files`, `TFRecordDataset` of file names, `ParquetDataset` or "
                f"`WebDataset`), i.e. 0 files for {num_workers} workers; use "
                "ShardingPolicy.DATA or FILE_OR_DATA"
            )
        return shard_files(dataset, policy, num_workers, worker_index)
    if policy == ShardingPolicy.DATA:
        return dataset.shard(num_workers, worker_index)
    if policy == ShardingPolicy.FILE_OR_DATA:
        file_lists = [
            files for node in graph.walk(dataset) if (files := graph.source_files(node)) is not None
        ]
        if file_lists and all(len(files) >= num_workers for files in file_lists):
            return shard_files(dataset, policy, num_workers, worker_index)
        if file_lists:
            _log_data_fallback_once(num_workers, file_lists)
        return dataset.shard(num_workers, worker_index)
    if policy == ShardingPolicy.HINT:
        return resolve_shard_hints(dataset, num_workers, worker_index)
    return dataset
