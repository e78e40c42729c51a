"""metrics.PipelineCpu: the pipeline CPU seconds a worker's heartbeat reports (its
task producers' own and its pipelines' helper threads'), read per helper thread."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from dataservice import metrics

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread CPU clocks by thread id"
)


def _spin_then_wait(cpu_s: float, release: threading.Event) -> None:
    start = time.thread_time()
    while time.thread_time() - start < cpu_s:
        pass
    release.wait()


def _thread(name: str, cpu_s: float, release: threading.Event) -> threading.Thread:
    t = threading.Thread(target=_spin_then_wait, args=(cpu_s, release), name=name, daemon=True)
    t.start()
    return t


def _wait_for_cpu(t: threading.Thread, cpu_s: float) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if t.native_id is not None and (metrics.thread_cpu_s(t.native_id) or 0) >= cpu_s:
            return
        time.sleep(0.02)
    raise AssertionError(f"{t.name} did not spend {cpu_s} s of CPU in 10 s")


def test_a_thread_cpu_clock_reads_that_thread_and_nothing_once_it_ended():
    release = threading.Event()
    t = _thread("dataservice-test-spin", 0.2, release)
    _wait_for_cpu(t, 0.2)
    spent = metrics.thread_cpu_s(t.native_id)
    assert 0.2 <= spent < 0.5, spent
    release.set()
    t.join()
    # join() returns once the thread's Python part is done; its kernel thread exits just
    # after.
    deadline = time.monotonic() + 10
    while metrics.thread_cpu_s(t.native_id) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert metrics.thread_cpu_s(t.native_id) is None
    # Not a thread of this process (pid 1's main thread).
    assert metrics.thread_cpu_s(1) is None


def test_pipeline_cpu_counts_helper_threads_alone_and_keeps_ended_ones():
    cpu = metrics.PipelineCpu()
    cpu.add(1.5)  # what task producers reported
    release = threading.Event()
    helper = _thread("dataservice-map-0", 0.2, release)
    other = _thread("ds-shm-producer-test", 0.3, release)  # not a pipeline's thread
    try:
        _wait_for_cpu(helper, 0.2)
        _wait_for_cpu(other, 0.3)
        total = cpu.total_s()
        assert 1.5 + 0.2 <= total < 1.5 + 0.45, total  # the helper's, not the other's 0.3 s
    finally:
        release.set()
        helper.join()
        other.join()
    # The helper ended: its last sampled time stays counted.
    after = cpu.total_s()
    assert after == pytest.approx(total, abs=0.05), (total, after)
