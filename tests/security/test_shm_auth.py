"""The shared-memory handshake: a client must prove it holds the token
(HMAC of the worker's challenge), other users are refused by SO_PEERCRED, and
connections that never authenticate get no thread and are bounded."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import dataservice as ds
from dataservice import auth
from dataservice.transfer import base as transfer
from dataservice.transfer import shm, shm_admission, shm_server
from tests.conftest import values

TOKEN = "shm-s3cret"


def _raw_handshake(name: str, hello: dict | None) -> tuple[dict, list[bytes]]:
    """Connects to the abstract socket `name`, reads the challenge, sends
    `hello` (with "auth" filled from hello["token"] when given) and returns
    (the challenge message, every later message up to the close)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10.0)
    try:
        sock.connect(name)
        first = json.loads(sock.recv(4096))
        if hello is not None:
            hello = dict(hello)
            token = hello.pop("token", None)
            if token is not None:
                hello["auth"] = auth.challenge_response(token, bytes.fromhex(first["challenge"]))
            sock.send(json.dumps(hello).encode())
        later = []
        while True:
            data, fds, _, _ = socket.recv_fds(sock, 4096, 4)
            for fd in fds:
                os.close(fd)
            assert not fds, "a refused client was handed a file descriptor"
            if not data:
                return first, later
            later.append(data)
    finally:
        sock.close()


@pytest.fixture
def secured(make_cluster, monkeypatch):
    monkeypatch.delenv(auth.AUTH_ENV, raising=False)
    c = make_cluster(0, auth_token=TOKEN)
    c.add_worker(auth_token=TOKEN, data_transfer_protocol="shm")
    monkeypatch.setenv(auth.AUTH_ENV, TOKEN)  # for this process's real consumers
    return c


def _running_task_id(c) -> tuple[int, object]:
    """A task id the worker runs now (a consumer is reading it), and its iterator."""
    dataset = ds.Dataset.range(1000).apply(
        ds.distribute("off", c.target, data_transfer_protocol="shm", job_name="victim")
    )
    it = iter(dataset)
    assert int(next(it)) == 0
    worker = c.workers[0]
    deadline = time.monotonic() + 10
    while worker.num_tasks() == 0:
        assert time.monotonic() < deadline, "the worker never got the task"
        time.sleep(0.01)
    with worker._mu:
        (task_id,) = worker._tasks
    return task_id, it


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x"])
def test_handshake_refuses_without_the_token(secured, token, caplog):
    task_id, it = _running_task_id(secured)
    name = shm.shm_socket_name(secured.workers[0].address)
    hello = {"v": shm.LAYOUT_VERSION, "task_id": task_id, "pid": os.getpid()}
    if token is not None:
        hello["token"] = token
    with caplog.at_level(logging.WARNING, logger="dataservice.auth"):
        first, later = _raw_handshake(name, hello)
    assert set(first) == {"v", "challenge"}
    assert len(later) == 1
    reply = json.loads(later[0])
    assert reply["ok"] is False
    assert "missing or wrong auth token" in reply["error"]
    assert "DATASERVICE_AUTH_TOKEN" in reply["error"]
    assert f"uid {os.getuid()} pid {os.getpid()}" in caplog.text
    # The real consumer still gets every element, in order: nothing was taken.
    assert [int(x) for x in it] == list(range(1, 1000))


def test_handshake_with_the_token_serves_through_shared_memory(secured, monkeypatch):
    monkeypatch.setenv(auth.AUTH_ENV, TOKEN)
    dataset = ds.Dataset.range(20).apply(
        ds.distribute("off", secured.target, data_transfer_protocol="shm")
    )
    it = iter(dataset)
    assert [int(x) for x in it] == list(range(20))
    assert {w["transfer_protocol"] for w in it.stats()["workers"].values()} == {"shm"}


def test_client_with_a_wrong_token_gets_the_reason(secured):
    endpoint = transfer.TaskEndpoint(
        task_id=4000,
        worker_address=secured.workers[0].address,
        transfer_address=secured.workers[0].address,
        host_id="",
    )
    with pytest.raises(transfer.TransferUnavailable, match="missing or wrong auth token"):
        shm.ShmTransferClient(endpoint, "wrong")


def test_a_silent_connection_is_closed_at_the_deadline(secured, monkeypatch):
    monkeypatch.setattr(shm_admission, "AUTH_DEADLINE_S", 0.3)  # read at accept time
    name = shm.shm_socket_name(secured.workers[0].address)
    start = time.monotonic()
    first, later = _raw_handshake(name, None)
    took = time.monotonic() - start
    assert "challenge" in first
    assert [json.loads(m)["error"] for m in later] == ["no HELLO within 0 s"]
    assert took < 3.0


_IDLE_CLIENT = textwrap.dedent(
    """
    import socket, sys
    name = bytes.fromhex(sys.argv[1]).decode()
    socks = []
    for _ in range(int(sys.argv[2])):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(name)
        socks.append(s)
    print("connected", len(socks), flush=True)
    sys.stdin.read()
    """
)


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def test_a_thousand_idle_connections_do_not_make_threads(secured, monkeypatch):
    name = shm.shm_socket_name(secured.workers[0].address)
    before = _threads()
    proc = subprocess.Popen(
        [sys.executable, "-c", _IDLE_CLIENT, name.encode().hex(), "1000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # connect() returns once the backlog has room
        assert line.strip() == "connected 1000", line
        peak = _threads()
        # A trainer (another process would be refused by the per-pid bound only
        # if it opened 64 at once) still reads through shared memory meanwhile.
        monkeypatch.setenv(auth.AUTH_ENV, TOKEN)
        it = iter(
            ds.Dataset.range(5).apply(
                ds.distribute("off", secured.target, data_transfer_protocol="shm")
            )
        )
        assert [int(x) for x in it] == list(range(5))
        peak = max(peak, _threads())
    finally:
        proc.stdin.close()
        proc.wait(10)
    # The worker's threads are the same few, not one per connection (was 1,013).
    assert peak - before < 30, (before, peak)
    server = shm_server.live_servers()[0]
    with server._mu:
        assert len(server._connections) <= 2


_OTHER_USER_CLIENT = textwrap.dedent(
    """
    import json, os, socket, sys
    name = bytes.fromhex(sys.argv[1]).decode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(name)
    messages = []
    while True:
        data = s.recv(4096)
        if not data:
            break
        messages.append(json.loads(data))
    print(json.dumps({"uid": os.getuid(), "messages": messages}), flush=True)
    """
)


def _as_nobody() -> list[str]:
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another user")
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip(f"no {python} that another user can run")
    if shutil.which("setpriv"):
        return ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", python]
    if shutil.which("runuser"):
        return ["runuser", "-u", "nobody", "--", python]
    pytest.skip("neither setpriv nor runuser is installed")


def test_another_user_is_refused_before_the_handshake(secured, caplog):
    command = _as_nobody()
    name = shm.shm_socket_name(secured.workers[0].address)
    with caplog.at_level(logging.WARNING, logger="dataservice.auth"):
        out = subprocess.run(
            [*command, "-c", _OTHER_USER_CLIENT, name.encode().hex()],
            capture_output=True,
            text=True,
            timeout=30,
            cwd="/",
        )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["uid"] == 65534
    # No challenge: only the refusal.
    assert result["messages"] == [{"ok": False, "error": "the client runs as another user"}]
    assert "uid 65534" in caplog.text


_FIRST_MESSAGE_CLIENT = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(bytes.fromhex(sys.argv[1]).decode())
    print(s.recv(4096).decode(), flush=True)
    """
)


def test_shm_allowed_uids_lets_another_user_in(make_cluster, monkeypatch):
    command = _as_nobody()
    monkeypatch.delenv(auth.AUTH_ENV, raising=False)
    c = make_cluster(0, auth_token=TOKEN)
    worker = c.add_worker(auth_token=TOKEN, shm_allowed_uids=[65534])
    name = shm.shm_socket_name(worker.address)
    out = subprocess.run(
        [*command, "-c", _FIRST_MESSAGE_CLIENT, name.encode().hex()],
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    # Let in as far as the challenge: it then has to prove the token like anyone.
    first = json.loads(out.stdout)
    assert set(first) == {"v", "challenge"}


def test_shm_allowed_uids_is_checked():
    with pytest.raises(ValueError, match="shm_allowed_uids"):
        ds.WorkerConfig("127.0.0.1:1", shm_allowed_uids=["nobody"])
    assert ds.WorkerConfig("127.0.0.1:1", shm_allowed_uids=(5, 6)).shm_allowed_uids == [5, 6]


def test_no_token_configured_still_serves(make_cluster, monkeypatch):
    monkeypatch.delenv(auth.AUTH_ENV, raising=False)
    c = make_cluster(0)
    c.add_worker(data_transfer_protocol="shm")
    assert values(
        ds.Dataset.range(4).apply(ds.distribute("off", c.target, data_transfer_protocol="shm"))
    ) == [0, 1, 2, 3]
    assert threading.active_count() < 200
