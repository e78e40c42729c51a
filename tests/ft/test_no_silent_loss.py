"""No element produced for a consumer is dropped by the transport (issue 10, item 2).

Replies are lost or late on purpose: `Faults` wraps the worker's GetElementsStream
handler and gives, in turn, the replies that carry elements one of three faults:
"lost" (the worker sends the whole reply, the client gets UNAVAILABLE instead),
"broken" (the stream breaks after its first message) and "late" (the first message
comes after the client's no-progress timeout, shortened here). Every element must
still arrive exactly once and in order: OFF mode with one consumer, a shared job's
consumers (first come, first served), coordinated reads and cross-trainer cache
reads over gRPC; over shared memory, a consumer of a shared job that goes away
mid-read leaves the elements it never took to the other consumer. A throttled TCP
proxy checks that replies slower than the old fixed deadline arrive (not retried
forever, not lost).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import numpy as np
import pytest

import dataservice as ds
from dataservice import errors
from dataservice.rpc import service_pb2 as pb
from dataservice.transfer import base, shm
from dataservice.transfer import grpc as grpc_transfer
from dataservice.worker import task_runner
from dataservice.worker.server import WorkerServer
from tests.conftest import FAST, to_py
from tests.ft.tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(120)

OFF = ds.ShardingPolicy.OFF
FAULTS = ("lost", "broken", "late")


def dist(dataset, target: str, **kw):
    return dataset.apply(ds.distribute(OFF, target, **kw))


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


class Faults:
    """Injects `plan`'s faults, in order, into the replies that carry elements
    (requests with a consumer key only), then lets replies through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, plan: list[str], late_s: float = 2.0):
        self.plan = list(plan)
        self.late_s = late_s
        self.applied: list[str] = []
        self.runners: dict[int, Any] = {}  # task id -> the runner that served it
        self._mu = threading.Lock()
        for name in ("_get_elements_stream", "_get_elements_frames"):
            monkeypatch.setattr(WorkerServer, name, self._faulty(getattr(WorkerServer, name)))
        # The client gives up on a reply after 1.0 s (its wait) + 0.3 s without a
        # first message, or 1 s without the next one.
        monkeypatch.setattr(grpc_transfer, "_FIRST_MESSAGE_GRACE_S", 0.3)
        monkeypatch.setattr(grpc_transfer, "_NO_PROGRESS_S", 1.0)

    def _faulty(self, original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        """`original` (GetElementsStream's or GetElementsFrames's reply) with faults."""
        faults = self

        def faulty(worker: WorkerServer, request: Any) -> Iterator[Any]:
            runner = worker._tasks.get(request.task_id)
            if runner is not None:
                faults.runners.setdefault(request.task_id, runner)
            inner = original(worker, request)
            try:
                first = next(inner)
                fault = faults._take() if _carries(first) and request.consumer_key else None
                if fault == "lost":
                    rest = list(inner)  # the worker sends all of it: its turn ends "sent"
                    assert _ends(first, rest)
                    raise errors.UnavailableError("injected: the reply was lost on the way")
                if fault == "broken":
                    yield first
                    inner.close()  # the worker's side of the stream breaks mid-reply
                    raise errors.UnavailableError("injected: the stream broke")
                if fault == "late":
                    time.sleep(faults.late_s)  # past the client's first-message timeout
                yield first
                yield from inner
            finally:
                inner.close()

        return faulty

    def _take(self) -> str | None:
        with self._mu:
            if not self.plan:
                return None
            fault = self.plan.pop(0)
            self.applied.append(fault)
            return fault


def _carries(first: Any) -> bool:
    """Whether a reply whose first message is `first` carries elements."""
    if isinstance(first, pb.ElementsHead):
        return not first.last or len(first.element_bytes) > 0
    return not first.last or len(first.elements) > 0


def _ends(first: Any, rest: list[Any]) -> bool:
    """Whether the messages `first` + `rest` are a whole reply."""
    messages = [first, *rest]
    if isinstance(first, pb.ElementsHead):
        return any(isinstance(m, pb.ElementsHead) and m.last for m in messages)
    return bool(messages[-1].last)


def unacked_totals(faults: Faults) -> dict[str, int]:
    """The reply counters of every task the faulty handler served (summed), with
    `delivered`: elements acknowledged, or in a consumer's last reply (still held,
    or counted as dropped when the task stopped). Requeued elements count when sent
    again, so `delivered` counts each element that left the worker once."""
    totals: dict[str, int] = {}
    for runner in faults.runners.values():
        for key, value in runner.unacked.stats().items():
            totals[key] = totals.get(key, 0) + value
    totals["delivered"] = (
        totals["acked_elements"] + totals["unacked_elements"] + totals["dropped_elements"]
    )
    return totals


def elements(n: int) -> ds.Dataset:
    return ds.Dataset.range(n).map(lambda i: {"i": i, "x": np.full(256, i, np.int64)})


def check(element: Any) -> int:
    i = int(element["i"])
    assert element["x"].shape == (256,) and (element["x"] == i).all()
    return i


# ---------------------------------------------------------------- gRPC, OFF mode
def test_grpc_one_consumer_gets_every_element_once_in_order(make_cluster, monkeypatch):
    cluster = make_cluster(1)
    faults = Faults(monkeypatch, ["lost", "broken", "late", "lost", "broken", "late"])
    n = 300
    got = [check(e) for e in dist(elements(n), cluster.target, data_transfer_protocol="grpc")]
    assert got == list(range(n))
    assert faults.applied == ["lost", "broken", "late", "lost", "broken", "late"]
    totals = unacked_totals(faults)
    assert totals["resent_replies"] >= 6  # every faulty reply came again
    assert totals["delivered"] == n


@pytest.mark.parametrize("fault", FAULTS)
def test_grpc_shared_job_consumers_together_get_every_element_once(
    make_cluster, monkeypatch, fault
):
    cluster = make_cluster(1)
    faults = Faults(monkeypatch, [fault] * 4)
    n = 400
    iterators = [
        iter(dist(elements(n), cluster.target, job_name="shared", data_transfer_protocol="grpc"))
        for _ in range(2)
    ]
    with futures.ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(lambda it: [check(e) for e in it], iterators))
    assert sorted(parts[0] + parts[1]) == list(range(n))
    for part in parts:
        assert part == sorted(part)  # each consumer's share comes in the worker's order
    assert faults.applied == [fault] * 4
    totals = unacked_totals(faults)
    assert totals["delivered"] == n
    assert totals["resent_replies"] >= 4  # to the consumer whose reply failed


@pytest.mark.parametrize(
    "other_client",
    [
        pytest.param(lambda endpoint: grpc_transfer.GrpcTransferClient(endpoint, None), id="grpc"),
        # A job mixing transports: the failed gRPC reply reaches a shm consumer too.
        pytest.param(shm.ShmTransferClient, id="shm"),
    ],
)
def test_grpc_shared_job_consumer_gone_after_a_failed_reply_leaves_it_to_the_others(
    make_cluster, monkeypatch, other_client
):
    monkeypatch.setattr(task_runner, "REQUEUE_AFTER_S", 0.5)
    cluster = make_cluster(1)
    worker = cluster.workers[0]
    faults = Faults(monkeypatch, ["broken"])
    n = 40
    holder = iter(dist(elements(n), cluster.target, job_name="gone"))  # makes the task
    try:
        wait_until(lambda: worker.num_tasks() == 1, 10, "the worker to get the task")
        (task_id,) = worker._tasks
        endpoint = base.TaskEndpoint(task_id, worker.address, worker.address, "")
        gone = grpc_transfer.GrpcTransferClient(endpoint, None)
        with pytest.raises(errors.UnavailableError, match="injected: the stream broke"):
            gone.get_elements(5, 1 << 20, 1.0)
        gone.close()  # and never comes back for its 5 elements
        other = other_client(endpoint)
        got: list[int] = []
        deadline = time.monotonic() + 30
        try:
            while True:
                assert time.monotonic() < deadline, got
                result = other.get_elements(8, 1 << 20, 1.0)
                got.extend(check(e) for e in result.elements)
                if result.end_of_sequence:
                    break
        finally:
            other.close()
    finally:
        holder.close()
    assert faults.applied == ["broken"]
    assert sorted(got) == list(range(n)), f"{len(got)} of {n}: missing {set(range(n)) - set(got)}"
    assert unacked_totals(faults)["requeued_elements"] == 5


# ---------------------------------------------------------------- coordinated reads
def test_grpc_coordinated_reads_get_their_own_element_of_every_round(make_cluster, monkeypatch):
    cluster = make_cluster(1)
    faults = Faults(monkeypatch, ["lost", "broken", "late"] * 2)
    dataset = ds.Dataset.range(10**6).repeat()
    iterators = [
        iter(dist(dataset, cluster.target, job_name="coord", consumer_index=i, num_consumers=2))
        for i in range(2)
    ]
    rounds = 16
    try:
        with futures.ThreadPoolExecutor(2) as pool:
            rows = list(pool.map(lambda it: [to_py(next(it)) for _ in range(rounds)], iterators))
    finally:
        for it in iterators:
            it.close()
    assert rows == [[2 * r + c for r in range(rounds)] for c in range(2)]
    assert sorted(faults.applied) == sorted(["lost", "broken", "late"] * 2)
    assert unacked_totals(faults)["resent_replies"] >= 6


# ---------------------------------------------------------------- cross-trainer cache
def test_grpc_cross_trainer_reads_get_every_element_once_in_order(make_cluster, monkeypatch):
    cluster = make_cluster(0)
    cluster.add_worker()
    faults = Faults(monkeypatch, ["lost", "broken", "late"] * 2)
    dataset = ds.Dataset.range(10**7).repeat()
    iterators = [
        iter(
            dist(
                dataset,
                cluster.target,
                job_name="cached",
                cross_trainer_cache=ds.CrossTrainerCache(f"trainer-{t}"),
                data_transfer_protocol="grpc",
            )
        )
        for t in range(2)
    ]
    try:
        got: list[list[int]] = [[], []]
        for _ in range(40):  # in lockstep
            for t, it in enumerate(iterators):
                got[t].append(to_py(next(it)))
    finally:
        for it in iterators:
            it.close()
    assert got == [list(range(40))] * 2
    assert sorted(faults.applied) == sorted(["lost", "broken", "late"] * 2)


# ---------------------------------------------------------------- shared memory
def test_shm_consumer_gone_mid_read_leaves_what_it_never_took_to_the_others(make_cluster):
    cluster = make_cluster(1)
    worker = cluster.workers[0]
    n = 50
    # A consumer of the shared job that asks for nothing: it makes the job's task.
    holder = iter(dist(ds.Dataset.range(n), cluster.target, job_name="shm-shared"))
    try:
        wait_until(lambda: worker.num_tasks() == 1, 10, "the worker to get the task")
        (task_id,) = worker._tasks
        runner = worker._tasks[task_id]
        endpoint = base.TaskEndpoint(task_id, worker.address, worker.address, "")
        gone = shm.ShmTransferClient(endpoint)
        # One request for 5 elements; the consumer takes 2 of them, then goes away.
        gone._sock.send(shm.REQUEST.pack(b"G", 5, 1 << 20, 5000))
        count, _, _ = shm.RESPONSE.unpack(gone._sock.recv(64))[1:]
        assert count == 5
        taken: list[int] = []
        deadline = time.monotonic() + 10
        while len(taken) < 2:
            assert time.monotonic() < deadline, "the ring got no element"
            took, _, _, _ = gone._ring.get_many(2 - len(taken), 1000)
            taken.extend(int(x) for x in took)
        assert taken == [0, 1]
        gone.close()
        wait_until(
            lambda: bool(runner._buffer) and int(runner._buffer[0][0]) == 2,
            10,
            "the 3 elements the consumer did not take to go back to the task",
        )
        other = shm.ShmTransferClient(endpoint)
        rest: list[int] = []
        try:
            while True:
                result = other.get_elements(100, 1 << 20, 2.0)
                rest.extend(int(x) for x in result.elements)
                if result.end_of_sequence:
                    break
                assert time.monotonic() < deadline + 20
        finally:
            other.close()
        assert taken + rest == list(range(n))
    finally:
        holder.close()


# ---------------------------------------------------------------- slow links
def read_through_slow_link(
    make_cluster, element_bytes: int, n: int, rate: float
) -> tuple[list[int], float]:
    """Reads `n` elements of `element_bytes` from a worker whose clients reach it
    through a `TcpProxy` at `rate` bytes/s: (element ids, seconds taken)."""
    cluster = make_cluster(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = TcpProxy(port, down_rate=rate)
    try:
        config = ds.WorkerConfig(
            cluster.target, port=port, worker_address=f"127.0.0.1:{proxy.port}", **FAST
        )
        cluster.workers.append(ds.WorkerServer(config))
        dataset = ds.Dataset.range(n).map(lambda i: np.full(element_bytes, i, np.uint8))
        start = time.monotonic()
        got = []
        # Uncompressed: AUTO would compress these constant arrays on a link this slow.
        read = dist(dataset, cluster.target, data_transfer_protocol="grpc", compression=None)
        for e in read:
            assert e.shape == (element_bytes,) and e[0] == e[-1]
            got.append(int(e[0]))
        return got, time.monotonic() - start
    finally:
        for w in cluster.workers:
            w.stop()
        proxy.close()


def test_grpc_replies_slower_than_the_no_progress_timeout_arrive_once(make_cluster, monkeypatch):
    # 5 x 4 MiB at 2 MiB/s: one reply (16 MiB, 4 elements) takes ~8 s, longer than
    # the old fixed deadline (6 s) and far longer than the no-progress timeout here.
    monkeypatch.setattr(grpc_transfer, "_FIRST_MESSAGE_GRACE_S", 1.0)
    monkeypatch.setattr(grpc_transfer, "_NO_PROGRESS_S", 2.0)
    got, elapsed_s = read_through_slow_link(make_cluster, 4 << 20, 5, 2 << 20)
    assert got == list(range(5))
    assert elapsed_s >= 8.0, f"the link was not throttled ({elapsed_s:.1f} s)"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grpc_256_mib_elements_through_a_slow_link_arrive(make_cluster):
    # Default timeouts. 2 x 256 MiB at 32 MiB/s: 8 s an element, each reply longer
    # than the old deadline; before, none arrived and the client retried forever.
    got, elapsed_s = read_through_slow_link(make_cluster, 256 << 20, 2, 32 << 20)
    assert got == [0, 1]
    assert elapsed_s >= 16.0


def test_grpc_stuck_worker_ends_the_request_within_the_no_progress_timeout(
    make_cluster, monkeypatch
):
    """A worker that sends nothing (not slow: stuck) fails the request with
    DeadlineExceededError after the no-progress timeout; the retry then gets the
    same reply once the worker answers again."""
    cluster = make_cluster(1)
    monkeypatch.setattr(grpc_transfer, "_FIRST_MESSAGE_GRACE_S", 0.3)
    release = threading.Event()

    def stuck(original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def serve(worker: WorkerServer, request: Any) -> Iterator[Any]:
            inner = original(worker, request)
            try:
                first = next(inner)
                if not release.is_set():
                    release.wait(30)  # stuck until the test lets it go
                yield first
                yield from inner
            finally:
                inner.close()

        return serve

    for name in ("_get_elements_stream", "_get_elements_frames"):
        monkeypatch.setattr(WorkerServer, name, stuck(getattr(WorkerServer, name)))
    it = iter(dist(elements(10), cluster.target, job_name="stuck"))
    wait_until(lambda: cluster.workers[0].num_tasks() == 1, 10, "the task")
    worker = cluster.workers[0]
    (task_id,) = worker._tasks
    client = grpc_transfer.GrpcTransferClient(
        base.TaskEndpoint(task_id, worker.address, worker.address, ""), None
    )
    try:
        start = time.monotonic()
        with pytest.raises(errors.DeadlineExceededError, match="no data for"):
            client.get_elements(4, 1 << 20, 0.5)
        assert time.monotonic() - start < 5.0
        release.set()
        result = client.get_elements(4, 1 << 20, 0.5)  # the retry: the same reply
        assert [check(e) for e in result.elements] == [0, 1, 2, 3]
        result = client.get_elements(4, 1 << 20, 0.5)
        assert [check(e) for e in result.elements] == [4, 5, 6, 7]
    finally:
        release.set()
        client.close()
        it.close()
