"""What the dispatcher tells about the cluster: GetClusterStatus (`dataservice
status`), its Prometheus metrics, and the INFO lines of its state's changes.

Owns `ObserveMixin`: the workers' and consumers' heartbeated counters
(`WorkerCounters`, `ConsumerCounters` in service.proto) are kept with a short
history (`metrics.CounterHistory`, up to `metrics.HISTORY_S`), from which
`_get_cluster_status` computes rates over the window the caller asks for, and the
per-consumer-process totals exported as `dataservice_consumer_*` (summed over the
iterators a process opened for a job, so they only grow). `_log_update_locked`
logs, at INFO, a job created, an iteration finished, a consumer joined or left.

Fields (`base.DispatcherBase`; guarded by `self._mu`): reads `_state`, `_workers`,
`_failed_workers`, `_config`; writes `_worker_seen`, `_client_seen_counters`,
`_consumer_totals`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dataservice import metrics
from dataservice.dispatcher import state as st
from dataservice.dispatcher.base import DispatcherBase, _probe_after_s, log
from dataservice.rpc import service_pb2 as pb

DEFAULT_STATUS_WINDOW_S = 60.0


@dataclass
class WorkerSeen:
    """A worker process's heartbeated counters: (elements_produced, bytes_sent,
    pipeline_s, idle_s) over time, and the last buffered_elements."""

    uid: str
    history: metrics.CounterHistory = field(default_factory=metrics.CounterHistory)
    buffered_elements: int = 0


@dataclass
class ClientSeen:
    """An iteration client's heartbeated counters: (elements, bytes, wait_s,
    active_s) over time, and who it is."""

    host: str = ""
    pid: int = 0
    consumer_index: int = -1
    history: metrics.CounterHistory = field(default_factory=metrics.CounterHistory)
    last: tuple[float, ...] = (0, 0, 0.0, 0.0)


def job_label(job: st.Job) -> str:
    """A job's name in metrics and status: its job_name, or "job-<id>"."""
    return job.job_name or f"job-{job.job_id}"


def consumer_label(host: str, pid: int, consumer_index: int) -> str:
    """A consumer in metrics and status: "host/pid" (and "/c<index>" for a
    coordinated read's consumer)."""
    label = f"{host or '?'}/{pid or '?'}"
    return label + (f"/c{consumer_index}" if consumer_index >= 0 else "")


class ObserveMixin(DispatcherBase):
    """Status, metrics and state-change logs of `DispatchServer` (see the module
    docstring)."""

    # ------------------------------------------------------------ heartbeats
    def _note_worker_counters_locked(self, address: str, request: Any, now: float) -> None:
        if not request.HasField("counters"):
            return
        c = request.counters
        seen = self._worker_seen.get(address)
        if seen is None or seen.uid != request.worker_uid:
            seen = WorkerSeen(request.worker_uid)  # a new process: its counters start over
            self._worker_seen[address] = seen
        seen.history.add(now, (c.elements_produced, c.bytes_sent, c.pipeline_s, c.idle_s))
        seen.buffered_elements = c.buffered_elements

    def _note_client_counters_locked(
        self, client_id: st.IterationClientId, job: st.Job, request: Any, now: float
    ) -> None:
        if not request.HasField("counters"):
            return
        c = request.counters
        seen = self._client_seen_counters.get(client_id)
        if seen is None:
            seen = ClientSeen(c.host, c.pid, c.consumer_index)
            self._client_seen_counters[client_id] = seen
        values = (c.elements, c.bytes, c.wait_s, c.active_s)
        key = (job_label(job), consumer_label(c.host, c.pid, c.consumer_index))
        totals = self._consumer_totals.setdefault(key, [0, 0, 0.0])
        for i in range(3):  # elements, bytes, wait_s: what grew since the last heartbeat
            totals[i] += max(0, values[i] - seen.last[i])
        seen.last = values
        seen.history.add(now, values)

    def _forget_client_counters_locked(self, client_id: st.IterationClientId) -> None:
        self._client_seen_counters.pop(client_id, None)

    # ------------------------------------------------------------ logs
    def _log_update_locked(self, update: st.Update, finished_before: bool | None) -> None:
        """INFO lines of the state changes an operator follows (`_apply_locked`
        calls this after applying `update`; `finished_before`: whether the
        iteration a FinishTask/RemoveTask touched had finished before)."""
        s = self._state
        if isinstance(update, st.CreateJob):
            log.info(
                "job %d (%s) created: dataset %s, processing mode %s%s",
                update.job_id,
                update.job_name or "anonymous",
                update.dataset_id,
                update.processing_mode.name,
                f", {update.num_consumers} coordinated consumers" if update.num_consumers else "",
            )
        elif isinstance(update, (st.FinishTask, st.RemoveTask)) and finished_before is False:
            task = s.tasks.get(update.task_id)
            it = s.iterations.get(task.iteration_id) if task is not None else None
            if it is not None and it.finished:
                job = s.jobs[it.job_id]
                log.info(
                    "iteration %d (repetition %d) of job %d (%s) finished",
                    it.iteration_id,
                    it.repetition,
                    job.job_id,
                    job.job_name or "anonymous",
                )
        elif isinstance(update, st.AcquireIterationClient):
            it = s.iterations[update.iteration_id]
            job = s.jobs[it.job_id]
            log.info(
                "consumer %d joined iteration %d (repetition %d) of job %d (%s) from host %s",
                update.client_id,
                it.iteration_id,
                it.repetition,
                job.job_id,
                job.job_name or "anonymous",
                update.host_id or "unknown",
            )

    def _finished_before_locked(self, update: st.Update) -> bool | None:
        if isinstance(update, (st.FinishTask, st.RemoveTask)):
            task = self._state.tasks.get(update.task_id)
            if task is not None:
                return self._state.iterations[task.iteration_id].finished
        return None

    # ------------------------------------------------------------ GetClusterStatus
    def _get_cluster_status(self, request: Any) -> Any:
        window_s = request.window_ms / 1000 if request.window_ms else DEFAULT_STATUS_WINDOW_S
        now = time.monotonic()
        with self._mu:
            response = pb.GetClusterStatusResponse(
                window_s=window_s, incarnation_id=self._state.incarnation_id
            )
            tasks_by_worker: dict[str, int] = {}
            for task in self._state.tasks.values():
                if not task.finished and not task.removed:
                    tasks_by_worker[task.worker_address] = (
                        tasks_by_worker.get(task.worker_address, 0) + 1
                    )
            for address in list(self._worker_seen):
                if address not in self._workers:
                    del self._worker_seen[address]
            for address, worker in sorted(self._workers.items()):
                w = response.workers.add(
                    address=address,
                    host_id=worker.host_id,
                    pid=worker.pid,
                    tasks=tasks_by_worker.get(address, 0),
                    state=self._worker_state_locked(worker, now),
                    since_heartbeat_s=now - worker.last_heartbeat,
                    idle_fraction=-1.0,
                )
                seen = self._worker_seen.get(address)
                if seen is None:
                    continue
                latest = seen.history.latest()
                if latest is not None:
                    produced, sent, pipeline_s, idle_s = latest[1]
                    w.elements_produced, w.bytes_sent = int(produced), int(sent)
                    w.pipeline_s, w.idle_s = pipeline_s, idle_s
                w.buffered_elements = seen.buffered_elements
                deltas = seen.history.deltas(window_s)
                if deltas is not None:
                    dt, (d_elements, d_bytes, _, d_idle) = deltas
                    w.elements_per_s, w.bytes_per_s = d_elements / dt, d_bytes / dt
                    w.idle_fraction = min(1.0, d_idle / dt)
            for client_id in list(self._client_seen_counters):
                if client_id not in self._state.clients:
                    del self._client_seen_counters[client_id]
            jobs: dict[st.JobId, Any] = {}
            for job in sorted(self._state.jobs.values(), key=lambda j: j.job_id):
                if job.garbage_collected:
                    continue
                jobs[job.job_id] = response.jobs.add(
                    job_id=job.job_id,
                    job_name=job.job_name,
                    processing_mode=job.processing_mode.name,
                    num_consumers=job.num_consumers,
                )
            for client_id, iteration_id in sorted(self._state.clients.items()):
                it = self._state.iterations[iteration_id]
                j = jobs.get(it.job_id)
                if j is None:
                    continue
                seen_at = self._client_seen.get(client_id, now)
                c = j.consumers.add(
                    iteration_client_id=client_id,
                    iteration_id=iteration_id,
                    repetition=it.repetition,
                    host=self._state.client_hosts.get(client_id, ""),
                    consumer_index=-1,
                    wait_fraction=-1.0,
                    since_heartbeat_s=now - seen_at,
                )
                counters = self._client_seen_counters.get(client_id)
                if counters is None:
                    continue
                c.host, c.pid, c.consumer_index = (
                    counters.host or c.host,
                    counters.pid,
                    counters.consumer_index,
                )
                c.elements = int(counters.last[0])
                deltas = counters.history.deltas(window_s)
                if deltas is not None:
                    dt, (d_elements, _, d_wait, d_active) = deltas
                    c.elements_per_s = d_elements / dt
                    c.window_s = dt
                    if d_active > 0:
                        c.wait_fraction = min(1.0, d_wait / d_active)
                j.elements_per_s += c.elements_per_s
            return response

    def _worker_state_locked(self, worker: Any, now: float) -> str:
        if worker.restarting:
            return "restarting"
        if worker.draining:  # retire.py: its supervisor retires it
            return "draining"
        if now - worker.last_heartbeat > _probe_after_s(worker):
            return "silent"
        return "alive"

    # ------------------------------------------------------------ metrics
    def _collect_state_metrics(self) -> Iterable[Any]:
        """The dispatcher's gauges and the consumers' counters, read under the lock
        at each scrape."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        now = time.monotonic()
        p = metrics.PREFIX
        with self._mu:
            by_state = {"alive": 0, "silent": 0, "restarting": 0, "draining": 0}
            for worker in self._workers.values():
                by_state[self._worker_state_locked(worker, now)] += 1
            failed = len(self._failed_workers)
            live_jobs = [j for j in self._state.jobs.values() if not j.garbage_collected]
            live_labels = {job_label(j) for j in live_jobs}
            num_consumers = len(self._state.clients)
            iterations = sum(1 for _ in self._state.unfinished_iterations())
            for key in list(self._consumer_totals):
                if key[0] not in live_labels:  # its job was collected
                    del self._consumer_totals[key]
            totals = sorted(self._consumer_totals.items())
        g = GaugeMetricFamily(
            p + "workers",
            "Workers the dispatcher knows, by state (alive; silent: missed heartbeats; "
            "restarting: its supervisor restarts it; draining: its supervisor retires it; "
            "failed: given up by its supervisor).",
            labels=["state"],
        )
        for state, n in by_state.items():
            g.add_metric([state], n)
        g.add_metric(["failed"], failed)
        yield g
        g = GaugeMetricFamily(p + "jobs", "Jobs not garbage collected.")
        g.add_metric([], len(live_jobs))
        yield g
        g = GaugeMetricFamily(p + "iterations", "Iterations not finished.")
        g.add_metric([], iterations)
        yield g
        g = GaugeMetricFamily(p + "consumers", "Consumers (iteration clients) attached.")
        g.add_metric([], num_consumers)
        yield g
        labels = ["job", "consumer"]
        elements = CounterMetricFamily(
            p + "consumer_elements",
            "Elements a consumer process's iterators of a job received (heartbeated).",
            labels=labels,
        )
        nbytes = CounterMetricFamily(
            p + "consumer_bytes",
            "Encoded bytes a consumer process's iterators of a job received (heartbeated).",
            labels=labels,
        )
        wait = CounterMetricFamily(
            p + "consumer_wait_seconds",
            "Seconds a consumer process's iterators of a job spent waiting in next().",
            labels=labels,
        )
        for (job, consumer), (n_elements, n_bytes, wait_s) in totals:
            elements.add_metric([job, consumer], n_elements)
            nbytes.add_metric([job, consumer], n_bytes)
            wait.add_metric([job, consumer], wait_s)
        yield elements
        yield nbytes
        yield wait
