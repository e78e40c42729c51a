"""Which source serves a read of a task's elements: the worker's one decision,
used by its gRPC servicer (`serving.py`) and, through `TransferHost.element_source`,
by the server of every other transfer protocol (`transfer/shm_server.py`).

A read naming a `trainer_id` takes from the task's cross-trainer cache at that
trainer's cursor (`CacheSource`); a coordinated read (`round_index` >= 0) takes its
consumer's element of that round (`RoundSource`); any other read takes from the
task's buffer, first come, first served (`BufferSource`), and what its consumer
never got goes back to that buffer. Source: tf.data service's
`DataServiceWorkerImpl::GetElementResult`, which makes the same choice.
"""

from __future__ import annotations

import time
from typing import Any

from dataservice import errors
from dataservice.rpc import validate
from dataservice.transfer.base import ElementSource, ReadRequest, TaskRead
from dataservice.transfer.shm import TrainerWindow
from dataservice.worker.task_runner import TaskRunner


class TaskSource(ElementSource):
    """An `ElementSource` over one of this worker's task runners (`runner`, whose
    acknowledged replies the gRPC servicer keeps). Thread-safe."""

    def __init__(self, runner: TaskRunner) -> None:
        self.runner = runner
        self.task_id = runner.task_id

    @property
    def stopped(self) -> bool:
        return self.runner.stopped

    @property
    def errors_ignored(self) -> int:
        return self.runner.errors_ignored


class BufferSource(TaskSource):
    """First come, first served: reads take elements out of the task's buffer, which
    the task's consumers share; undelivered ones go back to its front."""

    gives_back = True

    def read(self, max_elements: int, max_bytes: int, timeout_s: float) -> TaskRead:
        deadline = time.monotonic() + timeout_s
        read = self.runner.get_elements_raw(max_elements, max_bytes, timeout_s)
        return self._settled(read, deadline)

    def give_back(self, elements: list[Any]) -> None:
        self.runner.requeue(elements)

    def read_holding_end(self, max_elements: int, max_bytes: int, timeout_s: float) -> TaskRead:
        """`read`, and a read that ends the stream with elements holds the end
        (`TaskRead.end_held`) until `release_end`: what its consumer does not take
        goes back before the other consumers get the end."""
        deadline = time.monotonic() + timeout_s
        read = self.runner.get_elements_raw(max_elements, max_bytes, timeout_s, hold_end=True)
        return self._settled(read, deadline)

    def _settled(self, read: TaskRead, deadline: float) -> TaskRead:
        """`read`, without its end of sequence while replies of this task whose
        transfer failed (to any consumer, over any transport) still wait for their
        consumer's retry or were given back to the buffer
        (`UnackedReplies.settle_failed`): they are all that is left of the stream,
        and the end (or error) comes after them. A read's held end is released."""
        if not read.end_of_sequence:
            return read
        given_back, waiting = self.runner.unacked.settle_failed(
            max(0.0, deadline - time.monotonic())
        )
        if not (given_back or waiting):
            return read
        if read.end_held:
            self.runner.release_end_hold()
        return TaskRead(read.elements)

    def release_end(self) -> None:
        self.runner.release_end_hold()


class RoundSource(TaskSource):
    """A coordinated read: consumer `consumer_index`'s element of round `round_index`
    (one element; `max_elements` and `max_bytes` do not apply)."""

    def __init__(self, runner: TaskRunner, consumer_index: int, round_index: int) -> None:
        super().__init__(runner)
        self.consumer_index = consumer_index
        self.round_index = round_index

    def read(self, max_elements: int, max_bytes: int, timeout_s: float) -> TaskRead:
        return self.runner.get_round_element(
            self.consumer_index, self.runner.num_consumers, self.round_index, timeout_s
        )


class CacheSource(TaskSource):
    """A trainer's read through the task's cross-trainer cache, from its cursor on
    (decoded copies; same-host trainers may map the cache's window instead)."""

    def __init__(self, runner: TaskRunner, cache: Any, trainer_id: str) -> None:
        super().__init__(runner)
        self.cache = cache  # a CrossTrainerCache
        self.trainer_id = trainer_id
        # The last read's (first element's global index, count): one reader at a time
        # (a source serves one shared-memory connection, or one gRPC request).
        self._last = (0, 0)

    def read(self, max_elements: int, max_bytes: int, timeout_s: float) -> TaskRead:
        first, read = self.cache.read_elements(
            self.trainer_id, max_elements, timeout_s, max_bytes=max_bytes
        )
        self._last = (first, len(read.elements))
        return read

    def give_back_unacknowledged(self, count: int) -> None:
        first, n = self._last
        count = min(count, n)
        if count > 0:
            self.cache.give_back(self.trainer_id, first + n - count, count)

    def window(self) -> TrainerWindow | None:
        window: TrainerWindow | None = self.cache.trainer_window(self.trainer_id)
        return window


def choose_source(runner: TaskRunner, request: ReadRequest) -> TaskSource:
    """The source of `runner`'s task that serves `request` (see the module).

    Raises:
        FailedPreconditionError: The read does not fit the task: a trainer read of
            a task without a cross-trainer cache, a coordinated read of a task whose
            job has no `num_consumers` (or a consumer index past it), or a plain
            read of a coordinated task (`rpc.validate.check_read_fits_task`).
    """
    cache = runner.cross_trainer_cache
    validate.check_read_fits_task(request, runner.num_consumers, cache is not None)
    if request.trainer_id:
        if cache is None:
            raise errors.FailedPreconditionError(
                f"task {request.task_id} does not use a cross-trainer cache, but a "
                f"read for trainer {request.trainer_id!r} asked for one"
            )
        return CacheSource(runner, cache, request.trainer_id)
    if request.round_index >= 0:
        return RoundSource(runner, request.consumer_index, request.round_index)
    return BufferSource(runner)
