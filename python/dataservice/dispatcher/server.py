"""The dispatcher: registers datasets, creates jobs, iterations and tasks,
hands out splits (DYNAMIC), tracks workers and clients by heartbeat, and
collects abandoned jobs. As tf.data service's dispatcher.

Every decision becomes a `state.Update` applied through `_apply_locked`, which
journals it first when `fault_tolerant_mode` is on. RPC handlers take
`self._mu`; nothing but the journal write does I/O under it.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from dataservice import _waits, auth, errors
from dataservice.config import DispatcherConfig
from dataservice.data import graph
from dataservice.dispatcher import journal as journal_module
from dataservice.dispatcher import state as st
from dataservice.dispatcher.buffer_store import BufferStore, check_inline
from dataservice.dispatcher.journal import Journal
from dataservice.locality import host_id
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import service_pb2_grpc, validate
from dataservice.rpc import util as rpc_util
from dataservice.sharding import STATIC_POLICIES, ShardingPolicy, worker_index_in

log = logging.getLogger(__name__)

_MAX_SPLITS_PER_RPC = 4096
BUFFERS_SUBDIR = "dataset_buffers"  # of work_dir: buffer_store.py
_ROUND_BLOCK = 64  # coordinated reads: rounds assigned per block
# A maintenance tick late by more than this (and 4 periods) means the
# dispatcher itself stalled (SIGSTOP, a paused VM, swapping): everyone gets the
# grace of a restart (`_grant_stall_grace_locked`). One late by more than
# _DEAF_S (and a period) is credited (`_credit_deaf_time_locked`); shorter
# scheduling delays are ignored, so that a dead worker is still noticed on time.
_STALL_S = 2.0
_DEAF_S = 0.25


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


# A consumer's report that it cannot reach a worker is checked after this long,
# which is what a supervisor needs to say that the worker is restarting.
_SUPERVISOR_GRACE_S = 1.0


def _probe_after_s(worker: _Worker) -> float:
    """How long a worker may be silent before the dispatcher checks that its
    port still accepts connections: two missed heartbeats, at least 1 s."""
    return max(1.0, 2.5 * worker.heartbeat_interval_s)


class _Servicer(service_pb2_grpc.DispatcherServiceServicer):
    def __init__(self, dispatcher: DispatchServer) -> None:
        self._d = dispatcher

    def _call(self, fn: Any, request: Any, context: grpc.ServicerContext) -> Any:
        """Runs one RPC's handler on a request checked at the edge
        (rpc/validate.py); every error becomes the status of its class
        (rpc/util.py), a bug INTERNAL, never a dead handler thread."""
        try:
            validate.check_request(request)
            return fn(request)
        except (errors.DataServiceError, ValueError) as err:
            rpc_util.abort_with(context, err)
        except Exception as err:  # a bug: report it as INTERNAL, with its type
            log.exception("dispatcher RPC failed")
            rpc_util.abort_with(context, errors.InternalError(f"{type(err).__name__}: {err}"))

    def GetDispatcherInfo(self, request: Any, context: Any) -> Any:
        return self._call(self._d._get_info, request, context)

    def WorkerHeartbeat(self, request: Any, context: Any) -> Any:
        return self._call(self._d._worker_heartbeat, request, context)

    def RegisterDataset(self, request: Any, context: Any) -> Any:
        return self._call(self._d._register_dataset, request, context)

    def GetDatasetDef(self, request: Any, context: Any) -> Any:
        return self._call(self._d._get_dataset_def, request, context)

    def GetElementSpec(self, request: Any, context: Any) -> Any:
        return self._call(self._d._get_element_spec, request, context)

    def GetOrCreateJob(self, request: Any, context: Any) -> Any:
        return self._call(self._d._get_or_create_job, request, context)

    def GetOrCreateIteration(self, request: Any, context: Any) -> Any:
        return self._call(self._d._get_or_create_iteration, request, context)

    def ClientHeartbeat(self, request: Any, context: Any) -> Any:
        return self._call(self._d._client_heartbeat, request, context)

    def ReleaseIterationClient(self, request: Any, context: Any) -> Any:
        return self._call(self._d._release_iteration_client, request, context)

    def GetSplits(self, request: Any, context: Any) -> Any:
        return self._call(self._d._get_splits, request, context)

    def GetRounds(self, request: Any, context: Any) -> Any:
        return self._call(self._d._get_rounds, request, context)

    def ReportWorkerFailure(self, request: Any, context: Any) -> Any:
        return self._call(self._d._report_worker_failure, request, context)


def _parse_journaled(journal: Journal, dataset: st.Dataset) -> Any:
    """The checked `DatasetDef` of a journaled dataset.

    Raises:
        DataLossError: Its file is damaged (journal.read_dataset), does not
            parse, or names a buffer file (written by a version that took
            client paths); names the file.
    """
    from dataservice.data.serialize import parse

    data = journal.read_dataset(dataset)
    path = journal.dataset_path(dataset.definition_sha256 or dataset.fingerprint)
    try:
        definition = parse(data)
        check_inline(definition, f"the DatasetDef in {path}")
    except errors.InvalidArgumentError as err:
        raise errors.DataLossError(
            f"the definition of dataset {dataset.dataset_id!r} ({path}) is not usable: {err}"
        ) from err
    return definition


class DispatchServer:
    """A dispatcher, as `tf.data.experimental.service.DispatchServer`.

    Thread-safe. Serves gRPC on `config.host` (127.0.0.1 unless told
    otherwise) and `config.port` (0 picks a free port).

    Args:
        config: The `DispatcherConfig`; defaults to `DispatcherConfig()`.
        start: Start serving now (else call `start()`).

    Raises:
        ValueError: A bad config (e.g. `fault_tolerant_mode` without `work_dir`).
        DataLossError: The journal in `work_dir` is damaged beyond a torn tail.
    """

    def __init__(self, config: DispatcherConfig | None = None, start: bool = True) -> None:
        self._config = config or DispatcherConfig()
        self._mu = threading.RLock()
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
        self._lost_uids: dict[str, str] = {}  # address -> uid of a worker declared lost
        # Runtime only, like the workers: given up by whoever restarts them
        # (address -> reason), and the iterations that failed for lack of workers.
        self._failed_workers: dict[str, str] = {}
        self._iteration_errors: dict[st.IterationId, str] = {}
        self._client_seen: dict[st.IterationClientId, float] = {}
        self._job_last_used: dict[st.JobId, float] = {}
        self._split_providers: dict[st.IterationId, Any] = {}
        self._dataset_objects: dict[str, Any] = {}
        self._restart_time = time.monotonic()
        # The maintenance thread's: iterations with consumers and no worker.
        self._starved: dict[st.IterationId, _waits.SlowWait] = {}
        # Worker loss accounting (runtime only): DYNAMIC splits handed to each
        # task's current process, and per iteration the worker processes it lost.
        self._task_splits: dict[st.TaskId, int] = {}
        self._worker_losses: dict[st.IterationId, list[Any]] = {}
        self._probing: set[str] = set()  # addresses with a liveness probe in flight
        if start:
            self.start()

    # ------------------------------------------------------------ lifecycle
    @property
    def target(self) -> str:
        """ "grpc://host:port" of this dispatcher (the bound port once started)."""
        host = self._config.host
        if host in ("0.0.0.0", "::", ""):
            host = "localhost"
        return f"grpc://{host}:{self._port}"

    def start(self) -> None:
        """Starts serving (replaying the journal first in fault-tolerant mode).

        Raises:
            UnavailableError: The port cannot be bound.
            ValueError: The token file cannot be read, or `host` is beyond
                loopback with no token and not `insecure` (see SECURITY.md).
        """
        if self._server is not None:
            return
        self._stop_event.clear()
        self._stopped.clear()
        token = auth.resolve_token(self._config.auth_token, self._config.auth_token_file)
        auth.check_bind("dispatcher", self._config.host, token, self._config.insecure)
        self._recover()
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="ds-dispatcher"),
            options=rpc_util.SERVER_OPTIONS,
            interceptors=rpc_util.server_interceptors(token, "dispatcher"),
        )
        validate.add_service(server, _Servicer(self), "DispatcherService")
        try:
            port = server.add_insecure_port(f"{self._config.host}:{self._config.port}")
        except RuntimeError as err:
            raise errors.UnavailableError(
                f"dispatcher cannot bind {self._config.host}:{self._config.port}: {err}"
            ) from err
        if port == 0:
            raise errors.UnavailableError(
                f"dispatcher cannot bind {self._config.host}:{self._config.port}"
            )
        self._port = port
        server.start()
        self._server = server
        t = threading.Thread(target=self._maintenance_loop, name="ds-dispatcher-gc", daemon=True)
        t.start()
        self._threads = [t]
        log.info("dispatcher serving on %s", self.target)

    def stop(self) -> None:
        """Stops serving, after in-flight RPCs finish (grace 1 s). Idempotent."""
        self._stop_event.set()
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=1.0).wait()
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []
        with self._mu:
            if self._journal is not None:
                self._journal.close()
                self._journal = None
            buffers = self._buffers
        buffers.close()
        self._stopped.set()

    def join(self) -> None:
        """Blocks until `stop()` is called."""
        self._stopped.wait()

    def num_workers(self) -> int:
        """The number of registered, live workers."""
        with self._mu:
            return len(self._workers)

    def __enter__(self) -> DispatchServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _recover(self) -> None:
        """Fresh state, or the journal's in fault-tolerant mode.

        Raises:
            DataLossError: A file of `work_dir` is damaged (journal.py, work_dir.py).
        """
        with self._mu:
            self._state = st.DispatcherState()
            self._datasets = {}
            self._buffers.close()
            self._buffers = BufferStore(None)
            self._workers = {}
            self._lost_uids = {}
            self._failed_workers = {}
            self._iteration_errors = {}
            self._client_seen = {}
            self._job_last_used = {}
            self._split_providers = {}
            self._dataset_objects = {}
            self._task_splits = {}
            self._worker_losses = {}
            self._journal = None
            if self._config.fault_tolerant_mode:
                assert self._config.work_dir
                journal = Journal(self._config.work_dir)
                self._state = journal.load_snapshot() or self._state
                for update in journal.replay():
                    self._state.apply(update)
                # The journal holds each definition with its buffers inline; the
                # buffer files are kept across restarts and rebuilt when missing.
                self._buffers = BufferStore(os.path.join(self._config.work_dir, BUFFERS_SUBDIR))
                for dataset_id, dataset in self._state.datasets.items():
                    self._datasets[dataset_id] = self._buffers.put(
                        _parse_journaled(journal, dataset), repair=False
                    )
                journal.retain_datasets(self._state.datasets.values())
                self._buffers.retain_only(list(self._datasets.values()))
                self._journal = journal
            now = time.monotonic()
            for client_id in self._state.clients:
                self._client_seen[client_id] = now
            for job_id in self._state.jobs:
                self._job_last_used[job_id] = now
            if not self._state.incarnation_id:
                self._apply_locked(st.SetIncarnation(uuid.uuid4().hex))

    def _apply_locked(self, update: st.Update) -> None:
        """Journal first (in fault-tolerant mode), then mutate: the only write path."""
        if self._journal is not None:
            self._journal.append(update)
        self._state.apply(update)
        if (
            self._journal is not None
            and self._journal.records_since_snapshot >= journal_module.SNAPSHOT_EVERY_RECORDS
        ):
            self._journal.snapshot(self._state)

    # ------------------------------------------------------------ helpers
    def _check_incarnation_locked(self, incarnation_id: str) -> None:
        if incarnation_id and incarnation_id != self._state.incarnation_id:
            raise errors.DispatcherRestartedError(
                f"the dispatcher at {self.target} restarted without fault tolerance and lost "
                f"its state (incarnation {incarnation_id} is gone, now "
                f"{self._state.incarnation_id}); datasets, jobs and iterations must be "
                "created again (run the dispatcher with work_dir and fault_tolerant_mode=True "
                "to keep them across restarts)"
            )

    def _worker_serves_locked(self, worker: _Worker, job: st.Job, iteration: st.Iteration) -> bool:
        """Whether `worker` gets a task in `iteration` of `job`.

        A job that reads every worker runs a task on each. A job that reads
        only local workers (`st.Job.reads_local_workers_only`: LOCAL, or AUTO
        with static sharding) runs tasks on the workers of each host that has a
        consumer of the iteration (`Iteration.consumer_hosts`), and each
        consumer is given only its own host's tasks (`_client_heartbeat`), so
        consumers of one named job on several hosts each read the workers
        local to them: under static sharding each host's consumers get the
        shards of that host's workers (a worker's shard is its index in
        `DispatcherConfig.worker_addresses`), under OFF a full copy from each
        of its workers. tf.data service instead runs a task on every worker
        and lets each client skip the tasks that are not local to it; tasks
        only where a consumer reads them keep workers on hosts without a
        consumer idle (they would produce elements nobody reads), and a
        consumer from a new host gets its tasks when it joins. Each host's
        consumers are done when that host's tasks are
        (`DispatcherState.host_part_finished`), and the iteration stays open
        to consumers from other hosts until its job is collected (except
        under DYNAMIC sharding, whose splits are the whole iteration's).
        """
        if not job.reads_local_workers_only:
            return True
        return worker.host_id in iteration.consumer_hosts and not (
            self._state.host_part_finished(iteration, worker.host_id)
        )

    def _host_part_over_locked(self, task: st.Task) -> bool:
        """Whether `task`'s iteration is over for the consumers on its host:
        the iteration finished, or, for a job that reads only local workers,
        that host's part of it (`DispatcherState.host_part_finished`)."""
        iteration = self._state.iterations[task.iteration_id]
        if iteration.finished:
            return True
        job = self._state.jobs[iteration.job_id]
        return job.reads_local_workers_only and self._state.host_part_finished(
            iteration, task.host_id
        )

    def _create_task_locked(self, iteration: st.Iteration, worker: _Worker) -> None:
        task_id = st.TaskId(self._state.next_task_id)
        self._apply_locked(
            st.CreateTask(
                task_id, iteration.iteration_id, worker.address, worker.index, worker.host_id
            )
        )

    def _has_task_locked(self, iteration: st.Iteration, worker: _Worker) -> bool:
        return any(
            t.worker_address == worker.address and not t.removed for t in iteration.tasks.values()
        )

    def _assign_tasks_to_worker_locked(self, worker: _Worker) -> None:
        """Gives a (re)registered worker a task in every unfinished iteration it serves."""
        for iteration in self._state.unfinished_iterations():
            job = self._state.jobs[iteration.job_id]
            if job.garbage_collected or not self._worker_serves_locked(worker, job, iteration):
                continue
            if iteration.iteration_id in self._iteration_errors:
                continue
            if job.processing_mode == ShardingPolicy.DYNAMIC and iteration.splits_ended:
                continue
            if self._has_task_locked(iteration, worker):
                continue
            self._create_task_locked(iteration, worker)

    def _add_host_tasks_locked(self, job: st.Job, iteration: st.Iteration, host: str) -> None:
        """A job that reads only local workers: gives each worker on `host`
        (the host of a consumer joining `iteration`) a task, if it has none."""
        if job.processing_mode == ShardingPolicy.DYNAMIC and iteration.splits_ended:
            return
        for worker in list(self._workers.values()):
            if worker.host_id == host and not self._has_task_locked(iteration, worker):
                self._create_task_locked(iteration, worker)

    def _check_local_workers_locked(self, job: st.Job, host: str) -> None:
        """Raises InvalidArgumentError if workers are registered but none on
        `host`, for a consumer of a job that reads only local workers (with no
        worker registered yet, it waits for them, as any read)."""
        if not self._workers or any(w.host_id == host for w in self._workers.values()):
            return
        why = "Local reads require local workers"
        if job.target_workers == "AUTO":
            why = (
                f"Static sharding ({ShardingPolicy(job.processing_mode).name}) with "
                "target_workers=AUTO reads the workers local to the client only"
            )
        raise errors.InvalidArgumentError(
            f"{why}, but no local worker is found: {len(self._workers)} workers are "
            f"registered, none on the client's host ({host}); use target_workers='ANY' "
            "to read every worker"
        )

    def _add_task_info_locked(self, infos: Any, task: st.Task) -> None:
        """Appends where `task` runs to a repeated TaskInfo field (the worker's
        transfer address and host id once it has registered since a restart)."""
        worker = self._workers.get(task.worker_address)
        silent_ms = 0
        if worker is not None and not worker.restarting:
            silent_s = time.monotonic() - worker.last_heartbeat
            if silent_s > _probe_after_s(worker):
                silent_ms = int(silent_s * 1000)
        infos.add(
            task_id=task.task_id,
            worker_address=task.worker_address,
            transfer_address=worker.transfer_address if worker else task.worker_address,
            host_id=worker.host_id if worker else "",
            worker_silent_ms=silent_ms,
            worker_pid=worker.pid if worker else 0,
        )

    def _dataset_object(self, dataset_id: str) -> Any:
        from dataservice.data.serialize import load

        obj = self._dataset_objects.get(dataset_id)
        if obj is None:
            try:
                obj = load(self._datasets[dataset_id])  # maps the buffer files
            except OSError as err:
                raise errors.DataLossError(
                    f"dataset {dataset_id}: a buffer file is unreadable: {err}"
                ) from err
            self._dataset_objects[dataset_id] = obj
        return obj

    # ------------------------------------------------------------ RPCs
    def _get_info(self, request: Any) -> Any:
        with self._mu:
            return pb.DispatcherInfoResponse(
                incarnation_id=self._state.incarnation_id,
                fault_tolerant_mode=self._config.fault_tolerant_mode,
                client_timeout_ms=self._config.client_timeout_ms_or_default,
                worker_timeout_ms=self._config.worker_timeout_ms_or_default,
            )

    def _worker_heartbeat(self, request: Any) -> Any:
        now = time.monotonic()
        with self._mu:
            address = request.worker_address
            for task_id in request.finished_tasks:
                task = self._state.tasks.get(st.TaskId(task_id))
                if task is not None and task.worker_address != address:
                    # Unknown ids are left to reconciliation; another worker's are wrong.
                    raise errors.FailedPreconditionError(
                        f"WorkerHeartbeat: finished_tasks has task {task_id}, which runs on "
                        f"worker {task.worker_address}, not on {address}"
                    )
            worker = self._workers.get(address)
            index = -1
            if self._config.worker_addresses is not None:
                if worker is not None and worker.index >= 0:
                    index = worker.index  # keeps its position across heartbeats
                else:
                    taken = frozenset(w.index for a, w in self._workers.items() if a != address)
                    index = worker_index_in(address, self._config.worker_addresses, taken)
                if index < 0:
                    raise errors.InvalidArgumentError(
                        f"worker {address} is not in the dispatcher's fixed worker list "
                        f"(worker_addresses={self._config.worker_addresses}); a dispatcher "
                        "with a worker list only accepts those workers"
                    )
            if worker is None and self._lost_uids.get(address) == request.worker_uid:
                # Declared lost but it is the same process (it was only slow):
                # revive the tasks it still runs instead of starting them over
                # (not where its host's consumers are done: local reads).
                for task_id in request.current_tasks:
                    task = self._state.tasks.get(st.TaskId(task_id))
                    if (
                        task is not None
                        and task.removed
                        and task.worker_address == address
                        and not self._host_part_over_locked(task)
                    ):
                        self._apply_locked(st.ReviveTask(task.task_id))
                self._forget_losses_of_locked(request.worker_uid)
                log.info("worker %s is back (it was only slow)", address)
            if worker is None or worker.uid != request.worker_uid:
                if worker is None:
                    log.info("worker %s registered", address)
                else:
                    log.info("worker %s restarted", address)
                self._failed_workers.pop(address, None)  # back after all
                worker = _Worker(
                    address,
                    request.transfer_address or address,
                    request.host_id,
                    request.worker_uid,
                    now,
                    request.heartbeat_interval_ms / 1000,
                    index,
                    pid=request.pid,
                )
                self._workers[address] = worker
                self._assign_tasks_to_worker_locked(worker)
            worker.last_heartbeat = now
            for task_id in request.finished_tasks:
                task = self._state.tasks.get(st.TaskId(task_id))
                if task is not None and not task.finished and not task.removed:
                    self._apply_locked(st.FinishTask(task.task_id))
            current = set(request.current_tasks)
            assigned = self._state.tasks_of_worker(address)
            assigned_ids = {t.task_id for t in assigned}
            response = pb.WorkerHeartbeatResponse(incarnation_id=self._state.incarnation_id)
            for task in assigned:
                if task.task_id in current:
                    continue
                iteration = self._state.iterations[task.iteration_id]
                job = self._state.jobs[iteration.job_id]
                response.new_tasks.add(
                    task_id=task.task_id,
                    iteration_id=iteration.iteration_id,
                    job_id=job.job_id,
                    dataset_id=job.dataset_id,
                    processing_mode=job.processing_mode,
                    repetition=iteration.repetition,
                    num_consumers=job.num_consumers,
                    worker_index=task.worker_index,
                    num_workers=len(self._config.worker_addresses or ()),
                    job_name=job.job_name,
                    use_cross_trainer_cache=job.use_cross_trainer_cache,
                )
            response.tasks_to_delete.extend(sorted(current - assigned_ids))
            return response

    def _registered_locked(self, request: Any) -> str | None:
        """The id under which the dataset of `request` (a RegisterDatasetRequest)
        is registered already, or None.

        Raises:
            InvalidArgumentError: The requested id holds a dataset of another
                element_spec.
        """
        requested = request.dataset_id
        if not requested:
            return self._state.datasets_by_fingerprint.get(request.fingerprint)
        existing = self._state.datasets.get(requested)
        if existing is None:
            return None
        if (
            existing.element_spec
            and request.element_spec
            and existing.element_spec != request.element_spec
        ):
            raise errors.InvalidArgumentError(
                f"Datasets with the same ID should have the same structure: "
                f"dataset ID {requested!r} is registered with a different "
                "structure (element_spec) than the dataset given now"
            )
        return str(requested)

    def _register_dataset(self, request: Any) -> Any:
        from dataservice.data.serialize import parse

        definition = parse(request.dataset)
        check_inline(definition, "RegisterDatasetRequest.dataset")  # no file a client names
        with self._mu:
            found = self._registered_locked(request)
            if found is not None:
                return pb.RegisterDatasetResponse(dataset_id=found)
            buffers = self._buffers
        # Writing big buffers to their files can take seconds: not under the lock.
        stored = buffers.put(definition)
        with self._mu:
            if buffers is not self._buffers:
                raise errors.UnavailableError("the dispatcher restarted; register again")
            found = self._registered_locked(request)  # by another client meanwhile
            if found is not None:
                return pb.RegisterDatasetResponse(dataset_id=found)
            dataset_id = request.dataset_id
            auto = not dataset_id
            if auto:
                dataset_id = str(self._state.next_dataset_number)
                while dataset_id in self._state.datasets:
                    dataset_id = str(int(dataset_id) + 1)
            definition_sha256 = ""
            if self._journal is not None:
                definition_sha256 = self._journal.write_dataset(request.dataset)
            self._datasets[dataset_id] = stored
            self._apply_locked(
                st.RegisterDataset(
                    dataset_id,
                    request.fingerprint,
                    request.element_spec,
                    request.cardinality,
                    auto,
                    definition_sha256,
                )
            )
            return pb.RegisterDatasetResponse(dataset_id=dataset_id)

    def _get_dataset_def(self, request: Any) -> Any:
        with self._mu:
            definition = self._datasets.get(request.dataset_id)
            if definition is None:
                raise errors.NotFoundError(f"Dataset id {request.dataset_id} not found")
        if not request.host_id or request.host_id != host_id():
            # Another host cannot map our files: read them (outside the lock).
            definition = self._buffers.inline(definition)
        return pb.GetDatasetDefResponse(dataset=definition)

    def _get_element_spec(self, request: Any) -> Any:
        with self._mu:
            dataset = self._state.datasets.get(request.dataset_id)
            if dataset is None:
                raise errors.NotFoundError(f"Dataset id {request.dataset_id} not found")
            return pb.GetElementSpecResponse(
                element_spec=dataset.element_spec, cardinality=dataset.cardinality
            )

    def _get_or_create_job(self, request: Any) -> Any:
        mode = request.processing_mode
        if mode == ShardingPolicy.DYNAMIC:
            # Build a split provider now, outside the lock, so a pipeline that
            # cannot be split fails here, naming its first unsplittable op.
            with self._mu:
                self._check_incarnation_locked(request.incarnation_id)
                if request.dataset_id not in self._datasets:
                    raise errors.NotFoundError(f"Dataset id {request.dataset_id} not found")
            try:
                graph.split_providers(self._dataset_object(request.dataset_id), 0)
            except errors.DataServiceError:
                raise
            except ValueError as err:
                raise errors.InvalidArgumentError(str(err)) from err
        with self._mu:
            self._check_incarnation_locked(request.incarnation_id)
            if request.dataset_id not in self._state.datasets:
                raise errors.NotFoundError(f"Dataset id {request.dataset_id} not found")
            if mode in STATIC_POLICIES and not self._config.worker_addresses:
                raise errors.InvalidArgumentError(
                    f"static sharding ({ShardingPolicy(mode).name}) needs a fixed worker list: "
                    "set DispatcherConfig.worker_addresses (a worker's index is its position "
                    f"in it); got {self._config.worker_addresses!r}"
                )
            if request.num_consumers:
                if request.target_workers == "LOCAL":
                    raise errors.InvalidArgumentError(
                        "Coordinated reads require non-local workers: target_workers=LOCAL "
                        "cannot be used with num_consumers"
                    )
                cardinality = self._state.datasets[request.dataset_id].cardinality
                if cardinality >= 0:
                    raise errors.FailedPreconditionError(
                        "Round robin reads (num_consumers/consumer_index) require that the "
                        "input dataset has infinite cardinality, but the dataset has "
                        f"cardinality {cardinality}; add .repeat() before distribute"
                    )
            cache = request.use_cross_trainer_cache
            if cache:
                if not request.job_name:
                    raise errors.InvalidArgumentError(
                        "A cross-trainer cache needs a named job: set `job_name`"
                    )
                cardinality = self._state.datasets[request.dataset_id].cardinality
                if cardinality >= 0:
                    raise errors.FailedPreconditionError(
                        "Cross-trainer caching requires the input dataset to be infinite, "
                        f"but it has cardinality {cardinality}; add .repeat() before distribute"
                    )
            target = request.target_workers or "AUTO"
            if request.job_name:
                job = self._state.live_job_named(request.job_name)
                if job is not None:
                    diffs = []
                    if job.dataset_id != request.dataset_id:
                        diffs.append(
                            f"dataset id (existing: {job.dataset_id}, "
                            f"requested: {request.dataset_id})"
                        )
                    if job.processing_mode != mode:
                        diffs.append(
                            "processing mode (existing: "
                            f"{ShardingPolicy(job.processing_mode).name}, requested: "
                            f"{ShardingPolicy(mode).name})"
                        )
                    if job.target_workers != target:
                        diffs.append(
                            f"target_workers (existing: {job.target_workers}, requested: {target})"
                        )
                    if job.use_cross_trainer_cache != cache:
                        diffs.append(
                            f"cross-trainer cache (existing: {job.use_cross_trainer_cache}, "
                            f"requested: {cache})"
                        )
                    if job.num_consumers != request.num_consumers:
                        diffs.append(
                            f"num_consumers (existing: {job.num_consumers}, "
                            f"requested: {request.num_consumers})"
                        )
                    if not diffs:
                        self._job_last_used[job.job_id] = time.monotonic()
                        return pb.GetOrCreateJobResponse(job_id=job.job_id)
                    if job.dataset_id == request.dataset_id:
                        # As tf.data service: one job, one set of parameters.
                        raise errors.InvalidArgumentError(
                            f"Tried to create job with name {request.job_name}, but found an "
                            f"existing job with different parameters: {'; '.join(diffs)} "
                            "differ. A job's parameters cannot change under its name (a new "
                            "pipeline, another dataset id, replaces a job whose iterations "
                            "finished and whose consumers left): use another job_name"
                        )
                    in_use = self._job_in_use_locked(job)
                    if in_use:
                        raise errors.InvalidArgumentError(
                            f"Tried to create job with name {request.job_name}, but found an "
                            f"existing job with different parameters: {'; '.join(diffs)} "
                            f"differ. Job {job.job_id} is still in use: {'; '.join(in_use)}. "
                            + self._how_to_replace_locked(job)
                        )
                    # A new pipeline, every iteration of the old one finished and nobody
                    # reads it: the name goes to the new one now, not after job GC
                    # (tf.data service refuses any mismatch while the job exists).
                    log.info(
                        "job %d (%s) replaced by a new job: %s differ",
                        job.job_id,
                        job.job_name,
                        "; ".join(diffs),
                    )
                    self._apply_locked(st.RetireJob(job.job_id))
                    self._forget_job_locked(job)
            job_id = st.JobId(self._state.next_job_id)
            self._apply_locked(
                st.CreateJob(
                    job_id,
                    request.dataset_id,
                    request.job_name,
                    mode,
                    request.num_consumers,
                    target,
                    request.client_host_id,
                    cache,
                )
            )
            self._job_last_used[job_id] = time.monotonic()
            return pb.GetOrCreateJobResponse(job_id=job_id)

    def _job_in_use_locked(self, job: st.Job) -> list[str]:
        """Why `job` cannot give its name to another job now (empty: it can):
        its iterations with consumers attached (ids, repetition, iteration
        client ids), and those no consumer reads that did not finish."""
        in_use = []
        for repetition, iteration_id in sorted(job.iterations.items()):
            it = self._state.iterations[iteration_id]
            if it.clients:
                ids = ", ".join(str(c) for c in sorted(it.clients))
                in_use.append(
                    f"iteration {iteration_id} (repetition {repetition}) has "
                    f"{len(it.clients)} consumer(s) attached (iteration client ids {ids})"
                )
            elif not self._iteration_done_locked(job, it):
                in_use.append(
                    f"iteration {iteration_id} (repetition {repetition}) did not finish, "
                    "and no consumer reads it (its consumers stopped before the end)"
                )
        return in_use

    def _iteration_done_locked(self, job: st.Job, it: st.Iteration) -> bool:
        """Finished; for a job whose consumers read their own host's workers
        (which ends per host), finished on every host a consumer read from."""
        if it.finished:
            return True
        if job.reads_local_workers_only and job.processing_mode != ShardingPolicy.DYNAMIC:
            return bool(it.consumer_hosts) and all(
                self._state.host_part_finished(it, host) for host in it.consumer_hosts
            )
        return False

    def _how_to_replace_locked(self, job: st.Job) -> str:
        """How a user gets `job`'s name for another pipeline (an error's tail)."""
        gc_ms = self._config.job_gc_timeout_ms_or_default
        collected = (
            "a named DYNAMIC job is never garbage collected"
            if job.processing_mode == ShardingPolicy.DYNAMIC
            else f"it is garbage collected job_gc_timeout_ms ({gc_ms} ms) after its last "
            "consumer left"
        )
        return (
            "It can be replaced once each of its iterations has finished and no consumer "
            "is attached: consumers must read to the end, and a consumer leaves when its "
            "iterator ends, is closed or deleted, or sends no heartbeat for "
            f"client_timeout_ms ({self._config.client_timeout_ms_or_default} ms). An "
            f"iteration left unfinished keeps the job until it is collected ({collected}). "
            "Or use another job_name"
        )

    def _forget_job_locked(self, job: st.Job) -> None:
        """Drops the runtime state of a job that was collected or retired."""
        for iteration_id in job.iterations.values():
            self._split_providers.pop(iteration_id, None)
            self._worker_losses.pop(iteration_id, None)
        self._job_last_used.pop(job.job_id, None)

    def _get_or_create_iteration(self, request: Any) -> Any:
        with self._mu:
            self._check_incarnation_locked(request.incarnation_id)
            job = self._state.jobs.get(st.JobId(request.job_id))
            if job is None:
                raise errors.NotFoundError(f"Job {request.job_id} not found")
            if job.retired:
                replacement = self._state.live_job_named(job.job_name)
                raise errors.NotFoundError(
                    f"Job {request.job_id} ({job.job_name}) was replaced by "
                    + (f"job {replacement.job_id}" if replacement else "a newer job")
                    + " of the same name with another dataset or parameters, after its "
                    "consumers had finished: iterate the new pipeline, or use another job_name"
                )
            if job.garbage_collected:
                raise errors.NotFoundError(
                    f"Job {request.job_id} ({job.job_name or 'anonymous'}) was garbage "
                    "collected: no client read it for job_gc_timeout_ms"
                )
            if job.use_cross_trainer_cache and request.repetition > 0:
                raise errors.FailedPreconditionError(
                    f"job {job.job_name!r} reads through a cross-trainer cache over an infinite "
                    f"dataset: it has one repetition, and repetition {request.repetition} was "
                    "requested (iterate each distributed dataset once, or use a new job_name)"
                )
            local = job.reads_local_workers_only
            # The consumer's host (a client that does not say: its job's creator's).
            host = request.client_host_id or job.client_host_id
            iteration_id = job.iterations.get(request.repetition)
            known = self._state.iterations[iteration_id] if iteration_id is not None else None
            new_host = local and (known is None or host not in known.consumer_hosts)
            if new_host:
                self._check_local_workers_locked(job, host)
            already_finished = False
            if iteration_id is None:
                iteration_id = st.IterationId(self._state.next_iteration_id)
                num_providers = 1
                if job.processing_mode == ShardingPolicy.DYNAMIC:
                    dataset = self._dataset_object(job.dataset_id)
                    num_providers = graph.num_split_sources(dataset)
                self._apply_locked(
                    st.CreateIteration(
                        iteration_id,
                        job.job_id,
                        request.repetition,
                        random.getrandbits(62),
                        num_providers,
                    )
                )
                iteration = self._state.iterations[iteration_id]
                if not local:  # else the tasks of each consumer's host, as it joins
                    for worker in list(self._workers.values()):
                        self._create_task_locked(iteration, worker)
                created = True
            else:
                iteration = self._state.iterations[iteration_id]
                if local:
                    already_finished = self._state.host_part_finished(iteration, host)
                else:
                    already_finished = iteration.finished
                created = False
            error = self._iteration_errors.get(iteration_id)
            if error is not None:
                raise errors.WorkerCrashedError(error)
            client_id = st.IterationClientId(self._state.next_client_id)
            self._apply_locked(st.AcquireIterationClient(client_id, iteration_id, host))
            if local and not already_finished:
                self._add_host_tasks_locked(job, iteration, host)
            if created or new_host:
                self._fail_stranded_iterations_locked()
                error = self._iteration_errors.get(iteration_id)
                if error is not None:
                    self._release_client_locked(client_id)
                    raise errors.WorkerCrashedError(error)
            now = time.monotonic()
            self._client_seen[client_id] = now
            self._job_last_used[job.job_id] = now
            return pb.GetOrCreateIterationResponse(
                iteration_client_id=client_id,
                iteration_id=iteration_id,
                already_finished=already_finished,
            )

    def _client_heartbeat(self, request: Any) -> Any:
        with self._mu:
            self._check_incarnation_locked(request.incarnation_id)
            client_id = st.IterationClientId(request.iteration_client_id)
            iteration_id = self._state.clients.get(client_id)
            if iteration_id is None:
                raise errors.NotFoundError(
                    f"Unknown iteration client id {client_id}: it was released or timed out "
                    "(no heartbeat for client_timeout_ms), or its job was garbage collected"
                )
            now = time.monotonic()
            self._client_seen[client_id] = now
            iteration = self._state.iterations[iteration_id]
            self._job_last_used[iteration.job_id] = now
            error = self._iteration_errors.get(iteration_id)
            if error is not None:
                raise errors.WorkerCrashedError(error)
            self._probe_unreachable_locked(request.unreachable_workers, now)
            for task_id in request.finished_tasks:
                task = iteration.tasks.get(st.TaskId(task_id))
                if task is not None and not task.finished and not task.removed:
                    self._apply_locked(st.FinishTask(task.task_id))
            job = self._state.jobs[iteration.job_id]
            if job.reads_local_workers_only:
                # This consumer reads its own host's workers, and is done with them.
                host = self._state.client_hosts.get(client_id) or job.client_host_id
                finished = self._state.host_part_finished(iteration, host)
                tasks = [t for t in iteration.live_tasks() if t.host_id == host]
            else:
                finished = iteration.finished
                tasks = iteration.live_tasks()
            response = pb.ClientHeartbeatResponse(iteration_finished=finished)
            for task in tasks:
                self._add_task_info_locked(response.tasks, task)
            response.lost_workers.extend(self._worker_losses.get(iteration_id, ()))
            return response

    def _release_iteration_client(self, request: Any) -> Any:
        with self._mu:
            if request.incarnation_id and request.incarnation_id != self._state.incarnation_id:
                return pb.ReleaseIterationClientResponse()
            self._release_client_locked(st.IterationClientId(request.iteration_client_id))
            return pb.ReleaseIterationClientResponse()

    def _release_client_locked(self, client_id: st.IterationClientId) -> None:
        iteration_id = self._state.clients.get(client_id)
        if iteration_id is None:
            return
        self._apply_locked(st.ReleaseIterationClient(client_id))
        self._client_seen.pop(client_id, None)
        job = self._state.job_of_iteration(iteration_id)
        iteration = self._state.iterations[iteration_id]
        # Nobody else can join an anonymous job: free its tasks at once.
        if not job.job_name and not iteration.clients and not job.garbage_collected:
            self._apply_locked(st.GarbageCollectJob(job.job_id))
            self._split_providers.pop(iteration_id, None)

    def _get_splits(self, request: Any) -> Any:
        iteration_id = st.IterationId(request.iteration_id)
        max_splits = max(1, min(request.max_splits or 1, _MAX_SPLITS_PER_RPC))
        with self._mu:
            self._check_incarnation_locked(request.incarnation_id)
            iteration = self._state.iterations.get(iteration_id)
            if iteration is None:
                raise errors.NotFoundError(f"Iteration {iteration_id} not found")
            job = self._state.jobs[iteration.job_id]
            if job.processing_mode != ShardingPolicy.DYNAMIC:
                raise errors.FailedPreconditionError(
                    f"GetSplits: iteration {iteration_id} belongs to job {job.job_id}, whose "
                    f"processing mode is {ShardingPolicy(job.processing_mode).name}: only "
                    "DYNAMIC iterations hand out splits"
                )
            if st.TaskId(request.task_id) not in iteration.tasks:
                raise errors.NotFoundError(
                    f"GetSplits: task {request.task_id} is not a task of iteration {iteration_id}"
                )
            index = request.split_provider_index
            response = pb.GetSplitsResponse()
            task_id = st.TaskId(request.task_id)
            task = iteration.tasks.get(task_id)
            # (A task whose worker was declared lost still gets splits: only a
            # live process asks, and it is revived when it heartbeats again.)
            if iteration.finished or iteration.splits_ended_by_provider.get(index, False):
                response.end_of_splits = True
                return response
            providers = self._split_providers.get(iteration_id)
            if providers is None:
                dataset = self._dataset_object(job.dataset_id)
                providers = graph.split_providers(dataset, iteration.seed)
                for i, provider in enumerate(providers):
                    # Replay after a restart: skip what was handed out already.
                    for _ in range(iteration.splits_produced.get(i, 0)):
                        if provider.get_next() is None:
                            break
                self._split_providers[iteration_id] = providers
            if not 0 <= index < len(providers):
                raise errors.InvalidArgumentError(
                    f"split provider {index} requested, the pipeline has {len(providers)}"
                )
            provider = providers[index]
            # Fair shares: never hand one task more than half of its even share
            # of what is left, so a small epoch (16 files) spreads over the workers.
            total = provider.cardinality()
            if total > 0:
                remaining = max(0, total - iteration.splits_produced.get(index, 0))
                share = remaining // (2 * max(1, len(iteration.live_tasks())))
                max_splits = max(1, min(max_splits, share))
            splits = []
            end = False
            for _ in range(max_splits):
                split = provider.get_next()
                if split is None:
                    end = True
                    break
                splits.append(split)
            self._apply_locked(st.ProduceSplits(iteration_id, len(splits), end, index))
            if task is not None:
                self._task_splits[task_id] = self._task_splits.get(task_id, 0) + len(splits)
            if splits and isinstance(splits[0], str):
                response.str_splits.extend(splits)
            else:
                response.int_splits.extend(int(s) for s in splits)
            response.end_of_splits = end
            return response

    def _get_rounds(self, request: Any) -> Any:
        iteration_id = st.IterationId(request.iteration_id)
        first = request.first_round - request.first_round % _ROUND_BLOCK
        with self._mu:
            self._check_incarnation_locked(request.incarnation_id)
            iteration = self._state.iterations.get(iteration_id)
            if iteration is None:
                raise errors.NotFoundError(f"Iteration {iteration_id} not found")
            job = self._state.jobs[iteration.job_id]
            if not job.num_consumers:
                raise errors.FailedPreconditionError(
                    f"GetRounds: iteration {iteration_id} belongs to job {job.job_id}, which is "
                    "not a coordinated read (no num_consumers): it has no rounds"
                )
            if request.dead_task_id and st.TaskId(request.dead_task_id) not in iteration.tasks:
                raise errors.NotFoundError(
                    f"GetRounds: dead_task_id {request.dead_task_id} is not a task of "
                    f"iteration {iteration_id}"
                )
            live = sorted(t.task_id for t in iteration.live_tasks())
            response = pb.GetRoundsResponse(first_round=first)
            if not live:
                return response  # no worker yet: the client asks again
            dead = st.TaskId(request.dead_task_id)
            if dead and dead not in live:
                # Move the rounds of a lost task, from this round on, to live tasks.
                stale = sorted(
                    r for r, t in iteration.rounds.items() if t == dead and r >= request.first_round
                )
                for r in stale:
                    self._apply_locked(st.AssignRounds(iteration_id, r, (live[r % len(live)],)))
            if first not in iteration.rounds:
                self._apply_locked(
                    st.AssignRounds(
                        iteration_id,
                        first,
                        tuple(live[(first + i) % len(live)] for i in range(_ROUND_BLOCK)),
                    )
                )
            task_ids = [iteration.rounds[first + i] for i in range(_ROUND_BLOCK)]
            response.task_ids.extend(task_ids)
            for task_id in sorted(set(task_ids)):
                self._add_task_info_locked(response.tasks, self._state.tasks[task_id])
            return response

    def _report_worker_failure(self, request: Any) -> Any:
        """A worker's supervisor (LocalCluster) saw its process exit.

        With `request.restarting` it restarts the worker on the same address:
        what the dead process held is counted lost (`_record_losses_locked`) and
        its tasks are kept for the new process. Otherwise the supervisor gave
        up on it (restarts off, or `max_worker_restarts` used up): drop it and
        its tasks now (no need to wait for worker_timeout_ms), and fail the
        iterations no worker can run any more."""
        address = request.worker_address
        if not address:
            raise errors.InvalidArgumentError("ReportWorkerFailure needs a worker_address")
        reason = request.reason or f"worker {address} failed"
        with self._mu:
            worker = self._workers.get(address)
            uid = worker.uid if worker is not None else ""
            pid = request.pid or (worker.pid if worker is not None else 0)
            if request.restarting:
                if worker is not None and request.pid and worker.pid not in (0, request.pid):
                    # Its next process registered already: the report is late,
                    # and what the task holds now is the new process's.
                    log.warning("worker %s exited (late report): %s", address, reason)
                    return pb.ReportWorkerFailureResponse()
                log.warning("worker %s exited; its supervisor restarts it: %s", address, reason)
                if worker is not None:
                    worker.restarting = True
                self._record_losses_locked(address, uid, pid, reason, restarting=True)
                return pb.ReportWorkerFailureResponse()
            log.warning("worker %s given up by its supervisor: %s", address, reason)
            self._failed_workers[address] = reason
            self._record_losses_locked(address, uid, pid, reason, restarting=False)
            self._workers.pop(address, None)
            if worker is not None:
                self._lost_uids[address] = worker.uid
            self._remove_tasks_of_locked(address)
            self._fail_stranded_iterations_locked()
            return pb.ReportWorkerFailureResponse()

    def _record_losses_locked(
        self, address: str, uid: str, pid: int, reason: str, *, restarting: bool
    ) -> None:
        """Notes, for each unfinished iteration with a live task on `address`,
        that the worker process `uid` was lost, with the DYNAMIC splits handed
        to it (those whose elements no consumer received are lost: tf.data
        service's DYNAMIC mode is at-most-once). The consumers learn of it by
        their next heartbeat (`ClientHeartbeatResponse.lost_workers`), warn
        once, and list it in `stats()["lost_workers"]`. Splits handed to the
        task from now on belong to its next process."""
        for task in self._state.tasks_of_worker(address):
            iteration = self._state.iterations[task.iteration_id]
            job = self._state.jobs[iteration.job_id]
            splits = self._task_splits.pop(task.task_id, 0)
            one_per_split = False
            if job.processing_mode == ShardingPolicy.DYNAMIC:
                providers = self._split_providers.get(iteration.iteration_id) or []
                dataset = self._state.datasets.get(job.dataset_id)
                one_per_split = (
                    len(providers) == 1
                    and dataset is not None
                    and dataset.cardinality > 0
                    and providers[0].cardinality() == dataset.cardinality
                )
            self._worker_losses.setdefault(iteration.iteration_id, []).append(
                pb.WorkerLossReport(
                    worker_address=address,
                    worker_uid=uid,
                    pid=pid,
                    reason=reason,
                    task_id=task.task_id,
                    splits_handed_out=splits,
                    one_element_per_split=one_per_split,
                    restarting=restarting,
                )
            )
            if splits:
                log.warning(
                    "worker %s (pid %s) lost with %d splits of iteration %d handed to its "
                    "task %d: %s",
                    address,
                    pid or "unknown",
                    splits,
                    iteration.iteration_id,
                    task.task_id,
                    reason,
                )

    def _forget_losses_of_locked(self, uid: str) -> None:
        """A worker declared lost came back as the same process: it lost nothing."""
        for losses in self._worker_losses.values():
            for r in losses:
                if r.worker_uid == uid:
                    task_id = st.TaskId(r.task_id)
                    self._task_splits[task_id] = (
                        self._task_splits.get(task_id, 0) + r.splits_handed_out
                    )
            losses[:] = [r for r in losses if r.worker_uid != uid]

    def _fail_stranded_iterations_locked(self) -> None:
        """Fails (WorkerCrashedError, for its consumers) every unfinished
        iteration that no worker can run any more: it has no live task, no
        registered worker serves its job, no lost worker may still come back,
        and some worker was given up on (ReportWorkerFailure). Without a
        given-up worker an iteration waits for workers, as in tf.data service.
        A job that reads only local workers fails once the consumers of one
        host have neither a live task nor a worker there (and their part is
        not over), though consumers on other hosts could go on: the error is
        the iteration's."""
        if not self._failed_workers:
            return
        if any(a not in self._workers and a not in self._failed_workers for a in self._lost_uids):
            return  # a lost worker may come back (restarted on its address)
        for iteration in self._state.unfinished_iterations():
            if iteration.iteration_id in self._iteration_errors:
                continue
            job = self._state.jobs[iteration.job_id]
            if job.garbage_collected:
                continue
            if job.reads_local_workers_only:
                live_hosts = {t.host_id for t in iteration.live_tasks()}
                stranded = [
                    h
                    for h in iteration.consumer_hosts
                    if h not in live_hosts
                    and not self._state.host_part_finished(iteration, h)
                    and not any(w.host_id == h for w in self._workers.values())
                ]
                if not stranded:
                    continue
                held = {t.worker_address for t in iteration.tasks.values() if t.host_id in stranded}
            else:
                if iteration.live_tasks() or self._workers:
                    continue
                held = {t.worker_address for t in iteration.tasks.values()}
            reasons = [r for a, r in self._failed_workers.items() if a in held]
            name = f" ({job.job_name})" if job.job_name else ""
            self._iteration_errors[iteration.iteration_id] = (
                f"no worker is left to run job {job.job_id}{name}, repetition "
                f"{iteration.repetition}: its workers kept exiting and were given up on:\n  "
                + "\n  ".join(reasons or self._failed_workers.values())
            )
            log.error("%s", self._iteration_errors[iteration.iteration_id])

    # ------------------------------------------------------------ maintenance
    def _maintenance_loop(self) -> None:
        cfg = self._config
        period_s = (
            min(
                cfg.worker_timeout_ms_or_default / 4,
                cfg.client_timeout_ms_or_default / 4,
                cfg.job_gc_check_interval_ms_or_default,
                500,
            )
            / 1000
        )
        stall_s = max(_STALL_S, 4 * period_s)
        deaf_s = max(_DEAF_S, period_s)
        next_gc = time.monotonic() + cfg.job_gc_check_interval_ms_or_default / 1000
        # Workers that held tasks before a restart get worker_timeout_ms to come back.
        with self._mu:
            self._restart_time = time.monotonic()
        last_tick = time.monotonic()
        while not self._stop_event.wait(period_s):
            # One `now` per tick, taken before any check: a stall after it only
            # makes the checks more lenient, a stall before it shows as the gap.
            now = time.monotonic()
            late_s = now - last_tick - period_s
            last_tick = now
            try:
                if late_s > deaf_s:
                    with self._mu:
                        if late_s > stall_s:
                            self._grant_stall_grace_locked(late_s, now)
                        else:  # a short hiccup: the time it did not listen does not count
                            self._credit_deaf_time_locked(late_s, now)
                self._check_workers(now)
                self._check_clients(now)
                self._warn_starved_iterations(now)
                if now >= next_gc:
                    self._collect_jobs()
                    next_gc = time.monotonic() + cfg.job_gc_check_interval_ms_or_default / 1000
            except Exception:  # keep the dispatcher alive; the log has the bug
                log.exception("dispatcher maintenance failed")

    def _grant_stall_grace_locked(self, stalled_s: float, now: float) -> None:
        """The dispatcher itself could not run for `stalled_s` seconds (frozen
        by SIGSTOP, a paused VM, swapping): the heartbeats it missed meanwhile
        say nothing about its workers and clients. Give them what a restart
        gives (`_recover`): a fresh `client_timeout_ms` for every iteration
        client, `worker_timeout_ms` for every worker and for the tasks of
        workers not registered, `job_gc_timeout_ms` for every job."""
        log.warning(
            "dispatcher at %s was stalled for %.1f s (frozen or starved of CPU): its %d workers "
            "and %d iteration clients get their full timeouts again, as after a restart",
            self.target,
            stalled_s,
            len(self._workers),
            len(self._client_seen),
        )
        for worker in self._workers.values():
            worker.last_heartbeat = max(worker.last_heartbeat, now)
        for client_id in self._client_seen:
            self._client_seen[client_id] = max(self._client_seen[client_id], now)
        for job_id in self._job_last_used:
            self._job_last_used[job_id] = max(self._job_last_used[job_id], now)
        self._restart_time = max(self._restart_time, now)

    def _credit_deaf_time_locked(self, deaf_s: float, now: float) -> None:
        """Moves every last-seen time `deaf_s` seconds later (at most to
        `now`): heartbeats that could not be heard while the dispatcher did
        not run are not held against the workers and clients."""
        for worker in self._workers.values():
            worker.last_heartbeat = min(now, worker.last_heartbeat + deaf_s)
        for client_id, seen in self._client_seen.items():
            self._client_seen[client_id] = min(now, seen + deaf_s)
        for job_id, used in self._job_last_used.items():
            self._job_last_used[job_id] = min(now, used + deaf_s)

    def _warn_starved_iterations(self, now: float) -> None:
        """Warns (`_waits.SlowWait`: after 10 s, then every 30 s) about each
        iteration that has consumers but no worker running it."""
        waits: list[_waits.SlowWait] = []
        with self._mu:
            starved: dict[st.IterationId, str] = {}
            for iteration in self._state.unfinished_iterations():
                if not iteration.clients or iteration.iteration_id in self._iteration_errors:
                    continue
                job = self._state.jobs[iteration.job_id]
                if job.garbage_collected or any(not t.removed for t in iteration.tasks.values()):
                    continue
                if job.processing_mode == ShardingPolicy.DYNAMIC and iteration.splits_ended:
                    continue
                name = f" {job.job_name!r}" if job.job_name else ""
                if not self._workers:
                    why = "no worker is registered"
                else:
                    why = f"none of its {len(self._workers)} registered workers serves it" + (
                        f" (target_workers={job.target_workers} reads workers on the "
                        f"consumers' hosts {sorted(iteration.consumer_hosts)} only)"
                        if job.reads_local_workers_only
                        else ""
                    )
                starved[iteration.iteration_id] = (
                    f"dispatcher at {self.target}: iteration {iteration.iteration_id} of job "
                    f"{job.job_id}{name} (repetition {iteration.repetition}) has "
                    f"{len(iteration.clients)} consumers waiting and no worker: {why}"
                )
        for iteration_id in list(self._starved):
            if iteration_id not in starved:
                self._starved.pop(iteration_id).done(
                    f"dispatcher: iteration {iteration_id} has a worker again"
                )
        for iteration_id, text in starved.items():
            wait = self._starved.get(iteration_id)
            if wait is None:
                wait = self._starved[iteration_id] = _waits.SlowWait(log, text, start=now)
            wait.describe = text  # the latest reason
            waits.append(wait)
        for wait in waits:  # logged outside the lock
            wait.check(now)

    def _check_workers(self, now: float | None = None) -> None:
        """Drops the workers whose heartbeats stopped (as of `now`, default the
        current monotonic time), and tasks journaled for workers that never
        came back after a restart."""
        timeout_s = self._config.worker_timeout_ms_or_default / 1000
        now = time.monotonic() if now is None else now
        to_probe: list[_Worker] = []
        with self._mu:
            for address, worker in list(self._workers.items()):
                # A timeout below the worker's own heartbeat interval would drop
                # healthy workers: wait for at least 3 missed heartbeats.
                worker_timeout_s = max(timeout_s, 3 * worker.heartbeat_interval_s)
                silent_s = now - worker.last_heartbeat
                if silent_s > worker_timeout_s:
                    self._declare_lost_locked(
                        worker,
                        f"worker {address} (pid {worker.pid or 'unknown'}) sent no heartbeat "
                        f"for {worker_timeout_s:.1f} s (worker_timeout_ms): it is stopped, "
                        "hung, or its host is down",
                    )
                elif (
                    silent_s > _probe_after_s(worker)
                    and not worker.restarting
                    and address not in self._probing
                    and now - worker.last_probe >= max(0.5, worker.heartbeat_interval_s)
                ):
                    worker.last_probe = now
                    self._probing.add(address)
                    to_probe.append(worker)
            if now - self._restart_time > timeout_s:
                # Tasks journaled for workers that never came back after a restart.
                for task in list(self._state.tasks.values()):
                    if (
                        not task.finished
                        and not task.removed
                        and task.worker_address not in self._workers
                        and not self._state.iterations[task.iteration_id].finished
                    ):
                        self._apply_locked(st.RemoveTask(task.task_id))
        for worker in to_probe:
            threading.Thread(
                target=self._probe, args=(worker,), name="ds-dispatcher-probe", daemon=True
            ).start()

    def _probe_unreachable_locked(self, addresses: Any, now: float) -> None:
        """A consumer could not reach these workers: probe each now (at most
        every 0.5 s), rather than after it missed heartbeats."""
        for address in addresses:
            worker = self._workers.get(address)
            if (
                worker is None
                or worker.restarting
                or address in self._probing
                or now - worker.last_probe < 0.5
            ):
                continue
            worker.last_probe = now
            self._probing.add(address)
            threading.Thread(
                target=self._probe,
                args=(worker, _SUPERVISOR_GRACE_S),
                name="ds-dispatcher-probe",
                daemon=True,
            ).start()

    def _declare_lost_locked(self, worker: _Worker, reason: str) -> None:
        """Drops a registered worker and its tasks; it may come back (as the
        same process if it was only slow, or restarted on its address)."""
        log.warning("worker lost: %s", reason)
        self._record_losses_locked(worker.address, worker.uid, worker.pid, reason, restarting=False)
        del self._workers[worker.address]
        self._lost_uids[worker.address] = worker.uid
        self._remove_tasks_of_locked(worker.address)

    def _probe(self, worker: _Worker, delay_s: float = 0.0) -> None:
        """Connects to a worker that missed heartbeats or that a consumer could
        not reach (a thread of its own).

        A worker process that died (exit, SIGKILL, OOM kill) leaves no socket
        on its port, so the connection is refused at once: it is declared lost
        now, not after worker_timeout_ms. A worker that is only slow, stopped
        (SIGSTOP) or behind a network that drops packets still accepts or does
        not answer: the heartbeat timeout decides for it. `delay_s` first
        leaves a supervisor that restarts the worker (LocalCluster) time to
        say so (ReportWorkerFailure with `restarting`), so its tasks are kept.
        """
        if delay_s and self._stop_event.wait(delay_s):
            with self._mu:
                self._probing.discard(worker.address)
            return
        host, _, port = worker.address.rpartition(":")
        refused = False
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
                pass
        except ConnectionRefusedError:
            refused = True
        except (OSError, ValueError) as err:  # unreachable, unresolvable: not proof
            log.debug("probe of worker %s: %s", worker.address, err)
        with self._mu:
            self._probing.discard(worker.address)
            current = self._workers.get(worker.address)
            if refused and current is worker and not worker.restarting:
                silent_s = time.monotonic() - worker.last_heartbeat
                self._declare_lost_locked(
                    worker,
                    f"worker {worker.address} (pid {worker.pid or 'unknown'}) is gone: no "
                    f"heartbeat for {silent_s:.1f} s and its port refuses connections (the "
                    "process exited or was killed)",
                )

    def _remove_tasks_of_locked(self, address: str) -> None:
        for task in self._state.tasks_of_worker(address):
            self._apply_locked(st.RemoveTask(task.task_id))

    def _check_clients(self, now: float | None = None) -> None:
        """Releases the iteration clients whose heartbeats stopped (as of `now`)."""
        timeout_s = self._config.client_timeout_ms_or_default / 1000
        now = time.monotonic() if now is None else now
        with self._mu:
            for client_id, seen in list(self._client_seen.items()):
                if now - seen > timeout_s:
                    log.info("iteration client %d timed out", client_id)
                    self._release_client_locked(client_id)

    def _collect_jobs(self) -> None:
        timeout_s = self._config.job_gc_timeout_ms_or_default / 1000
        now = time.monotonic()
        with self._mu:
            for job in list(self._state.jobs.values()):
                if job.garbage_collected:
                    continue
                if job.processing_mode == ShardingPolicy.DYNAMIC and job.job_name:
                    continue  # as tf.data service: DYNAMIC jobs are never collected
                in_use = any(self._state.iterations[i].clients for i in job.iterations.values())
                if in_use:
                    self._job_last_used[job.job_id] = now
                    continue
                if now - self._job_last_used.get(job.job_id, now) > timeout_s:
                    log.info("garbage collecting job %d (%s)", job.job_id, job.job_name)
                    self._apply_locked(st.GarbageCollectJob(job.job_id))
                    self._forget_job_locked(job)
