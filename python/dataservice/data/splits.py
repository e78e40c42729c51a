"""Split providers: the dispatcher's side of DYNAMIC sharding.

Under `ShardingPolicy.DYNAMIC` the dispatcher owns, per iteration, one `SplitProvider`
per splittable source of the pipeline, built by `Dataset._split_providers(seed)` in the
pipeline's split-source order (depth-first from the root, inputs in order: for
`a.concatenate(b)` a's sources, then b's; see "Split hooks" in dataset.py); source k's
provider is seeded with `seed + k`. A pipeline with one source has one provider
(`Dataset._split_provider(seed)`). Workers ask for splits one at a time, from each
provider separately (their `IterContext.split_sources[k]`), and source k on the worker
turns each of its splits into elements, so every element is produced once per epoch
across all workers (tf.data service's "distributed_epoch").

Splits are small picklable values:

* `range`, `from_tensor_slices`, `from_tensors`: an `int` index into the source
  (`IndexSplitProvider`); range split i is the element `start + i * step`.
* `list_files`, `TFRecordDataset(list of names)`, `WebDataset`: a file (shard) name `str`
  (`FileSplitProvider`).
* `ParquetDataset`: an `int` k, the k-th row group counting through its files in order
  (`IndexSplitProvider`; the row groups of each file are in the dataset).

Providers are deterministic given their seed: after a restart the dispatcher rebuilds a
provider with the same seed and calls `get_next()` k times to get back to where it was.
`save()` / `restore()` do the same in O(1). Providers are thread-compatible (the
dispatcher calls them under its lock).

Source: tensorflow/core/data/split_utils.h (IndexSplitProvider),
tensorflow/core/kernels/data/repeat_dataset_op.cc (RepeatedSplitProvider).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np

__all__ = [
    "FileSplitProvider",
    "IndexSplitProvider",
    "RepeatSplitProvider",
    "SplitProvider",
    "SplitSource",
    "epoch_rng",
]

INFINITE = -1
UNKNOWN = -2


@runtime_checkable
class SplitSource(Protocol):
    """What a worker-side source pulls splits from (`IterContext.split_sources[k]`)."""

    def get_next(self) -> object | None:
        """The next split, or None when there are no more splits (may block)."""
        ...


@runtime_checkable
class SplitProvider(Protocol):
    """Hands out the splits of one source, epoch after epoch (dispatcher side)."""

    def get_next(self) -> object | None:
        """The next split, or None once this provider's splits are exhausted."""
        ...

    def reset(self) -> None:
        """Starts over from the first split (a new epoch; file order may reshuffle)."""
        ...

    def cardinality(self) -> int:
        """Splits per full run: a count, or -1 (infinite) / -2 (unknown)."""
        ...

    def save(self) -> object:
        """A small picklable state that `restore` accepts."""
        ...

    def restore(self, state: object) -> None:
        """Returns to the state `save` returned (on a provider built the same way)."""
        ...


def epoch_rng(seed: int | None, epoch: int, job_epoch: int = 0) -> np.random.Generator:
    """The random generator for `epoch` of a shuffle seeded with `seed`, in epoch
    `job_epoch` of a service job (`IterContext.epoch`; 0 otherwise).

    With a seed, the same (seed, epoch, job_epoch) always gives the same
    generator; without one, fresh OS entropy.
    """
    if seed is None:
        return np.random.default_rng()
    key = [int(seed) % (1 << 64), int(epoch)]
    if job_epoch:
        key.append(int(job_epoch))
    return np.random.default_rng(key)


class IndexSplitProvider:
    """Splits `0, 1, ..., n - 1`: O(1) memory and time per split.

    Used for `range` (split i is element `start + i * step`), `from_tensor_slices`
    (slice i) and `from_tensors` (n = 1).
    """

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"IndexSplitProvider: n must be >= 0, got {n}")
        self._n = int(n)
        self._next = 0

    def get_next(self) -> int | None:
        if self._next >= self._n:
            return None
        index = self._next
        self._next += 1
        return index

    def reset(self) -> None:
        self._next = 0

    def cardinality(self) -> int:
        return self._n

    def save(self) -> object:
        return self._next

    def restore(self, state: object) -> None:
        self._next = int(cast(int, state))

    def __repr__(self) -> str:
        return f"IndexSplitProvider(n={self._n}, next={self._next})"


class FileSplitProvider:
    """Splits that are file names, one file per split.

    Args:
        files: The file names, in their unshuffled (sorted) order.
        shuffle: Permute the files in each epoch; epoch e (counted by `reset()`) uses
            `epoch_rng(seed, e)`, so a given seed replays the same orders.
        seed: See `shuffle`; None gives fresh randomness (not replayable).
    """

    def __init__(
        self, files: Sequence[str], shuffle: bool = False, seed: int | None = None
    ) -> None:
        self._files = tuple(files)
        self._shuffle = bool(shuffle)
        self._seed = seed
        self._epoch = 0
        self._pos = 0
        self._order: list[int] | None = None

    def _ensure_order(self) -> None:
        if self._order is None:
            n = len(self._files)
            if self._shuffle:
                self._order = [int(i) for i in epoch_rng(self._seed, self._epoch).permutation(n)]
            else:
                self._order = list(range(n))

    def get_next(self) -> str | None:
        if self._pos >= len(self._files):
            return None
        self._ensure_order()
        assert self._order is not None
        name = self._files[self._order[self._pos]]
        self._pos += 1
        return name

    def reset(self) -> None:
        self._epoch += 1
        self._pos = 0
        self._order = None

    def cardinality(self) -> int:
        return len(self._files)

    def save(self) -> object:
        return (self._epoch, self._pos)

    def restore(self, state: object) -> None:
        epoch, pos = cast(tuple[int, int], state)
        self._epoch, self._pos, self._order = int(epoch), int(pos), None

    @property
    def files(self) -> tuple[str, ...]:
        """All file names, unshuffled."""
        return self._files

    def __repr__(self) -> str:
        return (
            f"FileSplitProvider({len(self._files)} files, shuffle={self._shuffle}, "
            f"epoch={self._epoch}, pos={self._pos})"
        )


class RepeatSplitProvider:
    """The splits of `provider`, `count` times over (`repeat(count)` on the source).

    Between repetitions the inner provider is `reset()`. `count=None` repeats forever,
    except that a repetition that yields no split ends it (tf.data's rule for
    `repeat()` of an empty dataset, so it cannot spin).
    """

    def __init__(self, provider: SplitProvider, count: int | None) -> None:
        self._inner = provider
        self._count = None if count is None or count < 0 else int(count)
        self._repetition = 0
        self._produced = False  # a split came out in the current repetition

    def get_next(self) -> Any:
        while self._count is None or self._repetition < self._count:
            split = self._inner.get_next()
            if split is not None:
                self._produced = True
                return split
            if self._count is None and not self._produced:
                return None
            self._repetition += 1
            self._produced = False
            if self._count is not None and self._repetition >= self._count:
                return None
            self._inner.reset()
        return None

    def reset(self) -> None:
        self._inner.reset()
        self._repetition = 0
        self._produced = False

    def cardinality(self) -> int:
        n = self._inner.cardinality()
        if self._count is None:
            return 0 if n == 0 else INFINITE
        if self._count == 0:
            return 0
        if n in (INFINITE, UNKNOWN):
            return n
        return n * self._count

    def save(self) -> object:
        return (self._repetition, self._produced, self._inner.save())

    def restore(self, state: object) -> None:
        repetition, produced, inner = cast(tuple[int, bool, object], state)
        self._repetition, self._produced = int(repetition), bool(produced)
        self._inner.restore(inner)

    def __repr__(self) -> str:
        return (
            f"RepeatSplitProvider({self._inner!r}, count={self._count}, "
            f"repetition={self._repetition})"
        )
