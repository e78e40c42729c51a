"""A dispatcher that could not run for a while (SIGSTOP, a paused VM) gets, on
return, the grace a restart gets: it must not declare its workers and
iteration clients dead because *it* did not hear their heartbeats
(dispatcher/liveness.py `_grant_stall_grace_locked`; issue 10, item 3).

The fault-tolerant dispatcher and two workers are real processes
(`python -m dataservice ...`); the consumer runs in the test process. The
dispatcher is frozen for longer than its client_timeout_ms and
worker_timeout_ms, then resumed, mid-epoch.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import pytest

import dataservice as ds

from .conftest import Servers, report

N = 600
DISPATCHER_TIMEOUT_MS = 3_000  # the dispatcher's client_timeout_ms and worker_timeout_ms
FREEZE_S = 6.0  # twice those


def _read_through_a_freeze(
    target: str,
    pid: int,
    mode: ds.ShardingPolicy,
    protocol: str,
    freeze_s: float,
) -> tuple[list[int], float, float]:
    """Reads one epoch of range(N) from `target`, freezing the dispatcher
    process `pid` for `freeze_s` seconds after the 50th element; returns the
    elements, when the freeze began and when the epoch ended (monotonic)."""
    dataset = ds.Dataset.range(N).apply(
        ds.distribute(mode, target, data_transfer_protocol=protocol, client_timeout_ms=60_000)
    )
    resumed = threading.Event()
    frozen_at: list[float] = []

    def freeze() -> None:
        os.kill(pid, signal.SIGSTOP)
        frozen_at.append(time.monotonic())
        try:
            # The scenario's length, not a synchronisation: the dispatcher stays
            # frozen this long whatever the consumer does meanwhile.
            time.sleep(freeze_s)
        finally:
            os.kill(pid, signal.SIGCONT)
            resumed.set()

    out: list[int] = []
    thread = None
    for x in dataset:
        out.append(int(x))
        if len(out) == 50:
            thread = threading.Thread(target=freeze, daemon=True)
            thread.start()
        if thread is not None and not resumed.is_set():
            # Read slowly while it is frozen, so the epoch outlasts the freeze.
            time.sleep(0.01)
    t_end = time.monotonic()
    assert thread is not None
    thread.join(freeze_s + 30)
    assert resumed.is_set()
    return out, frozen_at[0], t_end


def _check_epoch(out: list[int], mode: ds.ShardingPolicy, copies: int) -> None:
    counts = collections.Counter(out)
    missing = [i for i in range(N) if counts[i] < copies]
    extra = [i for i in counts if counts[i] > copies or not 0 <= i < N]
    assert not missing and not extra, (
        f"{mode.name}: {len(out)} elements, expected {copies * N}; "
        f"{len(missing)} short (first {missing[:5]}), {len(extra)} too many (first {extra[:5]})"
    )


def _freeze_mid_epoch(
    servers: Servers, tmp_path, mode: ds.ShardingPolicy, protocol: str, freeze_s: float = FREEZE_S
) -> None:
    dispatcher = servers.dispatcher(
        work_dir=str(tmp_path / "wd"),
        fault_tolerant=True,
        worker_timeout_ms=DISPATCHER_TIMEOUT_MS,
        extra=("--client-timeout-ms", str(DISPATCHER_TIMEOUT_MS)),
    )
    servers.workers(dispatcher, 2)
    t0 = time.monotonic()
    out, frozen_at, t_end = _read_through_a_freeze(
        dispatcher.target, dispatcher.pid, mode, protocol, freeze_s
    )
    _check_epoch(out, mode, 2 if mode == ds.ShardingPolicy.OFF else 1)
    assert t_end > frozen_at + freeze_s, "the epoch ended before the dispatcher resumed"
    text = dispatcher.text()
    # Healthy workers and consumers: none may be declared lost or timed out.
    assert "worker lost:" not in text, text[-3000:]
    assert "timed out" not in text, text[-3000:]
    assert "was stalled for" in text, text[-3000:]
    report(
        f"{mode.name}/{protocol}: dispatcher frozen {freeze_s} s (timeouts "
        f"{DISPATCHER_TIMEOUT_MS} ms); epoch of {len(out)} elements complete, "
        f"{t_end - t0:.1f} s"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "mode,protocol",
    [
        pytest.param(ds.ShardingPolicy.OFF, "auto", marks=pytest.mark.slow),
        (ds.ShardingPolicy.DYNAMIC, "grpc"),
    ],
    ids=["off-shm", "dynamic-grpc"],
)
def test_frozen_dispatcher_keeps_its_consumers_and_workers(
    servers: Servers, tmp_path, mode: ds.ShardingPolicy, protocol: str
) -> None:
    _freeze_mid_epoch(servers, tmp_path, mode, protocol)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "mode,protocol",
    [(ds.ShardingPolicy.OFF, "grpc"), (ds.ShardingPolicy.DYNAMIC, "auto")],
    ids=["off-grpc", "dynamic-shm"],
)
def test_frozen_dispatcher_other_transports(
    servers: Servers, tmp_path, mode: ds.ShardingPolicy, protocol: str
) -> None:
    _freeze_mid_epoch(servers, tmp_path, mode, protocol)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", [ds.ShardingPolicy.OFF, ds.ShardingPolicy.DYNAMIC])
def test_frozen_longer_than_an_rpc_deadline(servers: Servers, tmp_path, mode) -> None:
    """12 s: the clients' and workers' 10 s heartbeat RPCs time out meanwhile."""
    _freeze_mid_epoch(servers, tmp_path, mode, "auto", freeze_s=12.0)


@pytest.mark.timeout(120)
def test_frozen_local_cluster_dispatcher(tmp_path) -> None:
    """The same with LocalCluster's dispatcher process (fault tolerant) and its
    two worker processes, DYNAMIC over shared memory."""
    config = ds.DispatcherConfig(
        work_dir=str(tmp_path / "wd"),
        fault_tolerant_mode=True,
        worker_timeout_ms=DISPATCHER_TIMEOUT_MS,
        client_timeout_ms=DISPATCHER_TIMEOUT_MS,
    )
    with ds.LocalCluster(num_workers=2, dispatcher_config=config) as cluster:
        out, frozen_at, t_end = _read_through_a_freeze(
            cluster.target, cluster.dispatcher_pid, ds.ShardingPolicy.DYNAMIC, "auto", FREEZE_S
        )
    _check_epoch(out, ds.ShardingPolicy.DYNAMIC, 1)
    assert t_end > frozen_at + FREEZE_S
