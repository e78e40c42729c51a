"""Coordinated reads: consumers of a job with `num_consumers` read round by round.

As tf.data service's coordinated reads: every consumer reads round r from the same
worker, each its own element (`consumer_index`) of that worker's round, so that
consumers training in lockstep get batches of the same size. `CoordinatedReads`
(a part of `reader._Reader`, on the consumer's thread only) owns the rounds: which
task serves which round (asked of the dispatcher per block of rounds, `GetRounds`),
a gRPC transfer client per task, and the next round to read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dataservice import _waits, errors
from dataservice.client.stats import ReadStats, WorkerStats
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import util as rpc_util
from dataservice.transfer import base as transfer

if TYPE_CHECKING:
    from dataservice.client.reader import ReadOptions

# The read logs under one name, the reader's, whichever module does the work.
log = logging.getLogger("dataservice.client.reader")

# One round's request, as the reader's other fetches: its wait for the element (s),
# and the most bytes it asks for (a larger element still comes).
_ROUND_WAIT_S = 1.0
_ROUND_MAX_BYTES = 16 << 20


class CoordinatedReads:
    """Round-by-round reading of one consumer: a part of `reader._Reader`, whose
    state below it reads. The consumer's thread only."""

    options: ReadOptions
    stats: ReadStats
    iteration_id: int
    incarnation: str
    coordination_timeout_s: float  # how long a round may take (client_timeout_ms)
    _cv: threading.Condition
    _stop: threading.Event
    _error: BaseException | None
    _iteration_finished: bool
    _token: str | None
    call: Callable[..., Any]
    _what_iteration: Callable[[], str]
    _dispatcher_silence: Callable[[], str]
    check_process: Callable[[], None]

    def _init_rounds(self) -> None:
        """Sets up the round state (from the reader's __init__)."""
        self._round = 0
        self._round_tasks: dict[int, int] = {}
        self._endpoints: dict[int, transfer.TaskEndpoint] = {}
        self._round_clients: dict[int, transfer.TransferClient] = {}

    def _round_task(self, round_index: int, dead_task_id: int = 0) -> int:
        """The task serving `round_index` (asks the dispatcher per block of rounds)."""
        if not dead_task_id and round_index in self._round_tasks:
            return self._round_tasks[round_index]
        response = self.call(
            "GetRounds",
            pb.GetRoundsRequest(
                iteration_id=self.iteration_id,
                first_round=round_index,
                dead_task_id=dead_task_id,
                incarnation_id=self.incarnation,
            ),
        )
        for info in response.tasks:
            if info.task_id not in self._round_clients:
                self._endpoints[info.task_id] = transfer.TaskEndpoint(
                    info.task_id, info.worker_address, info.transfer_address, info.host_id
                )
        for i, task_id in enumerate(response.task_ids):
            self._round_tasks[response.first_round + i] = task_id
        while len(self._round_tasks) > 4096:  # forget old rounds
            del self._round_tasks[min(self._round_tasks)]
        return self._round_tasks.get(round_index, 0)

    def _round_client(self, task_id: int) -> transfer.TransferClient:
        client = self._round_clients.get(task_id)
        if client is None:
            endpoint = self._endpoints[task_id]
            client = transfer.make_client("grpc", endpoint, self._token)
            self._round_clients[task_id] = client
        return client

    def next_coordinated(self) -> Any:
        """Consumer `consumer_index`'s element of the next round (tf.data
        service's coordinated reads): every consumer reads round r from the
        same worker, each its own element of that worker's round.

        Raises:
            DeadlineExceededError: The round was not ready within the
                dispatcher's client_timeout_ms: another consumer stopped reading.
                Time spent waiting for the dispatcher's GetRounds answer (it
                restarting, frozen or cut off from the network) does not count:
                it says nothing about the other consumers.
            FailedPreconditionError: The round was already read (a restarted
                consumer set on an old job name).
            WorkerCrashedError: The worker serving the round could not be
                reached for `worker_loss_timeout_ms` and no other took it.
        """
        self.check_process()  # a forked copy of this read raises, never waits
        start = time.monotonic()
        if self.stats.first_next_at is None:
            self.stats.first_next_at = start
        with self._cv:  # status and stats() count the wait under way
            self.stats.waiting_since = start
        try:
            return self._next_round(start)
        finally:
            with self._cv:
                self.stats.waiting_since = None

    def _next_round(self, start: float) -> Any:
        """`next_coordinated`'s read of the next round, next() blocked since `start`."""
        round_index = self._round
        dead = 0
        backoff = rpc_util.Backoff(0.05, 0.5)
        task_of_round = [0]
        # Since when no worker could be reached for this round: past
        # `worker_loss_timeout_ms` the read fails, as an uncoordinated one does.
        unreachable_since: float | None = None
        dispatcher_s = 0.0  # spent waiting for GetRounds answers (s)
        slow = _waits.SlowWait(
            log,
            lambda: (
                f"consumer {self.options.consumer_index} of {self.options.num_consumers} of "
                f"{self._what_iteration()} is waiting for round {round_index} "
                + (
                    f"from the worker {self._endpoints[task_of_round[0]].worker_address} "
                    "(every consumer must read every round)"
                    if task_of_round[0] in self._endpoints
                    else "(no worker has a task for it yet)"
                )
                + self._dispatcher_silence()
            ),
            start=start,
        )
        while True:
            slow.check()
            if self._stop.is_set():
                raise errors.CancelledError("the iterator was closed")
            with self._cv:
                if self._error is not None:
                    raise self._error
                if self._iteration_finished:
                    raise StopIteration
            waited = time.monotonic() - start - dispatcher_s
            if waited > self.coordination_timeout_s:
                raise errors.DeadlineExceededError(
                    f"coordinated read: consumer {self.options.consumer_index} of "
                    f"{self.options.num_consumers} waited {waited:.1f} s for round "
                    f"{round_index} of job {self.options.job_name!r}; another consumer may "
                    "have stopped reading (every consumer must read every round)"
                )
            asked = time.monotonic()
            task_id = self._round_task(round_index, dead)
            dispatcher_s += time.monotonic() - asked
            task_of_round[0] = task_id
            dead = 0
            if not task_id:
                backoff.sleep(time.monotonic() + 0.5, self._stop)
                continue
            try:
                result = self._round_client(task_id).get_elements(
                    1,
                    _ROUND_MAX_BYTES,
                    _ROUND_WAIT_S,
                    consumer_index=self.options.consumer_index,
                    round_index=round_index,
                )
            except errors.WorkerError:
                # The pipeline raised, even one of the retried types below (a missing
                # file is NotFoundError): the consumer's error, not the transfer's.
                raise
            except (errors.UnavailableError, errors.NotFoundError) as err:
                log.debug("round %d on task %d: %s", round_index, task_id, err)
                now = time.monotonic()
                if unreachable_since is None:
                    unreachable_since = now
                loss_timeout_ms = self.options.worker_loss_timeout_ms
                if loss_timeout_ms is not None and now - unreachable_since > loss_timeout_ms / 1000:
                    address = self._endpoints[task_id].worker_address
                    raise errors.WorkerCrashedError(
                        f"coordinated read: consumer {self.options.consumer_index} of "
                        f"{self.options.num_consumers} could not reach the worker of round "
                        f"{round_index} ({address}, task {task_id}) for "
                        f"{now - unreachable_since:.1f} s (worker_loss_timeout_ms="
                        f"{loss_timeout_ms}), and no other worker took the round: {err}"
                    ) from err
                dead = task_id
                backoff.sleep(time.monotonic() + 0.5, self._stop)
                continue
            except errors.TransferStalledError:
                raise  # the link cannot carry the element (transfer/grpc.py): not retried
            except (errors.DeadlineExceededError, errors.CancelledError) as err:
                # The reply did not arrive (the worker sent nothing for the no-progress
                # timeout): ask again, with the same sequence number, for the same element.
                log.debug("round %d on task %d: %s", round_index, task_id, err)
                backoff.sleep(time.monotonic() + 0.5, self._stop)
                continue
            unreachable_since = None
            if result.errors_ignored:
                with self._cv:
                    key = (task_id, result.worker_uid)
                    ignored = self.stats.errors_ignored
                    ignored[key] = max(ignored.get(key, 0), result.errors_ignored)
            if result.elements:
                slow.done(f"round {round_index} of {self._what_iteration()} arrived")
                self._round += 1
                with self._cv:
                    self.stats.elements += 1
                    self.stats.bytes += result.nbytes
                    self.stats.wait_s += time.monotonic() - start
                    self.stats.waiting_since = None
                    endpoint = self._endpoints[task_id]
                    w = self.stats.workers.setdefault(endpoint.worker_address, WorkerStats("grpc"))
                    w.elements += 1
                    w.bytes += result.nbytes
                return result.elements[0]
            if result.end_of_sequence:
                raise StopIteration

    def _close_round_clients(self) -> None:
        """Closes the transfer clients of the rounds' tasks (the reader's close)."""
        for client in list(self._round_clients.values()):
            client.close()
