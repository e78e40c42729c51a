"""The shared-memory transport across processes and through the service:
a multi-process stress test (8 B - 12 MB elements, checksummed, a consumer
holding random views, more than the ring holds), protocol selection and
fallback, errors, and the scenarios C-11, C-13, C-14, C-17, C-25 of
shared/CASES.md."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import dataservice as ds
from dataservice import _core, errors
from dataservice.transfer import base, shm, shm_server

pytestmark = pytest.mark.timeout(180)

OFF = ds.ShardingPolicy.OFF

_STRESS_CONSUMER = textwrap.dedent(
    """
    import json, random, sys
    import numpy as np
    from dataservice import _core
    fd, ctl, hold_bytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    c = _core.ShmRingConsumer(fd, control_fd=ctl)
    rng = random.Random(1)
    held, held_bytes, expect, bad = [], 0, 0, []
    while True:
        els, _, end, err = c.get_many(rng.randint(1, 16), 30_000)
        for e in els:
            seq, crc, payload = int(e["seq"]), int(e["crc"]), e["payload"]
            if seq != expect:
                bad.append(f"seq {seq} where {expect} was expected")
            expect = seq + 1
            if _core.crc32c(payload.tobytes()) != crc:
                bad.append(f"element {seq}: checksum mismatch")
            if rng.random() < 0.3:
                held.append((payload, crc))
                held_bytes += payload.nbytes
            while held_bytes > hold_bytes and held:
                p, _ = held.pop(rng.randrange(len(held)))
                held_bytes -= p.nbytes
        if end or err:
            break
    for p, crc in held:  # views held across detaches are still intact
        if _core.crc32c(p.tobytes()) != crc:
            bad.append("a held view changed")
    print(json.dumps({"count": expect, "bad": bad[:5], "stats": c.stats()}), flush=True)
    """
)


def _element(rng: np.random.Generator, seq: int) -> dict:
    size = int(np.exp(rng.uniform(np.log(8), np.log(12 << 20))))
    payload = rng.integers(0, 256, size=size, dtype=np.uint8)
    if seq % 7 == 3:
        payload = payload[::2]  # non-contiguous: made contiguous on the way
    crc = np.uint32(_core.crc32c(payload.tobytes()))
    return {"seq": np.int64(seq), "crc": crc, "payload": payload}


def _stress(seconds: float, ring_bytes: int, hold_bytes: int) -> dict:
    ring = _core.ShmRingProducer(ring_bytes)
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = subprocess.Popen(
        [sys.executable, "-c", _STRESS_CONSUMER, str(ring.fileno()), str(there.fileno()),
         str(hold_bytes)],
        pass_fds=[ring.fileno(), there.fileno()],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    there.close()
    ring.set_peer(here.fileno(), child.pid)
    rng = np.random.default_rng(0)
    deadline = time.monotonic() + seconds
    seq = 0
    try:
        while time.monotonic() < deadline:
            batch = [_element(rng, seq + k) for k in range(4)]
            put = 0
            while put < len(batch):
                put += ring.put_many(batch[put:], 10_000)
            seq += len(batch)
        assert ring.put_end(30_000)
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        here.close()
        ring.close()
    result = json.loads(out)
    assert result["count"] == seq and result["bad"] == [], result
    return result


def test_multiprocess_stress_with_held_views():
    result = _stress(seconds=4, ring_bytes=16 << 20, hold_bytes=40 << 20)
    assert result["stats"]["leased"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_multiprocess_stress_long():
    result = _stress(seconds=60, ring_bytes=32 << 20, hold_bytes=128 << 20)
    assert result["stats"]["detaches"] > 0


@pytest.mark.benchmark
def test_element_of_many_leaves_costs_about_one_of_the_same_bytes():
    """K8/C-15: 256 leaves of 4 KiB vs one 1 MiB leaf, through the ring.

    A timing ratio, so it is a `benchmark` (off by default: run it with
    `-m benchmark` on a quiet machine): at load average 9-15 it failed on a
    ring that had not changed (0.28 s against a 0.265 s bound)."""

    def rate(element, n=200):
        p = _core.ShmRingProducer(64 << 20)
        c = _core.ShmRingConsumer(p.fileno())
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(n // 10):
                p.put_many([element] * 10, 5000)
                got = 0
                while got < 10:
                    got += len(c.get_many(10, 5000)[0])
            best = min(best, time.perf_counter() - t)
        return best

    one = rate(np.zeros(1 << 20, np.uint8))
    many = rate([np.zeros(4096, np.uint8) for _ in range(256)])
    assert many < 8 * one + 0.05, (many, one)


# ------------------------------------------------------------------ service


def dist(dataset, cluster, mode=OFF, **kw):
    return dataset.apply(ds.distribute(mode, cluster.target, **kw))


def protocols(iterator) -> set[str]:
    return {w["transfer_protocol"] for w in iterator.stats()["workers"].values()}


def test_auto_uses_shm_on_the_same_host(cluster):
    it = iter(dist(ds.Dataset.range(1000), cluster))
    assert [int(x) for x in it] == list(range(1000))
    assert protocols(it) == {"shm"}


@pytest.mark.parametrize("protocol", ["shm", "grpc"])
def test_forced_protocols(cluster, protocol):
    data = ds.Dataset.range(100).map(lambda x: {"a": np.full((300, 300), x, np.int32), "b": x})
    it = iter(dist(data, cluster, data_transfer_protocol=protocol))
    got = list(it)
    assert [int(e["b"]) for e in got] == list(range(100))
    assert all(int(e["a"][299, 299]) == i for i, e in enumerate(got))
    assert protocols(it) == {protocol}


def test_auto_falls_back_to_grpc_with_one_warning(cluster, monkeypatch, caplog):
    monkeypatch.setattr(shm, "_CONNECT_RETRY_S", 0.3)  # a refused connect's retries (3 s)
    monkeypatch.setattr(shm, "shm_socket_name", lambda address: "\0dataservice/nowhere")
    with caplog.at_level(logging.WARNING):
        it = iter(dist(ds.Dataset.range(50), cluster))
        assert [int(x) for x in it] == list(range(50))
    assert protocols(it) == {"grpc"}
    warnings = [r for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warnings) == 1


def test_forced_shm_fails_clearly_when_unavailable(cluster, monkeypatch):
    monkeypatch.setattr(shm, "_CONNECT_RETRY_S", 0.3)  # a refused connect's retries (3 s)
    monkeypatch.setattr(shm, "shm_socket_name", lambda address: "\0dataservice/nowhere")
    with pytest.raises(errors.UnavailableError, match="'shm' cannot reach worker"):
        list(dist(ds.Dataset.range(5), cluster, data_transfer_protocol="shm"))


def test_other_host_uses_grpc(cluster):
    endpoint = base.TaskEndpoint(4000, "w:1", "w:1", "another-host")
    assert base.protocol_candidates(None, endpoint) == ["grpc"]


def test_worker_error_arrives_after_the_elements_before_it(cluster):
    def fail_at_5(x):
        if x == 5:
            raise KeyError("five")
        return x

    got = []
    with pytest.raises(KeyError, match="five"):
        for x in dist(ds.Dataset.range(10).map(fail_at_5), cluster, data_transfer_protocol="shm"):
            got.append(int(x))
    assert got == [0, 1, 2, 3, 4]


def cached(dataset, cluster, trainer_id, **kw):
    return dist(
        dataset,
        cluster,
        job_name="cache",
        cross_trainer_cache=ds.CrossTrainerCache(trainer_id),
        **kw,
    )


def test_cache_worker_error_reaches_every_trainer_after_the_elements_before_it(cluster):
    def fail_at_5(x):
        if x == 5:
            raise KeyError("five")
        return x

    dataset = ds.Dataset.range(10**7).map(fail_at_5).repeat()
    for trainer in ("a", "b"):  # b reads the cached elements, then the cached error
        it = iter(cached(dataset, cluster, trainer, data_transfer_protocol="shm"))
        got = []
        with pytest.raises(KeyError, match="five"):
            for x in it:
                got.append(int(x))
        assert got == [0, 1, 2, 3, 4]
        assert protocols(it) == {"shm"}
        it.close()


def test_cache_reads_fall_back_to_grpc_when_shm_is_unavailable(cluster, monkeypatch):
    monkeypatch.setattr(shm, "shm_socket_name", lambda address: "\0dataservice/nowhere")
    its = [iter(cached(ds.Dataset.range(10**7).repeat(), cluster, t)) for t in "ab"]
    assert [[int(next(it)) for _ in range(10)] for it in its] == [list(range(10))] * 2
    assert [protocols(it) for it in its] == [{"grpc"}] * 2
    for it in its:
        it.close()


def test_the_shm_server_knows_the_worker_only_by_its_transfer_host(make_cluster):
    """The worker hands its "shm" server one frozen TransferHost (address, token,
    process id, shm settings, element_source), and the server serves reads through
    that host's element_source: the worker's own choice of the read's source."""
    cluster = make_cluster(0)
    worker = cluster.add_worker(shm_ring_bytes=1 << 20, shm_allowed_uids=[4242])
    (server,) = [s for s in shm_server.live_servers() if s.host.address == worker.address]
    host = server.host
    assert isinstance(host, base.TransferHost)
    assert not hasattr(server, "worker")
    assert (host.auth_token, host.shm_ring_bytes, host.shm_allowed_uids) == (
        worker.auth_token,
        1 << 20,
        frozenset({4242}),
    )
    assert len(host.worker_uid) == 32  # a new uuid4 hex at each start
    with pytest.raises(dataclasses.FrozenInstanceError):
        host.address = "elsewhere:1"  # type: ignore[misc]
    assert host.element_source(base.ReadRequest(4999), 0.05) is None  # no such task (yet)
    it = iter(dist(ds.Dataset.range(10**7).repeat(), cluster, data_transfer_protocol="shm"))
    assert int(next(it)) == 0
    (task_id,) = worker._tasks
    source = host.element_source(base.ReadRequest(task_id), 1.0)
    assert source is not None and source.gives_back and source.window() is None
    read = source.read(1, 1 << 20, 5.0)
    assert len(read.elements) == 1 and not read.end_of_sequence and read.error is None
    source.give_back(read.elements)  # taken here, never delivered: back to the task
    with pytest.raises(errors.FailedPreconditionError, match="does not use a cross-trainer"):
        host.element_source(base.ReadRequest(task_id, trainer_id="t"), 1.0)
    it.close()


def test_cache_read_of_a_task_without_a_cache_is_a_failed_precondition(cluster):
    it = iter(dist(ds.Dataset.range(10**7).repeat(), cluster))
    assert int(next(it)) == 0
    (worker,) = cluster.workers
    (task_id,) = worker._tasks
    endpoint = base.TaskEndpoint(task_id, worker.address, worker.address, "")
    client = shm.ShmTransferClient(endpoint, trainer_id="t")
    try:
        with pytest.raises(errors.InvalidArgumentError, match="reads for trainer 't'"):
            client.get_elements(1, 1 << 20, 1.0, trainer_id="other")
        with pytest.raises(errors.FailedPreconditionError, match="does not use a cross-trainer"):
            client.get_elements(1, 1 << 20, 1.0, trainer_id="t")
    finally:
        client.close()
        it.close()


def test_zero_copy_can_be_turned_off(cluster, monkeypatch):
    monkeypatch.setenv(shm.ZERO_COPY_ENV, "0")
    data = ds.Dataset.range(5).map(lambda x: np.full(100_000, x, np.uint8))
    got = list(dist(data, cluster, data_transfer_protocol="shm"))
    assert all(g.flags.owndata for g in got)


@pytest.mark.parametrize("zero_copy", [True, False])
def test_zero_copy_option_of_distribute(cluster, zero_copy):
    data = ds.Dataset.range(5).map(lambda x: np.full(100_000, x, np.uint8))
    it = iter(
        data.apply(
            ds.distribute(OFF, cluster.target, data_transfer_protocol="shm", zero_copy=zero_copy)
        )
    )
    got, flags = [], []
    for g in it:
        # a view of the ring owns no memory; a copy is the caller's own (views
        # still held when the ring closes are copied out of it then)
        flags.append(g.flags.owndata)
        got.append(g)
    assert [int(g[0]) for g in got] == [0, 1, 2, 3, 4]
    assert all(int(g.sum()) == 100_000 * i for i, g in enumerate(got))
    assert flags == [not zero_copy] * 5
    assert {w["transfer_protocol"] for w in it.stats()["workers"].values()} == {"shm"}


def test_zero_copy_must_be_a_bool(cluster):
    with pytest.raises(ValueError, match="zero_copy.*'no'"):
        ds.distribute(OFF, cluster.target, zero_copy="no")


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_c14_keeping_small_elements_holds_no_fds(cluster):
    """C-14: keeping 1e5 (1e6 under -m slow) small elements holds no extra fds."""
    n = 100_000
    list(dist(ds.Dataset.range(10), cluster))  # warm up sockets and threads
    before = _fd_count()
    kept = list(dist(ds.Dataset.range(n).map(lambda x: np.full(4, x, np.int32)), cluster))
    assert len(kept) == n and int(kept[-1][0]) == n - 1
    time.sleep(0.5)  # the iteration's connections close
    assert _fd_count() <= before + 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_c14_one_million_elements_under_ulimit_256(tmp_path):
    script = textwrap.dedent(
        """
        import os, resource
        import numpy as np
        import dataservice as ds
        from tests.conftest import InProcessCluster
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        c = InProcessCluster(1)
        try:
            dist = ds.distribute(ds.ShardingPolicy.OFF, c.target, data_transfer_protocol="shm")
            # Warm up: the worker's spare ring and the shm connection a finished
            # iterator keeps for the next one (shm.IDLE_CONNECTION_S) are open
            # before and after, as in the test above.
            assert len(list(ds.Dataset.range(10).apply(dist))) == 10
            d = ds.Dataset.range(1_000_000).map(lambda x: np.full(2, x, np.int32)).apply(dist)
            before = len(os.listdir("/proc/self/fd"))
            kept = list(d)
            assert len(kept) == 1_000_000
            after = len(os.listdir("/proc/self/fd"))
            assert after <= before + 2, (before, after)
        finally:
            c.stop()
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=880,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )  # fmt: skip
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_c25_slow_consumer_bounds_bytes_in_flight(make_cluster):
    """C-25: 1 MB elements, a 1 MiB ring (elements chunked), a client sleeping
    0.25 s per element: the ring never holds more than its capacity, and the
    worker never runs far ahead of the client's requests."""
    cluster = make_cluster(0, worker_timeout_ms=10_000)  # big copies under load
    worker = cluster.add_worker(shm_ring_bytes=1 << 20)
    data = ds.Dataset.range(6).map(lambda x: np.full(1_000_000, x, np.uint8))
    got = []
    peak = 0
    for x in dist(data, cluster, data_transfer_protocol="shm"):
        got.append(int(x[0]) if (x == x[0]).all() else -1)
        time.sleep(0.25)
        for server in shm_server.live_servers():
            if server.host.address == worker.address:
                for stats in server.ring_stats():
                    peak = max(peak, stats["buffered_bytes"])
    assert got == list(range(6))
    assert peak <= 1 << 20


def test_c17_element_larger_than_the_ring_streams_in_chunks(make_cluster):
    """C-17 (scaled down; 2.5 GiB under -m slow): one 300 MB element through a
    16 MiB ring arrives intact."""
    _big_element(make_cluster, 300 << 20, 16 << 20)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_c17_element_of_2_5_gib(make_cluster):
    _big_element(make_cluster, int(2.5 * (1 << 30)), 256 << 20)


def _big_element(make_cluster, nbytes: int, ring_bytes: int) -> None:
    cluster = make_cluster(0, worker_timeout_ms=10_000)  # big copies under load
    cluster.add_worker(shm_ring_bytes=ring_bytes)

    def make(_):
        a = np.empty(nbytes, np.uint8)
        a[::4096] = 7
        a[-1] = 9
        return a

    (got,) = list(dist(ds.Dataset.range(1).map(make), cluster, data_transfer_protocol="shm"))
    assert got.nbytes == nbytes and got[0] == 7 and got[-1] == 9 and got[4096 * 5] == 7


_SMALL_SHM_SCRIPT = textwrap.dedent(
    """
    import numpy as np, subprocess, sys
    import dataservice as ds
    free = subprocess.run(["df", "-B1", "--output=avail", "/dev/shm"], capture_output=True,
                          text=True).stdout.split()[-1]
    assert int(free) <= 64 << 20, free
    n_elements = int(sys.argv[1])
    options = dict(shm_ring_bytes=int(sys.argv[3]))
    with ds.LocalCluster(num_workers=int(sys.argv[2]), worker_options=options) as c:
        d = ds.Dataset.range(n_elements).map(lambda x: np.full(1 << 20, x % 251, np.uint8))
        it = iter(d.apply(ds.distribute(ds.ShardingPolicy.DYNAMIC, c.target)))
        seen = []
        for x in it:
            assert (x == x[0]).all()
            seen.append(int(x[0]))
        assert len(seen) == n_elements, len(seen)
        print({w["transfer_protocol"] for w in it.stats()["workers"].values()})
    """
)


def _under_small_dev_shm(n_elements: int, workers: int, ring_bytes: int) -> str:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("user and mount namespaces are not available")
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    cmd = (
        "mount -t tmpfs -o size=64m tmpfs /dev/shm && "
        f'{sys.executable} -c "$SCRIPT" {n_elements} {workers} {ring_bytes}'
    )
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, timeout=170,
        cwd=root, env={**os.environ, "SCRIPT": _SMALL_SHM_SCRIPT},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_c11_c13_small_dev_shm_is_no_problem():
    """C-11/C-13: under a 64 MiB /dev/shm, 2 workers with 256 MiB rings stream
    256 MB of 1 MB elements correctly over shm (memfd rings are not in /dev/shm)."""
    out = _under_small_dev_shm(256, 2, 256 << 20)
    assert "shm" in out


@pytest.mark.slow
def test_c13_local_cluster_4_streams_1_gb_under_64_mib_dev_shm():
    out = _under_small_dev_shm(1000, 4, 64 << 20)
    assert "shm" in out


def test_ring_budget_halves_then_refuses():
    """Past the memory cap, new rings are halved (floor 8 MiB), then refused
    (and "auto" clients fall back to gRPC)."""
    server = shm_server.ShmTransferServer.__new__(shm_server.ShmTransferServer)
    server._ring_bytes = 16 << 20
    server._budget = 30 << 20
    server._ring_total = 0
    server._mu = threading.Lock()
    a, size_a = server.create_ring()
    b, size_b = server.create_ring()
    assert (size_a, size_b) == (16 << 20, 8 << 20)
    with pytest.raises(errors.ResourceExhaustedError, match="budget"):
        server.create_ring()
    a.close()
    server.release_ring(size_a)
    c, size_c = server.create_ring()
    assert size_c == 16 << 20
    b.close()
    c.close()


def test_first_element_waits_for_every_worker_to_connect(cluster2, monkeypatch):
    """A consumer's first elements come from every worker, not all from the one
    whose shared-memory handshake finished first: next() starts once each task
    has tried to connect (at most reader._START_WAIT_S)."""
    from dataservice.client import reader as reader_module

    slow = cluster2.workers[1].address
    real_init = shm.ShmTransferClient.__init__

    def init(self, endpoint, *args, **kwargs):
        if endpoint.worker_address == slow:
            time.sleep(0.3)  # a slow handshake
        real_init(self, endpoint, *args, **kwargs)

    monkeypatch.setattr(shm.ShmTransferClient, "__init__", init)
    it = iter(dist(ds.Dataset.range(100), cluster2, data_transfer_protocol="shm"))
    t0 = time.monotonic()
    first = int(next(it))
    waited = time.monotonic() - t0
    tasks = list(it._reader._tasks.values())
    assert first == 0 and len(tasks) == 2
    assert all(t.tried for t in tasks)
    # It waited for the slow handshake, and not for long after it (a loaded
    # machine adds its own delay: the bound is well under the 4 s task wait).
    assert 0.25 < waited < reader_module._START_WAIT_S + 2.0, waited
    rest = [int(x) for x in it]
    assert sorted([first, *rest]) == sorted(2 * list(range(100)))  # OFF: a copy per worker
    assert {w["transfer_protocol"] for w in it.stats()["workers"].values()} == {"shm"}


class _Leaf:
    """Pickles unless told not to."""

    def __init__(self, ok):
        self.ok = ok

    def __reduce__(self):
        if not self.ok:
            raise TypeError("cannot pickle this leaf")
        return (_Leaf, (True,))


def test_unencodable_element_is_a_worker_error_not_a_lost_worker(cluster):
    data = ds.Dataset.range(3).map(lambda x: (x, _Leaf(int(x) != 2)))
    got = []
    with pytest.raises(TypeError, match="cannot pickle this leaf"):
        read = dist(data, cluster, data_transfer_protocol="shm", allow_pickled_elements=True)
        for x, _ in read:
            got.append(int(x))
    assert got == [0, 1]


_CGROUP_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import dataservice as ds
    from dataservice import _core, errors
    from tests.conftest import InProcessCluster
    cg, limit_file = sys.argv[1], sys.argv[2]
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    with open(os.path.join(cg, limit_file), "w") as f:
        f.write(str(100 << 20))
    try:
        _core.ShmRingProducer(256 << 20)
        print("created")
    except errors.ResourceExhaustedError as err:
        assert "268439552 bytes" in str(err), err
        print("refused")
    c = InProcessCluster(0)
    try:
        c.add_worker(shm_ring_bytes=256 << 20)
        d = ds.Dataset.range(2000).map(lambda x: np.full(1000, x, np.int32))
        it = iter(d.apply(ds.distribute(ds.ShardingPolicy.OFF, c.target)))
        assert [int(x[0]) for x in it] == list(range(2000))
        print(sorted({w["transfer_protocol"] for w in it.stats()["workers"].values()}))
    finally:
        c.stop()
    """
)


_CGROUP_GROWTH_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading
    import numpy as np
    from dataservice import _core
    cg, limit_file = sys.argv[1], sys.argv[2]
    usage_file = {"memory.max": "memory.current"}.get(limit_file, "memory.usage_in_bytes")
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))

    def usage():
        with open(os.path.join(cg, usage_file)) as f:
            return int(f.read())

    limit = usage() + (120 << 20)
    with open(os.path.join(cg, limit_file), "w") as f:
        f.write(str(limit))
    p = _core.ShmRingProducer(64 << 20)  # the whole 64 MiB fits the cgroup now
    c = _core.ShmRingConsumer(p.fileno(), nonce=p.nonce, zero_copy=False)
    ballast = np.ones(limit - usage() - (24 << 20), np.uint8)  # then 24 MiB are left
    got = []

    def consume():
        while len(got) < 160:
            out, _, _, err = c.get_many(1, 5000)  # one 250 KB copy at a time
            assert err is None, err
            got.extend(int(x[0]) for x in out)

    t = threading.Thread(target=consume)
    t.start()
    for i in range(160):  # 40 MB, in 250 KB elements
        assert p.put_many([np.full(250_000, i % 256, np.uint8)], 10_000) == 1
    t.join()
    assert got == [i % 256 for i in range(160)], got
    print(p.reserved_bytes >> 20, usage() <= limit)
    """
)


@pytest.mark.timeout(120)
def test_a_ring_short_of_memory_serves_within_what_it_has():
    """A ring allocates its memory as frames first reach it; when the memory cgroup
    cannot give more (whose OOM killer would answer the allocation), the ring runs on
    within what it has, every element delivered: here a 64 MiB ring with 24 MiB left
    to the cgroup stops at 16 MiB (a step to 32 MiB would need 16 MiB more)."""
    out = _run_in_child_memory_cgroup(_CGROUP_GROWTH_SCRIPT)
    reserved_mib, within = out.stdout.split()
    assert int(reserved_mib) in (8, 16), out.stdout
    assert within == "True"


def _child_memory_cgroup() -> tuple[str, str] | None:
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            parent, limit_file = f"/sys/fs/cgroup/memory{path}", "memory.limit_in_bytes"
        elif controllers == "" and os.path.exists(f"/sys/fs/cgroup{path}/memory.max"):
            parent, limit_file = f"/sys/fs/cgroup{path}", "memory.max"
        else:
            continue
        child = os.path.join(parent, f"ds-test-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.mkdir(child)
        except OSError:
            return None
        return child, limit_file
    return None


def _run_in_child_memory_cgroup(script: str) -> subprocess.CompletedProcess:
    """Runs `script` (argv: the cgroup's directory and its limit file, which the
    script writes) in a fresh child memory cgroup of this process's, from the
    repository root, and removes the cgroup after; skips the test where none can be
    made. Fails the test if the script does not exit 0 (an OOM kill is -9)."""
    made = _child_memory_cgroup()
    if made is None:
        pytest.skip("cannot create a memory cgroup here")
    child, limit_file = made
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
        out = subprocess.run(
            [sys.executable, "-c", script, child, limit_file],
            capture_output=True, text=True, timeout=100, cwd=root,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return out
    finally:
        for _ in range(50):
            try:
                os.rmdir(child)
                break
            except OSError:
                time.sleep(0.1)


@pytest.mark.timeout(120)
def test_c11_memory_cgroup_limit_is_a_clear_error_never_a_crash():
    """C-11 for memory: a 256 MiB ring in a 100 MiB memory cgroup is refused with
    ResourceExhaustedError naming the size (fallocate under a full cgroup would
    invoke the OOM killer); a worker asked for 256 MiB rings there still serves,
    with a smaller ring or over gRPC."""
    out = _run_in_child_memory_cgroup(_CGROUP_SCRIPT)
    lines = out.stdout.split("\n")
    assert lines[0] == "refused"
    assert lines[1] in ("['shm']", "['grpc']")
