"""Dispatcher decisions on worker liveness, driven through its RPC handlers."""

from __future__ import annotations

import pickle
import time

import pytest

import dataservice as ds
from dataservice.rpc import service_pb2 as pb


def _heartbeat(d, uid, current=()):
    return d._worker_heartbeat(
        pb.WorkerHeartbeatRequest(
            worker_address="w:1",
            transfer_address="w:1",
            host_id="h",
            worker_uid=uid,
            current_tasks=list(current),
            heartbeat_interval_ms=100,
        )
    )


def _start_read(d):
    dataset = ds.Dataset.range(10)
    from dataservice.data.serialize import serialize

    dataset_id = d._register_dataset(
        pb.RegisterDatasetRequest(
            dataset=serialize(dataset), element_spec=pickle.dumps(None), fingerprint="x"
        )
    ).dataset_id
    job = d._get_or_create_job(pb.GetOrCreateJobRequest(dataset_id=dataset_id, job_name="j"))
    return d._get_or_create_iteration(pb.GetOrCreateIterationRequest(job_id=job.job_id))


@pytest.mark.timeout(60)
def test_a_slow_worker_declared_lost_gets_its_task_back_not_a_new_copy():
    d = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=100))
    try:
        _heartbeat(d, "uid-1")
        iteration = _start_read(d)
        (task,) = _heartbeat(d, "uid-1").new_tasks
        d._workers["w:1"].last_heartbeat -= 10  # it missed its heartbeats
        d._check_workers()
        assert (
            d._client_heartbeat(
                pb.ClientHeartbeatRequest(iteration_client_id=iteration.iteration_client_id)
            ).tasks
            == []
        )
        response = _heartbeat(d, "uid-1", current=[task.task_id])  # back, same process
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
        _heartbeat(d, "uid-1")
        _start_read(d)
        (task,) = _heartbeat(d, "uid-1").new_tasks
        d._workers["w:1"].last_heartbeat = time.monotonic() - 10
        d._check_workers()
        (again,) = _heartbeat(d, "uid-2").new_tasks  # a new process at the same address
        assert again.task_id != task.task_id  # OFF: a new task, from the start
    finally:
        d.stop()
