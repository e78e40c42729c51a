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
import time

import psutil
import pytest

import dataservice as ds
from dataservice import errors

from .conftest import Servers, ThreadReader, exit_at_once, wait_until


def _exit_at_every_time(index: int, code: int):
    """A map whose worker process calls os._exit(code) at element `index`, in
    every process (the deterministic crash loop of an OFF task starting over)."""

    def fn(x):
        if int(x) == index:
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
    reader = ThreadReader(iter(data))
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


def _big(x):
    import numpy as np

    return {"i": x, "pad": np.zeros(60_000, np.uint8)}


def _run_cluster(num_workers: int, **kw) -> ds.LocalCluster:
    return ds.LocalCluster(
        num_workers,
        grace_period_s=1.0,
        worker_options={"heartbeat_interval_ms": 200},
        dispatcher_config=ds.DispatcherConfig(worker_timeout_ms=2_000),
        **kw,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_off_crash_at_the_same_element_each_restart_gives_up(num_workers: int, caplog) -> None:
    """OFF, a map that calls os._exit(3) at element 500 of range(1000) in every
    process (60 KB elements, copied: below the 64 KiB zero-copy threshold;
    each process hands out hundreds first): the task starts over on each
    restarted process and dies at the same place.
    Before, every such exit reset the restart count and the epoch never ended
    (47 restarts in 50 s, no error). Now the cluster gives up after
    max_worker_restarts + 1 exits in a row and the consumer raises
    WorkerCrashedError naming each worker, its exit code, the count and the
    options; with 2 workers both loop, so both are named."""
    limit = 2
    with caplog.at_level(logging.WARNING, logger="dataservice.cluster"):
        with _run_cluster(num_workers, max_worker_restarts=limit) as cluster:
            data = (
                ds.Dataset.range(1000)
                .map(_exit_at_every_time(500, 3))
                .map(_big)
                .apply(ds.distribute("off", cluster.target, worker_loss_timeout_ms=5_000))
            )
            t0 = time.monotonic()
            reader = ThreadReader(iter(data))
            reader.join(90)
            took = reader.ended_at - t0
            addresses = cluster.worker_addresses
            failed = cluster.failed_workers
            restarts = cluster.num_restarts
    print(f"{num_workers} worker(s): {reader.count} elements, {restarts} restarts, {took:.1f} s")
    assert isinstance(reader.error, errors.WorkerCrashedError), repr(reader.error)
    message = str(reader.error)
    assert sorted(failed) == sorted(addresses)
    assert restarts == limit * num_workers
    for address in addresses:
        assert f"at {address} exited with code 3, {limit + 1} times in a row" in message, message
    assert f"{limit + 1} exits since the cluster started" in message
    assert f"max_worker_restarts={limit}" in message and "healthy_uptime_s=30" in message
    # Each process hands out at most elements 0..499 of its copy.
    assert reader.seen <= set(range(500)), sorted(reader.seen - set(range(500)))[:5]
    assert reader.count <= (limit + 1) * 500 * num_workers
    assert took < 60, f"gave up {took:.1f} s after the start"


@pytest.mark.slow  # 18 s of crashes; in CI: the crash-loop tests above
@pytest.mark.timeout(120)
def test_rare_crashes_are_restarted_past_max_worker_restarts(tmp_path) -> None:
    """A crash once per healthy_uptime_s or less often (scaled down here: up
    1 s, each of the first 4 processes crashes ~1.5 s after starting) resets
    the count: with max_worker_restarts=1 the worker is restarted 4 times and
    the (OFF) epoch completes on the fifth process."""
    marker_dir = str(tmp_path)

    def crash_late(x, marker_dir=marker_dir):
        import os
        import time

        time.sleep(0.01)
        if int(x) == 150:  # ~1.5 s after the process started its task
            n = len(os.listdir(marker_dir))
            if n < 4:
                open(os.path.join(marker_dir, f"exit-{n}"), "w").close()
                os._exit(5)
        return x

    with _run_cluster(1, max_worker_restarts=1, healthy_uptime_s=1.0) as cluster:
        data = (
            ds.Dataset.range(200)
            .map(crash_late)
            .apply(ds.distribute("off", cluster.target, worker_loss_timeout_ms=10_000))
        )
        reader = ThreadReader(iter(data))
        reader.join(90)
        restarts = cluster.num_restarts
        failed = cluster.failed_workers
    assert reader.error is None, repr(reader.error)
    assert failed == {}
    assert restarts == 4
    assert reader.seen == set(range(200))


def _crash_randomly(p: float):
    def fn(x, p=p):
        import os
        import random

        if random.random() < p:
            os._exit(4)
        return x

    return fn


@pytest.mark.timeout(120)
def test_dynamic_crash_loop_is_bounded_and_its_losses_are_reported(caplog) -> None:
    """DYNAMIC, 2 workers, a 5 % crash rate per element (60 KB elements): the
    same bound applies (at most max_worker_restarts + 1 exits in a row per
    worker), and however the epoch ends the consumer says how much was lost.
    Before, the epoch could end normally with 55 of 2000 elements and only
    per-process WARNINGs. Now it raises WorkerCrashedError naming the
    workers, or, if every split was handed out before that, ends with one
    WARNING summing up the loss and `stats()` totals that add up to 2000."""
    n, limit = 2000, 2
    with caplog.at_level(logging.WARNING, logger="dataservice.client.reader"):
        with _run_cluster(2, max_worker_restarts=limit) as cluster:
            data = (
                ds.Dataset.range(n)
                .map(_crash_randomly(0.05))
                .map(_big)
                .apply(
                    ds.distribute("distributed_epoch", cluster.target, worker_loss_timeout_ms=5_000)
                )
            )
            t0 = time.monotonic()
            reader = ThreadReader(iter(data))
            reader.join(90)
            took = reader.ended_at - t0
            restarts = cluster.num_restarts
            addresses = cluster.worker_addresses
            failed = cluster.failed_workers
            stats = reader.it.stats()
    print(
        f"DYNAMIC crash loop: {reader.count} elements, {restarts} restarts, {took:.1f} s, "
        f"{type(reader.error).__name__ if reader.error else 'ended'}, "
        f"splits_lost {stats['splits_lost']}, elements_lost {stats['elements_lost']}"
    )
    assert restarts <= 2 * limit
    assert took < 60
    assert len(reader.seen) == reader.count  # at-most-once: nothing twice
    if reader.error is not None:
        assert isinstance(reader.error, errors.WorkerCrashedError), repr(reader.error)
        assert sorted(failed) == sorted(addresses)
        for address in addresses:
            assert f"at {address} exited with code 4, {limit + 1} times in a row" in str(
                reader.error
            )
        return
    assert stats["elements_lost"] is not None
    assert reader.count + stats["elements_lost"] == n, (reader.count, stats["elements_lost"])
    assert stats["splits_lost"] == stats["elements_lost"]
    summary = [r.getMessage() for r in caplog.records if "ended after" in r.getMessage()]
    assert len(summary) == 1, summary
    assert f"ended after {reader.count} elements read here" in summary[0]
    assert f"{stats['elements_lost']} elements" in summary[0] and f"of the {n} " in summary[0]


@pytest.mark.timeout(120)
def test_a_dynamic_epoch_that_lost_splits_ends_with_one_summary_warning(tmp_path, caplog) -> None:
    """DYNAMIC, 2 workers, one os._exit(4) at element 100: the worker is
    restarted, the epoch ends normally, and the consumer logs one WARNING at
    the end summing up what the dead process took (elements and share of the
    epoch), matching `stats()`'s totals; read + lost == the dataset."""
    n = 2000
    with caplog.at_level(logging.WARNING, logger="dataservice.client.reader"):
        with _run_cluster(2) as cluster:
            data = (
                ds.Dataset.range(n)
                .map(exit_at_once(str(tmp_path), 100, 4))
                .apply(
                    ds.distribute("distributed_epoch", cluster.target, worker_loss_timeout_ms=5_000)
                )
            )
            reader = ThreadReader(iter(data))
            reader.join(90)
            stats = reader.it.stats()
    assert reader.error is None, repr(reader.error)
    lost = stats["elements_lost"]
    print(f"read {reader.count}, lost {lost} ({stats['splits_lost']} splits)")
    assert lost is not None and lost > 0 and stats["splits_lost"] == lost
    assert reader.count + lost == n and len(reader.seen) == reader.count
    summary = [r.getMessage() for r in caplog.records if "ended after" in r.getMessage()]
    assert len(summary) == 1, summary
    share = f"{100 * lost / n:.0f} %"
    assert f"ended after {reader.count} elements read here" in summary[0], summary[0]
    assert f"{lost} elements, {share} of the {n} " in summary[0], summary[0]
    assert "lost with 1 worker process that died or stopped answering" in summary[0], summary[0]


@pytest.mark.parametrize("bad", [0, -1.0, "30", True, float("nan")])
def test_healthy_uptime_s_rejects_bad_values(bad) -> None:
    with pytest.raises(ValueError, match="healthy_uptime_s"):
        ds.LocalCluster(1, healthy_uptime_s=bad, start=False)
