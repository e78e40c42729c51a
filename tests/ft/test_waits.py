"""Every long wait says what it waits for (issue 10, item 1): one WARNING
after `_waits.FIRST_WARNING_S` naming the address / job / iteration, then one
every `_waits.REPEAT_WARNING_S`; a per-retry warning is logged once per worker.

The intervals are made small here: the module constants in this process, and
$DATASERVICE_WAIT_WARNING_MS / $DATASERVICE_WAIT_REPEAT_MS for server processes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

import dataservice as ds
from dataservice import _waits
from dataservice.client import connect
from dataservice.client import reader as reader_module
from dataservice.locality import host_id
from dataservice.sharding import ShardingPolicy
from dataservice.transfer import base as transfer
from dataservice.transfer import shm

from .conftest import Servers, wait_until

FIRST_S = 0.5
REPEAT_S = 2.0


@pytest.fixture
def short_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_waits, "FIRST_WARNING_S", FIRST_S)
    monkeypatch.setattr(_waits, "REPEAT_WARNING_S", REPEAT_S)
    monkeypatch.setenv(_waits.WAIT_WARNING_ENV, str(int(FIRST_S * 1000)))
    monkeypatch.setenv(_waits.WAIT_REPEAT_ENV, str(int(REPEAT_S * 1000)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _warnings(caplog: pytest.LogCaptureFixture, needle: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and needle in r.getMessage()]


def test_slow_wait_warns_after_the_first_interval_then_every_repeat_interval(
    short_waits, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    log = logging.getLogger("test.waits")
    wait = _waits.SlowWait(log, lambda: "waiting for the thing at h:1", start=100.0)
    logged = [t for t in (100.0, 100.4, 100.5, 101.0, 102.4, 102.5, 104.4, 104.6) if wait.check(t)]
    assert logged == [100.5, 102.5, 104.6]
    texts = [r.getMessage() for r in caplog.records if r.name == "test.waits"]
    assert texts == [
        "waiting for the thing at h:1 (waiting 0 s so far)",
        "waiting for the thing at h:1 (waiting 2 s so far)",
        "waiting for the thing at h:1 (waiting 5 s so far)",
    ]
    wait.done("the thing arrived")
    assert caplog.records[-1].levelno == logging.INFO
    assert caplog.records[-1].getMessage().startswith("the thing arrived after ")


def test_slow_wait_intervals_from_the_environment_reject_bad_values(monkeypatch) -> None:
    monkeypatch.setenv(_waits.WAIT_WARNING_ENV, "soon")
    with pytest.raises(ValueError, match=_waits.WAIT_WARNING_ENV):
        _waits.env_ms(_waits.WAIT_WARNING_ENV, 10_000)
    monkeypatch.setenv(_waits.WAIT_WARNING_ENV, "250")
    assert _waits.env_ms(_waits.WAIT_WARNING_ENV, 10_000) == 250
    monkeypatch.setenv(_waits.WAIT_WARNING_ENV, "-1")
    with pytest.raises(ValueError, match=_waits.WAIT_WARNING_ENV):
        _waits.env_ms(_waits.WAIT_WARNING_ENV, 10_000)


@pytest.mark.timeout(60)
def test_consumer_and_dispatcher_say_they_wait_for_a_worker(
    short_waits, caplog: pytest.LogCaptureFixture
) -> None:
    """A read from a dispatcher with no worker: the consumer's next() and the
    dispatcher's maintenance loop each warn, naming the dispatcher and the
    iteration, after FIRST_S, and again only after REPEAT_S; once a worker
    comes, the epoch completes."""
    caplog.set_level(logging.INFO)
    dispatcher = ds.DispatchServer()
    address = dispatcher.target.split("://")[1]
    worker = None
    try:
        dataset = ds.Dataset.range(5).apply(
            ds.distribute(ds.ShardingPolicy.OFF, dispatcher.target, job_name="waits")
        )
        out: list[int] = []
        t0 = time.time()  # LogRecord.created is wall-clock time
        reader = threading.Thread(target=lambda: out.extend(int(x) for x in dataset), daemon=True)
        reader.start()
        wait_until(
            lambda: len(_warnings(caplog, "is waiting for a worker")) >= 2,
            timeout_s=15,
            what="two consumer warnings",
        )
        consumer = _warnings(caplog, "is waiting for a worker")
        assert f"(dispatcher {address})" in consumer[0].getMessage()
        assert "job" in consumer[0].getMessage() and "'waits'" in consumer[0].getMessage()
        assert "no worker runs a task of it yet" in consumer[0].getMessage()
        first_at = consumer[0].created - t0
        assert FIRST_S * 0.9 <= first_at < FIRST_S + 3, first_at
        gap = consumer[1].created - consumer[0].created
        assert REPEAT_S * 0.9 <= gap < REPEAT_S + 3, gap
        served = _warnings(caplog, "consumers waiting and no worker")
        assert served, [r.getMessage() for r in caplog.records]
        text = served[0].getMessage()
        assert dispatcher.target in text and "no worker is registered" in text, text
        assert "'waits'" in text

        worker = ds.WorkerServer(ds.WorkerConfig(dispatcher.target, heartbeat_interval_ms=100))
        reader.join(30)
        assert not reader.is_alive()
        assert sorted(out) == list(range(5))
        assert any(
            "an element arrived after" in r.getMessage()
            for r in caplog.records
            if r.levelno == logging.INFO
        )
    finally:
        if worker is not None:
            worker.stop()
        dispatcher.stop()


@pytest.mark.timeout(60)
def test_the_falling_back_line_is_logged_once_per_worker(caplog, monkeypatch) -> None:
    """A same-host worker whose shared-memory socket refuses (e.g. it is
    restarting) is retried on every reconnect: "falling back" is one WARNING
    per worker address, later ones are DEBUG."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(shm, "_CONNECT_RETRY_S", 0.3)  # each refused connect's retries (3 s)
    if "shm" not in transfer.available_protocols():
        pytest.skip("no shared-memory transfer on this platform")
    reader = reader_module._Reader(
        reader_module.ReadOptions(
            dispatcher_address=f"127.0.0.1:{_free_port()}",
            processing_mode=ShardingPolicy.OFF,
            job_name="",
            num_consumers=0,
            consumer_index=0,
            max_outstanding_requests=None,
            data_transfer_protocol=None,
            target_workers="AUTO",
            client_timeout_ms=5_000,
        )
    )
    addresses = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    try:
        for _ in range(3):  # each try waits out a refused connect
            for i, address in enumerate(addresses):
                endpoint = transfer.TaskEndpoint(4000 + i, address, address, host_id())
                try:
                    reader._connect(endpoint).close()
                except ds.errors.DataServiceError:
                    pass  # nothing serves gRPC there either: counted below all the same
    finally:
        reader.close()
    for address in addresses:
        lines = [
            r
            for r in caplog.records
            if f"shm transfer to {address} unavailable" in r.getMessage()
            and "falling back" in r.getMessage()
        ]
        assert [r.levelno for r in lines] == [logging.WARNING] + [logging.DEBUG] * 2, [
            (r.levelname, r.getMessage()) for r in lines
        ]


@pytest.mark.timeout(60)
def test_a_worker_that_served_shared_memory_and_now_refuses_is_not_a_fallback(
    make_cluster, caplog
) -> None:
    """A same-host worker read over shared memory, then restarted: its refusal is
    not "shm unavailable; falling back" (it has shm, and the next reconnect tries
    it first); one that never served shared memory still gets that WARNING."""
    if "shm" not in transfer.available_protocols():
        pytest.skip("no shared-memory transfer on this platform")
    caplog.set_level(logging.DEBUG, logger="dataservice")
    cluster = make_cluster(1)
    address = cluster.workers[0].address
    dataset = ds.Dataset.range(5).apply(ds.distribute(ShardingPolicy.OFF, cluster.target))
    assert [int(x) for x in dataset] == list(range(5))
    endpoint = transfer.TaskEndpoint(4000, address, address, host_id())
    cluster.workers[0].stop()
    # (gRPC connects lazily: a client comes back, whose first fetch would fail)
    connect.connect(endpoint, None, None, zero_copy=True, trainer_id="", compression=None).close()
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if address in r.getMessage()]
    assert not [m for level, m in messages if "falling back" in m], messages
    assert [m for level, m in messages if "served this process before" in m], messages


@pytest.mark.timeout(90)
def test_worker_says_it_waits_for_its_dispatcher_then_that_it_is_back(
    servers: Servers, tmp_path, short_waits
) -> None:
    """A registered worker whose dispatcher is gone keeps serving and logs one
    WARNING naming the dispatcher's address after FIRST_S, the next only after
    REPEAT_S; when the dispatcher is back it says so (and does not exit)."""
    work_dir = str(tmp_path / "wd")
    dispatcher = servers.dispatcher(work_dir=work_dir, fault_tolerant=True)
    worker = servers.worker(dispatcher)
    port = dispatcher.port
    t_kill = dispatcher.kill()
    pattern = rf"no answer from the dispatcher at 127\.0\.0\.1:{port} to its heartbeats"
    first = worker.wait_line(pattern, timeout_s=20, since=t_kill)
    second = worker.wait_line(pattern, timeout_s=20, since=first + 0.001)
    assert FIRST_S * 0.9 <= first - t_kill < FIRST_S + 3, first - t_kill
    assert REPEAT_S * 0.9 <= second - first < REPEAT_S + 3, second - first
    assert worker.popen.poll() is None, "a registered worker must ride out its dispatcher"
    servers.dispatcher(port=port, work_dir=work_dir, fault_tolerant=True)
    worker.wait_line(rf"the dispatcher at 127\.0\.0\.1:{port} answers again", 30, since=second)
    assert worker.popen.poll() is None


@pytest.mark.timeout(60)
def test_rpc_retries_say_what_they_wait_for(short_waits, caplog, monkeypatch) -> None:
    """register_dataset against an address that answered before and is now
    gone (a restarting dispatcher): retried up to client_timeout_ms, with one
    WARNING naming the call and the address after FIRST_S."""
    caplog.set_level(logging.INFO)
    dispatcher = ds.DispatchServer()
    address = dispatcher.target.split("://")[1]
    ds.register_dataset(dispatcher.target, ds.Dataset.range(3))  # reached once
    dispatcher.stop()
    t0 = time.monotonic()
    with pytest.raises(ds.errors.UnavailableError, match=address):
        ds.register_dataset(dispatcher.target, ds.Dataset.range(3), client_timeout_ms=5_000)
    took = time.monotonic() - t0
    assert 4.5 < took < 8, took
    warned = _warnings(caplog, f"RegisterDataset to the dispatcher: no answer from {address}")
    # at FIRST_S, then every REPEAT_S: 0.5 s, 2.5 s and, when a retry falls in the
    # last half second, 4.5 s (checked at each retry, backing off up to 1 s apart)
    assert 2 <= len(warned) <= 3, [r.getMessage() for r in caplog.records]
    assert "retrying for up to 5000 ms" in warned[0].getMessage()


@pytest.mark.timeout(60)
def test_a_coordinated_consumer_says_which_round_and_worker_it_waits_for(
    short_waits, caplog: pytest.LogCaptureFixture
) -> None:
    """Coordinated reads with one of two consumers reading: the reader warns,
    naming the round, the worker and the job, until the dispatcher's
    client_timeout_ms ends the wait with DeadlineExceededError (C-27)."""
    caplog.set_level(logging.INFO)
    dispatcher = ds.DispatchServer(ds.DispatcherConfig(client_timeout_ms=5_000))
    worker = ds.WorkerServer(ds.WorkerConfig(dispatcher.target, heartbeat_interval_ms=100))
    try:
        dataset = (
            ds.Dataset.range(10)
            .repeat()
            .apply(
                ds.distribute(
                    ds.ShardingPolicy.OFF,
                    dispatcher.target,
                    job_name="coordinated",
                    consumer_index=0,
                    num_consumers=2,
                )
            )
        )
        got = 0
        with pytest.raises(ds.errors.DeadlineExceededError):
            for _ in dataset:
                got += 1
        warned = _warnings(caplog, "consumer 0 of 2 of iteration")
        assert 1 <= len(warned) <= 3, [r.getMessage() for r in warned]
        text = warned[0].getMessage()
        assert "'coordinated'" in text and f"from the worker {worker.address}" in text, text
        assert f"is waiting for round {got} " in text, (got, text)
        gaps = [b.created - a.created for a, b in zip(warned, warned[1:], strict=False)]
        assert all(g >= REPEAT_S * 0.9 for g in gaps), gaps
    finally:
        worker.stop()
        dispatcher.stop()


@pytest.mark.timeout(60)
def test_consumer_names_the_worker_it_cannot_fetch_from(
    short_waits, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker advertising an address this client cannot reach (C-09: the
    wrong `worker_address`): next()'s warning names that address and why
    its fetches fail."""
    caplog.set_level(logging.INFO)
    wrong = f"127.0.0.1:{_free_port()}"
    dispatcher = ds.DispatchServer()
    worker = ds.WorkerServer(
        ds.WorkerConfig(dispatcher.target, worker_address=wrong, heartbeat_interval_ms=100)
    )
    errors_seen: list[BaseException] = []
    try:
        it = iter(
            ds.Dataset.range(5).apply(
                ds.distribute(
                    ds.ShardingPolicy.OFF, dispatcher.target, data_transfer_protocol="grpc"
                )
            )
        )

        def read() -> None:
            try:
                next(it)
            except BaseException as err:  # the close() below ends the wait
                errors_seen.append(err)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_until(
            lambda: _warnings(caplog, "fetches keep failing from"),
            timeout_s=15,
            what="a warning naming the unreachable worker",
        )
        text = _warnings(caplog, "fetches keep failing from")[0].getMessage()
        assert f"an element from the workers {wrong}" in text, text
        assert f"fetches keep failing from {wrong} (UnavailableError" in text, text
        it.close()
        reader.join(10)
        assert not reader.is_alive()
        assert errors_seen and isinstance(errors_seen[0], ds.errors.CancelledError)
    finally:
        worker.stop()
        dispatcher.stop()
