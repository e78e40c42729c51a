"""The dispatcher: registers datasets, creates jobs, iterations and tasks,
hands out splits (DYNAMIC), tracks workers and clients by heartbeat, and
collects abandoned jobs. As tf.data service's dispatcher.

This module owns `DispatchServer`'s lifecycle (start, stop, join, recovery
from the journal) and the gRPC servicer that routes each RPC to its handler.
The handlers are mixins over the one state of `base.DispatcherBase`, each in
the module of its concern:

    datasets.py       RegisterDataset, GetDatasetDef, GetElementSpec; dataset objects
    tasks.py          WorkerHeartbeat, WatchTasks; which worker gets a task in which iteration
    jobs.py           GetOrCreateJob, GetOrCreateIteration, ClientHeartbeat,
                      ReleaseIterationClient; job replacement
    split_handout.py  GetSplits (DYNAMIC), GetRounds (coordinated reads)
    worker_loss.py    ReportWorkerFailure; what a lost worker took with it
    retire.py         RetireWorker: drain a worker, then forget it (LocalCluster autoscaling)
    liveness.py       the maintenance thread: worker and client timeouts, probes,
                      the stall grace, the silence of a cut-off dispatcher, job
                      garbage collection

Every decision becomes a `state.Update` applied through `_apply_locked`, which
journals it first when `fault_tolerant_mode` is on. RPC handlers take
`self._mu`; nothing but the journal write does I/O under it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent import futures
from typing import Any

import grpc

from dataservice import _netaddr, auth, errors, tls
from dataservice.config import DispatcherConfig
from dataservice.dispatcher import state as st
from dataservice.dispatcher.buffer_store import BufferStore, check_inline
from dataservice.dispatcher.datasets import DatasetsMixin, RegisterRequest
from dataservice.dispatcher.exactly_once import ExactlyOnceMixin
from dataservice.dispatcher.jobs import JobsMixin
from dataservice.dispatcher.journal import Journal
from dataservice.dispatcher.liveness import LivenessMixin
from dataservice.dispatcher.observe import ObserveMixin
from dataservice.dispatcher.retire import RetireMixin
from dataservice.dispatcher.split_handout import SplitHandoutMixin
from dataservice.dispatcher.tasks import WorkerTasksMixin
from dataservice.dispatcher.worker_loss import WorkerLossMixin
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import service_pb2_grpc, validate
from dataservice.rpc import util as rpc_util

log = logging.getLogger(__name__)

BUFFERS_SUBDIR = "dataset_buffers"  # of work_dir: buffer_store.py


class _Servicer(service_pb2_grpc.DispatcherServiceServicer):
    def __init__(self, dispatcher: DispatchServer) -> None:
        self._d = dispatcher

    def _call(self, method: str, fn: Any, request: Any, context: grpc.ServicerContext) -> Any:
        """Runs one RPC's handler on a request checked at the edge
        (rpc/validate.py); every error becomes the status of its class
        (rpc/util.py), a bug INTERNAL, never a dead handler thread. Its
        duration goes to `dataservice_rpc_seconds{method}` when metrics are on."""
        start = time.perf_counter()
        try:
            self._d._heard_rpc()  # before the handler reads any last-seen time
            validate.check_request(request)
            return fn(request)
        except (errors.DataServiceError, ValueError) as err:
            rpc_util.abort_with(context, err)
        except Exception as err:  # a bug: report it as INTERNAL, with its type
            log.exception("dispatcher RPC failed")
            rpc_util.abort_with(context, errors.InternalError(f"{type(err).__name__}: {err}"))
        finally:
            registry = self._d._metrics
            if registry is not None:
                registry.rpc_seconds.labels(method).observe(time.perf_counter() - start)

    def GetDispatcherInfo(self, request: Any, context: Any) -> Any:
        return self._call("GetDispatcherInfo", self._d._get_info, request, context)

    def WorkerHeartbeat(self, request: Any, context: Any) -> Any:
        return self._call("WorkerHeartbeat", self._d._worker_heartbeat, request, context)

    def RegisterDataset(self, request: Any, context: Any) -> Any:
        if not isinstance(request, validate.Malformed):
            request = RegisterRequest(request)
        return self._call("RegisterDataset", self._d._register_dataset, request, context)

    def GetDatasetDef(self, request: Any, context: Any) -> Any:
        return self._call("GetDatasetDef", self._d._get_dataset_def, request, context)

    def GetElementSpec(self, request: Any, context: Any) -> Any:
        return self._call("GetElementSpec", self._d._get_element_spec, request, context)

    def GetOrCreateJob(self, request: Any, context: Any) -> Any:
        return self._call("GetOrCreateJob", self._d._get_or_create_job, request, context)

    def GetOrCreateIteration(self, request: Any, context: Any) -> Any:
        return self._call(
            "GetOrCreateIteration", self._d._get_or_create_iteration, request, context
        )

    def ClientHeartbeat(self, request: Any, context: Any) -> Any:
        return self._call("ClientHeartbeat", self._d._client_heartbeat, request, context)

    def ReleaseIterationClient(self, request: Any, context: Any) -> Any:
        return self._call(
            "ReleaseIterationClient", self._d._release_iteration_client, request, context
        )

    def GetSplits(self, request: Any, context: Any) -> Any:
        return self._call("GetSplits", self._d._get_splits, request, context)

    def GetRounds(self, request: Any, context: Any) -> Any:
        return self._call("GetRounds", self._d._get_rounds, request, context)

    def ReportWorkerFailure(self, request: Any, context: Any) -> Any:
        return self._call("ReportWorkerFailure", self._d._report_worker_failure, request, context)

    def GetClusterStatus(self, request: Any, context: Any) -> Any:
        return self._call("GetClusterStatus", self._d._get_cluster_status, request, context)

    def RetireWorker(self, request: Any, context: Any) -> Any:
        return self._call("RetireWorker", self._d._retire_worker, request, context)

    def WatchTasks(self, request: Any, context: Any) -> Any:
        # A watch whose worker went away (died, cancelled) gives its slot back
        # within a check, not after its whole wait.
        def watch(request: Any) -> Any:
            return self._d._watch_tasks(request, context.is_active)

        return self._call("WatchTasks", watch, request, context)


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


class DispatchServer(
    DatasetsMixin,
    WorkerTasksMixin,
    JobsMixin,
    SplitHandoutMixin,
    ExactlyOnceMixin,
    WorkerLossMixin,
    LivenessMixin,
    ObserveMixin,
    RetireMixin,
):
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
        super().__init__(config or DispatcherConfig())
        if self._config.work_dir and not self._config.fault_tolerant_mode:
            log.warning(
                "work_dir %r is not used: nothing is journaled without fault_tolerant_mode "
                "(--fault-tolerant), so a restarted dispatcher starts empty",
                self._config.work_dir,
            )
        if start:
            self.start()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Starts serving (replaying the journal first in fault-tolerant mode).

        Raises:
            UnavailableError: The port cannot be bound.
            ValueError: The token file cannot be read, or `host` is beyond
                loopback with no token and not `insecure` (see SECURITY.md), or
                a TLS file cannot be read (the message names it).
        """
        if self._server is not None:
            return
        self._stop_event.clear()
        self._stopped.clear()
        token = auth.resolve_token(self._config.auth_token, self._config.auth_token_file)
        credentials = tls.server_credentials(
            self._config.tls_cert_file,
            self._config.tls_key_file,
            self._config.tls_client_ca_file,
            "dispatcher",
        )
        auth.check_bind(
            "dispatcher", self._config.host, token, self._config.insecure, credentials is not None
        )
        self._recover()
        if self._config.metrics_port is not None and self._metrics is None:
            from dataservice import metrics

            self._metrics = metrics.DispatcherMetrics(self._collect_state_metrics)
        refused = self._metrics.auth_refusals.inc if self._metrics is not None else None
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="ds-dispatcher"),
            options=rpc_util.SERVER_OPTIONS,
            interceptors=rpc_util.server_interceptors(token, "dispatcher", on_refused=refused),
        )
        validate.add_service(server, _Servicer(self), "DispatcherService")
        try:
            port = rpc_util.add_port(
                server, f"{self._config.host}:{self._config.port}", credentials
            )
        except RuntimeError as err:
            raise errors.UnavailableError(
                f"dispatcher cannot bind {self._config.host}:{self._config.port}: {err}"
            ) from err
        if port == 0:
            raise errors.UnavailableError(
                f"dispatcher cannot bind {self._config.host}:{self._config.port}"
            )
        self._port = port
        metrics_port = self._config.metrics_port
        if self._metrics is not None and metrics_port is not None and not self._metrics_endpoint:
            from dataservice import metrics

            try:
                self._metrics_endpoint = metrics.MetricsEndpoint(
                    self._metrics.registry,
                    self._config.host,
                    metrics_port,
                    "dispatcher",
                    token=token,
                    ssl_context=tls.metrics_ssl_context(
                        self._config.tls_cert_file,
                        self._config.tls_key_file,
                        self._config.tls_client_ca_file,
                    ),
                    on_refused=refused,
                )
            except BaseException:
                server.stop(grace=None)
                raise
        server.start()
        self._server = server
        t = threading.Thread(target=self._maintenance_loop, name="ds-dispatcher-gc", daemon=True)
        t.start()
        self._threads = [t]
        log.info("dispatcher serving on %s", self._describe_bind())

    def _describe_bind(self) -> str:
        """The address bound, and for every interface ("0.0.0.0", "::") the
        addresses of this host's interfaces that others can use (`target`'s
        "localhost" is for clients on this host only)."""
        host = self._config.host
        bound = f"{_netaddr.format_host(host or '0.0.0.0')}:{self._port}"
        if not _netaddr.is_wildcard(host):
            return bound
        reachable = [
            f"{_netaddr.format_host(a)}:{self._port}" for a in _netaddr.interface_addresses()
        ]
        if not reachable:
            return f"{bound} (all interfaces; none but loopback is up: localhost:{self._port})"
        shown = ", ".join(reachable[:8]) + (" ..." if len(reachable) > 8 else "")
        return f"{bound} (all interfaces; reachable at {shown})"

    def stop(self) -> None:
        """Stops serving, after in-flight RPCs finish (grace 1 s). Idempotent."""
        self._stop_event.set()
        with self._mu:
            self._tasks_cv.notify_all()  # held watches answer now
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=1.0).wait()
        endpoint, self._metrics_endpoint = self._metrics_endpoint, None
        if endpoint is not None:
            endpoint.stop()
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

    @property
    def metrics_port(self) -> int | None:
        """The port serving /metrics (`DispatcherConfig.metrics_port`; the bound
        one for 0), or None when metrics are off or the server is stopped."""
        endpoint = self._metrics_endpoint
        return endpoint.port if endpoint is not None else None

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
            self._iteration_idle_since = {}
            self._split_providers = {}
            self._dataset_objects = {}
            self._task_splits = {}
            self._split_grants = {}
            self._worker_losses = {}
            self._worker_seen = {}
            self._client_seen_counters = {}
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
            self._eo_unheard = set(self._state.clients)
            for job_id in self._state.jobs:
                self._job_last_used[job_id] = now
            if not self._state.incarnation_id:
                self._apply_locked(st.SetIncarnation(uuid.uuid4().hex))

    # ------------------------------------------------------------ RPCs
    def _get_info(self, request: Any) -> Any:
        with self._mu:
            return pb.DispatcherInfoResponse(
                incarnation_id=self._state.incarnation_id,
                fault_tolerant_mode=self._config.fault_tolerant_mode,
                client_timeout_ms=self._config.client_timeout_ms_or_default,
                worker_timeout_ms=self._config.worker_timeout_ms_or_default,
            )
