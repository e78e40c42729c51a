"""The cross-trainer cache's window as one shared-memory segment (issue 4):
same-host trainers read the frames the worker wrote once, leasing large leaves
as views; a lagging trainer skips to the oldest cached element; a hoarding
trainer does not stall the others; a SIGKILLed trainer leaves nothing behind.

The trainers here are `ShmTransferClient`s made directly (one per trainer id),
so the tests can hold views, interleave reads and look at the worker's cache.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import dataservice as ds
from dataservice.transfer import base, shm

pytestmark = pytest.mark.timeout(120)

ELEMENT = 16384  # float32s: 64 KiB, leased


def big(i):
    return {"i": i, "x": np.full(ELEMENT, i, np.float32)}


def cached_task(make_cluster, cache_bytes: int, dataset=None):
    """A cached job's task on an in-process worker: (iterator keeping the job
    alive, the worker's cache, the task's endpoint)."""
    cluster = make_cluster(0)
    worker = cluster.add_worker(cross_trainer_cache_size_bytes=cache_bytes)
    dataset = dataset or ds.Dataset.range(10**9).map(big).repeat()
    it = iter(
        dataset.apply(
            ds.distribute(
                ds.ShardingPolicy.OFF,
                cluster.target,
                job_name="window",
                cross_trainer_cache=ds.CrossTrainerCache("boot"),
            )
        )
    )
    next(it)
    (task_id,) = worker._tasks
    cache = worker._tasks[task_id].cross_trainer_cache
    assert cache.shared
    return it, cache, base.TaskEndpoint(task_id, worker.address, worker.address, "")


def consecutive(xs: list[int]) -> bool:
    return xs == list(range(xs[0], xs[0] + len(xs)))


def read_n(client, trainer_id, n):
    """Exactly `n` elements (a read returns what is cached now, at least one)."""
    out = []
    while len(out) < n:
        out.extend(read(client, trainer_id, n - len(out)))
    return out


def read(client, trainer_id, n=8):
    return client.get_elements(n, 1 << 30, 10.0, trainer_id=trainer_id).elements


def test_trainers_see_the_same_elements_in_order_from_one_copy(make_cluster):
    it, cache, endpoint = cached_task(make_cluster, 8 << 20)
    clients = {t: shm.ShmTransferClient(endpoint, trainer_id=t) for t in "abc"}
    try:
        got = {t: [] for t in clients}
        while min(len(g) for g in got.values()) < 300:
            for t, c in clients.items():  # interleaved, each at its own pace
                for e in read(c, t, 1 + len(t) * 3):
                    assert np.all(e["x"] == e["i"])
                    got[t].append(int(e["i"]))
        n = min(len(g) for g in got.values())
        assert consecutive(got["a"])
        assert all(g[:n] == got["a"][:n] for g in got.values())
        for c in clients.values():
            assert c.stats()["leased"] > 0  # views, not copies
        stats = cache.stats()
        # Each element was written into the segment once, for all trainers.
        assert stats["frames_written"] <= max(len(g) for g in got.values()) + 64 + 1
    finally:
        for c in clients.values():
            c.close()
        it.close()


def test_views_are_writeable_and_private_to_their_trainer(make_cluster):
    it, cache, endpoint = cached_task(make_cluster, 8 << 20)
    a = shm.ShmTransferClient(endpoint, trainer_id="a")
    b = shm.ShmTransferClient(endpoint, trainer_id="b")
    try:
        ea, eb = read_n(a, "a", 4), read_n(b, "b", 4)
        assert [int(e["i"]) for e in ea] == [int(e["i"]) for e in eb]
        for e in ea:
            e["x"][:] = -1  # a's write stays a's
        assert all(np.all(e["x"] == e["i"]) for e in eb)
        # a third trainer reading the same cached elements sees the originals
        c = shm.ShmTransferClient(endpoint, trainer_id="c")
        try:
            assert all(np.all(e["x"] == e["i"]) for e in read_n(c, "c", 4))
        finally:
            c.close()
    finally:
        a.close()
        b.close()
        it.close()


def test_a_lagging_trainer_skips_to_the_oldest_cached_element(make_cluster):
    it, cache, endpoint = cached_task(make_cluster, 1 << 20)  # ~15 elements
    slow = shm.ShmTransferClient(endpoint, trainer_id="slow")
    fast = shm.ShmTransferClient(endpoint, trainer_id="fast")
    try:
        first = [int(e["i"]) for e in read_n(slow, "slow", 2)]
        assert first == [first[0], first[0] + 1]
        fast_got = []
        while len(fast_got) < 200:
            fast_got.extend(int(e["i"]) for e in read(fast, "fast"))
        assert consecutive(fast_got)
        oldest = cache.stats()["first_index"]
        assert oldest > first[1] + 1
        nxt = [int(e["i"]) for e in read_n(slow, "slow", 3)]
        assert nxt == [oldest, oldest + 1, oldest + 2]
    finally:
        slow.close()
        fast.close()
        it.close()


def test_a_hoarding_trainer_does_not_stall_the_others(make_cluster):
    it, cache, endpoint = cached_task(make_cluster, 1 << 20)
    hoarder = shm.ShmTransferClient(endpoint, trainer_id="hoarder")
    others = {t: shm.ShmTransferClient(endpoint, trainer_id=t) for t in "ab"}
    kept = []
    try:
        got = {t: [] for t in others}
        while min(len(g) for g in got.values()) < 400:
            kept.extend(read(hoarder, "hoarder", 4))  # keeps every element (and view)
            for t, c in others.items():
                got[t].extend(int(e["i"]) for e in read(c, t))
        assert all(consecutive(g) for g in got.values())
        # Every view the hoarder kept still shows its element, after the worker
        # abandoned segments to it or it copied on pressure.
        assert all(np.all(e["x"] == e["i"]) for e in kept)
        stats = hoarder.stats()
        print("HOARD", stats, cache.abandons, cache.stats())
        assert stats["copied_on_pressure"] > 0 or cache.abandons > 0
    finally:
        hoarder.close()
        for c in others.values():
            c.close()
        it.close()
    assert all(np.all(e["x"] == e["i"]) for e in kept)  # views outlive the connection


def test_zero_copy_off_copies_everything(make_cluster):
    it, cache, endpoint = cached_task(make_cluster, 8 << 20)
    c = shm.ShmTransferClient(endpoint, trainer_id="t", zero_copy=False)
    try:
        es = read_n(c, "t", 8)
        assert consecutive([int(e["i"]) for e in es])
        assert c.stats()["leased"] == 0
        assert all(e["x"].flags.owndata for e in es)
    finally:
        c.close()
        it.close()


def test_grpc_and_shm_trainers_read_the_same_window(make_cluster):
    it, cache, endpoint = cached_task(make_cluster, 8 << 20)
    c = shm.ShmTransferClient(endpoint, trainer_id="shm")
    try:
        via_shm = [int(e["i"]) for e in read_n(c, "shm", 20)]
        raw = []
        while len(raw) < 20:  # what GetElements serves
            read = cache.get_elements("grpc", 20 - len(raw), 5.0)
            elements, end, error = read.elements, read.end_of_sequence, read.error
            assert (end, error) == (False, None)
            raw.extend(elements)
        assert consecutive(via_shm)
        assert [int(e["i"]) for e in raw] == via_shm
        assert all(np.all(e["x"] == e["i"]) for e in raw)
    finally:
        c.close()
        it.close()


_HOLDER = textwrap.dedent(
    """
    import sys
    from dataservice.transfer import base, shm
    endpoint = base.TaskEndpoint(int(sys.argv[1]), sys.argv[2], sys.argv[2], "")
    c = shm.ShmTransferClient(endpoint, trainer_id="doomed")
    held = []
    while len(held) < 40:
        held.extend(c.get_elements(8, 1 << 30, 10.0, trainer_id="doomed").elements)
    assert c.stats()["leased"] > 0
    print("holding", flush=True)
    sys.stdin.read()
    """
)


def _fd_targets() -> list[str]:
    """What this process's fds point at, TCP sockets left out: the in-process
    cluster's gRPC channels are TCP and may reconnect at any time; the shm
    transport's connections are Unix sockets (by inode in /proc/net/unix)."""
    with open("/proc/net/unix") as f:
        unix = {fields[6] for fields in map(str.split, list(f)[1:]) if len(fields) > 6}
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:[") or target[8:-1] in unix:
            out.append(target)
    return sorted(out)


def _sockets() -> int:
    return sum(t.startswith("socket:") for t in _fd_targets())


def test_sigkill_of_a_trainer_holding_views_leaves_nothing(make_cluster):
    it, cache, endpoint = cached_task(make_cluster, 1 << 20)
    other = shm.ShmTransferClient(endpoint, trainer_id="other")
    try:
        read(other, "other")
        before = _fd_targets()
        sockets = _sockets()
        attached = cache.stats()["attached_slots"]
        child = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(endpoint.task_id), endpoint.worker_address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            assert child.stdout.readline().strip() == b"holding"
            (doomed_slot,) = set(cache.stats()["attached_slots"]) - set(attached)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.wait(10)
            child.stdin.close()
            child.stdout.close()
        # The worker's end of the dead trainer's connection (a Unix socket) is
        # closed and its slot free. (Counted by kind: the cached job's own reader
        # in this process maps a new segment now and then, a dup of a memfd
        # already open.)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
            _sockets() > sockets or cache.stats()["attached_slots"] != attached
        ):
            time.sleep(0.05)
        assert _sockets() <= sockets
        assert not set(_fd_targets()) - set(before)
        assert cache.stats()["attached_slots"] == attached
        assert doomed_slot not in cache.stats()["held_slots"]  # its holds are gone
        # The others continue, well past the segment the dead trainer held.
        got = []
        while len(got) < 200:
            got.extend(int(e["i"]) for e in read(other, "other"))
        assert consecutive(got)
    finally:
        other.close()
        it.close()
