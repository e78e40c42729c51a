"""torchrun across hosts: examples/torch_ddp.py as two torchrun nodes, one on
each trainer host (t0, t1), against a dispatcher host and two worker hosts,
each host a network namespace (conftest.py, harness.py).

Node 0's namespace address is torchrun's master address (its c10d store), and
gloo is pinned to the namespace's own interface (GLOO_SOCKET_IFNAME=eth0): a
namespace's hostname resolves to the machine's own (here 127.0.0.1), which no
other namespace can reach: without it the nodes wait on each other until
killed. Each rank writes what it read (`--report-json`), and the test checks
it: DYNAMIC, every image once over the two ranks; coordinated reads, one full
batch per rank on every step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.ft.conftest import server_env  # noqa: E402

from . import harness  # noqa: E402
from .cluster import DISPATCHER_PORT, TOKEN, Cluster  # noqa: E402
from .conftest import exactly  # noqa: E402

pytestmark = pytest.mark.netns

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_ddp.py"
TRAINERS = ("t0", "t1")
RUN_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def cluster(net: harness.Net, token_file: str) -> Iterator[Cluster]:
    """The dispatcher on `disp` and a worker on each of `w0`, `w1`."""
    c = Cluster(net, token_file)
    try:
        c.dispatcher()
        target = c.address("disp", DISPATCHER_PORT)
        workers = [c.worker(h, target, wait=False) for h in ("w0", "w1")]
        for w in workers:
            w.wait_ready()
        yield c
    finally:
        c.close()


def run_nodes(c: Cluster, tmp_path: Path, master_port: int, *args: str) -> list[dict]:
    """Runs torch_ddp.py as 2 torchrun nodes of 1 process each, node R on host
    tR; returns each rank's report, rank 0's first.

    Raises:
        AssertionError: A node exited non-zero, or the nodes ran past
            RUN_TIMEOUT_S (the rest are then killed), with their output.
    """
    env = server_env()
    env.update(DATASERVICE_AUTH_TOKEN=TOKEN, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    report = tmp_path / "rank-{rank}.json"
    nodes = []
    logs = {h: (tmp_path / f"{h}.out", tmp_path / f"{h}.err") for h in TRAINERS}
    for node_rank, host in enumerate(TRAINERS):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node_rank),
            "--master-addr",
            c.net.ip["t0"],
            "--master-port",
            str(master_port),
            str(EXAMPLE),
            "--dispatcher",
            "grpc://" + c.address("disp", DISPATCHER_PORT),
            "--report-json",
            str(report),
            "--job-name",
            f"torchrun-{tmp_path.name}",
            *args,
        ]
        out_path, err_path = logs[host]
        with open(out_path, "w") as out, open(err_path, "w") as err:
            nodes.append(
                subprocess.Popen(
                    c.net.exec_argv(host, argv),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,  # torchrun and its rank: one group to kill
                )
            )
    # Each node waits for the other (the c10d store, gloo's pairs): once one
    # fails, or at the deadline, the rest are killed (a failure then reports in
    # seconds, with both nodes' output).
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while any(p.poll() is None for p in nodes):
        failed = any(p.returncode not in (None, 0) for p in nodes)
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    timed_out = time.monotonic() > deadline
    hung = []
    for host, p in zip(TRAINERS, nodes, strict=True):
        if p.poll() is None:
            hung.append(host)
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    for host, p in zip(TRAINERS, nodes, strict=True):
        why = f"no exit within {RUN_TIMEOUT_S} s" if timed_out else "the other node failed"
        what = f"was killed ({why})" if host in hung else f"exited {p.returncode}"
        out, err = (path.read_text() for path in logs[host])
        assert p.returncode == 0 and host not in hung, (
            f"torchrun node on {host} {what}:\n{out[-2000:]}\n{err[-6000:]}"
        )
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world"]) for r in reports] == [(0, 2), (1, 2)]
    return reports


def test_dynamic_each_image_reaches_one_rank_once(cluster: Cluster, tmp_path: Path) -> None:
    images = 96
    # batch size 1: the workers' drop_remainder batching drops nothing, so the
    # epoch is complete over the ranks; --steps covers a rank reading all of it.
    reports = run_nodes(
        cluster,
        tmp_path,
        29511,
        "--recipe",
        "dynamic",
        "--images",
        str(images),
        "--batch-size",
        "1",
        "--steps",
        str(images + 1),
    )
    read = [[i for step in r["steps"] for i in step] for r in reports]
    assert not set(read[0]) & set(read[1]), "an image reached both ranks"
    exactly(read[0] + read[1], list(range(images)), "DYNAMIC over the two torchrun nodes")
    assert all(read), f"a rank read nothing: {[len(r) for r in read]}"


@pytest.mark.slow  # 12 s; in CI: test_torch_ddp.py's coordinated reads on one host
def test_coordinated_reads_give_each_rank_a_batch_per_step(
    cluster: Cluster, tmp_path: Path
) -> None:
    steps, batch = 5, 4
    reports = run_nodes(
        cluster,
        tmp_path,
        29512,
        "--recipe",
        "coordinated",
        "--images",
        "64",
        "--batch-size",
        str(batch),
        "--steps",
        str(steps),
    )
    assert [len(r["steps"]) for r in reports] == [steps, steps]
    for s, (a, b) in enumerate(zip(reports[0]["steps"], reports[1]["steps"], strict=True)):
        assert len(a) == len(b) == batch, f"step {s}: rank 0 {a}, rank 1 {b}"
        assert a != b, f"step {s}: both ranks got the same batch {a}"
