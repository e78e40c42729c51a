"""`dataservice demo` end to end: a small image dataset, two workers, two epochs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

pytest.importorskip("PIL")
pytest.importorskip("skimage")
pytest.importorskip("sklearn")


def _torch_imports() -> bool:
    try:
        import torch.utils.data  # noqa: F401
    except ImportError:
        return False
    return True


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
    assert summary["exactly_once"] is True
    assert summary["load_average_before"] >= 0  # Linux has getloadavg
    assert summary["cpus"] >= 1

    rows = summary["rows"]
    if _torch_imports():
        assert set(rows) == {"in_process", "service", "dataloader"}
        assert summary["dataloader_skipped"] is None
        assert rows["dataloader"]["num_workers"] == 2
    else:
        assert set(rows) == {"in_process", "service"}
        assert "torch" in summary["dataloader_skipped"]
    for name, row in rows.items():
        assert row["epochs"] == 2, name
        assert row["images"] == 256 * 2, name  # dataset size x epochs
        assert row["records_per_epoch"] == [256, 256], name
        assert row["exactly_once"] is True, name
        assert 0 < row["wait_s"] < row["wall_s"], (name, row)
        assert 0.0 < row["wait_fraction"] < 1.0, (name, row)
        assert row["wait_fraction"] == pytest.approx(row["wait_s"] / row["wall_s"]), name
        assert row["images_per_second"] == pytest.approx(row["images"] / row["wall_s"]), name
        assert summary["speedup"][name] == pytest.approx(
            row["images_per_second"] / rows["in_process"]["images_per_second"]
        )
        assert row["batches"] >= 2 * (256 // 64), name
        assert len(row["loss_per_epoch"]) == 2 and all(v > 0 for v in row["loss_per_epoch"])
    # The model starts at ln(classes) and learns: the second epoch's mean loss is lower.
    in_process = rows["in_process"]
    assert in_process["loss_per_epoch"][1] < in_process["loss_per_epoch"][0]

    service = rows["service"]
    assert service["transport"] in ("grpc", "shm", "grpc+shm")
    assert service["workers"] == 2 and service["cluster_start_s"] > 0
    per_worker = service["elements_per_worker"]
    assert len(per_worker) == 2, per_worker
    assert all(n > 0 for n in per_worker.values()), per_worker
    assert sum(per_worker.values()) == service["batches"]
    assert service["bytes"] >= 256 * 2 * 224 * 224 * 3  # the uint8 images, at least

    # The table names each row and what it means.
    for label in ("in-process", "service, 2 workers", "trainer waited"):
        assert label in out
    if _torch_imports():
        assert "DataLoader, 2 workers" in out

    assert not _leftovers(proc.pid, data_dir)


@pytest.mark.timeout(60)
def test_demo_help_documents_flags_and_rows() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dataservice", "demo", "--help"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--workers", "--epochs", "--batch-size", "--data-dir", "--json", "--dataloader"):
        assert flag in out.stdout
    for row in ("in-process", "service", "DataLoader", "trainer waited"):
        assert row in out.stdout


@pytest.mark.timeout(60)
def test_demo_rejects_bad_flag_values(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dataservice", "demo", "--epochs", "0", "--data-dir", str(tmp_path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 1
    assert "--epochs must be >= 1, got 0" in out.stderr
    assert os.listdir(tmp_path) == []  # nothing written


@pytest.mark.timeout(120)
def test_dataloader_reads_each_record_once_per_epoch(tmp_path) -> None:
    pytest.importorskip("torch")
    from dataservice import demo
    from dataservice.demo.torch_loader import make_dataloader

    data = demo.write_dataset(str(tmp_path), 40, seed=1)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    loader = make_dataloader(data, batch_size=8, num_workers=2, seed=5)
    orders = []
    for _ in range(2):
        order = []
        for images, labels, indices in loader:
            assert tuple(images.shape[1:]) == (224, 224, 3) and str(images.dtype) == "torch.uint8"
            assert len(images) == len(labels) == len(indices) <= 8
            order.extend(int(i) for i in indices)
        assert sorted(order) == list(range(40))
        orders.append(order)
    assert orders[0] != orders[1]  # the shards are shuffled anew each epoch
    workers = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert len(workers) == 2  # persistent: the same two for both epochs
    del loader
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, alive
