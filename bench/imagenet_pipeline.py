"""ImageNet input-pipeline benchmark (not a test): `dataservice demo`'s pipeline and
training step, run three ways in one process, one after the other:

    in_process   the pipeline and the training step take turns in this process
    dataloader   torch.utils.data.DataLoader(num_workers=--workers), the same decode code
                 (only when torch imports)
    service      LocalCluster(num_workers=--workers), distribute(DYNAMIC)
    service_torch  the same service read through
                 DataLoader(dataservice.torch.ServiceDataset(...), batch_size=None), as a
                 PyTorch trainer would (only when torch imports)

The pipeline reads the demo's TFRecord shards of full-size JPEGs (long side 500 px),
decodes them with Pillow, applies torchvision's RandomResizedCrop(224) and a random flip
and batches uint8 images; the training step is the demo's numpy MLP on one BLAS thread.

Usage:
    python bench/imagenet_pipeline.py [--epochs 2] [--workers 2] [--batch-size 64]
        [--num-records 2048] [--data-dir DIR] [--repeat 1] [--only in_process,service]
        [--no-train] [--json bench/results/imagenet_pipeline.json]

For each way: images/s (images over the epochs' time, from `iter()` to the end of the
data, training included) and the share of that time the trainer waited in `iter()` and
`next()`. Each way runs `--repeat` times and its fastest run counts (the others are in the
JSON). The in-process and DataLoader runs go first: forking DataLoader workers after gRPC
has started its threads in this process is not safe.

On a machine shared with other work, wall-clock figures are noisy, so each run also counts
the CPU time of every process taking part (this one, the DataLoader's workers, the
service's workers and dispatcher) and derives `cpu_bound_images_per_second`: the rate
that work allows on `cpus` idle cores, min(cpus / CPU s per image, 1 / the trainer
process's CPU s per image), ignoring scheduling losses. It is an upper bound, not a
measurement; compare it with `images_per_second` to see what other load took.

To measure on a busy machine anyway, run it in a session of its own with a raised Linux
autogroup priority (`setsid bash -c 'echo -10 > /proc/self/autogroup; exec python
bench/imagenet_pipeline.py'`, as root): with autogroup scheduling a session's processes
share one CPU share, whatever their number. LocalCluster starts each server in a session
of its own, so this script gives the service's processes its own autogroup nice value
(recorded as `autogroup_nice`); the DataLoader's workers inherit it.

Writes JSON (default bench/results/imagenet_pipeline.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import psutil

import dataservice as ds
from dataservice.demo.data import DEFAULT_DATA_DIR, DEFAULT_NUM_RECORDS, ensure_dataset
from dataservice.demo.pipeline import CROP_SIZE, make_pipeline
from dataservice.demo.training import (
    POOL,
    MLPClassifier,
    Progress,
    check_epoch,
    one_blas_thread,
    run_epoch,
)

WAYS = ("in_process", "service", "service_torch", "dataloader")


class _NoTraining(MLPClassifier):
    """--no-train: the same iterator loop, no model step (input alone)."""

    def step(self, images: np.ndarray, labels: np.ndarray) -> float:
        return 0.0


def _cpu_s(pids: Iterable[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[pid] = t.user + t.system
    return out


def _timed_run(
    iterable: Iterable[Any],
    args: argparse.Namespace,
    num_classes: int,
    num_records: int,
    helper_pids: Callable[[], list[int]],
) -> dict[str, Any]:
    """Trains a fresh model for `args.epochs` epochs on `iterable`; returns the figures.

    `helper_pids` names the processes besides this one that do the run's work; it is
    called before and after (processes that appear during the run count from zero).
    """
    model_cls = _NoTraining if args.no_train else MLPClassifier
    model = model_cls((CROP_SIZE // POOL) ** 2 * 3, num_classes)
    me = psutil.Process()
    before_self = sum(me.cpu_times()[:2])
    before = _cpu_s(helper_pids())
    epochs = []
    for _ in range(args.epochs):
        progress = Progress(num_records, "", enabled=False)
        epochs.append(run_epoch(iterable, model, num_records, progress, None))
    trainer_cpu_s = sum(me.cpu_times()[:2]) - before_self
    after = _cpu_s(helper_pids())
    helpers_cpu_s = sum(v - before.get(pid, 0.0) for pid, v in after.items())
    images = sum(e.images for e in epochs)
    wall_s = sum(e.wall_s for e in epochs)
    wait_s = sum(e.wait_s for e in epochs)
    cpu_per_image_s = (trainer_cpu_s + helpers_cpu_s) / images
    return {
        "images": images,
        "wall_s": wall_s,
        "wait_s": wait_s,
        "images_per_second": images / wall_s,
        "wait_fraction": min(1.0, wait_s / wall_s),
        "exactly_once": all(check_epoch(0, e.index_counts) is None for e in epochs),
        "trainer_cpu_s": trainer_cpu_s,
        "helpers_cpu_s": helpers_cpu_s,
        "cpu_ms_per_image": 1e3 * cpu_per_image_s,
        "trainer_cpu_ms_per_image": 1e3 * trainer_cpu_s / images,
        "cpu_bound_images_per_second": min(
            args.cpus / cpu_per_image_s, images / trainer_cpu_s if trainer_cpu_s > 0 else np.inf
        ),
        "loadavg_1min_after": os.getloadavg()[0],
    }


def _autogroup_nice() -> int | None:
    """This process's Linux autogroup nice value, or None without autogroup scheduling."""
    try:
        with open("/proc/self/autogroup") as f:
            return int(f.read().split("nice")[1])
    except (OSError, IndexError, ValueError):
        return None


def _set_autogroup_nice(pids: list[int], nice: int) -> None:
    """Gives the sessions of `pids` the autogroup nice value `nice` (root, Linux)."""
    for pid in pids:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = dict(max(runs, key=lambda r: r["images_per_second"]))
    best["runs_images_per_second"] = [r["images_per_second"] for r in runs]
    best["runs_wait_fraction"] = [r["wait_fraction"] for r in runs]
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-records", type=int, default=DEFAULT_NUM_RECORDS)
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only", default=",".join(WAYS), help="comma-separated ways")
    parser.add_argument("--no-train", action="store_true", help="skip the model step")
    parser.add_argument("--json", default="bench/results/imagenet_pipeline.json")
    args = parser.parse_args()
    args.cpus = len(os.sched_getaffinity(0))
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(only) - set(WAYS))
    if unknown:
        parser.error(f"--only: unknown ways {unknown}; choose from {list(WAYS)}")

    data = ensure_dataset(
        args.data_dir, args.num_records, log=lambda m: print(m, file=sys.stderr, flush=True)
    )
    pipeline = make_pipeline(data, args.batch_size)
    results: dict[str, Any] = {}
    notes: dict[str, str] = {}
    loadavg_before = os.getloadavg()
    autogroup_nice = _autogroup_nice()
    t_start = time.monotonic()

    def report(way: str, r: dict[str, Any]) -> None:
        print(
            f"  {way:<13} {r['images_per_second']:7.1f} images/s, trainer waited "
            f"{r['wait_fraction']:.0%}, CPU {r['cpu_ms_per_image']:.2f} ms/image "
            f"(trainer {r['trainer_cpu_ms_per_image']:.2f}), load {r['loadavg_1min_after']:.1f}",
            file=sys.stderr,
            flush=True,
        )

    with one_blas_thread():
        if "in_process" in only:
            runs = []
            for _ in range(args.repeat):
                runs.append(
                    _timed_run(pipeline, args, data.num_classes, data.num_records, lambda: [])
                )
                report("in_process", runs[-1])
            results["in_process"] = _best(runs)

        if "dataloader" in only:
            try:
                from dataservice.demo.torch_loader import make_dataloader
            except ImportError as e:
                notes["dataloader"] = f"left out: torch does not import ({e})"
            else:
                me = psutil.Process()
                runs = []
                for _ in range(args.repeat):
                    loader = make_dataloader(data, args.batch_size, args.workers)
                    runs.append(
                        _timed_run(
                            loader,
                            args,
                            data.num_classes,
                            data.num_records,
                            lambda: [p.pid for p in me.children(recursive=True)],
                        )
                    )
                    del loader  # ends its persistent workers
                    report("dataloader", runs[-1])
                results["dataloader"] = _best(runs)

        if "service" in only or "service_torch" in only:
            t0 = time.monotonic()
            with ds.LocalCluster(num_workers=args.workers) as cluster:
                start_s = time.monotonic() - t0
                if autogroup_nice:
                    _set_autogroup_nice(
                        [cluster.dispatcher_pid, *cluster.worker_pids], autogroup_nice
                    )
                runs = []
                for r in range(args.repeat if "service" in only else 0):
                    distributed = pipeline.apply(
                        ds.distribute(
                            ds.ShardingPolicy.DYNAMIC,
                            cluster.target,
                            job_name=f"imagenet-bench-{os.getpid()}-{r}",
                        )
                    )
                    runs.append(
                        _timed_run(
                            distributed,
                            args,
                            data.num_classes,
                            data.num_records,
                            lambda: [cluster.dispatcher_pid, *cluster.worker_pids],
                        )
                    )
                    report("service", runs[-1])
                if "service_torch" in only:
                    try:
                        import torch.utils.data

                        from dataservice.torch import ServiceDataset
                    except ImportError as e:
                        notes["service_torch"] = (
                            f"left out: dataservice.torch does not import ({e})"
                        )
                    else:
                        torch_runs = []
                        for r in range(args.repeat):
                            distributed = pipeline.apply(
                                ds.distribute(
                                    ds.ShardingPolicy.DYNAMIC,
                                    cluster.target,
                                    job_name=f"imagenet-bench-torch-{os.getpid()}-{r}",
                                )
                            )
                            loader = torch.utils.data.DataLoader(
                                ServiceDataset(distributed), batch_size=None
                            )
                            torch_runs.append(
                                _timed_run(
                                    loader,
                                    args,
                                    data.num_classes,
                                    data.num_records,
                                    lambda: [cluster.dispatcher_pid, *cluster.worker_pids],
                                )
                            )
                            report("service_torch", torch_runs[-1])
                        results["service_torch"] = _best(torch_runs)
                        results["service_torch"]["cluster_start_s"] = start_s
            if runs:
                results["service"] = _best(runs)
                results["service"]["cluster_start_s"] = start_s

    base = results.get("in_process", {}).get("images_per_second")
    base_cpu = results.get("in_process", {}).get("cpu_bound_images_per_second")
    for r in results.values():
        r["speedup"] = r["images_per_second"] / base if base else None
        r["cpu_bound_speedup"] = r["cpu_bound_images_per_second"] / base_cpu if base_cpu else None

    out = {
        "benchmark": "imagenet_pipeline",
        "ways": results,
        "notes": notes,
        "config": {
            "epochs": args.epochs,
            "workers": args.workers,
            "batch_size": args.batch_size,
            "num_records": data.num_records,
            "repeat": args.repeat,
            "train": not args.no_train,
            "cpus": args.cpus,
            "image_size": CROP_SIZE,
            "autogroup_nice": autogroup_nice,
        },
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "total_s": time.monotonic() - t_start,
    }
    print(
        f"\nImageNet pipeline, {data.num_records} records x {args.epochs} epochs, "
        f"batch {args.batch_size}, {args.workers} workers, {args.cpus} CPUs "
        f"(load average before {loadavg_before[0]:.1f}, after {os.getloadavg()[0]:.1f})"
    )
    print(
        f"  {'way':<13} {'images/s':>9} {'speedup':>8} {'waited':>7} {'CPU ms/img':>11} "
        f"{'CPU-bound img/s':>16} {'speedup':>8}"
    )
    for way in WAYS:
        if way in results:
            r = results[way]
            print(
                f"  {way:<13} {r['images_per_second']:9.1f} {r['speedup']:7.2f}x "
                f"{r['wait_fraction']:7.0%} {r['cpu_ms_per_image']:11.2f} "
                f"{r['cpu_bound_images_per_second']:16.1f} {r['cpu_bound_speedup']:7.2f}x"
            )
        elif way in notes:
            print(f"  {way:<13} {notes[way]}")
    if not all(r["exactly_once"] for r in results.values()):
        print("FAILED: a way did not read every record exactly once per epoch")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"wrote {args.json}")
    return 0 if all(r["exactly_once"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
