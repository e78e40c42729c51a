"""SIGKILL either end of a shared-memory ring (TRANSPORT.md §8, C-16, C-23):
the survivor gets every complete element published before the kill, then
`UnavailableError` within a second; afterwards the fd count and /dev/shm are
back to baseline and the next start works. 3 rounds by default, 20 under
`-m slow`; every test has a watchdog (pytest-timeout)."""

from __future__ import annotations

import os
import random
import signal
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

pytestmark = pytest.mark.timeout(240)

_PRODUCER = textwrap.dedent(
    """
    import socket, sys
    import numpy as np
    from dataservice import _core
    sock = socket.socket(fileno=int(sys.argv[1]))
    ring = _core.ShmRingProducer(4 << 20)
    socket.send_fds(sock, [b"ring"], [ring.fileno()])
    ring.set_peer(sock.fileno(), None)
    rng = np.random.default_rng(int(sys.argv[2]))
    seq = 0
    while True:
        payload = rng.integers(0, 256, size=int(rng.integers(8, 3 << 20)), dtype=np.uint8)
        crc = np.uint32(_core.crc32c(payload.tobytes()))
        seq += ring.put_many([(np.int64(seq), crc, payload)], 60_000)
    """
)

_CONSUMER = textwrap.dedent(
    """
    import socket, sys
    from dataservice import _core
    sock = socket.socket(fileno=int(sys.argv[1]))
    _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    ring = _core.ShmRingConsumer(fds[0], control_fd=sock.fileno())
    held = []
    while True:
        els, _, _, _ = ring.get_many(8, 60_000)
        held.extend(els)  # hold every view
        if len(held) > 20:
            print("holding", flush=True)
    """
)


def _baseline() -> tuple[int, set[str]]:
    return len(os.listdir("/proc/self/fd")), set(os.listdir("/dev/shm"))


def _assert_back_to(baseline: tuple[int, set[str]]) -> None:
    deadline = time.monotonic() + 5
    while True:
        fds, shm = _baseline()
        if fds <= baseline[0] and shm <= baseline[1]:
            return
        if time.monotonic() > deadline:
            new = shm - baseline[1]
            raise AssertionError(f"fds {baseline[0]} -> {fds}, new in /dev/shm: {new}")
        time.sleep(0.05)


def _kill_producer_round(seed: int) -> int:
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = subprocess.Popen(
        [sys.executable, "-c", _PRODUCER, str(there.fileno()), str(seed)], pass_fds=[there.fileno()]
    )
    there.close()
    try:
        _, fds, _, _ = socket.recv_fds(here, 16, 1)
        ring = _core.ShmRingConsumer(fds[0], control_fd=here.fileno(), pid=child.pid)
        os.close(fds[0])
        expect = 0
        kill_after = random.Random(seed).randint(3, 30)
        killed_at = None
        while True:
            try:
                els, _, _, _ = ring.get_many(4, 10_000)
            except errors.UnavailableError as err:
                assert killed_at is not None, err
                assert time.monotonic() - killed_at < 1.0
                break
            for seq, crc, payload in els:
                assert int(seq) == expect, "every complete element, in order"
                assert _core.crc32c(payload.tobytes()) == int(crc), "intact"
                expect += 1
            if killed_at is None and expect >= kill_after:
                child.send_signal(signal.SIGKILL)  # most likely mid-write of a large element
                killed_at = time.monotonic()
        ring.close()
        return expect
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(10)  # no zombie
        here.close()


def _kill_consumer_round(seed: int) -> None:
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ring = _core.ShmRingProducer(1 << 20)
    child = subprocess.Popen(
        [sys.executable, "-c", _CONSUMER, str(there.fileno())],
        pass_fds=[there.fileno()],
        stdout=subprocess.PIPE,
        text=True,
    )
    there.close()
    try:
        socket.send_fds(here, [b"ring"], [ring.fileno()])
        ring.set_peer(here.fileno(), child.pid)
        rng = np.random.default_rng(seed)
        killed_at = None
        holding = threading.Event()
        threading.Thread(
            target=lambda: child.stdout.readline() and holding.set(), daemon=True
        ).start()
        while True:
            element = rng.integers(0, 256, size=int(rng.integers(8, 300_000)), dtype=np.uint8)
            try:
                ring.put_many([element], 100)
            except errors.UnavailableError:
                assert killed_at is not None
                assert time.monotonic() - killed_at < 1.0
                break
            if killed_at is None and holding.is_set():
                child.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(10)
        child.stdout.close()
        ring.close()
        here.close()


def _slow(request) -> bool:
    expr = request.config.getoption("-m") or ""
    return "slow" in expr and "not slow" not in expr


def _rounds(request) -> int:
    return 20 if _slow(request) else 3


def test_sigkill_producer_mid_write(request):
    baseline = _baseline()
    for seed in range(_rounds(request)):
        assert _kill_producer_round(seed) >= 3
    _assert_back_to(baseline)
    assert _kill_producer_round(99) >= 3  # the next start works


def test_sigkill_consumer_holding_views(request):
    baseline = _baseline()
    for seed in range(_rounds(request)):
        _kill_consumer_round(seed)
    _assert_back_to(baseline)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_loops_twenty_times(request):
    baseline = _baseline()
    for seed in range(20):
        _kill_producer_round(seed)
        _kill_consumer_round(seed)
    _assert_back_to(baseline)


_CLIENT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import dataservice as ds
    d = ds.Dataset.range(10**9).map(lambda x: np.full(100_000, x % 251, np.uint8))
    d = d.apply(ds.distribute(ds.ShardingPolicy.OFF, sys.argv[1]))  # auto: shm here
    for i, x in enumerate(d):
        if i == 20:
            print("streaming", flush=True)
    """
)


def _worker_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(300)
def test_c16_sigkill_clients_and_workers_of_a_local_cluster(request):
    """C-16: kill a streaming client (the worker frees its ring and fds) or a
    worker (the client reads on from the other one); then everything is back
    to baseline and a new stream works."""
    rounds = 20 if _slow(request) else 2
    baseline = _baseline()
    with ds.LocalCluster(num_workers=2) as cluster:
        warm = ds.Dataset.range(10).apply(ds.distribute(ds.ShardingPolicy.OFF, cluster.target))
        assert len(list(warm)) == 20
        worker_fds = {pid: _worker_fds(pid) for pid in cluster.worker_pids}
        for r in range(rounds):
            client = subprocess.Popen(
                [sys.executable, "-c", _CLIENT, cluster.target],
                stdout=subprocess.PIPE,
                text=True,
                # A process the cluster did not start needs its token (SECURITY.md).
                env={**os.environ, "DATASERVICE_AUTH_TOKEN": cluster.auth_token},
            )
            assert client.stdout.readline().startswith("streaming")
            if r != 1:
                client.send_signal(signal.SIGKILL)
                client.wait(10)
            else:
                victim = random.Random(r).choice(cluster.worker_pids)
                os.kill(victim, signal.SIGKILL)
                time.sleep(0.5)
                client.send_signal(signal.SIGKILL)
                client.wait(10)
            client.stdout.close()
        # Surviving workers freed the dead clients' rings and sockets.
        deadline = time.monotonic() + 10
        for pid, before in worker_fds.items():
            if not _alive(pid):
                continue
            while _worker_fds(pid) > before + 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _worker_fds(pid) <= before + 2
    # The next start with the same config works.
    with ds.LocalCluster(num_workers=2) as cluster:
        again = ds.Dataset.range(100).apply(
            ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, data_transfer_protocol="shm")
        )
        assert sorted(int(x) for x in again) == list(range(100))
    _assert_back_to(baseline)


_CLUSTER_OWNER = textwrap.dedent(
    """
    import numpy as np
    import dataservice as ds
    c = ds.LocalCluster(num_workers=2)
    c.__enter__()
    print(" ".join(map(str, c.worker_pids)), flush=True)
    d = ds.Dataset.range(10**9).map(lambda x: np.full(100_000, 1, np.uint8))
    for i, _ in enumerate(d.apply(ds.distribute(ds.ShardingPolicy.OFF, c.target))):
        if i == 50:
            print("streaming", flush=True)
    """
)


def test_c23_sigkilled_cluster_owner_leaves_no_workers_or_shm():
    shm_before = set(os.listdir("/dev/shm"))
    owner = subprocess.Popen(
        [sys.executable, "-c", _CLUSTER_OWNER], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert owner.stdout.readline().startswith("streaming")
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + 5
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        assert alive == [], f"workers still alive 5 s after their parent died: {alive}"
        assert set(os.listdir("/dev/shm")) <= shm_before
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        owner.stdout.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
