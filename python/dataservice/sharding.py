"""Sharding policies (`ShardingPolicy`) and the `SHARD_HINT` placeholder.

The names and meanings are tf.data service's
(`tf.data.experimental.service.ShardingPolicy`):

* OFF: every worker processes the whole dataset ("parallel_epochs").
* DYNAMIC: the dispatcher hands out splits of the source; each element is
  produced once per epoch across all workers ("distributed_epoch").
* FILE, DATA, FILE_OR_DATA, HINT: static sharding over a fixed worker list.

Owns what a policy is and which worker a static policy's shard index names
(`worker_index_in`). It imports nothing of the pipeline: the rewrites of a
`Dataset` graph under a static policy are `dataservice.data.static_sharding`'s.
"""

from __future__ import annotations

import enum

SHARD_HINT = -1
"""Placeholder for `Dataset.shard(SHARD_HINT, SHARD_HINT)`: under the HINT
policy it becomes `shard(num_workers, worker_index)` on each worker."""


class ShardingPolicy(enum.IntEnum):
    """How a distributed dataset is split across workers (tf.data service's ShardingPolicy).

    * OFF: no sharding; every worker produces the whole dataset.
    * DYNAMIC: the dispatcher hands out splits of the source on demand; each
      element is produced once per epoch across all workers.
    * FILE: each file source (`list_files`, `TFRecordDataset` of file names,
      `ParquetDataset`, `WebDataset`)
      of worker `i` of `n` reads files `i, i + n, ...`. Needs at least one
      file per worker: fewer files than workers is an error naming both
      counts, and a pipeline without a file source is an error too.
    * DATA: worker `i` of `n` keeps elements `i, i + n, ...` of the whole stream.
    * FILE_OR_DATA: FILE when the pipeline has a file source with at least as
      many files as workers; otherwise DATA. With no file source this is
      tf.data's behaviour. With fewer files than workers it departs from
      tf.data, which picks FILE anyway and then fails at run time because a
      shard has no file: here it falls back to DATA (logged once at INFO
      naming both counts), so every element is still read exactly once and
      workers whose shard is empty simply end (CASES.md C-29). Why:
      FILE_OR_DATA asks for "by files when that works, else by elements",
      and by files cannot work with fewer files than workers; FILE stays
      strict for those who need whole files per worker.
    * HINT: `shard(SHARD_HINT, SHARD_HINT)` placeholders become
      `shard(num_workers, worker_index)`.

    The static policies (FILE, DATA, FILE_OR_DATA, HINT) need
    `DispatcherConfig.worker_addresses`; a worker's index is its position in
    it. With `target_workers="AUTO"` (the default) a static job is read from
    the workers local to the client only (same host id, see API.md
    "Locality"); `"ANY"` reads every worker's shard.
    """

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


def sharding_policy_from_proto(value: int) -> ShardingPolicy:
    """The `ShardingPolicy` of a protobuf `processing_mode` field (service.proto's
    `int32`, journal.proto's `ShardingPolicy` enum: both read as an int). The one
    way in from the wire and the journal; everything above them carries the enum.

    Raises:
        ValueError: `value` is no policy's value; the message names it and lists
            the valid values with their names.
    """
    try:
        return ShardingPolicy(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a ShardingPolicy value (valid: {_VALID})") from None


def sharding_policy_to_proto(policy: ShardingPolicy) -> int:
    """The int that a protobuf `processing_mode` field holds for `policy` (the
    one way out to the wire and the journal).

    Raises:
        ValueError: `policy` is no `ShardingPolicy` member; the message names it
            and lists the valid values with their names.
    """
    return int(sharding_policy_from_proto(policy))


_VALID = ", ".join(f"{p.value} ({p.name})" for p in ShardingPolicy)

STATIC_POLICIES = (
    ShardingPolicy.FILE,
    ShardingPolicy.DATA,
    ShardingPolicy.FILE_OR_DATA,
    ShardingPolicy.HINT,
)


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
