"""Give-back over shared memory for the replies that used to have none (issue 10,
item 2: no silent loss): the stream's final reply (its last elements, then END) and
cross-trainer cache reads (a window read, or a trainer's read through a ring).

A consumer whose connection ends after the worker sent such a reply, before the
consumer had its elements, must not lose them: a shared job's final elements go to
its other consumers (who get the end of sequence only after them), and a trainer's
cache read is read again by that trainer id. The connection is broken at exactly that
moment with raw `ShmTransferClient`s (the test speaks the protocol: request, reply
header, then takes some or none of the elements), with a consumer process that is
SIGKILLed there, and inside a real iterator (its shared-window read fails after the
worker sent the reply, and it reconnects). Every element must arrive exactly once.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

import dataservice as ds
from dataservice import errors
from dataservice.transfer import base, shm
from dataservice.worker.cross_trainer_cache import CrossTrainerCache
from tests.ft.conftest import server_env, wait_until

pytestmark = pytest.mark.timeout(120)

OFF = ds.ShardingPolicy.OFF


def shared_task(cluster: Any, dataset: ds.Dataset, job_name: str, **kw: Any) -> tuple[Any, Any]:
    """(an iterator of the job that asks for nothing: it makes the task, the
    endpoint of the worker's task)."""
    worker = cluster.workers[0]
    holder = iter(dataset.apply(ds.distribute(OFF, cluster.target, job_name=job_name, **kw)))
    wait_until(lambda: worker.num_tasks() == 1, 10, "the worker to get the task")
    (task_id,) = worker._tasks
    return holder, base.TaskEndpoint(task_id, worker.address, worker.address, "")


def request(client: shm.ShmTransferClient, max_elements: int, timeout_ms: int = 5000) -> tuple:
    """Sends one request; returns the reply header: (elements that follow, flags)."""
    client._sock.send(shm.REQUEST.pack(b"G", max_elements, 1 << 20, timeout_ms))
    client._sock.settimeout(timeout_ms / 1000 + 10)
    _, count, flags, _ = shm.RESPONSE.unpack(client._sock.recv(64))
    return count, flags


def take(client: shm.ShmTransferClient, n: int) -> list[int]:
    """Takes `n` elements out of the client's ring (int64[] elements)."""
    out: list[int] = []
    deadline = time.monotonic() + 10
    while len(out) < n:
        assert time.monotonic() < deadline, f"the ring got {len(out)} of {n} elements"
        got, _, _, _ = client._ring.get_many(n - len(out), 1000)
        out.extend(int(x) for x in got)
    return out


def read_all(
    endpoint: base.TaskEndpoint, timeout_s: float = 30.0, trainer_id: str = ""
) -> tuple[list[int], bool]:
    """Reads with a fresh client until the end: (element values, ended)."""
    client = shm.ShmTransferClient(endpoint, trainer_id=trainer_id)
    out: list[int] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            result = client.get_elements(100, 1 << 20, 1.0, trainer_id=trainer_id)
            out.extend(int(np.asarray(x).flat[0]) for x in result.elements)
            if result.end_of_sequence:
                return out, True
        return out, False
    finally:
        client.close()


# ---------------------------------------------------------------- the final reply
def test_final_reply_not_taken_goes_to_the_others_before_their_end(make_cluster):
    cluster = make_cluster(1)
    n = 20
    holder, endpoint = shared_task(cluster, ds.Dataset.range(n), "final-close")
    runner = cluster.workers[0]._tasks[endpoint.task_id]
    try:
        wait_until(lambda: runner._end and len(runner._buffer) == n, 10, "the whole pipeline")
        gone = shm.ShmTransferClient(endpoint)
        count, flags = request(gone, 100)
        assert (count, flags) == (n, shm.END_FLAG)  # the last elements, then END
        taken = take(gone, 3)
        assert taken == [0, 1, 2]
        # While `gone` may still come back for its elements, another consumer of the
        # job gets no end of sequence (and nothing: the task has nothing else).
        other = shm.ShmTransferClient(endpoint)
        try:
            result = other.get_elements(100, 1 << 20, 0.5)
            assert (result.elements, result.end_of_sequence) == ([], False)
            gone.close()  # goes away without the other 17
            rest: list[int] = []
            deadline = time.monotonic() + 20
            while True:
                assert time.monotonic() < deadline, rest
                result = other.get_elements(100, 1 << 20, 1.0)
                rest.extend(int(x) for x in result.elements)
                if result.end_of_sequence:
                    break
        finally:
            other.close()
        assert taken + rest == list(range(n))
        # And the end of sequence is what is left for anyone else.
        assert read_all(endpoint) == ([], True)
    finally:
        holder.close()


def test_final_reply_taken_whole_is_not_given_back(make_cluster):
    cluster = make_cluster(1)
    n = 12
    holder, endpoint = shared_task(cluster, ds.Dataset.range(n), "final-taken")
    runner = cluster.workers[0]._tasks[endpoint.task_id]
    try:
        wait_until(lambda: runner._end and len(runner._buffer) == n, 10, "the whole pipeline")
        first = shm.ShmTransferClient(endpoint)
        try:
            assert request(first, 100) == (n, shm.END_FLAG)
            assert take(first, n) == list(range(n))
            # All taken: the hold is lifted at once (the consumer is still connected).
            got, ended = read_all(endpoint, timeout_s=10)
            assert (got, ended) == ([], True)
        finally:
            first.close()
        assert not runner._buffer
    finally:
        holder.close()


VICTIM = r"""
import sys, time
from dataservice.transfer import base, shm
task_id, address, want_taken = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
client = shm.ShmTransferClient(base.TaskEndpoint(task_id, address, address, ""))
client._sock.send(shm.REQUEST.pack(b"G", 1000, 1 << 20, 5000))
_, count, flags, _ = shm.RESPONSE.unpack(client._sock.recv(64))
taken = []
while len(taken) < want_taken:
    got, _, _, _ = client._ring.get_many(want_taken - len(taken), 1000)
    taken.extend(int(x) for x in got)
print(json.dumps({"count": count, "flags": flags, "taken": taken}), flush=True)
time.sleep(600)
""".replace("import sys, time", "import json, sys, time")


@pytest.mark.parametrize("taken", [0, 4])
def test_consumer_killed_after_the_final_reply_loses_nothing(make_cluster, taken):
    cluster = make_cluster(1)
    n = 30
    dataset = ds.Dataset.range(n)
    holder, endpoint = shared_task(cluster, dataset, f"final-kill-{taken}")
    runner = cluster.workers[0]._tasks[endpoint.task_id]
    victim = None
    try:
        wait_until(lambda: runner._end and len(runner._buffer) == n, 10, "the whole pipeline")
        victim = subprocess.Popen(
            [
                sys.executable,
                "-c",
                VICTIM,
                str(endpoint.task_id),
                endpoint.worker_address,
                str(taken),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=server_env(),
        )
        line = victim.stdout.readline()
        assert line, "the victim consumer printed nothing"
        report = json.loads(line)
        assert (report["count"], report["flags"]) == (n, shm.END_FLAG)
        assert report["taken"] == list(range(taken))
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        # The job's other consumer, a real iterator, gets everything the victim did
        # not take, once, then the end.
        rest = [
            int(x)
            for x in dataset.apply(
                ds.distribute(OFF, cluster.target, job_name=f"final-kill-{taken}")
            )
        ]
        assert report["taken"] + rest == list(range(n))
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
            victim.wait(10)
        if victim is not None and victim.stdout is not None:
            victim.stdout.close()
        holder.close()


# ---------------------------------------------------------------- cross-trainer reads
def cached_dataset() -> ds.Dataset:
    return ds.Dataset.range(10**9).repeat().map(lambda i: np.full(1024, i, np.int64))


def trainer_endpoint(cluster: Any, job_name: str) -> tuple[Any, base.TaskEndpoint]:
    return shared_task(
        cluster,
        cached_dataset(),
        job_name,
        cross_trainer_cache=ds.CrossTrainerCache("holder"),
    )


def read_n(client: shm.ShmTransferClient, trainer_id: str, n: int) -> list[int]:
    out: list[int] = []
    deadline = time.monotonic() + 20
    while len(out) < n:
        assert time.monotonic() < deadline, out
        result = client.get_elements(n - len(out), 1 << 20, 1.0, trainer_id=trainer_id)
        out.extend(int(e[0]) for e in result.elements)
    return out


def test_window_read_not_acknowledged_is_read_again_by_its_trainer(make_cluster):
    cluster = make_cluster(1)
    holder, endpoint = trainer_endpoint(cluster, "window-gone")
    cache = cluster.workers[0]._tasks[endpoint.task_id].cross_trainer_cache
    try:
        gone = shm.ShmTransferClient(endpoint, trainer_id="t")
        assert gone._window is not None  # the shared window, not a ring
        gone._sock.send(shm.REQUEST.pack(b"G", 8, 1 << 20, 5000))
        data, fds, _, _ = socket.recv_fds(gone._sock, shm._WINDOW_REPLY_BYTES, 1)
        for fd in fds:
            os.close(fd)
        reply = json.loads(data)
        assert (reply["n"], reply["seq"]) == (8, 0)  # elements 0..7 are on their way
        gone.close()  # ... and the trainer goes away before reading them (no DONE)
        wait_until(lambda: cache.given_back_elements == 8, 10, "the read to be given back")
        again = shm.ShmTransferClient(endpoint, trainer_id="t")
        other = shm.ShmTransferClient(endpoint, trainer_id="u")
        try:
            assert read_n(again, "t", 30) == list(range(30))
            assert read_n(other, "u", 30) == list(range(30))  # another trainer: unaffected
        finally:
            again.close()
            other.close()
        assert cache.stats()["evicted_unacked_elements"] == 0
    finally:
        holder.close()


def test_window_read_acknowledged_by_done_is_not_read_again(make_cluster):
    cluster = make_cluster(1)
    holder, endpoint = trainer_endpoint(cluster, "window-done")
    cache = cluster.workers[0]._tasks[endpoint.task_id].cross_trainer_cache
    try:
        first = shm.ShmTransferClient(endpoint, trainer_id="t")
        assert read_n(first, "t", 10) == list(range(10))  # each reply acknowledged (DONE)
        first.close()
        second = shm.ShmTransferClient(endpoint, trainer_id="t")
        try:
            assert read_n(second, "t", 10) == list(range(10, 20))
        finally:
            second.close()
        assert cache.given_back_elements == 0
    finally:
        holder.close()


def test_ring_cache_read_not_taken_is_read_again_by_its_trainer(make_cluster, monkeypatch):
    # No shared window (as when the cache could not get shared memory, or its 64 hold
    # slots are taken): the trainer reads through a ring of its own.
    monkeypatch.setattr(CrossTrainerCache, "shared", property(lambda self: False))
    cluster = make_cluster(1)
    holder, endpoint = trainer_endpoint(cluster, "ring-gone")
    cache = cluster.workers[0]._tasks[endpoint.task_id].cross_trainer_cache
    try:
        gone = shm.ShmTransferClient(endpoint, trainer_id="t")
        assert gone._ring is not None
        count, flags = request(gone, 6)
        assert (count, flags) == (6, 0)
        took, _, _, _ = gone._ring.get_many(2, 5000)
        taken = [int(e[0]) for e in took]
        while len(taken) < 2:
            took, _, _, _ = gone._ring.get_many(2 - len(taken), 5000)
            taken += [int(e[0]) for e in took]
        assert taken == [0, 1]
        gone.close()  # without elements 2..5
        wait_until(lambda: cache.given_back_elements == 4, 10, "the untaken 4 to go back")
        again = shm.ShmTransferClient(endpoint, trainer_id="t")
        try:
            assert taken + read_n(again, "t", 20) == list(range(22))
        finally:
            again.close()
    finally:
        holder.close()


def break_window_reads(monkeypatch: pytest.MonkeyPatch, at: set[int]) -> list[int]:
    """The shared-window reads numbered in `at` (0, 1, ... over all trainers) fail
    after the worker sent their reply and before the trainer read it: the client
    raises UnavailableError, as a broken connection makes it. Returns the list the
    numbers of the broken reads go to (with elements named in their reply)."""
    original = shm.ShmTransferClient._get_window_elements
    calls = itertools.count()
    broken: list[int] = []

    def faulty(self: Any, max_elements: int, max_bytes: int, timeout_s: float, timeout_ms: int):
        number = next(calls)
        if number not in at:
            return original(self, max_elements, max_bytes, timeout_s, timeout_ms)
        self._sock.send(shm.REQUEST.pack(b"G", max(1, max_elements), max_bytes, timeout_ms))
        data, fds, _, _ = socket.recv_fds(self._sock, shm._WINDOW_REPLY_BYTES, 1)
        for fd in fds:
            os.close(fd)
        if json.loads(data).get("n"):
            broken.append(number)
        raise errors.UnavailableError("injected: the connection broke before the reply was read")

    monkeypatch.setattr(shm.ShmTransferClient, "_get_window_elements", faulty)
    return broken


def test_iterators_with_broken_window_reads_get_every_element_once_in_order(
    make_cluster, monkeypatch
):
    cluster = make_cluster(1)
    broken = break_window_reads(monkeypatch, {2, 5, 9})
    iterators = [
        iter(
            cached_dataset().apply(
                ds.distribute(
                    OFF,
                    cluster.target,
                    job_name="window-iter",
                    cross_trainer_cache=ds.CrossTrainerCache(f"trainer-{t}"),
                    data_transfer_protocol="shm",
                )
            )
        )
        for t in range(2)
    ]
    try:
        got: list[list[int]] = [[], []]
        for _ in range(60):  # in lockstep
            for t, it in enumerate(iterators):
                got[t].append(int(next(it)[0]))
    finally:
        for it in iterators:
            it.close()
    assert got == [list(range(60))] * 2
    assert broken, "no read was broken after its reply carried elements"
    runner_stats = [r.cross_trainer_cache.stats() for r in cluster.workers[0]._tasks.values()]
    assert sum(s["given_back_elements"] for s in runner_stats) > 0


# ---------------------------------------------------------------- a stopped task
@pytest.mark.parametrize("trainer_id", ["", "t"])
def test_a_stopped_task_never_looks_ended_to_its_shm_consumers(make_cluster, trainer_id):
    """The worker drops a task (the dispatcher deleted it, or the worker stops) while a
    consumer is connected: the consumer loses the connection (and learns what became
    of the task from the dispatcher), it never gets an end of sequence for it."""
    cluster = make_cluster(1)
    if trainer_id:
        holder, endpoint = trainer_endpoint(cluster, "stopped-cache")
    else:
        holder, endpoint = shared_task(cluster, ds.Dataset.range(10**6), "stopped-plain")
    runner = cluster.workers[0]._tasks[endpoint.task_id]
    client = shm.ShmTransferClient(endpoint, trainer_id=trainer_id)
    try:
        first = client.get_elements(4, 1 << 20, 5.0, trainer_id=trainer_id)
        assert first.elements and not first.end_of_sequence
        runner.stop()
        assert runner.join(5)
        deadline = time.monotonic() + 10
        with pytest.raises(errors.UnavailableError):
            while time.monotonic() < deadline:
                result = client.get_elements(4, 1 << 20, 0.5, trainer_id=trainer_id)
                assert not result.end_of_sequence, "a stopped task ended its stream"
        assert time.monotonic() < deadline, "the connection of a stopped task stayed open"
    finally:
        client.close()
        holder.close()
