"""`LocalCluster`: a dispatcher and N worker *processes* on this host.

Each server runs as `python -m dataservice dispatcher|worker ... --parent-pid
<this pid>` (see `dataservice.cli`), binds 127.0.0.1, and prints a ready line
with its address (the format is `dataservice._serverproc`'s); the dispatcher
binds port 0 and the cluster reads the chosen port from that line, so there is
no port race.

Lifecycle (CASES C-01, C-23, C-24):

* `stop()` (also `__exit__`, interpreter exit through `atexit`, and SIGTERM of
  this process when no other SIGTERM handler is installed) sends SIGTERM to
  every server, waits `grace_period_s`, SIGKILLs what is left (with anything
  those processes started) and reaps them. It is bounded even when a worker is
  stuck in user code: at most about `grace_period_s` + 1 s in that case.
* If this process dies without stopping them, even by SIGKILL, the servers
  notice (parent-death signal on Linux, and a watcher thread polling the
  parent) and exit within a few seconds.
* Servers run in their own session, so Ctrl-C in a terminal reaches only this
  process, which then tears the cluster down.
* Only the process that started the cluster stops it. A process forked from it
  (a PyTorch DataLoader worker, a `multiprocessing` "fork" pool process, a bare
  `os.fork()`) inherits the cluster object, the `atexit` hook and the SIGTERM
  handler; in it `stop()` does nothing, the hooks are reset at fork
  (`os.register_at_fork`) and SIGTERM kills it as by default. Otherwise the
  child's exit (or `Pool.terminate()`) would kill the parent's servers.

Worker exits (CASES K4: a consumer gets progress or a bounded failure): a
monitor thread tells the dispatcher of each worker exit at once, then restarts
the worker on its port or gives up on it (`restart_workers`,
`max_worker_restarts`, `healthy_uptime_s`); `_worker_supervision.py` owns that rule and states it
in full.

Autoscaling (`num_workers="auto"`): a thread adds a worker process when the
consumers are input-bound and a CPU is free, and retires one, drained through
the dispatcher's RetireWorker so that no element is lost, when the workers are
mostly idle; `_autoscale.py` owns that rule and states it in full.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from dataservice import _proc, _serverproc, auth
from dataservice._autoscale import (
    DEFAULT_AUTOSCALE_INTERVAL_S,
    DEFAULT_AUTOSCALE_WINDOW_S,
    DEFAULT_SCALE_DOWN_GRACE_S,
    AutoscaleConfig,
    AutoscaleMixin,
    host_cpus,
)
from dataservice._worker_supervision import HEALTHY_UPTIME_S, WorkerSupervisionMixin, _Proc
from dataservice.config import DispatcherConfig, WorkerConfig, config_fields
from dataservice.dispatcher import buffer_store
from dataservice.rpc import util as rpc_util

logger = logging.getLogger(__name__)

DEFAULT_GRACE_PERIOD_S = 5.0
DEFAULT_START_TIMEOUT_S = 60.0
DEFAULT_MAX_WORKER_RESTARTS = 3


_NEVER_ON_COMMAND_LINE = ("auth_token", "auth_token_file")
"""Every local user can read a command line (`ps`): the token goes by environment."""


def _config_flags(config: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """CLI flags for the fields of `config` that differ from their defaults
    (never the auth token's: see `_NEVER_ON_COMMAND_LINE`)."""
    flags: list[str] = []
    for field in config_fields(type(config)):
        if field.name in skip or field.name in _NEVER_ON_COMMAND_LINE:
            continue
        value = getattr(config, field.name)
        if field.default is not dataclasses.MISSING and value == field.default:
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list | tuple):
            flags += [flag, ",".join(str(v) for v in value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def _child_env() -> dict[str, str]:
    """The environment of a server process: ours, plus the import path of this
    `dataservice` and the non-standard entries of our `sys.path`, so workers
    can import the modules user functions were pickled by reference from."""
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prefixes = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths = [pkg_root]
    for p in sys.path:
        ap = os.path.abspath(p) if p else os.getcwd()
        if not os.path.isdir(ap) or any(ap == q or ap.startswith(q + os.sep) for q in prefixes):
            continue
        if ap not in paths:
            paths.append(ap)
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class LocalCluster(WorkerSupervisionMixin, AutoscaleMixin):
    """A dispatcher and `num_workers` worker processes on 127.0.0.1.

    Example:
        with ds.LocalCluster(num_workers=2) as cluster:
            dataset = ds.Dataset.range(10).apply(ds.distribute("off", cluster.target))

    Auth (SECURITY.md): the servers always require a token, `auth_token`:
    the `dispatcher_config`'s, else one made here (`secrets.token_urlsafe`),
    so no other local user can connect to them. The servers get it through
    their environment (DATASERVICE_AUTH_TOKEN), never their command line
    (which every user can read in `ps`). Clients in this process that read
    from `target` send it without being told: the cluster registers it for
    its dispatcher address (`dataservice.auth.register_token`), which a
    client consults before DATASERVICE_AUTH_TOKEN. (Setting the environment
    variable instead would hand the token to every process this one starts,
    and two clusters would overwrite each other's.) Processes forked from
    this one (e.g. DataLoader workers) inherit the registration; clients in
    other processes need `DATASERVICE_AUTH_TOKEN=<cluster.auth_token>`.

    Thread-safe: properties and `stop()` may be called from any thread.

    Args:
        num_workers: Number of worker processes (>= 0), or "auto": start one
            and add or retire workers as the consumers need them, between 1
            and `max_workers` (`dataservice._autoscale` states the rule:
            consumers input-bound and a CPU free adds one; workers mostly
            idle for `scale_down_grace_s` retires one, after it drained
            without losing an element). Each decision is logged at INFO with
            its reason and listed in `autoscale_events`.
        max_workers: With num_workers="auto": the most worker processes
            (>= 1; default and upper bound: the CPUs this process may run on,
            `os.sched_getaffinity`). Only with "auto".
        autoscale_interval_s: With "auto": seconds between two decisions
            (> 0, default 1).
        autoscale_window_s: With "auto": seconds of consumer and worker
            counters each decision reads (> 0, default 5); also the wait after
            a change before the next.
        scale_down_grace_s: With "auto": seconds the workers must stay mostly
            idle before one is retired (>= 0, default 30).
        dispatcher_config: A `DispatcherConfig` for the dispatcher (port 0 by
            default; the bound port is read back).
        worker_options: `WorkerConfig` fields applied to every worker, e.g.
            `{"heartbeat_interval_ms": 100, "data_transfer_protocol": "grpc"}`.
            `dispatcher_address` is set by the cluster.
        restart_workers: Restart a worker process that exited (the default),
            on the same port so its address stays the same. A process that
            was up less than `healthy_uptime_s` (whether or not it handed out
            elements: a crash loop hands out a few before each crash) is
            restarted after a backoff (0.1 s, doubling, at most 2 s) with its
            tasks' pipelines started only when a consumer asks for them, and
            counts against `max_worker_restarts`; one that stayed up longer
            is restarted at once and resets that count (a rare crash never
            ends a long run). False: the cluster gives up on a worker at its
            first exit (as `max_worker_restarts` below, which it ignores):
            an iteration no other worker serves fails at once with
            `errors.WorkerCrashedError` naming the worker, its pid and its
            exit code or signal. Either way a monitor thread sees each exit
            within 0.1 s and tells the dispatcher at once.
        max_worker_restarts: With `restart_workers`, how many times in a row a
            worker whose process exits within `healthy_uptime_s` of starting
            is restarted (>= 0; None: forever). At the next such exit the
            cluster gives up
            on that worker: it logs an error, lists it in `failed_workers`,
            and tells the dispatcher, which drops the worker and fails every
            iteration that no worker is left to run: its consumers' `next()`
            raises `errors.WorkerCrashedError`, e.g. "no worker is left to run
            job 1000, repetition 0: ... worker-1 at 127.0.0.1:PORT exited with
            code 1, 4 times in a row, each within healthy_uptime_s=30 s of
            starting, each after handing out elements (pids ...; 4 exits since
            the cluster started); LocalCluster gave up restarting it
            (max_worker_restarts=3: ...)". While another worker still serves
            the iteration, it goes on.
        healthy_uptime_s: How long (seconds, > 0) a restarted worker process
            must stay up for its exit not to count against
            `max_worker_restarts` (default 30 s). Processes that each crash
            later than this are restarted forever, at most once per
            `healthy_uptime_s`: raise it to catch slower crash loops.
        start_timeout_s: How long each server may take to print its ready line.
        grace_period_s: Seconds between SIGTERM and SIGKILL on teardown.
        forward_output: Copy the servers' stdout/stderr lines to our stderr,
            prefixed with the server's name (they are always drained, and the
            last lines of a server that fails are part of the error).
        log_level: Logging level of the server processes.
        start: Start at once (else on `start()` or `__enter__`).

    Raises:
        ValueError: A bad argument (unknown worker option, invalid config, a
            `worker_options` token that differs from the dispatcher's).
        RuntimeError: A server exited before it was ready; the message has the
            end of its stderr.
        TimeoutError: A server did not print its ready line within
            `start_timeout_s` seconds.
    """

    def __init__(
        self,
        num_workers: int | str = 2,
        *,
        max_workers: int | None = None,
        autoscale_interval_s: float | None = None,
        autoscale_window_s: float | None = None,
        scale_down_grace_s: float | None = None,
        dispatcher_config: DispatcherConfig | None = None,
        worker_options: Mapping[str, Any] | None = None,
        restart_workers: bool = True,
        max_worker_restarts: int | None = DEFAULT_MAX_WORKER_RESTARTS,
        healthy_uptime_s: float = HEALTHY_UPTIME_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        grace_period_s: float = DEFAULT_GRACE_PERIOD_S,
        forward_output: bool = False,
        log_level: str = "WARNING",
        start: bool = True,
    ) -> None:
        autoscale = _autoscale_config(
            num_workers, max_workers, autoscale_interval_s, autoscale_window_s, scale_down_grace_s
        )
        if autoscale is not None:
            num_workers = 1
            several = autoscale.max_workers > 1
        elif not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
            raise ValueError(f"`num_workers` must be an int >= 0 or 'auto', got {num_workers!r}")
        else:
            several = num_workers > 1
        if dispatcher_config is None:
            dispatcher_config = DispatcherConfig()
        if not isinstance(dispatcher_config, DispatcherConfig):
            raise ValueError(
                f"`dispatcher_config` must be a DispatcherConfig, got {type(dispatcher_config)}"
            )
        options = dict(worker_options or {})
        known = {f.name for f in config_fields(WorkerConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown `worker_options` {unknown}; WorkerConfig fields are {sorted(known)}"
            )
        if "dispatcher_address" in options:
            raise ValueError("`worker_options` must not set `dispatcher_address`: the cluster does")
        if several and options.get("port", 0) != 0:
            raise ValueError(f"several workers cannot share `port={options['port']}`")
        if (
            several
            and options.get("worker_address")
            and ("%port%" not in options["worker_address"])
        ):
            raise ValueError("with several workers, `worker_address` must contain '%port%'")
        # Workers bind loopback: advertise exactly that address, not "localhost"
        # (which may resolve to ::1 first).
        options.setdefault("worker_address", "127.0.0.1:%port%")
        # Validates the values (raises ValueError naming a bad field).
        self._worker_template = WorkerConfig(dispatcher_address="127.0.0.1:1", **options)
        if grace_period_s < 0 or start_timeout_s <= 0:
            raise ValueError("`grace_period_s` must be >= 0 and `start_timeout_s` > 0")
        if max_worker_restarts is not None and (
            not isinstance(max_worker_restarts, int)
            or isinstance(max_worker_restarts, bool)
            or max_worker_restarts < 0
        ):
            raise ValueError(
                f"`max_worker_restarts` must be an int >= 0 or None, got {max_worker_restarts!r}"
            )

        if (
            isinstance(healthy_uptime_s, bool)
            or not isinstance(healthy_uptime_s, int | float)
            or not healthy_uptime_s > 0
        ):
            raise ValueError(f"`healthy_uptime_s` must be a number > 0, got {healthy_uptime_s!r}")

        # The dispatcher's token (auth_token, auth_token_file or the environment),
        # else the workers', else a fresh one: a cluster never serves without one.
        token = auth.resolve_token(dispatcher_config.auth_token, dispatcher_config.auth_token_file)
        worker_token = auth.resolve_token(
            options.get("auth_token"), options.get("auth_token_file"), environ={}
        )
        if token and worker_token and not auth.tokens_equal(token, worker_token):
            raise ValueError(
                "the auth token of `worker_options` differs from the `dispatcher_config`'s; "
                "set it once, in `dispatcher_config`"
            )
        self._auth_token: str = token or worker_token or auth.new_token()

        self._num_workers = num_workers
        self._autoscale = autoscale
        self._autoscale_events: list[dict[str, Any]] = []  # guarded by self._lock
        self._pending_workers: list[_Proc] = []  # guarded by self._lock: starting or retiring
        self._next_worker_index = num_workers  # guarded by self._lock: names of added workers
        self._autoscaler: threading.Thread | None = None
        self._dispatcher_config = dispatcher_config
        self._restart_workers = restart_workers
        self._max_worker_restarts = max_worker_restarts
        self._healthy_uptime_s = float(healthy_uptime_s)
        self._start_timeout_s = start_timeout_s
        self._grace_period_s = grace_period_s
        self._forward = sys.stderr if forward_output else None
        self._log_level = log_level

        self._lock = threading.RLock()  # RLock: stop() may run in a signal handler
        self._dispatcher: _Proc | None = None  # guarded by self._lock
        self._workers: list[_Proc] = []  # guarded by self._lock
        self._restarts = 0  # guarded by self._lock
        self._failed: dict[str, str] = {}  # guarded by self._lock: address -> why given up
        self._started = False  # guarded by self._lock
        self._stopped = False  # guarded by self._lock
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._owner_pid = os.getpid()  # only this process stops the servers (forks don't)
        if start:
            self.start()

    # ---------------------------------------------------------------- start

    def _spawn(self, kind: str, name: str, flags: list[str]) -> _Proc:
        argv = [
            sys.executable,
            "-m",
            "dataservice",
            kind,
            *flags,
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            self._log_level,
        ]
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**_child_env(), auth.AUTH_ENV: self._auth_token},
            start_new_session=True,  # Ctrl-C reaches us, not them; killpg reaches their children
            close_fds=True,
        )
        assert popen.stdout is not None and popen.stderr is not None
        return _Proc(
            name=name,
            popen=popen,
            stdout=_proc.OutputPump(
                popen.stdout,
                name,
                _serverproc.READY_RE,
                forward=self._forward,
                progress_pattern=_serverproc.FIRST_ELEMENT_RE if kind == "worker" else None,
            ),
            stderr=_proc.OutputPump(popen.stderr, name, None, forward=self._forward),
        )

    def _wait_ready(self, proc: _Proc, deadline: float, interruptible: bool = False) -> str:
        """Waits for `proc`'s ready line and returns the address in it.

        Raises:
            RuntimeError: The process exited first (message has its stderr tail).
            TimeoutError: No ready line by `deadline`.
        """
        while True:
            step = min(deadline, time.monotonic() + 0.2) if interruptible else deadline
            match = proc.stdout.wait_ready(step)
            if match is not None:
                proc.address = match.group(2)
                return proc.address
            if interruptible and self._stopping.is_set():
                raise RuntimeError(f"{proc.name}: cluster stopping")
            if proc.popen.poll() is not None or time.monotonic() >= deadline:
                break
        try:  # EOF on stdout: the process is exiting; let it finish writing stderr
            code = proc.popen.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        proc.stderr.join(1.0)
        tail = proc.stderr.tail(20) or "(no output on stderr)"
        if code is None:
            raise TimeoutError(
                f"{proc.name} (pid {proc.popen.pid}) did not report ready within "
                f"{self._start_timeout_s:.0f} s; last lines of its stderr:\n{tail}"
            )
        raise RuntimeError(
            f"{proc.name} (pid {proc.popen.pid}) exited with code {code} before it was "
            f"ready; last lines of its stderr:\n{tail}"
        )

    def _worker_flags(self, port: int | None = None) -> list[str]:
        assert self._dispatcher is not None
        template = self._worker_template
        if port is not None:
            template = dataclasses.replace(template, port=port)
        return [
            "--dispatcher",
            self._dispatcher.address,
            *_config_flags(template, skip=("dispatcher_address",)),
        ]

    def start(self) -> None:
        """Starts the dispatcher, then the workers, and waits until all serve.

        Blocks up to `start_timeout_s` per stage. Idempotent.

        Raises:
            RuntimeError, TimeoutError: See the class. Whatever was started is
                stopped again before the error propagates.
        """
        with self._lock:
            if self._started:
                return
            if self._stopped:
                raise RuntimeError("a stopped LocalCluster cannot be started again")
            self._started = True
            _register(self)
        try:
            dispatcher = self._spawn(
                "dispatcher", "dispatcher", _config_flags(self._dispatcher_config)
            )
            with self._lock:
                self._dispatcher = dispatcher
            self._wait_ready(dispatcher, time.monotonic() + self._start_timeout_s)
            auth.register_token(dispatcher.address, self._auth_token)
            rpc_util.mark_back(dispatcher.address)  # an earlier cluster's, stopped, had it
            workers = [
                self._spawn("worker", f"worker-{i}", self._worker_flags())
                for i in range(self._num_workers)
            ]
            with self._lock:
                self._workers = workers
            deadline = time.monotonic() + self._start_timeout_s
            for w in workers:
                self._wait_ready(w, deadline)
        except BaseException:
            self.stop()
            raise
        logger.info(
            "LocalCluster: dispatcher %s, workers %s", dispatcher.address, self.worker_addresses
        )
        # (the dispatcher's process too: with or without workers)
        self._monitor = threading.Thread(
            target=self._monitor_workers, name="ds-cluster-monitor", daemon=True
        )
        self._monitor.start()
        if self._autoscale is not None:
            self._autoscaler = threading.Thread(
                target=self._autoscale_loop, name="ds-cluster-autoscaler", daemon=True
            )
            self._autoscaler.start()

    # ----------------------------------------------------------------- stop

    def stop(self, grace_period_s: float | None = None) -> None:
        """Stops every server process and reaps it. Idempotent; thread-safe.

        SIGTERM to all, wait up to `grace_period_s` (default: the cluster's),
        then SIGKILL (with anything they started), then reap. Bounded.

        In a process forked from the one that started the cluster it does
        nothing: the servers are the parent's, still serving it.
        """
        if os.getpid() != self._owner_pid:
            logger.debug("LocalCluster.stop() in forked process %d: left to its owner", os.getpid())
            return
        grace = self._grace_period_s if grace_period_s is None else grace_period_s
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._stopping.set()
        for thread in (self._monitor, self._autoscaler):
            if thread is not None and thread is not threading.current_thread():
                thread.join(2.0)
        with self._lock:
            procs = [
                *self._workers,
                *self._pending_workers,
                *([self._dispatcher] if self._dispatcher else []),
            ]
        dispatcher = self._dispatcher
        if dispatcher is not None and dispatcher.address:
            # Before the processes go: a read in progress that loses them fails at
            # once, saying why, rather than warning it retries (and a dataset of this
            # cluster iterated after stop() fails at once too).
            rpc_util.mark_gone(
                dispatcher.address,
                "it was the dispatcher of a LocalCluster that was stopped",
                with_its_workers=True,
            )
        _proc.terminate_processes([p.popen for p in procs], grace, own_groups=True)
        for p in procs:
            p.stdout.join(1.0)
            p.stderr.join(1.0)
            for pump, stream in ((p.stdout, p.popen.stdout), (p.stderr, p.popen.stderr)):
                if stream is not None and pump.done():  # else a reader blocks in it
                    stream.close()
        if dispatcher is not None and dispatcher.address:
            auth.unregister_token(dispatcher.address)
        if dispatcher is not None and dispatcher.popen.returncode is not None:
            # One that died without stopping (SIGKILL) left its dataset buffer files.
            buffer_store.remove_private_dirs(dispatcher.popen.pid)
        _unregister(self)

    # ------------------------------------------------------------ properties

    @property
    def target(self) -> str:
        """The dispatcher as "grpc://127.0.0.1:PORT", for `distribute(...)`."""
        return f"grpc://{self.dispatcher_address}"

    @property
    def dispatcher_address(self) -> str:
        """The dispatcher's "host:port"."""
        with self._lock:
            if self._dispatcher is None or not self._dispatcher.address:
                raise RuntimeError("the LocalCluster is not started")
            return self._dispatcher.address

    @property
    def auth_token(self) -> str:
        """The token every server of this cluster requires: the
        `dispatcher_config`'s (`auth_token`, `auth_token_file` or
        DATASERVICE_AUTH_TOKEN when the cluster was made), else a random one
        made by the cluster. This process's clients of `target` send it
        without being told; give it (DATASERVICE_AUTH_TOKEN) to clients in
        other processes."""
        return self._auth_token

    @property
    def dispatcher_pid(self) -> int:
        with self._lock:
            if self._dispatcher is None:
                raise RuntimeError("the LocalCluster is not started")
            return self._dispatcher.popen.pid

    @property
    def worker_addresses(self) -> list[str]:
        """The workers' addresses as they advertise them ("host:port"), by index."""
        with self._lock:
            return [w.address for w in self._workers]

    @property
    def worker_pids(self) -> list[int]:
        """The workers' current pids, by index (a restarted worker has a new one)."""
        with self._lock:
            return [w.popen.pid for w in self._workers]

    @property
    def num_workers(self) -> int:
        """The worker processes the cluster runs now: `num_workers`, or with
        "auto" the autoscaler's current count (a draining worker counts until
        its process is stopped)."""
        if self._autoscale is None:
            return self._num_workers
        with self._lock:
            return len(self._workers)

    @property
    def max_workers(self) -> int:
        """The most workers: `num_workers`, or with "auto" `max_workers` capped
        at the CPUs this process may run on."""
        if self._autoscale is None:
            return self._num_workers
        return min(self._autoscale.max_workers, host_cpus())

    @property
    def autoscale_events(self) -> list[dict[str, Any]]:
        """The autoscaler's decisions, oldest first: dicts with "time" (Unix
        seconds), "action" ("add"; "drain": a retirement starts; "retire": its
        process stopped; "cancel-retire"), "worker" (its
        name), "address", "num_workers" (after it) and "reason" (as logged).
        Empty without num_workers="auto"."""
        with self._lock:
            return [dict(e) for e in self._autoscale_events]

    @property
    def failed_workers(self) -> dict[str, str]:
        """The workers the monitor gave up on (`max_worker_restarts`): address ->
        why (name, pids, how they exited; the consumers' error quotes it)."""
        with self._lock:
            return dict(self._failed)

    @property
    def num_restarts(self) -> int:
        """How many worker processes the monitor restarted (`restart_workers=True`)."""
        with self._lock:
            return self._restarts

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        with self._lock:
            state = "stopped" if self._stopped else "running" if self._started else "new"
            dispatcher = self._dispatcher.address if self._dispatcher else None
            return (
                f"LocalCluster({state}, dispatcher={dispatcher!r}, "
                f"workers={[w.address for w in self._workers]!r})"
            )


def _autoscale_config(
    num_workers: int | str,
    max_workers: int | None,
    interval_s: float | None,
    window_s: float | None,
    grace_s: float | None,
) -> AutoscaleConfig | None:
    """The autoscaler's validated config for num_workers="auto", else None.

    Raises:
        ValueError: A bad value, or an autoscaling argument without "auto".
    """
    knobs = {
        "max_workers": max_workers,
        "autoscale_interval_s": interval_s,
        "autoscale_window_s": window_s,
        "scale_down_grace_s": grace_s,
    }
    if not (isinstance(num_workers, str) and num_workers.lower() == "auto"):
        given = [k for k, v in knobs.items() if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(f'`{k}`' for k in given)} only apply to num_workers='auto' "
                f"(autoscaling), got num_workers={num_workers!r}"
            )
        return None
    cpus = host_cpus()
    if max_workers is None:
        max_workers = cpus
    config = AutoscaleConfig(
        max_workers=max_workers,
        interval_s=DEFAULT_AUTOSCALE_INTERVAL_S if interval_s is None else interval_s,
        window_s=DEFAULT_AUTOSCALE_WINDOW_S if window_s is None else window_s,
        scale_down_grace_s=DEFAULT_SCALE_DOWN_GRACE_S if grace_s is None else grace_s,
    )
    if config.max_workers > cpus:
        logger.info(
            "LocalCluster: max_workers=%d, but this process may run on %d CPUs: at most %d workers",
            config.max_workers,
            cpus,
            cpus,
        )
    return config


# ------------------------------------------------ every live cluster, for exit

_live_mu = threading.RLock()  # RLock: _on_sigterm may interrupt a holder
_refs: dict[int, LocalCluster] = {}  # guarded by _live_mu: a started cluster lives until stop
_atexit_registered = False  # guarded by _live_mu
_prev_sigterm: Any = None  # guarded by _live_mu: the handler ours replaced


def _stop_all() -> None:
    with _live_mu:
        clusters = [c for c in _refs.values() if c._owner_pid == os.getpid()]
    for c in clusters:
        try:
            c.stop()
        except Exception:  # at exit: keep stopping the others
            logger.exception("LocalCluster: teardown failed")


def _on_sigterm(signum: int, frame: object) -> None:
    """Tears every cluster this process started down, then dies of SIGTERM as we
    would have (a forked child whose at-fork reset could not run just dies)."""
    _stop_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _register(cluster: LocalCluster) -> None:
    global _atexit_registered, _prev_sigterm
    with _live_mu:
        _refs[id(cluster)] = cluster
        if not _atexit_registered:
            atexit.register(_stop_all)
            _atexit_registered = True
        if threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                    _prev_sigterm = signal.SIG_DFL
                    signal.signal(signal.SIGTERM, _on_sigterm)
            except ValueError:  # not the main interpreter
                pass


def _unregister(cluster: LocalCluster) -> None:
    global _prev_sigterm
    with _live_mu:
        _refs.pop(id(cluster), None)
        if (
            not _refs
            and _prev_sigterm is not None
            and threading.current_thread() is threading.main_thread()
        ):
            try:
                if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                    signal.signal(signal.SIGTERM, _prev_sigterm)
                    _prev_sigterm = None
            except ValueError:
                pass


def _after_fork_in_child() -> None:
    """Forgets the parent's clusters in a forked child (`os.register_at_fork`).

    The child must not stop them at exit or on SIGTERM, and `_live_mu` may have
    been held by another thread of the parent at fork (it would never be
    released here): a fresh lock, no clusters, the SIGTERM handler we replaced.
    """
    global _live_mu, _prev_sigterm
    _live_mu = threading.RLock()
    _refs.clear()
    if _prev_sigterm is not None:
        try:
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                signal.signal(signal.SIGTERM, _prev_sigterm)
        except ValueError:  # not the main thread: `_on_sigterm` checks the pid instead
            return
        _prev_sigterm = None


os.register_at_fork(after_in_child=_after_fork_in_child)
