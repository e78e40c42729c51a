"""First-element latency benchmark (not a test): how long a NEW iterator of a
distributed dataset takes to hand out its first element on a warm
`LocalCluster` (dispatcher and worker processes running), issue 13's target
being 20 ms (PyTorch's DataLoader takes 20-40 ms for its first batch).

Cases: scalars (int64[] from `Dataset.range`) and images (uint8[224, 224, 3],
150 KB, from a cheap map) x 1 and 2 workers x shared memory ("shm", the
same-host default) and gRPC x ShardingPolicy OFF and DYNAMIC x an anonymous
and a named job (`job_name`), each in two situations:

    warm  the same distributed dataset, one iterator already read from it:
          each timed sample is `next(iter(dataset))`
    new   a dataset not distributed before (its own fingerprint): each timed
          sample is `distribute` + `next(iter(dataset))` (registration included)

Each sample closes its iterator before the next one starts (not counted in
either situation: the figure is the wait for the first element). Prints median and
p90 (ms) per case with the target next to them, and, when torch imports,
DataLoader(num_workers=1/2, batch_size=None) first-batch latency on the same
elements. Writes JSON (default bench/results/first_element.json).

Usage:
    python bench/first_element.py [--samples 15] [--workers 1,2]
        [--only scalars,images] [--protocols shm,grpc] [--modes OFF,DYNAMIC]
        [--jobs anon,named] [--situations warm,new] [--json PATH] [--no-torch]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

TARGET_MS = 20.0
_N = 1 << 40  # the datasets never end within a sample


def _image(i: Any) -> Any:
    return np.full((224, 224, 3), int(i) % 256, np.uint8)


def _source(workload: str, salt: int) -> Any:
    import dataservice as ds

    # `salt` changes the dataset's fingerprint (a new dataset id), not its elements.
    source = ds.Dataset.range(salt, _N)
    if workload == "images":
        source = source.map(_image)
    return source


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _summary(samples_ms: list[float]) -> dict[str, Any]:
    return {
        "median_ms": round(statistics.median(samples_ms), 2),
        "p90_ms": round(_percentile(samples_ms, 0.9), 2),
        "min_ms": round(min(samples_ms), 2),
        "samples_ms": [round(s, 2) for s in samples_ms],
    }


def _first_element_ms(dataset: Any, start: float | None = None) -> float:
    """ms from `start` (default: now) to the first element of a new iterator of
    `dataset`; the iterator's close() after it is not counted."""
    if start is None:
        start = time.perf_counter()
    it = iter(dataset)
    next(it)
    elapsed = (time.perf_counter() - start) * 1000
    it.close()
    return elapsed


def _run_case(
    cluster: Any, workload: str, protocol: str, mode: str, job: str, situation: str, samples: int
) -> tuple[list[float], dict[str, Any]]:
    import dataservice as ds

    policy = getattr(ds.ShardingPolicy, mode)
    salt_base = (hash((workload, protocol, mode, job, situation)) % 1000) * 10_000
    case_id = f"{workload}-{protocol}-{mode}-{job}-{situation}-{os.getpid()}-{time.time_ns()}"

    def make(salt: int) -> Any:
        return _source(workload, salt_base + salt).apply(
            ds.distribute(
                policy,
                cluster.target,
                # (a job name belongs to one dataset: each new dataset gets its own)
                job_name=f"{case_id}-{salt}" if job == "named" else None,
                data_transfer_protocol=protocol if protocol == "grpc" else None,
            )
        )

    times: list[float] = []
    transports: dict[str, Any] = {}
    if situation == "warm":
        dataset = make(0)
        _first_element_ms(dataset)  # the previous iterator: dataset and workers warm
        for _ in range(samples):
            times.append(_first_element_ms(dataset))
        it = iter(dataset)
        next(it)
        transports = {w: s["transfer_protocol"] for w, s in it.stats()["workers"].items()}
        it.close()
    else:
        _first_element_ms(make(samples + 1))  # this code path warm in this process
        for k in range(samples):
            start = time.perf_counter()
            times.append(_first_element_ms(make(k + 1), start))
    return times, transports


class _TorchSource:
    def __init__(self, workload: str) -> None:
        self.workload = workload

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> Any:
        return _image(i) if self.workload == "images" else np.int64(i)


def _torch_case(workload: str, workers: int, samples: int) -> list[float] | None:
    try:
        import torch.utils.data as tud
    except ImportError:
        return None
    loader = tud.DataLoader(_TorchSource(workload), batch_size=None, num_workers=workers)
    times = []
    for _ in range(samples + 1):
        start = time.perf_counter()
        it = iter(loader)
        next(it)
        times.append((time.perf_counter() - start) * 1000)
        del it
    return times[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--only", default="scalars,images")
    parser.add_argument("--protocols", default="shm,grpc")
    parser.add_argument("--modes", default="OFF,DYNAMIC")
    parser.add_argument("--jobs", default="anon,named")
    parser.add_argument("--situations", default="warm,new")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument(
        "--json",
        default=os.path.join(os.path.dirname(__file__), "results", "first_element.json"),
    )
    args = parser.parse_args(argv)
    import dataservice as ds

    results: dict[str, Any] = {"target_ms": TARGET_MS, "cases": [], "torch": []}
    header = (
        f"{'workload':8} {'w':>1} {'proto':5} {'mode':7} {'job':5} {'situation':9} "
        f"{'median':>8} {'p90':>8} {'target':>7}  {'DataLoader':>10}"
    )
    torch_medians: dict[tuple[str, int], float | None] = {}
    for workers in [int(w) for w in args.workers.split(",")]:
        if not args.no_torch:
            for workload in args.only.split(","):
                t = _torch_case(workload, workers, args.samples)
                torch_medians[(workload, workers)] = statistics.median(t) if t else None
                if t:
                    results["torch"].append(
                        {"workload": workload, "workers": workers, **_summary(t)}
                    )
        print(f"\n{workers} worker(s)")
        print(header)
        with ds.LocalCluster(num_workers=workers) as cluster:
            for workload, protocol, mode, job, situation in itertools.product(
                args.only.split(","),
                args.protocols.split(","),
                args.modes.split(","),
                args.jobs.split(","),
                args.situations.split(","),
            ):
                times, transports = _run_case(
                    cluster, workload, protocol, mode, job, situation, args.samples
                )
                summary = _summary(times)
                torch_ms = torch_medians.get((workload, workers))
                print(
                    f"{workload:8} {workers:>1} {protocol:5} {mode:7} {job:5} {situation:9} "
                    f"{summary['median_ms']:8.1f} {summary['p90_ms']:8.1f} {TARGET_MS:7.0f}  "
                    + (f"{torch_ms:10.1f}" if torch_ms is not None else f"{'-':>10}"),
                    flush=True,
                )
                results["cases"].append(
                    {
                        "workload": workload,
                        "workers": workers,
                        "protocol": protocol,
                        "mode": mode,
                        "job": job,
                        "situation": situation,
                        "transports": transports,
                        **summary,
                    }
                )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
