"""Server processes: LocalCluster's token never on a command line, the CLI's
start-up warnings and refusals (no token beyond loopback, --insecure), and a
worker refused by its dispatcher exiting non-zero without its ready line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest

import dataservice as ds
from dataservice import _serverproc, auth, errors
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import service_pb2_grpc
from tests.conftest import values

READY = _serverproc.READY_RE


def _env(token: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != auth.AUTH_ENV}
    if token is not None:
        env[auth.AUTH_ENV] = token
    return env


def _run(args: list[str], env: dict[str, str], timeout_s: float = 30.0):
    return subprocess.run(
        [sys.executable, "-m", "dataservice", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
    )


def _start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """A server process and the address in its ready line (read with a deadline)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataservice", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(30):
            proc.kill()
            pytest.fail(f"no ready line; stderr: {proc.communicate()[1]}")
    line = proc.stdout.readline().strip()
    m = READY.match(line)
    if not m:
        proc.kill()
        pytest.fail(f"not a ready line {line!r}; stderr: {proc.communicate()[1]}")
    return proc, m.group(2)


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    return err


def _info(address: str, token: str | None) -> grpc.StatusCode:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.DispatcherServiceStub(channel)
        try:
            stub.GetDispatcherInfo(pb.DispatcherInfoRequest(), timeout=10, metadata=metadata)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def _get_elements(address: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.WorkerServiceStub(channel)
        try:
            stub.GetElements(pb.GetElementsRequest(), timeout=10)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_local_cluster_keeps_its_token_off_command_lines(monkeypatch):
    monkeypatch.delenv(auth.AUTH_ENV, raising=False)
    with ds.LocalCluster(num_workers=1, worker_options={"heartbeat_interval_ms": 200}) as c:
        token = c.auth_token
        assert len(token) >= 40
        for pid in (c.dispatcher_pid, *c.worker_pids):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            assert token.encode() not in cmdline
            assert b"--auth-token" not in cmdline
            with open(f"/proc/{pid}/environ", "rb") as f:  # readable by its own user only
                assert f"{auth.AUTH_ENV}={token}".encode() in f.read().split(b"\0")
            assert os.stat(f"/proc/{pid}/environ").st_mode & 0o077 == 0
        # Unauthenticated calls are refused by every server of the cluster ...
        assert _info(c.dispatcher_address, None) == grpc.StatusCode.UNAUTHENTICATED
        assert _info(c.dispatcher_address, "wrong") == grpc.StatusCode.UNAUTHENTICATED
        assert _get_elements(c.worker_addresses[0]) == grpc.StatusCode.UNAUTHENTICATED
        # ... while this process's clients send the token without being told.
        assert values(ds.Dataset.range(5).apply(ds.distribute("off", c.target))) == list(range(5))
        assert os.environ.get(auth.AUTH_ENV) is None  # not through our environment
    # Gone with the cluster: a later client of that address sends nothing.
    assert auth.client_token(c.dispatcher_address) is None


def test_local_cluster_uses_the_configured_token(monkeypatch):
    monkeypatch.delenv(auth.AUTH_ENV, raising=False)
    config = ds.DispatcherConfig(auth_token="given-token")
    with pytest.raises(ValueError, match="differs"):
        ds.LocalCluster(0, dispatcher_config=config, worker_options={"auth_token": "other"})
    with ds.LocalCluster(num_workers=0, dispatcher_config=config) as c:
        assert c.auth_token == "given-token"
        assert _info(c.dispatcher_address, "given-token") == grpc.StatusCode.OK
        with open(f"/proc/{c.dispatcher_pid}/cmdline", "rb") as f:
            assert b"given-token" not in f.read()


def test_cli_without_a_token_warns_loudly():
    proc, address = _start(["dispatcher", "--port", "0"], _env())
    err = _stop(proc)
    assert "WARNING" in err and "NO AUTH TOKEN" in err and "run code" in err
    assert address.startswith("127.0.0.1:")


def test_cli_refuses_a_wildcard_bind_without_a_token():
    out = _run(["dispatcher", "--port", "0", "--host", "0.0.0.0"], _env())
    assert out.returncode == 2  # a usage error, as argparse's
    assert "listening" not in out.stdout
    assert "without an auth token" in out.stderr and "--insecure" in out.stderr
    out = _run(["worker", "--dispatcher", "127.0.0.1:1", "--host", "0.0.0.0"], _env())
    assert out.returncode == 2 and "listening" not in out.stdout  # at once: no dispatcher wait
    assert "--insecure" in out.stderr


def test_cli_insecure_serves_a_wildcard_and_says_so():
    proc, address = _start(["dispatcher", "--port", "0", "--host", "0.0.0.0", "--insecure"], _env())
    try:
        host, _, port = address.rpartition(":")
        # Not "localhost": the address is for other hosts, which the wildcard serves.
        assert host == _serverproc.reachable_host() and host not in ("localhost", "0.0.0.0")
        assert _info(f"127.0.0.1:{port}", None) == grpc.StatusCode.OK
    finally:
        err = _stop(proc)
    assert "INSECURE" in err


def test_wildcard_ready_line_says_all_interfaces_and_still_parses():
    line = _serverproc.ready_line("dispatcher", "myhost:5050", "0.0.0.0")
    assert line == "dataservice dispatcher listening on myhost:5050 (on all interfaces, 0.0.0.0)"
    assert READY.search(line).group(2) == "myhost:5050"
    assert _serverproc.ready_line("worker", "127.0.0.1:5", "127.0.0.1").endswith("on 127.0.0.1:5")
    assert _serverproc.advertised_address("localhost:5050", "127.0.0.1") == "localhost:5050"
    assert _serverproc.advertised_address("localhost:5050", "::") == (
        f"{_serverproc.reachable_host()}:5050"
    )


def test_cli_token_beyond_loopback_warns_it_travels_in_clear(tmp_path):
    path = tmp_path / "token"
    path.write_text("file-token")
    path.chmod(0o600)
    args = ["dispatcher", "--port", "0", "--host", "0.0.0.0", "--auth-token-file", str(path)]
    proc, address = _start(args, _env())
    try:
        port = address.rsplit(":", 1)[1]
        assert _info(f"127.0.0.1:{port}", None) == grpc.StatusCode.UNAUTHENTICATED
        assert _info(f"127.0.0.1:{port}", "file-token") == grpc.StatusCode.OK
    finally:
        err = _stop(proc)
    assert "without TLS" in err and "NO AUTH TOKEN" not in err


def test_cli_auth_token_flag_warns_it_is_visible_in_ps():
    proc, _ = _start(["dispatcher", "--port", "0", "--auth-token", "flag-token"], _env())
    err = _stop(proc)
    assert "visible" in err or "can read" in err
    assert "--auth-token-file" in err


def test_refused_worker_exits_non_zero_without_its_ready_line():
    dispatcher, address = _start(["dispatcher", "--port", "0"], _env("right-token"))
    try:
        out = _run(["worker", "--dispatcher", address, "--port", "0"], _env("wrong-token"))
    finally:
        _stop(dispatcher)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "listening" not in out.stdout
    assert "UnauthenticatedError" in out.stderr
    assert address in out.stderr and auth.AUTH_ENV in out.stderr
    # A worker's advice, not a client's.
    assert "--auth-token-file" in out.stderr and "the worker's environment" in out.stderr
    assert "client's environment" not in out.stderr


def test_world_readable_token_file_is_warned_of_once(tmp_path):
    path = tmp_path / "token"
    path.write_text("file-token\n")
    path.chmod(0o644)
    proc, address = _start(["dispatcher", "--port", "0", "--auth-token-file", str(path)], _env())
    try:  # the trailing newline is stripped: the token is "file-token"
        assert _info(address, "file-token") == grpc.StatusCode.OK
    finally:
        err = _stop(proc)
    assert err.count("can be read by other users") == 1, err


@pytest.mark.parametrize("kind", ["dispatcher", "worker"])
def test_server_help_says_the_token_is_optional(kind):
    out = _run([kind, "--help"], _env())
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "is required" not in text
    assert "Optional." in text and "serves only loopback" in text


def test_cli_worker_with_the_token_in_its_environment_requires_it():
    dispatcher, address = _start(["dispatcher", "--port", "0"], _env("env-token"))
    try:
        worker, worker_address = _start(
            ["worker", "--dispatcher", address, "--port", "0"], _env("env-token")
        )
        try:
            assert _get_elements(worker_address) == grpc.StatusCode.UNAUTHENTICATED
        finally:
            _stop(worker)
    finally:
        _stop(dispatcher)


def test_client_refused_by_local_cluster_from_elsewhere_names_the_variable(monkeypatch):
    monkeypatch.delenv(auth.AUTH_ENV, raising=False)
    with ds.LocalCluster(num_workers=0) as c:
        # As a client in another process would be: no registry entry for this address.
        auth.unregister_token(c.dispatcher_address)
        with pytest.raises(errors.UnauthenticatedError, match=auth.AUTH_ENV):
            ds.register_dataset(c.target, ds.Dataset.range(3))
