"""The reader's read-ahead: what it fetches beyond what its consumer took stays
within its bound (half of what the consumer took, at least 16), requests sent
ahead (`TransferClient.request_ahead`) included, over both protocols; so a worker
that restarts midway is seen by a consumer halfway through its stream (the
reader had not run ahead to the old stream's end: conformance FT-13's case, here
over gRPC as well as shared memory)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

import dataservice as ds
from dataservice.client import fetch
from dataservice.transfer import base, shm
from dataservice.transfer import grpc as grpc_transfer

pytestmark = pytest.mark.timeout(120)

OFF = ds.ShardingPolicy.OFF


def _count_requests_ahead(monkeypatch) -> list[tuple[int, int]]:
    """Records each request sent ahead, of whichever protocol: (max elements, max bytes)."""
    sent: list[tuple[int, int]] = []
    for cls in (grpc_transfer.GrpcTransferClient, shm.ShmTransferClient):
        real = cls.request_ahead

        def wrapped(self, max_elements, max_bytes, *args, _real=real, **kwargs):
            ok = _real(self, max_elements, max_bytes, *args, **kwargs)
            if ok:
                sent.append((max_elements, max_bytes))
            return ok

        monkeypatch.setattr(cls, "request_ahead", wrapped)
    return sent


def _fetched(it) -> int:
    return sum(w["elements"] for w in it.stats()["workers"].values())


@pytest.mark.parametrize("protocol", ["grpc", "shm"])
def test_a_reader_fetches_no_more_than_its_read_ahead(make_cluster, monkeypatch, protocol):
    """A consumer that took 1,000 elements and pauses has at most 500 more fetched
    (its read-ahead) besides the rest of the fetched chunk it is taking elements
    from, though the reader sent requests ahead while it read."""
    sent = _count_requests_ahead(monkeypatch)
    cluster = make_cluster(1)
    dataset = ds.Dataset.range(100_000).map(lambda i: np.full(16, i, np.int64))
    it = iter(dataset.apply(ds.distribute(OFF, cluster.target, data_transfer_protocol=protocol)))
    try:
        taken = [int(next(it)[0]) for _ in range(1_000)]
        assert taken == list(range(1_000))
        assert sent, "no request was sent ahead"
        assert all(n <= 1_024 for n, _ in sent)
        # Let every fetch (and request sent ahead) land.
        deadline = time.monotonic() + 5
        last = -1
        while time.monotonic() < deadline:
            time.sleep(0.3)
            now = _fetched(it)
            if now == last:
                break
            last = now
        fetched = _fetched(it)
        reader = it._reader
        in_hand = len(reader._chunk) - reader._chunk_pos  # popped from the queue, not taken
        assert 1_000 < fetched <= 1_000 + in_hand + 500, (fetched, in_hand)
        rest = [int(e[0]) for e in it]
        assert rest == list(range(1_000, 100_000))
    finally:
        it.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("same_port", [True, False], ids=["same-port", "new-port"])
@pytest.mark.parametrize("protocol", ["grpc", "shm"])
def test_a_worker_restarted_halfway_is_seen_by_its_consumer(make_cluster, protocol, same_port):
    """OFF: the worker's new process starts the task's stream over, and the consumer
    gets that stream after at most the old stream's elements its reader had fetched
    (never the old stream's end, which would end the read)."""
    cluster = make_cluster(0, fault_tolerant=True)
    port = _free_port()
    worker = cluster.add_worker(port=port)
    n = 104
    it = iter(
        ds.Dataset.range(n).apply(
            ds.distribute(OFF, cluster.target, data_transfer_protocol=protocol)
        )
    )
    try:
        assert [int(next(it)) for _ in range(n // 2)] == list(range(n // 2))
        reader = it._reader
        in_hand = len(reader._chunk) - reader._chunk_pos  # popped from the queue, not taken
        worker.stop()
        cluster.workers.remove(worker)
        cluster.add_worker(port=port if same_port else _free_port())
        old = []
        while (x := int(next(it))) != 0:
            old.append(x)
        assert old == list(range(n // 2, n // 2 + len(old)))
        # At most the read-ahead when the worker stopped, besides the chunk in hand.
        assert len(old) <= in_hand + max(16, (n // 2) // 2), (old, in_hand)
        assert [int(x) for x in it] == list(range(1, n))
    finally:
        it.close()


def test_requests_sent_ahead_are_within_the_byte_bound(monkeypatch):
    """With requests sent ahead, a request asks for at most half the transfer
    client's bound on unconsumed bytes, so one reply can land while the last is
    unconsumed; the request sent ahead counts in the bound until it lands."""

    class _Fetching(fetch.TaskFetching):
        def __init__(self) -> None:
            self._buffered_elements = 0
            self._buffered_bytes = 0
            self._ahead_elements = 0
            self._fetch_elements = 1024
            self._buffer_elements = 8192

            class _Stats:
                elements = 10_000

            self.stats = _Stats()  # type: ignore[assignment]

    f = _Fetching()
    endpoint = base.TaskEndpoint(1, "w", "w", "")
    state = fetch._TaskState(endpoint, max_unconsumed_bytes=16 << 20, max_reply_bytes=16 << 20)
    assert f._byte_room_locked(state, False) == 16 << 20
    assert f._byte_room_locked(state, True) == 8 << 20
    state.unconsumed_bytes = 8 << 20  # the last reply, unconsumed
    assert f._plan_ahead_locked(state, 150_000) == (1024, 8 << 20)
    assert (f._ahead_elements, state.ahead_bytes, state.fetching) == (1024, 8 << 20, True)
    assert f._byte_room_locked(state, True) == 0  # nothing more until it lands
    assert f._room_locked() == 5000 - 1024
    f._ahead_landed_locked(state)
    assert (f._ahead_elements, state.ahead_elements, state.ahead_bytes) == (0, 0, 0)
    state.unconsumed_bytes = (16 << 20) - 100_000
    assert f._plan_ahead_locked(state, 150_000) is None  # no room for one such element
    assert f._ahead_elements == 0
