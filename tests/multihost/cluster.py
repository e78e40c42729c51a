"""Servers and trainers on the hosts of a `harness.Net`: servers started
through the CLI (`ip netns exec NAME python -m dataservice dispatcher|worker`,
tests/ft's `Server`), trainers as `ip netns exec NAME python trainer.py SPEC`
processes (trainer.py). Used by the multi-host tests (conftest.py) and
bench/multihost.py.

The servers bind their host's address, beyond loopback, so they have an auth
token (`--auth-token-file`, a file of mode 0600); the trainers get it in
DATASERVICE_AUTH_TOKEN.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from tests.ft.conftest import Server, server_env

from . import harness

HOSTS = ("disp", "w0", "w1", "t0", "t1")
DISPATCHER_PORT = 5050  # each host has its own ports: fixed ports never collide
WORKER_PORT = 5051
TOKEN = "multihost-test-token"
TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trainer.py")


class Trainer:
    """One `trainer.py` process on a host; its stdout JSON lines are parsed as
    they come (`progress`, `result`), its stderr kept for failure messages."""

    def __init__(self, net: harness.Net, host: str, spec: dict[str, Any]) -> None:
        self.host = host
        self.spec = spec
        env = server_env()
        env["DATASERVICE_AUTH_TOKEN"] = TOKEN
        self.popen = subprocess.Popen(
            net.exec_argv(host, [sys.executable, TRAINER, json.dumps(spec)]),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.progress = 0
        self.ready = threading.Event()
        self.result: dict[str, Any] | None = None
        self.ended_at = 0.0
        self._stderr: list[str] = []
        self._pumps = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for t in self._pumps:
            t.start()

    def _read_stdout(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                self._stderr.append("stdout: " + line.rstrip())
                continue
            if "progress" in msg:
                self.progress = int(msg["progress"])
            elif "ready" in msg:
                self.ready.set()
            elif "result" in msg:
                self.result = msg["result"]
                self.ended_at = time.monotonic()

    def _read_stderr(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self._stderr.append(line.rstrip())

    def stderr(self) -> str:
        return "\n".join(self._stderr[-60:])

    def wait_progress(self, count: int, timeout_s: float) -> float:
        """Waits until the trainer has read `count` elements; returns the seconds it took.

        Raises:
            AssertionError: Not within `timeout_s`, or the trainer ended before.
        """
        t0 = time.monotonic()
        while self.progress < count:
            if self.result is not None or self.popen.poll() is not None:
                raise AssertionError(
                    f"trainer on {self.host} ended at {self.progress} < {count} elements: "
                    f"{self.result and self.result['error']}\n{self.stderr()}"
                )
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(
                    f"trainer on {self.host}: {self.progress} < {count} elements after "
                    f"{timeout_s} s\n{self.stderr()}"
                )
            time.sleep(0.02)
        return time.monotonic() - t0

    def wait_result(self, timeout_s: float) -> dict[str, Any]:
        """Waits for the trainer's result line and its exit; returns the result.

        Raises:
            AssertionError: No result within `timeout_s` (the trainer is then
                killed: a hang fails the test in bounded time), or it exited
                without one.
        """
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"trainer on {self.host} hung: no result within {timeout_s} s "
                f"({self.progress} elements read)\n{self.stderr()}"
            ) from None
        for t in self._pumps:
            t.join(10)
        if self.result is None:
            raise AssertionError(
                f"trainer on {self.host} exited {self.popen.returncode} without a result:\n"
                f"{self.stderr()}"
            )
        return self.result

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)


class Cluster:
    """Servers and trainers started on `net`'s hosts; `close()` kills them all."""

    def __init__(self, net: harness.Net, token_file: str) -> None:
        self.net = net
        self.token_file = token_file
        self.servers: list[Server] = []
        self.trainers: list[Trainer] = []

    def address(self, host: str, port: int) -> str:
        return f"{self.net.ip[host]}:{port}"

    def dispatcher(
        self, host: str = "disp", extra: Sequence[str] = (), port: int = DISPATCHER_PORT
    ) -> Server:
        """Starts a dispatcher on `host` bound to its address and waits for its ready line."""
        flags = [
            "--host",
            self.net.ip[host],
            "--port",
            str(port),
            "--auth-token-file",
            self.token_file,
            *extra,
        ]
        server = Server("dispatcher", flags, prefix=tuple(self.net.exec_argv(host, [])))
        self.servers.append(server)
        server.wait_ready()
        return server

    def worker(
        self,
        host: str,
        dispatcher: str,
        extra: Sequence[str] = (),
        port: int = WORKER_PORT,
        wait: bool = True,
    ) -> Server:
        """Starts a worker on `host` (HOST_IP:`port`) for `dispatcher` ("IP:PORT")."""
        address = self.address(host, port)
        flags = [
            "--dispatcher",
            dispatcher,
            "--host",
            self.net.ip[host],
            "--port",
            str(port),
            "--worker-address",
            address,
            "--heartbeat-interval-ms",
            "200",
            "--auth-token-file",
            self.token_file,
            *extra,
        ]
        server = Server("worker", flags, prefix=tuple(self.net.exec_argv(host, [])))
        self.servers.append(server)
        if wait:
            server.wait_ready()
        return server

    def trainer(self, host: str, **spec: Any) -> Trainer:
        """Starts `trainer.py` on `host` with `spec` (see trainer.py)."""
        t = Trainer(self.net, host, spec)
        self.trainers.append(t)
        return t

    def close(self) -> None:
        for t in self.trainers:
            t.kill()
        for s in self.servers:
            s.cleanup()


def write_token_file(path: str) -> str:
    """Writes TOKEN to `path` (mode 0600); returns `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(TOKEN)
    return path
