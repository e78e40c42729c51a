"""Cross-trainer cache benchmark (not a test), issue 4.

Three trainers read a pipeline with an expensive map (~2 ms of CPU per
element, 64 KiB float32 elements) from one worker process, 2,000 elements each
(`repeat()` before `distribute`, `take()` after it), in two ways:

    cache        one named job read through `CrossTrainerCache(trainer_id)`:
                 the worker runs the pipeline once for all three and writes
                 each element once into the window's shared-memory segment,
                 which every trainer maps (large leaves are views of it)
    independent  three anonymous jobs: the worker runs it three times, and
                 each trainer reads through a 64 MiB ring of its own

For each: wall time, worker CPU seconds (psutil `cpu_times` of the worker
process, user + system), the worker's peak and final resident bytes (sampled
every 20 ms), trainer throughput, and whether the trainers saw the same
elements. Each way runs on a fresh `LocalCluster(1)`. Prints a table and
writes JSON to bench/results/. RSS counts the shared segment's pages the
worker maps (its own writes), so "cache" shows about one copy of the window.

One run on the 2-core development VM (2,000 elements x 3 trainers, 2 ms CPU
each, 32 MiB cache; RSS as growth over the idle worker):

    way          wall s  worker CPU s  RSS peak MiB  RSS end MiB
    cache           5.9           5.0           +48          +33
    independent    15.6          14.5          +197          +47

The cache's end figure is its 32 MiB segment; the peak is the moment it grew
from 16 to 32 MiB (both mapped while the window is copied over). On a busier
machine the trainers fell behind the pipeline and the task's runner buffered up
to 64 MiB ahead of the cache (other runs: 6.9 CPU s / +89 MiB, 7.3 / +100;
see docs/transport-notes.md); a cached task's runner now buffers a quarter of
the cache bound (8 MiB here): 5.0 CPU s, +46 / +45 MiB vs 14.4 s, +199 / +64
MiB independent, on a quiet machine. Before the
window was one segment (each same-host trainer read the cache through its own
64 MiB ring): cache 5.3 CPU s, RSS peak +227 MiB.

Usage:
    python bench/cross_trainer.py [--elements 2000] [--trainers 3] [--ms 2.0]
        [--cache-bytes 33554432] [--json bench/results/cross_trainer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Any

import numpy as np
import psutil

import dataservice as ds

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def expensive_pipeline(cpu_ms: float) -> ds.Dataset:
    def work(i: Any) -> np.ndarray:
        end = time.thread_time() + cpu_ms / 1000  # burn CPU, not wall time
        while time.thread_time() < end:
            pass
        return np.full(16384, i, np.float32)  # 64 KiB

    return ds.Dataset.range(10**9).map(work).repeat()


class Sampler:
    """Samples a process's RSS every 20 ms in a thread; keeps the peak."""

    def __init__(self, pid: int) -> None:
        self._proc = psutil.Process(pid)
        self._stop = threading.Event()
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self._proc.memory_info().rss


def run(way: str, args: argparse.Namespace) -> dict[str, Any]:
    options = {"cross_trainer_cache_size_bytes": args.cache_bytes}
    with ds.LocalCluster(1, worker_options=options) as cluster:
        worker = psutil.Process(cluster.worker_pids[0])
        pipeline = expensive_pipeline(args.ms)
        datasets = []
        for t in range(args.trainers):
            if way == "cache":
                apply = ds.distribute(
                    ds.ShardingPolicy.OFF,
                    cluster.target,
                    job_name="cross-trainer-bench",
                    cross_trainer_cache=ds.CrossTrainerCache(f"trainer-{t}"),
                )
            else:
                apply = ds.distribute(ds.ShardingPolicy.OFF, cluster.target)
            datasets.append(pipeline.apply(apply).take(args.elements))
        got: list[list[float]] = [[] for _ in datasets]
        seconds: list[float] = [0.0 for _ in datasets]
        errors: list[BaseException] = []

        def trainer(t: int) -> None:
            try:
                start = time.perf_counter()
                got[t] = [float(e[0]) for e in datasets[t]]
                seconds[t] = time.perf_counter() - start
            except BaseException as err:  # reported below
                errors.append(err)

        rss_before = worker.memory_info().rss
        cpu_before = worker.cpu_times()
        sampler = Sampler(worker.pid)
        start = time.perf_counter()
        threads = [threading.Thread(target=trainer, args=(t,)) for t in range(args.trainers)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - start
        cpu_after = worker.cpu_times()
        rss_end = sampler.stop()
    if errors:
        raise errors[0]
    cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    return {
        "way": way,
        "wall_s": wall,
        "worker_cpu_s": cpu,
        "worker_rss_before_bytes": rss_before,
        "worker_rss_peak_bytes": sampler.peak,
        "worker_rss_end_bytes": rss_end,
        "elements_per_trainer": [len(g) for g in got],
        "trainer_elements_per_s": [len(g) / s for g, s in zip(got, seconds, strict=True)],
        "trainers_saw_same_elements": all(g == got[0] for g in got),
        "distinct_elements_across_trainers": len({x for g in got for x in g}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=2000, help="per trainer")
    parser.add_argument("--trainers", type=int, default=3)
    parser.add_argument("--ms", type=float, default=2.0, help="CPU ms per element")
    parser.add_argument("--cache-bytes", type=int, default=32 << 20)
    parser.add_argument("--json", default=os.path.join(RESULTS, "cross_trainer.json"))
    args = parser.parse_args()

    rows = [run("cache", args), run("independent", args)]
    mib = 1 << 20
    print(
        f"{args.trainers} trainers x {args.elements} elements, {args.ms} ms CPU/element, "
        f"64 KiB elements, cache {args.cache_bytes / mib:.0f} MiB, 1 worker process"
    )
    header = (
        f"{'way':<12} {'wall s':>7} {'worker CPU s':>13} {'RSS peak MiB':>13} "
        f"{'RSS end MiB':>12} {'el/s/trainer':>13} {'same':>5} {'distinct':>9}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['way']:<12} {r['wall_s']:>7.1f} {r['worker_cpu_s']:>13.1f} "
            f"{(r['worker_rss_peak_bytes'] - r['worker_rss_before_bytes']) / mib:>+13.0f} "
            f"{(r['worker_rss_end_bytes'] - r['worker_rss_before_bytes']) / mib:>+12.0f} "
            f"{min(r['trainer_elements_per_s']):>13.0f} "
            f"{'yes' if r['trainers_saw_same_elements'] else 'no':>5} "
            f"{r['distinct_elements_across_trainers']:>9}"
        )
    cache, independent = rows
    ratio = independent["worker_cpu_s"] / max(cache["worker_cpu_s"], 1e-9)
    print(
        f"(RSS columns are growth over the idle worker) worker CPU independent/cache: {ratio:.2f}x"
    )
    result = {"args": vars(args), "runs": rows, "worker_cpu_ratio_independent_over_cache": ratio}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
