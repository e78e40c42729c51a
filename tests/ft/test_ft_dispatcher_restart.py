"""Dispatcher crashes and restarts, with and without fault tolerance (issue 5;
CASES C-03, C-04). The dispatcher and the workers are real processes
(`python -m dataservice ...`) that are SIGKILLed and restarted on the same
port; the consumer runs in the test process. Recovery times are printed
(`pytest -s`) as `[ft] ...` lines.
"""

from __future__ import annotations

import random
import re
import signal
import threading
import time

import grpc
import pytest

import dataservice as ds
from dataservice import errors
from dataservice.dispatcher.split_handout import _MAX_SPLITS_PER_RPC
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import service_pb2_grpc
from dataservice.worker.splits import _FIRST_SPLIT_BATCH, _MAX_SPLIT_BATCH

from .conftest import HEARTBEAT_MS, Servers, report, wait_until

N = 10_000


def split_batch_bounds(n: int) -> list[int]:
    """Where the batches of splits that one worker's successive GetSplits get
    start and end, for an IndexSplitProvider of `n` splits and one live task:
    the worker asks for 16, 32, ... 4096 (worker/splits.py `SplitFetcher`),
    the dispatcher grants min(asked, 4096, remaining // 2), at least 1
    (dispatcher/split_handout.py `_get_splits`)."""
    bounds, produced, asked = [0], 0, _FIRST_SPLIT_BATCH
    while produced < n:
        remaining = n - produced
        size = min(max(1, min(asked, _MAX_SPLITS_PER_RPC, remaining // 2)), remaining)
        produced += size
        bounds.append(produced)
        asked = min(asked * 2, _MAX_SPLIT_BATCH)
    return bounds


def _kill_round(servers: Servers, work_dir: str, state: dict, rng: random.Random, i: int) -> None:
    dispatcher = state["dispatcher"]
    kill_at = rng.randrange(N)
    restart_delay_s = rng.uniform(0.0, 0.5)
    dataset = ds.Dataset.range(N).apply(
        ds.distribute(ds.ShardingPolicy.DYNAMIC, dispatcher.target, client_timeout_ms=60_000)
    )
    out: list[int] = []
    times: list[float] = []
    restarted: dict = {}

    def restart(port: int) -> None:
        time.sleep(restart_delay_s)
        restarted["d"] = servers.dispatcher(port=port, work_dir=work_dir, fault_tolerant=True)

    t_kill = 0.0
    thread = None
    for x in dataset:
        if len(out) == kill_at:
            t_kill = dispatcher.kill()
            thread = threading.Thread(target=restart, args=(dispatcher.port,), daemon=True)
            thread.start()
        out.append(int(x))
        times.append(time.monotonic())
    t_end = time.monotonic()
    assert thread is not None
    thread.join(60)
    new = restarted["d"]
    state["dispatcher"] = new

    assert len(out) == len(set(out)), "an element was delivered twice"
    assert set(out) <= set(range(N))
    missing = sorted(set(range(N)) - set(out))
    bounds = split_batch_bounds(N)
    lost_batches = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    assert missing == [] or (missing[0], missing[-1] + 1) in lost_batches, (
        f"missing {len(missing)} elements {missing[:5]}...{missing[-5:]}: not exactly one "
        f"batch of splits {lost_batches}"
    )
    assert missing == [] or len(missing) == missing[-1] + 1 - missing[0]
    after = [t for t in times if t > t_kill]
    gaps = [b - a for a, b in zip([t_kill, *after], after, strict=False)]
    report(
        f"DYNAMIC FT kill #{i}: killed after {kill_at} elements, restart delay "
        f"{restart_delay_s:.2f} s; restarted dispatcher ready {new.ready_at - t_kill:.2f} s after "
        f"the kill (its own start-up and replay {new.ready_at - new.started_at:.2f} s); "
        f"longest consumer stall {max(gaps, default=0):.2f} s; epoch ended "
        f"{t_end - t_kill:.2f} s after the kill; lost {len(missing)} elements"
        + (f" [{missing[0]}, {missing[-1] + 1})" if missing else "")
    )


def _dynamic_kill_rounds(servers: Servers, tmp_path, rounds: int, seed: int) -> None:
    """C-04 (b): kill -9 the fault-tolerant dispatcher at a random point of a
    DYNAMIC epoch over range(10_000) (one worker, one consumer), restart it on
    the same work_dir and port: the consumer's elements have no duplicate and
    miss at most the splits of the GetSplits batch that was in flight.

    The bound, from the code: the dispatcher journals `ProduceSplits` (fsync)
    before it answers GetSplits, so no split is ever handed out twice. A
    worker that got its answer keeps those splits and produces them (it does
    not die here). The one worker has one task and one split provider, so at
    most one GetSplits is in flight; if the kill lands after its journal
    write and before the worker has the answer, the worker retries the same
    request and the restarted dispatcher, whose cursor is past that batch,
    hands out the next one. So each kill loses nothing or exactly one whole
    batch: [b_i, b_i+1) of `split_batch_bounds(10_000)` (16, 32, ... 2048
    splits, then at most half of what remains), i.e. at most 2960 elements.
    (The worker asks for its next batch while it produces the current one,
    but never has two requests in flight.)
    """
    rng = random.Random(seed)
    work_dir = str(tmp_path / "wd")
    dispatcher = servers.dispatcher(work_dir=work_dir, fault_tolerant=True)
    servers.worker(dispatcher)
    state = {"dispatcher": dispatcher}
    for i in range(rounds):
        _kill_round(servers, work_dir, state, rng, i)


@pytest.mark.timeout(150)
def test_dynamic_epoch_survives_dispatcher_kill(servers, tmp_path) -> None:
    _dynamic_kill_rounds(servers, tmp_path, rounds=2, seed=5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dynamic_epoch_survives_dispatcher_kill_20_rounds(servers, tmp_path) -> None:
    _dynamic_kill_rounds(servers, tmp_path, rounds=20, seed=20)


def test_split_batch_bounds() -> None:
    bounds = split_batch_bounds(N)
    assert bounds[:8] == [0, 16, 48, 112, 240, 496, 1008, 2032]
    assert bounds[-1] == N
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert max(sizes) == 2960  # half of the 5,920 left after 16 + 32 + ... + 2048
    assert all(size <= _MAX_SPLIT_BATCH for size in sizes)


# ----------------------------------------------------------------- no FT


def _read_in_thread(dataset) -> tuple[threading.Thread, dict]:
    result: dict = {"n": 0}
    it = iter(dataset)
    result["it"] = it

    def run() -> None:
        try:
            for _ in it:
                result["n"] += 1
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            result["error"] = err
            result["t_error"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: result["n"] >= 5 or "error" in result, 30, "the first elements")
    return thread, result


@pytest.mark.timeout(120)
def test_c04a_non_ft_restart_fails_the_reader_with_dispatcher_restarted(servers) -> None:
    """C-04 (a): without fault tolerance, a restarted dispatcher is a new
    incarnation: a client that is reading raises DispatcherRestartedError, whose
    message says the dispatcher restarted, within client_timeout_ms."""
    client_timeout_ms = 10_000
    dispatcher = servers.dispatcher()
    servers.worker(dispatcher)
    dataset = ds.Dataset.range(10**12).apply(
        ds.distribute(ds.ShardingPolicy.OFF, dispatcher.target, client_timeout_ms=client_timeout_ms)
    )
    thread, result = _read_in_thread(dataset)
    assert "error" not in result, result.get("error")
    t_kill = dispatcher.kill()
    new = servers.dispatcher(port=dispatcher.port)
    thread.join(client_timeout_ms / 1000 + 5)
    assert not thread.is_alive(), "the reader neither failed nor stopped"
    err = result.get("error")
    assert isinstance(err, errors.DispatcherRestartedError), repr(err)
    assert "restarted" in str(err)
    elapsed = result["t_error"] - t_kill
    report(
        f"C-04a: DispatcherRestartedError {elapsed:.2f} s after the kill "
        f"({result['t_error'] - new.ready_at:.2f} s after the new dispatcher was ready; "
        f"client_timeout_ms={client_timeout_ms})"
    )
    assert elapsed <= client_timeout_ms / 1000
    result["it"].close()


def _probe(worker_address: str, task_id: int) -> grpc.StatusCode | None:
    """Asks the worker for an element of `task_id`: None if it still serves it."""
    channel = grpc.insecure_channel(worker_address)
    try:
        stub = service_pb2_grpc.WorkerServiceStub(channel)
        request = pb.GetElementsRequest(
            task_id=task_id, max_elements=1, consumer_index=-1, round_index=-1
        )
        stub.GetElements(request, timeout=5)
        return None
    except grpc.RpcError as err:
        return err.code()
    finally:
        channel.close()


def _worker_with_stale_task(servers: Servers) -> tuple:
    """A dispatcher without FT, a worker, and a reader of an endless OFF job:
    returns (dispatcher, worker, task id the worker runs, reader thread, result)."""
    dispatcher = servers.dispatcher()
    worker = servers.worker(dispatcher)
    dataset = ds.Dataset.range(10**12).apply(
        ds.distribute(ds.ShardingPolicy.OFF, dispatcher.target, client_timeout_ms=10_000)
    )
    thread, result = _read_in_thread(dataset)
    worker.wait_line(r"started task \d+", 10)
    (line,) = [text for _, text in worker.lines_since(0, r"started task \d+")]
    task_id = int(re.search(r"started task (\d+)", line).group(1))
    assert _probe(worker.address, task_id) is None
    return dispatcher, worker, task_id, thread, result


@pytest.mark.timeout(120)
def test_c03_worker_drops_a_task_the_restarted_dispatcher_forgot(servers) -> None:
    """C-03: the dispatcher forgets a task while a worker holds it (a restart
    without FT on the same port). The worker drops the task within 3
    heartbeats of reaching the new dispatcher, and logs no endless warnings."""
    dispatcher, worker, task_id, thread, result = _worker_with_stale_task(servers)
    t_kill = dispatcher.kill()
    new = servers.dispatcher(port=dispatcher.port)
    t_registered = new.wait_line(r"worker \S+ registered", 15)
    t_dropped = t_registered + wait_until(
        lambda: _probe(worker.address, task_id) == grpc.StatusCode.NOT_FOUND,
        5,
        f"the worker to drop task {task_id}",
    )
    report(
        f"C-03: stale task {task_id} dropped {t_dropped - t_registered:.3f} s after the worker "
        f"re-registered, {t_dropped - new.ready_at:.2f} s after the new dispatcher was ready, "
        f"{t_dropped - t_kill:.2f} s after the kill"
    )
    assert t_dropped - t_registered <= 3 * HEARTBEAT_MS / 1000
    # ~30 heartbeats later: a bounded number of log lines, no warning loop.
    time.sleep(3.0)
    worker_lines = worker.lines_since(t_kill)
    noisy = [text for _, text in worker_lines if re.search(r"WARNING|ERROR", text)]
    dispatcher_lines = new.lines_since(0)
    report(
        f"C-03: {len(worker_lines)} worker log lines ({len(noisy)} warnings/errors) and "
        f"{len(dispatcher_lines)} dispatcher lines in the {time.monotonic() - t_kill:.1f} s "
        "after the kill"
    )
    assert len(noisy) <= 3, "\n".join(noisy)
    assert len(worker_lines) <= 10, worker.text()
    assert len(dispatcher_lines) <= 10, new.text()
    thread.join(15)
    assert isinstance(result.get("error"), errors.DispatcherRestartedError), result.get("error")
    result["it"].close()


def _take(dataset, n: int, timeout_s: float) -> list[int]:
    """Up to `n` elements of `dataset` (fewer if it ends), read within `timeout_s`."""
    out: list[int] = []
    it = iter(dataset)

    def run() -> None:
        for x in it:
            out.append(int(x))
            if len(out) >= n:
                break

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    it.close()
    assert not thread.is_alive(), f"read only {len(out)} elements in {timeout_s} s: {out[:20]}"
    return out


@pytest.mark.timeout(120)
def test_c03_worker_serves_the_next_job_after_a_non_ft_restart(servers) -> None:
    """C-03: after dropping the forgotten task, the worker serves the next job
    (its own dataset) right away."""
    dispatcher, worker, task_id, thread, result = _worker_with_stale_task(servers)
    dispatcher.kill()
    new = servers.dispatcher(port=dispatcher.port)
    t_registered = new.wait_line(r"worker \S+ registered", 15)
    wait_until(lambda: _probe(worker.address, task_id) is not None, 5, "the stale task dropped")
    result["it"].close()
    thread.join(5)
    dataset = ds.Dataset.range(1000, 1020).apply(
        ds.distribute(ds.ShardingPolicy.OFF, new.target, client_timeout_ms=10_000)
    )
    got = _take(dataset, 40, 20)
    report(f"C-03: next job read {len(got)} elements after re-registration: {got[:8]}...")
    assert got == list(range(1000, 1020))
    report(f"C-03: next job done {time.monotonic() - t_registered:.2f} s after re-registration")


@pytest.mark.timeout(120)
def test_c03_job_created_before_the_stale_worker_reconnects(servers) -> None:
    """C-03 / C-04: a trainer that recreates its job at once, before a worker
    holding a forgotten task is back, must still read its own dataset."""
    dispatcher, worker, task_id, thread, result = _worker_with_stale_task(servers)
    worker.send(signal.SIGSTOP)  # it reconnects only after the new job exists
    try:
        dispatcher.kill()
        result["it"].close()
        thread.join(5)
        new = servers.dispatcher(port=dispatcher.port)
        # A fresh dataset id, so that only the task id can collide.
        dataset_id = ds.register_dataset(new.target, ds.Dataset.range(1000, 1020), dataset_id="c03")
        dataset = ds.from_dataset_id(
            ds.ShardingPolicy.OFF, new.target, dataset_id, client_timeout_ms=10_000
        )
        it = iter(dataset)  # creates the iteration (no worker registered yet)
    finally:
        worker.send(signal.SIGCONT)
    got: list[int] = []

    def run() -> None:
        for x in it:
            got.append(int(x))
            if len(got) >= 40:
                break

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    reader.join(20)
    it.close()
    report(f"C-03: job created before the worker came back read {got[:8]}... (task {task_id})")
    assert got == list(range(1000, 1020))
