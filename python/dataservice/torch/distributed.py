"""Reading the data service from data-parallel training (torch.distributed, torchrun).

Three recipes (README "With PyTorch"):

1. **DYNAMIC shared job**: every rank reads the same named DYNAMIC job
   (`distribute_for_rank(DYNAMIC, target, job_name="train")`); each rank gets
   what it asks for first, every element once per epoch over all ranks. Ranks
   may get different numbers of batches: wrap the loop in DDP's `join()`.
2. **Coordinated reads** (`coordinated=True`): `consumer_index=rank`,
   `num_consumers=world_size`; every rank gets one batch per round, from the same
   worker, so all ranks step together. The dataset must be infinite (`repeat()`).
3. **OFF per rank**: each rank reads a job of its own
   (`distribute_for_rank(OFF, target, job_name="train")` makes "train/rank-R")
   over a pipeline shuffled with `seed + rank`: each rank gets the whole dataset
   (once per worker) in its own seeded order.

`distribute_for_rank` takes `rank` / `num_replicas` as `DistributedSampler`
does: by default from the initialised default process group, else from the
`RANK` / `WORLD_SIZE` environment variables torchrun sets, else rank 0 of 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from dataservice import auth
from dataservice.client.api import distribute, from_dataset_id
from dataservice.data.dataset import Dataset
from dataservice.rpc import util as rpc_util
from dataservice.sharding import ShardingPolicy, to_sharding_policy

_CONSUMER_KWARGS = ("consumer_index", "num_consumers")


def rank_and_world_size() -> tuple[int, int]:
    """This process's (rank, world size) for data-parallel reads.

    From `torch.distributed` when its default process group is initialised, else
    from the `RANK` and `WORLD_SIZE` environment variables (set by torchrun
    before the process group exists), else (0, 1): one process.

    Raises:
        ValueError: `RANK` / `WORLD_SIZE` are set but not integers with
            0 <= RANK < WORLD_SIZE, or only one of them is set.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None and world is None:
        return 0, 1
    if rank is None or world is None:
        raise ValueError(
            f"RANK and WORLD_SIZE must be set together, got RANK={rank!r}, WORLD_SIZE={world!r}"
        )
    try:
        r, w = int(rank), int(world)
    except ValueError:
        raise ValueError(
            f"RANK and WORLD_SIZE must be integers, got RANK={rank!r}, WORLD_SIZE={world!r}"
        ) from None
    _check_rank(r, w, "the environment's RANK / WORLD_SIZE")
    return r, w


def _check_rank(rank: Any, num_replicas: Any, where: str) -> None:
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas <= 0:
        raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r} ({where})")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < num_replicas:
        raise ValueError(
            f"Invalid rank {rank!r}, rank should be in the interval [0, {num_replicas - 1}] "
            f"({where})"
        )


def _rank_options(
    processing_mode: Any,
    job_name: str | None,
    coordinated: bool,
    rank: int | None,
    num_replicas: int | None,
    kwargs: dict[str, Any],
) -> tuple[ShardingPolicy, str | None, dict[str, Any]]:
    """(policy, job name, consumer kwargs) of one rank's read; see `distribute_for_rank`."""
    for name in _CONSUMER_KWARGS:
        if name in kwargs:
            raise ValueError(
                f"`{name}` is set from the rank by distribute_for_rank; "
                "use dataservice.distribute to set it yourself"
            )
    if not isinstance(coordinated, bool):
        raise ValueError(f"`coordinated` must be a bool, got {coordinated!r}")
    policy = to_sharding_policy(processing_mode)
    if rank is None or num_replicas is None:
        default_rank, default_world = rank_and_world_size()
        rank = default_rank if rank is None else rank
        num_replicas = default_world if num_replicas is None else num_replicas
    _check_rank(rank, num_replicas, "distribute_for_rank")
    if coordinated:
        if not job_name:
            raise ValueError(
                "coordinated reads need a `job_name` that every rank shares "
                "(consumer_index=rank of num_consumers=world size read one job)"
            )
        return policy, job_name, {"consumer_index": rank, "num_consumers": num_replicas}
    if policy == ShardingPolicy.OFF:
        # One job per rank: an OFF job shared by the ranks would deal each worker's
        # copy of the dataset out between them instead of giving each rank its own.
        return policy, f"{job_name}/rank-{rank}" if job_name else None, {}
    if not job_name and num_replicas > 1:
        raise ValueError(
            f"a {policy.name} read from {num_replicas} ranks needs a `job_name` that every "
            "rank shares: without one each rank makes a job of its own and reads the whole "
            "dataset, so every element is trained on once per rank"
        )
    return policy, job_name, {}


def distribute_for_rank(
    processing_mode: Any,
    service: Any,
    job_name: str | None = None,
    *,
    coordinated: bool = False,
    rank: int | None = None,
    num_replicas: int | None = None,
    **kwargs: Any,
) -> Callable[[Dataset], Dataset]:
    """`dataservice.distribute` for one rank of data-parallel training.

    Used as `DistributedSampler` is: nothing to pass under torchrun,
    `rank` / `num_replicas` to override. What it sets, by recipe:

    - `coordinated=True`: `consumer_index=rank`, `num_consumers=num_replicas`
      on the shared job `job_name` (coordinated reads: one batch per rank per
      round, all ranks step together; the dataset must be infinite).
    - `processing_mode` OFF: the job `"{job_name}/rank-{rank}"` (anonymous if
      `job_name` is None): a job per rank, each reading the whole dataset;
      shuffle the pipeline with `seed + rank` to give each rank its own order.
    - any other mode (DYNAMIC, FILE, ...): the shared job `job_name`, which
      is then required when `num_replicas > 1` (an anonymous job per rank
      would give every rank the whole dataset).

    Args:
        processing_mode, service, job_name: As `dataservice.distribute`.
        coordinated: Coordinated reads across the ranks (see above).
        rank: This process's rank; default from `rank_and_world_size()`.
        num_replicas: The number of ranks; default from `rank_and_world_size()`.
        **kwargs: Any other `dataservice.distribute` argument, except
            `consumer_index` / `num_consumers`.

    Returns:
        A function `Dataset -> Dataset` for `dataset.apply(...)`.

    Raises:
        ValueError: A bad argument (the message names it), as
            `dataservice.distribute`'s, a rank outside [0, num_replicas), a
            missing shared `job_name`, or `consumer_index` / `num_consumers`
            given.
    """
    policy, name, consumers = _rank_options(
        processing_mode, job_name, coordinated, rank, num_replicas, kwargs
    )
    return distribute(policy, service, job_name=name, **consumers, **kwargs)


def from_dataset_id_for_rank(
    processing_mode: Any,
    service: Any,
    dataset_id: str,
    element_spec: Any = None,
    job_name: str | None = None,
    *,
    coordinated: bool = False,
    rank: int | None = None,
    num_replicas: int | None = None,
    **kwargs: Any,
) -> Dataset:
    """`dataservice.from_dataset_id` for one rank; the rank options as
    `distribute_for_rank`'s.

    Raises:
        ValueError: As `distribute_for_rank`.
    """
    policy, name, consumers = _rank_options(
        processing_mode, job_name, coordinated, rank, num_replicas, kwargs
    )
    return from_dataset_id(
        policy, service, dataset_id, element_spec, job_name=name, **consumers, **kwargs
    )


def broadcast_service(
    target: str | None = None,
    auth_token: str | None = None,
    *,
    src: int = 0,
    group: Any = None,
) -> str:
    """Hands rank `src`'s dispatcher address and auth token to every rank.

    Rank `src` passes its `target` (e.g. `LocalCluster.target`) and token
    (`cluster.auth_token`; None when the dispatcher takes none); every other rank
    passes nothing, gets them and makes its clients of that dispatcher send the
    token (`auth.register_token`, as a `LocalCluster` does in its own process).
    A collective: every rank of `group` must call it. The token travels over the
    process group's connections (gloo/NCCL's TCP, in clear as the gRPC calls do).

    Args:
        target: On rank `src`: the dispatcher, "grpc://host:port" or "host:port".
        auth_token: On rank `src`: the dispatcher's token, or None.
        src: The rank that knows them.
        group: The process group (default: the default group).

    Returns:
        The dispatcher's address as rank `src` gave it.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: (on every rank) Rank `src`'s `target` is missing or not an
            address.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "broadcast_service needs torch.distributed initialised "
            "(torch.distributed.init_process_group) on every rank"
        )
    # Rank `src` checks what it sends and sends its error instead, so that the other
    # ranks raise it too rather than wait in the collective for the process group's timeout.
    payload: list[Any] = [None, None, None]
    if dist.get_rank() == src:
        try:
            if not isinstance(target, str) or not target:
                raise ValueError(f"rank {src} must give the dispatcher's `target`, got {target!r}")
            rpc_util.parse_address(target)
            payload = [target, auth_token or None, None]
        except ValueError as err:
            payload = [None, None, str(err)]
    dist.broadcast_object_list(payload, src=src, group=group)
    received_target, token, error = payload
    if error is not None:
        raise ValueError(f"broadcast_service: rank {src}: {error}")
    if dist.get_rank() != src and token:
        auth.register_token(rpc_util.parse_address(received_target), token)
    return str(received_target)
