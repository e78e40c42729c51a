"""Split handout: GetSplits (DYNAMIC sharding) and GetRounds (coordinated
reads, `num_consumers`).

Owns `SplitHandoutMixin`: the split providers of each DYNAMIC iteration
(built on first use outside the lock, and after a restart fast-forwarded past
the splits the journal says were handed out), fair shares of the splits left, and the
assignment of rounds to tasks in blocks of `_ROUND_BLOCK` (moving a lost
task's rounds to live tasks).

Fields (`base.DispatcherBase`; all guarded by `self._mu`): reads `_state`;
writes `_split_providers` (iteration -> providers, built under
`self._load_mu`), `_split_grants` (iteration -> the last answer to each of
its split fetchers, answered again to a retried request) and `_task_splits` (the
splits handed to each task's current process, for worker_loss.py); `_state`
changes only through `_apply_locked`. Uses datasets.py's `_dataset_object`
and tasks.py's `_add_task_info_locked`; both handlers find the iteration a
request names (or raise NotFoundError) through `_iteration_and_job_locked`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dataservice import errors
from dataservice.data import graph
from dataservice.dispatcher import state as st
from dataservice.dispatcher.base import DispatcherBase, NotLoaded
from dataservice.rpc import service_pb2 as pb
from dataservice.sharding import ShardingPolicy

_MAX_SPLITS_PER_RPC = 4096
_ROUND_BLOCK = 64  # coordinated reads: rounds assigned per block


class SplitHandoutMixin(DispatcherBase):
    """GetSplits and GetRounds of `DispatchServer` (see the module docstring)."""

    if TYPE_CHECKING:  # defined by datasets.py and tasks.py

        def _dataset_object(self, dataset_id: str) -> Any: ...

        def _add_task_info_locked(self, infos: Any, task: st.Task) -> None: ...

        def _eo_get_splits_locked(
            self, request: Any, iteration: st.Iteration, job: st.Job, task_id: st.TaskId
        ) -> Any: ...

    def _iteration_and_job_locked(
        self, iteration_id: st.IterationId
    ) -> tuple[st.Iteration, st.Job]:
        """The iteration a request names, and its job.

        Raises:
            NotFoundError: No iteration has this id.
        """
        iteration = self._state.iterations.get(iteration_id)
        if iteration is None:
            raise errors.NotFoundError(f"Iteration {iteration_id} not found")
        return iteration, self._state.jobs[iteration.job_id]

    def _get_splits(self, request: Any) -> Any:
        # An iteration's split providers are built outside the lock (base.py
        # `NotLoaded`, `_build_split_providers`).
        return self._retry_when_loaded(self._try_get_splits, request)

    def _try_get_splits(self, request: Any) -> Any:
        """`_get_splits` under the lock, if the iteration's split providers are built.

        Raises:
            NotLoaded: They are not; nothing was changed.
        """
        iteration_id = st.IterationId(request.iteration_id)
        max_splits = max(1, min(request.max_splits or 1, _MAX_SPLITS_PER_RPC))
        with self._mu:
            self._check_incarnation_locked(request.incarnation_id)
            iteration, job = self._iteration_and_job_locked(iteration_id)
            if job.processing_mode != ShardingPolicy.DYNAMIC:
                raise errors.FailedPreconditionError(
                    f"GetSplits: iteration {iteration_id} belongs to job {job.job_id}, whose "
                    f"processing mode is {job.processing_mode.name}: only "
                    "DYNAMIC iterations hand out splits"
                )
            if st.TaskId(request.task_id) not in iteration.tasks:
                raise errors.NotFoundError(
                    f"GetSplits: task {request.task_id} is not a task of iteration {iteration_id}"
                )
            if (request.exactly_once or job.exactly_once) and not request.exactly_once:
                raise errors.FailedPreconditionError(
                    f"GetSplits: iteration {iteration_id} belongs to exactly-once job "
                    f"{job.job_id}: its splits are leased (GetSplitsRequest.exactly_once)"
                )
            task_id = st.TaskId(request.task_id)
            grants = self._split_grants.setdefault(iteration_id, {})
            fetcher = (task_id, request.fetcher_id)
            last = grants.get(fetcher) if request.request_number else None
            if last is not None and request.request_number <= last[0]:
                if request.request_number == last[0]:
                    # Another attempt of a request already granted: its answer
                    # was lost on the way, and so would its splits (or leases) be.
                    return last[1]
                raise errors.FailedPreconditionError(
                    f"GetSplits: request {request.request_number} of split fetcher "
                    f"{request.fetcher_id!r} (task {task_id}) comes after its request "
                    f"{last[0]}: a late copy of an attempt its worker gave up on"
                )
            if request.exactly_once:
                response = self._eo_get_splits_locked(request, iteration, job, task_id)
            else:
                response = self._grant_splits_locked(request, iteration, task_id, max_splits)
            if request.request_number:
                grants[fetcher] = (request.request_number, response)
            return response

    def _grant_splits_locked(
        self, request: Any, iteration: st.Iteration, task_id: st.TaskId, max_splits: int
    ) -> Any:
        """GetSplits of a DYNAMIC iteration that is not exactly-once: up to
        `max_splits` of each source the request names, a fair share of what is
        left (the same count of each for a joint request).

        Raises:
            InvalidArgumentError: The request names a source twice, or one the
                pipeline does not have.
            NotLoaded: The split providers are not built yet; nothing changed.
        """
        iteration_id = iteration.iteration_id
        joint = list(request.joint_split_provider_indices)
        indices = joint or [request.split_provider_index]
        if len(set(indices)) != len(indices):
            raise errors.InvalidArgumentError(
                f"GetSplits: joint_split_provider_indices {joint} names a source twice"
            )
        response = pb.GetSplitsResponse()
        batches = [response.batches.add() for _ in indices] if joint else [response]
        task = iteration.tasks.get(task_id)
        # (A task whose worker was declared lost still gets splits: only a
        # live process asks, and it is revived when it heartbeats again.)
        worker = self._workers.get(task.worker_address) if task is not None else None
        draining = worker is not None and worker.draining
        # A draining worker (retire.py) gets no more splits: its task ends
        # after the elements of those it has, which its consumers read; the
        # splits left go to the other workers' tasks.
        open_indices = [
            i
            for i in indices
            if not (
                draining or iteration.finished or iteration.splits_ended_by_provider.get(i, False)
            )
        ]
        for index, batch in zip(indices, batches, strict=True):
            batch.end_of_splits = index not in open_indices
        if (
            draining
            and task is not None
            and not task.drained
            and not iteration.finished
            and not all(iteration.splits_ended_by_provider.get(i, False) for i in indices)
        ):
            self._apply_locked(st.DrainTask(task_id))
        if not open_indices:
            return response
        providers = self._split_providers.get(iteration_id)
        if providers is None:  # built outside the lock, then asked again
            raise NotLoaded(lambda: self._build_split_providers(iteration_id))
        for index in indices:
            if not 0 <= index < len(providers):
                raise errors.InvalidArgumentError(
                    f"split provider {index} requested, the pipeline has {len(providers)}"
                )
        # Fair shares: never hand one task more than half of its even share
        # of what is left, so a small epoch (16 files) spreads over the workers.
        # A joint grant is the same count of each source (the smallest share),
        # so a worker's zip does not hold one input's splits while another
        # worker holds the other input's.
        live = max(1, len(iteration.live_tasks()))
        for index in open_indices:
            total = providers[index].cardinality()
            if total > 0:
                remaining = max(0, total - iteration.splits_produced.get(index, 0))
                max_splits = max(1, min(max_splits, remaining // (2 * live)))
        handed = 0
        for index, batch in zip(indices, batches, strict=True):
            if index not in open_indices:
                continue
            splits = []
            end = False
            for _ in range(max_splits):
                split = providers[index].get_next()
                if split is None:
                    end = True
                    break
                splits.append(split)
            self._apply_locked(st.ProduceSplits(iteration_id, len(splits), end, index))
            handed += len(splits)
            if splits and isinstance(splits[0], str):
                batch.str_splits.extend(splits)
            else:
                batch.int_splits.extend(int(s) for s in splits)
            batch.end_of_splits = end
        if task is not None:
            self._task_splits[task_id] = self._task_splits.get(task_id, 0) + handed
        if self._metrics is not None and handed:
            self._metrics.splits_handed_out.inc(handed)
        return response

    def _build_split_providers(self, iteration_id: st.IterationId) -> None:
        """Builds the split providers of DYNAMIC iteration `iteration_id`, replays
        the splits handed out before a restart (`Iteration.splits_produced`), and
        installs them in `_split_providers`, unless a racing caller did first.

        Call without `self._mu` held: loading the dataset object and building the
        providers may read and glob files, and the replay after a restart may be
        long, so all of it runs outside the lock. `self._load_mu` makes a racing
        second caller wait for the first one's providers, so an iteration has
        one set. Providers built from a state that changed meanwhile (the
        dispatcher recovered from its journal) are dropped, and the handler asks
        again.

        Raises:
            ValueError: The pipeline cannot be split (graph.split_providers).
            NotFoundError, DataLossError: As `_dataset_object`.
        """
        with self._load_mu:
            with self._mu:
                iteration = self._state.iterations.get(iteration_id)
                if iteration is None or iteration_id in self._split_providers:
                    return
                dataset_id = self._state.jobs[iteration.job_id].dataset_id
                seed = iteration.seed
                produced = dict(iteration.splits_produced)
            providers = graph.split_providers(self._dataset_object(dataset_id), seed)
            for i, provider in enumerate(providers):
                # Replay after a restart: skip what was handed out already.
                for _ in range(produced.get(i, 0)):
                    if provider.get_next() is None:
                        break
            with self._mu:
                iteration = self._state.iterations.get(iteration_id)
                if (
                    iteration is not None
                    and iteration_id not in self._split_providers
                    and iteration.seed == seed
                    and iteration.splits_produced == produced
                ):
                    self._split_providers[iteration_id] = providers

    def _get_rounds(self, request: Any) -> Any:
        iteration_id = st.IterationId(request.iteration_id)
        first = request.first_round - request.first_round % _ROUND_BLOCK
        with self._mu:
            self._check_incarnation_locked(request.incarnation_id)
            iteration, job = self._iteration_and_job_locked(iteration_id)
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
