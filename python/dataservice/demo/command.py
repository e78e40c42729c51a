"""`dataservice demo`'s flags and its run: write or reuse the dataset, train through a
`LocalCluster` for `--epochs` epochs, time the same pipeline in-process, report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

from dataservice.demo.data import (
    DEFAULT_DATA_DIR,
    DEFAULT_NUM_RECORDS,
    DemoError,
    ensure_dataset,
    require_image_extras,
)
from dataservice.demo.pipeline import CROP_SIZE, make_pipeline
from dataservice.demo.report import print_summary, summarize
from dataservice.demo.training import (
    POOL,
    EpochResult,
    Progress,
    SoftmaxClassifier,
    StallWatch,
    check_epoch,
    run_epoch,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `dataservice demo`."""
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default: 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per batch (default: 64)")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs (default: 2)")
    parser.add_argument(
        "--data-dir",
        default=DEFAULT_DATA_DIR,
        help="where the image dataset is cached (default: %(default)s)",
    )
    parser.add_argument(
        "--num-records",
        type=int,
        default=DEFAULT_NUM_RECORDS,
        help="records in the dataset (default: %(default)s; small for tests)",
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument(
        "--learning-rate", type=float, default=0.3, help="SGD learning rate (default: 0.3)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the summary as one JSON line, last on stdout"
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    parser.add_argument(
        "--stall-timeout-s",
        type=float,
        default=300.0,
        help="fail if no batch arrives for this long (default: %(default)s)",
    )
    parser.add_argument("--verbose", action="store_true", help="show the servers' logs on stderr")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Runs the demo; returns the exit code (0 passed, 1 failed)."""
    try:
        return _run(args)
    except DemoError as e:
        print(f"dataservice demo: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("dataservice demo: interrupted", file=sys.stderr, flush=True)
        return 130


def _run(args: argparse.Namespace) -> int:
    for name in ("workers", "batch_size", "epochs", "num_records"):
        if getattr(args, name) < 1:
            raise DemoError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    require_image_extras()
    import dataservice as ds

    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    data = ensure_dataset(args.data_dir, args.num_records, seed=args.seed, log=_log)
    pipeline = make_pipeline(data, args.batch_size)
    num_features = (CROP_SIZE // POOL) ** 2 * 3
    model = SoftmaxClassifier(num_features, data.num_classes, args.learning_rate)
    job_name = f"dataservice-demo-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    epochs: list[EpochResult] = []
    stall = None
    failure = None
    _log(f"starting a local cluster: 1 dispatcher, {args.workers} workers")
    try:
        with ds.LocalCluster(
            num_workers=args.workers,
            worker_options={"heartbeat_interval_ms": 100},
            forward_output=args.verbose,
            log_level="INFO" if args.verbose else "WARNING",
        ) as cluster:
            _log(f"dispatcher {cluster.dispatcher_address}, workers {cluster.worker_addresses}")
            distributed = pipeline.apply(
                ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name=job_name)
            )
            stall = StallWatch(args.stall_timeout_s)
            t0 = time.monotonic()
            for epoch in range(args.epochs):
                progress = Progress(
                    data.num_records, f"epoch {epoch + 1}/{args.epochs}", show_progress
                )
                iterator = iter(distributed)
                try:
                    epochs.append(run_epoch(iterator, model, data.num_records, progress, stall))
                finally:
                    progress.close()
                    close = getattr(iterator, "close", None)
                    if callable(close):
                        close()
            wall_s = time.monotonic() - t0
            stall.close()
    except KeyboardInterrupt:
        if stall is not None and stall.fired:
            failure = f"no batch arrived for {args.stall_timeout_s:.0f} s (--stall-timeout-s)"
        else:
            raise
    finally:
        if stall is not None:
            stall.close()
    if failure is not None:
        print(f"dataservice demo: FAILED: {failure}", flush=True)
        return 1

    # The same pipeline and training step in this process, without the service.
    _log("timing the same pipeline in-process (no service), one epoch")
    in_process_model = SoftmaxClassifier(num_features, data.num_classes, args.learning_rate)
    progress = Progress(data.num_records, "in-process", show_progress)
    t1 = time.monotonic()
    try:
        local = run_epoch(iter(pipeline), in_process_model, data.num_records, progress, None)
    finally:
        progress.close()
    in_process_s = time.monotonic() - t1

    failures = [f for e, r in enumerate(epochs) if (f := check_epoch(e + 1, r.index_counts))]
    summary = summarize(args, data, epochs, wall_s, local, in_process_s)
    print_summary(summary, failures)
    if args.json:
        print(json.dumps(summary, sort_keys=True), flush=True)
    return 1 if failures else 0
