"""Jobs, iterations and iteration clients: GetOrCreateJob,
GetOrCreateIteration, ClientHeartbeat, ReleaseIterationClient.

Owns `JobsMixin`: creating a job or finding it by name (and replacing a
finished named job by a new pipeline), creating an iteration with its tasks,
acquiring and releasing iteration clients (an anonymous job is collected when
its last client leaves), a consumer's heartbeat (its task list, lost workers),
and `_forget_job_locked` (the runtime state of a collected or retired job).

Fields (`base.DispatcherBase`; all guarded by `self._mu`): reads `_config`,
`_state`, `_datasets`, `_workers`, `_iteration_errors`; writes
`_client_seen`, `_job_last_used`, `_split_providers` and `_worker_losses`
(dropped with a job); `_state` changes only through `_apply_locked`. Uses
datasets.py's `_dataset_object` (outside the lock) and
`_loaded_dataset_locked`, tasks.py's task placement, worker_loss.py's
`_fail_stranded_iterations_locked` and liveness.py's
`_probe_unreachable_locked`.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from dataservice import errors, exactly_once
from dataservice.data import graph
from dataservice.dispatcher import state as st
from dataservice.dispatcher.base import DispatcherBase, _Worker, log
from dataservice.rpc import service_pb2 as pb
from dataservice.sharding import STATIC_POLICIES, ShardingPolicy, sharding_policy_from_proto


class JobsMixin(DispatcherBase):
    """The job and iteration RPCs of `DispatchServer` (see the module docstring)."""

    if TYPE_CHECKING:  # defined by datasets.py, tasks.py, worker_loss.py, liveness.py

        def _dataset_object(self, dataset_id: str) -> Any: ...

        def _finish_task_locked(self, task: st.Task) -> None: ...

        def _eo_client_heartbeat_locked(
            self,
            client_id: st.IterationClientId,
            iteration: st.Iteration,
            request: Any,
            response: Any,
        ) -> None: ...

        def _eo_final_receipts_locked(
            self, client_id: st.IterationClientId, iteration: st.Iteration, request: Any
        ) -> None: ...

        def _eo_client_left_locked(
            self, iteration_id: st.IterationId, client_id: st.IterationClientId
        ) -> None: ...

        def _loaded_dataset_locked(self, dataset_id: str) -> Any: ...

        def _check_local_workers_locked(self, job: st.Job, host: str) -> None: ...

        def _create_task_locked(self, iteration: st.Iteration, worker: _Worker) -> None: ...

        def _add_host_tasks_locked(
            self, job: st.Job, iteration: st.Iteration, host: str
        ) -> None: ...

        def _add_task_info_locked(self, infos: Any, task: st.Task) -> None: ...

        def _fail_stranded_iterations_locked(self) -> None: ...

        def _probe_unreachable_locked(self, addresses: Any, now: float) -> None: ...

        def _note_client_counters_locked(
            self, client_id: st.IterationClientId, job: st.Job, request: Any, now: float
        ) -> None: ...

    def _get_or_create_job(self, request: Any) -> Any:
        """GetOrCreateJob: the job's id with the dispatcher's incarnation and
        client timeout, and with `join_iteration` the iteration joined (as
        GetOrCreateIteration): a read's first element waits for one round trip
        to the dispatcher, not three."""
        job_id = self._find_or_create_job(request)
        with self._mu:
            incarnation = self._state.incarnation_id
            dataset = self._state.datasets.get(request.dataset_id)
            compression = dataset.compression if dataset is not None else ""
        response = pb.GetOrCreateJobResponse(
            job_id=job_id,
            incarnation_id=incarnation,
            client_timeout_ms=self._config.client_timeout_ms_or_default,
            dataset_compression=compression,
        )
        if request.join_iteration:
            joined = self._get_or_create_iteration(
                pb.GetOrCreateIterationRequest(
                    job_id=job_id,
                    repetition=request.iteration_repetition,
                    incarnation_id=incarnation,
                    client_host_id=request.client_host_id,
                    counters=request.counters if request.HasField("counters") else None,
                )
            )
            response.iteration.CopyFrom(joined)
        return response

    def _find_or_create_job(self, request: Any) -> st.JobId:
        # Validated at the edge (rpc/validate.py), so this names a policy.
        mode = sharding_policy_from_proto(request.processing_mode)
        if mode == ShardingPolicy.DYNAMIC:
            # Build a split provider now, outside the lock, so a pipeline that
            # cannot be split fails here, naming its first unsplittable op.
            with self._mu:
                self._check_incarnation_locked(request.incarnation_id)
                if request.dataset_id not in self._datasets:
                    raise errors.NotFoundError(f"Dataset id {request.dataset_id} not found")
            try:
                dataset = self._dataset_object(request.dataset_id)
                graph.split_providers(dataset, 0)
            except errors.DataServiceError:
                raise
            except ValueError as err:
                raise errors.InvalidArgumentError(str(err)) from err
            if request.exactly_once:
                exactly_once.check_pipeline(dataset)
        with self._mu:
            self._check_incarnation_locked(request.incarnation_id)
            if request.dataset_id not in self._state.datasets:
                raise errors.NotFoundError(f"Dataset id {request.dataset_id} not found")
            if mode in STATIC_POLICIES and not self._config.worker_addresses:
                raise errors.InvalidArgumentError(
                    f"static sharding ({mode.name}) needs a fixed worker list: "
                    "set DispatcherConfig.worker_addresses (a worker's index is its position "
                    f"in it); got {self._config.worker_addresses!r}"
                )
            if request.exactly_once:
                _check_exactly_once_request(request, mode)
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
                            f"{job.processing_mode.name}, requested: {mode.name})"
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
                    if job.exactly_once != request.exactly_once:
                        diffs.append(
                            f"exactly_once (existing: {job.exactly_once}, "
                            f"requested: {request.exactly_once})"
                        )
                    if job.num_consumers != request.num_consumers:
                        diffs.append(
                            f"num_consumers (existing: {job.num_consumers}, "
                            f"requested: {request.num_consumers})"
                        )
                    # (An iteration is created with its first consumer attached.)
                    abandoned = (
                        request.resumed
                        and bool(job.iterations)
                        and not any(
                            self._state.iterations[i].clients for i in job.iterations.values()
                        )
                    )
                    if not diffs and not abandoned:
                        self._job_last_used[job.job_id] = time.monotonic()
                        return job.job_id
                    if not diffs:
                        # A resumed read nobody reads now: the next resume of the same
                        # state reads from the checkpoint again, not from where the last
                        # one (a crashed trainer's) stopped.
                        log.info(
                            "job %d (%s): a read resumed from its checkpoint again while no "
                            "consumer reads it; it starts over as a new job",
                            job.job_id,
                            job.job_name,
                        )
                        self._apply_locked(st.RetireJob(job.job_id))
                        self._forget_job_locked(job)
                    elif job.dataset_id == request.dataset_id:
                        # As tf.data service: one job, one set of parameters.
                        raise errors.InvalidArgumentError(
                            f"Tried to create job with name {request.job_name}, but found an "
                            f"existing job with different parameters: {'; '.join(diffs)} "
                            "differ. A job's parameters cannot change under its name (a new "
                            "pipeline, another dataset id, replaces a job whose iterations "
                            "finished and whose consumers left): use another job_name"
                        )
                    elif in_use := self._job_in_use_locked(job):
                        raise errors.InvalidArgumentError(
                            f"Tried to create job with name {request.job_name}, but found an "
                            f"existing job with different parameters: {'; '.join(diffs)} "
                            f"differ. Job {job.job_id} is still in use: {'; '.join(in_use)}. "
                            + self._how_to_replace_locked(job)
                        )
                    else:
                        # A new pipeline, every iteration of the old one finished and
                        # nobody reads it: the name goes to the new one now, not after
                        # job GC (tf.data service refuses any mismatch while the job exists).
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
                    len(self._config.worker_addresses or ()) if mode in STATIC_POLICIES else 0,
                    exactly_once=request.exactly_once,
                )
            )
            self._job_last_used[job_id] = time.monotonic()
            return job_id

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
                self._host_part_finished_locked(it, host) for host in it.consumer_hosts
            )
        return False

    def _how_to_replace_locked(self, job: st.Job) -> str:
        """How a user gets `job`'s name for another pipeline (an error's tail)."""
        gc_ms = self._config.job_gc_timeout_ms_or_default
        collected = (
            f"it is garbage collected job_gc_timeout_ms ({gc_ms} ms) after its last consumer left"
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
            self._split_grants.pop(iteration_id, None)
            self._worker_losses.pop(iteration_id, None)
        self._job_last_used.pop(job.job_id, None)

    def _get_or_create_iteration(self, request: Any) -> Any:
        # A DYNAMIC iteration's number of split providers comes from its
        # dataset's object, loaded outside the lock (base.py `NotLoaded`).
        return self._retry_when_loaded(self._try_get_or_create_iteration, request)

    def _try_get_or_create_iteration(self, request: Any) -> Any:
        """`_get_or_create_iteration` under the lock, if the dataset object it
        needs is loaded.

        Raises:
            NotLoaded: The dataset object of a DYNAMIC iteration to create is not
                loaded; nothing was changed.
        """
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
                    dataset = self._loaded_dataset_locked(job.dataset_id)
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
                        if not worker.draining:  # retire.py: it only finishes what it has
                            self._create_task_locked(iteration, worker)
                created = True
            else:
                iteration = self._state.iterations[iteration_id]
                if iteration.garbage_collected:
                    raise errors.FailedPreconditionError(
                        f"repetition {request.repetition} of job {job.job_id} "
                        f"({job.job_name!r}) was garbage collected: its consumers left "
                        "(released their iterators or sent no heartbeat for "
                        "client_timeout_ms) and none joined it for job_gc_timeout_ms "
                        f"({self._config.job_gc_timeout_ms_or_default} ms); iterate the "
                        "dataset again for a new repetition, or use another job_name"
                    )
                if local:
                    already_finished = self._host_part_finished_locked(iteration, host)
                else:
                    already_finished = iteration.finished
                created = False
            error = self._iteration_errors.get(iteration_id)
            if error is not None:
                raise errors.WorkerCrashedError(error)
            earlier = self._earlier_consumers_locked(iteration, time.monotonic())
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
            self._note_client_counters_locked(client_id, job, request, now)  # who it is
            response = pb.GetOrCreateIterationResponse(
                iteration_client_id=client_id,
                iteration_id=iteration_id,
                already_finished=already_finished,
                **earlier,
            )
            if not job.exactly_once and not already_finished:
                self._fill_client_view_locked(response.first_heartbeat, client_id, job, iteration)
            return response

    def _earlier_consumers_locked(self, iteration: st.Iteration, now: float) -> dict[str, Any]:
        """The GetOrCreateIterationResponse fields that say who read `iteration`
        before the client joining it now: its attached consumers (host and pid
        from their heartbeats, and how long each has been silent), whether
        consumers joined and all left, and the DYNAMIC splits handed out."""
        earlier = []
        for client_id in sorted(iteration.clients):
            seen = self._client_seen_counters.get(client_id)
            earlier.append(
                pb.EarlierConsumer(
                    host=seen.host if seen else "",
                    pid=seen.pid if seen else 0,
                    silent_ms=round(1000 * (now - self._client_seen.get(client_id, now))),
                )
            )
        return {
            "earlier_consumers": earlier,
            "earlier_consumers_left": iteration.ever_had_client and not iteration.clients,
            "splits_handed_out": sum(iteration.splits_produced.values()),
        }

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
            self._note_client_counters_locked(
                client_id, self._state.jobs[iteration.job_id], request, now
            )
            error = self._iteration_errors.get(iteration_id)
            if error is not None:
                raise errors.WorkerCrashedError(error)
            self._probe_unreachable_locked(request.unreachable_workers, now)
            for task_id in request.finished_tasks:
                task = iteration.tasks.get(st.TaskId(task_id))
                if task is not None:
                    self._finish_task_locked(task)
            job = self._state.jobs[iteration.job_id]
            response = pb.ClientHeartbeatResponse()
            self._fill_client_view_locked(response, client_id, job, iteration)
            if job.exactly_once:
                self._eo_client_heartbeat_locked(client_id, iteration, request, response)
            return response

    def _fill_client_view_locked(
        self, response: Any, client_id: st.IterationClientId, job: st.Job, iteration: st.Iteration
    ) -> None:
        """Fills ClientHeartbeatResponse `response` with what consumer `client_id`
        of `iteration` is told of it: the tasks to read (of its own host where
        the job reads local workers only), whether it finished, the shards and
        workers missing or lost, and what departed consumers left unread."""
        if job.reads_local_workers_only:
            # This consumer reads its own host's workers, and is done with them.
            host = self._state.client_hosts.get(client_id) or job.client_host_id
            finished = self._host_part_finished_locked(iteration, host)
            tasks = [t for t in iteration.live_tasks() if t.host_id == host]
            shards_of: str | None = host
        else:
            finished = iteration.finished
            tasks = iteration.live_tasks()
            shards_of = None
        response.iteration_finished = finished
        for task in tasks:
            self._add_task_info_locked(response.tasks, task)
        if not finished:
            # Static sharding: the shards of listed workers that are not
            # registered (the consumer waits for them, then gives up).
            response.missing_shards.extend(self._missing_shards_locked(iteration, shards_of))
        if not finished and not tasks:
            response.waiting_for = self._why_no_task_locked(iteration)
        iteration_id = iteration.iteration_id
        response.lost_workers.extend(self._worker_losses.get(iteration_id, ()))
        response.elements_left_by_departed_consumers = self._left_by_departed.get(iteration_id, 0)

    def _why_no_task_locked(self, iteration: st.Iteration) -> str:
        """Why unfinished `iteration` has no live task, where the workers'
        draining explains it (`Task.drained`, retire.py); "" otherwise."""
        drained = sorted(
            {t.worker_address for t in iteration.tasks.values() if t.drained and t.finished}
        )
        if not drained:
            return ""
        still = [a for a in drained if a in self._workers and self._workers[a].draining]
        return (
            f"a worker to take the splits left: the tasks of workers {', '.join(drained[:8])} "
            "ended as they drained for retirement (RetireWorker)"
            + (f", {', '.join(still[:8])} still draining" if still else "")
            + f"; {len([w for w in self._workers.values() if not w.draining])} "
            "other workers are registered"
        )

    def _release_iteration_client(self, request: Any) -> Any:
        with self._mu:
            if request.incarnation_id and request.incarnation_id != self._state.incarnation_id:
                return pb.ReleaseIterationClientResponse()
            client_id = st.IterationClientId(request.iteration_client_id)
            iteration_id = self._state.clients.get(client_id)
            if iteration_id is not None:  # its final counters
                job = self._state.job_of_iteration(iteration_id)
                self._note_client_counters_locked(client_id, job, request, time.monotonic())
                if request.counters.left_unreturned > 0:
                    self._left_by_departed[iteration_id] = (
                        self._left_by_departed.get(iteration_id, 0)
                        + request.counters.left_unreturned
                    )
                if job.exactly_once and request.split_receipts:
                    self._eo_final_receipts_locked(
                        client_id, self._state.iterations[iteration_id], request
                    )
            self._release_client_locked(client_id)
            return pb.ReleaseIterationClientResponse()

    def _release_client_locked(self, client_id: st.IterationClientId) -> None:
        iteration_id = self._state.clients.get(client_id)
        if iteration_id is None:
            return
        job = self._state.job_of_iteration(iteration_id)
        log.info(
            "consumer %d left iteration %d of job %d (%s)",
            client_id,
            iteration_id,
            job.job_id,
            job.job_name or "anonymous",
        )
        self._apply_locked(st.ReleaseIterationClient(client_id))
        self._eo_client_left_locked(iteration_id, client_id)
        self._client_seen.pop(client_id, None)
        self._client_seen_counters.pop(client_id, None)
        iteration = self._state.iterations[iteration_id]
        # Nobody else can join an anonymous job: free its tasks at once.
        if not job.job_name and not iteration.clients and not job.garbage_collected:
            self._apply_locked(st.GarbageCollectJob(job.job_id))
            self._split_providers.pop(iteration_id, None)
            self._split_grants.pop(iteration_id, None)


def _check_exactly_once_request(request: Any, mode: ShardingPolicy) -> None:
    """Refuses exactly_once where it does not apply.

    Raises:
        InvalidArgumentError: Not DYNAMIC, a coordinated read, or a cross-trainer cache.
    """
    if mode != ShardingPolicy.DYNAMIC:
        raise errors.InvalidArgumentError(
            f"exactly_once needs ShardingPolicy.DYNAMIC (splits leased until delivered); got "
            f"{mode.name}: OFF and static sharding produce each worker's share again when it "
            "restarts"
        )
    if request.num_consumers:
        raise errors.InvalidArgumentError(
            "exactly_once cannot be combined with num_consumers (coordinated reads assign "
            "rounds, not splits, to consumers)"
        )
    if request.use_cross_trainer_cache:
        raise errors.InvalidArgumentError(
            "exactly_once cannot be combined with a cross-trainer cache (each trainer reads "
            "every element)"
        )
