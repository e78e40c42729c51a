"""`LocalCluster`: processes start, serve, restart, and always go away
(CASES C-01, C-23, C-24)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import psutil
import pytest

import dataservice as ds


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if _alive(p.pid)]


def _run_script(source: str, timeout_s: float = 60.0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(source)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _read_json_line(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> dict:
    """The first stdout line of `proc` as JSON, read in a thread with a deadline."""
    assert proc.stdout is not None
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    if not box or not box[0]:
        proc.kill()
        pytest.fail(f"no line from the script; stderr: {proc.communicate()[1][-3000:]}")
    return json.loads(box[0])


@pytest.mark.timeout(120)
def test_cluster_serves_and_leaves_no_process() -> None:
    before = {p.pid for p in _children()}
    with ds.LocalCluster(num_workers=2) as cluster:
        assert cluster.target.startswith("grpc://127.0.0.1:")
        assert cluster.target == f"grpc://{cluster.dispatcher_address}"
        assert len(cluster.worker_addresses) == 2
        assert all(a.startswith("127.0.0.1:") for a in cluster.worker_addresses)
        assert len(set(cluster.worker_addresses)) == 2
        pids = [cluster.dispatcher_pid, *cluster.worker_pids]
        assert all(_alive(p) for p in pids)
        dataset = ds.Dataset.range(10).apply(
            ds.distribute(ds.ShardingPolicy.OFF, cluster.target, job_name="test-off")
        )
        elements = sorted(int(x) for x in dataset)
        assert elements == sorted(list(range(10)) * 2)
    assert not any(_alive(p) for p in pids)
    assert {p.pid for p in _children()} <= before


@pytest.mark.timeout(120)
def test_a_cluster_started_from_a_thread_that_ends_keeps_serving() -> None:
    """The parent-death signal fires when the forking *thread* exits; the
    servers must tell that apart from the death of this process."""
    box: list[ds.LocalCluster] = []
    t = threading.Thread(target=lambda: box.append(ds.LocalCluster(num_workers=1)))
    t.start()
    t.join(60)
    assert box, "LocalCluster did not start"
    with box[0] as cluster:
        dataset = ds.Dataset.range(4).apply(
            ds.distribute(ds.ShardingPolicy.OFF, cluster.target, job_name="from-thread")
        )
        assert sorted(int(x) for x in dataset) == [0, 1, 2, 3]
        assert all(_alive(p) for p in [cluster.dispatcher_pid, *cluster.worker_pids])


@pytest.mark.timeout(60)
def test_bad_arguments_raise_value_error_and_start_nothing() -> None:
    before = {p.pid for p in _children()}
    with pytest.raises(ValueError, match="unknown `worker_options`"):
        ds.LocalCluster(1, worker_options={"no_such_field": 1})
    with pytest.raises(ValueError, match="dispatcher_address"):
        ds.LocalCluster(1, worker_options={"dispatcher_address": "x:1"})
    with pytest.raises(ValueError, match="heartbeat_interval_ms"):
        ds.LocalCluster(1, worker_options={"heartbeat_interval_ms": -5})
    with pytest.raises(ValueError, match="share"):
        ds.LocalCluster(2, worker_options={"port": 5555})
    with pytest.raises(ValueError, match="num_workers"):
        ds.LocalCluster(-1)
    assert {p.pid for p in _children()} <= before


@pytest.mark.timeout(60)
def test_a_server_that_dies_at_start_raises_with_its_stderr() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=r"(?s)dispatcher .*exited with code 1.*bind"):
            ds.LocalCluster(1, dispatcher_config=ds.DispatcherConfig(port=port))
    assert not _children()


@pytest.mark.timeout(120)
def test_worker_options_reach_the_workers() -> None:
    with ds.LocalCluster(1, worker_options={"worker_address": "127.0.0.1:%port%"}) as cluster:
        cmdline = psutil.Process(cluster.worker_pids[0]).cmdline()
        assert "--worker-address" in cmdline
        assert cmdline[cmdline.index("--dispatcher") + 1] == cluster.dispatcher_address


@pytest.mark.timeout(120)
def test_restart_workers_restarts_a_killed_worker_at_the_same_address() -> None:
    with ds.LocalCluster(
        2, restart_workers=True, worker_options={"heartbeat_interval_ms": 100}
    ) as cluster:
        addresses = cluster.worker_addresses
        old = cluster.worker_pids[0]
        os.kill(old, signal.SIGKILL)
        _wait_until(
            lambda: (
                cluster.num_restarts >= 1
                and cluster.worker_pids[0] != old
                and _alive(cluster.worker_pids[0])
            ),
            60,
            "the worker to be restarted",
        )
        assert cluster.worker_addresses == addresses
        assert not _alive(old)
        dataset = ds.Dataset.range(5).apply(
            ds.distribute(ds.ShardingPolicy.OFF, cluster.target, job_name="after-restart")
        )
        assert sorted(int(x) for x in dataset) == sorted(list(range(5)) * 2)
        pids = [cluster.dispatcher_pid, *cluster.worker_pids]
    assert not any(_alive(p) for p in pids)


@pytest.mark.timeout(120)
def test_teardown_is_bounded_when_a_worker_is_stuck_in_user_code(tmp_path) -> None:
    """C-24: a `map` that sleeps forever does not hold up `__exit__`."""
    marker = str(tmp_path / "stuck")

    def stuck(x):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(10_000)
        return x

    grace_s = 2.0
    cluster = ds.LocalCluster(1, grace_period_s=grace_s)
    pids = [cluster.dispatcher_pid, *cluster.worker_pids]
    dataset = ds.Dataset.range(3).map(stuck)
    dataset = dataset.apply(ds.distribute(ds.ShardingPolicy.OFF, cluster.target, job_name="stuck"))
    iterator = iter(dataset)

    def read() -> None:
        try:
            next(iterator, None)
        except ds.errors.DataServiceError:
            pass  # the servers went away under it, or it was closed

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    _wait_until(lambda: os.path.exists(marker), 60, "the worker to enter the stuck map fn")
    t0 = time.monotonic()
    cluster.__exit__(None, None, None)
    elapsed = time.monotonic() - t0
    print(f"teardown with a worker stuck in user code took {elapsed:.2f} s (grace {grace_s} s)")
    assert elapsed <= grace_s + 2.0, f"teardown took {elapsed:.1f} s"
    assert not any(_alive(p) for p in pids)
    assert not _children()
    iterator.close()


@pytest.mark.timeout(120)
def test_closing_the_iterator_unblocks_a_reader_of_a_stuck_worker(tmp_path) -> None:
    """C-24, the iterator side: close() from another thread ends a blocked next()."""
    marker = str(tmp_path / "stuck")

    def stuck(x):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(10_000)
        return x

    with ds.LocalCluster(1, grace_period_s=1.0) as cluster:
        dataset = ds.Dataset.range(3).map(stuck)
        dataset = dataset.apply(ds.distribute(ds.ShardingPolicy.OFF, cluster.target))
        iterator = iter(dataset)
        outcome: list[object] = []

        def read() -> None:
            try:
                outcome.append(next(iterator, None))
            except ds.errors.DataServiceError as e:
                outcome.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        _wait_until(lambda: os.path.exists(marker), 60, "the worker to enter the stuck map fn")
        iterator.close()
        reader.join(5)
        assert not reader.is_alive(), "next() still blocked 5 s after close()"


_OWNER_SCRIPT = """
    import json, sys
    import dataservice as ds
    cluster = ds.LocalCluster({n})
    print(json.dumps({{"pids": [cluster.dispatcher_pid, *cluster.worker_pids]}}), flush=True)
    sys.stdin.read()  # until the test kills us
"""


@pytest.mark.timeout(120)
def test_children_die_when_the_owner_is_sigkilled() -> None:
    """C-23: no orphans, even without any teardown code running."""
    proc = _run_script(_OWNER_SCRIPT.format(n=4))
    pids = _read_json_line(proc)["pids"]
    assert len(pids) == 5 and all(_alive(p) for p in pids)
    proc.kill()
    proc.wait(10)
    t0 = time.monotonic()
    _wait_until(lambda: not any(_alive(p) for p in pids), 5.0, "the orphaned servers to exit")
    print(f"orphans gone {time.monotonic() - t0:.2f} s after SIGKILL of their owner")


@pytest.mark.timeout(120)
def test_children_stop_when_the_owner_gets_sigterm() -> None:
    proc = _run_script(_OWNER_SCRIPT.format(n=2))
    pids = _read_json_line(proc)["pids"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == -signal.SIGTERM  # still dies of SIGTERM, after teardown
    assert not any(_alive(p) for p in pids)  # reaped by the owner before it died


_C01_SCRIPT = """
    import json, sys
    import dataservice as ds
    {setup}
    dataset = ds.Dataset.range(1000).repeat().apply(
        ds.distribute(ds.ShardingPolicy.OFF, cluster.target))
    it = iter(dataset)
    for _ in range(10):
        next(it)
    pids = [cluster.dispatcher_pid, *cluster.worker_pids]
    {teardown}
    print(json.dumps({{"pids": pids}}), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("setup", "teardown"),
    [
        # The iterator is abandoned but alive; atexit stops the cluster.
        ("cluster = ds.LocalCluster(2)", "pass"),
        # The iterator is dropped, then the cluster stopped explicitly.
        ("cluster = ds.LocalCluster(2)", "del it; cluster.stop()"),
    ],
    ids=["atexit-iterator-alive", "stop-iterator-dropped"],
)
def test_script_using_local_cluster_exits_promptly(setup: str, teardown: str) -> None:
    """C-01: after the last line, the process (and its servers) end within 3 s."""
    proc = _run_script(_C01_SCRIPT.format(setup=setup, teardown=teardown))
    proc.stdin.close()
    pids = _read_json_line(proc, timeout_s=90)["pids"]
    t0 = time.monotonic()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    elapsed = time.monotonic() - t0
    err = proc.stderr.read()
    assert proc.returncode == 0, err[-3000:]
    assert elapsed <= 3.0, f"exit took {elapsed:.1f} s after the last line; stderr: {err[-3000:]}"
    _wait_until(lambda: not any(_alive(p) for p in pids), 5.0, "the servers to be gone")


def _epochs_with_early_breaks(num_epochs: int, seed: int) -> None:
    """C-21: a fresh iterator every epoch, sometimes abandoned early; a
    per-epoch watchdog (10 s) turns a deadlock at an epoch boundary into a failure."""
    import random

    rnd = random.Random(seed)
    with ds.LocalCluster(2, worker_options={"heartbeat_interval_ms": 100}) as cluster:
        dataset = ds.Dataset.range(40).apply(
            ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name=f"c21-{seed}")
        )
        for epoch in range(num_epochs):
            stop_after = rnd.choice([None, None, 0, 1, 5, 20])
            result: list[object] = []

            def run_epoch(
                stop_after: int | None = stop_after, result: list[object] = result
            ) -> None:
                iterator = iter(dataset)
                seen = []
                for x in iterator:
                    seen.append(int(x))
                    if stop_after is not None and len(seen) > stop_after:
                        break
                iterator.close()
                result.append(seen)

            t = threading.Thread(target=run_epoch, daemon=True)
            t.start()
            t.join(10)
            assert not t.is_alive(), f"epoch {epoch} (stop_after={stop_after}) hung for 10 s"
            assert result, f"epoch {epoch} failed (see the thread's exception above)"
            seen = result[0]
            assert isinstance(seen, list)
            if stop_after is None:
                assert sorted(seen) == list(range(40)), f"epoch {epoch}"
            else:
                assert len(seen) == min(40, stop_after + 1)


@pytest.mark.timeout(180)
def test_new_iterator_every_epoch_with_early_breaks_never_hangs() -> None:
    _epochs_with_early_breaks(20, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_200_epochs_with_early_breaks_never_hang() -> None:
    _epochs_with_early_breaks(200, seed=2)


def test_a_dead_dispatcher_is_reaped_named_and_new_calls_fail_at_once(caplog) -> None:
    import logging

    from dataservice import errors

    caplog.set_level(logging.ERROR)
    with ds.LocalCluster(num_workers=1) as cluster:
        pid = cluster.dispatcher_pid
        os.kill(pid, signal.SIGKILL)
        _wait_until(
            lambda: any("dispatcher process" in r.getMessage() for r in caplog.records),
            10,
            "the cluster to log its dispatcher's exit",
        )
        assert not os.path.exists(f"/proc/{pid}")  # reaped, no zombie
        logged = [r.getMessage() for r in caplog.records if "dispatcher process" in r.getMessage()]
        assert f"(pid {pid}) was killed by signal 9" in logged[0]
        started = time.monotonic()
        with pytest.raises(errors.UnavailableError, match=f"pid {pid}.*does not restart it"):
            next(iter(ds.Dataset.range(3).apply(ds.distribute("OFF", cluster.target))))
        assert time.monotonic() - started < 5  # not the 8-60 s of retries
    dataset = ds.Dataset.range(3).apply(ds.distribute("OFF", cluster.target))
    with pytest.raises(errors.UnavailableError, match="a LocalCluster that was stopped"):
        list(dataset)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["dynamic", "off"])
def test_a_read_in_progress_when_its_cluster_stops_fails_within_seconds(mode: str) -> None:
    """Its dispatcher and workers were stopped together: the read raises within a
    few heartbeats, saying so, not after client_timeout_ms (60 s) of waiting for
    a dispatcher and workers that cannot come back."""
    from dataservice import errors

    outcome: dict[str, object] = {}
    started = threading.Event()

    def read(target: str) -> None:
        n = 0
        try:
            for _ in ds.Dataset.range(10**9).apply(ds.distribute(mode, target)):
                n += 1
                started.set()
        except BaseException as err:  # noqa: BLE001  (the test inspects it)
            outcome["error"] = err
        outcome["read"] = n

    with ds.LocalCluster(num_workers=2) as cluster:
        reader = threading.Thread(target=read, args=(cluster.target,), daemon=True)
        reader.start()
        assert started.wait(30), "no element within 30 s"
    stopped = time.monotonic()
    reader.join(30)
    assert not reader.is_alive(), "the read still waits 30 s after its cluster stopped"
    took_s = time.monotonic() - stopped
    error = outcome.get("error")
    assert isinstance(error, errors.UnavailableError), repr(error)
    # From the heartbeat ("lost the dispatcher at ...: it was the dispatcher of a
    # LocalCluster...") or from a fetch ("lost worker W: the dispatcher at D is
    # gone (it was ...)"), whichever fails first; never a worker called a dispatcher.
    assert "LocalCluster that was stopped" in str(error), str(error)
    assert "and its workers were stopped with it" in str(error)
    assert not re.match(r"lost worker \S+: it was the dispatcher", str(error)), str(error)
    assert took_s < 10, f"raised {took_s:.1f} s after the cluster stopped"
    assert int(outcome["read"]) > 0  # type: ignore[call-overload]


def test_iterating_after_the_cluster_stopped_says_so_at_once() -> None:
    from dataservice import errors

    with ds.LocalCluster(num_workers=1) as cluster:
        dataset = ds.Dataset.range(3).apply(ds.distribute("OFF", cluster.target))
        assert [int(x) for x in dataset] == [0, 1, 2]
    started = time.monotonic()
    with pytest.raises(errors.UnavailableError, match="a LocalCluster that was stopped"):
        list(dataset)
    assert time.monotonic() - started < 5


def _slow_identity(x):
    time.sleep(0.01)
    return x


@pytest.mark.timeout(60)
def test_a_cluster_stopped_under_idle_iterators_logs_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Iterators still referenced, fetching ahead, when their LocalCluster stops
    (a `with` block left mid-epoch): their fetch threads see the workers go and
    closing them loses nothing anyone else reads, so none of it is a WARNING
    (they said "cannot reach worker ...; retrying" and "leaves mid-epoch with N
    elements")."""
    import logging

    with caplog.at_level(logging.WARNING, logger="dataservice"):
        with ds.LocalCluster(num_workers=2) as cluster:
            named = iter(
                ds.Dataset.range(10**6)
                .map(_slow_identity)
                .apply(ds.distribute(ds.ShardingPolicy.OFF, cluster.target, job_name="j"))
            )
            anonymous = iter(
                ds.Dataset.range(10**6)
                .map(_slow_identity)
                .apply(ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target))
            )
            for _ in range(10):
                next(named)
                next(anonymous)
        time.sleep(2.0)  # the fetch threads find the workers gone
        named.close()
        anonymous.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warnings, warnings


def test_a_server_on_the_port_of_a_stopped_cluster_is_not_taken_for_it() -> None:
    """A stopped LocalCluster marks its dispatcher's address gone (so reads of it
    fail at once); a server of this process bound later on that port serves, and
    calls to it are not refused with the old cluster's reason (CI: an in-process
    cluster on a reused port got "it was the dispatcher of a LocalCluster that was
    stopped" when its first try failed)."""
    from dataservice import errors
    from dataservice.rpc import util as rpc_util

    with ds.LocalCluster(num_workers=1) as cluster:
        address = cluster.target.split("://")[-1]
        assert [int(x) for x in ds.Dataset.range(3).apply(ds.distribute("OFF", cluster.target))]
    with pytest.raises(errors.UnavailableError, match="LocalCluster that was stopped"):
        ds.register_dataset(cluster.target, ds.Dataset.range(3))
    port = int(address.rsplit(":", 1)[1])
    dispatcher = ds.DispatchServer(ds.DispatcherConfig(port=port))
    worker = ds.WorkerServer(ds.WorkerConfig(f"127.0.0.1:{port}"))
    try:
        assert rpc_util.gone_reason(address) is None
        target = f"grpc://127.0.0.1:{port}"
        got = [int(x) for x in ds.Dataset.range(5).apply(ds.distribute("OFF", target))]
        assert got == list(range(5))
    finally:
        worker.stop()
        dispatcher.stop()
