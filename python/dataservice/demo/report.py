"""The demo's summary: figures gathered from each epoch's iterator stats, printed as a table
and, with `--json`, as one JSON line.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import numpy as np

from dataservice.demo.data import DemoData
from dataservice.demo.training import EpochResult, check_epoch


def summarize(
    args: argparse.Namespace,
    data: DemoData,
    epochs: list[EpochResult],
    wall_s: float,
    local: EpochResult,
    in_process_s: float,
) -> dict[str, Any]:
    """The run's figures as a JSON-ready dict (what `--json` prints).

    Args:
        epochs: the epochs run through the service; `wall_s` (s) is their total time.
        local: the one epoch run in-process, which took `in_process_s` (s).
    """
    per_worker: dict[str, int] = {}
    transports: set[str] = set()
    wait_ms = 0.0
    bytes_read = 0
    for r in epochs:
        if not r.stats:
            continue
        wait_ms += float(r.stats.get("wait_ms", 0.0))
        bytes_read += int(r.stats.get("bytes", 0))
        for address, w in r.stats.get("workers", {}).items():
            per_worker[address] = per_worker.get(address, 0) + int(w.get("elements", 0))
            if w.get("elements", 0) and w.get("transfer_protocol"):
                transports.add(str(w["transfer_protocol"]))
    images = sum(r.images for r in epochs)
    loss_per_epoch = [float(np.mean(r.losses)) if r.losses else math.nan for r in epochs]
    return {
        "images_per_second": images / wall_s if wall_s > 0 else 0.0,
        "in_process_images_per_second": local.images / in_process_s if in_process_s > 0 else 0.0,
        "in_process_measured_on": f"1 epoch ({local.batches} batches, {local.images} images)",
        "epochs": len(epochs),
        "batches": sum(r.batches for r in epochs),
        "images": images,
        "wall_s": wall_s,
        "wait_ms": wait_ms,
        "bytes": bytes_read,
        "transport": "+".join(sorted(transports)) if transports else "unknown",
        "workers": args.workers,
        "batch_size": args.batch_size,
        "records_per_epoch": [int(r.index_counts.sum()) for r in epochs],
        "elements_per_worker": per_worker,
        "loss_per_epoch": loss_per_epoch,
        "num_records": data.num_records,
        "num_classes": data.num_classes,
        "data_dir": data.data_dir,
        "exactly_once": all(check_epoch(0, r.index_counts) is None for r in epochs),
    }


def print_summary(s: dict[str, Any], failures: list[str]) -> None:
    """Prints `summarize`'s dict as a table on stdout, then one PASSED line or a FAILED line
    per entry of `failures`."""
    losses = " -> ".join(f"{v:.3f}" for v in s["loss_per_epoch"])
    lines = [
        "",
        "dataservice demo summary",
        f"  dataset      {s['num_records']} records, {s['num_classes']} classes, "
        f"in {s['data_dir']}",
        f"  epochs       {s['epochs']} ({s['records_per_epoch']} records), "
        f"{s['batches']} batches of up to {s['batch_size']}",
        f"  service      {s['images_per_second']:.1f} images/s over {s['wall_s']:.2f} s "
        f"with {s['workers']} workers, transport {s['transport']}, "
        f"trainer waited {s['wait_ms'] / 1000:.2f} s",
        f"  in-process   {s['in_process_images_per_second']:.1f} images/s "
        f"(no service; {s['in_process_measured_on']}; same training step)",
        "  per worker   "
        + (
            ", ".join(f"{a}: {n} batches" for a, n in sorted(s["elements_per_worker"].items()))
            or "(no stats)"
        ),
        f"  loss/epoch   {losses} (softmax regression on 20x20x3 pooled pixels)",
    ]
    for line in lines:
        print(line)
    if failures:
        for f in failures:
            print(f"dataservice demo: FAILED: {f}")
    else:
        print(
            "dataservice demo: PASSED: every record of each epoch was consumed exactly once "
            "(DYNAMIC sharding)"
        )
    sys.stdout.flush()
