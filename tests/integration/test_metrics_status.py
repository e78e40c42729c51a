"""Metrics (/metrics of a live dispatcher and workers), `dataservice status` and
its verdicts, the consumer's wait statistics and the dispatcher's INFO lines."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import dataservice as ds
from dataservice import status as status_mod

parser = pytest.importorskip("prometheus_client.parser")

ELEMENT_BYTES = 4096


def _scrape(port: int, path: str = "/metrics", token: str | None = None) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.read().decode()


def _samples(
    port: int, token: str | None = None
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape, parsed by prometheus-client."""
    out = {}
    for family in parser.text_string_to_metric_families(_scrape(port, token=token)):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _wait_until(what: str, check: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}; last: {result!r}")
        time.sleep(0.05)


def _block(x: Any) -> Any:
    return np.full(ELEMENT_BYTES, x % 251, np.uint8)


def _slow_block(x: Any) -> Any:
    time.sleep(0.02)
    return np.full(64, x % 251, np.uint8)


def _fast_block(x: Any) -> Any:
    return np.full(64, x % 251, np.uint8)


@pytest.fixture
def observed(make_cluster) -> Iterator[Any]:
    """A dispatcher and two workers, all serving /metrics."""
    cluster = make_cluster(0, metrics_port=0)
    for _ in range(2):
        cluster.add_worker(metrics_port=0, heartbeat_interval_ms=200)
    yield cluster


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["grpc", "shm"])
def test_metrics_match_what_was_read(observed: Any, protocol: str) -> None:
    d = observed.dispatcher
    assert d.metrics_port is not None and all(w.metrics_port for w in observed.workers)
    dataset = ds.Dataset.range(300).map(_block)
    dataset = dataset.apply(
        ds.distribute(
            ds.ShardingPolicy.DYNAMIC,
            d.target,
            job_name="scraped",
            data_transfer_protocol=protocol,
        )
    )
    it = iter(dataset)
    got = [int(e[0]) for e in it]
    assert sorted(got) == sorted(x % 251 for x in range(300))
    stats = it.stats()
    assert stats["elements"] == 300

    produced = sent_bytes = sent_elements = 0.0
    for w in observed.workers:
        s = _samples(w.metrics_port)
        produced += _value(s, "dataservice_elements_produced_total")
        sent_bytes += _value(s, "dataservice_bytes_sent_total", transport=protocol)
        sent_elements += _value(s, "dataservice_elements_sent_total", transport=protocol)
        other = "shm" if protocol == "grpc" else "grpc"
        assert _value(s, "dataservice_bytes_sent_total", transport=other) == 0
        assert _value(s, "dataservice_task_buffer_elements") >= 0
        assert _value(s, "dataservice_pipeline_seconds_total") > 0
        assert _value(s, "dataservice_worker_idle_seconds_total") > 0
    assert produced == 300
    assert sent_elements == 300
    # Encoded bytes: the client counts what it received; shared memory adds the
    # ring's END frame and frame headers.
    client_bytes = stats["bytes"]
    assert client_bytes >= 300 * ELEMENT_BYTES
    if protocol == "grpc":
        assert sent_bytes == client_bytes
    else:
        assert client_bytes <= sent_bytes <= client_bytes * 1.05 + 4096

    def dispatcher_caught_up() -> dict | None:
        s = _samples(d.metrics_port)
        labels = [k for k in s if k[0] == "dataservice_consumer_elements_total"]
        if not labels or s[labels[0]] != 300:
            return None
        return s

    s = _wait_until("the consumer's final counters at the dispatcher", dispatcher_caught_up)
    assert _value(s, "dataservice_workers", state="alive") == 2
    assert _value(s, "dataservice_workers", state="silent") == 0
    assert _value(s, "dataservice_jobs") == 1
    assert _value(s, "dataservice_consumers") == 0  # the iterator ended and left
    assert _value(s, "dataservice_splits_handed_out_total") >= 300
    consumer = f"{os.uname().nodename}/{os.getpid()}"
    assert _value(s, "dataservice_consumer_elements_total", job="scraped", consumer=consumer) == 300
    assert _value(
        s, "dataservice_consumer_bytes_total", job="scraped", consumer=consumer
    ) == pytest.approx(client_bytes)
    assert _value(
        s, "dataservice_consumer_wait_seconds_total", job="scraped", consumer=consumer
    ) == pytest.approx(stats["wait_s"], rel=1e-6)
    assert _value(s, "dataservice_rpc_seconds_count", method="GetSplits") >= 1
    assert _value(s, "dataservice_auth_refusals_total") == 0

    assert _scrape(d.metrics_port, "/healthz") == "ok\n"
    assert _scrape(observed.workers[0].metrics_port, "/readyz") == "ready\n"


@pytest.mark.timeout(60)
def test_metrics_port_is_off_by_default(cluster: Any) -> None:
    assert ds.DispatcherConfig().metrics_port is None
    assert ds.WorkerConfig("localhost:5050").metrics_port is None
    assert cluster.dispatcher.metrics_port is None
    assert cluster.workers[0].metrics_port is None
    with pytest.raises(ValueError, match="metrics_port"):
        ds.DispatcherConfig(metrics_port=70000)


@pytest.mark.timeout(60)
def test_metrics_endpoint_closes_with_the_server(make_cluster) -> None:
    cluster = make_cluster(0, metrics_port=0)
    port = cluster.dispatcher.metrics_port
    assert "dataservice_workers" in _scrape(port)
    cluster.dispatcher.stop()
    assert cluster.dispatcher.metrics_port is None
    with pytest.raises(urllib.error.URLError):
        _scrape(port)


def _read_for(
    dataset: Any, stop: threading.Event, per_element_s: float, iterators: list
) -> Callable[[], None]:
    def run() -> None:
        it = iter(dataset)
        iterators.append(it)
        for _ in it:
            if stop.is_set():
                break
            if per_element_s:
                time.sleep(per_element_s)
        it.close()

    return run


def _status_of(target: str, window_s: float) -> dict:
    return status_mod.fetch_status(target, window_s)


def _verdict(status: dict, job: str) -> dict:
    return next(v for v in status["verdicts"] if v["job"] == job)


def _run_status_cli(target: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dataservice", "status", "--dispatcher", target, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(120)
def test_status_tells_input_bound_from_trainer_bound(observed: Any) -> None:
    d = observed.dispatcher
    slow = ds.Dataset.range(10**6).map(_slow_block)  # ~100 elements/s from 2 workers
    fast = ds.Dataset.range(10**6).map(_fast_block)
    stop = threading.Event()
    iterators: list = []
    threads = [
        threading.Thread(
            target=_read_for(
                slow.apply(ds.distribute("parallel_epochs", d.target, job_name="starved")),
                stop,
                0.0,
                iterators,
            )
        ),
        threading.Thread(
            target=_read_for(
                fast.apply(ds.distribute("parallel_epochs", d.target, job_name="busy")),
                stop,
                0.01,
                iterators,
            )
        ),
    ]
    for t in threads:
        t.start()
    try:

        def settled() -> dict | None:
            s = _status_of(d.target, 2.0)
            v = {x["job"]: x["verdict"] for x in s["verdicts"]}
            windows = [c["window_s"] for j in s["jobs"] for c in j["consumers"]]
            if v == {"starved": "input-bound", "busy": "trainer-bound"} and min(windows) > 1.0:
                return s
            return None

        _wait_until("an input-bound and a trainer-bound verdict", settled, timeout_s=40)
        proc = _run_status_cli(d.target, "--json", "--window-s", "2")
        assert proc.returncode == 0, proc.stderr
        s = json.loads(proc.stdout)
        assert set(s) >= {"workers", "jobs", "verdicts"}
        starved, busy = _verdict(s, "starved"), _verdict(s, "busy")
        assert starved["verdict"] == "input-bound", s
        assert starved["wait_fraction"] > 0.5
        assert "add workers or cheapen the pipeline" in starved["message"]
        assert busy["verdict"] == "trainer-bound", s
        assert busy["wait_fraction"] < 0.2
        assert {w["address"] for w in s["workers"]} == {w.address for w in observed.workers}
        assert all(w["elements_per_s"] > 0 and w["tasks"] == 2 for w in s["workers"])
        jobs = {j["job"]: j for j in s["jobs"]}
        # `busy` reads ~100 elements/s (10 ms a step); `starved` gets what 2 workers
        # sleeping 20 ms an element make: ~100/s.
        assert 30 < jobs["busy"]["elements_per_s"] < 130
        assert 30 < jobs["starved"]["elements_per_s"] < 130
        text = _run_status_cli(d.target, "--window-s", "2")
        assert text.returncode == 0, text.stderr
        assert "starved: input-bound: trainers waited" in text.stdout
        assert "busy: trainer-bound" in text.stdout
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)


@pytest.mark.timeout(120)
def test_status_names_a_straggler(observed: Any) -> None:
    d = observed.dispatcher
    dataset = (
        ds.Dataset.range(10**6)
        .map(_slow_block)
        .apply(ds.distribute("parallel_epochs", d.target, job_name="shared"))
    )
    stop = threading.Event()
    iterators: list = []
    # One consumer takes 50 elements/s of the ~100 the workers make; the other
    # takes the rest and waits for each: it is the one the job's input starves.
    slow_reader = threading.Thread(target=_read_for(dataset, stop, 0.02, iterators))
    slow_reader.start()
    _wait_until("the first iterator", lambda: iterators)
    eager_reader = threading.Thread(target=_read_for(dataset, stop, 0.0, iterators))
    eager_reader.start()
    _wait_until("the second iterator", lambda: len(iterators) == 2)
    eager_client = iterators[1]._reader.client_id
    try:
        # Until the eager consumer drained what the workers made ahead for the
        # first one, it waits little; then it waits for every element.
        def straggler() -> tuple[dict, dict] | None:
            s = _status_of(d.target, 2.0)
            v = _verdict(s, "shared")
            if v["verdict"] == "straggler" and v["consumer"].endswith(f"#{eager_client}"):
                return v, s
            return None

        v, s = _wait_until("the eager consumer named a straggler", straggler, timeout_s=40)
        assert f"consumer {v['consumer']} waited" in v["message"]
        (job,) = [j for j in s["jobs"] if j["job"] == "shared"]
        waits = {c["iteration_client_id"]: c["wait_fraction"] for c in job["consumers"]}
        assert waits[eager_client] >= 0.25 + max(w for c, w in waits.items() if c != eager_client)
    finally:
        stop.set()
        slow_reader.join(timeout=30)
        eager_reader.join(timeout=30)


def test_verdict_rules() -> None:
    def job(*fractions: float | None) -> dict:
        return {
            "job": "j",
            "consumers": [
                {"consumer": f"h/{i}", "wait_fraction": f, "window_s": 60.0}
                for i, f in enumerate(fractions)
            ],
        }

    assert status_mod.verdicts([job()], 60)[0]["verdict"] == "idle"
    assert status_mod.verdicts([job(None)], 60)[0]["verdict"] == "unknown"
    assert status_mod.verdicts([job(0.9, 0.8)], 60)[0]["verdict"] == "input-bound"
    assert status_mod.verdicts([job(0.05, 0.1)], 60)[0]["verdict"] == "trainer-bound"
    v = status_mod.verdicts([job(0.05, 0.7, 0.1)], 60)[0]
    assert (v["verdict"], v["consumer"]) == ("straggler", "h/1")
    assert "waited 70% of the last 60 s" in v["message"]


@pytest.mark.timeout(60)
def test_status_without_the_token_is_refused(make_cluster, monkeypatch, tmp_path) -> None:
    cluster = make_cluster(0, auth_token="s3cret-token-for-status")
    monkeypatch.delenv("DATASERVICE_AUTH_TOKEN", raising=False)
    env = {k: v for k, v in os.environ.items() if k != "DATASERVICE_AUTH_TOKEN"}
    proc = subprocess.run(
        [sys.executable, "-m", "dataservice", "status", "--dispatcher", cluster.target],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 1
    assert "UnauthenticatedError" in proc.stderr
    assert "missing or wrong auth token" in proc.stderr
    assert "DATASERVICE_AUTH_TOKEN" in proc.stderr
    assert proc.stdout == ""
    ok = subprocess.run(
        [sys.executable, "-m", "dataservice", "status", "--dispatcher", cluster.target, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "DATASERVICE_AUTH_TOKEN": "s3cret-token-for-status"},
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["workers"] == []
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-for-status\n")
    token_file.chmod(0o600)
    from_file = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataservice",
            "status",
            "--dispatcher",
            cluster.target,
            "--json",
            "--auth-token-file",
            str(token_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert from_file.returncode == 0, from_file.stderr
    assert json.loads(from_file.stdout)["jobs"] == []


@pytest.mark.timeout(60)
def test_auth_refusals_are_counted(make_cluster) -> None:
    cluster = make_cluster(0, auth_token="another-token-xyz", metrics_port=0)
    with pytest.raises(ds.errors.UnauthenticatedError):
        status_mod.fetch_status(cluster.target, 5.0, auth_token="wrong-token")
    s = _samples(cluster.dispatcher.metrics_port, token="another-token-xyz")
    assert _value(s, "dataservice_auth_refusals_total") == 1


@pytest.mark.timeout(60)
def test_stats_wait_fraction(cluster: Any) -> None:
    dataset = (
        ds.Dataset.range(40)
        .map(_slow_block)
        .apply(ds.distribute("parallel_epochs", cluster.target))
    )
    it = iter(dataset)
    assert it.stats()["wall_s"] == 0 and it.stats()["wait_fraction"] == 0
    start = time.monotonic()
    assert len(list(it)) == 40
    elapsed = time.monotonic() - start
    s = it.stats()
    assert s["wait_ms"] == pytest.approx(s["wait_s"] * 1000)
    assert 0 < s["wall_s"] <= elapsed
    # One worker sleeping 20 ms an element, a consumer that does nothing: it waits.
    assert s["wait_fraction"] > 0.8
    assert s["wait_fraction"] == pytest.approx(s["wait_s"] / s["wall_s"])
    (worker,) = s["workers"].values()
    assert worker["elements"] == 40 and worker["bytes"] == s["bytes"]


@pytest.mark.timeout(60)
def test_dispatcher_logs_jobs_and_consumers(cluster: Any, caplog) -> None:
    caplog.set_level(logging.INFO, logger="dataservice.dispatcher.server")
    dataset = ds.Dataset.range(5).apply(ds.distribute("parallel_epochs", cluster.target, "logged"))
    assert len(list(dataset)) == 5
    _wait_until(
        "the consumer's release",
        lambda: any("consumer" in r.message and "left" in r.message for r in caplog.records),
    )
    text = "\n".join(r.message for r in caplog.records)
    assert "(logged) created: dataset" in text
    assert "joined iteration" in text and "of job" in text
    assert "(logged) finished" in text

    extra = cluster.add_worker()
    _wait_until(
        "the new worker's registration",
        lambda: any(f"worker {extra.address} registered (pid" in r.message for r in caplog.records),
    )
    extra.stop()
    lost = _wait_until(
        "the stopped worker's loss",
        lambda: [
            r
            for r in caplog.records
            if r.levelno == logging.WARNING and f"worker lost: worker {extra.address}" in r.message
        ],
    )
    assert "heartbeat" in lost[0].message or "connection" in lost[0].message, lost[0].message


@pytest.mark.timeout(60)
def test_version_flag() -> None:
    from importlib import metadata

    proc = subprocess.run(
        [sys.executable, "-m", "dataservice", "--version"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"dataservice {metadata.version('dataservice')}"


@pytest.mark.timeout(90)
def test_cli_servers_serve_metrics_on_metrics_port() -> None:
    import re
    import signal

    from dataservice import _serverproc

    def spawn(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "dataservice", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def ready(proc: subprocess.Popen[str]) -> tuple[str, int]:
        assert proc.stdout is not None
        line = proc.stdout.readline().rstrip("\n")  # bounded by the test's timeout
        m = _serverproc.READY_RE.match(line)
        metrics_port = _serverproc.METRICS_RE.search(line)
        assert m and metrics_port, f"ready line without a metrics port: {line!r}"
        assert re.fullmatch(r"\S+:\d+", m.group(2))
        return m.group(2), int(metrics_port.group(1))

    dispatcher = spawn("dispatcher", "--port", "0", "--metrics-port", "0")
    procs = [dispatcher]
    try:
        address, d_port = ready(dispatcher)
        worker = spawn("worker", "--dispatcher", address, "--metrics-port", "0")
        procs.append(worker)
        _, w_port = ready(worker)
        _wait_until(
            "the worker at the dispatcher's /metrics",
            lambda: _value(_samples(d_port), "dataservice_workers", state="alive") == 1,
        )
        assert _scrape(w_port, "/readyz") == "ready\n"
        assert _value(_samples(w_port), "dataservice_elements_produced_total") == 0
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                assert p.wait(timeout=30) == 0
            finally:
                if p.poll() is None:
                    p.kill()
                p.communicate()


def _stalled(x: Any) -> Any:
    if int(x) >= 5:
        time.sleep(60)  # the pipeline stalls after 5 elements
    return x


@pytest.mark.timeout(120)
def test_a_trainer_blocked_in_next_counts_as_waiting(observed: Any) -> None:
    """A consumer blocked in next() (the pipeline stalled): its wait under way
    counts in stats() and in the dispatcher's status, which calls the job
    input-bound; it used to count only once next() returned, so a trainer
    blocked for good looked trainer-bound with 0 % waited."""
    d = observed.dispatcher
    dataset = (
        ds.Dataset.range(1000)
        .map(_stalled)
        .apply(ds.distribute(ds.ShardingPolicy.OFF, d.target, job_name="stalled"))
    )
    it = iter(dataset)
    for _ in range(5 * len(observed.workers)):
        next(it)  # each worker's copy gives 5

    def read_on() -> None:
        try:
            next(it, None)
        except ds.errors.CancelledError:
            pass  # closed below

    blocked = threading.Thread(target=read_on, daemon=True)
    blocked.start()
    time.sleep(3.0)
    assert it.stats()["wait_ms"] > 2500

    def input_bound() -> dict | None:
        v = _verdict(_status_of(d.target, 2.0), "stalled")
        return v if v["verdict"] == "input-bound" else None

    verdict = _wait_until("the stalled job called input-bound", input_bound, timeout_s=20)
    assert verdict["wait_fraction"] > 0.5
    it.close()
    blocked.join(10)
