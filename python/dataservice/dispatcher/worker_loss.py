"""Worker loss: ReportWorkerFailure, what a lost worker process took with it,
and the iterations that no worker is left to run.

Owns `WorkerLossMixin`: a supervisor's report that a worker exited
(restarting on its address, or given up), the per-iteration
`WorkerLossReport`s that consumers receive by heartbeat (with the DYNAMIC
splits handed to the lost process), forgetting them when a worker declared
lost comes back as the same process, and failing iterations stranded without
workers (`WorkerCrashedError` for their consumers).

Fields (`base.DispatcherBase`; all guarded by `self._mu`): reads `_state`,
`_split_providers`; writes `_workers`, `_lost_uids`, `_failed_workers`,
`_iteration_errors`, `_task_splits` and `_worker_losses`; `_state` changes
only through `_apply_locked`. Uses liveness.py's `_remove_tasks_of_locked`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dataservice import errors
from dataservice.dispatcher import state as st
from dataservice.dispatcher.base import DispatcherBase, log
from dataservice.rpc import service_pb2 as pb
from dataservice.sharding import ShardingPolicy


class WorkerLossMixin(DispatcherBase):
    """Worker-loss accounting of `DispatchServer` (see the module docstring)."""

    if TYPE_CHECKING:  # defined by liveness.py

        def _remove_tasks_of_locked(self, address: str) -> None: ...

        def _eo_orphan_process_locked(self, task: st.Task, uid: str) -> None: ...

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
            self._eo_orphan_process_locked(task, uid)
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
        if uid in self._eo_dead_uids:
            # Exactly-once: its leases went to other workers; the consumers
            # must still close it (they drop what it sends).
            return
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
                    and not self._host_part_finished_locked(iteration, h)
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
                f"{iteration.repetition}: every worker that ran it was given up on:\n  "
                + "\n  ".join(reasons or self._failed_workers.values())
            )
            log.error("%s", self._iteration_errors[iteration.iteration_id])
