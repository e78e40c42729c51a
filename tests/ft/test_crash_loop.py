"""A pipeline that keeps killing its worker ends in a bounded, clear error, and
waiting for a lost worker costs no CPU (CASES K4).

A crash loop (a `map` that calls `os._exit` every few elements, in OFF mode the
same element after each restart) must not keep an epoch going forever by
handing out a few elements before each crash: `LocalCluster` counts an exit
against `max_worker_restarts` unless the process that exited ran for
`healthy_uptime_s`, and then consumers raise `WorkerCrashedError` naming the
worker, how it ended, the number of exits and the option to change. While a
consumer waits `worker_loss_timeout_ms` for a lost worker to come back, neither
it nor the dispatcher spins.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import psutil
import pytest

import dataservice as ds
from dataservice import errors

from .conftest import Servers, wait_until


class _Reader:
    """Reads an iterator on a thread; counts elements and distinct values."""

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
            self.error = err
        self.ended_at = time.monotonic()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the consumer hung ({self.count} elements read)"


def _exit_at_every_time(index: int, code: int):
    """A map whose worker process calls os._exit(code) at element `index`, in
    every process (the deterministic crash loop of an OFF task starting over)."""

    def fn(x):
        if int(x) == index:
            os._exit(code)
        return x

    return fn


def _exit_at_once(marker_dir: str, index: int, code: int):
    def fn(x):
        if int(x) == index:
            marker = os.path.join(marker_dir, "exited")
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(code)
        return x

    return fn


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def test_cli_worker_loss_wait_costs_no_cpu(servers: Servers) -> None:
    """The only worker died (os._exit in the map, DYNAMIC, nothing restarts
    it): for the `worker_loss_timeout_ms` the consumer and the dispatcher
    wait, they use little CPU (before: ~0.4 core each)."""
    dispatcher = servers.dispatcher(log_level="WARNING")
    (worker,) = servers.workers(dispatcher, 1, heartbeat_interval_ms=500)
    data = (
        ds.Dataset.range(100_000)
        .map(_exit_at_every_time(50, 3))
        .apply(ds.distribute("distributed_epoch", dispatcher.address, worker_loss_timeout_ms=9000))
    )
    reader = _Reader(iter(data))
    wait_until(lambda: worker.popen.poll() is not None, 30, "the worker's exit")
    me = psutil.Process()
    disp = psutil.Process(dispatcher.popen.pid)
    time.sleep(1.5)  # let the loss be found (the probe of the port)
    assert reader.error is None and reader.ended_at == 0.0
    c0, d0, t0 = _cpu_s(me), _cpu_s(disp), time.monotonic()
    time.sleep(4.0)  # measuring a window of waiting, not synchronising
    c1, d1, t1 = _cpu_s(me), _cpu_s(disp), time.monotonic()
    assert reader.ended_at == 0.0, "the consumer stopped waiting during the window"
    window = t1 - t0
    print(f"consumer {c1 - c0:.2f} s CPU, dispatcher {d1 - d0:.2f} s CPU in {window:.1f} s")
    assert (c1 - c0) / window < 0.1, f"the consumer used {c1 - c0:.2f} s CPU in {window:.1f} s"
    assert (d1 - d0) / window < 0.1, f"the dispatcher used {d1 - d0:.2f} s CPU in {window:.1f} s"
    reader.join(30)
    assert isinstance(reader.error, errors.WorkerCrashedError), reader.error
