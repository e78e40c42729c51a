"""Sharding policies (`ShardingPolicy`) and the `SHARD_HINT` placeholder.

The names and meanings are tf.data service's
(`tf.data.experimental.service.ShardingPolicy`):

* OFF: every worker processes the whole dataset ("parallel_epochs").
* DYNAMIC: the dispatcher hands out splits of the source; each element is
  produced once per epoch across all workers ("distributed_epoch").
* FILE, DATA, FILE_OR_DATA, HINT: static sharding over a fixed worker list.
"""

from __future__ import annotations

import enum
from typing import Any

from dataservice import errors

SHARD_HINT = -1
"""Placeholder for `Dataset.shard(SHARD_HINT, SHARD_HINT)`: under the HINT
policy it becomes `shard(num_workers, worker_index)` on each worker."""


class ShardingPolicy(enum.IntEnum):
    """How a distributed dataset is split across workers (tf.data service's ShardingPolicy)."""

    OFF = 0
    DYNAMIC = 1
    FILE = 2
    DATA = 3
    FILE_OR_DATA = 4
    HINT = 5


_ALIASES = {"parallel_epochs": ShardingPolicy.OFF, "distributed_epoch": ShardingPolicy.DYNAMIC}


def to_sharding_policy(processing_mode: object) -> ShardingPolicy:
    """Normalises a processing mode: a `ShardingPolicy`, its name, or the
    legacy strings "parallel_epochs" (OFF) and "distributed_epoch" (DYNAMIC).

    Raises:
        ValueError: `processing_mode` is none of these; the message lists them.
    """
    if isinstance(processing_mode, ShardingPolicy):
        return processing_mode
    if isinstance(processing_mode, str):
        key = processing_mode.strip()
        if key.lower() in _ALIASES:
            return _ALIASES[key.lower()]
        if key.upper() in ShardingPolicy.__members__:
            return ShardingPolicy[key.upper()]
    raise ValueError(
        "`processing_mode` must be a ShardingPolicy (OFF, DYNAMIC, FILE, DATA, FILE_OR_DATA, "
        "HINT) or one of the strings 'parallel_epochs', 'distributed_epoch'. "
        f"Got {processing_mode!r}."
    )


STATIC_POLICIES = (
    ShardingPolicy.FILE,
    ShardingPolicy.DATA,
    ShardingPolicy.FILE_OR_DATA,
    ShardingPolicy.HINT,
)


def _file_sources(dataset: Any) -> list[Any]:
    from dataservice.data.sources import ListFilesDataset, TFRecordDataset

    return [
        node
        for node in dataset._walk()
        if isinstance(node, ListFilesDataset)
        or (isinstance(node, TFRecordDataset) and node.filenames is not None)
    ]


def _shard_files(dataset: Any, num_workers: int, worker_index: int) -> Any:
    """The pipeline with each file source reading only files `worker_index`,
    `worker_index + num_workers`, ... (tf.data's FILE auto-sharding)."""
    import copy

    from dataservice.data.sources import ListFilesDataset, TFRecordDataset

    def rewrite(node: Any) -> Any:
        if isinstance(node, ListFilesDataset):
            files = node.files
            attr = "_files"
        elif isinstance(node, TFRecordDataset) and node.filenames is not None:
            files = node.filenames
            attr = "_filenames"
        else:
            return node
        if len(files) < num_workers:
            raise errors.FailedPreconditionError(
                f"FILE sharding: not enough files to shard: `{node._op_name}` has "
                f"{len(files)} files for {num_workers} workers (each worker needs at least "
                "one file); use ShardingPolicy.DATA or FILE_OR_DATA with more files"
            )
        new = copy.copy(node)
        setattr(new, attr, tuple(files[worker_index::num_workers]))
        return new

    return dataset._map_graph(rewrite)


def apply_static_sharding(
    dataset: Any, policy: ShardingPolicy, num_workers: int, worker_index: int
) -> Any:
    """Rewrites `dataset` for worker `worker_index` of `num_workers` under a
    static sharding policy, as tf.data service's auto-sharding does:

    * FILE: each file source (`list_files`, `TFRecordDataset` of names) reads
      every `num_workers`-th file from `worker_index` on;
    * DATA: the whole stream is `shard(num_workers, worker_index)`-ed at the end;
    * FILE_OR_DATA: FILE when the pipeline has a file source, else DATA;
    * HINT: `shard(SHARD_HINT, SHARD_HINT)` becomes `shard(num_workers, worker_index)`.

    Raises:
        InvalidArgumentError: FILE sharding of a pipeline without a file source.
        FailedPreconditionError: Fewer files than workers under FILE sharding.
    """
    if policy == ShardingPolicy.FILE:
        if not _file_sources(dataset):
            raise errors.InvalidArgumentError(
                "FILE sharding: the pipeline is unshardable by files: it has no file source "
                "(`list_files` or `TFRecordDataset` of file names); use ShardingPolicy.DATA"
            )
        return _shard_files(dataset, num_workers, worker_index)
    if policy == ShardingPolicy.DATA:
        return dataset.shard(num_workers, worker_index)
    if policy == ShardingPolicy.FILE_OR_DATA:
        if _file_sources(dataset):
            return _shard_files(dataset, num_workers, worker_index)
        return dataset.shard(num_workers, worker_index)
    if policy == ShardingPolicy.HINT:
        return dataset._with_shard_hints_resolved(num_workers, worker_index)
    return dataset


def worker_index_in(
    worker_address: str, worker_addresses: list[str], taken: frozenset[int] = frozenset()
) -> int:
    """The position of `worker_address` in a configured worker list, where an
    entry "host:%port%" (or "host" alone) matches any port of that host. An
    exact entry wins; among wildcard entries, the first one not in `taken`
    (positions held by other registered workers), so each "%port%" entry
    serves one worker. -1 if it is not in the list (or every match is taken)."""
    host, _, _ = worker_address.rpartition(":")
    for i, entry in enumerate(worker_addresses):
        if entry == worker_address:
            return i
    for i, entry in enumerate(worker_addresses):
        e_host, sep, e_port = entry.rpartition(":")
        if not sep:
            e_host, e_port = entry, "%port%"
        if e_host == host and e_port == "%port%" and i not in taken:
            return i
    return -1
