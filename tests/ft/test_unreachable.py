"""Fail fast on an address that never answered (issue 10, item 2): refused,
unresolvable or nothing listening (`localhost` pointing at the wrong machine)
gives an error naming the address and the call within 10 s by default
(rpc/util.py `call_with_retries`, `DEFAULT_UNREACHABLE_TIMEOUT_MS`), for
clients and workers; a dispatcher that answered once and is now gone is
restarting, and is retried up to the full timeout.
"""

from __future__ import annotations

import threading
import time

import pytest

import dataservice as ds
from dataservice import errors
from dataservice.rpc import util as rpc_util

from .conftest import Servers, unanswered_port


def _register(address: str) -> None:
    ds.register_dataset(address, ds.Dataset.range(3))


def _iterate(address: str) -> None:
    list(ds.Dataset.range(3).apply(ds.distribute(ds.ShardingPolicy.OFF, address)))


def _from_dataset_id(address: str) -> None:
    list(ds.from_dataset_id(ds.ShardingPolicy.OFF, address, dataset_id="d1"))


@pytest.mark.timeout(60)
def test_the_default_bound_is_under_10_s_and_names_the_address() -> None:
    address = f"localhost:{unanswered_port()}"  # a dispatcher on another host, named wrongly
    t0 = time.monotonic()
    with pytest.raises(errors.UnavailableError) as info:
        _register(address)
    took = time.monotonic() - t0
    assert took < 10, took
    message = str(info.value)
    assert address in message and "RegisterDataset" in message, message
    assert "never answered" in message and "'localhost' is this machine" in message, message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("host", "call"),
    [
        (host, call)
        if i == j
        else pytest.param(host, call, marks=pytest.mark.slow)  # each call and each host in CI
        for i, host in enumerate(["127.0.0.1", "localhost", "no-such-host.invalid"])
        for j, call in enumerate([_register, _iterate, _from_dataset_id])
    ],
)
def test_client_calls_fail_fast_on_an_address_that_never_answered(
    call, host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(rpc_util.UNREACHABLE_ENV, "1500")
    address = f"{host}:{unanswered_port()}"
    t0 = time.monotonic()
    with pytest.raises(errors.UnavailableError, match="never answered within 1500 ms") as info:
        call(address)
    took = time.monotonic() - t0
    assert 1.4 < took < 6, took
    assert address in str(info.value), str(info.value)


@pytest.mark.timeout(60)
def test_client_timeout_ms_still_bounds_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    address = f"127.0.0.1:{unanswered_port()}"
    t0 = time.monotonic()
    with pytest.raises(errors.UnavailableError, match=f"{address}: it never answered within 1000"):
        ds.register_dataset(address, ds.Dataset.range(3), client_timeout_ms=1_000)
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(90)
def test_a_dispatcher_that_answered_once_is_retried_while_it_restarts(
    servers: Servers, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Never reached" and "reached, now gone" differ: with a 1 s bound for
    unreachable addresses, a restart that takes 3 s is still ridden through."""
    monkeypatch.setenv(rpc_util.UNREACHABLE_ENV, "1000")
    work_dir = str(tmp_path / "wd")
    dispatcher = servers.dispatcher(work_dir=work_dir, fault_tolerant=True)
    dataset_id = ds.register_dataset(dispatcher.target, ds.Dataset.range(3))
    port = dispatcher.port
    t_kill = dispatcher.kill()
    restarted: list[float] = []

    def restart() -> None:
        time.sleep(3.0)  # the restart's length, not a synchronisation
        servers.dispatcher(port=port, work_dir=work_dir, fault_tolerant=True)
        restarted.append(time.monotonic())

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    again = ds.register_dataset(dispatcher.target, ds.Dataset.range(3))
    assert time.monotonic() - t_kill > 3.0
    thread.join(60)
    assert restarted and again == dataset_id


@pytest.mark.timeout(60)
def test_worker_process_exits_non_zero_on_a_dispatcher_address_nobody_answers(
    servers: Servers,
) -> None:
    address = f"localhost:{unanswered_port()}"
    worker = servers.worker(address, wait=False)
    code = worker.popen.wait(15)
    took = time.monotonic() - worker.started_at
    time.sleep(0.2)  # let the pumps read the last lines
    assert code != 0
    assert took < 12, took  # the interpreter's start-up, then the 8 s default bound
    text = worker.text()
    assert f"cannot reach {address}" in text and "never answered" in text, text


@pytest.mark.timeout(60)
def test_worker_process_unresolvable_dispatcher_host(servers: Servers) -> None:
    address = f"no-such-host.invalid:{unanswered_port()}"
    worker = servers.worker(
        address, wait=False, extra=("--dispatcher-unreachable-timeout-ms", "1500")
    )
    code = worker.popen.wait(15)
    took = time.monotonic() - worker.started_at
    time.sleep(0.2)
    assert code != 0 and took < 8, (code, took)
    assert f"cannot reach {address}" in worker.text(), worker.text()


@pytest.mark.timeout(60)
def test_in_process_worker_stops_with_an_error_naming_the_address() -> None:
    address = f"127.0.0.1:{unanswered_port()}"
    t0 = time.monotonic()
    worker = ds.WorkerServer(
        ds.WorkerConfig(address, heartbeat_interval_ms=100, dispatcher_unreachable_timeout_ms=1500)
    )
    try:
        with pytest.raises(errors.UnavailableError) as info:
            worker.join()
        assert time.monotonic() - t0 < 6
        assert address in str(info.value) and "never answered within 1500 ms" in str(info.value)
    finally:
        worker.stop()


def test_unreachable_bound_rejects_a_bad_environment_value(monkeypatch) -> None:
    monkeypatch.setenv(rpc_util.UNREACHABLE_ENV, "-5")
    with pytest.raises(ValueError, match=rpc_util.UNREACHABLE_ENV):
        rpc_util.unreachable_timeout_ms()
    with pytest.raises(ValueError, match="dispatcher_unreachable_timeout_ms"):
        ds.WorkerConfig("localhost:1", dispatcher_unreachable_timeout_ms=0)
