"""Retiring a worker without losing data: RetireWorker (LocalCluster's autoscaler,
`dataservice._autoscale`).

Owns `RetireMixin`. A worker being retired is *draining* (`_Worker.draining`):
it gets no task in a new iteration (tasks.py `_worker_serves_locked`, jobs.py)
and its DYNAMIC tasks get `end_of_splits` at their next GetSplits
(split_handout.py), so each ends after producing the elements of the splits it
holds, which its consumers read as usual; the splits left go to the other
workers' tasks. Once it runs no unfinished task it is *drained*: its
supervisor stops the process and asks again with `remove`, and the dispatcher
forgets it without counting anything lost (it held nothing).

Only DYNAMIC tasks drain. A worker that runs a task of an OFF job (each worker
produces the whole dataset: retiring it mid-epoch would drop a copy the
consumers are reading), of static sharding (FILE, DATA, ...: its shard is its
alone) or of a coordinated read (`num_consumers`: rounds are assigned to it) is
refused (`RetireWorkerResponse.refused`), so a retirement never changes what
an epoch contains. The autoscaler then tries another worker or waits for those
iterations to end. (tf.data service has no retirement: a worker leaves only by
being lost, and its DYNAMIC splits with it.)

Fields (`base.DispatcherBase`; all guarded by `self._mu`): reads `_state`;
writes `_workers` (a `_Worker`'s `draining`) and `_worker_seen`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dataservice import errors
from dataservice.dispatcher import state as st
from dataservice.dispatcher.base import DispatcherBase, _Worker, log
from dataservice.rpc import service_pb2 as pb
from dataservice.sharding import ShardingPolicy


class RetireMixin(DispatcherBase):
    """RetireWorker of `DispatchServer` (see the module docstring)."""

    if TYPE_CHECKING:  # defined by tasks.py

        def _assign_tasks_to_worker_locked(
            self, worker: _Worker, dynamic_only: bool = False
        ) -> None: ...

    def _retire_worker(self, request: Any) -> Any:
        """Drains, un-drains (`cancel`) or forgets (`remove`) a worker.

        Raises:
            InvalidArgumentError: Both `remove` and `cancel` are set.
            NotFoundError: No such worker is registered (drain or cancel).
            FailedPreconditionError: `remove` of a worker that still runs a task
                (its process must have drained first).
        """
        address = request.worker_address
        if request.remove and request.cancel:
            raise errors.InvalidArgumentError(
                "RetireWorker: `remove` and `cancel` exclude each other"
            )
        with self._mu:
            worker = self._workers.get(address)
            tasks = self._state.tasks_of_worker(address)
            if request.remove:
                if worker is None:
                    return pb.RetireWorkerResponse(drained=not tasks, tasks=len(tasks))
                if tasks:
                    raise errors.FailedPreconditionError(
                        f"RetireWorker: worker {address} still runs tasks "
                        f"{sorted(t.task_id for t in tasks)}: only a drained worker is removed"
                    )
                del self._workers[address]
                self._worker_seen.pop(address, None)
                log.info("worker %s retired by its supervisor (drained)", address)
                return pb.RetireWorkerResponse(drained=True)
            if worker is None:
                raise errors.NotFoundError(f"RetireWorker: worker {address} is not registered")
            if request.cancel:
                if worker.draining:
                    worker.draining = False
                    log.info("worker %s: retirement cancelled; it gets tasks again", address)
                    self._assign_tasks_to_worker_locked(
                        worker, dynamic_only=worker.join_running_dynamic_only
                    )
                return pb.RetireWorkerResponse(drained=not tasks, tasks=len(tasks))
            refused = self._undrainable_locked(tasks)
            if refused and not worker.draining:
                return pb.RetireWorkerResponse(tasks=len(tasks), refused=refused)
            if not worker.draining:
                worker.draining = True
                log.info(
                    "worker %s draining for retirement: %d DYNAMIC tasks finish what they hold",
                    address,
                    len(tasks),
                )
            return pb.RetireWorkerResponse(drained=not tasks, tasks=len(tasks))

    def _undrainable_locked(self, tasks: list[st.Task]) -> str:
        """Why a worker running `tasks` cannot be retired now ("" if it can)."""
        for task in tasks:
            job = self._state.job_of_iteration(task.iteration_id)
            name = f"job {job.job_id} ({job.job_name or 'anonymous'})"
            if job.processing_mode != ShardingPolicy.DYNAMIC:
                return (
                    f"it runs task {task.task_id} of {name}, processing mode "
                    f"{job.processing_mode.name}: its elements come from this worker only"
                )
            if job.num_consumers:
                return (
                    f"it runs task {task.task_id} of {name}, a coordinated read "
                    f"({job.num_consumers} consumers): rounds are assigned to it"
                )
        return ""
