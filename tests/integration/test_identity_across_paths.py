"""A pipeline's identity is what it computes: the same training script run from two
directories (two checkouts, two hosts) by two trainer processes registers one
dataset and shares one named job; a changed function body is another dataset."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

import dataservice as ds

# A trainer: registers its pipeline, prints the dataset id, waits for the test's go
# file (so that both trainers read the job at once), reads its share of the named
# job and prints the elements it got. The pipeline holds what made the bytes differ
# from one copy or one process to the next: functions defined in this file (their
# code names the file), a set constant (ordered by the hash seed), a class defined
# here (cloudpickle gives it a random id), and the module's `__file__`.
TRAINER = """
import json, os, sys, time
import dataservice as ds

address, job_name, go_file = sys.argv[1:4]
OFFSET = 1000
SMALL = {"1", "2", "3", "4", "5", "6", "7"}


class Scale:
    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        return x * self.k


def tag(x):
    time.sleep(0.005)
    small = str(int(x)) in SMALL
    return {"x": x + OFFSET, "small": small, "file": __file__}


dataset = ds.Dataset.range(300).map(Scale(BODY)).map(lambda x: x // BODY).map(tag)
dataset_id = ds.register_dataset(address, dataset)
print(json.dumps({"dataset_id": dataset_id}), flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(go_file):
    if time.monotonic() > deadline:
        sys.exit("no go file after 60 s")
    time.sleep(0.01)
data = ds.from_dataset_id(ds.ShardingPolicy.DYNAMIC, address, dataset_id, job_name=job_name)
got = [(int(e["x"]), bool(e["small"]), str(e["file"])) for e in data]
print(json.dumps({"elements": got}), flush=True)
"""


def _write_trainer(directory: Path, body: int = 3) -> Path:
    directory.mkdir(parents=True)
    path = directory / "train.py"
    path.write_text(TRAINER.replace("BODY", str(body)))
    return path


def _start(script: Path, address: str, job_name: str, go_file: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script), address, job_name, str(go_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
        cwd=str(script.parent),
    )


def _first_line(proc: subprocess.Popen[str], timeout_s: float = 60) -> dict:
    """The first JSON line `proc` prints, waited for at most `timeout_s`."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"the trainer printed nothing in {timeout_s} s"
    line = proc.stdout.readline()  # a whole line, flushed at once, or EOF
    if not line:
        proc.wait(timeout=10)
        assert proc.stderr is not None
        pytest.fail(f"trainer exited {proc.returncode} before registering: {proc.stderr.read()}")
    return json.loads(line)


def _finish(proc: subprocess.Popen[str], timeout_s: float = 90) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def test_one_script_in_two_directories_shares_one_named_job(tmp_path, cluster):
    scripts = [_write_trainer(tmp_path / "a"), _write_trainer(tmp_path / "b" / "checkout")]
    go_file = tmp_path / "go"
    procs = [_start(s, cluster.target, "shared", go_file) for s in scripts]
    try:
        ids = [_first_line(p)["dataset_id"] for p in procs]
        go_file.touch()
        results = [_finish(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rc, _, err in results:
        assert rc == 0, err
    assert ids[0] == ids[1], ids
    shares = [json.loads(out.strip().splitlines()[-1])["elements"] for _, out, _ in results]
    # One DYNAMIC job: each element once across the two trainers, not once each.
    xs = sorted(x for share in shares for x, _, _ in share)
    assert xs == [1000 + i for i in range(300)]
    assert all(share for share in shares), [len(s) for s in shares]
    # The workers run the functions with their module's `__file__` put back: the
    # full path of the trainer that registered the dataset first.
    files = {f for share in shares for _, _, f in share}
    assert len(files) == 1 and files <= {str(s) for s in scripts}, files
    assert sorted(x - 1000 for share in shares for x, small, _ in share if small) == [
        1,
        2,
        3,
        4,
        5,
        6,
        7,
    ]


def test_another_function_body_is_another_dataset(tmp_path, cluster):
    same = _write_trainer(tmp_path / "a", body=3)
    other = _write_trainer(tmp_path / "b", body=4)
    go_file = tmp_path / "go"
    procs = [_start(s, cluster.target, "shared", go_file) for s in (same, other)]
    try:
        ids = [_first_line(p)["dataset_id"] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert ids[0] != ids[1], ids


def test_a_restarted_dispatcher_dedups_the_script_from_another_directory(tmp_path):
    """The journal keeps the fingerprint (and the definition with its code paths):
    after a restart the same script from another checkout gets the same id."""
    work_dir = str(tmp_path / "work")
    config = ds.DispatcherConfig(work_dir=work_dir, fault_tolerant_mode=True)
    dispatcher = ds.DispatchServer(config)
    port = int(dispatcher.target.rpartition(":")[2])
    first = _write_trainer(tmp_path / "a")
    proc = _start(first, dispatcher.target, "j", tmp_path / "never")
    try:
        before = _first_line(proc)["dataset_id"]
    finally:
        proc.kill()
        proc.communicate()
    dispatcher.stop()
    restarted = ds.DispatchServer(
        ds.DispatcherConfig(work_dir=work_dir, fault_tolerant_mode=True, port=port)
    )
    worker = ds.WorkerServer(ds.WorkerConfig(restarted.target, heartbeat_interval_ms=100))
    try:
        second = _write_trainer(tmp_path / "b" / "checkout")
        go_file = tmp_path / "go"
        go_file.touch()
        proc = _start(second, restarted.target, "j2", go_file)
        after = _first_line(proc)["dataset_id"]
        rc, out, err = _finish(proc)
        assert rc == 0, err
        assert after == before
        elements = json.loads(out.strip().splitlines()[-1])["elements"]
        assert sorted(x for x, _, _ in elements) == [1000 + i for i in range(300)]
        # The definition replayed from the journal kept the first registrant's path.
        assert {f for _, _, f in elements} == {str(first)}
    finally:
        worker.stop()
        restarted.stop()
