"""One iteration of a distributed dataset, read by one consumer.

`DataServiceIterator` joins (or creates) the iteration at the dispatcher (`join.py`:
one call that also lists its tasks), heartbeats to learn of tasks added and lost,
runs one fetch thread per task (bounded by `max_outstanding_requests` and a results
buffer; the loop is `fetch.py`'s, the transfer client and protocol fallback
`connect.py`'s) and yields elements as they arrive. The iteration ends when the
dispatcher says it is finished, every fetch on its way from a live worker landed
and every element received was yielded (`_Reader._over_locked`).

Threads hold only `_Reader` (not the iterator), so an abandoned iterator is
garbage collected, which releases its iteration client and stops its threads.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import grpc

from dataservice import _waits, auth, errors
from dataservice.client import checkpoint, join
from dataservice.client.coordinated import CoordinatedReads
from dataservice.client.exactly_once import ExactlyOnceReceipts
from dataservice.client.fetch import TaskFetching, _FairSemaphore, _Fetched, _TaskState
from dataservice.client.stats import ReadStats, WorkerLossTracking, describe_missing_shards
from dataservice.locality import host_id
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import service_pb2_grpc
from dataservice.rpc import util as rpc_util
from dataservice.sharding import ShardingPolicy
from dataservice.transfer import base as transfer
from dataservice.transfer import grpc as _grpc_transfer  # noqa: F401  (registers "grpc")

log = logging.getLogger(__name__)

_START_WAIT_S = 0.5  # longest wait for the iteration's tasks to connect before the first element
_MAX_ELEMENTS_PER_FETCH = 1024
# close() of a shared read mid-epoch: how long it waits for fetches on their way
# (a fetch waits at most fetch.py's 1 s for elements), to count what they bring
# (exactly-once: to report them as received and not delivered, so they run again).
_CLOSE_FETCH_WAIT_S = 3.0
_RESULT_BUFFER_ELEMENTS = 8192
# A named job is shared first come, first served: a consumer must not take
# far more than it reads, so fetches and the local buffer stay small.
_SHARED_MAX_ELEMENTS_PER_FETCH = 8
_SHARED_RESULT_BUFFER_ELEMENTS = 64


@dataclass
class ReadOptions:
    """What the consumer asked for (from `distribute` / `from_dataset_id`)."""

    dispatcher_address: str
    processing_mode: int
    job_name: str
    num_consumers: int
    consumer_index: int
    max_outstanding_requests: int | None
    data_transfer_protocol: str | None
    target_workers: str
    client_timeout_ms: int
    auth_token: str | None = None
    trainer_id: str = ""  # set: read through the job's cross-trainer cache
    compression: str | None = "AUTO"  # distribute's argument, or join.REGISTERED
    zero_copy: bool = True  # shared memory: large arrays may be views of the ring
    # After the iteration lost its workers, or (static sharding) while a listed
    # worker's shard is read by nobody: how long next() waits for one to come
    # before raising WorkerCrashedError / MissingShardsError (ms); None: forever
    # (tf.data).
    worker_loss_timeout_ms: int | None = 60_000
    # Exactly-once DYNAMIC (client/exactly_once.py): elements arrive tagged.
    exactly_once: bool = False
    # Checkpoints (client/checkpoint.py): the dataset's fingerprint, the job
    # name as the user gave it, and the state this read resumes from (or None).
    fingerprint: str = ""
    user_job_name: str = ""
    resume: dict[str, Any] | None = None
    repetition: int = 0  # of the user's job (for the state; a resumed read keeps its own)


class _Reader(CoordinatedReads, WorkerLossTracking, ExactlyOnceReceipts, TaskFetching):
    """The shared state of one iterator's threads. Thread-safe (self._cv)."""

    def __init__(self, options: ReadOptions) -> None:
        self.options = options
        self.owner_pid = os.getpid()  # see check_process
        _live_readers.add(self)
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._wake_heartbeat = threading.Event()
        # The process's one channel to the dispatcher: never closed here.
        self._stub = service_pb2_grpc.DispatcherServiceStub(
            rpc_util.shared_channel(options.dispatcher_address)
        )
        # Sent to the dispatcher and to every worker (gRPC metadata, or proof of
        # it in the shared-memory handshake); see auth.client_token.
        self._token = auth.client_token(options.dispatcher_address, options.auth_token)
        auth.warn_if_sent_in_clear(
            options.dispatcher_address,
            self._token,
            rpc_util.channel_uses_tls(options.dispatcher_address),
        )
        self._metadata = rpc_util.call_metadata(self._token)
        limit = options.max_outstanding_requests
        self._outstanding = _FairSemaphore(limit) if limit else None
        self.incarnation = ""
        self.client_id = 0
        self.heartbeat_s = 0.5
        shared = bool(options.job_name)
        self._fetch_elements = _SHARED_MAX_ELEMENTS_PER_FETCH if shared else _MAX_ELEMENTS_PER_FETCH
        self._buffer_elements = (
            _SHARED_RESULT_BUFFER_ELEMENTS if shared else _RESULT_BUFFER_ELEMENTS
        )
        # guarded by self._cv:
        # Fetched elements, one entry per fetch, and the marks of ends and failure.
        self._results: collections.deque[_Fetched] = collections.deque()
        self._buffered_elements = 0  # in self._results
        self._fetched_after_close = 0  # elements of fetches that landed after close()
        self._buffered_bytes = 0
        self._ahead_elements = 0  # what requests sent ahead may bring (fetch.py)
        self._start_time = time.monotonic()
        self._started = False  # see _started_locked
        # Fetch threads connect at once but ask for no element before the
        # consumer's first next(), as tf.data's client starts its task threads
        # in the first GetNext: a worker restarted between iter() and next()
        # then serves its restarted task only, not also a chunk prefetched from
        # its previous process (conformance FT-09).
        self._consumer_asked = False
        # The chunk the consumer is taking elements from (the consumer's thread
        # only: next() takes them without the lock, one lock per fetch).
        self._chunk: list[Any] = []
        self._chunk_pos = 0
        self._chunk_nbytes = 0
        self._chunk_tags: list[Any] | None = None  # exactly-once: (split, seq) of each
        self._tasks: dict[int, _TaskState] = {}
        self._iteration_finished = False
        self._ended = False  # next() raised StopIteration (the iteration is over here)
        self._no_live_task_since: float | None = None  # since when no task can produce
        # Static sharding: the shards (pb.MissingShard) of listed workers that
        # nobody reads, as the last heartbeat said; the iteration waits for them.
        self._missing_shards: list[Any] = []
        self._dispatcher_waiting_for = ""  # ClientHeartbeatResponse.waiting_for
        # Workers a fetch could not reach since the last heartbeat (the
        # dispatcher probes them at once: a dead worker is dropped in < 1 s).
        self._unreachable: set[str] = set()
        self._error: BaseException | None = None
        self._heartbeat_thread: threading.Thread | None = None
        self.stats = ReadStats()
        # coordinated reads (the consumer's thread only):
        self.iteration_id = 0
        self.job_id = 0
        self._last_heartbeat_ok = time.monotonic()  # the heartbeat thread's; read for warnings
        self.coordination_timeout_s = 60.0
        self._init_rounds()
        self._init_receipts()

    # ------------------------------------------------------------ dispatcher calls
    def call(self, method: str, request: Any, timeout_ms: int | None = None) -> Any:
        return rpc_util.call_dispatcher(
            self._stub,
            method,
            request,
            address=self.options.dispatcher_address,
            metadata=self._metadata,
            timeout_ms=timeout_ms or self.options.client_timeout_ms,
            stop=self._stop,
        )

    def start(self, dataset_id: str, repetition: int) -> bool:
        """Joins the iteration (`join.join`, which lists its tasks: the fetches start
        before the first heartbeat); False if it was already read to its end."""
        joined = join.join(
            self.call,
            pb.GetOrCreateJobRequest(
                dataset_id=dataset_id,
                job_name=self.options.job_name,
                processing_mode=self.options.processing_mode,
                num_consumers=self.options.num_consumers,
                target_workers=self.options.target_workers,
                client_host_id=host_id(),
                use_cross_trainer_cache=bool(self.options.trainer_id),
                exactly_once=self.options.exactly_once,
                resumed=self.options.resume is not None,
                counters=self.stats.to_proto(self.options.consumer_index),
            ),
            repetition,
        )
        self.incarnation = joined.incarnation
        self.options.compression = join.read_compression(self.options.compression, joined)
        self.heartbeat_s = join.heartbeat_s(joined.client_timeout_ms)
        self.coordination_timeout_s = joined.client_timeout_ms / 1000
        iteration = joined.iteration
        self.client_id, self.iteration_id = iteration.iteration_client_id, iteration.iteration_id
        self.job_id = joined.job_id
        join.warn_if_late(joined, self.options.job_name, repetition, self.options.resume)
        if iteration.already_finished:
            self.release()
            return False
        if iteration.HasField("first_heartbeat"):
            self._on_heartbeat(iteration.first_heartbeat)
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop,
            args=(iteration.HasField("first_heartbeat"),),
            name="ds-client-heartbeat",
            daemon=True,
        )
        self._heartbeat_thread.start()
        return True

    def release(self) -> None:
        if not self.client_id:
            return
        client_id, self.client_id = self.client_id, 0
        request = pb.ReleaseIterationClientRequest(
            iteration_client_id=client_id, incarnation_id=self.incarnation
        )
        if self.options.exactly_once:
            with self._cv:
                self._eo_release_receipts_locked(request)
        request.counters.CopyFrom(self.stats.to_proto(self.options.consumer_index))
        try:
            self._stub.ReleaseIterationClient(request, timeout=2.0, metadata=self._metadata)
        except grpc.RpcError:
            pass  # the dispatcher times the client out instead

    # ------------------------------------------------------------ heartbeats
    def _heartbeat_loop(self, answered: bool) -> None:
        """Heartbeats every `heartbeat_s`, first after one if `answered` (`start`)."""
        last_ok = time.monotonic()
        said_gone = False
        if answered and self._wake_heartbeat.wait(self.heartbeat_s):
            self._wake_heartbeat.clear()
        while not self._stop.is_set():
            with self._cv:
                finished = [t for t, s in self._tasks.items() if s.finished]
                unreachable, self._unreachable = sorted(self._unreachable), set()
                counters = self.stats.to_proto(self.options.consumer_index)
            request = pb.ClientHeartbeatRequest(
                iteration_client_id=self.client_id,
                incarnation_id=self.incarnation,
                finished_tasks=finished,
                unreachable_workers=unreachable,
                counters=counters,
            )
            if self.options.exactly_once:
                with self._cv:
                    self._eo_fill_heartbeat_locked(request)
            try:
                response = self._stub.ClientHeartbeat(
                    request, timeout=10.0, metadata=self._metadata
                )
                last_ok = time.monotonic()
                self._last_heartbeat_ok = last_ok
                self._on_heartbeat(response)
            except grpc.RpcError as err:
                if err.code() in rpc_util.RETRYABLE:  # type: ignore[attr-defined]
                    # Known gone (a LocalCluster's dispatcher process exited): said at
                    # once; the read goes on with its workers until the timeout, as for
                    # a dispatcher that may come back.
                    gone = rpc_util.gone_reason(self.options.dispatcher_address)
                    if gone is not None and rpc_util.gone_with_its_workers(
                        self.options.dispatcher_address
                    ):
                        # Its workers were stopped with it: nothing is left to read from.
                        self._fail(
                            errors.UnavailableError(
                                f"lost the dispatcher at {self.options.dispatcher_address}: "
                                f"{gone}, and its workers were stopped with it"
                            )
                        )
                        return
                    if gone is not None and not said_gone:
                        said_gone = True
                        log.error(
                            "the dispatcher at %s is gone: %s; this read goes on with its "
                            "workers and fails if no dispatcher answers within %.0f s",
                            self.options.dispatcher_address,
                            gone,
                            self.options.client_timeout_ms / 1000,
                        )
                    timeout_s = self.options.client_timeout_ms / 1000
                    if time.monotonic() - last_ok > timeout_s:
                        self._fail(
                            errors.UnavailableError(
                                f"lost the dispatcher at {self.options.dispatcher_address}: no "
                                f"answer for {timeout_s:.1f} s "
                                + (f"({gone})" if gone else f"({err.details()})")  # type: ignore[attr-defined]
                            )
                        )
                        return
                else:
                    self._fail(
                        rpc_util.to_error(err, self.options.dispatcher_address, "ClientHeartbeat")
                    )
                    return
            if self._wake_heartbeat.wait(self.heartbeat_s):
                self._wake_heartbeat.clear()

    def _on_heartbeat(self, response: Any) -> None:
        if self.options.num_consumers:  # coordinated: next() reads round by round
            with self._cv:
                self._iteration_finished = response.iteration_finished
                self._cv.notify_all()
            return
        live = {t.task_id for t in response.tasks}
        to_start = []
        departed = response.elements_left_by_departed_consumers
        if departed > self.stats.left_by_departed:
            self.stats.left_by_departed = departed
        if self.options.exactly_once:
            with self._cv:
                # Closed before the loss is noted: what this consumer reports
                # as received from a lost process is final from here on.
                for r in response.lost_workers:
                    self._eo_close_locked(r.task_id, r.worker_uid)
                self._eo_on_heartbeat_locked(response)
        self._note_lost_workers(response.lost_workers)
        now = time.monotonic()
        revived = []
        with self._cv:
            for info in response.tasks:
                known = self._tasks.get(info.task_id)
                if known is not None:
                    known.worker_pid = info.worker_pid
                    known.heartbeats_on_time = info.worker_heartbeats_on_time
                    if not info.worker_silent_ms:
                        known.silent_since = None
                    elif known.silent_since is None:
                        known.silent_since = now - info.worker_silent_ms / 1000
                if known is not None and known.removed and not known.finished:
                    # Its worker was declared lost, then came back with the task.
                    known.removed = False
                    revived.extend(self._loss_taken_back_locked(info.task_id, response))
                    if known.thread is None or not known.thread.is_alive():
                        to_start.append(known)
                    continue
                if info.task_id not in self._tasks:
                    endpoint = transfer.TaskEndpoint(
                        info.task_id, info.worker_address, info.transfer_address, info.host_id
                    )
                    state = _TaskState(
                        endpoint,
                        worker_pid=info.worker_pid,
                        heartbeats_on_time=info.worker_heartbeats_on_time,
                    )
                    if info.worker_silent_ms:
                        state.silent_since = now - info.worker_silent_ms / 1000
                    self._tasks[info.task_id] = state
                    to_start.append(state)
            for task_id, state in self._tasks.items():
                if task_id not in live and not state.finished:
                    state.removed = True
            self._iteration_finished = response.iteration_finished
            self._missing_shards = list(response.missing_shards)
            self._dispatcher_waiting_for = response.waiting_for
            if live or response.iteration_finished:
                self._no_live_task_since = None
            elif self._no_live_task_since is None:
                self._no_live_task_since = time.monotonic()
            self._cv.notify_all()
        self._warn_losses_taken_back(revived)
        for state in to_start:
            state.thread = threading.Thread(
                target=self._fetch_loop,
                args=(state,),
                name=f"ds-client-fetch-{state.endpoint.task_id}",
                daemon=True,
            )
            state.thread.start()

    def _started_locked(self, now: float) -> bool:
        """Whether next() may hand out elements: from the first one on, once every
        task known then has tried to connect (or after `_START_WAIT_S`), so the
        first elements come from every worker in turn, as tf.data's round-robin
        client gives, not all from the one whose connection was up first (a
        shared-memory handshake maps a new ring: tens of ms)."""
        if self._started:
            return True
        if now - self._start_time >= _START_WAIT_S or all(
            s.tried or s.finished or s.removed for s in self._tasks.values()
        ):
            self._started = True
        return self._started

    def _fail(self, err: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = err
                self._results.append(_Fetched([], failed=True))
            self._cv.notify_all()

    # ------------------------------------------------------------ consuming
    @property
    def consumed_nothing(self) -> bool:
        return self.stats.elements == 0

    def next(self) -> Any:
        """The next element: from the current chunk without a lock, else the next
        fetched chunk (blocking until one arrives, the iteration ends, or fails)."""
        pos = self._chunk_pos
        chunk = self._chunk
        if pos < len(chunk):
            element = chunk[pos]
            chunk[pos] = None  # the consumer holds the only reference (views: leases)
            self._chunk_pos = pos + 1
            stats = self.stats
            stats.elements += 1
            stats.bytes += self._chunk_nbytes
            if self._chunk_tags is not None:
                self._eo_yielded_one(self._chunk_tags[pos])
            return element
        return self._next_chunk()

    def _what_iteration(self) -> str:
        name = f" {self.options.job_name!r}" if self.options.job_name else ""
        return (
            f"iteration {self.iteration_id} of job {self.job_id}{name} "
            f"(dispatcher {self.options.dispatcher_address})"
        )

    def _dispatcher_silence(self) -> str:
        """ "; no answer from the dispatcher for N s" once heartbeats go unanswered."""
        silent_s = time.monotonic() - self._last_heartbeat_ok
        if silent_s < max(2.0, 4 * self.heartbeat_s):
            return ""
        return (
            f"; the dispatcher at {self.options.dispatcher_address} has not answered "
            f"heartbeats for {silent_s:.0f} s (given up after client_timeout_ms="
            f"{self.options.client_timeout_ms})"
        )

    def _describe_wait_locked(self) -> str:
        """What next() waits for: which iteration, which workers (for SlowWait)."""
        live = sorted(
            {
                s.endpoint.worker_address
                for s in self._tasks.values()
                if not s.finished and not s.removed
            }
        )
        landing = sorted(
            f"{s.endpoint.worker_address} (task {s.endpoint.task_id})"
            for s in self._tasks.values()
            if s.removed and s.fetching
        )
        if self._iteration_finished and landing:
            what = (
                "the last reply from the workers "
                + ", ".join(landing[:8])
                + " (the iteration is finished; the reply is on its way)"
            )
        elif live:
            shown = ", ".join(live[:8]) + (f" and {len(live) - 8} more" if len(live) > 8 else "")
            what = f"an element from the workers {shown}"
            failing = sorted(
                {
                    f"{s.endpoint.worker_address} ({s.fetch_error})"
                    for s in self._tasks.values()
                    if s.fetch_error and not s.finished and not s.removed
                }
            )
            if failing:
                what += "; fetches keep failing from " + ", ".join(failing[:4])
            if self._dispatcher_waiting_for:
                what += "; the dispatcher says it waits for " + self._dispatcher_waiting_for
            now = time.monotonic()
            silent = sorted(
                {
                    f"{s.endpoint.worker_address} for {now - s.silent_since:.0f} s"
                    for s in self._tasks.values()
                    if s.silent_since is not None and not s.finished and not s.removed
                }
            )
            if silent:
                what += (
                    "; the dispatcher has had no heartbeat from "
                    + ", ".join(silent[:4])
                    + " (it declares a worker lost after its worker_timeout_ms; this consumer "
                    + (
                        "waits for ever: worker_loss_timeout_ms=None)"
                        if self.options.worker_loss_timeout_ms is None
                        else "raises WorkerCrashedError after worker_loss_timeout_ms="
                        f"{self.options.worker_loss_timeout_ms} of that)"
                    )
                )
        elif any(s.removed and not s.finished for s in self._tasks.values()):
            gone = sorted(
                {
                    s.endpoint.worker_address
                    for s in self._tasks.values()
                    if s.removed and not s.finished
                }
            )
            timeout_ms = self.options.worker_loss_timeout_ms
            what = (
                f"the lost workers {', '.join(gone[:8])} to come back "
                "(or another to take their tasks); "
                + (
                    "waiting forever (worker_loss_timeout_ms=None)"
                    if timeout_ms is None
                    else f"WorkerCrashedError after worker_loss_timeout_ms={timeout_ms}"
                )
            )
        elif self._dispatcher_waiting_for:
            what = self._dispatcher_waiting_for
        elif not self._missing_shards:
            what = (
                "a worker: no worker runs a task of it yet (is a worker registered with "
                "the dispatcher, and on this host for local reads?)"
            )
        else:
            what = ""
        if self._missing_shards:
            what += ("; and " if what else "") + (
                "the shards of listed workers that nobody reads (static sharding: the "
                "iteration ends once every listed worker's shard was read; given up after "
                f"worker_loss_timeout_ms={self.options.worker_loss_timeout_ms}): "
                + describe_missing_shards(self._missing_shards)
            )
        return (
            f"consumer of {self._what_iteration()} is waiting for {what}"
            + self._dispatcher_silence()
        )

    def check_process(self) -> None:
        """Raises in a process forked from the one that started this read.

        The fork copied the iterator but not its fetch and heartbeat threads
        (nothing would ever fill it) nor a consistent lock state (a lock a
        parent thread held stays held), so a wait here would be for ever.

        Raises:
            FailedPreconditionError: Says to make the iterator in the child.
        """
        if os.getpid() != self.owner_pid:
            raise errors.FailedPreconditionError(
                f"this iterator of {self.options.dispatcher_address} was created in process "
                f"{self.owner_pid}; process {os.getpid()} is a fork of it and cannot use it: "
                "create the iterator in the forked process (e.g. iter(dataset) inside a "
                "DataLoader worker or a Pool task)"
            )

    def _over_locked(self) -> bool:
        """Whether this consumer's iteration is over: the dispatcher says it
        finished, and every task ended here (its end of sequence taken) or was
        dropped by the dispatcher with no fetch from it on its way. A task of a
        shared job is dropped once any consumer took its end, which the worker
        gives only after every other reply of the task was taken out of the
        transport: a fetch then in flight here holds elements this consumer
        received, so they are yielded first. A lost worker's fetch is not waited
        for (it may hang until its transport's timeout): the loss is reported
        (`lost_workers`), and what such a fetch still brings is logged and
        counted (`elements_not_yielded`)."""
        if not self._iteration_finished:
            return False
        for state in self._tasks.values():
            if state.finished:
                continue
            if not state.removed:
                return False
            if state.fetching and not self._worker_lost_locked(state):
                return False
        return True

    def _worker_lost_locked(self, state: _TaskState) -> bool:
        """Whether the dispatcher reported the worker `state` fetches from as lost."""
        task_id = state.endpoint.task_id
        return any(
            key[3] == task_id and (not key[1] or not state.worker_uid or key[1] == state.worker_uid)
            for key in self.stats.lost
        )

    def _next_chunk(self) -> Any:
        self.check_process()  # before any lock: one held at fork is never released here
        start = time.monotonic()
        if self.stats.first_next_at is None:
            self.stats.first_next_at = start
        slow = _waits.SlowWait(log, self._describe_wait_locked, start=start)
        # When every task is finished or removed, the dispatcher is asked at once
        # whether the iteration is over, then after 0.05 s, 0.1 s, ... up to the
        # heartbeat interval: each heartbeat's answer wakes this loop, so asking
        # on every wake-up would ping-pong heartbeats with the dispatcher for the
        # whole `worker_loss_timeout_ms` (~0.4 core each side).
        ask_at, ask_delay_s = start, 0.05
        with self._cv:
            # next() blocks from here: status and stats() count the wait under way.
            self.stats.waiting_since = start
            try:
                if not self._consumer_asked:
                    self._consumer_asked = True
                    self._cv.notify_all()  # the fetch threads may ask for elements now
                while True:
                    # Once failed, what was fetched before the failure is handed out
                    # without waiting for the start barrier, then the error.
                    if self._results and (self._error is not None or self._started_locked(start)):
                        fetched = self._results.popleft()
                        origin = fetched.task
                        if fetched.failed:
                            self._results.clear()
                            raise self._error  # type: ignore[misc]
                        assert origin is not None  # only the failure's mark has none
                        if fetched.end:
                            # Consumed to the end: report it (the dispatcher then knows
                            # whether the iteration is over).
                            origin.finished = True
                            self._wake_heartbeat.set()
                            continue
                        self._unbuffer_locked(fetched, origin)
                        self.stats.wait_s += time.monotonic() - start
                        if self._buffered_elements < self._read_ahead_locked():
                            self._cv.notify_all()
                        self._chunk, self._chunk_pos = fetched.elements, 0
                        self._chunk_nbytes = fetched.nbytes_each
                        self._chunk_tags = fetched.tags
                        break
                    if self._error is not None:
                        raise self._error
                    if self._ended:
                        # Another thread's next() took the end (and closed the read
                        # with it): this one ends too, as a later next() would.
                        raise StopIteration
                    if self._stop.is_set():
                        raise errors.CancelledError("the iterator was closed")
                    if self._over_locked():
                        self._ended = True
                        self.stats.wait_s += time.monotonic() - start
                        self.warn_losses_at_end_locked()
                        raise StopIteration
                    now = time.monotonic()
                    if (
                        self._tasks
                        and now >= ask_at
                        and not self._iteration_finished
                        and (
                            # Exactly-once: the workers' tasks end once this
                            # consumer's receipts completed the last splits.
                            self.options.exactly_once
                            or all(s.finished or s.removed for s in self._tasks.values())
                        )
                    ):
                        self._wake_heartbeat.set()  # ask the dispatcher whether it is over
                        ask_at = now + ask_delay_s
                        ask_delay_s = min(ask_delay_s * 2, self.heartbeat_s)
                    self._check_worker_loss_locked(start)
                    self._check_unreachable_locked()
                    self._cv.wait(0.1)
                    slow.check()
            finally:
                self.stats.waiting_since = None
        if slow.warnings:
            slow.done(f"consumer of {self._what_iteration()}: an element arrived")
        return self.next()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake_heartbeat.set()
        with self._cv:
            unreturned = len(self._chunk) - self._chunk_pos if self._chunk else 0
            unreturned += sum(len(fetched.elements) for fetched in self._results)
            over = self._iteration_finished
            self._chunk = []  # drop fetched elements (and their shared-memory leases)
            self._results.clear()
            self._cv.notify_all()
            threads = [s.thread for s in self._tasks.values() if s.thread is not None]
        if self._heartbeat_thread is not None:
            threads.append(self._heartbeat_thread)
        shared = self.options.job_name and not self.options.num_consumers
        if rpc_util.gone_with_its_workers(self.options.dispatcher_address):
            shared = False  # the job went with its LocalCluster: nobody else reads it
        if shared and not over:
            # A fetch on its way brings elements no other consumer gets: waited for
            # (a worker with elements ready answers at once; one without, within
            # the fetch's wait), so that they are counted, or, exactly-once, are
            # among the receipts this consumer leaves with (their splits run again;
            # else a split leased after the release could reach only this consumer).
            deadline = time.monotonic() + _CLOSE_FETCH_WAIT_S
            with self._cv:
                while any(s.fetching for s in self._tasks.values()):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(min(left, 0.05))
                unreturned += self._fetched_after_close
        if unreturned and shared and not over and not self.options.exactly_once:
            # The job's other consumers go on without them: counted in their
            # stats() and end-of-epoch WARNING (the dispatcher sums them). Here
            # INFO: this consumer chose to stop, as with any iterator dropped early
            # (a WARNING per close() buried the logs of a loop that closes early).
            self.stats.left_unreturned = unreturned
            log.info(
                "consumer of %s leaves mid-epoch with %d elements it fetched and did not "
                "return: the job's other consumers do not get them (a shared read hands "
                "each element to one consumer, at most once, as tf.data service's; "
                "distribute(..., exactly_once=True) hands them to the others)",
                self._what_iteration(),
                unreturned,
            )
        self.release()
        self._close_round_clients()
        # Daemon threads: each ends within one fetch wait; don't hold the
        # caller for a thread stuck on a frozen worker.
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=0.2)


_live_readers: weakref.WeakSet[_Reader] = weakref.WeakSet()
"""Every read of this process, for `_forget_chunks_after_fork`."""


def _forget_chunks_after_fork() -> None:
    """In a forked child, empties each inherited read's current chunk, so that
    the child's next() reaches `check_process` at once rather than first
    handing out copies of elements the parent also consumes."""
    for reader in list(_live_readers):
        reader._chunk = []
        reader._chunk_pos = 0


os.register_at_fork(after_in_child=_forget_chunks_after_fork)


def _close_in_owner(reader: _Reader, owner_pid: int) -> None:
    """Closes `reader` in the process that created it only. A forked child (a
    DataLoader worker) inherits the parent's iterators but not their threads:
    their locks may be held for ever there, and the iteration's consumer is the
    parent, so the child's exit (or its garbage collection) leaves them alone."""
    if os.getpid() == owner_pid:
        reader.close()


class DataServiceIterator:
    """Iterator over one iteration of a distributed dataset.

    Yields the elements the workers produce (numpy values and nested structures
    of them), in each worker's order, interleaved across workers.

    Raises (from `__next__`):
        WorkerError: The pipeline raised on a worker, after the elements it
            produced before; also an instance of the original class where it
            can be found here (`except ValueError` works), with its args, its
            message once and the worker's traceback as `__cause__`
            (`errors.RemoteTraceback`); see `errors.WorkerError`.
        UnavailableError: The dispatcher could not be reached within the
            client timeout; the message names the address.
        DispatcherRestartedError: The dispatcher restarted without fault
            tolerance and lost this iteration.
        InvalidArgumentError / NotFoundError: Rejected by the dispatcher.
        WorkerCrashedError: The iteration's workers were lost and none is left
            to run it: at once when their supervisor (LocalCluster) gave up on
            them, else after `worker_loss_timeout_ms` of waiting (`distribute`).
            The message names each lost worker, its pid and how it was lost.
    """

    def __init__(self, options: ReadOptions, dataset_id: str, repetition: int) -> None:
        self._reader = _Reader(options)
        self._finalizer = weakref.finalize(self, _close_in_owner, self._reader, os.getpid())
        self.skip_empty_epoch = False
        # A resumed read (client/checkpoint.py): elements delivered before the
        # checkpoint, and (other than exactly-once) how many to skip first.
        self._resumed_elements = 0
        self._skip = 0
        if options.resume is not None:
            self._resumed_elements = options.resume["elements"]
            if options.exactly_once:
                self._reader._eo_preloaded = checkpoint.splits_of(options.resume)
            else:
                self._skip = self._resumed_elements
        try:
            if not self._reader.start(dataset_id, repetition):
                # A named job's repetition that other consumers read to the end.
                self.skip_empty_epoch = True
                self._done = True
            else:
                self._done = False
        except BaseException:
            self._finalizer()
            raise

    def __iter__(self) -> DataServiceIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            if self._reader.options.num_consumers:
                while self._skip:  # resumed: the rounds read before the checkpoint
                    self._reader.next_coordinated()
                    self._skip -= 1
                return self._reader.next_coordinated()
            while self._skip:  # resumed: the elements read before the checkpoint
                self._reader.next()
                self._skip -= 1
            return self._reader.next()
        except StopIteration:
            self._done = True
            self._reader.stats.ended_at = time.monotonic()
            if self._reader.options.job_name and self._reader.consumed_nothing:
                # Other consumers of the shared job may have taken this repetition:
                # an empty epoch here says nothing about the dataset (repeat goes on).
                self.skip_empty_epoch = True
            self._finalizer()
            raise
        except BaseException:
            self._done = True
            self._finalizer()
            raise

    def close(self) -> None:
        """Stops fetching and releases the iteration (also done on garbage collection)."""
        self._done = True
        self._finalizer()

    def state_dict(self) -> dict[str, Any]:
        """Where this read is: a small JSON-serialisable dict for the dataset's
        `load_state_dict`, whose next `iter()` then continues from here
        (torchdata's StatefulDataLoader convention; client/checkpoint.py and
        README "Checkpointing and visitation guarantees" give the semantics).
        Call it from the thread that calls `next()`.

        Returns:
            {"format", "dataset" (its fingerprint), "processing_mode",
             "exactly_once", "job_name", "elements" (returned by next() since
             the epoch began, across resumes), and for exactly-once reads
             "splits": [[split, [start, end, ...]], ...] (the sequence numbers
             of each split's elements returned)}.
        """
        options = self._reader.options
        if options.exactly_once:
            elements = self._resumed_elements + self._reader.stats.elements
            splits = self._reader._eo_delivered()
        else:
            # The skipped elements count in stats.elements as they are read.
            elements = self._reader.stats.elements + self._skip
            splits = None
        return checkpoint.make_state(
            dataset=options.fingerprint,
            processing_mode=ShardingPolicy(options.processing_mode).name,
            exactly_once=options.exactly_once,
            job_name=options.user_job_name,
            elements=elements,
            splits=splits,
            repetition=options.repetition,
        )

    def stats(self) -> dict[str, Any]:
        """Counters of this read.

        Returns:
            {"elements": int, "bytes": int (encoded bytes received),
             "wait_ms": float (time `__next__` spent blocked, ms, a wait under way included),
             "wait_s": float (the same, seconds),
             "wall_s": float (seconds since the first `__next__`; 0 before it),
             "wait_fraction": float (wait_s / wall_s: the share of the time since
                 the first `__next__` spent waiting for elements; 0 before it),
             "workers": {worker_address: {"transfer_protocol": "grpc" | "shm",
                                          "elements": int, "bytes": int}},
             "lost_workers": [{"address": str, "pid": int | None, "reason": str,
                               "task_id": int, "restarting": bool,
                               "splits_handed_out": int, "splits_lost": int,
                               "elements_received": int,
                               "elements_lost": int | None}, ...],
             "splits_lost": int, "elements_lost": int | None,
             "elements_not_yielded": int,
             "elements_left_by_departed_consumers": int, "errors_ignored": int}

            `lost_workers` lists each worker process the iteration lost,
            oldest first (the client also logs one WARNING for each). Under
            DYNAMIC sharding `splits_handed_out` is what the dispatcher handed
            the dead process; when every split is one element and this is the
            job's only consumer, `splits_lost` = `elements_lost` = those not
            received here, else `splits_lost` is the upper bound
            `splits_handed_out` and `elements_lost` None. The top-level
            `splits_lost` and `elements_lost` sum them over every lost process
            (`elements_lost` None when one of them is unknown); when a DYNAMIC
            iteration that lost splits ends, one WARNING says the same, with
            the share of the epoch lost. `elements_not_yielded` counts elements
            a lost worker's fetch brought after the iteration had ended here
            (each batch also logs a WARNING); every other element received is
            yielded. `elements_left_by_departed_consumers`: of a shared
            (named) job, the elements that consumers which left the iteration
            fetched and never returned (each said so when it closed; a killed
            one counts 0): no other consumer gets them (an exactly-once read
            hands them to the others: 0). `errors_ignored` sums the
            elements the pipeline's `ignore_errors` skipped in the tasks this consumer read, as each
            worker's last reply said (exact once the iteration ended here).
        """
        with self._reader._cv:
            return self._reader.stats_locked()
