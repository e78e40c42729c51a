"""`dataservice._autoscale.decide`: when the autoscaler adds, retires or holds,
on hand-made signals (no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from dataservice._autoscale import AutoscaleConfig, CpuMeter, Signals, decide

GIB = 1 << 30


def signals(**kw) -> Signals:
    base = dict(
        num_workers=1,
        max_workers=4,
        cpus=4,
        window_s=5.0,
        consumers=1,
        wait_fraction=0.78,
        busy_workers=1.0,
        cluster_cpus_used=1.2,
        host_cpu_percent=40.0,
        available_bytes=8 * GIB,
        worker_rss_bytes=GIB // 4,
    )
    base.update(kw)
    return Signals(**base)


def test_input_bound_with_a_free_cpu_adds_and_says_why():
    d = decide(signals())
    assert d.action == "add"
    assert d.reason == (
        "consumers waited 78 % of the last 5 s; the cluster used 1.2 of 4 CPUs (30 %; host 40 %)"
    )


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"num_workers": 4}, "4 workers is the most allowed"),
        ({"cluster_cpus_used": 3.6}, "no CPU is free"),
        ({"cluster_cpus_used": None}, "cluster CPU use unknown yet"),
        ({"available_bytes": GIB // 3}, "MiB of memory is available"),
    ],
)
def test_input_bound_but_a_bound_is_reached_holds(kw, why):
    d = decide(signals(**kw))
    assert d.action == "hold"
    assert why in d.reason


def test_not_input_bound_with_busy_workers_holds():
    assert decide(signals(num_workers=2, wait_fraction=0.15)).action == "hold"
    d = decide(signals(num_workers=2, wait_fraction=0.0, busy_workers=0.8))
    assert d.action == "hold" and "busy 0.8 of 2" in d.reason


def test_idle_workers_retire_but_never_the_last():
    d = decide(signals(num_workers=3, wait_fraction=0.02, busy_workers=0.9))
    assert d.action == "retire"
    assert "busy 0.9 of 3" in d.reason
    d = decide(signals(num_workers=2, consumers=0, wait_fraction=None, busy_workers=0.0))
    assert d.action == "retire" and "no consumer is attached" in d.reason
    assert decide(signals(num_workers=1, wait_fraction=None, busy_workers=0.0)).action == "hold"
    # A new worker's idle time is not known yet: never retire on a guess.
    assert decide(signals(num_workers=2, wait_fraction=0.0, busy_workers=None)).action == "hold"


def test_no_consumer_counters_never_adds():
    assert decide(signals(wait_fraction=None)).action == "hold"


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="`max_workers` must be an int >= 1, got True"):
        AutoscaleConfig(max_workers=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`autoscale_interval_s` must be a finite number"):
        AutoscaleConfig(max_workers=2, interval_s=float("inf"))
    with pytest.raises(ValueError, match=r"`scale_down_grace_s` must be .* >= 0"):
        AutoscaleConfig(max_workers=2, scale_down_grace_s=-0.5)
    config = AutoscaleConfig(max_workers=2, scale_down_grace_s=0)
    assert dataclasses.asdict(config) == {
        "max_workers": 2,
        "interval_s": 1.0,
        "window_s": 5.0,
        "scale_down_grace_s": 0,
    }


def test_cpu_meter_measures_this_process():
    import os
    import time

    meter = CpuMeter()
    t0, c0 = time.monotonic(), time.process_time()
    meter.sample([os.getpid()], window_s=10)
    assert meter.used_cpus() is None
    end = time.thread_time() + 0.2
    while time.thread_time() < end:
        pass
    meter.sample([os.getpid(), 2**22 + 12345], window_s=10)  # a pid that does not exist
    t1, c1 = time.monotonic(), time.process_time()
    used = meter.used_cpus()
    expected = (c1 - c0) / (t1 - t0)  # this process's CPUs over (about) the same stretch
    assert used is not None and used > 0 and abs(used - expected) < 0.15, (used, expected)
