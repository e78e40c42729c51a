"""Dispatcher decisions on worker liveness, driven through its RPC handlers."""

from __future__ import annotations

import time

import pytest

import dataservice as ds
from dataservice.rpc import service_pb2 as pb

from .dispatcher_handlers import register_range, worker_heartbeat


def _start_read(d):
    dataset_id = register_range(d, 10)
    job = d._get_or_create_job(pb.GetOrCreateJobRequest(dataset_id=dataset_id, job_name="j"))
    return d._get_or_create_iteration(pb.GetOrCreateIterationRequest(job_id=job.job_id))


@pytest.mark.timeout(60)
def test_a_slow_worker_declared_lost_gets_its_task_back_not_a_new_copy():
    d = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=100))
    try:
        worker_heartbeat(d, "w:1", "uid-1")
        iteration = _start_read(d)
        (task,) = worker_heartbeat(d, "w:1", "uid-1").new_tasks
        d._workers["w:1"].last_heartbeat -= 10  # it missed its heartbeats
        d._check_workers()
        assert (
            d._client_heartbeat(
                pb.ClientHeartbeatRequest(iteration_client_id=iteration.iteration_client_id)
            ).tasks
            == []
        )
        response = worker_heartbeat(d, "w:1", "uid-1", [task.task_id])  # back, same process
        assert list(response.new_tasks) == [] and list(response.tasks_to_delete) == []
        tasks = d._client_heartbeat(
            pb.ClientHeartbeatRequest(iteration_client_id=iteration.iteration_client_id)
        ).tasks
        assert [t.task_id for t in tasks] == [task.task_id]
    finally:
        d.stop()


@pytest.mark.timeout(60)
def test_a_restarted_worker_process_starts_its_task_over():
    d = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=100))
    try:
        worker_heartbeat(d, "w:1", "uid-1")
        _start_read(d)
        (task,) = worker_heartbeat(d, "w:1", "uid-1").new_tasks
        d._workers["w:1"].last_heartbeat = time.monotonic() - 10
        d._check_workers()
        (again,) = worker_heartbeat(d, "w:1", "uid-2").new_tasks  # a new process, same address
        assert again.task_id != task.task_id  # OFF: a new task, from the start
    finally:
        d.stop()


def _client_tasks(d, iteration):
    response = d._client_heartbeat(
        pb.ClientHeartbeatRequest(iteration_client_id=iteration.iteration_client_id)
    )
    return sorted(t.worker_address for t in response.tasks)


def _give_up(d, address):
    d._report_worker_failure(
        pb.ReportWorkerFailureRequest(worker_address=address, reason=f"{address} kept crashing")
    )


@pytest.mark.timeout(60)
def test_workers_given_up_on_fail_the_iterations_no_worker_is_left_to_run():
    """ReportWorkerFailure (LocalCluster gave up restarting a worker): the
    iteration goes on while another worker serves it, then fails with every
    reason; a new iteration fails at once; a worker that registers ends it."""
    d = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=100))
    try:
        worker_heartbeat(d, "w:1", "uid-1")
        worker_heartbeat(d, "w:2", "uid-2")
        iteration = _start_read(d)
        assert _client_tasks(d, iteration) == ["w:1", "w:2"]
        _give_up(d, "w:1")
        assert _client_tasks(d, iteration) == ["w:2"]  # dropped at once, the read goes on
        assert d.num_workers() == 1
        _give_up(d, "w:2")
        with pytest.raises(ds.errors.WorkerCrashedError) as info:
            _client_tasks(d, iteration)
        assert "no worker is left to run job" in str(info.value)
        assert "w:1 kept crashing" in str(info.value) and "w:2 kept crashing" in str(info.value)
        with pytest.raises(ds.errors.WorkerCrashedError, match="w:2 kept crashing"):
            _start_read(d)  # another consumer joins the failed iteration
        job_id = next(iter(d._state.jobs))
        with pytest.raises(ds.errors.WorkerCrashedError, match="w:1 kept crashing"):
            d._get_or_create_iteration(pb.GetOrCreateIterationRequest(job_id=job_id, repetition=1))
        worker_heartbeat(d, "w:3", "uid-3")  # a worker again: new iterations wait for it
        d._get_or_create_iteration(pb.GetOrCreateIterationRequest(job_id=job_id, repetition=2))
    finally:
        d.stop()


@pytest.mark.timeout(60)
def test_a_lost_worker_that_may_come_back_keeps_the_iteration_waiting():
    d = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=100))
    try:
        worker_heartbeat(d, "w:1", "uid-1")
        worker_heartbeat(d, "w:2", "uid-2")
        iteration = _start_read(d)
        d._workers["w:2"].last_heartbeat = time.monotonic() - 10
        d._check_workers()  # w:2 lost: it may be restarting
        _give_up(d, "w:1")
        assert _client_tasks(d, iteration) == []  # no error: waiting for w:2
        worker_heartbeat(d, "w:2", "uid-3")  # w:2 restarted
        assert _client_tasks(d, iteration) == ["w:2"]
    finally:
        d.stop()
