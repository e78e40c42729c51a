"""Processing-mode scenarios that need in-process servers on 127.0.0.1: a fixed worker list
of which only some workers run (so a read returns exactly their shards), workers added one by
one (port placeholders, refused addresses), fault injection into the cross-trainer cache,
dispatcher and worker internals (task counts, shared-memory servers), host ids set while a
worker registers, and job garbage collection. Each test asserts the exact elements each
consumer (or each worker's shard) sees.

The scenarios that make sense with worker processes too are in `test_modes.py`, run under
both harnesses; `test_modes_processes.py` has those only worker processes can run.
"""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import dataservice as ds
from dataservice import errors
from tests.conftest import to_py, values
from tests.integration.modes_common import (
    DATA,
    DYNAMIC,
    FILE,
    FILE_OR_DATA,
    HINT,
    NUM_FILES,
    cached,
    dist,
    free_ports,
    read_files,
    read_live_shards,
    record,
    registered,
    static_cluster,
    wait_until,
    write_tfrecords,
)


@pytest.fixture(scope="module")
def tfrecords(tmp_path_factory) -> list[str]:
    return write_tfrecords(tmp_path_factory.mktemp("modes-tfrecords"))


# ================================================================ static sharding
# In-process only: a fixed list of which only some workers run, and workers added one by
# one on chosen ports (the processes harness starts a whole fixed list at once).
@pytest.mark.timeout(60)
@pytest.mark.parametrize("index", [0, 1, 2])
def test_data_sharding_worker_keeps_every_nth_element(make_cluster, index):
    c = static_cluster(make_cluster, 3, live=[index])
    assert values(read_live_shards(ds.Dataset.range(20), c, DATA)) == list(range(index, 20, 3))


@pytest.mark.timeout(60)
def test_data_sharding_all_workers_union_is_the_dataset_once(make_cluster):
    c = static_cluster(make_cluster, 3)
    it = iter(dist(ds.Dataset.range(20), c, DATA))
    assert sorted(values(it)) == list(range(20))
    counts = sorted(w["elements"] for w in it.stats()["workers"].values())
    assert counts == [6, 7, 7]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "mode,index", [(FILE, 0), (FILE, 1), (FILE, 2), (FILE_OR_DATA, 1)], ids=str
)
def test_file_sharding_worker_reads_files_i_i_plus_n(make_cluster, tfrecords, mode, index):
    c = static_cluster(make_cluster, 3, live=[index])
    got = read_live_shards(read_files(tfrecords), c, mode)
    assert got == [record(f, r) for f in range(index, NUM_FILES, 3) for r in range(3)]


@pytest.mark.timeout(60)
def test_file_sharding_of_a_tfrecord_file_list(make_cluster, tfrecords):
    c = static_cluster(make_cluster, 3, live=[2])
    got = read_live_shards(ds.TFRecordDataset(tfrecords), c, FILE)
    assert got == [record(f, r) for f in (2, 5) for r in range(3)]


@pytest.mark.timeout(60)
def test_file_sharding_all_workers_union_is_every_record_once(make_cluster, tfrecords):
    c = static_cluster(make_cluster, 3)
    got = list(dist(read_files(tfrecords), c, FILE))
    assert sorted(got) == sorted(record(f, r) for f in range(NUM_FILES) for r in range(3))


@pytest.mark.timeout(60)
def test_file_or_data_without_file_source_falls_back_to_data(make_cluster):
    c = static_cluster(make_cluster, 3, live=[1])
    assert values(read_live_shards(ds.Dataset.range(20), c, FILE_OR_DATA)) == list(range(1, 20, 3))


@pytest.mark.timeout(60)
def test_file_sharding_without_file_source_is_an_error(make_cluster):
    c = static_cluster(make_cluster, 2)
    with pytest.raises(errors.DataServiceError, match="no file source"):
        values(dist(ds.Dataset.range(20), c, FILE))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("index", [0, 2])
def test_hint_placeholder_becomes_num_workers_and_index(make_cluster, tfrecords, index):
    c = static_cluster(make_cluster, 3, live=[index])
    by_elements = ds.Dataset.range(20).shard(ds.SHARD_HINT, ds.SHARD_HINT)
    assert values(read_live_shards(by_elements, c, HINT)) == list(range(index, 20, 3))
    files = ds.Dataset.list_files(tfrecords, shuffle=False).shard(ds.SHARD_HINT, ds.SHARD_HINT)
    by_files = files.flat_map(lambda f: ds.TFRecordDataset(f))
    got = read_live_shards(by_files, c, HINT)
    assert got == [record(f, r) for f in range(index, NUM_FILES, 3) for r in range(3)]


@pytest.mark.timeout(60)
def test_hint_without_placeholder_is_a_no_op(make_cluster):
    c = static_cluster(make_cluster, 3, live=[1])
    assert values(read_live_shards(ds.Dataset.range(6), c, HINT)) == list(range(6))


@pytest.mark.timeout(60)
def test_fewer_files_than_workers_names_both_counts(make_cluster, tfrecords):
    c = static_cluster(make_cluster, 3)
    with pytest.raises(errors.DataServiceError, match=r"not enough files.*2 files for 3 workers"):
        values(dist(read_files(tfrecords[:2]), c, FILE))


@pytest.mark.timeout(60)
def test_static_sharding_without_worker_list_is_an_error(cluster):
    with pytest.raises(errors.InvalidArgumentError, match="needs a fixed worker list"):
        values(dist(ds.Dataset.range(5), cluster, FILE_OR_DATA))


@pytest.mark.timeout(60)
def test_worker_not_in_the_list_is_refused_naming_it(make_cluster):
    (port,) = free_ports(1)
    c = make_cluster(0, worker_addresses=["127.0.0.1:1"])
    worker = c.add_worker(port=port, worker_address=f"127.0.0.1:{port}")
    assert not worker.wait_registered(10)
    with pytest.raises(errors.InvalidArgumentError, match=f"127.0.0.1:{port}.*not in"):
        worker.join()


@pytest.mark.timeout(60)
def test_port_placeholders_give_each_worker_its_own_index(make_cluster):
    c = make_cluster(0, worker_addresses=["127.0.0.1:%port%", "127.0.0.1:%port%"])
    for port in free_ports(2):
        c.add_worker(port=port, worker_address=f"127.0.0.1:{port}")
    registered(c)
    assert sorted(values(dist(ds.Dataset.range(10), c, DATA))) == list(range(10))


# ================================================================ cross-trainer cache
# In-process only: fault injection into the cache, and the worker's shm servers and cache
# slots read directly.
INFINITE = ds.Dataset.range(10**7).repeat()


def cache_cluster(make_cluster, size=None):
    c = make_cluster(0)
    c.add_worker(**({"cross_trainer_cache_size_bytes": size} if size else {}))
    return registered(c)


@pytest.mark.timeout(60)
def test_cache_trainers_arriving_together_both_see_every_element(make_cluster, monkeypatch):
    """Two trainers at the head of an empty window both ask the cache to fill
    it. Only one may pull from the pipeline: were both to pull up to 64
    elements, the window (room for 100) would overflow and evict elements
    neither trainer has read (trainer b would start at 28, not 0)."""
    from dataservice.worker.cross_trainer_cache import CrossTrainerCache as Cache

    c = cache_cluster(make_cluster, 100 * 800)  # room for 100 elements of 800 B
    extend = Cache._extend
    together = threading.Barrier(2, timeout=10)
    mu = threading.Lock()
    held: list[int] = []  # the window end each held fill saw
    broken: list[BaseException] = []

    def extend_together(self, seen_end_index, timeout_s):
        # Fault injection: hold the first two fills until both trainers are in
        # `_extend` at the head, and the task has 200 elements ready (as a fast
        # pipeline would), then let both go at once.
        with mu:
            hold = len(held) < 2
            if hold:
                held.append(seen_end_index)
        if hold:
            try:
                together.wait()
            except threading.BrokenBarrierError as err:
                broken.append(err)
            deadline = time.monotonic() + 5
            while len(self._runner._buffer) < 200 and time.monotonic() < deadline:
                time.sleep(0.01)
        return extend(self, seen_end_index, timeout_s)

    monkeypatch.setattr(Cache, "_extend", extend_together)
    dataset = ds.Dataset.range(10**7).map(lambda i: np.full(100, i, np.int64)).repeat()
    a, b = iter(cached(dataset, c, "a")), iter(cached(dataset, c, "b"))
    # Both trainers' first next() at once: a reader asks for nothing before it.
    first: dict[str, int] = {}
    starts = [
        threading.Thread(target=lambda n=n, it=it: first.update({n: int(next(it)[0])}))
        for n, it in (("a", a), ("b", b))
    ]
    for t in starts:
        t.start()
    for t in starts:
        t.join()
    got_a = [first["a"]] + [int(next(a)[0]) for _ in range(39)]
    got_b = [first["b"]] + [int(next(b)[0]) for _ in range(39)]
    a.close()
    b.close()
    # The race happened: both trainers were filling an empty window together.
    assert (held, broken) == ([0, 0], [])
    assert (got_a, got_b) == (list(range(40)), list(range(40)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", [None, "grpc"])
def test_cache_same_host_trainers_read_through_shared_memory(make_cluster, protocol):
    # "auto": every same-host trainer reads the cached window from the one
    # shared-memory segment it lives in (a connection and a hold slot a trainer,
    # no ring); data_transfer_protocol="grpc" still forces gRPC.
    from dataservice.transfer import shm_server

    c = cache_cluster(make_cluster)
    its = [
        iter(cached(INFINITE, c, f"trainer-{t}", data_transfer_protocol=protocol)) for t in range(3)
    ]
    got: list[list[int]] = [[], [], []]
    for _ in range(25):  # in lockstep
        for t, it in enumerate(its):
            got[t].append(to_py(next(it)))
    late = iter(cached(INFINITE, c, "late", data_transfer_protocol=protocol))
    got.append([to_py(next(late)) for _ in range(25)])  # a newcomer starts at the oldest
    its.append(late)
    (worker,) = c.workers
    rings = [
        r
        for s in shm_server.live_servers()
        if s.host.address == worker.address
        for r in s.ring_stats()
    ]
    (task,) = worker._tasks.values()
    attached = task.cross_trainer_cache.stats()["attached_slots"]
    protocols = []
    for it in its:
        (stats,) = it.stats()["workers"].values()
        protocols.append(stats["transfer_protocol"])
        it.close()
    assert got == [list(range(25))] * 4
    assert rings == []
    if protocol is None:
        assert protocols == ["shm"] * 4
        assert len(attached) == 4  # each maps the window's segment
    else:
        assert protocols == ["grpc"] * 4
        assert attached == []


# ================================================================ local reads on several hosts
# In-process only: each worker's host id is the environment's while it registers
# (test_modes_processes.py runs worker processes with host ids of their own).
HOSTS = ["host-a", "host-a", "host-b", "host-b"]  # of the workers, by index


def two_host_cluster(make_cluster, monkeypatch, **kw):
    """A fixed list of 4 in-process workers: 0 and 1 register from host-a, 2
    and 3 from host-b (DATASERVICE_HOST_ID while each registers: the
    dispatcher keeps the host id a worker registered with)."""
    ports = free_ports(len(HOSTS))
    addresses = [f"127.0.0.1:{p}" for p in ports]
    c = make_cluster(0, worker_addresses=addresses, **kw)
    for port, address, host in zip(ports, addresses, HOSTS, strict=True):
        monkeypatch.setenv("DATASERVICE_HOST_ID", host)
        assert c.add_worker(port=port, worker_address=address).wait_registered(10), address
    return registered(c)


def read_on(host: str, monkeypatch, dataset):
    """An iterator of `dataset` whose consumer is on `host` (its client says so
    to the dispatcher when it starts). gRPC only: the in-process workers'
    shared-memory endpoints depend on the host id of the moment."""
    monkeypatch.setenv("DATASERVICE_HOST_ID", host)
    return iter(dataset)


def elements_by_worker(it) -> dict[str, int]:
    return {a: w["elements"] for a, w in it.stats()["workers"].items() if w["elements"]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["AUTO", "LOCAL"])
def test_static_sharding_named_job_on_two_hosts_each_reads_its_own_workers_shards(
    make_cluster, monkeypatch, target
):
    # One job, a consumer on each host: each reads the shards of its own host's
    # workers (worker i keeps i, i + 4, ...), whether it joins while the other
    # host reads or after; a third host with no worker is refused, naming it.
    c = two_host_cluster(make_cluster, monkeypatch)
    addresses = c.dispatcher_config.worker_addresses

    def job():
        return dist(
            ds.Dataset.range(40),
            c,
            DATA,
            job_name="hosts",
            target_workers=target,
            data_transfer_protocol="grpc",
        )

    a = read_on("host-a", monkeypatch, job())
    got_a = [to_py(next(a))]
    b = read_on("host-b", monkeypatch, job())  # joins while host-a reads
    got_a += values(a)
    got_b = values(b)
    assert sorted(got_a) == [x for x in range(40) if x % 4 in (0, 1)]
    assert sorted(got_b) == [x for x in range(40) if x % 4 in (2, 3)]
    assert elements_by_worker(a) == {addresses[0]: 10, addresses[1]: 10}
    assert elements_by_worker(b) == {addresses[2]: 10, addresses[3]: 10}
    late = read_on("host-b", monkeypatch, job())  # host-b's part was read to its end
    assert values(late) == []
    with pytest.raises(errors.InvalidArgumentError, match=r"4 workers are registered") as info:
        read_on("host-c", monkeypatch, job())
    assert "none on the client's host (host-c)" in str(info.value)


@pytest.mark.timeout(60)
def test_local_off_named_job_on_two_hosts_each_reads_a_copy_per_own_worker(
    make_cluster, monkeypatch
):
    # LOCAL with OFF: each host's consumer gets a full copy from each of its own
    # two workers, host-b's after host-a's part ended; once both let go the job
    # is collected, and the name starts over (host-b reads its copies again).
    c = two_host_cluster(
        make_cluster, monkeypatch, job_gc_check_interval_ms=100, job_gc_timeout_ms=300
    )
    addresses = c.dispatcher_config.worker_addresses

    def job():
        return dist(
            ds.Dataset.range(5),
            c,
            job_name="copies",
            target_workers="LOCAL",
            data_transfer_protocol="grpc",
        )

    a = read_on("host-a", monkeypatch, job())
    assert sorted(values(a)) == sorted(2 * list(range(5)))
    assert elements_by_worker(a) == {addresses[0]: 5, addresses[1]: 5}
    b = read_on("host-b", monkeypatch, job())
    assert sorted(values(b)) == sorted(2 * list(range(5)))
    assert elements_by_worker(b) == {addresses[2]: 5, addresses[3]: 5}
    wait_until(lambda: c.dispatcher._state.live_job_named("copies") is None, 10, "job GC")
    wait_until(lambda: all(w.num_tasks() == 0 for w in c.workers), 10, "tasks to stop")
    again = read_on("host-b", monkeypatch, job())
    assert sorted(values(again)) == sorted(2 * list(range(5)))
    assert elements_by_worker(again) == {addresses[2]: 5, addresses[3]: 5}


@pytest.mark.timeout(60)
def test_local_dynamic_named_job_on_two_hosts_each_element_once(make_cluster, monkeypatch):
    # DYNAMIC splits are the iteration's: consumers on the two hosts read their
    # own workers, and together see each element once.
    c = two_host_cluster(make_cluster, monkeypatch)
    addresses = c.dispatcher_config.worker_addresses

    def job():
        return dist(
            ds.Dataset.range(200),
            c,
            DYNAMIC,
            job_name="splits",
            target_workers="LOCAL",
            data_transfer_protocol="grpc",
        )

    readers = {"host-a": read_on("host-a", monkeypatch, job())}
    readers["host-b"] = read_on("host-b", monkeypatch, job())
    its = dict(readers)
    got: dict[str, list] = {"host-a": [], "host-b": []}
    while readers:  # in turns
        for host, it in list(readers.items()):
            try:
                got[host].append(to_py(next(it)))
            except StopIteration:
                del readers[host]
    assert sorted(got["host-a"] + got["host-b"]) == list(range(200))
    assert set(elements_by_worker(its["host-a"])) <= set(addresses[:2])
    assert set(elements_by_worker(its["host-b"])) <= set(addresses[2:])


# ================================================================ job GC
# In-process only: the workers' task counts read directly (test_modes_processes.py
# measures worker memory instead).
@pytest.mark.timeout(60)
def test_gc_abandoned_named_job_stops_its_tasks_and_frees_the_name(make_cluster):
    c = registered(make_cluster(1, job_gc_check_interval_ms=100, job_gc_timeout_ms=300))
    worker = c.workers[0]
    dataset = dist(ds.Dataset.range(10**6), c, job_name="gc")
    it = iter(dataset)
    assert [to_py(next(it)) for _ in range(3)] == [0, 1, 2]
    assert worker.num_tasks() == 1
    del it
    gc.collect()
    took = wait_until(lambda: worker.num_tasks() == 0, 10, "the abandoned job's task to stop")
    assert took < 5
    # The name is free again: a new job from the start.
    again = iter(dist(ds.Dataset.range(10**6), c, job_name="gc"))
    assert [to_py(next(again)) for _ in range(3)] == [0, 1, 2]
    again.close()


@pytest.mark.timeout(60)
def test_gc_keeps_a_job_whose_consumer_is_alive(make_cluster):
    c = registered(make_cluster(1, job_gc_check_interval_ms=100, job_gc_timeout_ms=300))
    worker = c.workers[0]
    live = iter(dist(ds.Dataset.range(200), c, job_name="live"))
    first = [to_py(next(live)) for _ in range(5)]
    idle = iter(dist(ds.Dataset.range(10**6), c, job_name="idle"))
    next(idle)
    wait_until(lambda: worker.num_tasks() == 2, 10, "two tasks")
    del idle
    gc.collect()
    # Once the abandoned job is collected, the GC has run past its timeout while the
    # live consumer sat idle: its job must have been kept.
    wait_until(lambda: worker.num_tasks() == 1, 10, "the abandoned job to be collected")
    assert first + values(live) == list(range(200))


@pytest.mark.timeout(60)
def test_anonymous_job_tasks_stop_when_its_iterator_closes(cluster2):
    it = iter(dist(ds.Dataset.range(10**6), cluster2))
    next(it)
    wait_until(lambda: all(w.num_tasks() == 1 for w in cluster2.workers), 10, "tasks")
    it.close()
    wait_until(lambda: all(w.num_tasks() == 0 for w in cluster2.workers), 5, "tasks to stop")
