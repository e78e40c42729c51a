"""The state every part of the dispatcher shares, and its one write path.

`DispatcherBase` holds all of `DispatchServer`'s fields: the lifecycle ones
(config, gRPC server, port, stop events, maintenance thread) and, guarded by
the one lock `self._mu` (an RLock), the journaled `DispatcherState` and the
runtime-only maps beside it (workers, clients' and jobs' last-seen times,
split providers, worker losses). Each handler mixin (datasets.py, tasks.py,
jobs.py, split_handout.py, worker_loss.py, liveness.py) reads and writes
these fields under `self._mu`; none adds a field of its own.

Every decision becomes a `state.Update` applied through `_apply_locked`, which
journals it first when `fault_tolerant_mode` is on. Work that does I/O
(loading a dataset object, building split providers) is done outside
`self._mu`: a handler that finds it missing raises `NotLoaded`, and
`_retry_when_loaded` does it and runs the handler again.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from dataservice import _waits, errors
from dataservice.config import DispatcherConfig
from dataservice.dispatcher import journal as journal_module
from dataservice.dispatcher import state as st
from dataservice.dispatcher.buffer_store import BufferStore
from dataservice.dispatcher.journal import Journal
from dataservice.rpc import service_pb2 as pb

# One logger for all of the dispatcher's modules, under the name it has always had.
log = logging.getLogger("dataservice.dispatcher.server")


@dataclass
class _Worker:
    """A registered worker (runtime only: workers register again after a restart)."""

    address: str
    transfer_address: str
    host_id: str
    uid: str
    last_heartbeat: float
    heartbeat_interval_s: float
    index: int  # position in DispatcherConfig.worker_addresses, -1 without a list
    pid: int = 0  # as the worker reports it (0: an older worker that does not)
    # Its supervisor reported its process exited and restarts it on the same
    # address (ReportWorkerFailure with `restarting`): not probed meanwhile.
    restarting: bool = False
    last_probe: float = 0.0  # time.monotonic() of the last liveness probe
    # Its supervisor retires it (RetireWorker, retire.py): no new task, and its
    # DYNAMIC tasks get no more splits.
    draining: bool = False
    # Registered with WorkerHeartbeatRequest.join_running_dynamic_only: tasks in the
    # iterations running then only where they cannot change what the epoch contains.
    join_running_dynamic_only: bool = False


def _probe_after_s(worker: _Worker) -> float:
    """How long a worker may be silent before the dispatcher checks that its
    port still accepts connections: two missed heartbeats, at least 1 s."""
    return max(1.0, 2.5 * worker.heartbeat_interval_s)


class NotLoaded(Exception):
    """Raised by a handler under `self._mu`, before it changed anything, when it
    needs something whose making does I/O (a dataset object, an iteration's split
    providers): `DispatcherBase._retry_when_loaded` calls `load` outside the lock
    and runs the handler again.

    Args:
        load: Makes the missing thing and caches it; called without `self._mu`.
    """

    def __init__(self, load: Callable[[], object]) -> None:
        super().__init__("needs loading outside the dispatcher lock")
        self.load = load


class DispatcherBase:
    """The fields of a `DispatchServer`, its journaled write path and its
    incarnation check. Thread-safe where the caller holds `self._mu` (methods
    ending in `_locked` expect it held).

    Args:
        config: The dispatcher's configuration.
    """

    def __init__(self, config: DispatcherConfig) -> None:
        self._config = config
        self._mu = threading.RLock()
        # Held while a dataset object is loaded or an iteration's split providers
        # are built, outside self._mu (datasets.py `_dataset_object`,
        # split_handout.py `_build_split_providers`), so that a racing caller waits
        # for the first one's result instead of making its own. Taken before
        # self._mu, never while holding it.
        self._load_mu = threading.RLock()
        self._server: grpc.Server | None = None
        self._port = self._config.port
        self._stop_event = threading.Event()
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []
        # guarded by self._mu:
        self._state = st.DispatcherState()
        self._journal: Journal | None = None
        # dataset_id -> DatasetDef, its big buffers as files of self._buffers
        self._datasets: dict[str, Any] = {}
        self._buffers = BufferStore(None)
        self._workers: dict[str, _Worker] = {}
        # Per worker address, how many tasks were given to it (tasks.py
        # WatchTasks: a worker's long poll returns when it changes), notified
        # on `_tasks_cv`; and how many watches are held now.
        self._task_generation: dict[str, int] = {}
        # Per worker address, the last tasks given to it: (generation, task id).
        self._tasks_given: dict[str, collections.deque[tuple[int, st.TaskId]]] = {}
        self._tasks_cv = threading.Condition(self._mu)
        self._watches = 0
        self._lost_uids: dict[str, str] = {}  # address -> uid of a worker declared lost
        # Runtime only, like the workers: given up by whoever restarts them
        # (address -> reason), and the iterations that failed for lack of workers.
        self._failed_workers: dict[str, str] = {}
        self._iteration_errors: dict[st.IterationId, str] = {}
        # Elements consumers fetched and never returned before leaving each iteration
        # (their final ConsumerCounters.left_unreturned; runtime only).
        self._left_by_departed: dict[st.IterationId, int] = {}
        self._client_seen: dict[st.IterationClientId, float] = {}
        self._job_last_used: dict[st.JobId, float] = {}
        # Since when each unfinished iteration of a named job has had no consumer
        # (liveness.py `_collect_iterations`; runtime only: a restart starts it over).
        self._iteration_idle_since: dict[st.IterationId, float] = {}
        self._split_providers: dict[st.IterationId, Any] = {}
        # Exactly-once DYNAMIC (exactly_once.py): what consumers and workers
        # tell again after a restart, so not journaled.
        self._eo_received: dict[st.IterationId, dict[int, dict[st.IterationClientId, Any]]] = {}
        self._eo_delivered: dict[st.IterationId, dict[int, dict[st.IterationClientId, Any]]] = {}
        self._eo_holder: dict[tuple[st.IterationId, int], str] = {}
        self._eo_orphans: dict[st.IterationId, dict[int, Any]] = {}
        self._eo_ready: dict[st.IterationId, list[int]] = {}
        self._eo_dead_uids: set[str] = set()
        # iteration -> ordinal -> generation of the split's current run (absent: 0),
        # and the runs replaced after a consumer left: ordinal -> consumers still to
        # say they drop the older run's elements.
        self._eo_generation: dict[st.IterationId, dict[int, int]] = {}
        self._eo_fences: dict[st.IterationId, dict[int, set[st.IterationClientId]]] = {}
        # Consumers journaled before this dispatcher started that have not sent a
        # heartbeat since: what they received is unknown here.
        self._eo_unheard: set[st.IterationClientId] = set()
        self._eo_told_unheard: set[tuple[st.IterationId, st.TaskId]] = set()  # logged once
        self._dataset_objects: dict[str, Any] = {}
        self._restart_time = time.monotonic()
        # The maintenance thread's: iterations with consumers and no worker.
        self._starved: dict[st.IterationId, _waits.SlowWait] = {}
        # Worker loss accounting (runtime only): DYNAMIC splits handed to each
        # task's current process, and per iteration the worker processes it lost.
        self._task_splits: dict[st.TaskId, int] = {}
        # GetSplits made harmless to retry (split_handout.py): per DYNAMIC
        # iteration, each split fetcher's (task, fetcher_id) last request number
        # and the answer it got. Runtime only: a grant whose answer a restart
        # cut off is a loss of DYNAMIC's at-most-once kind.
        self._split_grants: dict[st.IterationId, dict[tuple[st.TaskId, str], tuple[int, Any]]] = {}
        self._worker_losses: dict[st.IterationId, list[Any]] = {}
        self._probing: set[str] = set()  # addresses with a liveness probe in flight
        # Silence (liveness.py `_watch_silence_locked`): when an RPC from any
        # worker or client last arrived (time.monotonic(); written without the
        # lock by `_heard_rpc`, a float store), since when the dispatcher has
        # heard from nobody and suspects its own network (None: it does not),
        # and when it last warned about it.
        self._last_heard = time.monotonic()
        self._silent_since: float | None = None
        self._silence_warned_at = 0.0
        # When a maintenance tick last came late (the dispatcher did not run:
        # frozen, or its GIL held by one long call such as the parse of a
        # registration of hundreds of MB): no silence is declared within
        # `_silence_s()` of it (RPCs could not be heard meanwhile).
        self._deaf_at = float("-inf")
        # Status and metrics (observe.py; runtime only): each registered worker's and
        # iteration client's heartbeated counters with their recent history, and the
        # consumers' totals per (job, consumer process) for dataservice_consumer_*.
        self._worker_seen: dict[str, Any] = {}
        self._client_seen_counters: dict[st.IterationClientId, Any] = {}
        self._consumer_totals: dict[tuple[str, str], list[float]] = {}
        # The Prometheus registry and its endpoint (server.py; None: no metrics_port).
        self._metrics: Any = None
        self._metrics_endpoint: Any = None

    @property
    def target(self) -> str:
        """ "grpc://host:port" of this dispatcher (the bound port once started)."""
        host = self._config.host
        if host in ("0.0.0.0", "::", ""):
            host = "localhost"
        return f"grpc://{host}:{self._port}"

    def _apply_locked(self, update: st.Update) -> None:
        """Journal first (in fault-tolerant mode), then mutate: the only write path.
        Changes an operator follows are logged at INFO (observe.py)."""
        if self._journal is not None:
            self._journal.append(update)
        finished_before = self._finished_before_locked(update)
        self._state.apply(update)
        self._log_update_locked(update, finished_before)
        if (
            self._journal is not None
            and self._journal.records_since_snapshot >= journal_module.SNAPSHOT_EVERY_RECORDS
        ):
            self._journal.snapshot(self._state)

    def _finished_before_locked(self, update: st.Update) -> bool | None:
        return None  # observe.py

    def _log_update_locked(self, update: st.Update, finished_before: bool | None) -> None:
        pass  # observe.py

    def _retry_when_loaded(self, handler: Callable[[Any], Any], request: Any) -> Any:
        """`handler(request)`, run again after each `NotLoaded` it raises once its
        `load` is done (without `self._mu`, so call this without it: STYLE.md
        allows no I/O under the dispatcher lock but the journal write). The
        handler checks the state again on each run, so what a racing caller
        created meanwhile (an iteration, split providers) is found, not made twice.

        Raises:
            What `handler` or a `load` raises, except `NotLoaded`.
        """
        while True:
            try:
                return handler(request)
            except NotLoaded as missing:
                missing.load()

    def _check_incarnation_locked(self, incarnation_id: str) -> None:
        if incarnation_id and incarnation_id != self._state.incarnation_id:
            raise errors.DispatcherRestartedError(
                f"the dispatcher at {self.target} restarted without fault tolerance and lost "
                f"its state (incarnation {incarnation_id} is gone, now "
                f"{self._state.incarnation_id}); datasets, jobs and iterations must be "
                "created again (run the dispatcher with work_dir and fault_tolerant_mode=True "
                "to keep them across restarts)"
            )

    def _missing_shards_locked(self, it: st.Iteration, host: str | None) -> list[Any]:
        """The shards of `it` nobody reads now, as `pb.MissingShard`s (static
        sharding with a fixed worker list; empty otherwise): those no task read
        to its end (`DispatcherState.unread_shards`) and no live task reads.
        Their listed worker never registered, or registered and was lost.

        With `host` (a job that reads only local workers), only the shards
        that may be that host's: those of a worker registered there, and of a
        listed worker whose host is unknown or was that host when it was
        lost (a worker that never registered may be any host's).
        """
        unread = self._state.unread_shards(it)
        if not unread:
            return []
        listed = self._config.worker_addresses or []
        registered = {w.index: w for w in self._workers.values() if w.index >= 0}
        by_index: dict[int, list[st.Task]] = {}
        for t in sorted(it.tasks.values(), key=lambda t: t.task_id):
            by_index.setdefault(t.worker_index, []).append(t)
        missing = []
        for index in unread:
            tasks = by_index.get(index, [])
            if any(not t.finished and not t.removed for t in tasks):
                continue  # being read
            worker = registered.get(index)
            if host is not None:
                known_host = worker.host_id if worker else (tasks[-1].host_id if tasks else None)
                if known_host is not None and known_host != host:
                    continue
            address = worker.address if worker else (tasks[-1].worker_address if tasks else "")
            address = address or (listed[index] if index < len(listed) else f"#{index}")
            before = bool(tasks) or address in self._lost_uids or worker is not None
            if address in self._failed_workers:
                reason = f"given up by its supervisor: {self._failed_workers[address]}"
            elif worker is not None:
                reason = "registered, but runs no task of this iteration yet"
            elif before:
                reason = (
                    "registered, then was lost (its process exited or it sent no heartbeat "
                    "for worker_timeout_ms) and has not registered again"
                )
            else:
                reason = "has not registered with the dispatcher"
            missing.append(
                pb.MissingShard(
                    worker_address=address,
                    worker_index=index,
                    registered_before=before,
                    reason=reason,
                )
            )
        return missing

    def _host_part_finished_locked(self, it: st.Iteration, host: str) -> bool:
        """`DispatcherState.host_part_finished`, and under static sharding no
        shard that may be `host`'s is unread (`_missing_shards_locked`): the
        consumers on a host are not done while a listed worker that may be
        theirs has not delivered its shard."""
        if not self._state.host_part_finished(it, host):
            return False
        if it.finished:
            return True
        return not self._missing_shards_locked(it, host)
