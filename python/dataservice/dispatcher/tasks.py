"""Workers and their tasks: WorkerHeartbeat, and which worker runs a task in
which iteration.

Owns `WorkerTasksMixin`: `_worker_heartbeat` (registration, a restarted or
revived worker, finished tasks, the tasks a worker is told to run or drop),
`_watch_tasks` (a worker's long poll, answered when it is given a task),
task placement (`_worker_serves_locked` with local reads, creating the tasks
of a worker or of a consumer's host) and the `TaskInfo` a consumer gets
(`_add_task_info_locked`).

Fields (`base.DispatcherBase`; all guarded by `self._mu`): reads `_config`,
`_state`, `_iteration_errors`, `_lost_uids`; writes `_workers` (and its
`_Worker` records), `_failed_workers`, `_task_generation`, `_tasks_given` and `_watches`
(notifying `_tasks_cv`); `_state` changes only through
`_apply_locked`. Uses worker_loss.py's `_forget_losses_of_locked`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dataservice import errors
from dataservice.dispatcher import state as st
from dataservice.dispatcher.base import DispatcherBase, _probe_after_s, _Worker, log
from dataservice.rpc import service_pb2 as pb
from dataservice.sharding import ShardingPolicy, sharding_policy_to_proto, worker_index_in

# WatchTasks: the longest a watch is held, and how many are held at once (the rest
# of the dispatcher's 64 RPC threads serve everything else; a worker refused one
# learns of its tasks by heartbeat, as without watches).
MAX_WATCH_S = 60.0
MAX_WATCHES = 32
# A held watch looks at the dispatcher's stop this often.
_WATCH_CHECK_S = 0.5
# How many of the last tasks given to a worker are remembered, so that a watch that
# knows an earlier generation is answered with the tasks given since, not all the
# worker's live tasks (`_watch_answer_locked`).
_TASKS_GIVEN_KEPT = 1024


class WorkerTasksMixin(DispatcherBase):
    """WorkerHeartbeat and task placement of `DispatchServer` (see the module docstring)."""

    if TYPE_CHECKING:  # defined by worker_loss.py

        def _forget_losses_of_locked(self, uid: str) -> None: ...

        def _note_worker_counters_locked(self, address: str, request: Any, now: float) -> None: ...

        def _record_losses_locked(
            self, address: str, uid: str, pid: int, reason: str, *, restarting: bool
        ) -> None: ...

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
        if worker.draining:  # retire.py: it only finishes what it has
            return False
        if not job.reads_local_workers_only:
            return True
        return worker.host_id in iteration.consumer_hosts and not (
            self._host_part_finished_locked(iteration, worker.host_id)
        )

    def _host_part_over_locked(self, task: st.Task) -> bool:
        """Whether `task`'s iteration is over for the consumers on its host:
        the iteration finished, or, for a job that reads only local workers,
        that host's part of it (`DispatcherState.host_part_finished`)."""
        iteration = self._state.iterations[task.iteration_id]
        if iteration.finished:
            return True
        job = self._state.jobs[iteration.job_id]
        return job.reads_local_workers_only and self._host_part_finished_locked(
            iteration, task.host_id
        )

    def _create_task_locked(self, iteration: st.Iteration, worker: _Worker) -> None:
        task_id = st.TaskId(self._state.next_task_id)
        self._apply_locked(
            st.CreateTask(
                task_id, iteration.iteration_id, worker.address, worker.index, worker.host_id
            )
        )
        self._task_given_locked(worker.address, task_id)

    def _has_task_locked(self, iteration: st.Iteration, worker: _Worker) -> bool:
        """Whether `worker` runs or ran a task in `iteration` (one cut short by
        its draining, `Task.drained`, does not count: un-drained, it may take
        the splits left)."""
        return any(
            t.worker_address == worker.address and not t.removed and not (t.finished and t.drained)
            for t in iteration.tasks.values()
        )

    def _finish_task_locked(self, task: st.Task) -> None:
        """Records that `task` ran to its end (reported by its worker or a
        consumer). A task cut short by draining (`Task.drained`) whose worker
        was un-drained meanwhile (RetireWorker `cancel`) gives that worker a
        task again, so the iteration's splits left do not wait for another."""
        if task.finished or task.removed:
            return
        self._apply_locked(st.FinishTask(task.task_id))
        worker = self._workers.get(task.worker_address)
        if task.drained and worker is not None and not worker.draining:
            self._assign_tasks_to_worker_locked(worker, dynamic_only=True)

    def _assign_tasks_to_worker_locked(self, worker: _Worker, dynamic_only: bool = False) -> None:
        """Gives a (re)registered worker a task in every unfinished iteration it
        serves (with `dynamic_only`, only in those of DYNAMIC jobs that are not
        coordinated reads: there its task takes splits the others would have
        taken; elsewhere it would add a copy or a shard to an epoch under way)."""
        for iteration in self._state.unfinished_iterations():
            job = self._state.jobs[iteration.job_id]
            if job.garbage_collected or not self._worker_serves_locked(worker, job, iteration):
                continue
            if dynamic_only and (
                job.processing_mode != ShardingPolicy.DYNAMIC or job.num_consumers
            ):
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
            if worker.draining:  # retire.py: it only finishes what it has
                continue
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
                f"Static sharding ({job.processing_mode.name}) with "
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
        on_time = False
        if worker is not None and not worker.restarting:
            silent_s = time.monotonic() - worker.last_heartbeat
            if silent_s > _probe_after_s(worker):
                silent_ms = int(silent_s * 1000)
            else:
                on_time = True
        infos.add(
            task_id=task.task_id,
            worker_address=task.worker_address,
            transfer_address=worker.transfer_address if worker else task.worker_address,
            host_id=worker.host_id if worker else "",
            worker_silent_ms=silent_ms,
            worker_pid=worker.pid if worker else 0,
            worker_heartbeats_on_time=on_time,
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
                        self._task_given_locked(address, task.task_id)
                self._forget_losses_of_locked(request.worker_uid)
                log.info("worker %s is back (it was only slow)", address)
            if worker is None or worker.uid != request.worker_uid:
                if worker is None:
                    log.info(
                        "worker %s registered (pid %s, host %s)",
                        address,
                        request.pid or "unknown",
                        request.host_id or "unknown",
                    )
                else:
                    log.info("worker %s restarted (pid %s)", address, request.pid or "unknown")
                    self._restarted_locked(worker, request.pid)
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
                    join_running_dynamic_only=request.join_running_dynamic_only,
                )
                self._workers[address] = worker
                self._assign_tasks_to_worker_locked(
                    worker, dynamic_only=request.join_running_dynamic_only
                )
            worker.last_heartbeat = now
            self._note_worker_counters_locked(address, request, now)
            for task_id in request.finished_tasks:
                task = self._state.tasks.get(st.TaskId(task_id))
                if task is not None:
                    self._finish_task_locked(task)
            current = set(request.current_tasks)
            assigned = self._state.tasks_of_worker(address)
            assigned_ids = {t.task_id for t in assigned}
            response = pb.WorkerHeartbeatResponse(incarnation_id=self._state.incarnation_id)
            for task in assigned:
                if task.task_id not in current:
                    self._add_task_def_locked(response.new_tasks, task)
            response.tasks_to_delete.extend(sorted(current - assigned_ids))
            return response

    def _add_task_def_locked(self, defs: Any, task: st.Task) -> None:
        """Appends what `task`'s worker needs to run it to a repeated TaskDef field."""
        iteration = self._state.iterations[task.iteration_id]
        job = self._state.jobs[iteration.job_id]
        defs.add(
            task_id=task.task_id,
            iteration_id=iteration.iteration_id,
            job_id=job.job_id,
            dataset_id=job.dataset_id,
            processing_mode=sharding_policy_to_proto(job.processing_mode),
            repetition=iteration.repetition,
            num_consumers=job.num_consumers,
            worker_index=task.worker_index,
            num_workers=len(self._config.worker_addresses or ()),
            job_name=job.job_name,
            use_cross_trainer_cache=job.use_cross_trainer_cache,
            exactly_once=job.exactly_once,
        )

    def _task_given_locked(self, address: str, task_id: st.TaskId) -> None:
        """Task `task_id` was created or revived on worker `address`: wakes its watch
        (`_watch_tasks`)."""
        generation = self._task_generation.get(address, 0) + 1
        self._task_generation[address] = generation
        given = self._tasks_given.get(address)
        if given is None:
            given = self._tasks_given[address] = collections.deque(maxlen=_TASKS_GIVEN_KEPT)
        given.append((generation, task_id))
        self._tasks_cv.notify_all()

    def _watch_tasks(self, request: Any, active: Callable[[], bool] = lambda: True) -> Any:
        """WatchTasks: answers when worker `request.worker_address` was given a
        task since `request.generation` (its count of tasks given, -1 when it
        knows none), or after `request.wait_ms` (at most `MAX_WATCH_S`), or when
        the dispatcher stops, with the worker's live tasks (`_watch_answer_locked`).
        The worker starts those it lacks, so a new iteration's tasks start while
        its consumers connect instead of when their first request reaches the
        worker and makes it heartbeat (measured: that heartbeat and the task's
        first GetSplits, ~2 ms each from an idle channel on this 2-core machine,
        came after the request). At most `MAX_WATCHES` are held at once; past
        that the answer says `watching` False at once. `active()` False (the
        caller went away) ends the wait at the next check (`_WATCH_CHECK_S`)."""
        deadline = time.monotonic() + min(request.wait_ms / 1000, MAX_WATCH_S)
        address = request.worker_address
        with self._mu:
            generation = self._task_generation.get(address, 0)
            if generation != request.generation:
                return self._watch_answer_locked(request, generation, True)
            if self._watches >= MAX_WATCHES:
                return pb.WatchTasksResponse(generation=generation, watching=False)
            self._watches += 1
            try:
                while (
                    generation == request.generation and not self._stop_event.is_set() and active()
                ):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._tasks_cv.wait(min(left, _WATCH_CHECK_S))
                    generation = self._task_generation.get(address, 0)
            finally:
                self._watches -= 1
            # A stopping dispatcher says it holds no watch: the worker does not ask
            # again at once (its heartbeats find the dispatcher gone).
            watching = not self._stop_event.is_set()
            return self._watch_answer_locked(request, generation, watching)

    def _watch_answer_locked(self, request: Any, generation: int, watching: bool) -> Any:
        """WatchTasks' answer: with the live tasks of the worker if its process
        (`worker_uid`) is the one registered at its address; another one (not
        registered yet, restarted) gets its tasks from its registering heartbeat."""
        response = pb.WatchTasksResponse(
            generation=generation, watching=watching, incarnation_id=self._state.incarnation_id
        )
        worker = self._workers.get(request.worker_address)
        if worker is not None and worker.uid == request.worker_uid and not worker.restarting:
            tasks = self._state.tasks_of_worker(worker.address)
            given = self._tasks_given.get(worker.address)
            known = request.generation
            if 0 <= known <= generation and given and given[0][0] <= known + 1:
                # Every task given since the worker's generation is remembered: those,
                # not all its live tasks (a worker may hold many idle ones: named jobs
                # wait job_gc_timeout_ms for their consumers). Its heartbeats still
                # list every task it lacks.
                since = {task_id for g, task_id in given if g > known}
                tasks = [t for t in tasks if t.task_id in since]
            for task in tasks:
                self._add_task_def_locked(response.tasks, task)
        return response

    def _restarted_locked(self, worker: _Worker, new_pid: int) -> None:
        """Worker `worker`'s address registered a new process before (or without)
        a report of the old one's exit (a supervisor other than LocalCluster's:
        systemd, Kubernetes, a script restarting it within the probe's reach).
        What the old process held is lost as when a report says so: the DYNAMIC
        splits handed to it (at most once, as tf.data service, and reported to
        the consumers: `lost_workers`, `splits_lost`), and under exactly-once
        its leases, which go back once its consumers close it. Recorded once per
        process (a report that came first recorded it already)."""
        known = any(
            r.worker_uid == worker.uid for losses in self._worker_losses.values() for r in losses
        )
        if known:
            return
        reason = (
            f"worker {worker.address} (pid {worker.pid or 'unknown'}) was replaced by a new "
            f"process (pid {new_pid or 'unknown'}) on its address"
        )
        self._record_losses_locked(worker.address, worker.uid, worker.pid, reason, restarting=True)
