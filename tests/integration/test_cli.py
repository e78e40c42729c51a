"""The `dataservice` command: flags, ready lines, signals, exit codes."""

from __future__ import annotations

import logging
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time

import pytest

import dataservice as ds
from dataservice import cli
from dataservice.config import DispatcherConfig, WorkerConfig, config_fields

READY = re.compile(r"^dataservice (dispatcher|worker) listening on (\S+):(\d+)$")


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dataservice", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ready_line(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> re.Match[str]:
    """The first stdout line, which must be the ready line, read with a deadline."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            proc.kill()
            pytest.fail(f"no ready line within {timeout_s} s; stderr: {proc.communicate()[1]}")
    line = proc.stdout.readline().rstrip("\n")
    m = READY.match(line)
    assert m, f"not a ready line: {line!r}; stderr: {proc.communicate(timeout=10)[1]}"
    return m


def _finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"pid {proc.pid} still running after {timeout_s} s; stderr: {err}")
    return proc.returncode, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_dispatcher_prints_address_and_stops_on_signal(signum: int) -> None:
    proc = _spawn("dispatcher", "--port", "0")
    m = _ready_line(proc)
    assert m.group(1) == "dispatcher" and m.group(2) == "127.0.0.1"
    port = int(m.group(3))
    assert port > 0
    socket.create_connection(("127.0.0.1", port), timeout=5).close()  # it serves
    proc.send_signal(signum)
    code, err = _finish(proc, 15)
    assert code == 0, err


@pytest.mark.timeout(60)
def test_worker_registers_and_both_stop_on_sigterm() -> None:
    dispatcher = _spawn("dispatcher", "--port", "0", "--job-gc-timeout-ms", "60000")
    try:
        d = _ready_line(dispatcher)
        worker = _spawn(
            "worker", "--dispatcher", f"{d.group(2)}:{d.group(3)}", "--heartbeat-interval-ms", "100"
        )
        w = _ready_line(worker)
        assert w.group(1) == "worker" and int(w.group(3)) > 0
        worker.send_signal(signal.SIGTERM)
        code, err = _finish(worker, 15)
        assert code == 0, err
    finally:
        dispatcher.send_signal(signal.SIGTERM)
        code, err = _finish(dispatcher, 15)
    assert code == 0, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dispatcher", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["dispatcher", "--port", "http"], "argument --port: invalid int value: 'http'"),
        (["dispatcher", "--port", "70000"], "port"),
        (["dispatcher", "--fault-tolerant"], "work_dir"),
        (["worker"], "required: --dispatcher-address/--dispatcher"),
        (["worker", "--dispatcher", "x:1", "--data-transfer-protocol", "tcp"], "data_transfer"),
        (["nonsense"], "invalid choice: 'nonsense'"),
        ([], "required: {dispatcher,worker,demo,status}"),
    ],
)
def test_bad_flags_exit_2_with_a_message(args: list[str], message: str) -> None:
    proc = _spawn(*args)
    code, err = _finish(proc, 30)
    assert code == 2, err
    assert message in err, err
    assert "usage: dataservice" in err


@pytest.mark.timeout(60)
def test_worker_with_unreachable_dispatcher_fails_naming_it() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    proc = _spawn("worker", "--dispatcher", address, "--dispatcher-timeout-ms", "1000")
    code, err = _finish(proc, 30)
    assert code != 0
    assert address in err, err
    assert "error" in err.lower()
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(60)
def test_server_exits_when_its_parent_pid_dies() -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        proc = _spawn("dispatcher", "--port", "0", "--parent-pid", str(parent.pid))
        _ready_line(proc)
    finally:
        parent.kill()
        parent.wait()
    _finish(proc, 5)


@pytest.mark.timeout(60)
def test_every_config_field_has_a_flag() -> None:
    parser = cli.build_parser()
    sub = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for command, cls in (("dispatcher", DispatcherConfig), ("worker", WorkerConfig)):
        options = {o for a in sub[command]._actions for o in a.option_strings}
        for field in config_fields(cls):
            assert "--" + field.name.replace("_", "-") in options, (command, field.name)
        assert "--parent-pid" in options
        assert "--parent-pid" not in sub[command].format_help()  # hidden
    assert "--fault-tolerant" in {o for a in sub["dispatcher"]._actions for o in a.option_strings}


@pytest.mark.timeout(60)
def test_flags_reach_the_config() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(
        [
            "dispatcher",
            "--port",
            "5050",
            "--work-dir",
            "/tmp/x",
            "--fault-tolerant",
            "--worker-addresses",
            "a:1,b:2",
            "--job-gc-timeout-ms",
            "600000",
        ]
    )
    config = DispatcherConfig(**cli._config_kwargs(args, DispatcherConfig))
    assert config == DispatcherConfig(
        port=5050,
        work_dir="/tmp/x",
        fault_tolerant_mode=True,
        worker_addresses=["a:1", "b:2"],
        job_gc_timeout_ms=600000,
    )
    args = parser.parse_args(["worker", "--dispatcher", "h:1", "--shm-ring-bytes", "4096"])
    config = WorkerConfig(**cli._config_kwargs(args, WorkerConfig))
    assert config == WorkerConfig(dispatcher_address="h:1", shm_ring_bytes=4096)


@pytest.mark.timeout(60)
def test_help_lists_the_subcommands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dataservice", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0
    for command in ("dispatcher", "worker", "demo"):
        assert command in out.stdout


def test_a_work_dir_without_fault_tolerance_is_said_to_be_unused(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dataservice"):
        d = ds.DispatchServer(ds.DispatcherConfig(work_dir=str(tmp_path)), start=False)
        d.stop()
        ds.DispatchServer(
            ds.DispatcherConfig(work_dir=str(tmp_path), fault_tolerant_mode=True), start=False
        ).stop()
    warned = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path) in warned[0] and "--fault-tolerant" in warned[0]
