"""Worker churn during a job (issue 5; CASES C-28): a worker SIGKILLed or
frozen (SIGSTOP) mid-job, a slow consumer, and a pipeline that kills its
worker process at random or always (LocalCluster's bounded restarts: progress,
or WorkerCrashedError in bounded time). Servers are real processes; recovery times are
printed (`pytest -s`) as `[ft] ...` lines.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import signal
import threading
import time

import pytest

import dataservice as ds
from dataservice import cluster as cluster_module
from dataservice import errors

from .conftest import Servers, report

WORKER_TIMEOUT_MS = 2_000


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mode", "n", "fault"),
    [
        (ds.ShardingPolicy.OFF, 3_000, "sigkill"),
        pytest.param(ds.ShardingPolicy.OFF, 3_000, "sigstop", marks=pytest.mark.slow),
        pytest.param(ds.ShardingPolicy.DYNAMIC, 100_000, "sigkill", marks=pytest.mark.slow),
        (ds.ShardingPolicy.DYNAMIC, 100_000, "sigstop"),
    ],
    ids=["0-3000-sigkill", "0-3000-sigstop", "1-100000-sigkill", "1-100000-sigstop"],
)
def test_losing_one_of_three_workers_mid_job(servers: Servers, fault: str, mode, n: int) -> None:
    """One of three workers is SIGKILLed or frozen after it delivered 200
    elements. The read ends within 2 x worker_timeout_ms of the fault: OFF,
    with the two other workers' full copies (in order) and a prefix of the
    lost one's; DYNAMIC (C-28), with every element at most once. (A clear
    DataServiceError within the same bound would also be allowed.)"""
    dispatcher = servers.dispatcher(worker_timeout_ms=WORKER_TIMEOUT_MS)
    workers = servers.workers(dispatcher, 3)
    victim = workers[1]

    def tag_with_pid(x):  # nested: shipped by value
        import os

        return x, os.getpid()

    dataset = (
        ds.Dataset.range(n)
        .map(tag_with_pid)
        .apply(ds.distribute(mode, dispatcher.target, client_timeout_ms=30_000))
    )
    by_pid: dict[int, list[int]] = collections.defaultdict(list)
    t_fault = 0.0
    error = None
    try:
        for x, pid in dataset:
            by_pid[int(pid)].append(int(x))
            if not t_fault and len(by_pid[victim.pid]) >= 200:
                t_fault = time.monotonic()
                victim.send(signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
    except errors.DataServiceError as err:
        error = err
    elapsed = time.monotonic() - t_fault
    assert t_fault, "the victim delivered fewer than 200 elements"
    total = sum(len(v) for v in by_pid.values())
    report(
        f"{fault} 1 of 3 workers, {mode.name} over range({n}): read ended {elapsed:.2f} s after "
        f"the fault ({'error ' + repr(error) if error else 'completed'}); {total} elements, "
        f"{len(by_pid[victim.pid])} from the lost worker"
    )
    assert elapsed <= 2 * WORKER_TIMEOUT_MS / 1000
    assert set(by_pid) <= {w.pid for w in workers}
    if error is not None:
        return
    lost = by_pid[victim.pid]
    if mode == ds.ShardingPolicy.OFF:
        for w in workers:
            if w is not victim:
                assert by_pid[w.pid] == list(range(n)), f"worker {w.address}'s copy"
        assert lost == list(range(len(lost))) and len(lost) < n
    else:
        values = [x for v in by_pid.values() for x in v]
        assert len(values) == len(set(values)), "an element was delivered twice"
        assert set(values) <= set(range(n))
        report(f"DYNAMIC: {n - len(values)} splits lost with the {fault} worker")


@pytest.mark.timeout(120)
def test_slow_consumer_trips_no_liveness_timeout(servers: Servers) -> None:
    """C-28: a consumer that sleeps 2 s per element (4x worker_timeout_ms,
    2x client_timeout_ms) gets every element and no error."""
    dispatcher = servers.dispatcher(worker_timeout_ms=500, extra=("--client-timeout-ms", "1000"))
    servers.workers(dispatcher, 2)
    dataset = ds.Dataset.range(6).apply(
        ds.distribute(ds.ShardingPolicy.DYNAMIC, dispatcher.target, client_timeout_ms=1_000)
    )
    got = []
    t0 = time.monotonic()
    for x in dataset:
        got.append(int(x))
        if len(got) <= 3:
            time.sleep(2.0)
    report(f"slow consumer: {len(got)} elements in {time.monotonic() - t0:.1f} s, no error")
    assert sorted(got) == list(range(6))
    assert dispatcher.lines_since(0, r"lost|timed out") == []


@dataclasses.dataclass
class _CrashRun:
    n: int  # elements received
    error: BaseException | None
    elapsed: float  # seconds until `target` elements, the error, or the deadline
    restarts: int
    failed_workers: dict[str, str]
    worker_addresses: list[str]
    next_epoch_error: BaseException | None = None
    next_epoch_s: float = 0.0


def _count_with_crashing_map(
    p: float,
    sleep_s: float,
    target: int,
    deadline_s: float,
    *,
    code: int = 1,
    num_workers: int = 3,
    max_worker_restarts: int | None = cluster_module.DEFAULT_MAX_WORKER_RESTARTS,
    healthy_uptime_s: float = cluster_module.HEALTHY_UPTIME_S,
    then_read_again: bool = False,
) -> _CrashRun:
    """Reads an endless OFF job whose map calls os._exit(`code`) with
    probability `p` per element, on LocalCluster(`num_workers`,
    restart_workers=True), until `target` elements, an error, or `deadline_s`.
    With `then_read_again`, after an error, times a second read (the next epoch)."""

    def crash_sometimes(x, p=p, sleep_s=sleep_s, code=code):
        import os
        import random
        import time

        if sleep_s:
            time.sleep(sleep_s)
        if random.random() < p:
            os._exit(code)
        return x

    logging.getLogger("dataservice.cluster").setLevel(logging.CRITICAL)  # a line per restart
    with ds.LocalCluster(
        num_workers,
        restart_workers=True,
        max_worker_restarts=max_worker_restarts,
        healthy_uptime_s=healthy_uptime_s,
        grace_period_s=1.0,
        worker_options={"heartbeat_interval_ms": 100},
        dispatcher_config=ds.DispatcherConfig(worker_timeout_ms=1_000),
    ) as cluster:
        dataset = (
            ds.Dataset.range(10**12)
            .map(crash_sometimes)
            .apply(ds.distribute(ds.ShardingPolicy.OFF, cluster.target, client_timeout_ms=30_000))
        )
        state: dict = {"n": 0, "error": None}
        it = iter(dataset)

        def run() -> None:
            try:
                for _ in it:
                    state["n"] += 1
                    if state["n"] >= target:
                        return
            except BaseException as err:  # noqa: BLE001 - reported below
                if not state.get("closed"):  # not the CancelledError of our close()
                    state["error"] = err

        t0 = time.monotonic()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(deadline_s)
        elapsed = time.monotonic() - t0
        state["closed"] = True
        it.close()
        result = _CrashRun(
            state["n"],
            state["error"],
            elapsed,
            cluster.num_restarts,
            cluster.failed_workers,
            cluster.worker_addresses,
        )
        if then_read_again and result.error is not None:
            t1 = time.monotonic()
            try:
                next(iter(dataset))
            except errors.DataServiceError as err:
                result.next_epoch_error = err
            result.next_epoch_s = time.monotonic() - t1
    logging.getLogger("dataservice.cluster").setLevel(logging.NOTSET)
    return result


def _slow_crashing_map_progresses(target: int, deadline_s: float) -> None:
    """A 5 % chance per element of os._exit(1), with 50 ms of work per
    element (a worker lives ~1 s): with `healthy_uptime_s=0.5` a process that
    lives that long resets its restart budget, the restarted workers start
    their copies over, and the consumer gets `target` elements. (With the
    default 30 s, a crash a second is a crash loop: see test_crash_loop.py.)"""
    run = _count_with_crashing_map(0.05, 0.05, target, deadline_s, healthy_uptime_s=0.5)
    report(
        f"crashing map (50 ms/element): {run.n} elements in {run.elapsed:.1f} s, "
        f"{run.restarts} restarts"
    )
    assert run.error is None, repr(run.error)
    assert run.n == target
    assert run.failed_workers == {}


@pytest.mark.timeout(120)
def test_map_that_kills_its_worker_slowly_still_makes_progress() -> None:
    _slow_crashing_map_progresses(60, 90)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_map_that_kills_its_worker_slowly_still_makes_progress_300() -> None:
    _slow_crashing_map_progresses(300, 300)


# How long a LocalCluster(3) with the default max_worker_restarts (3) may take
# to give up on workers whose map crashes at once: 4 lives each, a restarted one
# waiting for its consumer (fetch backoff up to ~1.5 s) after starting (~1-2 s
# on a loaded 2-core machine), plus backoffs of 0.1 + 0.2 + 0.4 s.
_GIVE_UP_BOUND_S = 45.0


@pytest.mark.timeout(120)
def test_map_that_kills_its_worker_progresses_or_fails_in_bounded_time() -> None:
    """Issue 5: a map that calls os._exit(1) with 5 % probability, on
    LocalCluster(3, restart_workers=True): the consumer either counts 300
    elements or, within a bound, gets WorkerCrashedError naming each worker and
    its exit code (300 elements take 0.1 s without crashes). A worker dies ~20
    elements in, within milliseconds, so it rarely hands an element out: after
    max_worker_restarts restarts in a row without one, the cluster gives up."""
    run = _count_with_crashing_map(0.05, 0.0, 300, _GIVE_UP_BOUND_S + 15)
    report(
        f"crashing map (fast): {run.n} elements, "
        f"{'error ' + type(run.error).__name__ if run.error else 'no error'} after "
        f"{run.elapsed:.1f} s, {run.restarts} restarts, {len(run.failed_workers)} workers "
        "given up"
    )
    if run.error is None:
        assert run.n == 300, f"{run.n} elements and no error in {run.elapsed:.0f} s: a hang"
        return
    assert isinstance(run.error, errors.WorkerCrashedError), repr(run.error)
    assert run.elapsed <= _GIVE_UP_BOUND_S
    message = str(run.error)
    assert sorted(run.failed_workers) == sorted(run.worker_addresses)
    for address in run.worker_addresses:
        assert f"at {address} exited with code 1, " in message, message
    assert "4 times in a row, each within healthy_uptime_s=30 s of starting" in message
    assert "gave up restarting it (max_worker_restarts=3: " in message


@pytest.mark.timeout(120)
def test_map_that_always_kills_its_worker_fails_with_a_clear_error() -> None:
    """A map that calls os._exit(7) on its first element: no worker ever hands
    out an element, so after max_worker_restarts (1) restarts of each the
    consumer gets WorkerCrashedError naming every worker, its pids and exit
    code; the next epoch fails at once with the same error (no silent hang)."""
    run = _count_with_crashing_map(
        1.0, 0.0, 1, 60, code=7, num_workers=2, max_worker_restarts=1, then_read_again=True
    )
    report(
        f"map that always exits: {type(run.error).__name__} after {run.elapsed:.1f} s "
        f"({run.restarts} restarts); next epoch failed in {run.next_epoch_s:.2f} s:\n{run.error}"
    )
    assert run.n == 0
    assert isinstance(run.error, errors.WorkerCrashedError), repr(run.error)
    assert run.elapsed <= 30
    message = str(run.error)
    assert sorted(run.failed_workers) == sorted(run.worker_addresses)
    for address in run.worker_addresses:
        reason = run.failed_workers[address]
        assert reason in message
        assert re.search(
            rf"worker-\d at {re.escape(address)} exited with code 7, 2 times in a row, "
            r"each within healthy_uptime_s=30 s of starting, without handing out an element "
            r"\(pids \d+, \d+; 2 exits since the cluster started\); LocalCluster gave up "
            r"restarting it \(max_worker_restarts=1: ",
            reason,
        ), reason
    assert run.restarts == 2  # one per worker
    assert isinstance(run.next_epoch_error, errors.WorkerCrashedError), repr(run.next_epoch_error)
    assert run.next_epoch_s < 5
