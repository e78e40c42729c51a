"""`ServiceDataset`: a torch `IterableDataset` over a dataset read from the data service.

Zero copy, and how long a tensor's memory lives
-----------------------------------------------
A same-host read hands out numpy arrays of >= 64 KiB as views of the worker's
shared-memory ring (`transfer/shm.py`); `torch.from_numpy` makes a tensor over
the same memory, and the tensor keeps the numpy array alive, whose base chain
(`ndarray -> memoryview -> _core.RingLease`) holds the ring frame's lease
(`rust/py/lease.rs`, `FrameLease` in `rust/shm/ring.rs`) and, through it, the
ring's mapping and memfd. While a lease lives the worker cannot reuse that
frame's bytes. A consumer that keeps views while the worker waits for ring space
(2 ms, `rust/shm/detach.rs`) copies the pages of the frames still held into
private memory *at the same addresses* and maps the ring afresh: a held tensor
keeps its `data_ptr` and its values however far the ring moves on, and only the
frames still held then are copied. So any tensor may be kept as long as wanted;
keeping many costs that one copy, never a wrong value.

Arrays from the service are writable and the memory under them is this
consumer's alone: a ring (one per worker task and consumer) is written by its
worker and read by this consumer, and the worker never reads a frame's bytes
back; a cross-trainer cache's leaves are private copy-on-write mappings; a gRPC
reply's buffer belongs to the reader. So the tensors are writable too, and
writing into one (in-place augmentation, `tensor.mul_`) changes nothing anyone
else reads. An array an op after `distribute` made read-only, byte-swapped or
with negative strides cannot be a torch tensor as it is and is copied
(`ServiceDataset.stats()["copied_arrays"]` counts them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data

from dataservice.client.api import DistributedDataset
from dataservice.data import graph, structure
from dataservice.data.dataset import Dataset

# numpy kinds with no torch dtype: unicode, bytes, object, datetime, timedelta, void.
_NOT_TENSOR_KINDS = frozenset("USOMmV")


def _leaf_to_tensor(leaf: Any, copies: list[int]) -> Any:
    """One leaf as a tensor over the same memory where torch allows it.

    numpy scalars become 0-d tensors (numpy made them by value anyway); arrays
    whose dtype torch lacks (strings, objects, datetimes) and non-array leaves
    (`str`, `bytes`, pickled objects) are returned unchanged. `copies[0]` counts
    the arrays that had to be copied.
    """
    if isinstance(leaf, np.ndarray):
        if leaf.dtype.kind in _NOT_TENSOR_KINDS:
            return leaf
        if not leaf.flags.writeable or not leaf.dtype.isnative or any(s < 0 for s in leaf.strides):
            # torch has no read-only tensors, foreign byte order or negative strides.
            copies[0] += 1
            leaf = np.array(leaf, dtype=leaf.dtype.newbyteorder("="), order="C", copy=True)
        try:
            return torch.from_numpy(leaf)
        except TypeError:  # a dtype this torch lacks (uint32 before torch 2.3)
            return leaf
    if isinstance(leaf, np.generic) and not isinstance(leaf, (np.str_, np.bytes_)):
        if leaf.dtype.kind in _NOT_TENSOR_KINDS:
            return leaf
        return torch.from_numpy(np.asarray(leaf))
    return leaf


def to_torch(element: Any) -> Any:
    """`element` with each numpy array replaced by a `torch.Tensor` over its memory.

    The nested structure (dict, tuple, list, namedtuple) is kept; numpy scalars
    become 0-d tensors; `str`, `bytes` and string/object arrays are unchanged.
    A read-only, byte-swapped or negatively strided array is copied (torch cannot
    view it).

    Raises:
        TypeError: A dict of the element has keys that cannot be sorted together.
    """
    copies = [0]
    return structure.map_structure(lambda leaf: _leaf_to_tensor(leaf, copies), element)


def _reads_service(dataset: Dataset) -> bool:
    """True if `dataset` is, or reads from, a `DistributedDataset`."""
    return any(isinstance(node, DistributedDataset) for node in graph.walk(dataset))


class _TensorIterator:
    """One epoch of a `ServiceDataset`: the dataset's iterator, elements as tensors.
    One consumer thread."""

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it
        self._copies = [0]
        self._mu = threading.Lock()  # stats() may be called from another thread

    def __iter__(self) -> _TensorIterator:
        return self

    def __next__(self) -> Any:
        element = next(self._it)
        copies = [0]
        out = structure.map_structure(lambda leaf: _leaf_to_tensor(leaf, copies), element)
        if copies[0]:
            with self._mu:
                self._copies[0] += copies[0]
        return out

    def stats(self) -> dict[str, Any]:
        inner = getattr(self._it, "stats", None)
        out: dict[str, Any] = dict(inner()) if callable(inner) else {}
        with self._mu:
            out["copied_arrays"] = self._copies[0]
        return out

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if callable(close):
            close()


_WORKER_REFUSAL = (
    "ServiceDataset cannot run in a DataLoader worker process (num_workers={n}): the data "
    "service's workers already run the input pipeline in parallel, and each DataLoader "
    "worker would be one more consumer with its own iterator (under an anonymous job each "
    "would read the whole dataset; under coordinated reads the consumer count would be "
    "wrong; the epoch counts of a named job would drift apart between worker processes), "
    "and its tensors would be copied through a pipe instead of read in place. Use "
    "DataLoader(ServiceDataset(dataset), batch_size=None, num_workers=0) (pin_memory=True "
    "works: it pins in a thread of this process), and raise the service's worker count "
    "for more throughput."
)


class ServiceDataset(torch.utils.data.IterableDataset):
    """A `torch.utils.data.IterableDataset` over a dataset read from the data service.

    Each `iter()` is one epoch of `dataset` (for a named job, the next repetition
    of the job, as iterating `dataset` itself). Elements keep their nested
    structure; numpy arrays become `torch.Tensor`s over the same memory (see the
    module docstring: same-host arrays of >= 64 KiB are views of the shared-memory
    ring and stay valid as long as the tensor lives), numpy scalars 0-d tensors,
    and `str`, `bytes` and string/object arrays pass through unchanged.

    Use it directly (`for batch in ServiceDataset(d)`) or in
    `DataLoader(ServiceDataset(d), batch_size=None)`: the batching is the
    pipeline's own `batch(...)`, so the DataLoader must not batch again.
    `pin_memory=True` works (the DataLoader pins in a thread of this process).
    `num_workers` must be 0: iterating in a DataLoader worker process raises
    RuntimeError naming why: the service's workers are the parallelism, and each
    DataLoader worker would be one more consumer (an anonymous job read once per
    worker process, a wrong consumer count for coordinated reads, epochs of a named
    job drifting apart) whose tensors are copied through a pipe.

    Args:
        dataset: A `dataservice.Dataset` that reads from the service: the result
            of `.apply(distribute(...))` or `from_dataset_id(...)`, possibly
            followed by ops that run in this process.

    Raises:
        ValueError: `dataset` is not a `Dataset`, or does not read from the
            service (the pipeline would run in the trainer: apply `distribute`).

    Thread-safety: each iterator belongs to one consumer thread; `stats()` may
    be called from any thread.
    """

    def __init__(self, dataset: Dataset) -> None:
        super().__init__()
        if not isinstance(dataset, Dataset):
            raise ValueError(f"ServiceDataset needs a dataservice.Dataset, got {dataset!r}")
        if not _reads_service(dataset):
            raise ValueError(
                "ServiceDataset needs a dataset read from the data service: "
                "dataset.apply(dataservice.distribute(...)) or dataservice.from_dataset_id(...); "
                f"{type(dataset).__name__} does not read from one, so its pipeline would run "
                "in this training process"
            )
        self.dataset = dataset
        self._mu = threading.Lock()
        self._last: _TensorIterator | None = None  # guarded by self._mu

    def __iter__(self) -> Iterator[Any]:
        """A new epoch: an iterator of tensor elements with `.stats()` and `.close()`.

        Raises:
            RuntimeError: Called in a DataLoader worker process (`num_workers > 0`).
        """
        info = torch.utils.data.get_worker_info()
        if info is not None:
            raise RuntimeError(_WORKER_REFUSAL.format(n=info.num_workers))
        it = _TensorIterator(iter(self.dataset))
        with self._mu:
            self._last = it
        return it

    def stats(self) -> dict[str, Any]:
        """The latest epoch's read statistics: the service iterator's `stats()`
        (`elements`, `bytes`, `wait_ms`, `workers`, ...; absent when ops after
        `distribute` hide it) plus `copied_arrays`, the arrays this adapter had to
        copy (read-only, byte-swapped or negatively strided ones). Empty before
        the first epoch."""
        with self._mu:
            last = self._last
        return last.stats() if last is not None else {}

    def state_dict(self) -> dict[str, Any]:
        """The latest epoch's position, as its service iterator's `state_dict()`
        (torchdata's StatefulDataLoader calls it; client/checkpoint.py). Before
        the first epoch: the state of an epoch that read nothing is not known,
        so {} (which `load_state_dict` accepts as "start afresh").

        Raises:
            ValueError: `dataset` has an op after `distribute` that reads ahead
                or holds elements (`prefetch`, a parallel `map`, `shuffle`, ...:
                `Dataset.load_state_dict` lists those that keep the position).
        """
        with self._mu:
            last = self._last
        if last is None:
            return {}
        # (A service read's iterator, or, with ops after the read, a StatsIterator.)
        state: dict[str, Any] = last._it.state_dict()  # type: ignore[attr-defined]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next epoch continues where `state` (a `state_dict()`) was, as
        `DistributedDataset.load_state_dict`; {} does nothing.

        Raises:
            ValueError: As `state_dict`.
            InvalidArgumentError: As `DistributedDataset.load_state_dict`.
        """
        if not state:
            return
        self.dataset.load_state_dict(state)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_mu"] = None
        state["_last"] = None  # an iterator holds threads and rings: never shipped
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mu = threading.Lock()

    def __repr__(self) -> str:
        return f"ServiceDataset({self.dataset!r})"
