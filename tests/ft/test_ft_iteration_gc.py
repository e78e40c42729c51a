"""A collected iteration (dispatcher/liveness.py `_collect_iterations`) is
journaled: a fault-tolerant dispatcher restarted on its work_dir still has it
collected, and its repetition still cannot be joined."""

from __future__ import annotations

import time

import pytest

import dataservice as ds
from dataservice import errors
from dataservice.rpc import service_pb2 as pb


@pytest.mark.timeout(60)
def test_collected_iteration_survives_a_restart(make_cluster) -> None:
    cluster = make_cluster(
        1, fault_tolerant=True, job_gc_timeout_ms=500, job_gc_check_interval_ms=100
    )
    distributed = ds.Dataset.range(10_000).apply(
        ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name="epochs")
    )
    for _ in range(3):  # three epochs that each read 2 elements and drop the iterator
        it = iter(distributed)
        next(it), next(it)
        it.close()
    current = iter(distributed)  # repetition 3, still read
    next(current)
    state = cluster.dispatcher._state
    (job,) = state.jobs.values()
    deadline = time.monotonic() + 20
    while not all(state.iterations[job.iterations[r]].garbage_collected for r in range(3)):
        assert time.monotonic() < deadline, "the dropped iterations were not collected"
        time.sleep(0.05)
    current.close()
    cluster.dispatcher.stop()
    cluster.dispatcher = ds.DispatchServer(cluster.dispatcher_config)  # replays work_dir
    state = cluster.dispatcher._state
    job = state.jobs[job.job_id]
    assert [state.iterations[job.iterations[r]].garbage_collected for r in range(4)] == [
        True,
        True,
        True,
        False,
    ]
    with pytest.raises(errors.FailedPreconditionError, match="repetition 1 of job"):
        cluster.dispatcher._get_or_create_iteration(
            pb.GetOrCreateIterationRequest(
                job_id=job.job_id, repetition=1, incarnation_id=state.incarnation_id
            )
        )
