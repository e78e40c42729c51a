"""Processing-mode scenarios that need worker processes: `LocalCluster`, or
`python -m dataservice worker` processes started here when each needs its own port
(static sharding) or host id (locality). Elements are tagged on the worker with its pid
where a test asserts which worker produced what. Also C-19 (worker memory flat across epochs
of a big in-memory source, held once on the host for all workers), C-27 with a consumer
process that is SIGKILLed, job GC measured in worker memory, and a dispatcher restart.

The scenarios that make sense in-process too are in `test_modes.py`, run under both
harnesses; `test_modes_inprocess.py` has those only in-process servers can run.
"""

from __future__ import annotations

import gc
import glob
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator

import numpy as np
import psutil
import pytest

import dataservice as ds
from dataservice import errors
from tests.conftest import to_py, values
from tests.integration.modes_common import (
    DATA,
    FILE,
    FILE_OR_DATA,
    HINT,
    LOCAL_INDEX,
    NUM_FILES,
    REPO,
    FixedWorkersCluster,
    StaticCluster,
    by_pid,
    cached,
    dist,
    free_ports,
    line_reader,
    next_line,
    read_files,
    record,
    start_workers,
    tagged,
    wait_until,
    write_tfrecords,
)

SHARED_WORKERS = 4
CLIENT_TIMEOUT_MS = 3000


def rss(pids: list[int]) -> int:
    return sum(psutil.Process(p).memory_info().rss for p in pids)


HOST_A, HOST_B = "host-a", "host-b"


class TwoHostCluster(FixedWorkersCluster):
    """A fault-tolerant dispatcher (in this process, on a fixed port) with a
    fixed list of 4 worker processes: 0 and 1 on host-a, 2 and 3 on host-b."""

    def __init__(self, work_dir: str) -> None:
        dispatcher_port, *ports = free_ports(5)
        config = ds.DispatcherConfig(
            port=dispatcher_port,
            worker_addresses=[f"127.0.0.1:{p}" for p in ports],
            work_dir=work_dir,
            fault_tolerant_mode=True,
            job_gc_check_interval_ms=200,
            job_gc_timeout_ms=1000,
        )
        super().__init__(config, ports, [HOST_A, HOST_A, HOST_B, HOST_B])

    @staticmethod
    def read_on(host: str, monkeypatch, dataset):
        """An iterator of `dataset` whose consumer is on `host` (its client
        tells the dispatcher when it starts)."""
        monkeypatch.setenv("DATASERVICE_HOST_ID", host)
        return iter(dataset)

    def restart_dispatcher(self) -> None:
        """Stops the dispatcher and starts it again on its port (the journal replayed)."""
        self.dispatcher.stop()
        self.dispatcher = ds.DispatchServer(self.config)


@pytest.fixture(scope="module")
def tfrecords(tmp_path_factory) -> list[str]:
    return write_tfrecords(tmp_path_factory.mktemp("modes-processes-tfrecords"))


@pytest.fixture(scope="module")
def static() -> Iterator[StaticCluster]:
    c = StaticCluster()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> Iterator[TwoHostCluster]:
    c = TwoHostCluster(str(tmp_path_factory.mktemp("two-hosts-journal")))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def shared() -> Iterator[ds.LocalCluster]:
    """4 worker processes; fast client timeout (C-27) and job GC."""
    config = ds.DispatcherConfig(
        client_timeout_ms=CLIENT_TIMEOUT_MS, job_gc_check_interval_ms=200, job_gc_timeout_ms=1000
    )
    with pytest.MonkeyPatch.context() as mp:
        # A fixed mmap threshold: freed elements go back to the OS at once, so worker
        # RSS shows what the service still holds, not what malloc keeps cached.
        mp.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
        cluster = ds.LocalCluster(
            SHARED_WORKERS, dispatcher_config=config, worker_options={"heartbeat_interval_ms": 100}
        )
    with cluster:
        yield cluster


@pytest.fixture(scope="module")
def cache_cluster() -> Iterator[ds.LocalCluster]:
    """One worker process whose cross-trainer cache holds 400 elements of 800 B."""
    options = {"cross_trainer_cache_size_bytes": 400 * 800, "heartbeat_interval_ms": 100}
    with ds.LocalCluster(1, worker_options=options) as c:
        yield c


# ================================================================ static sharding
# Processes only: worker processes with host ids of their own, a dispatcher restart.
@pytest.mark.timeout(60)
def test_static_sharding_local_read_gets_the_local_shard_only(static):
    got = values(dist(tagged(ds.Dataset.range(20)), static.target, DATA, target_workers="LOCAL"))
    assert static.by_worker(got) == {LOCAL_INDEX: list(range(LOCAL_INDEX, 20, 4))}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [FILE, DATA, FILE_OR_DATA, HINT])
def test_static_sharding_auto_reads_the_local_worker_only(static, tfrecords, mode):
    # API.md: local workers are the ones static sharding reads from. (tf.data's AUTO
    # would read every worker not colocated with another trainer.)
    if mode == HINT:
        dataset = ds.Dataset.range(20).shard(ds.SHARD_HINT, ds.SHARD_HINT)
        expected = list(range(LOCAL_INDEX, 20, 4))
    elif mode == FILE:
        dataset = read_files(tfrecords)
        expected = [record(f, r) for f in range(LOCAL_INDEX, NUM_FILES, 4) for r in range(3)]
    else:
        dataset = ds.Dataset.range(20)
        expected = list(range(LOCAL_INDEX, 20, 4))
    got = list(dist(tagged(dataset), static.target, mode))  # target_workers="AUTO"
    assert static.by_worker([(to_py(x), pid) for x, pid in got]) == {LOCAL_INDEX: expected}


@pytest.mark.timeout(60)
def test_static_sharding_auto_named_job_consumers_all_read_the_local_worker(static):
    # Two consumers of one named job split the local worker's shard between them.
    def consumer():
        return iter(dist(tagged(ds.Dataset.range(200)), static.target, DATA, job_name="auto"))

    readers = {"a": consumer(), "b": consumer()}
    got: dict[str, list] = {"a": [], "b": []}
    while readers:  # in turns
        for name, it in list(readers.items()):
            try:
                got[name].append(to_py(next(it)))
            except StopIteration:
                del readers[name]
    for name in got:
        assert set(static.by_worker(got[name])) <= {LOCAL_INDEX}, name
    union = [x for x, _ in got["a"] + got["b"]]
    assert sorted(union) == list(range(LOCAL_INDEX, 200, 4))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("target", ["AUTO", "LOCAL"])
def test_static_sharding_named_job_on_two_hosts_each_reads_its_own_workers_shards(
    two_hosts, monkeypatch, target
):
    # One job, a consumer on each host: each reads the shards of its own host's
    # workers (worker i keeps i, i + 4, ...), host-b joining while host-a reads;
    # a consumer on a host with no worker is refused, naming its host.
    def job():
        dataset = tagged(ds.Dataset.range(40))
        return dist(
            dataset, two_hosts.target, DATA, job_name=f"shards-{target}", target_workers=target
        )

    a = two_hosts.read_on(HOST_A, monkeypatch, job())
    got_a = [to_py(next(a))]
    b = two_hosts.read_on(HOST_B, monkeypatch, job())
    got_a += values(a)
    got_b = values(b)
    assert two_hosts.by_worker(got_a) == {0: list(range(0, 40, 4)), 1: list(range(1, 40, 4))}
    assert two_hosts.by_worker(got_b) == {2: list(range(2, 40, 4)), 3: list(range(3, 40, 4))}
    with pytest.raises(errors.InvalidArgumentError, match=r"4 workers are registered") as info:
        two_hosts.read_on("host-c", monkeypatch, job())
    assert "none on the client's host (host-c)" in str(info.value)


@pytest.mark.timeout(90)
def test_local_off_named_job_on_two_hosts_each_reads_a_copy_per_own_worker(two_hosts, monkeypatch):
    # LOCAL with OFF: each host's consumer gets a full copy from each of its own
    # two workers, host-b's after host-a's part ended; once both let go the job
    # is collected, and the name starts over.
    def job():
        return dist(
            tagged(ds.Dataset.range(5)), two_hosts.target, job_name="copies", target_workers="LOCAL"
        )

    copies = list(range(5))
    got_a = values(two_hosts.read_on(HOST_A, monkeypatch, job()))
    assert two_hosts.by_worker(got_a) == {0: copies, 1: copies}
    got_b = values(two_hosts.read_on(HOST_B, monkeypatch, job()))
    assert two_hosts.by_worker(got_b) == {2: copies, 3: copies}
    assert values(two_hosts.read_on(HOST_B, monkeypatch, job())) == []  # read to its end
    wait_until(lambda: two_hosts.dispatcher._state.live_job_named("copies") is None, 20, "job GC")
    got_a = values(two_hosts.read_on(HOST_A, monkeypatch, job()))
    assert two_hosts.by_worker(got_a) == {0: copies, 1: copies}


@pytest.mark.timeout(120)
def test_named_job_on_two_hosts_survives_a_dispatcher_restart(two_hosts, monkeypatch):
    # Fault tolerance: which host each consumer and each task is on is journaled.
    # host-b creates the job and host-a joins it; after the restart host-a still
    # reads host-a's workers only (not those of the job's creator), and each
    # host's consumer gets exactly its own shards.
    def job():
        return dist(
            tagged(ds.Dataset.range(80)),
            two_hosts.target,
            DATA,
            job_name="restart",
            target_workers="LOCAL",
        )

    b = two_hosts.read_on(HOST_B, monkeypatch, job())
    got_b = [to_py(next(b))]
    a = two_hosts.read_on(HOST_A, monkeypatch, job())
    got_a = [to_py(next(a))]
    two_hosts.restart_dispatcher()
    got_a += values(a)
    got_b += values(b)
    assert two_hosts.by_worker(got_a) == {0: list(range(0, 80, 4)), 1: list(range(1, 80, 4))}
    assert two_hosts.by_worker(got_b) == {2: list(range(2, 80, 4)), 3: list(range(3, 80, 4))}


@pytest.mark.timeout(120)
def test_local_cluster_and_worker_processes_on_two_hosts_read_their_own_shards(monkeypatch):
    # LocalCluster's 2 worker processes on host-a (the '%port%' entries of the
    # list), 2 CLI worker processes on host-b (fixed entries 2 and 3); one
    # static-sharding job read from each host.
    ports = free_ports(2)
    config = ds.DispatcherConfig(
        worker_addresses=["127.0.0.1:%port%"] * 2 + [f"127.0.0.1:{p}" for p in ports]
    )
    monkeypatch.setenv("DATASERVICE_HOST_ID", HOST_A)
    with ds.LocalCluster(2, dispatcher_config=config) as cluster:
        # Processes the cluster did not start need its token (SECURITY.md).
        monkeypatch.setenv("DATASERVICE_AUTH_TOKEN", cluster.auth_token)
        workers_b = start_workers(cluster.dispatcher_address, ports, [HOST_B, HOST_B])
        try:
            # (A worker process prints its ready line once it is registered.)
            def job():
                return dist(tagged(ds.Dataset.range(40)), cluster.target, DATA, job_name="lc")

            got_a = values(TwoHostCluster.read_on(HOST_A, monkeypatch, job()))
            got_b = values(TwoHostCluster.read_on(HOST_B, monkeypatch, job()))
        finally:
            for w in workers_b:
                w.stop()
    # Which LocalCluster worker took which '%port%' entry depends on who registered first.
    assert set(by_pid(got_a)) == set(cluster.worker_pids)
    assert sorted(by_pid(got_a).values()) == [list(range(0, 40, 4)), list(range(1, 40, 4))]
    assert by_pid(got_b) == {
        workers_b[0].pid: list(range(2, 40, 4)),
        workers_b[1].pid: list(range(3, 40, 4)),
    }


@pytest.mark.timeout(60)
def test_static_sharding_auto_from_another_host(static, monkeypatch):
    # No worker on this client's host: a clear error, and ANY still reads every shard.
    monkeypatch.setenv("DATASERVICE_HOST_ID", "a-trainer-elsewhere")  # this client only
    with pytest.raises(errors.InvalidArgumentError, match=r"target_workers=AUTO.*no local worker"):
        next(iter(dist(ds.Dataset.range(20), static.target, DATA)))
    got = values(dist(tagged(ds.Dataset.range(20)), static.target, DATA, target_workers="ANY"))
    assert static.by_worker(got) == {i: list(range(i, 20, 4)) for i in range(4)}


@pytest.mark.slow  # the bug is in the dispatcher; test_modes_inprocess.py shows it
@pytest.mark.timeout(60)
def test_port_placeholders_with_local_cluster_read_every_shard_once():
    # Each '%port%' entry serves one worker (not the first entry for both).
    config = ds.DispatcherConfig(worker_addresses=["127.0.0.1:%port%"] * 2)
    with ds.LocalCluster(2, dispatcher_config=config) as c:
        got = values(dist(tagged(ds.Dataset.range(10)), c.target, DATA))
    # Which worker process took which entry depends on who registered first.
    assert sorted(by_pid(got).values()) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


# ================================================================ target_workers
# Processes only: a static cluster of which one worker process shares this host.
@pytest.mark.timeout(60)
@pytest.mark.parametrize("target,copies", [("ANY", 4), ("AUTO", 4), ("LOCAL", 1)])
def test_target_workers_off_mode_with_one_local_worker(static, target, copies):
    got = values(dist(tagged(ds.Dataset.range(5)), static.target, target_workers=target))
    per_worker = static.by_worker(got)
    assert len(per_worker) == copies
    assert all(xs == list(range(5)) for xs in per_worker.values())
    if target == "LOCAL":
        assert list(per_worker) == [LOCAL_INDEX]


@pytest.mark.timeout(60)
def test_local_read_without_a_local_worker_is_an_error(shared, monkeypatch):
    monkeypatch.setenv("DATASERVICE_HOST_ID", "a-trainer-elsewhere")  # this client only
    with pytest.raises(errors.InvalidArgumentError, match="no local worker"):
        next(iter(dist(ds.Dataset.range(5), shared.target, target_workers="LOCAL")))
    got = values(dist(ds.Dataset.range(5), shared.target, target_workers="ANY"))
    assert sorted(got) == sorted(SHARED_WORKERS * list(range(5)))


# ================================================================ C-27
# Processes only: the stopped consumer is a process, SIGKILLed.
@pytest.mark.timeout(60)
def test_c27_killed_consumer_process_fails_the_other_within_client_timeout(shared):
    job = "c27-processes"
    source = ds.Dataset.range(10**6).repeat()
    consumer0 = iter(dist(source, shared.target, job_name=job, consumer_index=0, num_consumers=2))
    script = textwrap.dedent(
        f"""
        import sys
        import dataservice as ds
        dataset = ds.Dataset.range(10**6).repeat().apply(ds.distribute(
            "parallel_epochs", {shared.target!r}, job_name={job!r},
            consumer_index=1, num_consumers=2))
        it = iter(dataset)
        print("ready", flush=True)
        print(" ".join(str(int(next(it))) for _ in range(10)), flush=True)
        sys.stdin.read()
        """
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.path.join(REPO, "python"),
        DATASERVICE_AUTH_TOKEN=shared.auth_token,  # a process the cluster did not start
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        lines = line_reader(proc.stdout)
        deadline = time.monotonic() + 30
        assert next_line(lines, deadline, "consumer 1").strip() == "ready"
        w = SHARED_WORKERS
        mine = [to_py(next(consumer0)) for _ in range(10)]
        theirs = [int(x) for x in next_line(lines, deadline, "consumer 1").split()]
        assert mine == [(r // w) * 2 for r in range(10)]
        assert theirs == [(r // w) * 2 + 1 for r in range(10)]
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        more = []
        with pytest.raises(errors.DeadlineExceededError, match="consumer 0 of 2"):
            while True:
                more.append(to_py(next(consumer0)))
        elapsed = time.monotonic() - killed
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdin.close()
        consumer0.close()
    assert more == [(r // w) * 2 for r in range(10, 10 + len(more))]
    assert elapsed < CLIENT_TIMEOUT_MS / 1000 + 3.0, f"failed after {elapsed:.1f} s"


# ================================================================ cross-trainer cache
# Processes only: a LocalCluster worker serving trainers through shared memory.
@pytest.mark.timeout(60)
def test_cache_same_host_worker_process_serves_through_shared_memory(cache_cluster):
    dataset = ds.Dataset.range(10**7).repeat()
    its = [iter(cached(dataset, cache_cluster.target, t, job_name="shm")) for t in "abc"]
    got: list[list[int]] = [[], [], []]
    for _ in range(20):  # in lockstep
        for t, it in enumerate(its):
            got[t].append(to_py(next(it)))
    protocols = []
    for it in its:
        (stats,) = it.stats()["workers"].values()
        protocols.append(stats["transfer_protocol"])
        it.close()
    assert got == [list(range(20))] * 3
    assert protocols == ["shm"] * 3


# ================================================================ job GC
# Processes only: what the worker processes hold, measured in their RSS.
def worker_rss(pids: list[int]) -> list[int]:
    return [psutil.Process(p).memory_info().rss for p in pids]


def _mib(sizes: list[int]) -> str:
    return f"{[v >> 20 for v in sizes]} MiB"


def heavy_job(target: str, job_name: str):
    """An OFF job of 1 MiB elements read over gRPC (so that no shared-memory ring,
    which stays resident while mapped, blurs what the workers hold)."""
    dataset = ds.Dataset.range(10**6).map(lambda x: np.full(1 << 20, x % 251, np.uint8))
    return iter(dist(dataset, target, job_name=job_name, data_transfer_protocol="grpc"))


def drain_to_grow(it) -> None:
    """Reads until every worker handed out 40 MiB: a task's buffer starts at a few
    elements and doubles as its consumer drains it (worker/task_runner.py), so each
    task's bound is then 32 MiB or more and the workers buffer that much. (Counted
    per worker: the reader takes from whichever worker answers first, so 40 MiB per
    worker on average can leave one worker's bound at 16 MiB.)"""
    for _ in range(40 * SHARED_WORKERS):
        next(it)
    for _ in range(100 * SHARED_WORKERS):
        workers = it.stats()["workers"].values()
        if len(workers) == SHARED_WORKERS and min(w["elements"] for w in workers) >= 40:
            return
        next(it)
    raise AssertionError(f"a worker handed out under 40 elements: {it.stats()['workers']}")


def wait_buffered_then_freed(pids: list[int], baseline: list[int], abandon: Callable) -> float:
    """Waits until every worker holds 32 MiB more than `baseline` (its task buffer,
    grown by `drain_to_grow`, up to 64 MiB), calls `abandon`, and returns how long
    until every worker is back under baseline + 16 MiB."""
    mib = 1 << 20
    wait_until(
        lambda: all(r > b + 32 * mib for r, b in zip(worker_rss(pids), baseline, strict=True)),
        20,
        lambda: (
            f"every worker to buffer the job's elements ({_mib(baseline)} -> "
            f"{_mib(worker_rss(pids))})"
        ),
    )
    abandon()
    return wait_until(
        lambda: all(r < b + 16 * mib for r, b in zip(worker_rss(pids), baseline, strict=True)),
        15,
        lambda: (
            f"the abandoned job's memory to be freed ({_mib(baseline)} -> {_mib(worker_rss(pids))})"
        ),
    )


@pytest.mark.timeout(60)
def test_gc_abandoned_job_frees_worker_process_memory(shared):
    pids = shared.worker_pids
    baseline = worker_rss(pids)
    it = heavy_job(shared.target, "gc-memory")
    assert int(next(it)[0]) == 0
    drain_to_grow(it)

    def abandon():
        nonlocal it
        del it
        gc.collect()

    # Collected after job_gc_timeout_ms (1 s) without a consumer.
    assert wait_buffered_then_freed(pids, baseline, abandon) < 10
    # The name is free again: a new job starts at the beginning.
    again = iter(dist(ds.Dataset.range(100), shared.target, job_name="gc-memory"))
    assert to_py(next(again)) == 0
    again.close()


@pytest.mark.timeout(60)
def test_gc_keeps_the_job_of_an_idle_live_consumer(shared):
    live = iter(
        dist(
            ds.Dataset.range(300), shared.target, job_name="gc-live", data_transfer_protocol="grpc"
        )
    )
    first = [to_py(next(live)) for _ in range(3)]
    pids = shared.worker_pids
    baseline = worker_rss(pids)
    abandoned = heavy_job(shared.target, "gc-abandoned")
    next(abandoned)
    drain_to_grow(abandoned)

    def abandon():
        nonlocal abandoned
        del abandoned
        gc.collect()

    # Once the abandoned job (started after `live`) is collected, the GC has run past
    # its timeout while `live` sat idle: its job must have been kept, whole.
    wait_buffered_then_freed(pids, baseline, abandon)
    got = sorted(first + values(live))
    assert got == sorted(SHARED_WORKERS * list(range(300)))


# ================================================================ C-19
# Processes only: worker processes' memory across epochs; files they map.
def c19_cluster() -> ds.LocalCluster:
    """LocalCluster(2) whose workers return freed buffers of 64 KiB and more to the
    OS at once (a fixed mmap threshold), so that their RSS after an epoch shows
    what they hold, not how much malloc kept of the epoch's transient buffers."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
        return ds.LocalCluster(2)


def _c19_run(num_items: int) -> dict[str, list[int]]:
    """`from_tensor_slices` over `num_items` random 64-byte strings, batched on the
    workers (64 KiB batches), read for 3 epochs from LocalCluster(2) in OFF mode
    (each worker reads the whole source each epoch) over gRPC (no shared-memory
    ring resident in the workers); worker RSS after each epoch."""
    batch = 1024
    source = np.frombuffer(np.random.default_rng(19).bytes(num_items * 64), dtype="S64")
    first_of_batch = {bytes(source[i]): i for i in range(0, num_items, batch)}
    after: list[int] = []
    with c19_cluster() as c:
        dataset = dist(
            ds.Dataset.from_tensor_slices(source).batch(batch),
            c.target,
            data_transfer_protocol="grpc",
        )
        for _ in range(3):
            n = 0
            for b in dataset:
                i = first_of_batch[bytes(b[0])]
                assert np.array_equal(b, source[i : i + batch])
                n += len(b)
            assert n == 2 * num_items
            after.append(rss(c.worker_pids))
    return {"rss_after_epoch": after, "source_bytes": [source.nbytes]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "num_items", [1_000_000, pytest.param(2_000_000, marks=pytest.mark.slow)], ids=["1M", "2M"]
)
def test_c19_worker_memory_stays_flat_across_epochs(num_items):
    result = _c19_run(num_items)
    first, _, third = result["rss_after_epoch"]
    growth = (third - first) / first
    assert growth < 0.10, f"worker RSS grew {growth:.1%} from epoch 1 to 3: {result}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "num_items", [1_000_000, pytest.param(2_000_000, marks=pytest.mark.slow)], ids=["64MB", "128MB"]
)
def test_c19_big_source_is_not_copied_once_per_worker(num_items):
    # The source's array travels out of band; the dispatcher keeps it in a file
    # that both workers map: one copy of its pages on the host, not one a worker.
    batch = 1024
    source = np.frombuffer(np.random.default_rng(20).bytes(num_items * 64), dtype="S64")
    first_of_batch = {bytes(source[i]): i for i in range(0, num_items, batch)}
    with c19_cluster() as cluster:
        pids = cluster.worker_pids

        def pss() -> int:
            return sum(psutil.Process(p).memory_full_info().pss for p in pids)

        baseline = pss()
        dataset = dist(
            ds.Dataset.from_tensor_slices(source).batch(batch),
            cluster.target,
            data_transfer_protocol="grpc",
        )
        reads = dict.fromkeys(first_of_batch.values(), 0)
        for b in dataset:
            i = first_of_batch[bytes(b[0])]
            assert np.array_equal(b, source[i : i + batch])
            reads[i] += 1
        assert set(reads.values()) == {2}  # OFF: each worker read every batch once
        # The epoch is over: its task buffers go away; the source stays.
        limit = baseline + 1.5 * source.nbytes
        wait_until(
            lambda: pss() < limit,
            10,
            lambda: (
                f"summed worker PSS {(pss() - baseline) >> 20} MiB over the idle workers "
                f"to drop under 1.5 x the {source.nbytes >> 20} MiB source"
            ),
        )


def _maps_file(pid: int, name: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any(line.rstrip().endswith(os.sep + name) for line in f)


@pytest.mark.timeout(90)
def test_c19_only_workers_on_the_dispatchers_host_map_the_source():
    # A worker on the dispatcher's host maps the dispatcher's file of the source
    # (named by its SHA-256); one on another host gets the bytes inline.
    source = np.arange(1 << 18, dtype=np.int64)  # 2 MiB: out of band
    file_name = hashlib.sha256(source.tobytes()).hexdigest()
    with ds.DispatchServer() as dispatcher:
        address = dispatcher.target.split("://")[1]
        local, remote = start_workers(address, free_ports(2), [None, "remote-host-c19"])
        try:
            dataset = tagged(ds.Dataset.from_tensor_slices(source).batch(1 << 15))
            got = by_pid(values(dist(dataset, dispatcher.target, target_workers="ANY")))
            expected = [list(range(i, i + (1 << 15))) for i in range(0, 1 << 18, 1 << 15)]
            assert got == {local.pid: expected, remote.pid: expected}
            assert _maps_file(local.pid, file_name)
            assert not _maps_file(remote.pid, file_name)
        finally:
            for w in (local, remote):
                w.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["stopped", "sigkilled"])
def test_c19_local_cluster_leaves_no_buffer_files_behind(how):
    def private_dirs(pid: int) -> list[str]:
        return glob.glob(os.path.join(tempfile.gettempdir(), f"dataservice-dispatcher-{pid}-*"))

    source = np.arange(1 << 18, dtype=np.int64)
    with ds.LocalCluster(1) as cluster:
        ds.register_dataset(cluster.target, ds.Dataset.from_tensor_slices(source))
        pid = cluster.dispatcher_pid
        (made,) = private_dirs(pid)
        assert os.listdir(made) == [hashlib.sha256(source.tobytes()).hexdigest()]
        if how == "sigkilled":  # no chance to delete its directory itself
            os.kill(pid, signal.SIGKILL)

            def dead() -> bool:
                try:
                    return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    return True

            wait_until(dead, 10, "the dispatcher to die")
            assert os.path.isdir(made)
    assert private_dirs(pid) == []
