"""An epoch loop that reads a few elements of a named job and drops its iterator
(CASES K6): each dropped iterator leaves an iteration with a task per worker.
Those tasks hold a few elements, not a full task buffer (worker/task_runner.py:
the buffer grows with demand), and the iteration is collected job_gc_timeout_ms
after its consumer left (dispatcher/liveness.py `_collect_iterations`)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import dataservice as ds
from dataservice import errors
from dataservice.rpc import service_pb2 as pb
from dataservice.worker.task_runner import INITIAL_BUFFER_BYTES

pytestmark = pytest.mark.timeout(120)

ELEMENT_BYTES = 256 << 10
EPOCHS = 30


def _pipeline(n: int = 20_000):
    # 20 000 elements of 256 KiB: ~5 GiB per iteration if a task prefetched freely.
    return ds.Dataset.range(n).map(lambda i: np.full(ELEMENT_BYTES, i % 251, dtype=np.uint8))


def _named(dataset, cluster, mode, name="epochs"):
    return dataset.apply(ds.distribute(mode, cluster.target, job_name=name))


def _drop_iterators(distributed, epochs: int = EPOCHS) -> None:
    for _ in range(epochs):
        it = iter(distributed)
        for _ in range(2):
            assert next(it).nbytes == ELEMENT_BYTES
        it.close()


def _runners(worker) -> list:
    with worker._mu:
        return list(worker._tasks.values())


def _task_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("ds-task-"))


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", [ds.ShardingPolicy.DYNAMIC, ds.ShardingPolicy.OFF])
def test_dropped_iterators_hold_a_few_elements_each(make_cluster, mode) -> None:
    cluster = make_cluster(2)  # job GC at its default (minutes): nothing is collected
    _drop_iterators(_named(_pipeline(), cluster, mode))
    runners = [r for w in cluster.workers for r in _runners(w)]
    assert len(runners) == 2 * EPOCHS  # one task per worker per dropped iteration
    # Every producer fills its buffer to its bound and stops there.
    _wait_for(
        lambda: all(r.buffered_bytes + ELEMENT_BYTES > r.buffer_bound_bytes for r in runners),
        60,
        "every task's buffer to fill",
    )
    for worker in cluster.workers:
        buffered = sum(r.buffered_bytes for r in _runners(worker))
        # The client read ahead at most 16 elements of each iteration, so a task's
        # bound grew at most once: 30 tasks hold <= 30 x 4 MiB (was 30 x 64 MiB).
        assert buffered <= EPOCHS * 2 * INITIAL_BUFFER_BYTES, buffered
        assert max(r.buffer_bound_bytes for r in _runners(worker)) <= 2 * INITIAL_BUFFER_BYTES


@pytest.mark.parametrize("mode", [ds.ShardingPolicy.DYNAMIC, ds.ShardingPolicy.OFF])
def test_released_iterations_are_collected(make_cluster, mode) -> None:
    cluster = make_cluster(2, job_gc_timeout_ms=1_000, job_gc_check_interval_ms=100)
    baseline_threads = _task_threads()
    distributed = _named(_pipeline(), cluster, mode)
    _drop_iterators(distributed, epochs=10)
    # The current epoch's consumer keeps the job in use (job GC leaves it alone).
    current = iter(distributed)
    assert next(current).nbytes == ELEMENT_BYTES
    # 1 s of job_gc_timeout_ms, checks every 100 ms, worker heartbeats: well within 20 s.
    _wait_for(
        lambda: sum(w.num_tasks() for w in cluster.workers) == 2,
        20,
        "the workers to delete the collected iterations' tasks",
    )
    _wait_for(lambda: _task_threads() <= baseline_threads + 2, 10, "the task threads to exit")
    assert next(current).nbytes == ELEMENT_BYTES  # the current epoch reads on
    state = cluster.dispatcher._state
    (job,) = state.jobs.values()
    assert not job.garbage_collected
    iterations = [state.iterations[job.iterations[r]] for r in range(11)]
    assert all(it.garbage_collected for it in iterations[:10])
    assert not iterations[10].garbage_collected and not iterations[10].finished
    current.close()
    # Joining a collected repetition fails, naming the job, repetition and why.
    with pytest.raises(errors.FailedPreconditionError) as info:
        cluster.dispatcher._get_or_create_iteration(
            pb.GetOrCreateIterationRequest(
                job_id=job.job_id,
                repetition=3,
                incarnation_id=state.incarnation_id,
            )
        )
    text = str(info.value)
    assert f"repetition 3 of job {job.job_id} ('epochs') was garbage collected" in text
    assert "job_gc_timeout_ms (1000 ms)" in text
    # The next epoch is a new repetition and reads everything.
    n = 300  # 75 MiB: the task buffers grow to their full bound on the way
    full = list(_named(_pipeline(n), cluster, mode, name="full"))
    expected = sorted(i % 251 for i in range(n))
    if mode == ds.ShardingPolicy.OFF:
        expected = sorted(expected * 2)  # each worker produces the whole dataset
    assert sorted(int(x[0]) for x in full) == expected
