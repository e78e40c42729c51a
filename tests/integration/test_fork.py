"""Processes forked from a trainer that owns a `LocalCluster` (PyTorch
DataLoader workers, `multiprocessing` "fork" pools, bare `os.fork()`): they can
read from the cluster, their exit or SIGTERM leaves the parent's servers alone,
and they exit (no hang at exit, no orphan).

Each scenario runs in a fresh interpreter under a timeout, so a hang fails the
test instead of the session, and the test can look for orphans afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(180)

_SCRIPT = r"""
import json, multiprocessing as mp, os, sys, time
import dataservice as ds

def child_read(target):
    return sum(1 for _ in ds.Dataset.range(100).apply(ds.distribute("off", target)))

def child_read_forever(args):
    target, started = args
    it = iter(ds.Dataset.range(10**9).apply(ds.distribute("off", target)))
    next(it)
    started.put(os.getpid())
    for _ in it:  # until the pool terminates us (SIGTERM) mid-read
        pass

def wait_exit(pid, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    return None

scenario = sys.argv[1]
c = ds.LocalCluster(num_workers=1)
before = (c.dispatcher_pid, c.worker_pids)
out = {"children": [], "child_reads": []}
if scenario.startswith("pool_"):
    pool = mp.get_context("fork").Pool(2)
    out["child_reads"] = pool.map(child_read, [c.target] * 2)
    out["children"] = [p.pid for p in pool._pool]
    if scenario == "pool_terminate_busy":
        # SIGTERM reaches the children while they are inside gRPC reads.
        started = mp.get_context("fork").Manager().Queue()
        pool.map_async(child_read_forever, [(c.target, started)] * 2)
        out["busy"] = sorted(started.get(timeout=60) for _ in range(2))
    if scenario.startswith("pool_terminate"):
        pool.terminate()
    else:
        pool.close()
    pool.join()
else:
    it = None
    if scenario.endswith("_midread"):
        # The parent is mid-iteration: its fetch/heartbeat threads and their
        # locks exist at fork; the child inherits the iterator object.
        it = iter(ds.Dataset.range(100).apply(ds.distribute("off", c.target)))
        out["parent_first"] = [int(next(it)) for _ in range(10)]
    child = os.fork()
    if child == 0:
        n = child_read(c.target)
        if n != 100:
            os._exit(3)
        if it is not None:  # the parent's iterator: a clear error, not a wait for ever
            try:
                next(it)
                os._exit(4)
            except ds.errors.FailedPreconditionError as e:
                if "create the iterator in the forked process" not in str(e):
                    os._exit(5)
        if scenario.startswith("fork_os_exit"):
            os._exit(0)
        sys.exit(0)
    out["children"] = [child]
    out["child_exit"] = wait_exit(child, 60)
    if it is not None:
        out["parent_rest"] = len(list(it))
out["parent_read"] = child_read(c.target)
out["same_servers"] = before == (c.dispatcher_pid, c.worker_pids)
out["restarts"] = c.num_restarts
c.stop(grace_period_s=2)
print("RESULT " + json.dumps(out), flush=True)
"""


def _run(scenario: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, scenario],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, 9)
        for pid in tree:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        stdout, stderr = proc.communicate()
        pytest.fail(f"{scenario}: hung for 120 s\nstdout:\n{stdout}\nstderr:\n{stderr[-4000:]}")
    assert proc.returncode == 0, f"{scenario}: rc {proc.returncode}\n{stderr[-4000:]}"
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"{scenario}: no result\n{stdout}\n{stderr[-4000:]}"
    assert "was killed by signal" not in stderr, stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def _assert_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and _not_zombie(p)]
        if not alive:
            return
        time.sleep(0.05)
    for p in alive:
        try:
            os.kill(p, 9)
        except ProcessLookupError:
            pass
    pytest.fail(f"forked children left behind: {alive}")


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize(
    "scenario",
    [pytest.param("pool_terminate", marks=pytest.mark.slow), "pool_close", "pool_terminate_busy"],
)
def test_fork_pool_children_read_and_leave_the_cluster_serving(scenario: str) -> None:
    out = _run(scenario)
    assert out["child_reads"] == [100, 100]
    assert out["parent_read"] == 100
    assert out["same_servers"] is True
    assert out["restarts"] == 0
    assert len(out["children"]) == 2
    if scenario == "pool_terminate_busy":
        assert out["busy"] == sorted(out["children"])
    _assert_gone(out["children"])


@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param("fork_sys_exit", marks=pytest.mark.slow),
        "fork_os_exit",
        "fork_sys_exit_midread",
        pytest.param("fork_os_exit_midread", marks=pytest.mark.slow),
    ],
)
def test_os_fork_child_exit_leaves_the_cluster_serving(scenario: str) -> None:
    out = _run(scenario)
    assert out["child_exit"] == 0, out
    assert out["parent_read"] == 100
    assert out["same_servers"] is True
    assert out["restarts"] == 0
    if scenario.endswith("_midread"):
        assert out["parent_first"] == list(range(10))
        assert out["parent_rest"] == 90
    _assert_gone(out["children"])
