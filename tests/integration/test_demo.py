"""`dataservice demo` end to end: a small image dataset, two workers, two epochs."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

pytest.importorskip("PIL")
pytest.importorskip("skimage")
pytest.importorskip("sklearn")


def _leftovers(demo_pid: int, data_dir: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if p.info["status"] == psutil.STATUS_ZOMBIE or p.info["pid"] == psutil.Process().pid:
            continue
        ours = data_dir in cmdline or (
            "dataservice" in cmdline and f"--parent-pid {demo_pid}" in cmdline
        )
        if ours:
            found.append(f"{p.info['pid']}: {cmdline}")
    return found


@pytest.mark.timeout(300)
def test_demo_json_two_workers_two_epochs(tmp_path) -> None:
    data_dir = str(tmp_path / "demo-data")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dataservice",
            "demo",
            "--json",
            "--num-records",
            "256",
            "--epochs",
            "2",
            "--data-dir",
            data_dir,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"demo did not finish in 240 s; stderr: {err[-3000:]}")
    assert proc.returncode == 0, f"stdout: {out[-3000:]}\nstderr: {err[-3000:]}"
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert "PASSED" in out and "FAILED" not in out

    assert summary["images_per_second"] > 0
    assert summary["in_process_images_per_second"] > 0
    assert summary["epochs"] == 2
    assert summary["records_per_epoch"] == [256, 256]
    assert summary["batches"] >= 2 * (256 // 64)
    assert summary["wall_s"] > 0
    assert summary["transport"] in ("grpc", "shm", "grpc+shm")
    per_worker = summary["elements_per_worker"]
    assert len(per_worker) == 2, per_worker
    assert all(n > 0 for n in per_worker.values()), per_worker
    assert sum(per_worker.values()) == summary["batches"]

    assert not _leftovers(proc.pid, data_dir)
