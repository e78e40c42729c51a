"""An in-process worker's `stop()` releases what it holds before it returns (issue 10:
nothing left behind), with the garbage collector off: no reference cycle may keep a
cross-trainer cache window's memfd, a ring, a socket or a thread alive until the next
collection. A user who starts and stops workers in a notebook or a test gets the memory
back at `stop()`.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import dataservice as ds
from dataservice.transfer import shm_server
from tests.conftest import FAST
from tests.ft.conftest import memfds, our_shm_names, wait_until

pytestmark = pytest.mark.timeout(120)

# Threads a worker starts: its gRPC server's ("ds-worker_N"), heartbeat, tasks'
# producers and shared-memory accept and connection threads.
WORKER_THREAD_PREFIXES = ("ds-worker", "ds-task-", "ds-shm-")


@pytest.fixture
def no_gc() -> Iterator[None]:
    """The cyclic garbage collector off for the test: only reference counts free."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def fd_inodes(fds: list[int]) -> dict[int, tuple[int, str]]:
    """fd -> (inode, /proc link) of each open fd."""
    return {fd: (os.fstat(fd).st_ino, os.readlink(f"/proc/self/fd/{fd}")) for fd in fds}


def still_open(fds: dict[int, tuple[int, str]]) -> list[str]:
    """Those of `fds` still open on the same file (an fd number reused since is not)."""
    left = []
    for fd, (inode, link) in fds.items():
        try:
            if os.fstat(fd).st_ino == inode:
                left.append(f"{fd} -> {link}")
        except OSError:
            continue
    return left


def workers_own_memfds(workers: list[ds.WorkerServer]) -> dict[int, tuple[int, str]]:
    """The workers' own fds of their memfds: cache windows and producer rings (a
    trainer's mapping in this process has fds of its own on the same files)."""
    fds = []
    for worker in workers:
        for runner in list(worker._tasks.values()):
            cache = runner.cross_trainer_cache
            if cache is None:
                continue
            with cache._mu:  # the writer is the cache's, one thread at a time
                if cache.writer is not None:
                    fds.append(cache.writer.fileno())
    for server in shm_server.live_servers():
        with server._mu:
            conns = list(server._connections)
        fds += [c.ring.fileno() for c in conns if c.ring is not None]
    return fd_inodes(fds)


def worker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(WORKER_THREAD_PREFIXES)]


def client_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ds-client-")]


def one_round(round_index: int) -> None:
    dispatcher = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=1_000))
    workers = [ds.WorkerServer(ds.WorkerConfig(dispatcher.target, **FAST)) for _ in range(2)]
    iterators: list[Any] = []
    try:
        cached = ds.Dataset.range(10**9).repeat().map(lambda i: np.full(4096, i, np.int64))
        for trainer in ("a", "b"):
            iterators.append(
                iter(
                    cached.apply(
                        ds.distribute(
                            ds.ShardingPolicy.OFF,
                            dispatcher.target,
                            job_name=f"cached-{round_index}",
                            cross_trainer_cache=ds.CrossTrainerCache(trainer),
                            data_transfer_protocol="shm",
                        )
                    )
                )
            )
        plain = ds.Dataset.range(10**6).map(lambda i: np.full(4096, i, np.int64))
        iterators.append(
            iter(
                plain.apply(
                    ds.distribute(
                        ds.ShardingPolicy.OFF,
                        dispatcher.target,
                        job_name=f"plain-{round_index}",
                        data_transfer_protocol="shm",
                    )
                )
            )
        )
        rows: list[list[int]] = [[], [], []]
        for _ in range(10):
            for row, it in zip(rows, iterators, strict=True):
                row.append(int(next(it)[0]))
        assert all(len(row) == 10 for row in rows)

        owned = workers_own_memfds(workers)
        links = sorted(link for _, link in owned.values())
        assert any("dataservice-cache-window" in link for link in links), links
        assert any("dataservice-ring" in link for link in links), links
        runners = [weakref.ref(r) for w in workers for r in w._tasks.values()]
        caches = [
            weakref.ref(r.cross_trainer_cache)
            for w in workers
            for r in w._tasks.values()
            if r.cross_trainer_cache is not None
        ]
        servers = [weakref.ref(s) for s in shm_server.live_servers()]
        assert len(runners) == 4 and len(caches) == 2 and len(servers) == 2

        # Stopped while the trainers are still connected and reading.
        for worker in workers:
            start = time.monotonic()
            worker.stop()
            stop_s = time.monotonic() - start
            assert stop_s < 5.0, f"stop() took {stop_s:.1f} s"
        assert still_open(owned) == [], "a stopped worker's memfd is still open"
        assert [r for r in runners if r() is not None] == [], "a stopped task runner lives on"
        assert [c for c in caches if c() is not None] == [], "a stopped cache lives on"
        assert [s for s in servers if s() is not None] == [], "a stopped shm server lives on"
        assert worker_threads() == []
        assert shm_server.live_servers() == []
    finally:
        for it in iterators:
            it.close()
        for worker in workers:
            worker.stop()
        dispatcher.stop()
    # The trainers' own mappings go with their fetch threads (each ends within one
    # fetch wait once its iterator is closed).
    wait_until(lambda: not client_threads(), 10, "the trainers' fetch threads to end")


def test_stopped_workers_free_their_memfds_and_threads_without_gc(no_gc):
    memfds_before = memfds()
    shm_before = our_shm_names()
    for round_index in range(3):
        one_round(round_index)
        # Without gc.collect(): reference counts alone freed everything.
        assert memfds() - memfds_before == set(), f"round {round_index}"
        assert our_shm_names() - shm_before == set(), f"round {round_index}"
    assert gc.isenabled() is False
