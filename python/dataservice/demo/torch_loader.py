"""The demo's comparison with PyTorch: the same records, decode and augmentation
(`parse_record`) through `torch.utils.data.DataLoader(num_workers=N)`, as a PyTorch
ImageNet trainer would read TFRecord shards: an `IterableDataset` whose workers split the
shards between them.

Imported only when torch is installed (`import torch` at the top is deliberate: the demo
catches the ImportError and leaves the row out).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.utils.data

from dataservice.demo.data import DemoData
from dataservice.demo.pipeline import parse_record


class ShardedRecords(torch.utils.data.IterableDataset):  # type: ignore[type-arg,misc,unused-ignore]
    """The demo's records as (uint8[224, 224, 3], int64[], int64[]) elements; DataLoader
    worker k of n reads shards k, k + n, ... of a per-epoch shuffle of the shard list, so
    each record is read once per epoch.

    The epoch counts the calls of `__iter__` in each process: with `persistent_workers` each
    DataLoader worker keeps its own copy of this object and all of them count alike, so they
    agree on every epoch's shuffle without talking to each other.
    """

    def __init__(self, files: list[str], seed: int) -> None:
        super().__init__()
        self._files = list(files)
        self._seed = seed
        self._epoch = 0

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.int64, np.int64]]:
        import dataservice as ds

        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        order = np.random.default_rng([self._seed, self._epoch]).permutation(len(self._files))
        self._epoch += 1
        mine = [self._files[i] for i in order[worker::num_workers]]
        if not mine:
            return
        for record in ds.TFRecordDataset(mine):
            yield parse_record(record)


def make_dataloader(data: DemoData, batch_size: int, num_workers: int, seed: int = 0) -> Any:
    """A DataLoader of (uint8[b, 224, 224, 3], int64[b], int64[b]) tensor batches.

    `persistent_workers=True` (as timm's ImageNet loader): the worker processes are forked
    at the first `iter()` and kept for later epochs; they end when the DataLoader is
    garbage-collected (or with this process).
    """
    return torch.utils.data.DataLoader(
        ShardedRecords(data.files, seed),
        batch_size=batch_size,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )
