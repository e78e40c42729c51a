"""Slow links over gRPC (issue 10, items 2 and 3): a consumer whose link to a worker is
too slow for one ~1 MiB message per no-progress timeout still gets every element
exactly once (the client asks for smaller messages and replies, the worker cuts its
stored reply and keeps the rest for the next requests), and when not even the
smallest message can cross the link the read fails with `TransferStalledError` in a
bounded time instead of retrying forever. The link is a real TCP proxy that forwards
at a set number of bytes per second in both directions; the worker advertises the
proxy's address, so the consumer reaches it only through the proxy. The no-progress
timeout is 1 s here (30 s by default).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import numpy as np
import pytest

import dataservice as ds
from dataservice import _waits, errors
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import util as rpc_util
from dataservice.transfer import base
from dataservice.transfer import grpc as grpc_transfer
from dataservice.worker import task_runner
from dataservice.worker.server import WorkerServer
from tests.conftest import FAST
from tests.ft.tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(180)

OFF = ds.ShardingPolicy.OFF
NO_PROGRESS_S = 1.0


@pytest.fixture
def slow_worker(make_cluster, monkeypatch) -> Iterator:
    """`make(rate)`: a cluster whose one worker clients reach through a `TcpProxy` at
    `rate` bytes/s; returns (cluster, link). The no-progress timeout is 1 s."""
    monkeypatch.setattr(grpc_transfer, "_NO_PROGRESS_S", NO_PROGRESS_S)
    made: list[tuple] = []

    def make(rate: float):
        cluster = make_cluster(0)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        link = TcpProxy(port, down_rate=rate, up_rate=rate)
        made.append((cluster, link))
        config = ds.WorkerConfig(cluster.target, port=port, worker_address=link.address, **FAST)
        cluster.workers.append(ds.WorkerServer(config))
        return cluster, link

    yield make
    for cluster, link in made:
        for w in cluster.workers:
            w.stop()
        link.close()


def big(n: int, element_bytes: int) -> ds.Dataset:
    """Constant arrays: read with compression=None, as AUTO would compress them on a
    slow link (and these tests need the link to be slow)."""
    return ds.Dataset.range(n).map(lambda i: np.full(element_bytes, i, np.uint8))


def ids(elements, element_bytes: int) -> list[int]:
    out = []
    for e in elements:
        assert e.shape == (element_bytes,) and (e == e[0]).all()
        out.append(int(e[0]))
    return out


@pytest.mark.parametrize("n", [4, pytest.param(16, marks=pytest.mark.slow)])
def test_64_kib_elements_over_a_20_kb_s_link_arrive_once_in_order(
    slow_worker, n, caplog, monkeypatch
):
    # One element takes 3.2 s through the link, a 1 MiB message 52 s, against a 1 s
    # no-progress timeout: before, the client resent the first reply forever.
    cluster, link = slow_worker(20_000)
    size = 64 << 10
    monkeypatch.setattr(_waits, "FIRST_WARNING_S", 2.0)
    caplog.set_level(logging.WARNING, logger="dataservice.transfer.grpc")
    start = time.monotonic()
    it = iter(
        big(n, size).apply(
            ds.distribute(OFF, cluster.target, compression=None, data_transfer_protocol="grpc")
        )
    )
    got = ids([next(it)], size)
    (runner,) = cluster.workers[0]._tasks.values()  # (gone once the read ends)
    got += ids(it, size)
    elapsed_s = time.monotonic() - start
    assert got == list(range(n))
    stats = runner.unacked.stats()
    assert stats["resent_replies"] >= 1, stats  # replies timed out and came again, cut
    # Each element left the worker in exactly one reply the consumer got.
    assert stats["acked_elements"] + stats["unacked_elements"] + stats["dropped_elements"] == n
    # A request that took long said what it waited for (a 2 s threshold here).
    waits = [r.getMessage() for r in caplog.records if "over a slow link" in r.getMessage()]
    assert waits and link.address in waits[0] and "B/s" in waits[0], waits
    # The payload crossed the link about once: smaller messages did not resend much.
    assert n * size <= link.forwarded_bytes < 3 * n * size, link.forwarded_bytes
    assert elapsed_s >= n * size / link.down_rate * 0.9, f"the link was not throttled ({elapsed_s})"
    print(
        f"\n{n} x {size} B over {link.down_rate:.0f} B/s: {elapsed_s:.1f} s, "
        f"{link.forwarded_bytes} B forwarded, {link.connections} connections"
    )


def test_a_1_mib_element_over_a_2_kb_s_link_raises_a_bounded_clear_error(slow_worker, caplog):
    cluster, link = slow_worker(2_000)
    size = 1 << 20
    caplog.set_level(logging.WARNING, logger="dataservice.transfer.grpc")
    it = iter(
        big(1, size).apply(
            ds.distribute(OFF, cluster.target, compression=None, data_transfer_protocol="grpc")
        )
    )
    start = time.monotonic()
    with pytest.raises(errors.TransferStalledError) as info:
        next(it)
    elapsed_s = time.monotonic() - start
    message = str(info.value)
    assert isinstance(info.value, errors.DeadlineExceededError)
    assert link.address in message  # the worker, as the consumer reaches it
    assert "a reply of 1048" in message and "the largest 1048" in message  # its size
    assert "B/s" in message and "DATASERVICE_TRANSFER_NO_PROGRESS_MS" in message
    # 1 MiB -> 256 KiB -> 64 KiB -> 16 KiB -> 4 KiB messages, then 3 tries at 4 KiB:
    # 7 tries, each at most the request's wait (1 s) + 2 no-progress timeouts.
    tries = 4 + grpc_transfer.STALLED_ATTEMPTS
    assert elapsed_s < tries * (1.0 + 2 * NO_PROGRESS_S) + 5.0, elapsed_s
    assert elapsed_s > tries * NO_PROGRESS_S * 0.9, elapsed_s
    # The wait said what it waited for while it went on.
    waits = [r.getMessage() for r in caplog.records if "over a slow link" in r.getMessage()]
    assert waits and link.address in waits[0] and "a reply of 1048" in waits[0], waits
    # Nothing was lost: the element waits on the worker for this consumer's retry.
    (runner,) = cluster.workers[0]._tasks.values()
    stats = runner.unacked.stats()
    assert stats["unacked_elements"] == 1 and stats["acked_elements"] == 0, stats
    it.close()
    print(f"\nTransferStalledError after {elapsed_s:.1f} s: {message}")


def test_messages_shrink_on_a_slow_link_and_grow_back_when_it_is_fast(slow_worker):
    cluster, link = slow_worker(20_000)
    size = 16 << 10
    dataset = ds.Dataset.range(10**6).repeat().map(lambda i: np.full(size, i % 251, np.uint8))
    it = iter(
        dataset.apply(ds.distribute(OFF, cluster.target, compression=None, job_name="resize"))
    )
    worker = cluster.workers[0]
    deadline = time.monotonic() + 10
    while not worker.num_tasks():
        assert time.monotonic() < deadline, "the worker got no task"
        time.sleep(0.02)
    (task_id,) = worker._tasks
    client = grpc_transfer.GrpcTransferClient(
        base.TaskEndpoint(task_id, link.address, link.address, ""), None
    )
    got: list[int] = []
    sizes: list[int | None] = []

    def read_until(done, max_calls: int) -> None:
        for _ in range(max_calls):
            if done():
                return
            try:
                result = client.get_elements(16, 4 << 20, 1.0)
            except errors.TransferStalledError:
                raise
            except errors.DeadlineExceededError:
                sizes.append(client.message_bytes)
                continue
            got.extend(ids(result.elements, size))
            sizes.append(client.message_bytes)

    try:
        # 16 x 16 KiB (256 KiB) replies: 13 s at 20 KB/s, against a 1 s timeout.
        read_until(lambda: bool(got), 8)
        assert got, sizes  # elements arrived
        assert 0 < (client.message_bytes or 0) <= 64 << 10, sizes  # in small messages
        link.down_rate = link.up_rate = 20_000_000
        read_until(lambda: client.message_bytes is None, 12)
        assert client.message_bytes is None, sizes  # back to the worker's default
        assert got == [i % 251 for i in range(len(got))], got  # each once, in order
    finally:
        client.close()
        it.close()


@pytest.mark.parametrize(
    "reads",
    ["coordinated", pytest.param("cross_trainer", marks=pytest.mark.slow)],  # 17 s
)
def test_other_reads_over_a_slow_link_arrive_once_in_order(slow_worker, reads):
    # 64 KiB elements over 40 KB/s (1.6 s an element) with a 1 s timeout.
    cluster, link = slow_worker(40_000)
    size = 64 << 10
    dataset = ds.Dataset.range(10**6).repeat().map(lambda i: np.full(size, i % 251, np.uint8))
    if reads == "coordinated":  # two consumers, one element of each round each
        its = [
            iter(
                dataset.apply(
                    ds.distribute(
                        OFF,
                        cluster.target,
                        compression=None,
                        job_name="slow-rounds",
                        num_consumers=2,
                        consumer_index=c,
                        data_transfer_protocol="grpc",
                    )
                )
            )
            for c in range(2)
        ]
        rounds = 3
        expected = [[2 * r + c for r in range(rounds)] for c in range(2)]
    else:  # one trainer of a cross-trainer cache
        its = [
            iter(
                dataset.apply(
                    ds.distribute(
                        OFF,
                        cluster.target,
                        compression=None,
                        job_name="slow-cache",
                        cross_trainer_cache=ds.CrossTrainerCache("trainer-0"),
                        data_transfer_protocol="grpc",
                    )
                )
            )
        ]
        rounds = 6
        expected = [list(range(rounds))]
    try:
        with futures.ThreadPoolExecutor(len(its)) as pool:
            rows = list(pool.map(lambda it: ids([next(it) for _ in range(rounds)], size), its))
    finally:
        for it in its:
            it.close()
    assert rows == expected


def test_the_no_progress_timeout_comes_from_the_environment():
    code = "from dataservice.transfer import grpc; print(grpc._NO_PROGRESS_S)"
    env = dict(os.environ, DATASERVICE_TRANSFER_NO_PROGRESS_MS="1500")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "1.5", out.stderr
    env["DATASERVICE_TRANSFER_NO_PROGRESS_MS"] = "soon"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "DATASERVICE_TRANSFER_NO_PROGRESS_MS" in out.stderr


# ------------------------------------------------- the worker's side, without a link
def encoded(n: int, size: int) -> list[bytes]:
    return [bytes([i]) * size for i in range(n)]


def test_a_retry_with_a_smaller_max_bytes_gets_the_part_that_fits_and_the_rest_next():
    back: list[list[bytes]] = []
    replies = task_runner.UnackedReplies(4000, requeue=back.append)
    elements = encoded(5, 100)
    turn = replies.begin("k", 1, 1.0)
    turn.store(task_runner.Reply(list(elements), True, None, requeue_on_failure=False))
    turn.finish(sent=False)  # a slow link: the client timed out
    turn = replies.begin("k", 1, 1.0)  # its retry, asking for at most 250 bytes
    head = turn.cut(250)
    turn.finish(sent=True)
    assert head is not None and head.elements == elements[:2] and not head.end_of_sequence
    got = list(head.elements)
    sequence = 2
    while True:
        turn = replies.begin("k", sequence, 1.0)
        reply = turn.take_rest(150)
        assert reply is not None
        turn.store(reply)
        turn.finish(sent=True)
        got += reply.elements
        sequence += 1
        if reply.end_of_sequence:
            break
    assert got == elements  # every element once, in order, the end after the last
    assert not back
    assert replies.stats()["unacked_elements"] == 1


def test_a_reply_made_from_a_rest_and_cut_again_keeps_the_order():
    back: list[list[bytes]] = []
    replies = task_runner.UnackedReplies(4000, requeue=back.append)
    elements = encoded(6, 100)
    error = errors.RemoteErrorInfo("ValueError", "bad record", "", b"")
    turn = replies.begin("k", 1, 1.0)  # first come, first served, ending in an error
    turn.store(task_runner.Reply(list(elements), True, error, requeue_on_failure=True))
    head = turn.cut(100)  # the rest keeps the error: it stays with the consumer
    turn.finish(sent=True)
    assert head is not None and head.elements == elements[:1] and head.error is None
    turn = replies.begin("k", 2, 1.0)
    second = turn.take_rest(300)
    assert second is not None and second.elements == elements[1:4]
    turn.store(second)
    turn.finish(sent=False)  # timed out
    turn = replies.begin("k", 2, 1.0)  # the retry asks for less
    again = turn.cut(100)
    turn.finish(sent=True)
    assert again is not None and again.elements == elements[1:2]
    got = elements[:2]
    sequence = 3
    while True:
        turn = replies.begin("k", sequence, 1.0)
        reply = turn.take_rest(0)
        assert reply is not None
        turn.store(reply)
        turn.finish(sent=True)
        got += reply.elements
        sequence += 1
        if reply.end_of_sequence:
            assert reply.error == error  # the error comes after the last element
            break
    assert got == elements and not back


def test_a_cut_first_come_first_served_reply_gives_the_rest_back_to_the_task():
    back: list[list[bytes]] = []
    replies = task_runner.UnackedReplies(4000, requeue=back.append)
    elements = encoded(4, 100)
    turn = replies.begin("k", 1, 1.0)
    turn.store(task_runner.Reply(list(elements), False, None, requeue_on_failure=True))
    head = turn.cut(100)
    turn.finish(sent=True)
    assert head is not None and head.elements == elements[:1]
    assert back == [elements[1:]]
    assert replies.stats()["cut_elements"] == 3 and replies.stats()["unacked_elements"] == 1


def test_max_message_bytes_is_checked_at_the_edge():
    from dataservice.rpc import validate

    validate.check_request(pb.GetElementsRequest(round_index=-1, consumer_index=-1))
    validate.check_request(
        pb.GetElementsRequest(round_index=-1, consumer_index=-1, max_message_bytes=4096)
    )
    with pytest.raises(errors.InvalidArgumentError, match="max_message_bytes=10"):
        validate.check_request(
            pb.GetElementsRequest(round_index=-1, consumer_index=-1, max_message_bytes=10)
        )


# ------------------------------------------------- the dispatcher's large RPCs
def test_a_large_dataset_registers_over_a_slow_link_to_the_dispatcher(make_cluster, monkeypatch):
    """RegisterDataset carries the pipeline's arrays (here 150 KB): over a 60 KB/s link
    it takes ~2.5 s, longer than one try's deadline (0.5 s here, 10 s by default). Each
    try after a timed-out one gets twice as long, so it arrives; before, it was resent
    until the client timeout and failed with "could not reach"."""
    monkeypatch.setattr(rpc_util, "DISPATCHER_ATTEMPT_S", 0.5)
    cluster = make_cluster(0)
    port = int(cluster.target.rsplit(":", 1)[1])
    link = TcpProxy(port, down_rate=60_000, up_rate=60_000)
    try:
        values = np.arange(150_000, dtype=np.uint8)
        dataset = ds.Dataset.from_tensor_slices(values)
        start = time.monotonic()
        dataset_id = ds.register_dataset(link.address, dataset, client_timeout_ms=60_000)
        elapsed_s = time.monotonic() - start
        assert dataset_id
        assert elapsed_s >= 150_000 / link.down_rate * 0.9, elapsed_s  # it did cross the link
        rate = link.down_rate
        print(f"\nRegisterDataset of {values.nbytes} B over {rate:.0f} B/s: {elapsed_s:.1f} s")
        # The same definition, straight to the dispatcher: the same id.
        assert ds.register_dataset(cluster.target, dataset) == dataset_id
    finally:
        link.close()


def test_a_worker_that_sends_nothing_is_not_taken_for_a_slow_link(make_cluster, monkeypatch):
    """A stuck (or frozen) worker sends no message at all: the client keeps retrying
    with DeadlineExceededError, leaving it to the worker-loss rules
    (`worker_loss_timeout_ms`), instead of blaming the link with TransferStalledError."""
    monkeypatch.setattr(grpc_transfer, "_NO_PROGRESS_S", 0.3)
    monkeypatch.setattr(grpc_transfer, "_FIRST_MESSAGE_GRACE_S", 0.3)
    release = threading.Event()

    def stuck(original: Callable[..., Iterator]) -> Callable[..., Iterator]:
        def serve(worker: WorkerServer, request) -> Iterator:
            inner = original(worker, request)
            try:
                first = next(inner)
                release.wait(60)
                yield first
                yield from inner
            finally:
                inner.close()

        return serve

    for name in ("_get_elements_stream", "_get_elements_frames"):
        monkeypatch.setattr(WorkerServer, name, stuck(getattr(WorkerServer, name)))
    cluster = make_cluster(1)
    worker = cluster.workers[0]
    it = iter(
        big(10, 64 << 10).apply(
            ds.distribute(OFF, cluster.target, compression=None, job_name="stuck")
        )
    )
    client = None
    try:
        deadline = time.monotonic() + 10
        while not worker.num_tasks():
            assert time.monotonic() < deadline, "the worker got no task"
            time.sleep(0.02)
        (task_id,) = worker._tasks
        client = grpc_transfer.GrpcTransferClient(
            base.TaskEndpoint(task_id, worker.address, worker.address, ""), None
        )
        tries = 4 + grpc_transfer.STALLED_ATTEMPTS + 2
        for _ in range(tries):
            with pytest.raises(errors.DeadlineExceededError) as info:
                client.get_elements(4, 1 << 20, 0.2)
            assert not isinstance(info.value, errors.TransferStalledError)
        assert client.message_bytes == grpc_transfer.MIN_MESSAGE_BYTES
        release.set()
        result = client.get_elements(4, 1 << 20, 1.0)  # the same reply, once it answers
        assert ids(result.elements, 64 << 10)[0] == 0
    finally:
        release.set()
        if client is not None:
            client.close()
        it.close()
