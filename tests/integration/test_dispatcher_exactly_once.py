"""Exactly-once split leases on the dispatcher, driven through its RPC handlers
(dispatcher/exactly_once.py): a split is out to one worker process at a time."""

from __future__ import annotations

import pytest

import dataservice as ds
from dataservice.rpc import service_pb2 as pb
from dataservice.sharding import sharding_policy_to_proto

from .dispatcher_handlers import register_range, worker_heartbeat

DYNAMIC = sharding_policy_to_proto(ds.ShardingPolicy.DYNAMIC)


def _leases(d, iteration_id, task_id, uid, max_splits, produced=()):
    request = pb.GetSplitsRequest(
        iteration_id=iteration_id,
        task_id=task_id,
        max_splits=max_splits,
        exactly_once=True,
        worker_uid=uid,
    )
    for ordinal, count in produced:
        request.produced.add(ordinal=ordinal, count=count)
    return [lease.ordinal for lease in d._get_splits(request).leases]


def _start(d):
    """Workers w:1 (uid-1a) and w:2 (uid-2) and one consumer of an exactly-once
    DYNAMIC read of range(100): (the consumer's iteration, w:1's task, w:2's task)."""
    worker_heartbeat(d, "w:1", "uid-1a")
    worker_heartbeat(d, "w:2", "uid-2")
    dataset_id = register_range(d, 100)
    job_id = d._get_or_create_job(
        pb.GetOrCreateJobRequest(dataset_id=dataset_id, processing_mode=DYNAMIC, exactly_once=True)
    ).job_id
    iteration = d._get_or_create_iteration(pb.GetOrCreateIterationRequest(job_id=job_id))
    tasks = {t.worker_address: t.task_id for t in d._state.tasks.values()}
    return iteration, tasks["w:1"], tasks["w:2"]


@pytest.mark.timeout(60)
def test_a_restarted_processs_splits_go_out_once_when_its_consumer_closed_it():
    """Worker w:1's process is replaced by a new one at the same address (as
    LocalCluster restarts it): the old process's open leases wait for the
    consumer to close it, then go out again, each to one process: the new
    process of the same task, which asks first, must not take what another
    task then also gets (two copies of one split: the later one reaches the
    consumer after the split completed, past its dedup)."""
    d = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=60_000))
    try:
        iteration, task1, task2 = _start(d)
        iteration_id = iteration.iteration_id
        held = _leases(d, iteration_id, task1, "uid-1a", 4)
        assert held, "the first process got no lease"
        worker_heartbeat(d, "w:1", "uid-1b")  # a new process at w:1: the old one's leases wait
        assert _leases(d, iteration_id, task1, "uid-1b", 1)[0] not in held  # (not yet)
        closed = pb.ClientHeartbeatRequest(iteration_client_id=iteration.iteration_client_id)
        closed.closed_processes.add(task_id=task1, worker_uid="uid-1a")
        d._client_heartbeat(closed)
        out = []
        for _ in range(len(held)):
            out += _leases(d, iteration_id, task1, "uid-1b", 1)
            out += _leases(d, iteration_id, task2, "uid-2", 1)
        again = [o for o in out if o in held]
        assert sorted(again) == sorted(held), (held, out)  # each once, none twice
    finally:
        d.stop()


@pytest.mark.timeout(60)
def test_a_split_waiting_to_go_out_again_is_not_orphaned_twice():
    """A lost process's splits wait, ready to go out again, when the next
    process of the same task is lost too: they are not that process's, so they
    do not wait for its close as well (then going out twice)."""
    d = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=60_000))
    try:
        iteration, task1, task2 = _start(d)
        iteration_id = iteration.iteration_id
        held = _leases(d, iteration_id, task1, "uid-1a", 4)

        def close(uid):
            request = pb.ClientHeartbeatRequest(iteration_client_id=iteration.iteration_client_id)
            request.closed_processes.add(task_id=task1, worker_uid=uid)
            d._client_heartbeat(request)

        worker_heartbeat(d, "w:1", "uid-1b")
        close("uid-1a")  # held: ready to go out again
        worker_heartbeat(d, "w:1", "uid-1c")  # uid-1b is lost before anyone took them
        out = []
        for _ in range(len(held)):
            out += _leases(d, iteration_id, task2, "uid-2", 1)
        close("uid-1b")
        for _ in range(len(held)):
            out += _leases(d, iteration_id, task2, "uid-2", 1)
            out += _leases(d, iteration_id, task1, "uid-1c", 1)
        again = [o for o in out if o in held]
        assert sorted(again) == sorted(held), (held, out)
    finally:
        d.stop()


@pytest.mark.timeout(60)
def test_after_a_dispatcher_restart_a_split_goes_out_again_only_with_its_receipts(tmp_path):
    """A split leased before the dispatcher restarted, whose process is gone,
    goes out again once the consumer told the new dispatcher what it received
    of it (then skipped), not before (then produced again, a second copy)."""
    config = ds.DispatcherConfig(
        work_dir=str(tmp_path), fault_tolerant_mode=True, worker_timeout_ms=120_000
    )
    d = ds.DispatchServer(config)
    try:
        iteration, task1, _ = _start(d)
        iteration_id = iteration.iteration_id
        held = _leases(d, iteration_id, task1, "uid-1a", 2)
        assert held
    finally:
        d.stop()
    d = ds.DispatchServer(config)
    try:
        worker_heartbeat(d, "w:1", "uid-1b")  # w:1's process is new too
        worker_heartbeat(d, "w:2", "uid-2")
        assert not set(_leases(d, iteration_id, task1, "uid-1b", 8)) & set(held)
        receipts = pb.ClientHeartbeatRequest(iteration_client_id=iteration.iteration_client_id)
        receipts.split_receipts.add(ordinal=held[0], ranges=[0, 1])  # got its element
        d._client_heartbeat(receipts)
        request = pb.GetSplitsRequest(
            iteration_id=iteration_id,
            task_id=task1,
            max_splits=8,
            exactly_once=True,
            worker_uid="uid-1b",
        )
        skip = {lease.ordinal: list(lease.skip) for lease in d._get_splits(request).leases}
        assert skip[held[0]] == [0, 1], skip
    finally:
        d.stop()


@pytest.mark.timeout(60)
def test_a_consumer_leaving_sends_the_open_splits_out_again_once_the_others_drop_the_old_run():
    """Consumers A and B of one exactly-once iteration; A received seqs 0-2 of
    split 0 and delivered 0-1, then leaves: split 0 (and every split open) goes
    out again under generation 1, but only after B said it drops generation 0,
    skipping what B received and what A delivered."""
    d = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=60_000))
    try:
        a, task1, _ = _start(d)
        iteration_id = a.iteration_id
        job_id = d._state.iterations[iteration_id].job_id
        b = d._get_or_create_iteration(pb.GetOrCreateIterationRequest(job_id=job_id))
        assert b.iteration_id == iteration_id
        held = _leases(d, iteration_id, task1, "uid-1a", 2)
        assert held[0] == 0
        heartbeat = pb.ClientHeartbeatRequest(iteration_client_id=a.iteration_client_id)
        heartbeat.split_receipts.add(ordinal=0, ranges=[0, 3])
        d._client_heartbeat(heartbeat)
        heartbeat = pb.ClientHeartbeatRequest(iteration_client_id=b.iteration_client_id)
        heartbeat.split_receipts.add(ordinal=0, ranges=[5, 6])
        assert not d._client_heartbeat(heartbeat).split_generations
        release = pb.ReleaseIterationClientRequest(iteration_client_id=a.iteration_client_id)
        release.split_receipts.add(ordinal=0, ranges=[0, 2])  # delivered 0-1, not 2
        d._release_iteration_client(release)

        def get(max_splits: int) -> list:
            request = pb.GetSplitsRequest(
                iteration_id=iteration_id,
                task_id=task1,
                max_splits=max_splits,
                exactly_once=True,
                worker_uid="uid-1a",
            )
            return list(d._get_splits(request).leases)

        assert all(lease.ordinal not in held for lease in get(4))  # B has not dropped run 0
        told = d._client_heartbeat(
            pb.ClientHeartbeatRequest(iteration_client_id=b.iteration_client_id)
        )
        assert {(g.ordinal, g.generation) for g in told.split_generations} == {(o, 1) for o in held}
        ack = pb.ClientHeartbeatRequest(iteration_client_id=b.iteration_client_id)
        for ordinal in held:
            ack.split_generations.add(ordinal=ordinal, generation=1)
        d._client_heartbeat(ack)
        again = {lease.ordinal: lease for lease in get(8) if lease.ordinal in held}
        assert sorted(again) == sorted(held)
        assert again[0].generation == 1
        assert list(again[0].skip) == [0, 2, 5, 6]  # A delivered 0-1; B received 5
    finally:
        d.stop()
