"""An exactly-once DYNAMIC task's elements on the worker (dataservice/exactly_once.py
says how the pieces fit).

`elements` leases splits from the dispatcher (GetSplits with `exactly_once`),
runs the pipeline once per split, and yields `(ordinal, seq, split, element,
generation)`: the split's ordinal, the element's sequence number within the
split, the split itself (an index or a file name: a checkpoint's key,
client/checkpoint.py), the element, and the lease's generation (which run of
the split: consumers drop the elements of a run the dispatcher replaced after a
consumer left). Sequence numbers a consumer already received (a split leased again
after its worker was lost: `SplitLease.skip`) are produced but not yielded, so
the pipeline must produce a split's elements in the same order every time
(deterministic, seeded randomness). The element counts of the splits run are
reported with the next GetSplits.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dataservice import errors
from dataservice import exactly_once as eo
from dataservice.data import graph
from dataservice.rpc import service_pb2 as pb
from dataservice.worker import splits

if TYPE_CHECKING:
    from dataservice.worker.server import WorkerServer

_MAX_LEASES = 64  # splits asked for in one GetSplits (doubling from 1)
_RAN_KEPT = 4 * _MAX_LEASES
_POLL_S = (0.01, 0.2)  # first and longest wait before asking again when none is free


class _OneSplit:
    """A split source that hands out one split, then ends."""

    def __init__(self, split: Any) -> None:
        self._split: Any = split

    def get_next(self) -> Any:
        split, self._split = self._split, None
        return split

    def get_next_batch(self) -> list[Any] | None:
        split = self.get_next()
        return None if split is None else [split]


def elements(worker: WorkerServer, task: Any, dataset: Any, stats: Any) -> Iterator[Any]:
    """Task `task`'s tagged elements: `(ordinal, seq, split, element, generation)` (see the module
    docstring), until the dispatcher says no split is left and no lease is open.

    Raises:
        DataServiceError: What `WorkerServer._call_dispatcher` raises, and what
            the pipeline raises.
    """
    produced: list[tuple[int, int]] = []
    # (ordinal, generation) -> elements, of the last `_RAN_KEPT` splits this process ran
    # (a duplicate lease comes in the same or the next GetSplits answer)
    ran: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
    queue: collections.deque[Any] = collections.deque()
    batch = 1
    wait_s = _POLL_S[0]
    fetcher = splits.RequestNumbers()
    while True:
        if not queue:
            numbers = fetcher.next()  # a retried attempt gets the same leases again
            request = pb.GetSplitsRequest(
                iteration_id=task.iteration_id,
                task_id=task.task_id,
                max_splits=batch,
                incarnation_id=worker._incarnation,
                exactly_once=True,
                worker_uid=worker._uid,
                fetcher_id=numbers[0],
                request_number=numbers[1],
            )
            for ordinal, count in produced:
                request.produced.add(ordinal=ordinal, count=count)
            try:
                response = worker._call_dispatcher("GetSplits", request)
            except errors.NotFoundError:
                return  # the iteration is gone: nothing more to read
            produced = []
            if not response.leases:
                if response.end_of_splits:
                    return
                # Leases are open elsewhere (a lost worker's splits may come
                # back): ask again shortly.
                time.sleep(wait_s)
                wait_s = min(wait_s * 2, _POLL_S[1])
                continue
            wait_s = _POLL_S[0]
            queue.extend(response.leases)
            batch = min(batch * 2, _MAX_LEASES)
        lease = queue.popleft()
        run = (lease.ordinal, lease.generation)
        if run in ran:
            # Leased to this process again (a dispatcher restarted between two journal
            # records): already run; its count goes back, its elements not twice.
            produced.append((lease.ordinal, ran[run]))
            continue
        split = lease.str_split if lease.is_str else lease.int_split
        skip = eo.unflatten(lease.skip)
        # Epoch = the repetition, so a split run again shuffles as it did the first time.
        iterator = graph.make_iterator(
            dataset, split_sources=(_OneSplit(split),), stats=stats, epoch=task.repetition
        )
        seq = 0
        try:
            for element in iterator:
                if not (skip and eo.contains(skip, seq)):
                    yield (lease.ordinal, seq, split, element, lease.generation)
                seq += 1
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        produced.append((lease.ordinal, seq))
        ran[run] = seq
        if len(ran) > _RAN_KEPT:
            ran.popitem(last=False)
