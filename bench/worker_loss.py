"""Worker loss benchmark (not a test), issue 10: how long after a worker's
SIGKILL does a consumer learn of it?

    error   LocalCluster(1, restart_workers=False), the consumer waiting in
            next() on a pipeline that never returns: seconds from the SIGKILL
            to the consumer's WorkerCrashedError (the cluster's monitor sees
            the exit and tells the dispatcher, which fails the iteration).
    epoch   an in-process dispatcher (defaults: 300 s worker timeout) and 2
            `dataservice worker` CLI processes (1 s heartbeats), DYNAMIC over
            range(4000) with a 2 ms map; one worker is SIGKILLed after the
            consumer read 400 elements: seconds from the SIGKILL to the end of
            the epoch (the dispatcher probes the silent worker's port), and
            the elements the consumer reports lost. Also "seen": seconds from
            the SIGKILL to the consumer's stats() listing the lost worker
            (the rest of "epoch" is the survivor finishing the epoch).

Usage: python bench/worker_loss.py [--runs N] [--only error|epoch]
Prints min / median / max of N runs of each.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import dataservice as ds
from dataservice import errors
from dataservice._serverproc import READY_RE
from dataservice.cluster import _child_env


def _block(x):
    time.sleep(3600)
    return x


def _slow(x):
    time.sleep(0.002)
    return x


class _Reader(threading.Thread):
    def __init__(self, it) -> None:
        super().__init__(daemon=True)
        self.it = it
        self.count = 0
        self.error: BaseException | None = None
        self.ended_at = 0.0
        self.start()

    def run(self) -> None:
        try:
            for _ in self.it:
                self.count += 1
        except BaseException as err:  # noqa: BLE001  (reported)
            self.error = err
        self.ended_at = time.monotonic()


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        time.sleep(0.01)


def run_error() -> float:
    with ds.LocalCluster(1, restart_workers=False) as cluster:
        data = ds.Dataset.range(10).map(_block).apply(ds.distribute("off", cluster.target))
        reader = _Reader(iter(data))
        time.sleep(1.0)  # the consumer is in next(), the pipeline blocked
        killed_at = time.monotonic()
        os.kill(cluster.worker_pids[0], signal.SIGKILL)
        reader.join(120)
        if not isinstance(reader.error, errors.WorkerCrashedError):
            raise RuntimeError(f"expected WorkerCrashedError, got {reader.error!r}")
        return reader.ended_at - killed_at


def _start_worker(dispatcher_address: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dataservice",
            "worker",
            "--dispatcher",
            dispatcher_address,
            "--worker-address",
            "127.0.0.1:%port%",
            "--parent-pid",
            str(os.getpid()),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_child_env(),
        start_new_session=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        m = READY_RE.match(line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain
            return proc, m.group(2)
    raise RuntimeError(f"worker exited with code {proc.wait()} before it was ready")


def run_epoch() -> tuple[float, float, int]:
    dispatcher = ds.DispatchServer()
    address = dispatcher.target.removeprefix("grpc://").replace("localhost", "127.0.0.1")
    procs = []
    try:
        procs = [_start_worker(address) for _ in range(2)]
        n = 4000
        data = (
            ds.Dataset.range(n)
            .map(_slow)
            .apply(ds.distribute("distributed_epoch", "grpc://" + address))
        )
        reader = _Reader(iter(data))
        _wait(lambda: reader.count >= 400, 120, "400 elements")
        killed_at = time.monotonic()
        procs[0][0].kill()
        procs[0][0].wait()
        _wait(lambda: reader.it.stats()["lost_workers"], 600, "the loss in stats()")
        seen_at = time.monotonic()
        reader.join(600)
        if reader.error is not None:
            raise RuntimeError(f"the epoch failed: {reader.error!r}")
        lost = reader.it.stats()["lost_workers"]
        elements_lost = sum(e["elements_lost"] or 0 for e in lost)
        return reader.ended_at - killed_at, seen_at - killed_at, elements_lost
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        dispatcher.stop()


def _summary(name: str, values: list[float]) -> str:
    return (
        f"{name:6s} n={len(values)}  min {min(values):.2f} s  "
        f"median {statistics.median(values):.2f} s  max {max(values):.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--only", choices=("error", "epoch"))
    args = parser.parse_args()
    if args.only in (None, "error"):
        times = [run_error() for _ in range(args.runs)]
        print(_summary("error", times), flush=True)
    if args.only in (None, "epoch"):
        results = [run_epoch() for _ in range(args.runs)]
        print(_summary("seen", [s for _, s, _ in results]), flush=True)
        print(_summary("epoch", [t for t, _, _ in results]), flush=True)
        print(f"       elements lost per run: {[lost for _, _, lost in results]}")


if __name__ == "__main__":
    main()
