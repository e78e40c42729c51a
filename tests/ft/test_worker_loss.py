"""A consumer never hangs when workers die, and losses are visible (CASES K4).

Whatever ends a worker process (`os._exit` in a map, SIGKILL, SIGSTOP past the
dispatcher's worker timeout), the consumer either makes progress or raises
`WorkerCrashedError` naming the worker, its pid and how it ended, within a
bounded time; DYNAMIC splits the lost worker held are counted in
`it.stats()["lost_workers"]` and the client logs one WARNING per lost worker.

Kinds of servers: LocalCluster worker processes (which watch their children
and tell the dispatcher of each exit), `dataservice worker` CLI processes with
an in-process dispatcher (found dead by the dispatcher's probe of their port),
and in-process `WorkerServer`s. Both transfer protocols (shared memory, gRPC).
After each test: no new /dev/shm entry of ours, no child process left.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

import dataservice as ds
from dataservice import errors

from .conftest import HEARTBEAT_MS, Servers, ThreadReader, exit_at_once, wait_until

PROTOCOLS = ["grpc", "shm"]


def _block_at(index: int):
    """A map function that never returns at element `index` (the consumer waits)."""

    def fn(x):
        if int(x) == index:
            time.sleep(3600)
        time.sleep(0.001)  # slow enough that each element is handed out at once
        return x

    return fn


def _slow(seconds: float):
    def fn(x):
        time.sleep(seconds)
        return x

    return fn


# ------------------------------------------------------------ LocalCluster


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("mode", ["off", "distributed_epoch"])
def test_os_exit_in_map_without_restarts_raises_naming_pid_and_exit_code(
    protocol: str, mode: str, tmp_path
) -> None:
    with ds.LocalCluster(
        1,
        restart_workers=False,
        worker_options={"heartbeat_interval_ms": HEARTBEAT_MS, "data_transfer_protocol": protocol},
    ) as cluster:
        pid = cluster.worker_pids[0]
        data = (
            ds.Dataset.range(10_000)
            .map(exit_at_once(str(tmp_path), 300, 7))
            .apply(ds.distribute(mode, cluster.target, data_transfer_protocol=protocol))
        )
        t0 = time.monotonic()
        reader = ThreadReader(iter(data))
        reader.join(30)
        took = time.monotonic() - t0
        assert isinstance(reader.error, errors.WorkerCrashedError), reader.error
        message = str(reader.error)
        assert f"pid {pid}" in message and "exited with code 7" in message, message
        assert "restart_workers=False" in message
        assert took < 20, f"the error took {took:.1f} s"
        assert cluster.failed_workers and cluster.num_restarts == 0


def _segfault_at(index: int):
    def fn(x):
        if int(x) == index:
            import ctypes

            ctypes.string_at(0)  # reads address 0: SIGSEGV
        return x

    return fn


def test_a_segfault_in_map_without_restarts_raises_naming_the_signal() -> None:
    with ds.LocalCluster(
        1, restart_workers=False, worker_options={"heartbeat_interval_ms": HEARTBEAT_MS}
    ) as cluster:
        pid = cluster.worker_pids[0]
        data = (
            ds.Dataset.range(1000)
            .map(_segfault_at(100))
            .apply(ds.distribute("off", cluster.target))
        )
        reader = ThreadReader(iter(data))
        reader.join(30)
        assert isinstance(reader.error, errors.WorkerCrashedError), reader.error
        message = str(reader.error)
        assert f"pid {pid}" in message and "killed by signal 11 (SIGSEGV)" in message, message


def test_one_of_two_workers_exiting_without_restarts_leaves_the_other_serving(
    tmp_path, caplog
) -> None:
    """OFF over 2 workers, restarts off: one worker's exit is no failure while
    the other serves; the read ends with the survivor's full copy, and the
    lost one is listed in stats() and warned about once."""
    with ds.LocalCluster(
        2, restart_workers=False, worker_options={"heartbeat_interval_ms": HEARTBEAT_MS}
    ) as cluster:
        n = 2000

        def tag(x):
            return x, os.getpid()

        data = (
            ds.Dataset.range(n)
            .map(exit_at_once(str(tmp_path), 300, 5))
            .map(tag)
            .apply(ds.distribute("off", cluster.target))
        )
        with caplog.at_level(logging.WARNING, logger="dataservice.client.reader"):
            it = iter(data)
            by_pid: dict[int, list[int]] = {}
            for x, pid in it:
                by_pid.setdefault(int(pid), []).append(int(x))
        survivors = [p for p in cluster.worker_pids if p in by_pid and len(by_pid[p]) == n]
        assert len(survivors) == 1, {p: len(v) for p, v in by_pid.items()}
        assert by_pid[survivors[0]] == list(range(n))
        lost = it.stats()["lost_workers"]
        assert len(lost) == 1 and "exited with code 5" in lost[0]["reason"], lost
        assert lost[0]["pid"] != survivors[0] and not lost[0]["restarting"]
        warnings = [r for r in caplog.records if "lost worker" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_sigkill_of_the_only_worker_while_next_waits_raises_naming_the_signal(
    protocol: str,
) -> None:
    with ds.LocalCluster(
        1,
        restart_workers=False,
        worker_options={"heartbeat_interval_ms": HEARTBEAT_MS, "data_transfer_protocol": protocol},
    ) as cluster:
        pid = cluster.worker_pids[0]
        data = (
            ds.Dataset.range(1000)
            .map(_block_at(0))
            .apply(ds.distribute("off", cluster.target, data_transfer_protocol=protocol))
        )
        reader = ThreadReader(iter(data))
        time.sleep(1.5)  # next() is waiting: the pipeline never returns element 0
        assert reader.count == 0 and reader.error is None
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        reader.join(30)
        assert isinstance(reader.error, errors.WorkerCrashedError), reader.error
        message = str(reader.error)
        assert f"pid {pid}" in message, message
        assert "killed by signal 9 (SIGKILL), maybe by the kernel's OOM killer" in message
        assert "last RSS" in message
        assert reader.ended_at - killed_at < 10, f"{reader.ended_at - killed_at:.1f} s"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_default_cluster_restarts_a_worker_that_exits_and_the_read_goes_on(
    protocol: str, tmp_path, caplog
) -> None:
    with ds.LocalCluster(
        1,
        worker_options={"heartbeat_interval_ms": HEARTBEAT_MS, "data_transfer_protocol": protocol},
    ) as cluster:
        data = (
            ds.Dataset.range(2000)
            .map(exit_at_once(str(tmp_path), 300, 3))
            .apply(ds.distribute("distributed_epoch", cluster.target))  # the worker's protocol
        )
        with caplog.at_level(logging.WARNING, logger="dataservice.client.reader"):
            it = iter(data)
            got = [int(x) for x in it]
        wait_until(lambda: cluster.num_restarts == 1, 10, "the monitor sees the restart")
        assert 300 <= len(got) < 2000 and len(set(got)) == len(got)
        lost = it.stats()["lost_workers"]
        assert len(lost) == 1, lost
        entry = lost[0]
        assert entry["restarting"] and "exited with code 3" in entry["reason"]
        assert entry["address"] == cluster.worker_addresses[0]
        # One element per split, one consumer: what did not arrive is counted exactly.
        assert entry["elements_lost"] == entry["splits_lost"] == 2000 - len(got), entry
        warnings = [r for r in caplog.records if "lost worker" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert f"{entry['splits_lost']} of the" in warnings[0].getMessage()


def test_a_slow_consumer_never_trips_the_worker_loss_timeout() -> None:
    with ds.LocalCluster(1, worker_options={"heartbeat_interval_ms": HEARTBEAT_MS}) as cluster:
        data = ds.Dataset.range(6).apply(
            ds.distribute("off", cluster.target, worker_loss_timeout_ms=200)
        )
        got = []
        for x in data:
            got.append(int(x))
            time.sleep(0.5)  # far longer than the timeout, between elements
        assert got == list(range(6))


def test_worker_loss_timeout_rejects_bad_values() -> None:
    for bad in (0, -1, 1.5, "60", True):
        with pytest.raises(ValueError, match="worker_loss_timeout_ms"):
            ds.distribute("off", "localhost:1", worker_loss_timeout_ms=bad)
    ds.distribute("off", "localhost:1", worker_loss_timeout_ms=None)  # waits forever


# ------------------------------------------------------------ CLI workers


def _inprocess_dispatcher(**kw) -> ds.DispatchServer:
    return ds.DispatchServer(ds.DispatcherConfig(**kw))


@pytest.mark.parametrize("protocol", [pytest.param("grpc", marks=pytest.mark.slow), "shm"])
def test_sigkill_of_one_of_two_cli_workers_ends_a_dynamic_epoch_promptly(
    servers: Servers, protocol: str, caplog
) -> None:
    """The default 300 s worker timeout is in force: the dispatcher finds the
    dead worker by its refused port, so the epoch ends within seconds, and
    the consumer reports exactly what was lost."""
    dispatcher = _inprocess_dispatcher()
    try:
        target = dispatcher.target.replace("localhost", "127.0.0.1")
        workers = servers.workers(target.removeprefix("grpc://"), 2, heartbeat_interval_ms=1000)
        n = 4000
        data = (
            ds.Dataset.range(n)
            .map(_slow(0.002))
            .apply(ds.distribute("distributed_epoch", target, data_transfer_protocol=protocol))
        )
        with caplog.at_level(logging.WARNING, logger="dataservice.client.reader"):
            reader = ThreadReader(iter(data))
            wait_until(lambda: reader.count >= 400, 60, "400 elements")
            victim = workers[0]
            killed_at = victim.kill()
            reader.join(60)
        assert reader.error is None, reader.error
        took = reader.ended_at - killed_at
        assert took < 12, f"the epoch ended {took:.1f} s after the kill"
        stats = reader.it.stats()
        lost = stats["lost_workers"]
        assert len(lost) == 1, lost
        entry = lost[0]
        assert entry["address"] == victim.address and entry["pid"] == victim.pid, entry
        assert "refuses connections" in entry["reason"]
        assert entry["elements_lost"] is not None and entry["elements_lost"] > 0
        assert reader.count + entry["elements_lost"] == n, (reader.count, entry)
        warnings = [r.getMessage() for r in caplog.records if "lost worker" in r.getMessage()]
        assert len(warnings) == 1 and victim.address in warnings[0], warnings
    finally:
        dispatcher.stop()


def test_sigkill_of_the_only_cli_worker_raises_after_the_worker_loss_timeout(
    servers: Servers,
) -> None:
    dispatcher = _inprocess_dispatcher()
    try:
        target = dispatcher.target.replace("localhost", "127.0.0.1")
        (worker,) = servers.workers(target.removeprefix("grpc://"), 1, heartbeat_interval_ms=500)
        data = (
            ds.Dataset.range(1000)
            .map(_block_at(10))
            .apply(ds.distribute("off", target, worker_loss_timeout_ms=2000))
        )
        reader = ThreadReader(iter(data))
        wait_until(lambda: reader.count >= 10, 30, "10 elements")
        killed_at = worker.kill()
        reader.join(30)
        assert isinstance(reader.error, errors.WorkerCrashedError), reader.error
        message = str(reader.error)
        assert worker.address in message and f"pid {worker.pid}" in message, message
        assert "worker_loss_timeout_ms" in message
        took = reader.ended_at - killed_at
        assert 2 <= took < 10, f"raised {took:.1f} s after the kill"
    finally:
        dispatcher.stop()


def test_coordinated_reads_raise_after_the_worker_loss_timeout(servers: Servers) -> None:
    """Coordinated reads (num_consumers) whose only worker was SIGKILLed raise
    WorkerCrashedError after worker_loss_timeout_ms, naming the worker and the
    round, not after the dispatcher's client_timeout_ms (5 min by default)."""
    dispatcher = _inprocess_dispatcher()
    try:
        target = dispatcher.target.replace("localhost", "127.0.0.1")
        (worker,) = servers.workers(target.removeprefix("grpc://"), 1, heartbeat_interval_ms=500)
        data = (
            ds.Dataset.range(10**6)
            .repeat()
            .apply(
                ds.distribute(
                    "off",
                    target,
                    job_name="coordinated-loss",
                    consumer_index=0,
                    num_consumers=1,
                    worker_loss_timeout_ms=2000,
                )
            )
        )
        reader = ThreadReader(iter(data))
        wait_until(lambda: reader.count >= 10, 30, "10 rounds")
        killed_at = worker.kill()
        reader.join(30)
        assert isinstance(reader.error, errors.WorkerCrashedError), reader.error
        message = str(reader.error)
        assert worker.address in message, message
        took = reader.ended_at - killed_at
        assert took < 15, f"raised {took:.1f} s after the kill"
    finally:
        dispatcher.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_sigstopped_worker_raises_after_the_worker_loss_timeout(
    servers: Servers, protocol: str
) -> None:
    """The dispatcher's worker timeout is the default 300 s: the consumer
    waiting on a stopped worker (no heartbeat) raises after
    worker_loss_timeout_ms all the same, naming it and its pid; the worker
    goes on after SIGCONT."""
    dispatcher = _inprocess_dispatcher()
    try:
        target = dispatcher.target.replace("localhost", "127.0.0.1")
        (worker,) = servers.workers(target.removeprefix("grpc://"), 1, heartbeat_interval_ms=200)
        data = (
            ds.Dataset.range(100_000)
            .map(_slow(0.001))
            .apply(
                ds.distribute(
                    "off", target, data_transfer_protocol=protocol, worker_loss_timeout_ms=2000
                )
            )
        )
        reader = ThreadReader(iter(data))
        wait_until(lambda: reader.count >= 50, 30, "50 elements")
        stopped_at = time.monotonic()
        worker.send(signal.SIGSTOP)
        reader.join(40)
        assert isinstance(reader.error, errors.WorkerCrashedError), reader.error
        message = str(reader.error)
        assert "no heartbeat" in message and f"pid {worker.pid}" in message, message
        assert worker.address in message and "SIGSTOP" in message
        took = reader.ended_at - stopped_at
        assert 2 < took < 12, f"raised {took:.1f} s after SIGSTOP"
        assert dispatcher.num_workers() == 1  # not dropped: it may still come back
    finally:
        worker.send(signal.SIGCONT)
        dispatcher.stop()


@pytest.mark.timeout(120)
def test_a_worker_declared_lost_that_comes_back_takes_its_loss_back(
    servers: Servers, caplog
) -> None:
    """One of two workers SIGSTOPped past the dispatcher's worker timeout (2 s)
    is declared lost (a WARNING announces its DYNAMIC splits lost), then
    SIGCONTed while the epoch goes on: it is the same process, gets its task
    back and delivers what it held. The epoch is exact, `lost_workers` is empty
    at the end, and a WARNING takes the announced loss back."""
    caplog.set_level(logging.WARNING, logger="dataservice")
    dispatcher = _inprocess_dispatcher(worker_timeout_ms=2000)
    try:
        target = dispatcher.target.replace("localhost", "127.0.0.1")
        stopped, other = servers.workers(
            target.removeprefix("grpc://"), 2, heartbeat_interval_ms=200
        )
        n = 20_000
        it = iter(
            ds.Dataset.range(n)
            .map(_slow(0.0005))
            .apply(ds.distribute("dynamic", target, worker_loss_timeout_ms=60_000))
        )
        reader = ThreadReader(it)
        wait_until(lambda: reader.count >= 500, 30, "500 elements")
        stopped.send(signal.SIGSTOP)
        try:
            wait_until(lambda: it.stats()["lost_workers"], 30, "the consumer to hear of the loss")
        finally:
            stopped.send(signal.SIGCONT)
        assert reader.count < n, "the epoch ended before the worker came back"
        reader.join(60)
        assert reader.error is None, reader.error
        assert reader.count == n and reader.seen == set(range(n))
        assert it.stats()["lost_workers"] == []
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"lost worker {stopped.address}" in m for m in messages), messages
        assert any(
            f"worker {stopped.address} (pid {stopped.pid}) was only slow, not lost" in m
            for m in messages
        ), messages
    finally:
        dispatcher.stop()


@pytest.mark.slow
def test_a_sigstopped_worker_past_the_worker_timeout_raises(servers: Servers) -> None:
    """Stopped past the dispatcher's worker timeout: the worker is dropped,
    and the consumer raises naming it once worker_loss_timeout_ms passed."""
    dispatcher = _inprocess_dispatcher(worker_timeout_ms=3000)
    try:
        target = dispatcher.target.replace("localhost", "127.0.0.1")
        (worker,) = servers.workers(target.removeprefix("grpc://"), 1, heartbeat_interval_ms=200)
        data = (
            ds.Dataset.range(100_000)
            .map(_slow(0.001))
            .apply(ds.distribute("off", target, worker_loss_timeout_ms=5000))
        )
        reader = ThreadReader(iter(data))
        wait_until(lambda: reader.count >= 50, 30, "50 elements")
        stopped_at = time.monotonic()
        worker.send(signal.SIGSTOP)
        reader.join(40)
        assert isinstance(reader.error, errors.WorkerCrashedError), reader.error
        message = str(reader.error)
        assert "no heartbeat" in message and f"pid {worker.pid}" in message, message
        took = reader.ended_at - stopped_at
        assert 4 < took < 20, f"raised {took:.1f} s after SIGSTOP"
        assert dispatcher.num_workers() == 0
    finally:
        worker.send(signal.SIGCONT)
        dispatcher.stop()


# ------------------------------------------------------------ in-process servers


def test_a_cli_worker_restarted_on_its_port_at_once_reports_what_it_lost(
    servers: Servers, caplog
) -> None:
    """A supervisor other than LocalCluster's (systemd, Kubernetes, a script)
    restarts a SIGKILLed worker on its port before anything finds it dead: the
    dispatcher sees a new process register on the address and counts what the
    old one held lost, as for a reported exit, so the consumer warns and
    read + lost is the epoch (was: ~1,400 of 6,000 elements missing and
    `lost_workers` empty)."""
    dispatcher = _inprocess_dispatcher()
    try:
        target = dispatcher.target.replace("localhost", "127.0.0.1")
        addr = target.removeprefix("grpc://")
        # 3 s heartbeats: a port found refusing is judged after up to two intervals
        # (liveness.py), so the new process registers first even on a loaded machine.
        workers = servers.workers(addr, 2, heartbeat_interval_ms=3000)
        n = 4000
        data = (
            ds.Dataset.range(n)
            .map(_slow(0.002))
            .apply(ds.distribute("distributed_epoch", target, data_transfer_protocol="grpc"))
        )
        with caplog.at_level(logging.WARNING, logger="dataservice.client.reader"):
            reader = ThreadReader(iter(data))
            wait_until(lambda: reader.count >= 400, 60, "400 elements")
            victim = workers[0]
            victim.kill()
            servers.worker(addr, heartbeat_interval_ms=3000, extra=("--port", str(victim.port)))
            reader.join(90)
        assert reader.error is None, reader.error
        lost = reader.it.stats()["lost_workers"]
        assert len(lost) == 1, lost
        entry = lost[0]
        assert entry["address"] == victim.address and entry["pid"] == victim.pid, entry
        assert "replaced by a new process" in entry["reason"], entry
        assert entry["elements_lost"] is not None and entry["elements_lost"] > 0, entry
        assert reader.count + entry["elements_lost"] == n, (reader.count, entry)
        warnings = [r.getMessage() for r in caplog.records if "lost worker" in r.getMessage()]
        assert len(warnings) == 1 and victim.address in warnings[0], warnings
    finally:
        dispatcher.stop()


def _two_inprocess_workers(dispatcher: ds.DispatchServer, protocol: str) -> list[ds.WorkerServer]:
    return [
        ds.WorkerServer(
            ds.WorkerConfig(
                dispatcher.target,
                heartbeat_interval_ms=200,
                worker_address="127.0.0.1:%port%",
                data_transfer_protocol=protocol,
            )
        )
        for _ in range(2)
    ]


def _slow_dynamic_epoch(n: int, dispatcher: ds.DispatchServer, protocol: str) -> ds.Dataset:
    """range(n), 1 ms an element, read DYNAMIC from `dispatcher` over `protocol`."""
    return (
        ds.Dataset.range(n)
        .map(_slow(0.001))
        .apply(
            ds.distribute("distributed_epoch", dispatcher.target, data_transfer_protocol=protocol)
        )
    )


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_in_process_worker_that_stops_mid_epoch_is_found_and_reported(
    protocol: str,
) -> None:
    dispatcher = _inprocess_dispatcher()
    workers = _two_inprocess_workers(dispatcher, protocol)
    try:
        n = 3000
        reader = ThreadReader(iter(_slow_dynamic_epoch(n, dispatcher, protocol)))
        wait_until(lambda: reader.count >= 300, 60, "300 elements")
        stopped_at = time.monotonic()
        workers[0].stop()  # its port closes, its heartbeats stop
        reader.join(60)
        assert reader.error is None, reader.error
        assert reader.ended_at - stopped_at < 10
        lost = reader.it.stats()["lost_workers"]
        assert [e["address"] for e in lost] == [workers[0].address], lost
        assert lost[0]["pid"] == os.getpid()
        assert reader.count + lost[0]["elements_lost"] == n
    finally:
        for w in workers:
            w.stop()
        dispatcher.stop()


@pytest.mark.parametrize("protocol", ["grpc", pytest.param("shm", marks=pytest.mark.slow)])
def test_a_worker_stopped_while_its_split_fetch_retries_fails_no_read(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stopped (SIGTERM, a scale-down) while its pipeline's GetSplits
    is retrying: the stop cancels the retries, which is the worker's doing, not
    the pipeline's failure, so the consumer does not get it as the task's error
    (it got `CancelledError: GetSplits ... cancelled`); the worker is lost like
    any other, and the epoch ends with every element read or counted lost."""
    import grpc

    from dataservice.dispatcher import server as dispatcher_server
    from dataservice.worker import task_runner

    refuse = threading.Event()
    refused = threading.Event()
    grant = dispatcher_server._Servicer.GetSplits

    def get_splits(self, request, context):  # noqa: ANN001, ANN202
        if refuse.is_set():
            refused.set()
            context.abort(grpc.StatusCode.UNAVAILABLE, "the test refuses splits for now")
        return grant(self, request, context)

    monkeypatch.setattr(dispatcher_server._Servicer, "GetSplits", get_splits)
    # A worker's stop takes its time (in a busy process, the GIL; a CLI worker, its
    # servers): the pipeline may fail from the stop before its task is stopped.
    stop_task = task_runner.TaskRunner.stop

    def slow_stop(self):  # noqa: ANN001, ANN202
        time.sleep(0.5)
        stop_task(self)

    monkeypatch.setattr(task_runner.TaskRunner, "stop", slow_stop)
    dispatcher = _inprocess_dispatcher()
    workers = _two_inprocess_workers(dispatcher, protocol)
    try:
        n = 3000
        reader = ThreadReader(iter(_slow_dynamic_epoch(n, dispatcher, protocol)))
        wait_until(lambda: reader.count >= 100, 60, "100 elements")
        refuse.set()
        assert refused.wait(30), "no GetSplits came while refused"
        # Both pipelines retry once the splits they hold are read: the count stops.
        last, still_since = reader.count, time.monotonic()
        while time.monotonic() - still_since < 0.5:
            time.sleep(0.05)
            if reader.count != last:
                last, still_since = reader.count, time.monotonic()
        workers[0].stop()
        time.sleep(0.5)  # worker 1's retries go on failing past the stop
        refuse.clear()
        reader.join(60)
        assert reader.error is None, repr(reader.error)
        lost = reader.it.stats()["lost_workers"]
        assert [e["address"] for e in lost] == [workers[0].address], lost
        assert reader.count + lost[0]["elements_lost"] == n
    finally:
        for w in workers:
            w.stop()
        dispatcher.stop()


def test_restart_on_the_same_address_after_being_declared_lost_serves_again(
    servers: Servers,
) -> None:
    """A CLI worker SIGKILLed and started again on its port is taken back,
    and an OFF read started after that reads everything from it."""
    dispatcher = _inprocess_dispatcher()
    try:
        target = dispatcher.target.replace("localhost", "127.0.0.1")
        addr = target.removeprefix("grpc://")
        (worker,) = servers.workers(addr, 1, heartbeat_interval_ms=200)
        port = worker.port
        assert [int(x) for x in ds.Dataset.range(5).apply(ds.distribute("off", target))] == list(
            range(5)
        )
        worker.kill()
        wait_until(lambda: dispatcher.num_workers() == 0, 10, "the dispatcher drops the worker")
        servers.worker(addr, heartbeat_interval_ms=200, extra=("--port", str(port)))
        wait_until(lambda: dispatcher.num_workers() == 1, 20, "the worker registers again")
        got = [int(x) for x in ds.Dataset.range(5).apply(ds.distribute("off", target))]
        assert got == list(range(5))
    finally:
        dispatcher.stop()
