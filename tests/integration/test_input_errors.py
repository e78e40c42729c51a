"""Bad input named at once, before any RPC: tokens with a trailing newline or
characters gRPC metadata cannot carry, addresses with a port out of range, and
a worker's address given as the dispatcher's."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

import dataservice as ds
from dataservice import auth, errors
from tests.conftest import values

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ tokens
def test_env_token_with_a_trailing_newline_is_stripped(monkeypatch):
    monkeypatch.setenv(auth.AUTH_ENV, "env-token\n")
    assert auth.client_token(None) == "env-token"
    assert auth.resolve_token() == "env-token"


def test_client_reads_with_an_env_token_ending_in_a_newline(monkeypatch):
    monkeypatch.delenv(auth.AUTH_ENV, raising=False)
    with ds.LocalCluster(
        num_workers=1, dispatcher_config=ds.DispatcherConfig(auth_token="tok-1")
    ) as c:
        auth.unregister_token(c.dispatcher_address)  # as a client in another process
        monkeypatch.setenv(auth.AUTH_ENV, "tok-1\n")
        assert values(ds.Dataset.range(5).apply(ds.distribute("off", c.target))) == list(range(5))


@pytest.mark.parametrize("bad", ["to ken", "tok\x07en", "tök", "a\nb"])
def test_env_token_with_bad_characters_names_the_variable_before_any_rpc(monkeypatch, bad):
    monkeypatch.setenv(auth.AUTH_ENV, bad)
    start = time.monotonic()
    # Port 1: nothing listens; a ValueError before any RPC comes at once.
    with pytest.raises(ValueError, match=r"\$DATASERVICE_AUTH_TOKEN") as info:
        ds.register_dataset("127.0.0.1:1", ds.Dataset.range(3))
    assert time.monotonic() - start < 2.0
    assert bad not in str(info.value)


def test_token_argument_with_bad_characters_names_the_argument():
    with pytest.raises(ValueError, match="`auth_token` argument"):
        auth.client_token("127.0.0.1:1", "tok\n")


def test_token_file_with_a_trailing_newline_is_stripped(tmp_path):
    path = tmp_path / "token"
    path.write_text("  file-token\r\n")
    path.chmod(0o600)
    assert auth.resolve_token(auth_token_file=str(path)) == "file-token"
    path.write_text("file token\n")
    with pytest.raises(ValueError, match=str(path)):
        auth.resolve_token(auth_token_file=str(path))


# --------------------------------------------------------------- addresses
@pytest.mark.parametrize("target", ["127.0.0.1:99999", "grpc://localhost:65536", "localhost:0"])
def test_client_target_with_port_out_of_range_is_an_immediate_value_error(target):
    start = time.monotonic()
    with pytest.raises(ValueError, match="out of range") as info:
        list(ds.Dataset.range(3).apply(ds.distribute("off", target)))
    assert target.split("://")[-1] in str(info.value)
    assert time.monotonic() - start < 2.0


def test_config_addresses_with_port_out_of_range_are_value_errors():
    with pytest.raises(ValueError, match="`dispatcher_address` '127.0.0.1:99999'"):
        ds.WorkerConfig(dispatcher_address="127.0.0.1:99999")
    with pytest.raises(ValueError, match="`worker_address` 'h:70000'"):
        ds.WorkerConfig(dispatcher_address="localhost:5050", worker_address="h:70000")
    with pytest.raises(ValueError, match="`worker_addresses` entry 'b:0'"):
        ds.DispatcherConfig(worker_addresses=["a:%port%", "b:0"])
    # Still accepted: the port template, and a valid port.
    ds.WorkerConfig(dispatcher_address="grpc://localhost:5050", worker_address="h:%port%")


@pytest.mark.parametrize(
    "field,value,unit",
    [
        ("shm_ring_bytes", 0, "(bytes)"),
        ("shm_ring_bytes", True, "(bytes)"),
        ("cross_trainer_cache_size_bytes", -1, "(bytes)"),
        ("heartbeat_interval_ms", 0, "(milliseconds)"),
        ("dispatcher_timeout_ms", "5", "(milliseconds)"),
    ],
)
def test_config_positive_fields_name_their_unit(field: str, value: object, unit: str) -> None:
    with pytest.raises(ValueError) as info:
        ds.WorkerConfig("localhost:5050", **{field: value})
    assert str(info.value) == f"`{field}` must be a positive int {unit}, got {value!r}"


def test_cli_worker_with_port_out_of_range_exits_2_naming_the_address():
    out = subprocess.run(
        [sys.executable, "-m", "dataservice", "worker", "--dispatcher", "127.0.0.1:99999"],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 2, out.stderr
    assert "127.0.0.1:99999" in out.stderr and "out of range" in out.stderr


# ------------------------------------------------------------- wrong server
def test_worker_address_given_as_the_dispatcher_address_says_so():
    dispatcher = ds.DispatchServer()
    worker = ds.WorkerServer(ds.WorkerConfig(dispatcher.target, heartbeat_interval_ms=100))
    try:
        start = time.monotonic()
        with pytest.raises(errors.UnimplementedError) as info:
            ds.register_dataset(worker.address, ds.Dataset.range(3))
        message = str(info.value)
        assert f"the server at {worker.address} is not a dataservice dispatcher" in message
        assert "DispatcherService" in message and "worker's address" in message
        assert time.monotonic() - start < 5.0
    finally:
        worker.stop()
        dispatcher.stop()


@pytest.fixture
def http1_server():
    """An HTTP/1.0 server on a free loopback port (not gRPC): its address."""
    import http.server

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_http1_server_at_the_dispatcher_address_is_named_at_once(http1_server: str) -> None:
    """Every caller says the server there is not gRPC, at its first try, instead
    of retrying until its unreachable timeout (8 s) and saying nothing answers."""
    start = time.monotonic()
    with pytest.raises(errors.UnavailableError) as info:
        list(ds.Dataset.range(3).apply(ds.distribute("off", http1_server)))
    assert f"the server at {http1_server} is not a dataservice server" in str(info.value)
    assert "another protocol than gRPC's HTTP/2" in str(info.value)
    assert time.monotonic() - start < 5.0

    worker = ds.WorkerServer(ds.WorkerConfig(http1_server, heartbeat_interval_ms=100))
    joined: list[BaseException] = []

    def join() -> None:
        try:
            worker.join()  # returns (raising) once the worker stopped itself
        except BaseException as err:  # noqa: BLE001  (the test inspects it)
            joined.append(err)

    joiner = threading.Thread(target=join, daemon=True)
    joiner.start()
    joiner.join(10)
    try:
        assert not joiner.is_alive(), "the worker still waits to register after 10 s"
        (error,) = joined
        assert isinstance(error, errors.UnavailableError), repr(error)
        assert "is not a dataservice server" in str(error)
    finally:
        worker.stop()
    assert time.monotonic() - start < 10.0

    out = subprocess.run(
        [sys.executable, "-m", "dataservice", "worker", "--dispatcher", http1_server],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 1, out.stderr
    assert f"the server at {http1_server} is not a dataservice server" in out.stderr
    assert time.monotonic() - start < 30.0
