"""Shared fixtures: in-process clusters on 127.0.0.1 with fast heartbeats."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

import dataservice as ds

FAST = dict(heartbeat_interval_ms=100, dispatcher_timeout_ms=5_000)


class InProcessCluster:
    """A dispatcher and N in-process workers, all on 127.0.0.1, port 0."""

    def __init__(self, num_workers: int = 1, fault_tolerant: bool = False, **dispatcher_kw):
        self.work_dir = tempfile.mkdtemp(prefix="ds-test-") if fault_tolerant else None
        dispatcher_kw.setdefault("worker_timeout_ms", 1_000)
        self.dispatcher_config = ds.DispatcherConfig(
            work_dir=self.work_dir, fault_tolerant_mode=fault_tolerant, **dispatcher_kw
        )
        self.dispatcher = ds.DispatchServer(self.dispatcher_config)
        self.workers: list[ds.WorkerServer] = []
        for _ in range(num_workers):
            self.add_worker()

    @property
    def target(self) -> str:
        return self.dispatcher.target

    def add_worker(self, **kw) -> ds.WorkerServer:
        config = ds.WorkerConfig(self.target, **{**FAST, **kw})
        worker = ds.WorkerServer(config)
        self.workers.append(worker)
        return worker

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        self.dispatcher.stop()
        if self.work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _forget_earlier_tests_workers() -> None:
    """Each test starts with no memory of earlier tests' workers. This process
    remembers per worker address which transfer protocol it served
    (`client.connect._SERVED`) and which warnings it logged once (`_waits`); a
    test's in-process worker may get the port of an earlier test's, and would
    then be taken for it (a fallback logged at DEBUG, not its one WARNING)."""
    from dataservice import _waits
    from dataservice.client import connect

    connect._SERVED.clear()
    with _waits._ONCE_MU:
        _waits._ONCE_KEYS.clear()


@pytest.fixture
def make_cluster() -> Iterator:
    made: list[InProcessCluster] = []

    def _make(num_workers: int = 1, **kw) -> InProcessCluster:
        c = InProcessCluster(num_workers, **kw)
        made.append(c)
        return c

    yield _make
    for c in made:
        c.stop()


@pytest.fixture
def cluster(make_cluster) -> InProcessCluster:
    return make_cluster(1)


@pytest.fixture
def cluster2(make_cluster) -> InProcessCluster:
    return make_cluster(2)


def values(dataset) -> list:
    """Iterates `dataset` and returns its elements as plain Python values."""
    return [to_py(e) for e in dataset]


def to_py(x):
    import numpy as np

    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, tuple):
        return tuple(to_py(v) for v in x)
    if isinstance(x, list):
        return [to_py(v) for v in x]
    if isinstance(x, dict):
        return {k: to_py(v) for k, v in x.items()}
    return x


os.environ.setdefault("DATASERVICE_CLIENT_TIMEOUT_MS", "20000")
