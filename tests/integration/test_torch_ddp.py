"""The three data-parallel recipes of dataservice.torch, each with 2 DDP ranks (gloo, CPU)
under torchrun against a LocalCluster of 2 worker processes; each rank reports what it
received (torch_ranks.py) and the test checks it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("torch")

import dataservice as ds  # noqa: E402

RANKS_SCRIPT = Path(__file__).with_name("torch_ranks.py")
ELEMENTS = 200
BATCH = 8
RUN_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def cluster():
    with ds.LocalCluster(num_workers=2) as c:
        yield c


def run_ranks(cluster, tmp_path: Path, recipe: str, *extra: str) -> list[dict]:
    """Runs 2 ranks of torch_ranks.py under torchrun; returns each rank's report."""
    env = dict(os.environ, DATASERVICE_AUTH_TOKEN=cluster.auth_token, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(RANKS_SCRIPT),
        "--recipe",
        recipe,
        "--dispatcher",
        cluster.target,
        "--out",
        str(tmp_path),
        "--elements",
        str(ELEMENTS),
        "--batch-size",
        str(BATCH),
        "--job",
        f"{recipe}-{tmp_path.name}",
        *extra,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in reports] == [2, 2]
    # DDP kept the replicas equal: both ranks trained on every step's all-reduce.
    assert reports[0]["weights"] == reports[1]["weights"]
    return reports


@pytest.mark.slow  # 14 s; in CI: test_torchrun.py's DYNAMIC over two torchrun nodes
def test_dynamic_shared_job_reads_every_element_once_over_the_ranks(cluster, tmp_path):
    reports = run_ranks(cluster, tmp_path, "dynamic")
    ids = [[i for step in r["steps"] for i in step["ids"]] for r in reports]
    assert not set(ids[0]) & set(ids[1]), "an element reached both ranks"
    assert sorted(ids[0] + ids[1]) == list(range(ELEMENTS))


def test_coordinated_reads_give_every_rank_one_batch_per_step(cluster, tmp_path):
    steps = 6
    reports = run_ranks(cluster, tmp_path, "coordinated", "--steps", str(steps))
    assert [len(r["steps"]) for r in reports] == [steps, steps]
    for s, (a, b) in enumerate(zip(reports[0]["steps"], reports[1]["steps"], strict=True)):
        assert len(a["ids"]) == len(b["ids"]) == BATCH, f"step {s}"
        # One round: both ranks' batches come from the same worker, each its own batch.
        assert len(a["pids"]) == 1 and a["pids"] == b["pids"], f"step {s}: {a} {b}"
        assert a["ids"] != b["ids"], f"step {s}: both ranks got the same batch"


def test_off_per_rank_reads_the_whole_dataset_in_its_seeded_order(cluster, tmp_path):
    seed = 11
    reports = run_ranks(cluster, tmp_path, "off", "--seed", str(seed))
    orders = []
    for r in reports:
        expected = list(
            ds.Dataset.range(ELEMENTS).shuffle(ELEMENTS, seed=seed + r["rank"]).as_numpy_iterator()
        )
        by_worker: dict[int, list[int]] = defaultdict(list)
        for step in r["steps"]:
            assert len(step["pids"]) == 1  # a batch is made by one worker
            by_worker[step["pids"][0]].extend(step["ids"])
        # OFF: each of the 2 workers produced this rank's whole dataset, in its order.
        assert len(by_worker) == 2, f"rank {r['rank']}: workers {sorted(by_worker)}"
        for pid, got in by_worker.items():
            assert got == expected, f"rank {r['rank']}, worker pid {pid}"
        orders.append(expected)
    assert orders[0] != orders[1]  # seed + rank: each rank its own order


@pytest.mark.parametrize(
    "given", [pytest.param("grpc://127.0.0.1:5999", marks=pytest.mark.slow), "no-port-here"]
)
def test_broadcast_service_hands_rank_0s_dispatcher_and_token_to_rank_1(tmp_path, given):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DATASERVICE_AUTH_TOKEN", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(RANKS_SCRIPT),
        "--recipe",
        "broadcast",
        "--dispatcher",
        given,
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    if given == "no-port-here":
        # Rank 0's bad address is every rank's error, not a hang of rank 1.
        for r in got:
            assert "broadcast_service: rank 0:" in r["error"] and "no-port-here" in r["error"]
    else:
        assert got[1] == {"target": given, "token": "tok-en"}  # rank 1's clients send it
        assert got[0]["target"] == given
