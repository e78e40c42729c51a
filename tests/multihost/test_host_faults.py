"""Hosts failing under a read, each host a network namespace (conftest.py):
the dispatcher's host restarting its (fault-tolerant) dispatcher mid-epoch, a
worker host's link torn down mid-epoch, and a trainer host partitioned and
healed. Each test starts its own dispatcher and workers on the module's
hosts; a link is set down on the bridge's end of the host's veth (the
processes keep running, every packet to and from the host is dropped).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.ft.conftest import report

from . import harness
from .cluster import DISPATCHER_PORT, WORKER_PORT, Cluster
from .conftest import exactly, transports

pytestmark = pytest.mark.netns

WORKER_TIMEOUT_MS = 5_000  # the dispatcher's: a silent worker is lost after this


@pytest.fixture
def cluster(net: harness.Net, token_file: str) -> Iterator[Cluster]:
    c = Cluster(net, token_file)
    try:
        yield c
    finally:
        c.close()
        for h in net.hosts:  # a test that failed with a link down leaves it up for the next
            net.link_up(h)


def _workers(c: Cluster) -> list:
    target = c.address("disp", DISPATCHER_PORT)
    started = [c.worker(h, target, wait=False) for h in ("w0", "w1")]
    for w in started:
        w.wait_ready()
    return started


def _target(c: Cluster) -> str:
    return "grpc://" + c.address("disp", DISPATCHER_PORT)


@pytest.mark.timeout(240)
def test_a_fault_tolerant_dispatcher_restarted_on_its_host_mid_epoch(
    cluster: Cluster, tmp_path
) -> None:
    """SIGKILL the dispatcher (work_dir, fault-tolerant) mid-epoch and start it
    again on its host and port: a DYNAMIC trainer (t0) still reads each
    element exactly once, an OFF trainer (t1) each worker's whole epoch."""
    flags = ("--work-dir", str(tmp_path / "dispatcher"), "--fault-tolerant-mode")
    dispatcher = cluster.dispatcher(extra=flags)
    _workers(cluster)
    n_dynamic, n_off = 3000, 1500
    paced = {"read_delay_ms": 2, "progress_every": 50}
    dynamic = cluster.trainer("t0", target=_target(cluster), mode="dynamic", n=n_dynamic, **paced)
    off = cluster.trainer("t1", target=_target(cluster), mode="off", n=n_off, **paced)
    dynamic.wait_progress(300, 60)
    off.wait_progress(300, 60)
    killed_at = dispatcher.kill()
    read_by_then = (dynamic.progress, off.progress)
    restarted = cluster.dispatcher(extra=flags)
    back_s = restarted.ready_at - killed_at
    results = {"t0": dynamic.wait_result(120), "t1": off.wait_result(120)}
    for h, r in results.items():
        assert r["error"] is None, (h, r["error"])
    assert read_by_then[0] < n_dynamic and read_by_then[1] < 2 * n_off, "not mid-epoch"
    exactly(results["t0"]["elements"], range(n_dynamic), "DYNAMIC across the restart")
    exactly(results["t1"]["elements"], list(range(n_off)) * 2, "OFF across the restart")
    for r in results.values():
        assert set(transports(r).values()) == {"grpc"}
        assert r["stats"]["lost_workers"] == []
    report(f"dispatcher SIGKILLed mid-epoch and back on its host in {back_s:.1f} s; exact")


REPORT_S = 60.0  # a trainer cut off from a worker host hears of it within this
# With the dispatcher's default worker_timeout_ms (5 min) the dispatcher still
# counts the cut-off worker as alive; the trainer's own limit on a worker it
# cannot reach while the dispatcher does not hear it either (worker_loss_timeout_ms,
# 60 s, after keepalive notices the dead connection) raises first.
DEFAULT_REPORT_S = 150.0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "worker_timeout_ms",
    [
        pytest.param(None, marks=pytest.mark.slow, id="default-timeouts"),
        pytest.param(WORKER_TIMEOUT_MS, id="worker-timeout-5s"),
    ],
)
def test_a_worker_hosts_link_torn_down_mid_epoch_is_reported_in_bounded_time(
    cluster: Cluster, worker_timeout_ms: int | None
) -> None:
    """w1's link goes down (for good) mid-epoch, its process running: the OFF
    trainer on t0 gets w0's whole epoch and, within REPORT_S (DEFAULT_REPORT_S
    with the default timeouts), either an error naming w1 or a loss report
    naming w1 (what it received from w1 counted, what it lost counted or None:
    OFF cannot know); never a silent hang."""
    extra = () if worker_timeout_ms is None else ("--worker-timeout-ms", str(worker_timeout_ms))
    cluster.dispatcher(extra=extra)
    _workers(cluster)
    lost = cluster.address("w1", WORKER_PORT)
    n = 3000
    t = cluster.trainer(
        "t0", target=_target(cluster), mode="off", n=n, read_delay_ms=1, progress_every=50
    )
    t.wait_progress(400, 60)
    cut_at = cluster.net.link_down("w1")
    report_s = REPORT_S if worker_timeout_ms is not None else DEFAULT_REPORT_S
    r = t.wait_result(report_s)  # kills the trainer and fails past report_s
    took_s = t.ended_at - cut_at
    got = Counter(r["elements"])
    assert set(got) == set(range(n)) and max(got.values()) <= 2, "w0's epoch is not whole"
    error, losses = r["error"], r["stats"]["lost_workers"]
    if error is not None:
        assert lost in error["message"], error
    else:
        assert [x["address"] for x in losses] == [lost], r["stats"]
        received = r["stats"]["workers"][lost]["elements"]
        assert losses[0]["elements_received"] == received == r["count"] - n, losses
        assert losses[0]["elements_lost"] in (None, n - received), losses
    assert took_s < report_s, f"told {took_s:.0f} s after the cut"
    report(f"worker host cut off mid-epoch: told after {took_s:.1f} s ({error or losses})")


@pytest.mark.timeout(180)
def test_a_trainer_host_partitioned_and_healed_reads_on(cluster: Cluster) -> None:
    """t0's link goes down for CUT_S mid-epoch, then comes back: the OFF
    trainer continues and ends with every element of both workers' epochs, or
    with the ones it lost counted in a loss report."""
    cut_s = 4.0
    cluster.dispatcher()
    workers = _workers(cluster)
    n = 2000
    t = cluster.trainer(
        "t0", target=_target(cluster), mode="off", n=n, read_delay_ms=2, progress_every=50
    )
    t.wait_progress(300, 60)
    cut_at = cluster.net.link_down("t0")
    try:
        time.sleep(cut_s)  # the partition's length, not a synchronisation
        during = t.progress
    finally:
        healed_at = cluster.net.link_up("t0")
    r = t.wait_result(120)
    assert r["error"] is None, r["error"]
    losses = r["stats"]["lost_workers"]
    if not losses:
        exactly(r["elements"], list(range(n)) * 2, "OFF through a partition")
    else:
        got = Counter(r["elements"])
        assert max(got.values()) <= 2 and set(got) <= set(range(n))
        assert sum(x["elements_lost"] for x in losses) == 2 * n - r["count"], losses
    assert set(transports(r)) == {w.address for w in workers}
    report(
        f"trainer host cut off {healed_at - cut_at:.1f} s ({during} elements read by then): "
        f"{r['count']} of {2 * n} read, {len(losses)} worker(s) reported lost, "
        f"ended {t.ended_at - healed_at:.1f} s after the heal"
    )
