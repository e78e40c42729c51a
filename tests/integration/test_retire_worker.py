"""RetireWorker (`dispatcher/retire.py`): a draining worker gets no new task and
no more DYNAMIC splits, finishes what it holds, and is then forgotten; a worker
with an OFF task is refused; a worker that joins mid-epoch gets DYNAMIC splits
at once. In-process servers (fast heartbeats, tests/conftest.py)."""

from __future__ import annotations

import threading
import time

import pytest

import dataservice as ds
from dataservice import _serverproc, errors, status
from dataservice.rpc import service_pb2 as pb


def _retire(cluster, address: str, **flags: bool):
    with _serverproc.DispatcherStub(cluster.target) as d:
        try:
            return d.stub.RetireWorker(
                pb.RetireWorkerRequest(worker_address=address, **flags), timeout=10
            )
        except Exception as e:  # grpc.RpcError -> our error class
            from dataservice.rpc import util as rpc_util

            raise rpc_util.to_error(e, d.address, "RetireWorker") from None


def _wait_drained(cluster, address: str, read_one, timeout_s: float = 30.0):
    """Reads (with `read_one`) until the dispatcher says `address` drained."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = _retire(cluster, address)
        assert not response.refused, response.refused
        if response.drained:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"worker {address} did not drain in {timeout_s} s ({response.tasks} tasks)")
        read_one()


def _slow_dynamic(cluster, n: int, job_name: str):
    """An iterator over a DYNAMIC job of range(n), 1 ms an element (the workers
    do not make the whole epoch before the test acts)."""

    def slow(x):
        time.sleep(0.001)
        return x

    return iter(
        ds.Dataset.range(n)
        .map(slow)
        .apply(ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name=job_name))
    )


@pytest.mark.timeout(120)
def test_draining_worker_finishes_its_splits_and_loses_nothing(make_cluster):
    n = 3000
    cluster = make_cluster(2)
    retiring = cluster.workers[1]

    it = _slow_dynamic(cluster, n, "drain")
    got = [int(next(it)) for _ in range(20)]
    _wait_drained(cluster, retiring.address, lambda: got.append(int(next(it))))
    assert len(got) < n, "the epoch ended before the worker drained"
    # No new task in a new iteration of another job while it is registered.
    other = iter(
        ds.Dataset.range(5).apply(
            ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name="after")
        )
    )
    assert sorted(int(x) for x in other) == list(range(5))
    assert retiring.address not in other.stats()["workers"]
    retiring.stop()
    response = _retire(cluster, retiring.address, remove=True)
    assert response.drained
    got += [int(x) for x in it]
    assert sorted(got) == list(range(n)), f"{len(got)} elements, {len(set(got))} distinct"
    assert not it.stats().get("lost_workers")
    assert cluster.dispatcher.num_workers() == 1


@pytest.mark.timeout(120)
def test_worker_with_an_off_task_is_refused_and_cancel_undrains(make_cluster):
    cluster = make_cluster(2)
    address = cluster.workers[1].address
    it = iter(
        ds.Dataset.range(10_000).apply(
            ds.distribute(ds.ShardingPolicy.OFF, cluster.target, job_name="off")
        )
    )
    next(it)
    response = _retire(cluster, address)
    assert not response.drained
    assert "processing mode OFF" in response.refused, response.refused
    del it
    with pytest.raises(errors.InvalidArgumentError, match="exclude each other"):
        _retire(cluster, address, remove=True, cancel=True)
    with pytest.raises(errors.NotFoundError, match="not registered"):
        _retire(cluster, "127.0.0.1:1")


@pytest.mark.timeout(120)
def test_remove_of_a_worker_with_tasks_is_refused(make_cluster):
    cluster = make_cluster(1)
    address = cluster.workers[0].address
    it = iter(
        ds.Dataset.range(10_000).apply(
            ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name="busy")
        )
    )
    next(it)
    with pytest.raises(errors.FailedPreconditionError, match="still runs tasks"):
        _retire(cluster, address, remove=True)
    # Draining, then cancelled: it serves the iteration to its end again.
    assert not _retire(cluster, address).drained
    (worker,) = status.fetch_status(cluster.target, window_s=5)["workers"]
    assert worker["state"] == "draining"
    _retire(cluster, address, cancel=True)
    (worker,) = status.fetch_status(cluster.target, window_s=5)["workers"]
    assert worker["state"] == "alive"
    assert len([int(x) for x in it]) == 9_999


@pytest.mark.timeout(120)
def test_a_drain_cancelled_after_its_task_ended_serves_the_splits_left(make_cluster):
    # The only worker drains: its task ends with splits left, which must not
    # end the epoch; un-drained, it gets a new task and produces the rest.
    n = 3000
    cluster = make_cluster(1)
    address = cluster.workers[0].address
    it = _slow_dynamic(cluster, n, "undrain")
    got = [int(next(it)) for _ in range(20)]
    # A reader thread: once the task drained, next() waits for the splits left.
    reader = threading.Thread(target=lambda: got.extend(int(x) for x in it), daemon=True)
    reader.start()
    deadline = time.monotonic() + 30
    while not _retire(cluster, address).drained:
        assert time.monotonic() < deadline, "the worker did not drain in 30 s"
        time.sleep(0.05)
    time.sleep(0.5)  # the consumer's heartbeat sees the iteration without a task
    assert reader.is_alive(), f"the epoch ended with {len(got)} of {n} elements"
    with it._reader._cv:  # what its wait message (logged after 10 s) says
        waiting_for = it._reader._describe_wait_locked()
    assert "drained for retirement" in waiting_for, waiting_for
    _retire(cluster, address, cancel=True)
    reader.join(60)
    assert not reader.is_alive()
    assert sorted(got) == list(range(n)), f"{len(got)} elements, {len(set(got))} distinct"


@pytest.mark.timeout(120)
def test_worker_joining_mid_epoch_gets_dynamic_splits_at_once(make_cluster):
    n = 3000
    cluster = make_cluster(1)
    it = _slow_dynamic(cluster, n, "join")
    got = [int(next(it)) for _ in range(50)]
    joined = cluster.add_worker()
    got += [int(x) for x in it]
    assert sorted(got) == list(range(n))
    per_worker = it.stats()["workers"]
    assert per_worker.get(joined.address, {}).get("elements", 0) > 0, per_worker


@pytest.mark.timeout(120)
def test_worker_added_by_the_autoscaler_joins_running_dynamic_iterations_only(make_cluster):
    """`join_running_dynamic_only`: a running OFF epoch keeps its one copy per
    worker that was there; a running DYNAMIC epoch gets the new worker at once;
    the next OFF epoch gets it too."""
    from tests.conftest import FAST

    cluster = make_cluster(1)
    off = ds.Dataset.range(300).apply(
        ds.distribute(ds.ShardingPolicy.OFF, cluster.target, job_name="off")
    )
    dynamic = ds.Dataset.range(3000).map(lambda x: (time.sleep(0.001), x)[1])
    dynamic = dynamic.apply(
        ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name="dyn")
    )
    off_it, dyn_it = iter(off), iter(dynamic)
    got_off, got_dyn = [int(next(off_it))], [int(next(dyn_it))]
    added = ds.WorkerServer(ds.WorkerConfig(cluster.target, **FAST), join_running_dynamic_only=True)
    cluster.workers.append(added)
    got_dyn += [int(x) for x in dyn_it]
    got_off += [int(x) for x in off_it]
    assert sorted(got_dyn) == list(range(3000))
    assert dyn_it.stats()["workers"].get(added.address, {}).get("elements", 0) > 0
    assert sorted(got_off) == list(range(300)), "a running OFF epoch got another copy"
    next_epoch = iter(off)
    assert sorted(int(x) for x in next_epoch) == sorted(list(range(300)) * 2)
