"""The dispatcher loads dataset objects and builds split providers, and writes a
registration's definition file, outside its lock (STYLE.md: no I/O under the
dispatcher lock but the journal write), and callers that race for them still
share one object, one set of providers and one iteration (dispatcher/base.py
`NotLoaded`, datasets.py `_dataset_object`, split_handout.py
`_build_split_providers`).

Most tests restart a fault-tolerant dispatcher on its work_dir, so that the
dataset object and the split providers are gone and must be made again; the
handlers are called in-process, from threads of the test.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import dataservice as ds
from dataservice.data import graph
from dataservice.rpc import service_pb2 as pb

from .dispatcher_handlers import register_range, worker_heartbeat

# The module (`dataservice.data.serialize` is also the name of its function).
serialize = importlib.import_module("dataservice.data.serialize")

DYNAMIC = ds.ShardingPolicy.DYNAMIC
N = 100  # elements (and index splits) of the dataset


def _config(work_dir: Path) -> ds.DispatcherConfig:
    # A long worker timeout: the worker registered before the restart does not
    # come back, and its tasks must stay for the test's GetSplits.
    return ds.DispatcherConfig(
        work_dir=str(work_dir), fault_tolerant_mode=True, worker_timeout_ms=120_000
    )


def _lock_is_free(lock: Any) -> bool:
    """Whether another thread takes `lock` within 5 s (an RLock held by the
    calling thread keeps it out)."""
    got: list[bool] = []

    def take() -> None:
        if lock.acquire(timeout=5):
            lock.release()
            got.append(True)

    t = threading.Thread(target=take)
    t.start()
    t.join(10)
    return bool(got)


@pytest.fixture
def restarted(tmp_path: Path) -> Iterator[tuple[ds.DispatchServer, int, int, int]]:
    """A dispatcher restarted from its journal after a DYNAMIC job of
    `range(N)` got one iteration (repetition 0) with one task, and 10 of its
    splits were handed out. Yields (dispatcher, job_id, iteration_id, task_id)."""
    d = ds.DispatchServer(_config(tmp_path))
    try:
        worker_heartbeat(d, "w:1", "uid-1")
        dataset_id = register_range(d, N)
        job_id = d._get_or_create_job(
            pb.GetOrCreateJobRequest(dataset_id=dataset_id, job_name="j", processing_mode=DYNAMIC)
        ).job_id
        iteration_id = d._get_or_create_iteration(
            pb.GetOrCreateIterationRequest(job_id=job_id)
        ).iteration_id
        (task_id,) = d._state.iterations[iteration_id].tasks
        first = d._get_splits(
            pb.GetSplitsRequest(iteration_id=iteration_id, task_id=task_id, max_splits=10)
        )
        assert list(first.int_splits) == list(range(10))
    finally:
        d.stop()
    d = ds.DispatchServer(_config(tmp_path))
    try:
        assert not d._dataset_objects and not d._split_providers
        yield d, job_id, iteration_id, task_id
    finally:
        d.stop()


def _counting(
    monkeypatch: pytest.MonkeyPatch, module: Any, name: str, check: Callable[[], None]
) -> list[Any]:
    """Replaces `module.name` by a wrapper that runs `check()` first; returns
    the list of the first argument of each call."""
    real = getattr(module, name)
    calls: list[Any] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0] if args else None)
        check()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def _run_together(
    fns: list[Callable[[], Any]], arrived: threading.Semaphore, go: threading.Event
) -> list[Any]:
    """Runs `fns` on threads of their own; once each has released `arrived`
    (reached the point of the race), sets `go`. Returns their results."""
    results: list[Any] = [None] * len(fns)
    failures: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as err:  # re-raised in the test's thread
            failures.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for _ in fns:
        assert arrived.acquire(timeout=10), "a racing caller never asked for the load"
    go.set()
    for t in threads:
        t.join(20)
        assert not t.is_alive(), "a racing caller is stuck"
    if failures:
        raise failures[0]
    return results


@pytest.mark.timeout(60)
def test_get_splits_loads_and_builds_outside_the_lock(restarted, monkeypatch):
    d, _, iteration_id, task_id = restarted
    free: list[bool] = []
    loads = _counting(monkeypatch, serialize, "load", lambda: free.append(_lock_is_free(d._mu)))
    builds = _counting(
        monkeypatch, graph, "split_providers", lambda: free.append(_lock_is_free(d._mu))
    )
    response = d._get_splits(
        pb.GetSplitsRequest(iteration_id=iteration_id, task_id=task_id, max_splits=5)
    )
    # Replayed past the 10 splits handed out before the restart.
    assert list(response.int_splits) == list(range(10, 15))
    assert len(loads) == 1 and len(builds) == 1
    assert free == [True, True]


@pytest.mark.timeout(60)
def test_racing_get_splits_build_one_set_of_providers(restarted, monkeypatch):
    d, _, iteration_id, task_id = restarted
    arrived, go = threading.Semaphore(0), threading.Event()
    builds = _counting(monkeypatch, graph, "split_providers", lambda: go.wait(20))
    real_build = d._build_split_providers

    def build(iteration: int) -> None:
        arrived.release()
        real_build(iteration)

    monkeypatch.setattr(d, "_build_split_providers", build)
    request = pb.GetSplitsRequest(iteration_id=iteration_id, task_id=task_id, max_splits=8)
    a, b = _run_together([lambda: d._get_splits(request)] * 2, arrived, go)
    assert len(builds) == 1
    assert len(d._split_providers[iteration_id]) == 1
    # One provider handed out both: 16 distinct splits after the first 10.
    assert sorted(list(a.int_splits) + list(b.int_splits)) == list(range(10, 26))


@pytest.mark.timeout(60)
def test_racing_get_or_create_iteration_loads_once_and_creates_one(restarted, monkeypatch):
    d, job_id, _, _ = restarted
    arrived, go = threading.Semaphore(0), threading.Event()
    free: list[bool] = []

    def check() -> None:
        free.append(_lock_is_free(d._mu))
        go.wait(20)

    loads = _counting(monkeypatch, serialize, "load", check)
    real_load = d._dataset_object

    def load(dataset_id: str) -> Any:
        arrived.release()
        return real_load(dataset_id)

    monkeypatch.setattr(d, "_dataset_object", load)
    request = pb.GetOrCreateIterationRequest(job_id=job_id, repetition=1)
    a, b = _run_together([lambda: d._get_or_create_iteration(request)] * 2, arrived, go)
    assert len(loads) == 1 and free == [True]
    assert a.iteration_id == b.iteration_id
    assert a.iteration_client_id != b.iteration_client_id
    assert sorted(d._state.jobs[job_id].iterations) == [0, 1]
    assert d._state.iterations[a.iteration_id].clients == {
        a.iteration_client_id,
        b.iteration_client_id,
    }


@pytest.mark.timeout(60)
def test_register_dataset_writes_its_definition_outside_the_lock(tmp_path, monkeypatch):
    """A registration's journal copy of the definition (hundreds of MB for a
    pipeline capturing big arrays, fsynced: seconds) is written with the lock
    free, so heartbeats and the liveness checks go on meanwhile (they waited,
    and the dispatcher then took the wait for a stall of its own)."""
    from dataservice.dispatcher import journal

    d = ds.DispatchServer(_config(tmp_path))
    try:
        free: list[bool] = []
        writes = _counting(
            monkeypatch,
            journal.Journal,
            "write_dataset",
            lambda: free.append(_lock_is_free(d._mu)),
        )
        dataset_id = register_range(d, N)
        assert len(writes) == 1 and free == [True]
        assert d._state.datasets[dataset_id].definition_sha256
    finally:
        d.stop()
    # The journal holds it: a restart reads the definition back.
    d = ds.DispatchServer(_config(tmp_path))
    try:
        assert dataset_id in d._state.datasets
        assert d._datasets[dataset_id].pickle
    finally:
        d.stop()


@pytest.mark.timeout(60)
def test_racing_registrations_of_one_definition_write_one_whole_file(tmp_path, monkeypatch):
    """Two clients registering the same pipeline at once both write its
    definition file (outside the lock): each through a file of its own, so
    neither renames the other's half-written one over the definition."""
    from dataservice.dispatcher import journal

    d = ds.DispatchServer(_config(tmp_path))
    arrived, go = threading.Semaphore(0), threading.Event()
    real = journal.Journal.write_dataset

    def write(self: Any, data: bytes) -> str:
        arrived.release()
        go.wait(20)
        return real(self, data)

    monkeypatch.setattr(journal.Journal, "write_dataset", write)
    try:
        a, b = _run_together([lambda: register_range(d, N)] * 2, arrived, go)
        assert a == b  # one dataset: the second found the first's
        digest = d._state.datasets[a].definition_sha256
        path = Path(d._journal.dataset_path(digest))
        assert [p.name for p in path.parent.iterdir()] == [path.name]  # no .tmp left
    finally:
        d.stop()
    d = ds.DispatchServer(_config(tmp_path))
    try:
        assert d._datasets[a].pickle
    finally:
        d.stop()
