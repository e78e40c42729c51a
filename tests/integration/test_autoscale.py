"""`LocalCluster(num_workers="auto")`: the autoscaler adds a worker to an
input-bound DYNAMIC job with a CPU free, throughput rises, and it retires the
worker again (drained, no element lost or repeated) once the consumer slows
down (`dataservice._autoscale`, `dispatcher/retire.py`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import psutil
import pytest

import dataservice as ds
from dataservice._autoscale import host_cpus

BURN_CPU_S = 0.005


def burn(x):
    """~5 ms of this thread's CPU per element: a CPU-bound map. Its 1 MiB
    element keeps how far a worker runs ahead of its consumer small (the
    task buffer's bytes bound, at most 64 MiB), so that a slow consumer leaves
    the workers idle soon and a retired worker drains in seconds."""
    end = time.thread_time() + BURN_CPU_S
    while time.thread_time() < end:
        pass
    return np.full(1 << 18, x, np.int32)


def _wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def _rate(times: list[float], start: float, end: float) -> float:
    """Elements per second received in [start, end)."""
    return sum(1 for t in times if start <= t < end) / (end - start)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(host_cpus() < 2, reason="needs 2 CPUs to add a worker")
def test_autoscale_adds_then_retires_without_loss(caplog):
    n = 3000
    caplog.set_level(logging.INFO, logger="dataservice.cluster")
    with ds.LocalCluster(
        "auto",
        max_workers=2,
        autoscale_interval_s=0.25,
        autoscale_window_s=2.0,
        scale_down_grace_s=1.0,
        worker_options={"heartbeat_interval_ms": 200},
    ) as cluster:
        assert cluster.num_workers == 1
        dataset = (
            ds.Dataset.range(n)
            .map(burn)
            .apply(ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name="auto"))
        )
        it = iter(dataset)
        got: list[int] = []
        times: list[float] = []
        most = 0

        def read(count: int | None = None, pause_s: float = 0.0, until=None, timeout_s=60.0):
            nonlocal most
            deadline = time.monotonic() + timeout_s
            k = 0
            while count is None or k < count:
                if until is not None and until():
                    return
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"timed out after {timeout_s} s; {len(got)} elements read, "
                        f"events {cluster.autoscale_events}"
                    )
                try:
                    got.append(int(next(it)[0]))
                except StopIteration:
                    return
                times.append(time.monotonic())
                most = max(most, cluster.num_workers)
                k += 1
                if pause_s:
                    time.sleep(pause_s)

        # 1. As fast as it comes: input-bound with one worker busy on one CPU.
        read(until=lambda: cluster.num_workers == 2, timeout_s=90)
        events = cluster.autoscale_events
        assert [e["action"] for e in events] == ["add"], events
        assert "consumers waited" in events[0]["reason"], events
        joined = time.monotonic()
        first = times[0] if times else joined
        assert joined - first > 2.0, "scaled up before a window of one worker was seen"
        one_rate = _rate(times, first + 1.0, joined)
        read(until=lambda: time.monotonic() > joined + 5.0, timeout_s=30)
        two_rate = _rate(times, joined + 1.0, joined + 5.0)
        assert two_rate >= 1.3 * one_rate, (
            f"{one_rate:.0f} elements/s with 1 worker, {two_rate:.0f} with 2 "
            f"(load average {psutil.getloadavg()})"
        )

        # 2. The consumer slows down: the workers go idle and one is drained
        # while the epoch goes on; it finishes the splits it holds as the
        # consumer reads them (fast again: max_workers=2 counts the draining
        # worker, so reading fast does not cancel its retirement).
        slow_from = time.monotonic()

        def has(action: str) -> Callable[[], bool]:
            return lambda: any(e["action"] == action for e in cluster.autoscale_events)

        read(pause_s=0.05, until=has("drain"), timeout_s=120)
        drain_from = time.monotonic()
        read(until=has("retire"), timeout_s=120)
        print(
            f"1 worker: {one_rate:.0f} elements/s, 2 workers: {two_rate:.0f}; drained "
            f"{drain_from - slow_from:.1f} s after the consumer slowed down, retired "
            f"{time.monotonic() - drain_from:.1f} s later, {len(got)} of {n} elements "
            f"read; load average {psutil.getloadavg()}"
        )
        assert cluster.num_workers == 1
        actions = [e["action"] for e in cluster.autoscale_events]
        assert actions[:3] == ["add", "drain", "retire"], cluster.autoscale_events
        assert len(got) < n - 100, "the epoch (nearly) ended before a worker was retired"

        # 3. The rest: every element of the epoch exactly once.
        read(timeout_s=120)
        assert sorted(got) == list(range(n)), (
            f"{len(got)} elements, {len(set(got))} distinct; missing "
            f"{sorted(set(range(n)) - set(got))[:10]}"
        )
        assert most <= 2
        assert it.stats().get("lost_workers", []) in ([], {}, None, 0)
    logs = "\n".join(r.getMessage() for r in caplog.records)
    assert "adding worker-1: consumers waited" in logs, logs
    assert "retired worker-1" in logs, logs


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_workers": "auto", "max_workers": 0}, "`max_workers` must be an int >= 1"),
        ({"num_workers": "auto", "max_workers": 1.5}, "`max_workers` must be an int >= 1"),
        ({"num_workers": "auto", "autoscale_interval_s": 0}, "`autoscale_interval_s`"),
        ({"num_workers": "auto", "autoscale_window_s": -1}, "`autoscale_window_s`"),
        ({"num_workers": "auto", "scale_down_grace_s": -1}, "`scale_down_grace_s`"),
        ({"num_workers": "auto", "scale_down_grace_s": float("nan")}, "`scale_down_grace_s`"),
        ({"num_workers": "auto", "autoscale_interval_s": "1"}, "`autoscale_interval_s`"),
        ({"num_workers": 2, "max_workers": 4}, "only apply to num_workers='auto'"),
        ({"num_workers": 1, "scale_down_grace_s": 1}, "only apply to num_workers='auto'"),
        ({"num_workers": "many"}, "int >= 0 or 'auto'"),
        (
            {"num_workers": "auto", "max_workers": 2, "worker_options": {"port": 5555}},
            "several workers cannot share",
        ),
    ],
)
def test_bad_autoscale_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ds.LocalCluster(start=False, **kwargs)


def test_auto_defaults_to_the_cpu_count():
    cluster = ds.LocalCluster("auto", start=False)
    assert cluster.max_workers == host_cpus()
    cluster = ds.LocalCluster("auto", max_workers=10_000, start=False)
    assert cluster.max_workers == host_cpus()
    cluster = ds.LocalCluster("AUTO", max_workers=1, start=False)
    assert cluster.max_workers == 1


@pytest.mark.timeout(180)
@pytest.mark.skipif(host_cpus() < 2, reason="needs 2 CPUs to add a worker")
def test_autoscale_short_up_on_demand_down_when_the_consumer_leaves():
    """The default-set version: 1 -> 2 workers while an anonymous DYNAMIC job is
    read as fast as it comes, back to 1 once its iterator is closed (its
    iteration ends with it, so the retiring worker holds nothing to read)."""
    with ds.LocalCluster(
        "auto",
        max_workers=2,
        autoscale_interval_s=0.25,
        autoscale_window_s=1.0,
        scale_down_grace_s=0.5,
        worker_options={"heartbeat_interval_ms": 200},
    ) as cluster:
        assert cluster.num_workers == 1
        it = iter(
            ds.Dataset.range(1_000_000)
            .map(burn)
            .apply(ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target))
        )
        deadline = time.monotonic() + 60
        most = 1
        while cluster.num_workers < 2:
            next(it)
            most = max(most, cluster.num_workers)
            assert time.monotonic() < deadline, f"no scale-up in 60 s: {cluster.autoscale_events}"
        for _ in range(20):  # the new worker serves the running epoch
            next(it)
            most = max(most, cluster.num_workers)
        retired_pid = cluster.worker_pids[1]
        it.close()
        _wait_until(
            lambda: any(e["action"] == "retire" for e in cluster.autoscale_events),
            60,
            "the second worker to retire",
        )
        assert cluster.num_workers == 1
        actions = [e["action"] for e in cluster.autoscale_events]
        assert actions == ["add", "drain", "retire"], cluster.autoscale_events
        assert most <= 2 and len(cluster.worker_pids) == 1
        assert all(e["worker"] == "worker-1" for e in cluster.autoscale_events)
        assert not psutil.pid_exists(retired_pid) or (
            psutil.Process(retired_pid).status() == psutil.STATUS_ZOMBIE
        )
