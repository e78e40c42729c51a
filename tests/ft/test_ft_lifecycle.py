"""Lifecycle under faults (issue 5; CASES C-21, C-23): the trainer process
that owns a LocalCluster is SIGKILLed while reading, and many epochs with
fresh, abandoned and concurrent iterators never hang.
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import dataservice as ds

from .conftest import gone, report, server_env, wait_until

SHM_PREFIXES = ("dataservice", "ds-")


def _our_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIXES)}


_TRAINER = textwrap.dedent(
    """
    import json, sys
    import dataservice as ds
    cluster = ds.LocalCluster(2, worker_options={"heartbeat_interval_ms": 100})
    dataset = ds.Dataset.range(10**12).apply(ds.distribute("parallel_epochs", cluster.target))
    it = iter(dataset)
    for _ in range(100):
        next(it)
    stats = it.stats()
    print(json.dumps({"pids": [cluster.dispatcher_pid, *cluster.worker_pids],
                      "protocols": sorted({w["transfer_protocol"]
                                           for w in stats["workers"].values()})}), flush=True)
    for _ in it:  # reading when it is killed
        pass
    """
)


@pytest.mark.timeout(120)
def test_killing_the_trainer_takes_its_workers_and_shared_memory_along() -> None:
    """C-23: SIGKILL a trainer that owns LocalCluster(2) and is reading: the
    dispatcher and worker processes are gone within 5 s, and no /dev/shm entry
    of ours is left (rings are memfds; none should ever appear there)."""
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAINER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=server_env(),
    )
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        info = json.loads(line)
        pids = info["pids"]
        assert len(pids) == 3 and not any(gone(p) for p in pids)
        shm_while_reading = _our_shm() - shm_before
        proc.kill()
        proc.wait(10)
        took = wait_until(lambda: all(gone(p) for p in pids), 5.0, f"servers {pids} to exit")
        leftover = _our_shm() - shm_before
        report(
            f"trainer SIGKILLed while reading over {info['protocols']}: its 3 server processes "
            f"gone {took:.2f} s later; /dev/shm entries of ours while reading: "
            f"{sorted(shm_while_reading)}, after: {sorted(leftover)}"
        )
        assert leftover == set()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _epochs(num_epochs: int, seed: int) -> None:
    """C-21: a fresh iterator every epoch over LocalCluster(2), OFF or DYNAMIC
    (anonymous jobs), read to the end (exact elements checked), broken out of
    early and closed, broken out of early and abandoned (never closed), or
    read by two iterators at once. A per-epoch watchdog (10 s) turns a
    deadlock into a failure."""
    rng = random.Random(seed)
    n = 30
    with ds.LocalCluster(2, worker_options={"heartbeat_interval_ms": 100}) as cluster:
        datasets = {
            mode: ds.Dataset.range(n).apply(ds.distribute(mode, cluster.target))
            for mode in (ds.ShardingPolicy.OFF, ds.ShardingPolicy.DYNAMIC)
        }
        expected = {
            ds.ShardingPolicy.OFF: sorted(2 * list(range(n))),
            ds.ShardingPolicy.DYNAMIC: list(range(n)),
        }
        durations = []
        for epoch in range(num_epochs):
            mode = rng.choice(list(datasets))
            kind = rng.choice(["full", "break-close", "break-abandon", "two-iterators"])
            stop_after = rng.randrange(0, 20)
            dataset = datasets[mode]
            outcome: dict = {}

            def run(dataset=dataset, kind=kind, stop_after=stop_after, outcome=outcome) -> None:
                if kind == "full":
                    outcome["got"] = sorted(int(x) for x in dataset)
                elif kind == "two-iterators":
                    a, b = iter(dataset), iter(dataset)
                    first = [int(next(a)) for _ in range(stop_after // 2 + 1)]
                    outcome["got"] = sorted(int(x) for x in b)
                    outcome["first"] = first
                    del a  # abandoned mid-epoch
                else:
                    it = iter(dataset)
                    seen = [int(x) for _, x in zip(range(stop_after + 1), it, strict=False)]
                    outcome["seen"] = seen
                    if kind == "break-close":
                        it.close()
                    else:
                        del it
                        if rng.random() < 0.5:
                            gc.collect()
                outcome["done"] = True

            t0 = time.monotonic()
            thread = threading.Thread(target=run, name=f"epoch-{epoch}", daemon=True)
            thread.start()
            thread.join(10)
            durations.append(time.monotonic() - t0)
            assert not thread.is_alive(), f"epoch {epoch} ({mode.name}, {kind}) hung for 10 s"
            assert outcome.get("done"), f"epoch {epoch} ({mode.name}, {kind}) raised (see above)"
            if "got" in outcome:
                assert outcome["got"] == expected[mode], f"epoch {epoch} ({mode.name}, {kind})"
            if "seen" in outcome:
                assert len(outcome["seen"]) == stop_after + 1
                assert set(outcome["seen"]) <= set(range(n))
        report(
            f"{num_epochs} epochs: longest {max(durations):.2f} s, mean "
            f"{sum(durations) / len(durations):.2f} s"
        )


@pytest.mark.timeout(180)
def test_epochs_with_fresh_abandoned_and_concurrent_iterators_never_hang() -> None:
    _epochs(20, seed=1)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_200_epochs_with_fresh_abandoned_and_concurrent_iterators_never_hang() -> None:
    _epochs(200, seed=2)
