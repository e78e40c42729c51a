"""A DYNAMIC task's split source on the worker: `SplitFetcher` takes the task's
splits from the dispatcher (`DispatcherService.GetSplits`) in growing batches, so
that the task's pipeline (`data.graph.make_iterator(..., split_sources=...)`) reads
splits without one RPC per element. `WorkerServer._start_task` makes one per split
source of the task's pipeline; the RPC itself goes through the worker's
`_call_dispatcher` (its channel, token and retries).
"""

from __future__ import annotations

import threading
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

    Without `prefetch` (a pipeline with several split sources, e.g. a zip of
    two), each batch is asked for when the last one is used up, in the
    pipeline's thread: the sources of a zip then ask in the same order on every
    worker and get equal batches, so no worker's zip ends on one side while
    holding splits of the other (with background requests racing across
    workers, a zip of two 40-element sources lost elements in 2 of 16 runs)."""

    def __init__(
        self, worker: WorkerServer, task: Any, provider_index: int = 0, prefetch: bool = True
    ) -> None:
        self._worker = worker
        self._prefetch = prefetch
        self._task = task
        self._provider_index = provider_index
        self._splits: list[Any] = []
        self._pos = 0
        self._batch = _FIRST_SPLIT_BATCH
        self._end = False  # the dispatcher has no split after self._splits
        self._next: futures.Future[tuple[list[Any], bool]] | None = None

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
        if self._prefetch:
            self._ask_next()
        return bool(self._splits)

    def _ask_next(self) -> None:
        """Starts the GetSplits RPC for the next batch, unless one is in flight."""
        if self._next is not None or self._end:
            return
        batch = self._batch
        self._batch = min(batch * 2, _MAX_SPLIT_BATCH)
        pending: futures.Future[tuple[list[Any], bool]] = futures.Future()

        def fetch() -> None:
            try:
                pending.set_result(self._fetch(batch))
            except BaseException as err:  # delivered to the pipeline by get_next
                pending.set_exception(err)

        self._next = pending
        threading.Thread(target=fetch, name=f"ds-splits-{self._task.task_id}", daemon=True).start()

    def _fetch(self, batch: int) -> tuple[list[Any], bool]:
        """One GetSplits RPC: (splits, end_of_splits)."""
        request = pb.GetSplitsRequest(
            iteration_id=self._task.iteration_id,
            task_id=self._task.task_id,
            max_splits=batch,
            incarnation_id=self._worker._incarnation,
            split_provider_index=self._provider_index,
        )
        try:
            response = self._worker._call_dispatcher("GetSplits", request)
        except errors.NotFoundError:
            return [], True
        return list(response.int_splits) or list(response.str_splits), response.end_of_splits
