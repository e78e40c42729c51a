"""C-05 benchmark (not a test): the cost of DYNAMIC sharding over OFF.

`register_dataset(range(N))` on a dispatcher with one worker, then read it with
`from_dataset_id` in OFF mode and in DYNAMIC mode, several times each. Prints
elements/s of each (best run), the ratio DYNAMIC / OFF, and the number of
GetSplits RPCs a DYNAMIC epoch made (counted by wrapping the dispatcher's
`_get_splits`; the dispatcher runs in this process, the worker in its own
process unless --in-process-worker). Writes JSON to bench/results/.

Usage:
    python bench/dynamic_vs_off.py [--elements 100000] [--repeats 3]
        [--in-process-worker] [--json bench/results/dynamic_vs_off.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import dataservice as ds

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class SplitCounter:
    """Wraps `DispatchServer._get_splits`: counts RPCs and the splits they carried."""

    def __init__(self, dispatcher: ds.DispatchServer) -> None:
        self._inner = dispatcher._get_splits
        self._mu = threading.Lock()
        self.rpcs = 0
        self.splits = 0
        dispatcher._get_splits = self  # type: ignore[method-assign]

    def __call__(self, request: Any) -> Any:
        response = self._inner(request)
        with self._mu:
            self.rpcs += 1
            self.splits += len(response.int_splits) + len(response.str_splits)
        return response

    def take(self) -> tuple[int, int]:
        with self._mu:
            counts = (self.rpcs, self.splits)
            self.rpcs = self.splits = 0
            return counts


def start_worker_process(dispatcher_address: str) -> subprocess.Popen[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "dataservice", "worker", "--dispatcher", dispatcher_address]
    argv += ["--port", str(port), "--worker-address", f"127.0.0.1:{port}"]
    argv += ["--parent-pid", str(os.getpid())]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the ready line (after registration)
    if not re.match(r"dataservice worker listening on ", line):
        proc.kill()
        raise RuntimeError(f"the worker did not start: {line!r}")
    return proc


def read_epoch(target: str, mode: ds.ShardingPolicy, dataset_id: str, n: int) -> float:
    """Reads one epoch; returns its elements/s. Checks every element came once."""
    start = time.perf_counter()
    count = total = 0
    for x in ds.from_dataset_id(mode, target, dataset_id):
        count += 1
        total += int(x)
    seconds = time.perf_counter() - start
    if count != n or total != n * (n - 1) // 2:
        raise AssertionError(f"{mode.name}: {count} elements, sum {total}; expected range({n})")
    return n / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--in-process-worker", action="store_true")
    parser.add_argument("--json", default=os.path.join(RESULTS, "dynamic_vs_off.json"))
    args = parser.parse_args()
    n = args.elements

    dispatcher = ds.DispatchServer()
    counter = SplitCounter(dispatcher)
    address = dispatcher.target.split("://", 1)[1]
    worker: Any
    if args.in_process_worker:
        worker = ds.WorkerServer(ds.WorkerConfig(address))
        worker.wait_registered(30)
    else:
        worker = start_worker_process(address)
    runs: dict[str, list[float]] = {"OFF": [], "DYNAMIC": []}
    rpcs_per_epoch: list[int] = []
    try:
        dataset_id = ds.register_dataset(dispatcher.target, ds.Dataset.range(n))
        for _ in range(args.repeats):
            for mode in (ds.ShardingPolicy.OFF, ds.ShardingPolicy.DYNAMIC):
                counter.take()
                runs[mode.name].append(read_epoch(dispatcher.target, mode, dataset_id, n))
                rpcs, splits = counter.take()
                if mode == ds.ShardingPolicy.DYNAMIC:
                    assert splits == n, f"{splits} splits handed out for {n} elements"
                    rpcs_per_epoch.append(rpcs)
                else:
                    assert rpcs == 0, f"OFF made {rpcs} GetSplits RPCs"
    finally:
        if args.in_process_worker:
            worker.stop()
        else:
            worker.terminate()
            worker.wait(timeout=10)
        dispatcher.stop()

    off, dynamic = max(runs["OFF"]), max(runs["DYNAMIC"])
    result = {
        "elements": n,
        "repeats": args.repeats,
        "worker": "in-process" if args.in_process_worker else "process",
        "off_elements_per_s": runs["OFF"],
        "dynamic_elements_per_s": runs["DYNAMIC"],
        "off_best": off,
        "dynamic_best": dynamic,
        "dynamic_over_off": dynamic / off,
        "get_splits_rpcs_per_epoch": rpcs_per_epoch,
        "elements_per_get_splits_rpc": n / max(rpcs_per_epoch),
    }
    print(f"range({n}), 1 worker ({result['worker']}), best of {args.repeats}")
    print(f"{'mode':<8} {'elements/s':>12}  runs")
    for name, best in (("OFF", off), ("DYNAMIC", dynamic)):
        print(f"{name:<8} {best:>12,.0f}  {', '.join(f'{r:,.0f}' for r in runs[name])}")
    print(f"DYNAMIC / OFF = {dynamic / off:.2f}")
    print(
        f"GetSplits RPCs per DYNAMIC epoch: {rpcs_per_epoch} "
        f"({n / max(rpcs_per_epoch):,.0f} elements per RPC)"
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
