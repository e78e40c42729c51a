"""PyTorch adapter: read the data service from a PyTorch training loop.

`ServiceDataset` is a `torch.utils.data.IterableDataset` over a dataset read from
the service (`distribute(...)` or `from_dataset_id`): it yields the same nested
elements with every numpy array turned into a `torch.Tensor` over the same memory
(no copy). `distribute_for_rank` / `from_dataset_id_for_rank` fill the consumer
options from the process's rank and world size as `DistributedSampler` does,
and `broadcast_service` hands rank 0's dispatcher address and auth token to the
other ranks.

Importing this module imports torch; `import dataservice` never does. Install it
with the `torch` extra (`pip install 'dataservice[torch]'`).
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (fail here, with the fix, not deep inside)
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dataservice.torch needs PyTorch, which is not installed: "
        "pip install 'dataservice[torch]' (or torch>=2.1)"
    ) from err

from dataservice.torch.dataset import ServiceDataset, to_torch
from dataservice.torch.distributed import (
    broadcast_service,
    distribute_for_rank,
    from_dataset_id_for_rank,
    rank_and_world_size,
)

__all__ = [
    "ServiceDataset",
    "broadcast_service",
    "distribute_for_rank",
    "from_dataset_id_for_rank",
    "rank_and_world_size",
    "to_torch",
]
