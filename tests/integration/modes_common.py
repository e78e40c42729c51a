"""Helpers shared by the processing-mode tests: `test_modes.py` (scenarios run under both
harnesses), `test_modes_inprocess.py` and `test_modes_processes.py` (what only one harness can
do). A harness makes clusters: `inprocess` runs the dispatcher and workers as servers in this
process (tests/conftest.py's `make_cluster`); `processes` runs workers as processes
(`LocalCluster`, or `python -m dataservice worker` where each needs its own port or host id).
"""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures

import numpy as np
import pytest

import dataservice as ds
from tests.conftest import to_py, values

OFF = ds.ShardingPolicy.OFF
DYNAMIC = ds.ShardingPolicy.DYNAMIC
FILE = ds.ShardingPolicy.FILE
DATA = ds.ShardingPolicy.DATA
FILE_OR_DATA = ds.ShardingPolicy.FILE_OR_DATA
HINT = ds.ShardingPolicy.HINT

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_FILES = 7
RECORDS_PER_FILE = 3
STATIC_WORKERS = 4  # of the processes harness's static cluster
LOCAL_INDEX = 1  # of that cluster: the only worker on this host


def dist(dataset, target, mode=OFF, **kw):
    """`dataset` distributed by the service at `target`: a target string, or a cluster
    (anything with a `.target`)."""
    return dataset.apply(ds.distribute(mode, getattr(target, "target", target), **kw))


def read_live_shards(dataset, target, mode, **kw) -> list:
    """The elements of a static-sharding read of a cluster where only some listed workers
    run (`static_cluster(..., live=...)`): their shards arrive, then, the other listed
    workers never registering, the read raises MissingShardsError after
    `worker_loss_timeout_ms` (300 ms here) instead of ending with part of the data."""
    got = []
    with pytest.raises(ds.errors.MissingShardsError, match="has not registered"):
        for e in dist(dataset, target, mode, worker_loss_timeout_ms=300, **kw):
            got.append(e)
    return got


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago (bound together, then closed)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str | Callable[[], str]) -> float:
    """Polls `cond` until it holds; returns the seconds it took, fails after `timeout_s`."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            described = what if isinstance(what, str) else what()
            pytest.fail(f"timed out after {timeout_s} s waiting for {described}")
        time.sleep(0.02)
    return time.monotonic() - start


def record(f: int, r: int) -> bytes:
    return b"file %d record %d" % (f, r)


def write_tfrecords(directory) -> list[str]:
    """file_0.tfrecord .. file_6.tfrecord in `directory`, 3 records each (record(f, r))."""
    names = []
    for f in range(NUM_FILES):
        path = str(directory / f"file_{f}.tfrecord")
        with ds.io.TFRecordWriter(path) as w:
            for r in range(RECORDS_PER_FILE):
                w.write(record(f, r))
        names.append(path)
    return names


def read_files(names: list[str]):
    """list_files over `names` (sorted), each file's records in order."""
    return ds.Dataset.list_files(names, shuffle=False).flat_map(lambda f: ds.TFRecordDataset(f))


def worker_of_last_element(it, before: dict[str, int]) -> str:
    """The worker whose element count in `it.stats()` grew by one since `before`."""
    now = {a: w["elements"] for a, w in it.stats()["workers"].items()}
    grown = [a for a in now if now[a] != before.get(a, 0)]
    assert len(grown) == 1, (before, now)
    before.update(now)
    return grown[0]


class Consumers:
    """`n` coordinated consumers of one job, reading round by round concurrently."""

    def __init__(self, dataset, target: str, n: int, job_name: str, mode=OFF, **kw):
        self.iterators = [
            iter(
                dataset.apply(
                    ds.distribute(
                        mode, target, job_name=job_name, consumer_index=i, num_consumers=n, **kw
                    )
                )
            )
            for i in range(n)
        ]
        self.seen: list[dict[str, int]] = [{} for _ in range(n)]
        self.pool = futures.ThreadPoolExecutor(max_workers=n)

    def read_round(self, consumers=None) -> tuple[list, list[str]]:
        """One round: (element per consumer, worker each element came from)."""
        idx = range(len(self.iterators)) if consumers is None else consumers
        fs = [self.pool.submit(next, self.iterators[i]) for i in idx]
        row = [to_py(f.result(timeout=30)) for f in fs]
        workers = [worker_of_last_element(self.iterators[i], self.seen[i]) for i in idx]
        return row, workers

    def close(self) -> None:
        for it in self.iterators:
            it.close()
        self.pool.shutdown(wait=False)


def cached(dataset, target, trainer_id, job_name="cache-job", **kw):
    """`dataset` read through the cross-trainer cache as trainer `trainer_id`."""
    return dist(
        dataset,
        target,
        kw.pop("mode", OFF),
        job_name=job_name,
        cross_trainer_cache=ds.CrossTrainerCache(trainer_id),
        **kw,
    )


def big_elements():
    """An infinite dataset of 800-byte elements: element i is int64[100] filled with i."""
    return ds.Dataset.range(10**7).map(lambda i: np.full(100, i, np.int64)).repeat()


def tagged(dataset):
    """Each element as (element, pid of the worker process that produced it)."""
    return dataset.map(lambda x: (x, os.getpid()))


def by_pid(got: list) -> dict[int, list]:
    out: dict[int, list] = {}
    for x, pid in got:
        out.setdefault(pid, []).append(x)
    return out


def line_reader(stream) -> queue.Queue:
    """A queue of `stream`'s lines (None at EOF), filled by a thread that closes
    the stream at EOF."""
    lines: queue.Queue = queue.Queue()

    def pump():
        with stream:
            for line in iter(stream.readline, ""):
                lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def next_line(lines: queue.Queue, deadline: float, what: str) -> str:
    try:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        pytest.fail(f"no line from {what} in time")
    if line is None:
        pytest.fail(f"{what} exited before printing its line")
    return line


class WorkerProcess:
    """`python -m dataservice worker` on a fixed port, optionally under another host id."""

    def __init__(self, dispatcher: str, port: int, host_id: str | None = None, **flags) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.path.join(REPO, "python"), REPO, env.get("PYTHONPATH")) if p
        )
        if host_id:
            env["DATASERVICE_HOST_ID"] = host_id
        argv = [sys.executable, "-m", "dataservice", "worker", "--dispatcher", dispatcher]
        argv += ["--port", str(port), "--worker-address", self.address]
        argv += ["--heartbeat-interval-ms", "100", "--parent-pid", str(os.getpid())]
        for name, value in flags.items():
            argv += ["--" + name.replace("_", "-"), str(value)]
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=self._stderr, env=env, text=True
        )
        self.pid = self.proc.pid
        self._lines = line_reader(self.proc.stdout)

    def wait_ready(self, deadline: float) -> None:
        try:
            line = next_line(self._lines, deadline, f"worker {self.address}")
        except BaseException:
            self._stderr.seek(0)
            print(self._stderr.read()[-3000:], file=sys.stderr)
            raise
        assert re.match(rf"dataservice worker listening on {self.address}$", line.strip()), line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._stderr.close()


def start_workers(dispatcher: str, ports: list[int], host_ids: list[str | None], **flags):
    workers = [
        WorkerProcess(dispatcher, p, h, **flags) for p, h in zip(ports, host_ids, strict=True)
    ]
    deadline = time.monotonic() + 60
    try:
        for w in workers:
            w.wait_ready(deadline)
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


class FixedWorkersCluster:
    """A dispatcher (in this process) configured with `config`, whose
    `worker_addresses` are worker processes on `ports`, worker i with host id
    `host_ids[i]` (None: ours)."""

    def __init__(self, config: ds.DispatcherConfig, ports: list[int], host_ids: list) -> None:
        self.config = config
        self.dispatcher = ds.DispatchServer(config)
        self.target = self.dispatcher.target
        try:
            self.workers = start_workers(self.target.split("://")[1], ports, host_ids)
        except BaseException:
            self.dispatcher.stop()
            raise
        self.index_of_pid = {w.pid: i for i, w in enumerate(self.workers)}

    def by_worker(self, got: list) -> dict[int, list]:
        return {self.index_of_pid[pid]: xs for pid, xs in by_pid(got).items()}

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        self.dispatcher.stop()


class StaticCluster(FixedWorkersCluster):
    """A dispatcher (in this process) with a fixed list of 4 worker processes,
    started on pre-picked ports; only worker LOCAL_INDEX shares our host id."""

    def __init__(self) -> None:
        ports = free_ports(STATIC_WORKERS)
        addresses = [f"127.0.0.1:{p}" for p in ports]
        host_ids = [None if i == LOCAL_INDEX else f"remote-host-{i}" for i in range(len(ports))]
        super().__init__(ds.DispatcherConfig(worker_addresses=addresses), ports, host_ids)


# ---------------------------------------------------------------- harnesses
def registered(cluster):
    """Waits until every in-process worker of `cluster` is registered; returns `cluster`."""
    for w in cluster.workers:
        assert w.wait_registered(10), f"worker {w.address} did not register"
    wait_until(lambda: cluster.dispatcher.num_workers() == len(cluster.workers), 10, "all workers")
    return cluster


def static_cluster(make_cluster, num_workers: int, live=None, **kw):
    """In-process: a dispatcher with a fixed list of `num_workers` addresses; only the
    workers at positions `live` (default: all) run, so a read returns exactly their shards
    before it fails for the others' (`read_live_shards`)."""
    ports = free_ports(num_workers)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    c = make_cluster(0, worker_addresses=addresses, **kw)
    for i in range(num_workers) if live is None else live:
        c.add_worker(port=ports[i], worker_address=addresses[i])
    return registered(c)


class Handle:
    """What a scenario sees of a cluster: its `target`, its workers' addresses (for a fixed
    worker list, in the list's order) and, where it runs in this process, the dispatcher."""

    def __init__(
        self, target: str, worker_addresses: list[str], dispatcher=None, worker_pids=None
    ) -> None:
        self.target = target
        self.worker_addresses = list(worker_addresses)
        self.dispatcher = dispatcher
        # The worker processes' pids; None for in-process workers (they run in this process).
        self.worker_pids = None if worker_pids is None else list(worker_pids)


class InProcessHarness:
    """Dispatcher and workers are servers in this test's process; a fresh cluster per call."""

    name = "inprocess"

    def __init__(self, make_cluster) -> None:
        self._make = make_cluster

    def pick(self, inprocess, processes):
        return inprocess

    def cluster(self, num_workers: int, dispatcher=None, worker=None) -> Handle:
        c = self._make(0, **(dispatcher or {}))
        for _ in range(num_workers):
            c.add_worker(**(worker or {}))
        registered(c)
        return Handle(c.target, [w.address for w in c.workers], c.dispatcher)

    def static(self, num_workers: int) -> Handle:
        c = static_cluster(self._make, num_workers)
        return Handle(c.target, c.dispatcher_config.worker_addresses, c.dispatcher)

    def read_shards(self, dataset, mode, num_workers: int) -> dict[int, list]:
        """{worker index: the elements its shard holds} of `dataset` under static sharding
        with a fixed list of `num_workers` workers (empty shards left out). In-process,
        elements carry no sign of their worker: one read per worker, of a cluster where
        only that worker of the list runs."""
        out = {}
        for i in range(num_workers):
            c = static_cluster(self._make, num_workers, live=[i])
            got = [to_py(e) for e in read_live_shards(dataset, c.target, mode)]
            if got:
                out[i] = got
        return out

    def dispatcher_with_workers(self, num_workers: int) -> Handle:
        """A cluster whose dispatcher is in this process (a test may patch it); not shared."""
        return self.cluster(num_workers)


class ProcessClusters:
    """The processes harness's clusters, kept for the module (starting worker processes
    takes seconds): the two most recently used, keyed by how they were made."""

    KEEP = 2

    def __init__(self) -> None:
        self._clusters: dict[tuple, tuple[Handle, Callable[[], None]]] = {}

    def get(self, key: tuple, make: Callable[[], tuple[Handle, Callable[[], None]]]) -> Handle:
        if key in self._clusters:
            self._clusters[key] = self._clusters.pop(key)  # most recent last
            return self._clusters[key][0]
        while len(self._clusters) >= self.KEEP:
            _, stop = self._clusters.pop(next(iter(self._clusters)))
            stop()
        self._clusters[key] = make()
        return self._clusters[key][0]

    def close(self) -> None:
        while self._clusters:
            _, stop = self._clusters.pop(next(iter(self._clusters)))
            stop()


class ProcessHarness:
    """Workers are processes: `LocalCluster` (shared by the module's tests that ask for the
    same one: scenarios use their own job names), or `python -m dataservice worker`
    processes on fixed ports for a fixed worker list (`StaticCluster`)."""

    name = "processes"

    def __init__(self, clusters: ProcessClusters, request) -> None:
        self._clusters = clusters
        self._request = request

    def pick(self, inprocess, processes):
        return processes

    def cluster(self, num_workers: int, dispatcher=None, worker=None) -> Handle:
        dispatcher = dispatcher or {}
        options = {"heartbeat_interval_ms": 100, **(worker or {})}

        def make():
            c = ds.LocalCluster(
                num_workers,
                dispatcher_config=ds.DispatcherConfig(**dispatcher),
                worker_options=options,
            )
            return Handle(c.target, c.worker_addresses, worker_pids=c.worker_pids), c.stop

        key = (
            "local",
            num_workers,
            repr(sorted(dispatcher.items())),
            repr(sorted(options.items())),
        )
        return self._clusters.get(key, make)

    def static(self, num_workers: int) -> Handle:
        assert num_workers == STATIC_WORKERS, num_workers

        def make():
            c = StaticCluster()
            handle = Handle(
                c.target, c.config.worker_addresses, c.dispatcher, [w.pid for w in c.workers]
            )
            return handle, c.stop

        return self._clusters.get(("static",), make)

    def read_shards(self, dataset, mode, num_workers: int) -> dict[int, list]:
        """{worker index: the elements its shard holds} of `dataset` under static sharding
        with a fixed list of `num_workers` worker processes (empty shards left out): one read
        of every worker (`target_workers="ANY"`), each element tagged with its worker's pid."""
        c = self.static(num_workers)
        got = values(dist(tagged(dataset), c.target, mode, target_workers="ANY"))
        index_of_pid = {pid: i for i, pid in enumerate(c.worker_pids or [])}
        return {index_of_pid[pid]: xs for pid, xs in by_pid(got).items()}

    def dispatcher_with_workers(self, num_workers: int) -> Handle:
        """A dispatcher in this process (a test may patch it) and `num_workers` worker
        processes; not shared, stopped after the test."""
        dispatcher = ds.DispatchServer()
        try:
            workers = start_workers(
                dispatcher.target.split("://")[1], free_ports(num_workers), [None] * num_workers
            )
        except BaseException:
            dispatcher.stop()
            raise

        def stop():
            for w in workers:
                w.stop()
            dispatcher.stop()

        self._request.addfinalizer(stop)
        return Handle(
            dispatcher.target, [w.address for w in workers], dispatcher, [w.pid for w in workers]
        )
