"""Autoscaling of `LocalCluster(num_workers="auto")`: a thread that adds a worker
process when the consumers are input-bound and a CPU is free, and retires one,
without losing data, when the workers are mostly idle.

tf.data service only computes an "optimal number of workers" metric for its
operator to act on; this acts, for a cluster whose workers all run on this host.

Every `interval_s` (`LocalCluster(autoscale_interval_s=...)`, 1 s by default)
the autoscaler reads the dispatcher's status over the last `window_s` seconds
(`GetClusterStatus`, the counters consumers and workers heartbeat:
`dispatcher/observe.py`) and samples this host (psutil), then `decide`s:

* **add a worker** when the consumers waited at least
  `SCALE_UP_WAIT_FRACTION` (20 %, `dataservice status`'s *input-bound*) of the
  window, on average over the consumers that heartbeated counters, and every
  bound leaves room: fewer workers than `max_workers` and than the CPUs this
  process may run on (`os.sched_getaffinity`); at least `MIN_FREE_CPU` (0.5)
  CPU free of the cluster's own use, that is the CPU time this process (the
  trainer: its use counts) and the dispatcher's and workers' processes used
  over the window (other tenants' load is not held against the job: the kernel
  shares the CPUs among all runnable processes, so one more worker still gets
  the job a larger share; the host-wide figure is logged beside it); and
  available memory at least twice the largest worker's RSS (the new worker's
  and as much again spare).
* **retire a worker** when no consumer is input-bound (they waited less than
  `SCALE_DOWN_WAIT_FRACTION`, 10 %, or none is attached) and the workers'
  busy time (1 - idle fraction, summed) would keep the others at most
  `SCALE_DOWN_MAX_BUSY` (50 %) busy, continuously for `scale_down_grace_s`
  (30 s by default). Never below one worker.

After a change the autoscaler waits a full window before the next one, so
that the rates it reads were measured with the new number of workers.

Retiring drains politely (`dispatcher/retire.py`): the newest worker is marked
draining at the dispatcher, gets no new task, and its DYNAMIC tasks get no more
splits, so they finish after their consumers read the elements of the splits
they hold; only then is the process stopped (SIGTERM, `grace_period_s`) and
the dispatcher told to forget it. No element is lost or repeated. A worker
that runs a task of an OFF job, of static sharding or of a coordinated read is
never retired (it would change what that epoch contains): the autoscaler tries
an older worker, else waits for those iterations to end. A new worker gets a
task in every running DYNAMIC iteration at once (tf.data service adds tasks for
a new worker to running jobs too), so it takes splits mid-epoch; it joins
running OFF, static-sharding and coordinated-read iterations not at all
(`WorkerHeartbeatRequest.join_running_dynamic_only`; tf.data service would
give a running OFF iteration one more copy of the dataset from it: with an
autoscaler that loops, each added worker adding a copy and making the epoch
longer), only the iterations created after it joined. If the
consumers turn input-bound while a worker drains, its retirement is cancelled.

Each decision is logged at INFO on the "dataservice.cluster" logger with its
reason ("adding worker-1: consumers waited 78 % of the last 5 s; the cluster
used 0.9 of 2 CPUs (45 %; host 100 %)") and listed in
`LocalCluster.autoscale_events`; `LocalCluster.num_workers` is the current
count.

Owns `AutoscaleConfig` (validated knobs), `Signals` and `decide` (the pure
rule, unit-tested), `CpuMeter` and `AutoscaleMixin` (the thread's methods;
`LocalCluster` inherits them and holds their fields).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from dataservice import _proc, _serverproc, errors, status
from dataservice._worker_supervision import _Proc, logger

DEFAULT_AUTOSCALE_INTERVAL_S = 1.0
DEFAULT_AUTOSCALE_WINDOW_S = 5.0
DEFAULT_SCALE_DOWN_GRACE_S = 30.0
SCALE_UP_WAIT_FRACTION = status.INPUT_BOUND_WAIT_FRACTION
SCALE_DOWN_WAIT_FRACTION = 0.1
SCALE_DOWN_MAX_BUSY = 0.5
MIN_FREE_CPU = 0.5
MEMORY_HEADROOM = 2.0  # available memory must be this many times the largest worker RSS
_DRAIN_LOG_PERIOD_S = 30.0


def host_cpus() -> int:
    """The CPUs this process may run on (`os.sched_getaffinity`; `os.cpu_count` elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _number(name: str, value: Any, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"`{name}` must be a number of seconds, got {value!r}")
    if positive and not value > 0 or not positive and value < 0 or math.isinf(value):
        raise ValueError(
            f"`{name}` must be a finite number of seconds {'> 0' if positive else '>= 0'}, "
            f"got {value!r}"
        )
    return float(value)


@dataclasses.dataclass(frozen=True)
class AutoscaleConfig:
    """The knobs of `LocalCluster(num_workers="auto")` (see the module docstring).

    Attributes:
        max_workers: Most worker processes (>= 1); never above `host_cpus()`.
        interval_s: Seconds between two decisions (> 0).
        window_s: Seconds the rates a decision reads cover (> 0); also the wait
            after a change before the next one.
        scale_down_grace_s: Seconds the workers must stay mostly idle before
            one is retired (>= 0).

    Raises:
        ValueError: A bad value, naming the `LocalCluster` argument.
    """

    max_workers: int
    interval_s: float = DEFAULT_AUTOSCALE_INTERVAL_S
    window_s: float = DEFAULT_AUTOSCALE_WINDOW_S
    scale_down_grace_s: float = DEFAULT_SCALE_DOWN_GRACE_S

    def __post_init__(self) -> None:
        m = self.max_workers
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"`max_workers` must be an int >= 1, got {m!r}")
        _number("autoscale_interval_s", self.interval_s, positive=True)
        _number("autoscale_window_s", self.window_s, positive=True)
        _number("scale_down_grace_s", self.scale_down_grace_s, positive=False)


@dataclasses.dataclass
class Signals:
    """What one decision reads (see `decide`)."""

    num_workers: int
    max_workers: int  # AutoscaleConfig.max_workers, capped at `cpus`
    cpus: int
    window_s: float
    consumers: int  # attached to some job
    wait_fraction: float | None  # mean over consumers with counters in the window
    busy_workers: float | None  # sum over workers of 1 - idle fraction (None: unknown)
    cluster_cpus_used: float | None  # CPUs this process and the servers used in the window
    host_cpu_percent: float  # the whole host's, for the log
    available_bytes: int
    worker_rss_bytes: int  # the largest worker's (0: unknown)


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str  # "add", "retire" or "hold"
    reason: str


def decide(s: Signals) -> Decision:
    """The rule of the module docstring, on one set of signals. Pure.

    "retire" means the workers are idle enough *now*; the caller retires one
    only after it has held for `scale_down_grace_s`.
    """
    cpu = (
        "cluster CPU use unknown yet"
        if s.cluster_cpus_used is None
        else f"the cluster used {s.cluster_cpus_used:.1f} of {s.cpus} CPUs "
        f"({100 * s.cluster_cpus_used / s.cpus:.0f} %; host {s.host_cpu_percent:.0f} %)"
    )
    if s.wait_fraction is not None and s.wait_fraction >= SCALE_UP_WAIT_FRACTION:
        waited = f"consumers waited {100 * s.wait_fraction:.0f} % of the last {s.window_s:g} s"
        if s.num_workers >= s.max_workers:
            return Decision("hold", f"{waited}, but {s.num_workers} workers is the most allowed")
        if s.cluster_cpus_used is None:
            return Decision("hold", f"{waited}, but {cpu}")
        if s.cpus - s.cluster_cpus_used < MIN_FREE_CPU:
            return Decision("hold", f"{waited}, but no CPU is free: {cpu}")
        if s.worker_rss_bytes and s.available_bytes < MEMORY_HEADROOM * s.worker_rss_bytes:
            return Decision(
                "hold",
                f"{waited}, but only {s.available_bytes / 2**20:.0f} MiB of memory is "
                f"available for workers of {s.worker_rss_bytes / 2**20:.0f} MiB RSS",
            )
        return Decision("add", f"{waited}; {cpu}")
    if s.num_workers <= 1:
        return Decision("hold", "one worker")
    if s.wait_fraction is not None and s.wait_fraction >= SCALE_DOWN_WAIT_FRACTION:
        return Decision(
            "hold", f"consumers waited {100 * s.wait_fraction:.0f} % of the last {s.window_s:g} s"
        )
    if s.busy_workers is None:
        return Decision("hold", "the workers' idle time is unknown yet")
    if s.busy_workers > SCALE_DOWN_MAX_BUSY * (s.num_workers - 1):
        return Decision(
            "hold", f"the workers were busy {s.busy_workers:.1f} of {s.num_workers} in the window"
        )
    who = (
        "no consumer is attached"
        if s.consumers == 0 or s.wait_fraction is None
        else f"consumers waited {100 * s.wait_fraction:.0f} %"
    )
    return Decision(
        "retire",
        f"{who} and the {s.num_workers} workers were busy {s.busy_workers:.1f} of "
        f"{s.num_workers} over the last {s.window_s:g} s",
    )


class CpuMeter:
    """CPU time of a changing set of processes over a sliding window
    (psutil). Thread-compatible (the autoscaler thread only)."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._procs: dict[int, Any] = {}
        self._samples: collections.deque[tuple[float, dict[int, float]]] = collections.deque()

    def sample(self, pids: list[int], window_s: float) -> None:
        now = time.monotonic()
        cpu: dict[int, float] = {}
        for pid in pids:
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = self._psutil.Process(pid)
                t = proc.cpu_times()
                cpu[pid] = t.user + t.system
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                self._procs.pop(pid, None)
        for pid in list(self._procs):
            if pid not in cpu:
                del self._procs[pid]
        self._samples.append((now, cpu))
        while len(self._samples) > 2 and now - self._samples[1][0] >= window_s:
            self._samples.popleft()

    def used_cpus(self) -> float | None:
        """CPUs used between the oldest and newest sample (None: one sample)."""
        if len(self._samples) < 2:
            return None
        (t0, old), (t1, new) = self._samples[0], self._samples[-1]
        if t1 <= t0:
            return None
        return sum(max(0.0, new[p] - old[p]) for p in new if p in old) / (t1 - t0)


@dataclasses.dataclass
class _Retirement:
    worker: _Proc
    reason: str
    started: float
    logged: float


class AutoscaleMixin:
    """The autoscaler thread's methods of `LocalCluster` (see the module). It
    runs on `LocalCluster`'s fields (declared below) under `LocalCluster._lock`."""

    _lock: threading.RLock
    _workers: list[_Proc]
    _pending_workers: list[_Proc]
    _stopping: threading.Event
    _stopped: bool
    _autoscale: AutoscaleConfig | None
    _autoscale_events: list[dict[str, Any]]
    _next_worker_index: int
    _start_timeout_s: float
    _grace_period_s: float
    _auth_token: str
    _dispatcher: _Proc | None

    if TYPE_CHECKING:  # LocalCluster's, used here

        def _spawn(self, kind: str, name: str, flags: list[str]) -> _Proc: ...

        def _worker_flags(self, port: int | None = None) -> list[str]: ...

        def _wait_ready(self, proc: _Proc, deadline: float, interruptible: bool = False) -> str: ...

        @property
        def dispatcher_address(self) -> str: ...

        @property
        def num_workers(self) -> int: ...

    def _autoscale_loop(self) -> None:
        """Decides every `interval_s` until the cluster stops (module docstring)."""
        import psutil

        cfg = self._autoscale
        assert cfg is not None
        cpus = host_cpus()
        most = min(cfg.max_workers, cpus)
        meter = CpuMeter()
        psutil.cpu_percent(None)  # starts the host-wide measure
        last_change = time.monotonic()
        idle_since: float | None = None
        retirement: _Retirement | None = None
        last_hold = ""
        with _serverproc.DispatcherStub(self.dispatcher_address, self._auth_token) as dispatcher:
            while not self._stopping.wait(cfg.interval_s):
                try:
                    with self._lock:
                        workers = list(self._workers)
                        pids = [os.getpid()] + [w.popen.pid for w in workers]
                        if self._dispatcher is not None:
                            pids.append(self._dispatcher.popen.pid)
                    meter.sample(pids, cfg.window_s)
                    signals = self._signals(dispatcher, workers, meter, cfg, cpus, most)
                    decision = decide(signals)
                    now = time.monotonic()
                    if retirement is not None:
                        if decision.action == "add":
                            self._cancel_retirement(dispatcher, retirement, decision.reason)
                            retirement, last_change = None, now
                        elif self._retirement_done(dispatcher, retirement):
                            # (It may have taken grace_period_s to stop the process.)
                            retirement, last_change, idle_since = None, time.monotonic(), None
                        continue
                    if decision.action != "retire":
                        idle_since = None
                    if now - last_change < cfg.window_s:
                        continue  # the window still shows the previous number of workers
                    if decision.action == "add":
                        if self._add_worker(decision.reason):
                            last_change, last_hold = time.monotonic(), ""
                    elif decision.action == "retire":
                        if idle_since is None:
                            idle_since = now
                        if now - idle_since >= cfg.scale_down_grace_s:
                            reason = (
                                f"{decision.reason} (idle for {now - idle_since:.0f} s, "
                                f"scale_down_grace_s={cfg.scale_down_grace_s:g})"
                            )
                            retirement = self._start_retirement(dispatcher, workers, reason)
                    elif decision.reason != last_hold and signals.wait_fraction is not None:
                        last_hold = decision.reason
                        logger.debug("LocalCluster autoscaler: holding: %s", decision.reason)
                except errors.DataServiceError as e:  # the dispatcher busy or restarting
                    if self._stopping.is_set():
                        return
                    logger.warning("LocalCluster autoscaler: %s; trying again", e)
                except Exception:  # a bug: keep the cluster serving at its size
                    logger.exception("LocalCluster autoscaler failed; it stops scaling")
                    return

    def _signals(
        self,
        dispatcher: _serverproc.DispatcherStub,
        workers: list[_Proc],
        meter: CpuMeter,
        cfg: AutoscaleConfig,
        cpus: int,
        most: int,
    ) -> Signals:
        import psutil

        from dataservice.rpc import service_pb2 as pb
        from dataservice.rpc import util as rpc_util

        response = rpc_util.call_with_retries(
            lambda: dispatcher.stub.GetClusterStatus(
                pb.GetClusterStatusRequest(window_ms=max(1, round(cfg.window_s * 1000))),
                timeout=5.0,
                metadata=dispatcher.metadata,
            ),
            address=dispatcher.address,
            what="GetClusterStatus to the dispatcher",
            timeout_ms=10_000,
            stop=self._stopping,
        )
        st = status.to_dict(response)
        waits = [
            c["wait_fraction"]
            for j in st["jobs"]
            for c in j["consumers"]
            if c["wait_fraction"] is not None
        ]
        consumers = sum(len(j["consumers"]) for j in st["jobs"])
        ours = {w.address for w in workers}
        busy: float | None = 0.0
        for w in st["workers"]:
            if w["address"] not in ours:
                continue
            if w["idle_fraction"] is None:
                busy = None
                break
            assert busy is not None
            busy += 1.0 - w["idle_fraction"]
        rss = 0
        for w in workers:
            try:
                rss = max(rss, psutil.Process(w.popen.pid).memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return Signals(
            num_workers=len(workers),
            max_workers=most,
            cpus=cpus,
            window_s=cfg.window_s,
            consumers=consumers,
            wait_fraction=sum(waits) / len(waits) if waits else None,
            busy_workers=busy,
            cluster_cpus_used=meter.used_cpus(),
            host_cpu_percent=psutil.cpu_percent(None),
            available_bytes=psutil.virtual_memory().available,
            worker_rss_bytes=rss,
        )

    def _record(self, action: str, w: _Proc, reason: str) -> None:
        with self._lock:
            self._autoscale_events.append(
                {
                    "time": time.time(),
                    "action": action,
                    "worker": w.name,
                    "address": w.address,
                    "num_workers": len(self._workers),
                    "reason": reason,
                }
            )

    def _add_worker(self, reason: str) -> bool:
        """Starts one more worker process and waits (up to `start_timeout_s`)
        until it serves. Returns whether it does."""
        with self._lock:
            if self._stopped:
                return False
            name = f"worker-{self._next_worker_index}"
            self._next_worker_index += 1
        logger.info("LocalCluster: adding %s: %s", name, reason)
        try:
            # A running OFF epoch must not get one more copy from it (see the module).
            extra = ["--join-running-dynamic-only"]
            w = self._spawn("worker", name, [*self._worker_flags(), *extra])
            w.extra_flags = extra
        except OSError as e:
            logger.error("LocalCluster: cannot start %s: %s", name, e)
            return False
        with self._lock:
            self._pending_workers.append(w)
        try:
            self._wait_ready(w, time.monotonic() + self._start_timeout_s, interruptible=True)
        except (RuntimeError, TimeoutError) as e:
            with self._lock:
                self._pending_workers.remove(w)
            _proc.terminate_processes([w.popen], 0.0, own_groups=True)
            if not self._stopping.is_set():
                logger.error("LocalCluster: could not add %s: %s", name, e)
            return False
        with self._lock:
            self._pending_workers.remove(w)
            if self._stopped:
                _proc.terminate_processes([w.popen], 0.0, own_groups=True)
                return False
            self._workers.append(w)
        self._record("add", w, reason)
        logger.info("LocalCluster: %s serves at %s (%d workers)", name, w.address, self.num_workers)
        return True

    def _retire_call(
        self, dispatcher: _serverproc.DispatcherStub, address: str, **flags: bool
    ) -> Any:
        from dataservice.rpc import service_pb2 as pb
        from dataservice.rpc import util as rpc_util

        return rpc_util.call_with_retries(
            lambda: dispatcher.stub.RetireWorker(
                pb.RetireWorkerRequest(worker_address=address, **flags),
                timeout=5.0,
                metadata=dispatcher.metadata,
            ),
            address=dispatcher.address,
            what="RetireWorker to the dispatcher",
            timeout_ms=10_000,
            stop=self._stopping,
        )

    def _start_retirement(
        self, dispatcher: _serverproc.DispatcherStub, workers: list[_Proc], reason: str
    ) -> _Retirement | None:
        """Starts draining the newest worker the dispatcher lets go (see
        `dispatcher/retire.py`); None if none can go now (each refusal is
        logged at DEBUG: the next decision tries again)."""
        for w in reversed(workers):
            try:
                response = self._retire_call(dispatcher, w.address)
            except errors.NotFoundError:
                continue  # not registered (yet, or again after a restart)
            if response.refused:
                logger.debug("LocalCluster: cannot retire %s now: %s", w.name, response.refused)
                continue
            logger.info(
                "LocalCluster: retiring %s (%s): %s; draining its %d tasks",
                w.name,
                w.address,
                reason,
                response.tasks,
            )
            self._record("drain", w, reason)
            now = time.monotonic()
            return _Retirement(w, reason, now, now)
        return None

    def _cancel_retirement(
        self, dispatcher: _serverproc.DispatcherStub, r: _Retirement, reason: str
    ) -> None:
        try:
            self._retire_call(dispatcher, r.worker.address, cancel=True)
        except errors.NotFoundError:
            pass  # restarted meanwhile: registered anew, not draining
        logger.info("LocalCluster: keeping %s after all: %s", r.worker.name, reason)
        self._record("cancel-retire", r.worker, reason)

    def _retirement_done(self, dispatcher: _serverproc.DispatcherStub, r: _Retirement) -> bool:
        """Asks whether `r`'s worker drained (draining it again if it was
        restarted meanwhile); when it has, stops its process and has the
        dispatcher forget it. Returns whether the retirement is over."""
        w = r.worker
        with self._lock:
            current = next((x for x in self._workers if x.name == w.name), None)
        if current is None:
            return True  # given up by the monitor (crash loop)
        try:
            response = self._retire_call(dispatcher, current.address)
        except errors.NotFoundError:
            return False  # restarting: ask again when it registered
        if response.refused:
            logger.info("LocalCluster: not retiring %s: %s", w.name, response.refused)
            return True
        if not response.drained:
            now = time.monotonic()
            if now - r.logged >= _DRAIN_LOG_PERIOD_S:
                r.logged = now
                logger.info(
                    "LocalCluster: %s still drains: %d tasks wait for their consumers to "
                    "read what they hold (%.0f s)",
                    w.name,
                    response.tasks,
                    now - r.started,
                )
            return False
        with self._lock:
            if self._stopped or current not in self._workers:
                return True
            self._workers.remove(current)  # the monitor no longer watches it
            self._pending_workers.append(current)  # stop() still stops it
        _proc.terminate_processes([current.popen], self._grace_period_s, own_groups=True)
        for pump, stream in (
            (current.stdout, current.popen.stdout),
            (current.stderr, current.popen.stderr),
        ):
            pump.join(1.0)
            if stream is not None and pump.done():
                stream.close()
        with self._lock:
            self._pending_workers.remove(current)
        try:
            self._retire_call(dispatcher, current.address, remove=True)
        except errors.DataServiceError as e:  # it is gone: the dispatcher times it out
            logger.warning("LocalCluster: could not tell the dispatcher %s retired: %s", w.name, e)
        logger.info(
            "LocalCluster: retired %s (pid %d) after %.1f s of draining (%d workers)",
            w.name,
            current.popen.pid,
            time.monotonic() - r.started,
            self.num_workers,
        )
        self._record("retire", current, r.reason)
        return True
