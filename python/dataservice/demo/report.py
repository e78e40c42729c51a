"""The demo's summary: for each row (in-process, service, DataLoader) images/s and the
share of time the trainer waited for data, printed as a table and, with `--json`, as one
JSON line.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataservice.demo.data import STORED_LONG_SIDE, DemoData
from dataservice.demo.pipeline import CROP_SIZE
from dataservice.demo.training import EpochResult, check_epoch

ROWS = ("in_process", "service", "dataloader")
"""The rows of the summary, in print order (`summary["rows"]`'s keys)."""


@dataclass
class RowRun:
    """One row's epochs; `cluster_start_s` (s) is the LocalCluster's start, service only."""

    epochs: list[EpochResult]
    cluster_start_s: float | None = None


def _row(name: str, run: RowRun, args: argparse.Namespace) -> dict[str, Any]:
    images = sum(r.images for r in run.epochs)
    wall_s = sum(r.wall_s for r in run.epochs)
    wait_s = sum(r.wait_s for r in run.epochs)
    row: dict[str, Any] = {
        "images": images,
        "epochs": len(run.epochs),
        "batches": sum(r.batches for r in run.epochs),
        "wall_s": wall_s,
        "wait_s": wait_s,
        "images_per_second": images / wall_s if wall_s > 0 else 0.0,
        "wait_fraction": min(1.0, wait_s / wall_s) if wall_s > 0 else 0.0,
        "records_per_epoch": [int(r.index_counts.sum()) for r in run.epochs],
        "exactly_once": all(check_epoch(0, r.index_counts) is None for r in run.epochs),
        "loss_per_epoch": [float(np.mean(r.losses)) if r.losses else math.nan for r in run.epochs],
    }
    if name == "dataloader":
        row["num_workers"] = args.workers
    if name == "service":
        per_worker: dict[str, int] = {}
        transports: set[str] = set()
        client_wait_ms = 0.0
        bytes_read = 0
        for r in run.epochs:
            if not r.stats:
                continue
            client_wait_ms += float(r.stats.get("wait_ms", 0.0))
            bytes_read += int(r.stats.get("bytes", 0))
            for address, w in r.stats.get("workers", {}).items():
                per_worker[address] = per_worker.get(address, 0) + int(w.get("elements", 0))
                if w.get("elements", 0) and w.get("transfer_protocol"):
                    transports.add(str(w["transfer_protocol"]))
        row.update(
            workers=args.workers,
            cluster_start_s=run.cluster_start_s,
            transport="+".join(sorted(transports)) if transports else "unknown",
            elements_per_worker=per_worker,
            bytes=bytes_read,
            client_wait_ms=client_wait_ms,
        )
    return row


def summarize(
    args: argparse.Namespace,
    data: DemoData,
    runs: dict[str, RowRun],
    dataloader_skipped: str | None,
    load_average_before: float | None = None,
) -> dict[str, Any]:
    """The run's figures as a JSON-ready dict (what `--json` prints).

    `rows` maps each name of `ROWS` that ran to its figures: `images` (all epochs),
    `images_per_second` (images over `wall_s`, the epochs' time from `iter()` to the end of
    the data, training included), `wait_s` (time in `iter()` and `next()`), `wait_fraction`
    (`wait_s / wall_s`, in [0, 1]), `records_per_epoch`, `exactly_once`, `loss_per_epoch`;
    the service's also `workers`, `cluster_start_s`, `transport`, `elements_per_worker`
    (batches), `bytes` and `client_wait_ms` (its iterators' own `stats()["wait_ms"]`).
    `speedup` is each row's images/s over the in-process row's. `load_average_before` is
    the machine's 1-minute load average when the rows started: other work running then
    takes CPU from the rows.
    """
    rows = {name: _row(name, runs[name], args) for name in ROWS if name in runs}
    base = rows.get("in_process", {}).get("images_per_second", 0.0)
    speedup = {
        name: (row["images_per_second"] / base if base > 0 else None) for name, row in rows.items()
    }
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 0
    return {
        "rows": rows,
        "speedup": speedup,
        "dataloader_skipped": dataloader_skipped,
        "exactly_once": all(row["exactly_once"] for row in rows.values()),
        "epochs": args.epochs,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "image_size": CROP_SIZE,
        "stored_long_side": STORED_LONG_SIDE,
        "cpus": cpus,
        "load_average_before": load_average_before,
        "num_records": data.num_records,
        "num_classes": data.num_classes,
        "data_dir": data.data_dir,
    }


def _describe(name: str, s: dict[str, Any]) -> tuple[str, str]:
    """(label, what the row is) for the table."""
    workers = s["workers"]
    if name == "in_process":
        return "in-process", "the pipeline and the training step take turns in this process"
    if name == "service":
        transport = s["rows"][name]["transport"]
        return (
            f"service, {workers} workers",
            f"{workers} worker processes (LocalCluster) make the batches while this process "
            f"trains ({transport} transport)",
        )
    return (
        f"DataLoader, {workers} workers",
        f"torch.utils.data.DataLoader(num_workers={workers}) runs the same decode code",
    )


def failures_of(s: dict[str, Any]) -> list[str]:
    """A message per row that did not read each record exactly once per epoch."""
    out = []
    for name, row in s["rows"].items():
        if not row["exactly_once"]:
            out.append(
                f"{name}: records read per epoch {row['records_per_epoch']}, expected each of "
                f"the {s['num_records']} records once per epoch"
            )
    return out


def print_summary(s: dict[str, Any]) -> list[str]:
    """Prints `summarize`'s dict as a table on stdout, then one PASSED line or a FAILED line
    per failure; returns the failures (`failures_of`)."""
    lines = [
        "",
        "dataservice demo summary",
        f"  dataset      {s['num_records']} full-size JPEGs (long side {s['stored_long_side']} "
        f"px), {s['num_classes']} classes, in {s['data_dir']}",
        f"  each row     {s['epochs']} epochs of batches of {s['batch_size']}: decode (Pillow), "
        f"RandomResizedCrop {s['image_size']}, flip;",
        f"               an SGD step of a numpy MLP per batch, on one thread; {s['cpus']} CPUs",
        f"  {'row':<24}{'images/s':>9}   {'trainer waited':<22}{'speedup':>7}",
    ]
    legend = []
    for name in ROWS:
        if name not in s["rows"]:
            continue
        row = s["rows"][name]
        label, what = _describe(name, s)
        waited = f"{row['wait_fraction']:4.0%} ({row['wait_s']:.1f} of {row['wall_s']:.1f} s)"
        speedup = s["speedup"].get(name)
        ratio = f"{speedup:.2f}x" if speedup is not None else "-"
        lines.append(f"  {label:<24}{row['images_per_second']:9.1f}   {waited:<22}{ratio:>7}")
        legend.append(f"    {label.split(',')[0]}: {what}")
    if s["dataloader_skipped"]:
        lines.append(f"  {'DataLoader':<24}{'-':>9}   left out: {s['dataloader_skipped']}")
    lines += legend
    lines += [
        "    trainer waited: the share of the row's time spent in iter() and next(), waiting",
        "      for a batch; the rest of the time is the training step",
        "    speedup: images/s over the in-process row's",
    ]
    service = s["rows"].get("service")
    if service is not None:
        lines.append(
            "  per worker   "
            + (
                ", ".join(
                    f"{a}: {n} batches" for a, n in sorted(service["elements_per_worker"].items())
                )
                or "(no stats)"
            )
            + f"; cluster started in {service['cluster_start_s']:.1f} s (not counted)"
        )
    losses = "; ".join(
        f"{_describe(name, s)[0].split(',')[0]} "
        + " -> ".join(f"{v:.2f}" for v in s["rows"][name]["loss_per_epoch"])
        for name in ROWS
        if name in s["rows"]
    )
    lines.append(f"  loss/epoch   {losses}")
    load = s.get("load_average_before")
    if load is not None and s["cpus"] and load > 0.5 * s["cpus"]:
        lines.append(
            f"  note         other work was running (load average {load:.1f} on {s['cpus']} "
            "CPUs):\n               it takes CPU from the rows, so their images/s are lower "
            "and noisier"
        )
    for line in lines:
        print(line)
    failures = failures_of(s)
    if failures:
        for f in failures:
            print(f"dataservice demo: FAILED: {f}")
    else:
        print(
            "dataservice demo: PASSED: each row read every record exactly once per epoch "
            "(the service by DYNAMIC sharding)"
        )
    sys.stdout.flush()
    return failures
