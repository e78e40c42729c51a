"""The worker: registers with the dispatcher by heartbeat, runs the tasks it is
given, and serves their elements (as tf.data service's worker).

This module owns `WorkerServer`'s life (start, stop, join), its side of the
dispatcher (registration, heartbeats, fetching dataset definitions) and its
tasks (starting a runner per new task, stopping deleted ones). The worker's
gRPC server on `config.port` serves `WorkerService.GetElements` and
`GetElementsStream` (the "grpc" transfer protocol; elements leave the worker
when the consumer acknowledges them, see `unacked_replies.UnackedReplies`): that
reading is `serving.py`'s, and a DYNAMIC task's splits come from the dispatcher
through `splits.py`. A heartbeat thread reports the worker's tasks every
`heartbeat_interval_ms` and receives new tasks and tasks to delete; a worker
holding a task the dispatcher no longer knows drops it (reconciles) on the next
heartbeat. A watch thread holds a long poll (WatchTasks) that the dispatcher
answers, with the worker's tasks, when it gives this worker a task. If the
dispatcher goes away, the worker keeps serving the tasks it has and retries
heartbeats until it comes back.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from dataservice import _netaddr, _proc, _waits, auth, errors, metrics, tls
from dataservice.config import WorkerConfig
from dataservice.data import graph
from dataservice.data.static_sharding import apply_static_sharding
from dataservice.locality import host_id
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import service_pb2_grpc, validate
from dataservice.rpc import util as rpc_util
from dataservice.sharding import STATIC_POLICIES, ShardingPolicy, sharding_policy_from_proto
from dataservice.transfer import base as transfer
from dataservice.worker import exactly_once
from dataservice.worker.cross_trainer_cache import CrossTrainerCache
from dataservice.worker.serving import ElementServing, WorkerServicer
from dataservice.worker.splits import split_sources
from dataservice.worker.task_runner import DEFAULT_BUFFER_BYTES, TaskRunner

DEFAULT_CROSS_TRAINER_CACHE_BYTES = 1 << 30
_STOP_JOIN_S = 2.0  # how long stop() waits for its tasks' producer threads, in all
# How long a WatchTasks call may be held by the dispatcher (`_watch_loop`).
_WATCH_MS = 30_000
# How long after its last task stopped a worker gives malloc's free memory back
# (`_proc.release_free_memory`): a trainer that makes an iterator after another
# (each a new task) reuses that memory, and trimming after each stop made each
# next task fault it in again (page faults and the kernel's zeroing: ~2 ms of
# system CPU per iterator of 150 KB images on this 2-core machine).
_RELEASE_MEMORY_AFTER_S = 2.0
# After a refused watch, the worker asks again this late (or a heartbeat interval).
_WATCH_REFUSED_S = 5.0

log = logging.getLogger(__name__)


class _WorkerTaskRunner(TaskRunner):
    """A `TaskRunner` that tells its worker when it hands out elements and, for
    a worker started with `lazy_tasks`, runs no pipeline code before a consumer
    asks for the task (`start_producing`, or any read). `make_iterator(runner)`
    builds the pipeline and sets `runner.allow_pickled_elements` from it."""

    def __init__(
        self,
        task_id: int,
        make_iterator: Callable[[TaskRunner], Iterator[Any]],
        worker_address: str,
        *,
        lazy: bool,
        on_handout: Callable[[], None],
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        initial_buffer_bytes: int | None = None,
        counters: metrics.WorkerCounters | None = None,
    ) -> None:
        self._go = threading.Event()
        self._cancelled = False
        self._on_handout = on_handout
        self._handed_out = False  # reads stay cheap: one check each after the first
        if not lazy:
            self._go.set()
        # Weakly: this closure is the runner's own `_make_iterator`.
        me = weakref.ref(self)
        go = self._go

        def make_when_asked() -> Iterator[Any]:
            go.wait()
            runner = me()
            if runner is None or runner._cancelled:
                return iter(())
            return make_iterator(runner)

        super().__init__(
            task_id,
            make_when_asked,
            worker_address,
            buffer_bytes=buffer_bytes,
            initial_buffer_bytes=initial_buffer_bytes,
            counters=counters,
        )

    def start_producing(self) -> None:
        if not self._go.is_set():
            self._go.set()

    def _handed(self) -> None:
        self._handed_out = True
        self._on_handout()

    def get_elements_raw(
        self, max_elements: int, max_bytes: int, timeout_s: float, hold_end: bool = False
    ) -> transfer.TaskRead:
        if not self._go.is_set():
            self._go.set()
        result = super().get_elements_raw(max_elements, max_bytes, timeout_s, hold_end)
        if result.elements and not self._handed_out:
            self._handed()
        return result

    def get_round_element(
        self, consumer_index: int, num_consumers: int, round_index: int, timeout_s: float
    ) -> transfer.TaskRead:
        if not self._go.is_set():
            self._go.set()
        result = super().get_round_element(consumer_index, num_consumers, round_index, timeout_s)
        if result.elements and not self._handed_out:
            self._handed()
        return result

    def stop(self) -> None:
        self._cancelled = True
        self._go.set()
        super().stop()


class WorkerServer(ElementServing):
    """A worker, as `tf.data.experimental.service.WorkerServer`. Thread-safe.

    Args:
        config: The `WorkerConfig`.
        start: Start serving now (else call `start()`).
        lazy_tasks: Run a task's pipeline only once a consumer asks for the
            task, not as soon as the dispatcher assigns it. `LocalCluster`
            restarts a worker that exited without handing out an element this
            way, so a pipeline that kills its process within milliseconds
            (before any consumer reached it) hands its first elements out.
        on_first_element: Called once, on the serving thread, when this worker
            hands out its first element, before the element leaves the worker
            (`LocalCluster`'s progress signal: the worker CLI prints a line).
        join_running_dynamic_only: Take tasks, when it registers, only in the
            running iterations of DYNAMIC jobs (not OFF, static sharding or
            coordinated reads, where a task would add a copy or a shard to an
            epoch under way); later iterations as usual. `LocalCluster`'s
            autoscaler starts the workers it adds this way.

    Raises:
        UnavailableError: The port cannot be bound.
        ValueError: The token file cannot be read, or `host` is beyond
            loopback with no token and not `insecure` (see SECURITY.md).
    """

    def __init__(
        self,
        config: WorkerConfig,
        start: bool = True,
        *,
        lazy_tasks: bool = False,
        on_first_element: Callable[[], None] | None = None,
        join_running_dynamic_only: bool = False,
    ) -> None:
        # glibc malloc on a worker: fixed thresholds, the consumer's (32 MiB mmap,
        # 64 MiB trim; a task's buffers go back to the kernel when it ends,
        # `_proc.release_free_memory`). With glibc's moving thresholds, 150 KB
        # elements over gRPC ran at ~600 MB/s in some worker processes and
        # ~1,200-1,600 in others, for their whole life; under a lower mmap threshold
        # each 9.6 MB element is a fresh mapping (page faults and the kernel's zeroing).
        _proc.tune_malloc()
        self._config = config
        self._lazy_tasks = lazy_tasks
        self._join_running_dynamic_only = join_running_dynamic_only
        self._on_first_element = on_first_element
        self._handed_out = False
        self._handout_mu = threading.Lock()
        self._dispatcher_address = rpc_util.parse_address(config.dispatcher_address)
        # One token for both directions: required of every caller (gRPC and the
        # shared-memory handshake) and sent to the dispatcher.
        self._token = auth.resolve_token(config.auth_token, config.auth_token_file)
        self._metadata = rpc_util.call_metadata(self._token)
        self._server_credentials, self._client_tls = tls.worker_tls(
            config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file, config.tls_ca_file
        )
        self._mu = threading.Lock()
        # Notified (under _mu) when `_tasks` or `_deleted` change: a read waiting
        # for a task it heard of first wakes at once (ElementServing.element_source).
        self._tasks_changed = threading.Condition(self._mu)
        self._wake = threading.Event()
        # When to give free memory back (monotonic s; None: nothing to give back).
        self._release_memory_at: float | None = None
        self._stop_event = threading.Event()
        self._stopped = threading.Event()
        self._server: grpc.Server | None = None
        self._channel: grpc.Channel | None = None
        self._stub: service_pb2_grpc.DispatcherServiceStub | None = None
        self._heartbeat_thread: threading.Thread | None = None
        self._watch_thread: threading.Thread | None = None
        self._start_mu = threading.Lock()  # `_start_task`
        self._watch_call: Any = None  # the WatchTasks call in flight (a grpc future)
        self._address = ""
        self._uid = ""
        self._incarnation = ""
        self._registration_error: BaseException | None = None
        self._registered = threading.Event()
        self._transfer_servers: list[transfer.TransferServer] = []
        # guarded by self._mu:
        self._tasks: dict[int, TaskRunner] = {}
        self._deleted: OrderedDict[int, None] = OrderedDict()
        self._reported_finished: set[int] = set()
        self._datasets: dict[str, Any] = {}
        # Counters since this process started (metrics.py): in heartbeats and, with
        # `metrics_port`, at /metrics.
        self._counters = metrics.WorkerCounters()
        self._metrics_endpoint: metrics.MetricsEndpoint | None = None
        if start:
            self.start()

    @property
    def address(self) -> str:
        """The "host:port" advertised to the dispatcher and clients (`_advertised_address`)."""
        return self._address

    @property
    def metrics_port(self) -> int | None:
        """The port serving /metrics (`WorkerConfig.metrics_port`; the bound one
        for 0), or None when metrics are off or the worker is stopped."""
        endpoint = self._metrics_endpoint
        return endpoint.port if endpoint is not None else None

    def _buffered_elements(self) -> int:
        with self._mu:
            runners = list(self._tasks.values())
        return sum(r.buffered_elements for r in runners)

    def _not_ready(self) -> str | None:
        """Why /readyz says not ready (None: ready)."""
        if self._stop_event.is_set():
            return "stopping"
        if not self._registered.is_set():
            return f"not registered with the dispatcher at {self._dispatcher_address} yet"
        return None

    def num_tasks(self) -> int:
        """The number of tasks this worker runs now."""
        with self._mu:
            return len(self._tasks)

    def task_runner(self, task_id: int) -> TaskRunner | None:
        """The runner of a task this worker runs (None: unknown or deleted). A
        consumer is taken to ask for it: with `lazy_tasks`, its pipeline starts."""
        runner, _ = self._runner_now(task_id)
        return runner

    def _note_handout(self) -> None:
        if self._handed_out:
            return
        with self._handout_mu:
            if self._handed_out:
                return
            self._handed_out = True
        if self._on_first_element is not None:
            try:
                self._on_first_element()
            except Exception:  # a progress signal must never fail a read
                log.exception("worker %s: on_first_element failed", self._address)

    @property
    def auth_token(self) -> str | None:
        """The token this worker requires and sends (config, file or environment)."""
        return self._token

    @property
    def registration_error(self) -> BaseException | None:
        """Why the dispatcher refused this worker (e.g. `UnauthenticatedError`),
        or None; the worker has stopped when it is set."""
        return self._registration_error

    def wait_registered(self, timeout_s: float) -> bool:
        """Waits until the dispatcher has answered a first heartbeat.

        Returns:
            True once registered; False after `timeout_s` seconds or if
            registration failed (then `join()` raises the reason).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._registered.wait(0.05):
                return True
            if self._registration_error is not None or self._stopped.is_set():
                return False
        return self._registered.is_set()

    def start(self) -> None:
        """Binds the port, starts serving and heartbeating (returns at once;
        registration happens on the heartbeat thread)."""
        if self._server is not None:
            return
        self._stop_event.clear()
        self._stopped.clear()
        self._registered.clear()
        self._registration_error = None
        tls_on = self._server_credentials is not None
        auth.check_bind("worker", self._config.host, self._token, self._config.insecure, tls_on)
        auth.warn_if_sent_in_clear(self._dispatcher_address, self._token, tls_on)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="ds-worker"),
            options=rpc_util.SERVER_OPTIONS,
            interceptors=rpc_util.server_interceptors(
                self._token, "worker", on_refused=self._counters.refused
            ),
        )
        validate.add_service(server, WorkerServicer(self), "WorkerService")
        bind = f"{self._config.host}:{self._config.port}"
        try:
            port = rpc_util.add_port(server, bind, self._server_credentials)
        except RuntimeError as err:
            raise errors.UnavailableError(f"worker cannot bind {bind}: {err}") from err
        if port == 0:
            raise errors.UnavailableError(f"worker cannot bind {bind}")
        self._address = self._advertised_address(port)
        self._uid = uuid.uuid4().hex
        if self._config.metrics_port is not None and self._metrics_endpoint is None:
            registry = metrics.WorkerMetrics(
                self._counters, self._buffered_elements, self.num_tasks
            ).registry
            try:
                self._metrics_endpoint = metrics.MetricsEndpoint(
                    registry,
                    self._config.host,
                    self._config.metrics_port,
                    "worker",
                    not_ready=self._not_ready,
                    token=self._token,
                    ssl_context=tls.metrics_ssl_context(
                        self._config.tls_cert_file,
                        self._config.tls_key_file,
                        self._config.tls_client_ca_file,
                    ),
                    on_refused=self._counters.refused,
                )
            except BaseException:
                server.stop(grace=None)
                raise
        server.start()
        self._server = server
        self._channel = rpc_util.make_channel(self._dispatcher_address, self._client_tls)
        self._stub = service_pb2_grpc.DispatcherServiceStub(self._channel)
        transfer_host = transfer.TransferHost(
            address=self._address,
            auth_token=self._token,
            worker_uid=self._uid,
            element_source=self.element_source,
            shm_ring_bytes=self._config.shm_ring_bytes,
            shm_allowed_uids=frozenset(self._config.shm_allowed_uids or ()),
            on_sent=self._counters.sent,
        )
        for name, factory in transfer.server_factories().items():
            try:
                self._transfer_servers.append(factory(transfer_host))
            except Exception as err:  # the worker still serves gRPC
                log.warning("worker %s: %s transfer unavailable: %s", self._address, name, err)
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, name="ds-worker-heartbeat", daemon=True
        )
        self._heartbeat_thread.start()
        self._watch_thread = threading.Thread(
            target=self._watch_loop, name="ds-worker-watch", daemon=True
        )
        self._watch_thread.start()

    def _advertised_address(self, port: int) -> str:
        """The "host:port" this worker gives the dispatcher and its clients.

        `worker_address` as given, "%port%" replaced by the bound `port`; else,
        as tf.data service, "localhost:<port>" for a loopback-bound worker and
        "<host>:<port>" for one bound to a single interface; for one bound to
        every interface ("0.0.0.0", "::"), an address of this host that its
        dispatcher can reach (`_netaddr.wildcard_advertised_host`: the local
        address of its route to the dispatcher), logged with the reason.
        """
        if self._config.worker_address:
            return self._config.worker_address.replace("%port%", str(port))
        host = self._config.host
        if _netaddr.is_wildcard(host):
            chosen, why = _netaddr.wildcard_advertised_host(self._dispatcher_address)
            address = f"{chosen}:{port}"
            log.info(
                "worker bound to %s advertises %s: %s (set worker_address, "
                "--worker-address, to choose another)",
                _netaddr.format_host(host or "0.0.0.0") + f":{port}",
                address,
                why,
            )
            return address
        if host in ("127.0.0.1", "::1"):
            return f"localhost:{port}"
        return f"{_netaddr.format_host(host)}:{port}"

    def stop(self) -> None:
        """Stops serving and heartbeating; returns promptly. Idempotent.

        What the worker holds is released when it returns, not at a later garbage
        collection: the gRPC server and its threads, the shared-memory listener, its
        connections' threads and rings, each task's buffer, producer thread and
        cross-trainer cache window (memfds), and the channel to the dispatcher.
        Waits up to 0.5 s for gRPC replies in flight and up to `_STOP_JOIN_S`
        seconds for the tasks' threads (a pipeline inside user code ends its thread
        at its next element; that is logged).
        """
        # First the tasks are told: a pipeline that fails from here on fails because
        # the worker stops (its GetSplits retries cancelled by `_stop_event`), and
        # its consumers must not get that CancelledError as the task's error: they
        # find the worker gone, as any lost worker (`TaskRunner.halt`). (Stopping the
        # tasks here instead would refuse the requests that still arrive before the
        # server stops, with "task has stopped".)
        with self._mu:
            for runner in self._tasks.values():
                runner.halt()
        self._stop_event.set()
        self._wake.set()
        watch = self._watch_call
        if watch is not None:
            watch.cancel()
        server, self._server = self._server, None
        stopped_serving = server.stop(grace=0.5) if server is not None else None
        servers, self._transfer_servers = self._transfer_servers, []
        for transfer_server in servers:
            transfer_server.begin_stop()
        with self._mu:
            runners = list(self._tasks.values())
            self._tasks.clear()
        # Stopping the runners wakes every read waiting for elements (gRPC handlers,
        # shared-memory connections), so that the joins below are short; a stopped
        # runner's reads never report an end of sequence.
        for runner in runners:
            runner.stop()
        if stopped_serving is not None:
            stopped_serving.wait()
        for transfer_server in servers:
            transfer_server.stop()
        endpoint, self._metrics_endpoint = self._metrics_endpoint, None
        if endpoint is not None:
            endpoint.stop()
        deadline = time.monotonic() + _STOP_JOIN_S
        for runner in runners:
            if not runner.join(max(0.0, deadline - time.monotonic())):
                log.warning(
                    "worker %s: task %d's pipeline is still running (inside user code) "
                    "%.1f s after stop; its thread ends at its next element",
                    self._address,
                    runner.task_id,
                    _STOP_JOIN_S,
                )
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=5)
            self._heartbeat_thread = None
        if self._watch_thread is not None:
            self._watch_thread.join(timeout=5)
            self._watch_thread = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stub = None
        self._stopped.set()

    def join(self) -> None:
        """Blocks until `stop()`.

        Raises:
            UnavailableError: The dispatcher could not be reached to register
                within `dispatcher_timeout_ms` (`dispatcher_unreachable_timeout_ms`
                if its address never answered); the worker has stopped.
        """
        self._stopped.wait()
        if self._registration_error is not None:
            raise self._registration_error

    def __enter__(self) -> WorkerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ dispatcher
    def _call_dispatcher(self, method: str, request: Any) -> Any:
        stub = self._stub
        if stub is None:
            raise errors.CancelledError("worker stopped")
        return rpc_util.call_dispatcher(
            stub,
            method,
            request,
            address=self._dispatcher_address,
            metadata=self._metadata,
            timeout_ms=self._config.dispatcher_timeout_ms_or_default,
            stop=self._stop_event,
        )

    def _heartbeat_loop(self) -> None:
        """Heartbeats every `heartbeat_interval_ms` until `stop()`.

        Registration (the first answered heartbeat) is retried for up to
        `dispatcher_unreachable_timeout_ms` while the dispatcher's address never
        answered (likely a wrong address); then the worker stops and `join()`
        raises. A dispatcher that answered once and is now unavailable is
        restarting: registration is retried until it answers (as tf.data
        service's worker start), with the warnings below, so a dispatcher
        restarted while a worker starts does not stop that worker. Once registered it retries
        unanswered heartbeats while serving its tasks. An unanswered stretch
        longer than `_waits.FIRST_WARNING_S` logs a WARNING (then one every
        `_waits.REPEAT_WARNING_S`).
        """
        interval_s = self._config.heartbeat_interval_ms_or_default / 1000
        timeout_ms = self._config.dispatcher_timeout_ms_or_default
        unreachable_ms = min(
            timeout_ms,
            rpc_util.unreachable_timeout_ms(self._config.dispatcher_unreachable_timeout_ms),
        )
        address = self._dispatcher_address
        registered = False
        first_try = time.monotonic()
        last_refusal_log = -auth.REFUSAL_LOG_INTERVAL_S
        backoff = rpc_util.Backoff(0.05, interval_s)
        unanswered: _waits.SlowWait | None = None
        while not self._stop_event.is_set():
            try:
                attempt_s = 10.0
                if not registered and not rpc_util.was_reached(address):
                    attempt_s = max(
                        0.05, min(10.0, first_try + unreachable_ms / 1000 - time.monotonic())
                    )
                self._heartbeat(attempt_s)
                rpc_util.mark_reached(address)
                registered = True
                if unanswered is not None:
                    unanswered.done(
                        f"worker {self._address}: the dispatcher at {address} answers again"
                    )
                    unanswered = None
                backoff = rpc_util.Backoff(0.05, interval_s)
                self._release_memory_if_due(interval_s)
                self._wake.wait(interval_s)
                self._wake.clear()
            except grpc.RpcError as err:
                if rpc_util.server_answered(err):
                    rpc_util.mark_reached(address)
                if err.code() not in rpc_util.RETRYABLE and not registered:  # type: ignore[attr-defined]
                    # Refused (e.g. not in the dispatcher's worker list): no point retrying.
                    if err.code() == grpc.StatusCode.UNAUTHENTICATED:  # type: ignore[attr-defined]
                        self._registration_error = errors.UnauthenticatedError(
                            auth.refused_message(address, "worker registration", worker=True)
                        )
                    else:
                        self._registration_error = rpc_util.to_error(
                            err, address, "WorkerHeartbeat (the worker's registration)"
                        )
                    log.error(
                        "worker %s: the dispatcher at %s refused it: %s",
                        self._address,
                        address,
                        self._registration_error,
                    )
                    threading.Thread(target=self.stop, daemon=True).start()
                    return
                details = f"{err.code().name}: {err.details()}"  # type: ignore[attr-defined]
                now = time.monotonic()
                if not registered:
                    self._registration_error = rpc_util.not_grpc_error(
                        address, f"worker {self._address} registering with the dispatcher", details
                    )
                    reached = rpc_util.was_reached(address)
                    if (
                        self._registration_error is None
                        and not reached
                        and now - first_try > unreachable_ms / 1000
                    ):
                        self._registration_error = rpc_util.unreachable_error(
                            f"worker {self._address} registering with the dispatcher",
                            address,
                            unreachable_ms,
                            details,
                        )
                    if self._registration_error is not None:
                        log.error("%s", self._registration_error)
                        threading.Thread(target=self.stop, daemon=True).start()
                        return
                if registered and err.code() == grpc.StatusCode.UNAUTHENTICATED:  # type: ignore[attr-defined]
                    # E.g. the dispatcher restarted with another token.
                    if now - last_refusal_log > auth.REFUSAL_LOG_INTERVAL_S:
                        last_refusal_log = now
                        log.warning(
                            "worker %s: %s",
                            self._address,
                            auth.refused_message(address, "heartbeat", worker=True),
                        )
                else:
                    doing = "heartbeats (its tasks go on)" if registered else "registration"
                    text = (
                        f"worker {self._address}: no answer from the dispatcher at {address} "
                        f"to its {doing} ({details}); retrying"
                    )
                    if unanswered is None:
                        unanswered = _waits.SlowWait(
                            log, text, start=now if registered else first_try
                        )
                    unanswered.describe = text  # the latest error
                    unanswered.check(now)
                    if registered:
                        log.debug("heartbeat to %s failed: %s", address, err)
                backoff.sleep(now + interval_s, self._stop_event)
            except Exception:
                log.exception("worker heartbeat failed")
                self._stop_event.wait(interval_s)

    def _watch_loop(self) -> None:
        """Holds a WatchTasks call to the dispatcher (a long poll, dispatcher/tasks.py)
        and starts the tasks of its answer when it says this worker was given a
        task: a new iteration's tasks start while its consumers connect. Without an
        answer (the dispatcher unreachable, or holding as many watches as it
        allows), the heartbeats every `heartbeat_interval_ms` give the tasks, as
        they would anyway; a dispatcher without WatchTasks (an older version)
        ends the loop."""
        interval_s = self._config.heartbeat_interval_ms_or_default / 1000
        known = -1  # the generation of the last answer: the dispatcher sends what is newer
        watched = ""  # the dispatcher incarnation that answered last
        while not self._stop_event.is_set():
            stub = self._stub
            if stub is None or not self._registered.is_set():
                self._stop_event.wait(min(interval_s, 0.1))
                continue
            request = pb.WatchTasksRequest(
                worker_address=self._address,
                generation=known,
                wait_ms=_WATCH_MS,
                worker_uid=self._uid,
            )
            try:
                call = stub.WatchTasks.future(
                    request, timeout=_WATCH_MS / 1000 + 10, metadata=self._metadata
                )
                self._watch_call = call
                if self._stop_event.is_set():
                    call.cancel()
                response = call.result()
            except (grpc.RpcError, grpc.FutureCancelledError) as err:
                code = err.code() if isinstance(err, grpc.RpcError) else None  # type: ignore[attr-defined]
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    log.info(
                        "worker %s: the dispatcher at %s has no WatchTasks (an older "
                        "version); new tasks come with heartbeats",
                        self._address,
                        self._dispatcher_address,
                    )
                    return
                self._stop_event.wait(interval_s)
                continue
            finally:
                self._watch_call = None
            if watched and response.incarnation_id != watched:
                # Another incarnation counts its generations afresh: an answer to a
                # generation of the old one may leave tasks out; ask for all of them.
                watched, known = response.incarnation_id, -1
                continue
            watched = response.incarnation_id
            if response.generation != known:
                known = response.generation
                self._start_watched_tasks(response)
            if not response.watching:  # the dispatcher is at its limit, or stopping
                self._stop_event.wait(max(interval_s, _WATCH_REFUSED_S))

    def _start_watched_tasks(self, response: Any) -> None:
        """Starts the tasks of a WatchTasks answer that this worker neither runs
        nor was told to delete, if the answer is of the dispatcher incarnation its
        heartbeats know (else the next heartbeat sorts the tasks out, and is asked
        for now)."""
        if not response.incarnation_id or response.incarnation_id != self._incarnation:
            self._wake.set()
            return
        for task in response.tasks:
            self._start_task(task, incarnation=response.incarnation_id)

    def _heartbeat(self, timeout_s: float = 10.0) -> None:
        with self._mu:
            current = list(self._tasks)
        # Tasks are reported finished by their consumers once they have *consumed*
        # the end (reader.py): a worker that handed out its last element may still
        # see a new worker join the iteration (OFF mode gives it a full copy).
        request = pb.WorkerHeartbeatRequest(
            worker_address=self._address,
            transfer_address=self._address,
            host_id=host_id(),
            worker_uid=self._uid,
            current_tasks=current,
            transfer_protocols=["grpc", *transfer.server_factories()],
            heartbeat_interval_ms=self._config.heartbeat_interval_ms_or_default,
            pid=os.getpid(),
            counters=self._counters.to_proto(self._buffered_elements()),
            join_running_dynamic_only=self._join_running_dynamic_only,
        )
        stub = self._stub
        if stub is None:
            return
        response = stub.WorkerHeartbeat(request, timeout=timeout_s, metadata=self._metadata)
        if self._incarnation and response.incarnation_id != self._incarnation:
            # The dispatcher restarted without its state: ids it hands out now
            # (datasets, tasks) may reuse old ones. Drop everything of the old
            # incarnation and report again with no tasks (C-03, C-04). Under
            # `_start_mu`: no task of a watch answered by the old one starts after.
            with self._start_mu:
                with self._mu:
                    runners = list(self._tasks.values())
                    for task_id in self._tasks:
                        self._deleted[task_id] = None
                    self._tasks.clear()
                    self._datasets.clear()
                    self._tasks_changed.notify_all()
                self._incarnation = response.incarnation_id
            for runner in runners:
                runner.stop()
            log.warning(
                "worker %s: the dispatcher at %s restarted and lost its state; dropped %d "
                "tasks of its previous incarnation",
                self._address,
                self._dispatcher_address,
                len(runners),
            )
            self._wake.set()  # heartbeat again at once, holding no task
            return
        self._incarnation = response.incarnation_id
        self._registered.set()
        stopped = 0
        for task_id in response.tasks_to_delete:
            with self._mu:
                deleted = self._tasks.pop(task_id, None)
                self._deleted[task_id] = None
                while len(self._deleted) > 10_000:
                    self._deleted.popitem(last=False)
                self._tasks_changed.notify_all()
            if deleted is not None:
                deleted.stop()
                stopped += 1
        if stopped:  # their buffers are freed: give what malloc keeps back to the OS, soon
            self._release_memory_at = time.monotonic() + _RELEASE_MEMORY_AFTER_S
        for task in response.new_tasks:
            with self._mu:
                if task.task_id in self._tasks:
                    continue
            self._start_task(task)

    def _release_memory_if_due(self, interval_s: float) -> None:
        """Gives free memory back to the kernel when no task stopped for
        `_RELEASE_MEMORY_AFTER_S` (each stop moves that time on), less the heartbeat
        wait of `interval_s` that follows this call: not one wait later."""
        at = self._release_memory_at
        if at is not None and time.monotonic() + interval_s >= at:
            self._release_memory_at = None
            _proc.release_free_memory()

    def _dataset(self, dataset_id: str) -> Any:
        with self._mu:
            dataset = self._datasets.get(dataset_id)
        if dataset is None:
            dataset = self._fetch_dataset(dataset_id)
            with self._mu:
                self._datasets[dataset_id] = dataset
        return dataset

    def _fetch_dataset(self, dataset_id: str) -> Any:
        """The dataset's definition from the dispatcher. On the dispatcher's host
        its big buffers are the dispatcher's files, mapped (shared by every worker
        process of the host); should they not map (a host id that two machines
        share), they are fetched inline."""
        from dataservice.data.serialize import load

        response = self._call_dispatcher(
            "GetDatasetDef", pb.GetDatasetDefRequest(dataset_id=dataset_id, host_id=host_id())
        )
        try:
            return load(response.dataset)
        except OSError as err:
            log.warning(
                "worker %s cannot map the buffer files of dataset %s (%s); fetching them inline",
                self._address,
                dataset_id,
                err,
            )
        response = self._call_dispatcher(
            "GetDatasetDef", pb.GetDatasetDefRequest(dataset_id=dataset_id)
        )
        return load(response.dataset)

    def _start_task(self, task: Any, incarnation: str | None = None) -> None:
        """Starts a runner for `task` unless one runs it. The heartbeat and watch
        threads both start tasks: one at a time, so a task never gets two runners
        (the second's pipeline would take DYNAMIC splits from the dispatcher and
        drop them when stopped).

        `incarnation`: the dispatcher incarnation of the WatchTasks answer that
        lists the task; it starts only if the worker's heartbeats still know that
        incarnation and did not delete the task. A heartbeat that finds the
        dispatcher restarted drops the old tasks holding `_start_mu` too, so a
        task of the old incarnation never starts after that drop (its id may be
        one the new incarnation gives another task: C-03, C-04)."""
        with self._start_mu:
            with self._mu:
                if task.task_id in self._tasks:
                    return
                if incarnation is not None and (
                    incarnation != self._incarnation or task.task_id in self._deleted
                ):
                    return
            self._start_runner(task)

    def _start_runner(self, task: Any) -> None:
        def make_iterator(runner: TaskRunner) -> Any:
            dataset = self._dataset(task.dataset_id)
            runner.allow_pickled_elements = graph.allows_pickled_elements(dataset)
            policy = sharding_policy_from_proto(task.processing_mode)
            if policy in STATIC_POLICIES:
                dataset = apply_static_sharding(
                    dataset, policy, task.num_workers, task.worker_index
                )
            sources = None
            runner.iter_stats = graph.new_iter_stats()
            if policy == ShardingPolicy.DYNAMIC and task.exactly_once:
                return exactly_once.elements(self, task, dataset, runner.iter_stats)
            if policy == ShardingPolicy.DYNAMIC:
                sources = split_sources(self, task, graph.num_split_sources(dataset))
            return graph.make_iterator(
                dataset, split_sources=sources, stats=runner.iter_stats, epoch=task.repetition
            )

        cache_bytes = (
            self._config.cross_trainer_cache_size_bytes or DEFAULT_CROSS_TRAINER_CACHE_BYTES
        )
        # A task's buffer starts small and grows with what its consumers take
        # (TaskRunner): an iteration nobody reads past its first elements holds a
        # few elements here, not DEFAULT_BUFFER_BYTES.
        buffer_bytes = DEFAULT_BUFFER_BYTES
        initial_buffer_bytes = None
        if task.use_cross_trainer_cache:
            # The window is the task's buffer: the runner prefetches one fill of it
            # (a quarter), not 64 MiB more of elements no trainer asked for yet. The
            # window is sized by the worker's config, so its bound is fixed.
            buffer_bytes = max(1 << 20, min(DEFAULT_BUFFER_BYTES, cache_bytes // 4))
            initial_buffer_bytes = buffer_bytes
        runner = _WorkerTaskRunner(
            task.task_id,
            make_iterator,
            self._address,
            lazy=self._lazy_tasks,
            on_handout=self._note_handout,
            buffer_bytes=buffer_bytes,
            initial_buffer_bytes=initial_buffer_bytes,
            counters=self._counters,
        )
        runner.num_consumers = task.num_consumers
        if task.use_cross_trainer_cache:
            runner.cross_trainer_cache = CrossTrainerCache(runner, cache_bytes)
        with self._mu:
            if task.task_id in self._tasks or self._stop_event.is_set():
                runner.stop()
                return
            self._tasks[task.task_id] = runner
            self._deleted.pop(task.task_id, None)
            self._tasks_changed.notify_all()
        log.info("worker %s started task %d", self._address, task.task_id)
