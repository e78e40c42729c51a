"""What exactly-once DYNAMIC costs (not a test): the same epoch read with the
default (at-most-once) DYNAMIC and with `exactly_once=True`, on a LocalCluster
of two worker processes, one consumer:

    range     `range(N).map(f)`: one element per split, so under exactly_once
              the workers build the pipeline once per element (the worst case)
    files     TFRecord files of 256 records of 1 KiB, `.batch(32)`: one file
              per split, the pipeline built once per file (the usual case)

Usage:
    python bench/exactly_once.py [--quick] [--repeat 3] [--json out.json]

Each row is the fastest of `--repeat` epochs (a first, untimed epoch starts
the workers); prints elements/s of both modes and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import dataservice as ds

DYNAMIC = ds.ShardingPolicy.DYNAMIC


def _double(x):
    return x * 2


def _pipelines(tmp: str, quick: bool) -> dict[str, tuple[Any, int]]:
    n = 5_000 if quick else 20_000
    files = 16 if quick else 64
    paths = []
    for f in range(files):
        path = os.path.join(tmp, f"part-{f:03d}.tfrecord")
        with ds.io.TFRecordWriter(path) as w:
            for r in range(256):
                w.write(bytes([r % 256]) * 1024)
        paths.append(path)
    return {
        "range": (lambda: ds.Dataset.range(n).map(_double), n),
        "files": (lambda: ds.TFRecordDataset(paths).batch(32), files * 256 // 32),
    }


def _epoch_s(cluster: ds.LocalCluster, make: Any, exactly_once: bool, expect: int) -> float:
    dataset = make().apply(ds.distribute(DYNAMIC, cluster.target, exactly_once=exactly_once))
    start = time.perf_counter()
    count = sum(1 for _ in dataset)
    took = time.perf_counter() - start
    if count != expect:
        raise RuntimeError(f"read {count} elements, expected {expect}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller epochs")
    parser.add_argument("--repeat", type=int, default=3, help="epochs per row (fastest counts)")
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ds.LocalCluster(num_workers=2) as cluster:
        for name, (make, expect) in _pipelines(tmp, args.quick).items():
            _epoch_s(cluster, make, False, expect)  # warm-up
            best = {}
            for exactly_once in (False, True):
                times = [_epoch_s(cluster, make, exactly_once, expect) for _ in range(args.repeat)]
                best[exactly_once] = expect / min(times)
            rows.append(
                {
                    "workload": name,
                    "elements": expect,
                    "default_per_s": best[False],
                    "exactly_once_per_s": best[True],
                    "ratio": best[True] / best[False],
                }
            )
            print(
                f"{name:6s} {expect:7d} elements: default {best[False]:10.0f}/s, "
                f"exactly_once {best[True]:10.0f}/s ({best[True] / best[False]:.2f}x)",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
