"""Data-parallel training (DistributedDataParallel) fed by the data service.

    torchrun --nproc-per-node 2 examples/torch_ddp.py              # CPU, gloo
    torchrun --nproc-per-node 2 examples/torch_ddp.py --recipe coordinated
    torchrun --nproc-per-node 2 examples/torch_ddp.py --dispatcher grpc://host:5050

Rank 0 starts a `LocalCluster` (a dispatcher and `--workers` worker processes on
this host) unless `--dispatcher` names a running one (its token then comes from
DATASERVICE_AUTH_TOKEN on every rank), and hands its address and auth token to
the other ranks over the process group (`broadcast_service`). Every rank reads
the pipeline through `ServiceDataset` in one of the three recipes (`--recipe`):

- dynamic: one shared DYNAMIC job; each rank takes what it gets, every image once
  per epoch over the ranks; DDP's join() absorbs the ranks' different batch counts.
- coordinated: coordinated reads (consumer_index=rank of num_consumers=world size)
  of an endless pipeline; every rank gets one batch per step.
- off: a job per rank over the pipeline shuffled with seed + rank.

Each rank prints its images/s and the fraction of its time spent waiting for data;
with `--report-json PATH` it also writes what it read to PATH (`{rank}` in PATH is
replaced by the rank): {"rank", "world", "recipe", "steps": [[image index, ...] per
step]}, each image's index in the epoch (the `index` leaf the workers add).
Without torchrun it runs as a single rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dataservice as ds
from dataservice.torch import ServiceDataset, broadcast_service, distribute_for_rank

IMAGE = 64
CLASSES = 10


def make_image(i):
    """Runs on the service's workers: a synthetic labelled image, uint8[64, 64, 3]."""
    rng = np.random.default_rng(int(i))
    label = int(i) % CLASSES
    image = rng.integers(0, 256, (IMAGE, IMAGE, 3), dtype=np.uint8)
    image[..., label % 3] //= 2  # something for the model to learn
    if rng.random() < 0.5:
        image = image[:, ::-1]  # flip
    return {"image": np.ascontiguousarray(image), "label": np.int64(label), "index": np.int64(i)}


def pipeline(args, rank: int) -> ds.Dataset:
    source = ds.Dataset.range(args.images)
    if args.recipe == "off":
        source = source.shuffle(args.images, seed=args.seed + rank)
    if args.recipe == "coordinated":
        source = source.repeat()  # coordinated reads need an endless dataset
    return source.map(make_image).batch(args.batch_size, drop_remainder=True)


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, CLASSES),
    )


def init_process_group() -> None:
    if "RANK" not in os.environ:  # not under torchrun: one rank
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))


def train(args, target: str, rank: int, world: int) -> None:
    dataset = pipeline(args, rank).apply(
        distribute_for_rank(
            ds.ShardingPolicy.OFF if args.recipe == "off" else ds.ShardingPolicy.DYNAMIC,
            target,
            job_name=args.job_name,
            coordinated=args.recipe == "coordinated",
        )
    )
    service = ServiceDataset(dataset)
    loader = torch.utils.data.DataLoader(service, batch_size=None)  # batches come batched
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    net = DistributedDataParallel(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    images = steps = 0
    read: list[list[int]] = []  # per step, the indices of its images (--report-json)
    wait_s = 0.0
    loss = torch.zeros(())
    start = time.perf_counter()
    # join(): a rank that runs out of batches first keeps answering the others' all-reduces.
    with net.join() if args.recipe != "coordinated" else contextlib.nullcontext():
        it = iter(loader)
        while steps < args.steps:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            wait_s += time.perf_counter() - t0
            x = batch["image"].permute(0, 3, 1, 2).float().div_(255)  # NHWC uint8 -> NCHW
            opt.zero_grad()
            loss = loss_fn(net(x), batch["label"])
            loss.backward()  # all-reduces the gradients with the other ranks
            opt.step()
            images += len(batch["label"])
            read.append(batch["index"].tolist())
            steps += 1
    elapsed = time.perf_counter() - start
    stats = service.stats()
    transports = sorted({w["transfer_protocol"] for w in stats.get("workers", {}).values()})
    print(
        f"rank {rank}/{world} [{args.recipe}]: {steps} steps, {images} images in {elapsed:.2f} s "
        f"= {images / max(elapsed, 1e-9):.0f} images/s; data wait {wait_s:.2f} s "
        f"({100 * wait_s / max(elapsed, 1e-9):.0f} % of the time; the reader's own wait_ms "
        f"{stats.get('wait_ms', 0):.0f}); transport {','.join(transports) or '-'}; "
        f"last loss {loss.item():.3f}",
        flush=True,
    )
    if args.report_json:
        report = {"rank": rank, "world": world, "recipe": args.recipe, "steps": read}
        with open(args.report_json.replace("{rank}", str(rank)), "w") as f:
            json.dump(report, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", choices=["dynamic", "coordinated", "off"], default="dynamic")
    p.add_argument("--dispatcher", help="a running dispatcher; default: rank 0 starts one")
    p.add_argument("--workers", type=int, default=2, help="LocalCluster worker processes")
    p.add_argument("--images", type=int, default=2048, help="images per epoch")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="most training steps per rank")
    p.add_argument("--seed", type=int, default=0, help="off: rank R shuffles with seed + R")
    p.add_argument("--job-name", default="ddp-train")
    p.add_argument(
        "--report-json",
        metavar="PATH",
        help="write the image indices read per step to PATH ({rank} is replaced by the rank)",
    )
    args = p.parse_args()

    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    with contextlib.ExitStack() as stack:
        if args.dispatcher:
            target = args.dispatcher
        elif rank == 0:
            cluster = stack.enter_context(ds.LocalCluster(num_workers=args.workers))
            print(f"rank 0: started {cluster!r}", flush=True)
            target = broadcast_service(cluster.target, cluster.auth_token)
        else:
            target = broadcast_service()
        try:
            train(args, target, rank, world)
        finally:
            dist.barrier()  # rank 0 keeps its cluster up until every rank is done
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
