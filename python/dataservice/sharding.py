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
