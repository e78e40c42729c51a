"""`dataservice demo`'s flags and its run: write or reuse the dataset, then train for
`--epochs` epochs three ways (in-process, through PyTorch's DataLoader when torch imports,
through a `LocalCluster`) and report images/s and how long the trainer waited for data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Iterable
from typing import Any

from dataservice.demo.data import (
    DEFAULT_DATA_DIR,
    DEFAULT_NUM_RECORDS,
    DemoData,
    DemoError,
    ensure_dataset,
    require_image_extras,
)
from dataservice.demo.pipeline import CROP_SIZE, make_pipeline
from dataservice.demo.report import ROWS, RowRun, print_summary, summarize
from dataservice.demo.training import (
    POOL,
    EpochResult,
    MLPClassifier,
    Progress,
    StallWatch,
    one_blas_thread,
    run_epoch,
)

EPILOG = """\
Each row trains the same model (a numpy MLP, one thread) on the same pipeline (read
TFRecord shards, decode the full-size JPEGs with Pillow, RandomResizedCrop to 224x224,
random flip, batch) for --epochs epochs:

  in-process   the pipeline and the training step take turns in this process (no service)
  service      --workers worker processes of a LocalCluster run the pipeline while this
               process trains, DYNAMIC sharding (each record once per epoch)
  DataLoader   torch.utils.data.DataLoader(num_workers=--workers) runs the same decode
               code (only when torch imports; --no-dataloader leaves it out)

"trainer waited" is the share of a row's time spent in iter() and next() waiting for a
batch; the rest is the training step. Exit code 1 when a row did not read each record
exactly once per epoch.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `dataservice demo` (and its --help's epilog)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument(
        "--workers",
        type=int,
        default=2,
        help="worker processes of the service, and of the DataLoader (default: 2)",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="images per batch (default: 64)")
    parser.add_argument(
        "--epochs", type=int, default=2, help="training epochs per row (default: 2)"
    )
    parser.add_argument(
        "--data-dir",
        default=DEFAULT_DATA_DIR,
        help="where the image dataset is cached, written once (default: %(default)s)",
    )
    parser.add_argument(
        "--num-records",
        type=int,
        default=DEFAULT_NUM_RECORDS,
        help="records in the dataset (default: %(default)s; small for tests)",
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument(
        "--learning-rate", type=float, default=0.01, help="SGD learning rate (default: 0.01)"
    )
    parser.add_argument(
        "--dataloader",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the DataLoader row (default: when torch imports)",
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


class _Stalled(Exception):
    pass


def _train(
    name: str,
    iterable: Iterable[Any],
    data: DemoData,
    args: argparse.Namespace,
    show_progress: bool,
) -> list[EpochResult]:
    """Trains a fresh model (the same seed in every row) for `--epochs` epochs, a new
    iterator of `iterable` per epoch.

    Raises:
        _Stalled: no batch arrived for `--stall-timeout-s` (the stall watch's SIGINT).
    """
    num_features = (CROP_SIZE // POOL) ** 2 * 3
    model = MLPClassifier(num_features, data.num_classes, args.learning_rate)
    results: list[EpochResult] = []
    stall = StallWatch(args.stall_timeout_s)
    try:
        for epoch in range(args.epochs):
            progress = Progress(
                data.num_records, f"{name} epoch {epoch + 1}/{args.epochs}", show_progress
            )
            try:
                results.append(run_epoch(iterable, model, data.num_records, progress, stall))
            finally:
                progress.close()
    except KeyboardInterrupt:
        if stall.fired:
            raise _Stalled(
                f"{name}: no batch arrived for {args.stall_timeout_s:.0f} s (--stall-timeout-s)"
            ) from None
        raise
    finally:
        stall.close()
    return results


def _dataloader_unavailable(args: argparse.Namespace) -> str | None:
    """Why the DataLoader row is left out, or None to run it."""
    if args.dataloader is False:
        return "--no-dataloader"
    try:
        import torch.utils.data  # noqa: F401
    except ImportError as e:
        if args.dataloader:
            raise DemoError(f"--dataloader needs torch, which does not import: {e}") from e
        return f"torch does not import ({e})"
    return None


def _load_average() -> float | None:
    """The 1-minute load average (runnable processes), or None where unknown."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _run(args: argparse.Namespace) -> int:
    for name in ("workers", "batch_size", "epochs", "num_records"):
        if getattr(args, name) < 1:
            raise DemoError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    require_image_extras()
    import dataservice as ds

    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    data = ensure_dataset(args.data_dir, args.num_records, seed=args.seed, log=_log)
    pipeline = make_pipeline(data, args.batch_size)
    dataloader_skipped = _dataloader_unavailable(args)
    load_before = _load_average()
    runs: dict[str, RowRun] = {}
    try:
        with one_blas_thread():
            _log(f"in-process: {args.epochs} epochs, pipeline and training step in turn")
            results = _train("in-process", pipeline, data, args, show_progress)
            runs["in_process"] = RowRun(results)

            # Before the service: forking (DataLoader workers) after gRPC has started its
            # threads in this process is not safe.
            if dataloader_skipped is None:
                from dataservice.demo.torch_loader import make_dataloader

                _log(f"DataLoader: {args.epochs} epochs, num_workers={args.workers}")
                loader = make_dataloader(data, args.batch_size, args.workers, seed=args.seed)
                try:
                    results = _train("DataLoader", loader, data, args, show_progress)
                finally:
                    del loader  # ends its persistent worker processes
                runs["dataloader"] = RowRun(results)

            _log(f"service: starting a local cluster: 1 dispatcher, {args.workers} workers")
            job_name = f"dataservice-demo-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            t0 = time.monotonic()
            with ds.LocalCluster(
                num_workers=args.workers,
                forward_output=args.verbose,
                log_level="INFO" if args.verbose else "WARNING",
            ) as cluster:
                start_s = time.monotonic() - t0
                _log(
                    f"service: dispatcher {cluster.dispatcher_address}, workers "
                    f"{cluster.worker_addresses} (started in {start_s:.1f} s)"
                )
                distributed = pipeline.apply(
                    ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name=job_name)
                )
                results = _train("service", distributed, data, args, show_progress)
                runs["service"] = RowRun(results, cluster_start_s=start_s)
    except _Stalled as e:
        print(f"dataservice demo: FAILED: {e}", flush=True)
        return 1

    summary = summarize(args, data, runs, dataloader_skipped, load_before)
    failures = print_summary(summary)
    if args.json:
        print(json.dumps(summary, sort_keys=True), flush=True)
    return 1 if failures else 0


__all__ = ["EPILOG", "ROWS", "add_arguments", "run"]
