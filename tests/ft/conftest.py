"""Helpers of the fault-tolerance tests (tests/ft/test_ft_*.py): real server
processes started through the CLI (`python -m dataservice dispatcher|worker`),
which a test can SIGKILL, SIGSTOP and restart on the same port, with their log
lines captured and time-stamped.

Every process started through the `servers` fixture is SIGCONTed and
SIGKILLed at teardown (and gets `--parent-pid`, so it also dies with pytest).

Every test here also checks, after its own teardown, that it left nothing
behind (`no_leaks`): no new /dev/shm name with our prefixes, no new child
process, and no new shared-memory fd (memfd) in this process.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from dataservice.rpc import util as rpc_util

READY_RE = re.compile(r"^dataservice (dispatcher|worker) listening on (\S+)")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEARTBEAT_MS = 100


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [os.path.join(REPO, "python"), REPO]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Server:
    """One `python -m dataservice dispatcher|worker` process; its stdout and
    stderr lines are kept as (monotonic time, line)."""

    def __init__(
        self, kind: str, flags: list[str], log_level: str = "INFO", prefix: tuple[str, ...] = ()
    ) -> None:
        self.kind = kind
        self.flags = flags
        argv = [
            *prefix,  # e.g. `ip netns exec NAME`, which execs the rest in its place
            sys.executable,
            "-m",
            "dataservice",
            kind,
            *flags,
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            log_level,
        ]
        self.started_at = time.monotonic()
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=server_env(),
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.address = ""
        self.ready_at = 0.0
        self._ready = threading.Event()
        self._mu = threading.Lock()
        self.lines: list[tuple[float, str]] = []
        self._pumps = [
            threading.Thread(target=self._pump, args=(self.popen.stdout,), daemon=True),
            threading.Thread(target=self._pump, args=(self.popen.stderr,), daemon=True),
        ]
        for t in self._pumps:
            t.start()

    def _pump(self, stream) -> None:
        for line in stream:
            now = time.monotonic()
            line = line.rstrip("\n")
            with self._mu:
                self.lines.append((now, line))
            m = READY_RE.match(line)
            if m:
                self.address = m.group(2)
                self.ready_at = now
                self._ready.set()

    def wait_ready(self, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.05):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                time.sleep(0.2)  # let the pumps read the last lines
                raise AssertionError(
                    f"{self.kind} {self.flags} did not get ready (exit code "
                    f"{self.popen.poll()}); output:\n{self.text()[-4000:]}"
                )
        return self.address

    @property
    def target(self) -> str:
        return "grpc://" + self.address

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def text(self) -> str:
        with self._mu:
            return "\n".join(line for _, line in self.lines)

    def lines_since(self, t: float, pattern: str = "") -> list[tuple[float, str]]:
        rx = re.compile(pattern)
        with self._mu:
            return [(ts, line) for ts, line in self.lines if ts >= t and rx.search(line)]

    def wait_line(self, pattern: str, timeout_s: float, since: float = 0.0) -> float:
        """Waits for a line matching `pattern` (logged at or after `since`); returns its time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.lines_since(since, pattern)
            if found:
                return found[0][0]
            time.sleep(0.02)
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s:\n{self.text()}")

    def send(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> float:
        """SIGKILL; waits for the exit; returns the time of the kill."""
        t = time.monotonic()
        self.send(signal.SIGKILL)
        self.popen.wait(10)
        return t

    def terminate(self, timeout_s: float = 15.0) -> int:
        self.send(signal.SIGCONT)
        self.send(signal.SIGTERM)
        return self.popen.wait(timeout_s)

    def cleanup(self) -> None:
        if self.popen.poll() is None:
            self.send(signal.SIGCONT)
            self.send(signal.SIGKILL)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for t in self._pumps:
            t.join(2)


class Servers:
    """Starts servers for one test and kills them all at its end."""

    def __init__(self) -> None:
        self.all: list[Server] = []

    def dispatcher(
        self,
        port: int = 0,
        work_dir: str | None = None,
        fault_tolerant: bool = False,
        worker_timeout_ms: int | None = None,
        extra: tuple[str, ...] = (),
        wait: bool = True,
        log_level: str = "INFO",
        prefix: tuple[str, ...] = (),
    ) -> Server:
        flags = ["--port", str(port)]
        if work_dir is not None:
            flags += ["--work-dir", work_dir]
        if fault_tolerant:
            flags += ["--fault-tolerant-mode"]
        if worker_timeout_ms is not None:
            flags += ["--worker-timeout-ms", str(worker_timeout_ms)]
        flags += list(extra)
        server = Server("dispatcher", flags, log_level, prefix)
        self.all.append(server)
        if wait:
            server.wait_ready()
        return server

    def worker(
        self,
        dispatcher: Server | str,
        heartbeat_interval_ms: int = HEARTBEAT_MS,
        extra: tuple[str, ...] = (),
        wait: bool = True,
        log_level: str = "INFO",
    ) -> Server:
        address = dispatcher if isinstance(dispatcher, str) else dispatcher.address
        flags = [
            "--dispatcher",
            address,
            "--heartbeat-interval-ms",
            str(heartbeat_interval_ms),
            "--worker-address",
            "127.0.0.1:%port%",
            *extra,
        ]
        server = Server("worker", flags, log_level)
        self.all.append(server)
        if wait:
            server.wait_ready()
        return server

    def workers(self, dispatcher: Server, n: int, **kw) -> list[Server]:
        started = [self.worker(dispatcher, wait=False, **kw) for _ in range(n)]
        for w in started:
            w.wait_ready()
        return started

    def cleanup(self) -> None:
        for server in self.all:
            server.cleanup()


@pytest.fixture
def servers() -> Iterator[Servers]:
    s = Servers()
    try:
        yield s
    finally:
        s.cleanup()


SHM_PREFIXES = ("dataservice", "ds-")


def our_shm_names() -> set[str]:
    """Our names in /dev/shm (rings are memfds and have none: any is a leak)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIXES)}


def memfds() -> set[str]:
    """This process's open memfds (`/proc/self/fd` entries that link to
    '/memfd:...'): a ring or cache window a consumer still holds."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own fd, a racing close)
            continue
        if target.startswith("/memfd:"):
            out.add(f"{fd} -> {target}")
    return out


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fails a test that leaves a /dev/shm name, a child process or a memfd
    behind once its fixtures are torn down (waits up to 10 s: a closed
    iterator's fetch threads let go of their fds asynchronously)."""
    shm_before = our_shm_names()
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    memfds_before = memfds()
    yield

    def leaked() -> list[str]:
        out = [f"/dev/shm/{n}" for n in sorted(our_shm_names() - shm_before)]
        for p in psutil.Process().children(recursive=True):
            if p.pid in children_before:
                continue
            try:
                if p.status() != psutil.STATUS_ZOMBIE:  # exited, not yet reaped: gone
                    out.append(f"child {p.pid} {p.cmdline()[:4]}")
            except psutil.Error:  # exited while we looked
                continue
        out += [f"memfd {m}" for m in sorted(memfds() - memfds_before)]
        return out

    # No gc.collect() here: a stopped in-process worker frees its memfds and sockets
    # by itself (test_stop_releases.py); what is waited for is asynchronous endings
    # (closed iterators' fetch threads, killed processes).
    deadline = time.monotonic() + 10.0
    while (left := leaked()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"the test left behind: {left}"


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> float:
    """Polls `predicate` every 20 ms; returns the seconds it took.

    Raises:
        AssertionError: Not true within `timeout_s`.
    """
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


def gone(pid: int) -> bool:
    """The process exited (a zombie nobody reaped yet counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def report(msg: str) -> None:
    """A measured value, printed so that `pytest -s` (or a failure) shows it."""
    print(f"[ft] {msg}", flush=True)


class ThreadReader:
    """Reads an iterator on a thread, so the test can kill workers meanwhile;
    counts elements (`count`) and distinct values (`seen`: `x["i"]` of dict
    elements, else `x`), and keeps the error that ended it (`error`)."""

    def __init__(self, it) -> None:
        self.it = it
        self.count = 0
        self.seen: set[int] = set()
        self.error: BaseException | None = None
        self.ended_at = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for x in self.it:
                self.count += 1
                self.seen.add(int(x["i"]) if isinstance(x, dict) else int(x))
        except BaseException as err:  # noqa: BLE001  (the test inspects it)
            # Without its traceback: that holds this frame, whose last element
            # is a view of a shared-memory ring (kept mapped while referenced).
            self.error = err.with_traceback(None)
        self.ended_at = time.monotonic()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the consumer hung ({self.count} elements read)"


def exit_at_once(marker_dir: str, index: int, code: int) -> Callable[[object], object]:
    """A map function whose worker process calls os._exit(code) at element
    `index`, once per marker directory (a restarted worker goes on)."""

    def fn(x):
        if int(x) == index:
            marker = os.path.join(marker_dir, "exited")
            try:  # atomic: OFF workers reach `index` at the same time, and only one exits
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return x
            os._exit(code)
        return x

    return fn


def unanswered_port() -> int:
    """A port nothing listens on (bound, then closed) and that no server this
    process talked to had: a port another test's dispatcher used answered
    once, so a refusal there reads as a restart (the full timeout)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not any(rpc_util.was_reached(f"{h}:{port}") for h in ("127.0.0.1", "localhost")):
            return port
