"""The supervision of `LocalCluster`'s worker processes: a monitor thread that
sees each exit, tells the dispatcher, and restarts the worker or gives up on it.

Worker exits (CASES K4: a consumer gets progress or a bounded failure): a
monitor thread polls every worker process (every 0.1 s) and tells the
dispatcher of each exit at once (`ReportWorkerFailure`, with the pid and how
it exited), so the consumers learn of it then, not after the dispatcher's
worker timeout. By default (`restart_workers=True`) a worker process that
exits is restarted on its port; the DYNAMIC splits its dead process held are
counted lost and each consumer warns once (`stats()["lost_workers"]`). With
`restart_workers=False` the cluster gives up on it at its first exit, as
below. An exit of a process that was up (ready) for less than
`healthy_uptime_s` (30 s by default) counts against `max_worker_restarts`,
whether or not it handed out elements first: a crash loop (a `map` that calls
`os._exit` every few elements, segfaults, is OOM-killed; in OFF mode the same
element of a task that starts over on each restarted process) cannot go on
forever by producing a few elements before each crash. Such a worker is
restarted after a backoff (0.1 s, doubling, at most 2 s) and starts its tasks'
pipelines only when a consumer asks, so the consumer gets the elements
produced before the next crash. Only a process that stayed up
`healthy_uptime_s` resets the count, so a rare crash (one an hour) is
restarted every time and a long run goes on; a crash loop whose processes each
last longer than `healthy_uptime_s` is tolerated as rare crashes (at most one
restart per `healthy_uptime_s`). When the count runs out the cluster gives up
on that worker and tells the dispatcher, which fails the iterations no worker
is left to run: their consumers raise `errors.WorkerCrashedError` naming each
worker, its pids, how it ended, the number of exits in a row and the options
to change, as PyTorch's DataLoader raises "worker (pid X) exited
unexpectedly".

Owns `WorkerSupervisionMixin` (the monitor thread's methods; `LocalCluster`
inherits them and holds every field they use: the mixin adds none), the
per-worker state machine (`_Slot`), the restart timings (`RESTART_BACKOFF_S`,
`MAX_RESTART_BACKOFF_S`, `HEALTHY_UPTIME_S`), exit descriptions and RSS
sampling, and `_Proc`, the handle of one server process. It may import the
leaves (`_proc`, `_serverproc`, `errors`) and `rpc`, never `cluster.py` or
`cli.py`; its log lines go to the "dataservice.cluster" logger, as
`LocalCluster`'s own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING

from dataservice import _proc, _serverproc, errors
from dataservice.rpc import util as rpc_util

# One logger for the cluster's lines (users and tests filter on its name).
logger = logging.getLogger("dataservice.cluster")

RESTART_BACKOFF_S = 0.1  # before the first restart after an exit without progress
MAX_RESTART_BACKOFF_S = 2.0  # the backoff doubles up to this
HEALTHY_UPTIME_S = 30.0  # default: a process up this long resets the restart count
_MONITOR_PERIOD_S = 0.1
_RSS_PERIOD_S = 0.5  # how often the monitor samples each worker's RSS
try:
    _PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):
    _PAGE_BYTES = 4096


@dataclasses.dataclass
class _Proc:
    """One server process and the threads draining its pipes."""

    name: str
    popen: subprocess.Popen[bytes]
    stdout: _proc.OutputPump
    stderr: _proc.OutputPump
    address: str = ""
    extra_flags: list[str] = dataclasses.field(default_factory=list)  # kept across restarts


@dataclasses.dataclass
class _Slot:
    """The monitor's view of one worker index (monitor thread only)."""

    state: str = "running"  # running | waiting (to be restarted) | starting | failed
    ready_at: float = 0.0  # time.monotonic() when the current process became ready
    retry_at: float = 0.0  # waiting: when to restart
    start_deadline: float = 0.0  # starting: when to give up waiting for the ready line
    exits: list[str] = dataclasses.field(default_factory=list)  # in a row, each up < healthy
    pids: list[int] = dataclasses.field(default_factory=list)  # of those exits
    handed_out: int = 0  # how many of those processes handed out an element first
    total_exits: int = 0  # every exit of this index since the cluster started
    last_rss_bytes: int = 0  # of the current process, sampled every _RSS_PERIOD_S


def _describe_exit(code: int | None, last_rss_bytes: int = 0) -> str:
    """How a process ended, from its `Popen.returncode`: "exited with code 1",
    "was killed by signal 9 (SIGKILL), maybe by the kernel's OOM killer (last
    RSS 1.2 GiB)"."""
    if code is None:
        return "did not report ready"
    if code < 0:
        try:
            how = f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            how = f"was killed by signal {-code}"
        if -code == signal.SIGKILL:
            how += ", maybe by the kernel's OOM killer"
            if last_rss_bytes:
                how += f" (last RSS {_format_bytes(last_rss_bytes)})"
        return how
    return f"exited with code {code}"


def _format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _rss_bytes(pid: int) -> int:
    """The resident set size of `pid` in bytes (0 if unknown: not Linux, or gone)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0


class WorkerSupervisionMixin:
    """The monitor thread's methods of `LocalCluster` (see the module). Not a class
    of its own: it runs on `LocalCluster`'s fields (declared below for the type
    checker) under `LocalCluster._lock`, as the class documents them."""

    _lock: threading.RLock
    _dispatcher: _Proc | None
    _workers: list[_Proc]
    _stopping: threading.Event
    _stopped: bool
    _restarts: int
    _failed: dict[str, str]
    _restart_workers: bool
    _max_worker_restarts: int | None
    _healthy_uptime_s: float
    _start_timeout_s: float
    _auth_token: str

    if TYPE_CHECKING:  # LocalCluster's, used here

        def _spawn(self, kind: str, name: str, flags: list[str]) -> _Proc: ...

        def _worker_flags(self, port: int | None = None) -> list[str]: ...

        @property
        def dispatcher_address(self) -> str: ...

    def _monitor_workers(self) -> None:
        """Sees each worker exit and tells the dispatcher; restarts dead
        workers on their old port until the cluster stops, or gives up on one
        (see `restart_workers`, `max_worker_restarts`). Never blocks on one
        worker: each is a small state machine (`_Slot`, by worker name) polled
        every 0.1 s. Workers the autoscaler adds are watched from the next
        poll; one it retires leaves `_workers` before its process is stopped,
        so its exit is not taken for a crash."""
        now = time.monotonic()
        slots: dict[str, _Slot] = {}
        next_rss = now
        dispatcher_exited = False
        while not self._stopping.wait(_MONITOR_PERIOD_S):
            if not dispatcher_exited:
                dispatcher_exited = self._check_dispatcher()
            sample_rss = time.monotonic() >= next_rss
            if sample_rss:
                next_rss = time.monotonic() + _RSS_PERIOD_S
            with self._lock:
                workers = list(self._workers)
            names = {w.name for w in workers}
            for name in [n for n in slots if n not in names]:
                del slots[name]  # retired
            for w in workers:
                if self._stopping.is_set():
                    return
                slot = slots.get(w.name)
                if slot is None:
                    slot = slots[w.name] = _Slot(ready_at=time.monotonic())
                if not self._is_current(w):
                    continue  # retired meanwhile
                if slot.state == "running":
                    code = w.popen.poll()
                    if code is not None:
                        if self._is_current(w):
                            self._on_worker_exit(slot, w, code, was_ready=True)
                    elif sample_rss:
                        slot.last_rss_bytes = _rss_bytes(w.popen.pid) or slot.last_rss_bytes
                elif slot.state == "starting":
                    self._check_started(slot, w)
                elif slot.state == "waiting" and time.monotonic() >= slot.retry_at:
                    if not self._restart(slot, w):
                        return

    def _check_dispatcher(self) -> bool:
        """Whether the dispatcher's process exited (reaped here). An exit while the
        cluster runs is logged at once with its last stderr lines, and this
        process's new calls to it fail at once (`rpc.util.mark_gone`): the
        cluster does not restart its dispatcher."""
        with self._lock:
            d = self._dispatcher
        if d is None:
            return False
        code = d.popen.poll()
        if code is None or self._stopping.is_set():
            return code is not None
        how = _describe_exit(code)
        why = f"the LocalCluster's dispatcher process (pid {d.popen.pid}) {how}"
        rpc_util.mark_gone(d.address, why + "; a LocalCluster does not restart it")
        tail = d.stderr.tail(10)
        logger.error(
            "%s; the cluster's consumers fail after their client_timeout_ms%s",
            why,
            f"; its last stderr lines:\n{tail}" if tail else "",
        )
        return True

    def _is_current(self, w: _Proc) -> bool:
        """Whether `w` is still one of the cluster's workers (not retired)."""
        with self._lock:
            return any(x is w for x in self._workers)

    def _on_worker_exit(self, slot: _Slot, w: _Proc, code: int | None, was_ready: bool) -> None:
        """Counts the exit of `w` and schedules its restart, or gives up on it."""
        if self._stopping.is_set():
            return
        _proc.terminate_processes([w.popen], 0.0, own_groups=True)  # reap, and its group
        w.stdout.join(0.5)  # EOF: the first-element line, if any, has been read
        w.stderr.join(0.5)
        now = time.monotonic()
        handed_out = w.stdout.progress_seen()
        uptime_s = now - slot.ready_at if was_ready else 0.0
        # Handing out elements is no sign of health: a crash loop hands out a
        # few before each crash (and an OFF task starts over on each restart).
        healthy = was_ready and uptime_s >= self._healthy_uptime_s
        slot.total_exits += 1
        how = _describe_exit(code, slot.last_rss_bytes)
        if not was_ready:
            how += " before it was ready"
        slot.last_rss_bytes = 0
        if not self._restart_workers:
            slot.exits, slot.pids = [how], [w.popen.pid]
            self._give_up(slot, w)
            return
        if was_ready:
            # The dispatcher counts what the dead process held as lost now, and
            # keeps its tasks for the restarted one (in a thread: the report may
            # retry for seconds while other workers need watching).
            self._report_failure_async(
                w.address,
                f"{w.name} at {w.address} (pid {w.popen.pid}) {how}; LocalCluster restarts it",
                w.popen.pid,
                restarting=True,
            )
        if healthy:
            slot.exits, slot.pids, slot.handed_out = [], [], 0
        else:
            slot.exits.append(how)
            slot.pids.append(w.popen.pid)
            slot.handed_out += bool(handed_out)
        limit = self._max_worker_restarts
        if limit is not None and len(slot.exits) > limit:
            self._give_up(slot, w)
            return
        delay = 0.0
        if slot.exits:
            delay = min(RESTART_BACKOFF_S * 2 ** (len(slot.exits) - 1), MAX_RESTART_BACKOFF_S)
        if healthy:
            after = f" after {uptime_s:.0f} s up"
        else:
            limit_text = "" if limit is None else f" of max_worker_restarts={limit}"
            after = (
                f" {uptime_s:.1f} s after it started"
                f"{', having handed out elements' if handed_out else ''}"
                f" ({len(slot.exits)} such exits in a row{limit_text}; a process up "
                f"healthy_uptime_s={self._healthy_uptime_s:g} resets the count)"
            )
        logger.warning(
            "LocalCluster: %s (pid %d, %s) %s%s; restarting it on port %s in %.1f s",
            w.name,
            w.popen.pid,
            w.address,
            how,
            after,
            w.address.rsplit(":", 1)[-1],
            delay,
        )
        if not was_ready:
            tail = w.stderr.tail(20)
            if tail:
                logger.error("LocalCluster: last lines of %s's stderr:\n%s", w.name, tail)
        slot.state = "waiting"
        slot.retry_at = now + delay

    def _restart(self, slot: _Slot, w: _Proc) -> bool:
        """Starts worker `w` again on its port. Returns False if the cluster stopped."""
        port = int(w.address.rsplit(":", 1)[1])
        flags = [*self._worker_flags(port=port), *w.extra_flags]
        if slot.exits:  # it made no progress: start pipelines only when a consumer asks
            flags.append("--lazy-tasks")
        try:
            new = self._spawn("worker", w.name, flags)
        except OSError as e:
            logger.error("LocalCluster: cannot restart %s: %s", w.name, e)
            slot.exits.append(f"could not be started ({e})")
            slot.pids.append(0)
            limit = self._max_worker_restarts
            if limit is not None and len(slot.exits) > limit:
                self._give_up(slot, w)
            else:
                slot.retry_at = time.monotonic() + 1.0
            return True
        new.address = w.address  # the same port; the ready line confirms it
        new.extra_flags = w.extra_flags
        with self._lock:
            if self._stopped:  # raced with stop(): don't leave it behind
                _proc.terminate_processes([new.popen], 0.0, own_groups=True)
                return False
            i = next((k for k, x in enumerate(self._workers) if x is w), None)
            if i is None:  # retired meanwhile
                _proc.terminate_processes([new.popen], 0.0, own_groups=True)
                return True
            self._workers[i] = new
        slot.state = "starting"
        slot.start_deadline = time.monotonic() + self._start_timeout_s
        return True

    def _check_started(self, slot: _Slot, w: _Proc) -> None:
        old_address = w.address
        match = w.stdout.wait_ready(time.monotonic())  # does not block
        if match is not None:
            w.address = match.group(2)
            slot.state = "running"
            slot.ready_at = time.monotonic()
            with self._lock:
                self._restarts += 1
            if w.address != old_address:
                logger.warning(
                    "LocalCluster: %s came back as %s, not %s", w.name, w.address, old_address
                )
            return
        code = w.popen.poll()
        if code is not None:
            self._on_worker_exit(slot, w, code, was_ready=False)
        elif time.monotonic() >= slot.start_deadline:
            logger.error(
                "LocalCluster: %s (pid %d) did not report ready within %.0f s",
                w.name,
                w.popen.pid,
                self._start_timeout_s,
            )
            self._on_worker_exit(slot, w, None, was_ready=False)

    def _give_up(self, slot: _Slot, w: _Proc) -> None:
        """Stops restarting `w`'s index; tells the dispatcher (its consumers fail)."""
        n = len(slot.exits)
        times = "once" if n == 1 else f"{n} times in a row"
        if len(set(slot.exits)) == 1:
            how = f"{slot.exits[0]}, {times},"
        else:
            how = f"exited {times} ({', '.join(slot.exits)})"
        pids = ", ".join(str(p) for p in slot.pids if p)
        if not self._restart_workers:
            reason = (
                f"{w.name} at {w.address} (pid {pids}) {slot.exits[0]}; LocalCluster does "
                "not restart workers (restart_workers=False)"
            )
        else:
            if slot.handed_out == n:
                handed = "each after handing out elements"
            elif slot.handed_out:
                handed = f"{slot.handed_out} of them after handing out elements"
            else:
                handed = "without handing out an element"
            reason = (
                f"{w.name} at {w.address} {how} each within "
                f"healthy_uptime_s={self._healthy_uptime_s:g} s of starting, {handed} "
                f"(pids {pids}; {slot.total_exits} exits since the cluster started); "
                f"LocalCluster gave up restarting it (max_worker_restarts="
                f"{self._max_worker_restarts}: a crash loop, e.g. in the pipeline's "
                "functions; raise `LocalCluster(max_worker_restarts=...)`, or lower "
                "`healthy_uptime_s`, to restart it more)"
            )
        tail = w.stderr.tail(5)
        if tail:
            reason += f"; last lines of its stderr:\n{tail}"
        slot.state = "failed"
        with self._lock:
            self._failed[w.address] = reason
        logger.error("LocalCluster: %s", reason)
        self._report_failure(w.address, reason, slot.pids[-1] if slot.pids else 0)

    def _report_failure_async(self, address: str, reason: str, pid: int, restarting: bool) -> None:
        threading.Thread(
            target=self._report_failure,
            args=(address, reason, pid, restarting),
            name="ds-cluster-report",
            daemon=True,
        ).start()

    def _report_failure(
        self, address: str, reason: str, pid: int = 0, restarting: bool = False
    ) -> None:
        """ReportWorkerFailure to the dispatcher (retried for up to 5 s)."""
        from dataservice.rpc import service_pb2 as pb
        from dataservice.rpc import util as rpc_util

        request = pb.ReportWorkerFailureRequest(
            worker_address=address, reason=reason, pid=pid, restarting=restarting
        )
        with _serverproc.DispatcherStub(self.dispatcher_address, self._auth_token) as dispatcher:
            try:
                rpc_util.call_with_retries(
                    lambda: dispatcher.stub.ReportWorkerFailure(
                        request, timeout=2.0, metadata=dispatcher.metadata
                    ),
                    address=dispatcher.address,
                    what="ReportWorkerFailure to the dispatcher",
                    timeout_ms=5_000,
                    stop=self._stopping,
                )
            except errors.DataServiceError as e:
                logger.warning("LocalCluster: could not tell the dispatcher: %s", e)
