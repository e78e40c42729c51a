"""One rank of the 2-rank DDP recipe tests (test_torch_ddp.py runs it under torchrun).

Reads the service in one of the three recipes (`--recipe dynamic|coordinated|off`),
trains a tiny DistributedDataParallel model (gloo, CPU) on what it gets, and writes
what it received to OUT/rank-R.json: per step the element ids, the pid of the
worker that made them, and the final weights (DDP keeps them equal across ranks).
The dispatcher comes from --dispatcher, its token from DATASERVICE_AUTH_TOKEN.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dataservice as ds
from dataservice.torch import (
    ServiceDataset,
    broadcast_service,
    distribute_for_rank,
    rank_and_world_size,
)


def tag(i):
    # Runs on the worker: which worker made the element travels with it.
    return {"id": i, "pid": np.int64(os.getpid()), "x": np.full(4, i, np.float32)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--recipe", choices=["dynamic", "coordinated", "off", "broadcast"], required=True
    )
    p.add_argument("--dispatcher", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--elements", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="coordinated: steps to train")
    p.add_argument("--seed", type=int, default=7, help="off: rank R shuffles with seed + R")
    p.add_argument("--job", default="ddp")
    args = p.parse_args()

    rank, world = rank_and_world_size()  # from torchrun's env, before the group exists
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    assert (rank, world) == rank_and_world_size() == (dist.get_rank(), dist.get_world_size())

    if args.recipe == "broadcast":
        # Rank 0 hands out --dispatcher (and a token); a bad address fails on every rank.
        given = args.dispatcher if rank == 0 else None
        try:
            got = broadcast_service(given, "tok-en" if rank == 0 else None)
            outcome = {"target": got, "token": ds.auth.client_token(got)}
        except ValueError as err:
            outcome = {"error": str(err)}
        with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
            json.dump(outcome, f)
        dist.destroy_process_group()
        return

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    if args.recipe == "dynamic":
        pipeline = ds.Dataset.range(args.elements).map(tag).batch(args.batch_size)
        dataset = pipeline.apply(
            distribute_for_rank(ds.ShardingPolicy.DYNAMIC, args.dispatcher, job_name=args.job)
        )
    elif args.recipe == "coordinated":
        # (README recipe 2: OFF, each worker shuffling in its own order.)
        pipeline = (
            ds.Dataset.range(args.elements)
            .shuffle(args.elements)
            .repeat()
            .map(tag)
            .batch(args.batch_size)
        )
        dataset = pipeline.apply(
            distribute_for_rank(
                ds.ShardingPolicy.OFF, args.dispatcher, job_name=args.job, coordinated=True
            )
        )
    else:
        pipeline = (
            ds.Dataset.range(args.elements)
            .shuffle(args.elements, seed=args.seed + rank)
            .map(tag)
            .batch(args.batch_size)
        )
        dataset = pipeline.apply(
            distribute_for_rank(ds.ShardingPolicy.OFF, args.dispatcher, job_name=args.job)
        )

    loader = torch.utils.data.DataLoader(ServiceDataset(dataset), batch_size=None)
    steps: list[dict] = []

    def train_step(batch: dict) -> None:
        opt.zero_grad()
        loss = model(batch["x"]).pow(2).mean()
        loss.backward()  # all-reduces the gradients with the other rank
        opt.step()
        ids = batch["id"].tolist()
        pids = sorted(set(batch["pid"].tolist()))
        steps.append({"ids": ids, "pids": pids})

    if args.recipe == "coordinated":
        it = iter(loader)
        for _ in range(args.steps):  # infinite dataset: every rank takes the same steps
            train_step(next(it))
    else:
        # Ranks may get different numbers of batches (DYNAMIC): join() lets the one that
        # ends first shadow the other's all-reduces instead of hanging.
        with model.join():
            for batch in loader:
                train_step(batch)

    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "steps": steps, "weights": weights}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
