"""A DYNAMIC task's split sources on the worker: `split_sources` builds them, one
per splittable source of the task's pipeline, for
`data.graph.make_iterator(..., split_sources=...)`. They take the task's splits
from the dispatcher (`DispatcherService.GetSplits`) in growing batches, so the
pipeline reads splits without one RPC per element: `SplitFetcher` for a pipeline
with one source, `JointSplitFetch` (one RPC for all sources, equal counts of each)
for several. The RPC itself goes through the worker's `_call_dispatcher` (its
channel, token and retries). Each fetcher numbers its requests
(`GetSplitsRequest.fetcher_id`, `request_number`), so that a retried attempt of
one whose answer was lost (it timed out after the dispatcher granted it) gets
the same splits again instead of the next ones.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from concurrent import futures
from typing import TYPE_CHECKING, Any

from dataservice import errors
from dataservice.rpc import service_pb2 as pb

if TYPE_CHECKING:
    from dataservice.worker.server import WorkerServer

_FIRST_SPLIT_BATCH = 16
_MAX_SPLIT_BATCH = 4096  # the dispatcher grants at most 4096 a call, and half of what is left


class SplitFetcher:
    """A DYNAMIC task's split source: fetches splits from the dispatcher in
    growing batches (16, 32, ... 4096 per RPC), not one RPC per element, and
    asks for the next batch in the background as soon as it takes one, so the
    pipeline does not stop for a GetSplits round trip every batch. (That round
    trip takes 10-20 ms in a worker whose pipeline thread holds the GIL: each
    of the RPC's GIL acquisitions waits out a switch interval. A batch of 4096
    fast elements lasts about as long.)

    At most one batch is in flight; splits it brings are this task's, so a
    worker lost with a batch in hand or in flight loses at most those
    elements (DYNAMIC is at-most-once, as tf.data service's). One consumer
    thread (the task's producer).

    A pipeline with several sources (a zip of two) uses `JointSplitFetch`
    instead, so the inputs of a zip hold equal counts of splits.
    """

    def __init__(self, worker: WorkerServer, task: Any, provider_index: int = 0) -> None:
        self._worker = worker
        self._task = task
        self._provider_index = provider_index
        self._splits: list[Any] = []
        self._pos = 0
        self._batch = _FIRST_SPLIT_BATCH
        self._end = False  # the dispatcher has no split after self._splits
        self._next: futures.Future[tuple[list[Any], bool]] | None = None
        self._numbers = RequestNumbers()

    def get_next(self) -> Any:
        pos = self._pos
        if pos < len(self._splits):
            self._pos = pos + 1
            return self._splits[pos]
        if self._end:
            return None
        if not self._refill():
            return None
        return self.get_next()

    def get_next_batch(self) -> list[Any] | None:
        """The splits not yet taken from the current batch (or the next batch), all
        at once; None when there are no more (a source that turns a batch into
        elements without a Python call per split: `range`)."""
        if self._pos >= len(self._splits) and (self._end or not self._refill()):
            return None
        batch = self._splits[self._pos :] if self._pos else self._splits
        self._pos = len(self._splits)
        return batch

    def _refill(self) -> bool:
        """Takes the next batch (waiting for its RPC) and asks for the one after;
        False if there is none."""
        self._ask_next()
        assert self._next is not None
        pending, self._next = self._next, None
        self._splits, self._end = pending.result()  # raises what the RPC raised
        self._pos = 0
        self._ask_next()
        return bool(self._splits)

    def _ask_next(self) -> None:
        """Starts the GetSplits RPC for the next batch, unless one is in flight."""
        if self._next is not None or self._end:
            return
        batch = self._batch
        self._batch = min(batch * 2, _MAX_SPLIT_BATCH)
        pending: futures.Future[tuple[list[Any], bool]] = futures.Future()
        number = self._numbers.next()

        def fetch() -> None:
            try:
                pending.set_result(self._fetch(batch, number))
            except BaseException as err:  # delivered to the pipeline by get_next
                pending.set_exception(err)

        self._next = pending
        threading.Thread(target=fetch, name=f"ds-splits-{self._task.task_id}", daemon=True).start()

    def _fetch(self, batch: int, number: tuple[str, int]) -> tuple[list[Any], bool]:
        """One GetSplits RPC, request `number`: (splits, end_of_splits)."""
        got = _get_splits(self._worker, self._task, batch, [self._provider_index], number)
        if got is None:
            return [], True
        return _splits_of(got[0]), got[0].end_of_splits


class RequestNumbers:
    """A split fetcher's request numbers: (fetcher_id, 1), (fetcher_id, 2), ...
    (`GetSplitsRequest.fetcher_id`, `request_number`). The id is random, so a
    task's fetcher in a restarted worker process (or a second fetcher of one
    task) is not taken for this one."""

    def __init__(self) -> None:
        self._id = uuid.uuid4().hex
        self._count = itertools.count(1)

    def next(self) -> tuple[str, int]:
        return self._id, next(self._count)


def _get_splits(
    worker: WorkerServer,
    task: Any,
    max_splits: int,
    indices: list[int],
    number: tuple[str, int],
) -> list[Any] | None:
    """One GetSplits RPC for task `task`'s sources `indices`, as request
    `number` of its fetcher (`RequestNumbers`): one batch per index,
    in order (a `SplitBatch`, or for one source the response itself, which has
    the same fields); None when the dispatcher no longer knows the iteration
    (nothing more to read). Several sources get a joint grant: the same count
    of each source that has splits left.

    Raises:
        InternalError: The answer does not have one batch per source asked for.
        DataServiceError: What `WorkerServer._call_dispatcher` raises.
    """
    request = pb.GetSplitsRequest(
        iteration_id=task.iteration_id,
        task_id=task.task_id,
        max_splits=max_splits,
        incarnation_id=worker._incarnation,
        fetcher_id=number[0],
        request_number=number[1],
    )
    if len(indices) == 1:
        request.split_provider_index = indices[0]
    else:
        request.joint_split_provider_indices.extend(indices)
    try:
        response = worker._call_dispatcher("GetSplits", request)
    except errors.NotFoundError:
        return None
    if len(indices) == 1:
        return [response]
    if len(response.batches) != len(indices):
        raise errors.InternalError(
            f"GetSplits answered {len(response.batches)} batches for the "
            f"{len(indices)} sources {indices} asked for"
        )
    return list(response.batches)


def _splits_of(batch: Any) -> list[Any]:
    """The splits of a `GetSplitsResponse` or `SplitBatch`: file names or indices."""
    return list(batch.int_splits) or list(batch.str_splits)


class JointSplitFetch:
    """The split sources of a pipeline with several (`Dataset.zip((a, b))`,
    `concatenate`, `sample_from_datasets`): one GetSplits RPC asks for all of them,
    and the dispatcher grants the same count of each source that has splits left.

    Why joint: a zip on a worker pairs its k-th element of each input, and ends
    when one input does. Sources fetched one by one race across workers (worker A
    takes a's last batch, worker B then b's), and a worker whose zip ended on
    one input would drop the splits it holds of the other: a zip of two
    40-element sources lost elements in about 1 run in 10. With equal grants,
    inputs of equal length run out together on every worker; for inputs of
    unequal length what is dropped is, as in a local zip, the longer input's
    excess. Batches grow as `SplitFetcher`'s; they are asked for in the
    pipeline's thread when the source being read runs dry (no prefetch: a
    prefetched batch would be held away from other workers, the race again).
    One consumer thread (the task's producer).
    """

    def __init__(self, worker: WorkerServer, task: Any, num_sources: int) -> None:
        self._worker = worker
        self._task = task
        self._splits: list[list[Any]] = [[] for _ in range(num_sources)]
        self._pos = [0] * num_sources
        self._end = [False] * num_sources
        self._batch = _FIRST_SPLIT_BATCH
        self._numbers = RequestNumbers()
        self.sources = tuple(_JointSource(self, i) for i in range(num_sources))

    def _take(self, index: int, whole: bool) -> Any:
        """The next split of source `index` (all its splits in hand if `whole`);
        None when it has no more."""
        while self._pos[index] >= len(self._splits[index]):
            if self._end[index]:
                return None
            self._refill()
        pos = self._pos[index]
        splits = self._splits[index]
        if whole:
            self._pos[index] = len(splits)
            return splits[pos:] if pos else splits
        self._pos[index] = pos + 1
        return splits[pos]

    def _refill(self) -> None:
        """One joint GetSplits for every source not yet ended; what a source had
        not read yet stays ahead of what arrives."""
        open_indices = [i for i, end in enumerate(self._end) if not end]
        batch = self._batch
        self._batch = min(batch * 2, _MAX_SPLIT_BATCH)
        batches = _get_splits(self._worker, self._task, batch, open_indices, self._numbers.next())
        if batches is None:  # the iteration is gone: nothing more to read
            for i in open_indices:
                self._end[i] = True
            return
        for i, got in zip(open_indices, batches, strict=True):
            left = self._splits[i][self._pos[i] :]
            self._splits[i] = left + _splits_of(got)
            self._pos[i] = 0
            self._end[i] = got.end_of_splits


class _JointSource:
    """Source `index` of a `JointSplitFetch`, with a `SplitFetcher`'s interface."""

    def __init__(self, fetch: JointSplitFetch, index: int) -> None:
        self._fetch = fetch
        self._index = index

    def get_next(self) -> Any:
        return self._fetch._take(self._index, whole=False)

    def get_next_batch(self) -> list[Any] | None:
        """As `SplitFetcher.get_next_batch`."""
        batch: list[Any] | None = self._fetch._take(self._index, whole=True)
        return batch


def split_sources(worker: WorkerServer, task: Any, num_sources: int) -> tuple[Any, ...]:
    """The split sources of DYNAMIC task `task`, whose pipeline has `num_sources`
    splittable sources (`graph.num_split_sources`), in split-source order."""
    if num_sources == 1:
        return (SplitFetcher(worker, task, 0),)
    return JointSplitFetch(worker, task, num_sources).sources
