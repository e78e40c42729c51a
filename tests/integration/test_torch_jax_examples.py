"""examples/torch_ddp.py (2 ranks under torchrun, CPU/gloo) and examples/jax_train.py run
to the end with few steps and print their per-rank throughput and data wait."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dataservice as ds

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIMEOUT_S = 120
RANK_LINE = re.compile(
    r"rank (\d)/2 \[(\w+)\]: (\d+) steps, (\d+) images in [\d.]+ s = \d+ images/s; "
    r"data wait [\d.]+ s \(\d+ % of the time"
)


def run(cmd: list[str], **env: str) -> str:
    proc = subprocess.run(
        cmd,
        env=dict(os.environ, OMP_NUM_THREADS="1", **env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return proc.stdout


def torchrun(*args: str, **env: str) -> list[tuple[int, str, int, int]]:
    out = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "torch_ddp.py"),
            *args,
        ],
        **env,
    )
    ranks = sorted((int(m[1]), m[2], int(m[3]), int(m[4])) for m in RANK_LINE.finditer(out))
    assert [r[0] for r in ranks] == [0, 1], out
    return ranks


def test_torch_ddp_example_with_a_cluster_started_by_rank_0():
    pytest.importorskip("torch")
    ranks = torchrun("--steps", "4", "--images", "512", "--batch-size", "32")
    # DYNAMIC: each rank trains on what it gets, at most 4 steps of 32 images.
    assert all(recipe == "dynamic" and 0 <= steps <= 4 for _, recipe, steps, _ in ranks)
    assert sum(images for *_, images in ranks) == 32 * sum(steps for _, _, steps, _ in ranks) > 0


@pytest.mark.slow
def test_torch_ddp_example_with_an_external_dispatcher():
    pytest.importorskip("torch")
    with ds.LocalCluster(num_workers=1) as cluster:
        ranks = torchrun(
            "--dispatcher",
            cluster.target,
            "--recipe",
            "coordinated",
            "--steps",
            "3",
            "--batch-size",
            "16",
            DATASERVICE_AUTH_TOKEN=cluster.auth_token,
        )
    assert ranks == [(0, "coordinated", 3, 48), (1, "coordinated", 3, 48)]


def test_jax_example():
    pytest.importorskip("jax")
    out = run([sys.executable, str(EXAMPLES / "jax_train.py"), "--steps", "5", "--images", "640"])
    m = re.search(r"process 0/1 on \S+ \[dynamic\]: 5 steps, 320 images in .* images/s", out)
    assert m, out
