"""Process helpers shared by the CLI servers and `LocalCluster`.

Two sides:

* In a server process started with `--parent-pid` (child side): leave when the
  parent dies, even if it was SIGKILLed (CASES C-23). Linux delivers a
  parent-death signal (`prctl(PR_SET_PDEATHSIG)`), and a watcher thread polls
  the parent as a fallback (other platforms, and the window before `prctl`).
* In the process that owns children (parent side): read their output without
  ever letting a pipe fill up, and stop them in bounded time: SIGTERM, a grace
  period, SIGKILL, reap (CASES C-24).

Everything here is thread-safe unless said otherwise.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import functools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import IO

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

PARENT_DEATH_SIGNAL = signal.SIGUSR2
"""The parent-death signal. Not SIGTERM: Linux sends it when the *thread* that
forked the child exits, not only when the parent process dies, so the handler
checks that the child was really re-parented before it stops the server. A
`LocalCluster` created (or a worker restarted) from a short-lived thread would
otherwise lose its processes with that thread."""


@functools.cache
def _libc() -> ctypes.CDLL:
    """This process's C library, loaded once (raises OSError if it cannot be)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def set_parent_death_signal(signum: int = PARENT_DEATH_SIGNAL) -> bool:
    """Asks Linux to send `signum` to this process when its parent thread exits.

    Returns:
        True if it was set, False on platforms without `prctl` (non-Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = _libc()
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            err = ctypes.get_errno()
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(err))
            return False
    except (OSError, AttributeError) as e:  # no libc / no prctl symbol
        logger.warning("prctl(PR_SET_PDEATHSIG) unavailable: %s", e)
        return False
    return True


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class ParentWatch:
    """Calls `on_death()` once when process `parent_pid` is gone.

    Two mechanisms, whichever fires first: the parent-death signal
    (`PARENT_DEATH_SIGNAL`, Linux, needs the main thread, so call `start()`
    from it) and a daemon thread polling every `poll_interval_s` seconds. If
    `parent_pid` is our real parent, "gone" means we were re-parented (immune to
    pid reuse); otherwise it means no process has that pid any more.

    `on_death` runs in the signal handler or in the watcher thread: it must be
    quick and must not block (set an event, send a signal).
    """

    def __init__(
        self, parent_pid: int, on_death: Callable[[], None], poll_interval_s: float = 0.2
    ) -> None:
        self._parent_pid = parent_pid
        self._on_death = on_death
        self._poll_interval_s = poll_interval_s
        self._is_real_parent = os.getppid() == parent_pid
        self._fired = threading.Event()
        self._thread: threading.Thread | None = None

    def parent_alive(self) -> bool:
        if self._is_real_parent:
            return os.getppid() == self._parent_pid
        return _process_alive(self._parent_pid)

    def start(self) -> None:
        """Arms both mechanisms; fires at once if the parent is already gone."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(PARENT_DEATH_SIGNAL, self._on_signal)
            if self._is_real_parent:
                set_parent_death_signal(PARENT_DEATH_SIGNAL)
        self._thread = threading.Thread(
            target=self._poll, name="dataservice-parent-watch", daemon=True
        )
        self._thread.start()
        if not self.parent_alive():  # died before prctl took effect
            self._fire()

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.parent_alive():  # else only the forking thread exited
            self._fire()

    def _poll(self) -> None:
        while not self._fired.wait(self._poll_interval_s):
            if not self.parent_alive():
                self._fire()

    def _fire(self) -> None:
        if self._fired.is_set():
            return
        self._fired.set()
        self._on_death()


class OutputPump:
    """Drains one pipe of a child process line by line in a daemon thread.

    Keeps the last `tail_lines` lines (for error messages), optionally copies
    each line to `forward` with a prefix, records the first line matching
    `ready_pattern` (see `wait_ready`) and whether a line matched
    `progress_pattern` (see `progress_seen`). Ends at EOF, i.e. when the child
    exits.
    """

    def __init__(
        self,
        stream: IO[bytes],
        name: str,
        ready_pattern: re.Pattern[str] | None = None,
        tail_lines: int = 200,
        forward: IO[str] | None = None,
        progress_pattern: re.Pattern[str] | None = None,
    ) -> None:
        self._stream = stream
        self._name = name
        self._ready_pattern = ready_pattern
        self._progress_pattern = progress_pattern
        self._forward = forward
        self._mu = threading.Lock()
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)  # guarded
        self._ready_match: re.Match[str] | None = None  # guarded by self._mu
        self._progress = False  # guarded by self._mu
        self._changed = threading.Condition(self._mu)
        self._eof = False  # guarded by self._mu
        self._thread = threading.Thread(target=self._run, name=f"pump-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for raw in iter(self._stream.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                with self._mu:
                    self._tail.append(line)
                    if (
                        self._ready_match is None
                        and self._ready_pattern is not None
                        and (m := self._ready_pattern.search(line))
                    ):
                        self._ready_match = m
                        self._changed.notify_all()
                    elif (
                        not self._progress
                        and self._progress_pattern is not None
                        and self._progress_pattern.search(line)
                    ):
                        self._progress = True
                if self._forward is not None:
                    try:
                        self._forward.write(f"[{self._name}] {line}\n")
                        self._forward.flush()
                    except (OSError, ValueError):
                        pass
        except (OSError, ValueError):  # closed under us during teardown
            pass
        finally:
            with self._mu:
                self._eof = True
                self._changed.notify_all()

    def wait_ready(self, deadline: float) -> re.Match[str] | None:
        """Blocks until the ready line arrived, EOF, or `deadline` (time.monotonic()).

        Returns:
            The match of the ready line, or None on EOF or timeout.
        """
        with self._mu:
            while self._ready_match is None and not self._eof:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(min(remaining, 0.1))
            return self._ready_match

    def progress_seen(self) -> bool:
        """Whether a line matched `progress_pattern` (so far)."""
        with self._mu:
            return self._progress

    def tail(self, n: int = 20) -> str:
        with self._mu:
            lines = list(self._tail)[-n:]
        return "\n".join(lines)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def done(self) -> bool:
        """True once the pipe reached EOF and the thread ended."""
        return not self._thread.is_alive()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_processes(
    procs: Iterable[subprocess.Popen[bytes]],
    grace_s: float,
    kill_wait_s: float = 5.0,
    own_groups: bool = False,
) -> list[int]:
    """Stops processes in bounded time: SIGTERM to all at once, wait up to
    `grace_s` seconds, then SIGKILL the survivors and reap them (no zombies).

    Blocks at most about `grace_s + kill_wait_s` seconds.

    Args:
        procs: The processes (our children).
        grace_s: Seconds between SIGTERM and SIGKILL.
        kill_wait_s: Seconds to wait for SIGKILLed processes to be reaped.
        own_groups: Each process leads its own process group (it was started
            with `start_new_session=True`): SIGKILL the whole group, and at the
            end SIGKILL whatever is left in it (children of the child).

    Returns:
        The pids that needed SIGKILL.
    """
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    killed = []
    for p in procs:
        if p.poll() is None:
            killed.append(p.pid)
            logger.warning(
                "process %d did not stop within %.1f s of SIGTERM: SIGKILL", p.pid, grace_s
            )
            if own_groups:
                _killpg(p.pid, signal.SIGKILL)
            else:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
    deadline = time.monotonic() + kill_wait_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.error("process %d survived SIGKILL for %.1f s", p.pid, kill_wait_s)
    if own_groups:  # leftovers: processes a child started and left behind
        for p in procs:
            _killpg(p.pid, signal.SIGKILL)
    return killed


class ExitWatchdog:
    """Ends this process with `os._exit` if it is still alive at a deadline.

    Bounds shutdown even when a server's `stop()` hangs or a non-daemon thread
    left behind would keep the interpreter from exiting. `arm` (re)sets the
    deadline and the exit code; `disarm` cancels. The thread is a daemon and
    starts on the first `arm`.
    """

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._deadline: float | None = None  # guarded by self._mu
        self._code = 1  # guarded by self._mu
        self._thread: threading.Thread | None = None  # guarded by self._mu

    def arm(self, timeout_s: float, code: int) -> None:
        with self._mu:
            self._deadline = time.monotonic() + timeout_s
            self._code = code
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dataservice-exit-watchdog", daemon=True
                )
                self._thread.start()

    def disarm(self) -> None:
        with self._mu:
            self._deadline = None

    def _run(self) -> None:
        while True:
            with self._mu:
                deadline, code = self._deadline, self._code
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


MALLOC_TUNING_ENV = "DATASERVICE_MALLOC_TUNING"
# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_malloc_tuned = False
_GLIBC_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


# glibc malloc's thresholds (`tune_malloc`), for consumers and workers alike: blocks
# under 32 MiB come from malloc's heap (reused, already mapped) and up to 64 MiB of free
# memory stays at a heap's top, the highest values glibc's own moving thresholds reach.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 64 << 20


def tune_malloc(
    mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES,
    trim_threshold_bytes: int = TRIM_THRESHOLD_BYTES,
) -> bool:
    """Once per process, sets glibc malloc's thresholds: blocks under
    `mmap_threshold_bytes` come from its heap (reused, already mapped) and not from
    a mapping of their own, and up to `trim_threshold_bytes` of free memory stays at
    the top of a heap for reuse. By default both move with the largest block freed
    so far, so the same stream of ~1 MiB messages can run from the heap or from a
    fresh mapping (page faults and the kernel's zeroing) per block, depending on
    what the process happened to free first. $DATASERVICE_MALLOC_TUNING=0 leaves
    malloc as it is, and so do glibc's own settings in the environment
    ($MALLOC_MMAP_THRESHOLD_, $MALLOC_TRIM_THRESHOLD_, $GLIBC_TUNABLES): the user's
    choice wins. Other allocators than glibc's are left alone. Returns whether
    malloc was tuned now (False: already, turned off, or not glibc)."""
    global _malloc_tuned
    if _malloc_tuned:
        return False
    _malloc_tuned = True
    env = os.environ
    if (
        env.get(MALLOC_TUNING_ENV, "1") == "0"
        or not sys.platform.startswith("linux")
        or any(name in env for name in _GLIBC_MALLOC_ENV)
    ):
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes)
        and mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes)
    )


def release_free_memory() -> None:
    """Gives the free memory malloc keeps back to the kernel (glibc's
    `malloc_trim(0)`, which also releases free pages inside the heap, not only at
    its top; a no-op elsewhere). A worker calls it when tasks end: a task buffer
    of up to 64 MiB of small elements (`bytes` of a few KiB, small arrays) is
    freed into malloc's bins, which glibc does not return on its own."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        return
    try:
        malloc_trim = _libc().malloc_trim
    except (OSError, AttributeError):
        return
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim(0)
