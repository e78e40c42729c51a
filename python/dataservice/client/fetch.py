"""Fetching one task's elements: the fetch thread that `reader._Reader` runs per
task of the iteration, and what it shares with the consumer's thread.

A fetch thread connects to its task's worker (`connect.py`: the transfer client
and the protocol fallback), then asks for elements whenever the consumer has
asked for its first one and the results queue (`_Fetched` entries, in the
order fetched) is under its bounds: the read-ahead (`_read_ahead_locked`, which
grows with what the consumer took), `_RESULT_BUFFER_BYTES`, and the transfer
client's own bound on unconsumed bytes; at most `max_outstanding_requests`
fetches run at once (`_FairSemaphore`, served in arrival order). Without that
bound, and for a job of its own, a full reply that leaves room under those bounds
sends the next request at once (`TransferClient.request_ahead`), counted in them
until its reply lands: the worker prepares it while the consumer uses this one,
and the reader is never further ahead of its consumer than a read without it.
A worker that cannot be reached is retried with backoff and reported to the
dispatcher (the heartbeat thread asks at once); a worker that restarted has the
elements fetched from its previous process dropped when the task starts over
there (not under DYNAMIC sharding, whose restarted task reads new splits: they
are yielded); a pipeline error ends the read after what was fetched before it.

`TaskFetching` is a part of `reader._Reader`, whose state (declared below) it
reads and writes under `_cv`. This module may import `connect`, `stats`,
`transfer`, `rpc`, `sharding` and `errors`, never `reader.py` at run time.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dataservice import errors
from dataservice.client import connect
from dataservice.client.stats import ReadStats, WorkerStats
from dataservice.rpc import util as rpc_util
from dataservice.sharding import ShardingPolicy
from dataservice.transfer import base as transfer

if TYPE_CHECKING:
    from dataservice.client.reader import ReadOptions

# The read logs under one name, the reader's, whichever module does the work.
log = logging.getLogger("dataservice.client.reader")

_FETCH_WAIT_S = 1.0
# A forced protocol that cannot reach a worker fails the read, but only after
# this long: a worker that just died is reported first (WorkerCrashedError).
_FORCED_CONNECT_GRACE_S = 3.0
# Failures of the connection to a worker (not of its pipeline): refused, no route,
# connect timeout, a link that died under a call (keepalive, rpc/util.py).
_LINK_ERRORS = (errors.UnavailableError, ConnectionError)
_RESULT_BUFFER_BYTES = 128 << 20


class _FairSemaphore:
    """A counting semaphore that serves its waiters in arrival order, so that
    with `max_outstanding_requests` below the number of tasks every task's
    fetch thread gets its turn (a plain Semaphore let the thread that just
    released it take it again, and one worker served the whole read)."""

    def __init__(self, value: int) -> None:
        self._cv = threading.Condition()
        self._free = value  # guarded by self._cv
        self._waiters: collections.deque[object] = collections.deque()  # guarded by self._cv

    def acquire(self, timeout: float) -> bool:
        """Takes a unit, waiting up to `timeout` s behind earlier waiters."""
        me = object()
        deadline = time.monotonic() + timeout
        with self._cv:
            self._waiters.append(me)
            while not (self._free > 0 and self._waiters[0] is me):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._waiters.remove(me)
                    self._cv.notify_all()
                    return False
                self._cv.wait(remaining)
            self._waiters.popleft()
            self._free -= 1
            self._cv.notify_all()
            return True

    def release(self) -> None:
        with self._cv:
            self._free += 1
            self._cv.notify_all()


@dataclass
class _Fetched:
    """An entry of the results queue: one fetch's `elements` from `task`, each
    counted as `nbytes_each` bytes; or (no elements) the mark that `task`'s stream
    `end`s here, or that the iteration `failed` here (`_Reader._error`; no task):
    what was fetched before comes first, as tf.data raises an error where the
    pipeline reached it, and nothing fetched after it is handed out."""

    elements: list[Any]
    nbytes_each: int = 0
    task: _TaskState | None = None
    end: bool = False
    failed: bool = False
    # Exactly-once reads: each element's (split ordinal, sequence number): what next()
    # returned, for receipts and checkpoints.
    tags: list[Any] | None = None


@dataclass
class _TaskState:
    endpoint: transfer.TaskEndpoint
    thread: threading.Thread | None = None
    finished: bool = False  # the consumer took every element, up to the end
    removed: bool = False  # the dispatcher dropped it (worker lost)
    protocol: str = ""
    unconsumed_bytes: int = 0  # fetched from this task, not yet taken by next()
    max_unconsumed_bytes: int = _RESULT_BUFFER_BYTES  # the transfer client's bound
    max_reply_bytes: int = 16 << 20  # the transfer client's (TransferClient)
    tried: bool = False  # its first connection attempt is over (made or failed)
    worker_uid: str = ""  # the worker process the last fetched elements came from
    fetch_error: str = ""  # why the last fetch failed; "" once one succeeds (for warnings)
    worker_pid: int = 0  # as the dispatcher knows it (0: unknown)
    # A fetch is on its way (decided under `_cv` with `removed` false, until its
    # result is in the results queue or it failed): the iteration does not end
    # before it lands, even if the task finished meanwhile (another consumer of a
    # shared job got its end of sequence) and the dispatcher dropped it.
    fetching: bool = False
    # time.monotonic() since which the dispatcher has not heard from the
    # task's worker (None: it heartbeats on time)
    silent_since: float | None = None
    # the dispatcher's last word: the worker is registered, not restarting, and
    # heartbeats on time (TaskInfo.worker_heartbeats_on_time)
    heartbeats_on_time: bool = False
    # time.monotonic() since which every connection to the worker failed (refused,
    # no route, timed out, a dead link: `_LINK_ERRORS`); None once a fetch got through
    unreachable_since: float | None = None
    reached: bool = False  # a fetch from the worker got through
    # A request sent ahead (`request_ahead`), until its reply lands or it fails: the
    # most elements and bytes it may bring, counted in the bounds (the elements in
    # `_Reader._ahead_elements` too).
    ahead_elements: int = 0
    ahead_bytes: int = 0


class TaskFetching:
    """The fetch threads' methods of one consumer's read: a part of
    `reader._Reader`, whose state below they read; the `_locked` methods expect
    `_cv` held."""

    options: ReadOptions
    stats: ReadStats
    _cv: threading.Condition
    _stop: threading.Event
    _fetched_after_close: int
    _wake_heartbeat: threading.Event
    _token: str | None
    _outstanding: _FairSemaphore | None
    _fetch_elements: int
    _buffer_elements: int
    _results: collections.deque[_Fetched]
    _buffered_elements: int
    _buffered_bytes: int
    _ahead_elements: int
    _consumer_asked: bool
    _ended: bool
    iteration_id: int
    _tasks: dict[int, _TaskState]
    _unreachable: set[str]
    _fail: Callable[[BaseException], None]

    if TYPE_CHECKING:  # client/exactly_once.py

        def _eo_accept_locked(
            self, task_id: int, worker_uid: str, elements: list[Any]
        ) -> tuple[list[Any], list[Any]]: ...

    def _connect(self, endpoint: transfer.TaskEndpoint) -> transfer.TransferClient:
        """A transfer client for `endpoint` (`connect.connect`: "auto" tries shared
        memory on the same host, then gRPC).

        Raises:
            UnavailableError: A forced protocol cannot reach the worker.
            NotFoundError: An unknown protocol was requested.
        """
        options = self.options
        return connect.connect(
            endpoint,
            options.data_transfer_protocol,
            self._token,
            zero_copy=options.zero_copy,
            trainer_id=options.trainer_id,
            compression=options.compression,
        )

    def _fetch_loop(self, state: _TaskState) -> None:
        endpoint = state.endpoint
        forced_error: errors.UnavailableError | None = None
        forced_at = 0.0
        try:
            client: transfer.TransferClient | None = self._connect(endpoint)
        except errors.DataServiceError as err:
            if isinstance(err, errors.UnavailableError):
                client = None  # the worker may be restarting: retried below
                if self.options.data_transfer_protocol not in (None, "auto"):
                    # Retried for a grace period: if the worker died, the
                    # dispatcher's word on it (WorkerCrashedError, or the task
                    # removed) comes first; else the forced protocol cannot work.
                    forced_error, forced_at = err, time.monotonic()
            else:
                self._fail(err)
                return
        finally:
            with self._cv:
                state.tried = True
                self._cv.notify_all()
        if client is not None:
            self._connected(state, client)
        backoff = rpc_util.Backoff(0.05, 1.0)
        # Requests sent ahead: not with bounded requests in flight; nor for a shared
        # job, whose small fetches are first come, first served among its consumers.
        ahead = self._outstanding is None and not self.options.job_name
        want = max_bytes = 1
        asked = (want, max_bytes)  # the request whose reply comes next
        try:
            while not self._stop.is_set():
                with self._cv:
                    sent_ahead = state.ahead_elements > 0  # within the bounds when sent
                    while (
                        not self._stop.is_set()
                        and not sent_ahead
                        and (
                            not self._consumer_asked
                            or self._buffered_elements + self._ahead_elements
                            >= self._read_ahead_locked()
                            or self._buffered_bytes >= _RESULT_BUFFER_BYTES
                            or state.unconsumed_bytes >= state.max_unconsumed_bytes
                        )
                    ):
                        self._cv.wait(0.5)
                    if state.removed or self._stop.is_set():
                        return
                    state.fetching = True
                    if sent_ahead:
                        asked = (state.ahead_elements, state.ahead_bytes)
                    else:
                        want = max(1, min(self._fetch_elements, self._room_locked()))
                        if self.stats.elements == 0 and not self._buffered_elements:
                            # The consumer waits for its first element: a worker answers
                            # with every element it has ready, and 16 150 KB images
                            # encoded and sent before the first is handed out cost it
                            # 10-25 ms over gRPC; the next fetch asks for the read-ahead.
                            want = 1
                        # (at least one element is always sent, whatever its size)
                        max_bytes = max(1, self._byte_room_locked(state, ahead))
                        asked = (want, max_bytes)
                if self._outstanding is not None:
                    while not self._outstanding.acquire(timeout=0.5):
                        if self._stop.is_set() or state.removed:
                            self._fetch_over(state)
                            return
                try:
                    if client is None:  # reconnect (a restarted worker needs a new handshake)
                        client = self._connect(endpoint)
                        self._connected(state, client)
                        forced_error = None
                    result = client.get_elements(
                        want, max_bytes, _FETCH_WAIT_S, trainer_id=self.options.trainer_id
                    )
                except (errors.TransferStalledError, errors.WorkerError):
                    # The link cannot carry the reply (transfer/grpc.py), or the
                    # pipeline raised (even one of the types retried below: a missing
                    # file is NotFoundError): retrying cannot help; the consumer gets
                    # the error.
                    if self._outstanding is not None:
                        self._outstanding.release()
                    raise
                except (
                    errors.UnavailableError,
                    errors.NotFoundError,
                    errors.DeadlineExceededError,
                    errors.CancelledError,
                    ConnectionError,  # a shared-memory socket reset by a restarting worker
                ) as err:
                    # The worker may be restarting, or lost: the dispatcher decides
                    # (told now, it checks whether the worker's port is still open).
                    log.debug("fetch from %s failed: %s", endpoint.worker_address, err)
                    if self._stop.is_set():
                        # The reader was closed while this fetch waited (e.g. its
                        # cluster stopped right after): the error is nobody's to hear.
                        if client is not None and not client.retry_in_place:
                            client.close()
                            client = None
                        if self._outstanding is not None:
                            self._outstanding.release()
                        return
                    state.fetch_error = f"{type(err).__name__}: {err}"
                    dispatcher = self.options.dispatcher_address
                    if rpc_util.gone_with_its_workers(dispatcher):
                        # Its LocalCluster was stopped: no worker comes back.
                        if self._outstanding is not None:
                            self._outstanding.release()
                        self._fail(
                            errors.UnavailableError(
                                f"lost worker {endpoint.worker_address}: the dispatcher at "
                                f"{dispatcher} is gone ({rpc_util.gone_reason(dispatcher)}), "
                                "and its workers were stopped with it"
                            )
                        )
                        return
                    if isinstance(err, _LINK_ERRORS) and state.unreachable_since is None:
                        state.unreachable_since = time.monotonic()
                        log.warning(
                            "cannot reach worker %s (task %d) to fetch elements: %s; retrying "
                            "(the dispatcher is asked whether the worker is lost)",
                            endpoint.worker_address,
                            endpoint.task_id,
                            err,
                        )
                    if forced_error is not None and (
                        time.monotonic() - forced_at > _FORCED_CONNECT_GRACE_S
                    ):
                        if self._outstanding is not None:
                            self._outstanding.release()
                        self._fail(forced_error)
                        return
                    if isinstance(err, errors.UnavailableError | ConnectionError):
                        with self._cv:
                            self._unreachable.add(endpoint.worker_address)
                        self._wake_heartbeat.set()
                    if client is not None and not client.retry_in_place:
                        client.close()
                        client = None
                    if self._outstanding is not None:
                        self._outstanding.release()
                    self._fetch_over(state)
                    backoff.sleep(time.monotonic() + 1.0, self._stop)
                    continue
                if self._outstanding is not None:
                    self._outstanding.release()
                backoff = rpc_util.Backoff(0.05, 1.0)
                state.fetch_error = ""
                if not state.reached:
                    state.reached = True
                    rpc_util.mark_reached(endpoint.worker_address)
                if state.unreachable_since is not None:
                    log.info(
                        "worker %s (task %d) reached again after %.1f s",
                        endpoint.worker_address,
                        endpoint.task_id,
                        time.monotonic() - state.unreachable_since,
                    )
                    state.unreachable_since = None
                next_request: tuple[int, int] | None = None
                with self._cv:
                    state.fetching = False
                    self._ahead_landed_locked(state)
                    self._cv.notify_all()
                    if self._stop.is_set():
                        # Closed while this fetch was on its way: close() counts what
                        # it brought among what the consumer leaves unreturned;
                        # exactly-once, they count received (not delivered), so the
                        # consumer's final receipts send their splits out again.
                        self._fetched_after_close += len(result.elements)
                        if result.elements and self.options.exactly_once:
                            self._eo_accept_locked(
                                endpoint.task_id, result.worker_uid, list(result.elements)
                            )
                        return
                    if self._ended:
                        # Only a lost worker's fetch may still be on its way when the
                        # iteration ends (`_Reader._over_locked`): what it brought
                        # is told, not silently dropped.
                        if result.elements:
                            self.stats.not_yielded += len(result.elements)
                            log.warning(
                                "%d elements from worker %s (task %d) arrived after this "
                                "consumer's iteration %d ended; they were not yielded",
                                len(result.elements),
                                endpoint.worker_address,
                                endpoint.task_id,
                                self.iteration_id,
                            )
                        return
                    if result.worker_uid and result.worker_uid != state.worker_uid:
                        starts_over = self.options.processing_mode != ShardingPolicy.DYNAMIC
                        if state.worker_uid and starts_over:
                            self._drop_unconsumed_locked(state)
                        state.worker_uid = result.worker_uid
                    if result.errors_ignored:
                        key = (endpoint.task_id, result.worker_uid)
                        ignored = self.stats.errors_ignored
                        ignored[key] = max(ignored.get(key, 0), result.errors_ignored)
                    elements = list(result.elements)
                    tags = None
                    if elements and self.options.exactly_once:
                        elements, tags = self._eo_accept_locked(
                            endpoint.task_id, result.worker_uid, elements
                        )
                    if elements:
                        count = len(elements)
                        key = (endpoint.task_id, result.worker_uid)
                        self.stats.received[key] = self.stats.received.get(key, 0) + count
                        per = result.nbytes // len(result.elements)
                        self._results.append(_Fetched(elements, per, state, tags=tags))
                        self._buffered_elements += count
                        self._buffered_bytes += per * count
                        state.unconsumed_bytes += per * count
                        w = self.stats.workers.setdefault(
                            endpoint.worker_address, WorkerStats(state.protocol)
                        )
                        w.elements += count
                        w.bytes += result.nbytes
                    end = result.end_of_sequence
                    if end:
                        self._results.append(_Fetched([], task=state, end=True))
                    elif ahead and elements and not state.removed:
                        # Only after a full reply: the worker had more ready than asked
                        # for, and its next reply is worth writing while the consumer
                        # takes this one. After a short one the pipeline is what the read
                        # waits for, and a request sent ahead would only split what it
                        # makes into more, smaller replies.
                        if transfer.reply_filled(len(result.elements), result.nbytes, *asked):
                            next_request = self._plan_ahead_locked(state, per)
                    self._cv.notify_all()
                # The elements are the queue's now: this frame must not keep them (views
                # of a shared-memory ring keep it mapped, its memfd open) while it waits,
                # reconnects to a restarting worker, or survives in a traceback.
                del result, elements
                if end:
                    return
                if next_request is not None and not client.request_ahead(
                    *next_request, _FETCH_WAIT_S, trainer_id=self.options.trainer_id
                ):
                    self._fetch_over(state)
        except BaseException as err:  # e.g. WorkerError: the pipeline raised
            self._fail(err)
        finally:
            self._fetch_over(state)
            if client is not None:
                connect.release(client)

    def _check_unreachable_locked(self) -> None:
        """Raises UnavailableError for a worker this consumer cannot reach while
        the dispatcher still hears its heartbeats (so it is not declared lost,
        and its task would be waited for for ever). Every connection to it has
        failed (`_LINK_ERRORS`) for `rpc_util.unreachable_timeout_ms()` (8 s by
        default, $DATASERVICE_UNREACHABLE_TIMEOUT_MS) when this process never
        reached its address (most likely an address that does not lead to it
        from here), or for `worker_loss_timeout_ms` (60 s by default; None:
        for ever) when it did (a partition between this host and the worker's;
        a worker that restarts, dies or stops heartbeating is the
        dispatcher's to judge, and does not count). A worker that is only slow never fails a
        connection, and never trips it."""
        now = time.monotonic()
        for state in self._tasks.values():
            since = state.unreachable_since
            if since is None or state.finished or state.removed or not state.heartbeats_on_time:
                continue
            address = state.endpoint.worker_address
            reached = state.reached or rpc_util.was_reached(address)
            if reached:
                bound_ms = self.options.worker_loss_timeout_ms
                if bound_ms is None:
                    continue
                how = (
                    f"it answered this process before; no connection got through for "
                    f"{now - since:.1f} s (worker_loss_timeout_ms={bound_ms})"
                )
            else:
                bound_ms = rpc_util.unreachable_timeout_ms()
                how = (
                    f"it never answered this process within {now - since:.1f} s "
                    f"(${rpc_util.UNREACHABLE_ENV}={bound_ms})"
                )
            if (now - since) * 1000 < bound_ms:
                continue
            raise errors.UnavailableError(
                f"cannot reach worker {address} (task {state.endpoint.task_id} of iteration "
                f"{self.iteration_id}) from this host: {how}; last error: {state.fetch_error}. "
                f"The dispatcher still hears the worker's heartbeats, so it runs: {address} is "
                "the address it advertised to the dispatcher (its worker_address / "
                "--worker-address as given, '%port%' replaced; without one, the address it "
                "chose for its bind host, which its log names: 'worker bound to ... "
                "advertises ...'), and this host cannot reach it there (a wrong address, a "
                "firewall, or a network partition between the two hosts)"
            )

    def _fetch_over(self, state: _TaskState) -> None:
        """The task's fetch in flight (if any) ended without a result to queue."""
        with self._cv:
            self._ahead_landed_locked(state)
            if state.fetching:
                state.fetching = False
                self._cv.notify_all()

    def _room_locked(self) -> int:
        """How many more elements this read may ask for: its read-ahead less what
        waits in the results queue and what requests sent ahead may bring."""
        return self._read_ahead_locked() - self._buffered_elements - self._ahead_elements

    def _byte_room_locked(self, state: _TaskState, ahead: bool) -> int:
        """How many bytes a request to `state`'s task may ask for: its transfer
        client's reply bound, less what this task's fetched elements and its request
        sent ahead pin. With requests sent ahead (`ahead`), at most half the client's
        bound on unconsumed bytes, so that one reply can land while the last one is
        still unconsumed (a reply that fills the bound leaves no room for the next)."""
        bound = state.max_unconsumed_bytes
        reply = min(state.max_reply_bytes, bound // 2) if ahead else state.max_reply_bytes
        return min(
            reply,
            bound - state.unconsumed_bytes - state.ahead_bytes,
            _RESULT_BUFFER_BYTES - self._buffered_bytes,
        )

    def _plan_ahead_locked(self, state: _TaskState, element_bytes: int) -> tuple[int, int] | None:
        """The request to send ahead to `state`'s task now that a reply of elements of
        about `element_bytes` bytes landed: (max elements, max bytes), counted in the
        bounds until its reply lands (`_ahead_landed_locked`); None if the bounds
        leave no room for a reply of at least one such element."""
        room = min(self._fetch_elements, self._room_locked())
        byte_room = self._byte_room_locked(state, True)
        if room < 1 or byte_room < max(1, element_bytes):
            return None
        state.ahead_elements, state.ahead_bytes = room, byte_room
        self._ahead_elements += room
        state.fetching = True
        return room, byte_room

    def _ahead_landed_locked(self, state: _TaskState) -> None:
        """`state`'s request sent ahead (if any) landed, or failed, or was not sent:
        the bounds no longer count it."""
        self._ahead_elements -= state.ahead_elements
        state.ahead_elements = state.ahead_bytes = 0

    def _unbuffer_locked(self, fetched: _Fetched, state: _TaskState) -> None:
        """A fetched chunk leaves the results queue (taken by next(), or dropped):
        the counters the fetch threads' bounds read go down by its size."""
        self._buffered_elements -= len(fetched.elements)
        self._buffered_bytes -= fetched.nbytes_each * len(fetched.elements)
        state.unconsumed_bytes -= fetched.nbytes_each * len(fetched.elements)

    def _drop_unconsumed_locked(self, state: _TaskState) -> None:
        """The task's worker restarted, so the task started over there (tf.data
        service's OFF semantics, and the static FILE/DATA shards'): the elements
        fetched from its previous process and not yet handed out would come
        again, so they are dropped. (Those the consumer already took are not
        taken back.) Not called under DYNAMIC sharding: the restarted task reads
        splits not handed out before, so those elements would never come again
        (and the loss report counts them as received)."""
        kept: collections.deque[_Fetched] = collections.deque()
        dropped = 0
        for entry in self._results:
            if entry.task is state and not entry.end:
                dropped += len(entry.elements)
                self._unbuffer_locked(entry, state)
            else:
                kept.append(entry)
        self._results = kept
        if dropped:
            log.info(
                "worker %s restarted: dropped %d elements fetched from its previous process "
                "(task %d starts over there)",
                state.endpoint.worker_address,
                dropped,
                state.endpoint.task_id,
            )

    def _connected(self, state: _TaskState, client: transfer.TransferClient) -> None:
        state.protocol = client.protocol
        state.max_reply_bytes = client.max_reply_bytes
        state.max_unconsumed_bytes = min(
            _RESULT_BUFFER_BYTES, client.max_unconsumed_bytes or _RESULT_BUFFER_BYTES
        )

    def _read_ahead_locked(self) -> int:
        """How many elements may wait here unconsumed: it grows with what the
        consumer has taken (16, then half of the elements consumed so far, up to
        the buffer's size), so a consumer that reads little holds little, and
        little is lost or skipped if a worker restarts or joins mid-iteration."""
        return max(16, min(self._buffer_elements, self.stats.elements // 2))
