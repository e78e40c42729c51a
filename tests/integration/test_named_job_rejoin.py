"""A trainer restarted with the same job_name joins the repetition its killed
predecessor was reading (named jobs are shared, as tf.data service's): the read
yields only what is left, or nothing. That is by design, and said: one WARNING
naming the job and the repetition (client/join.py `late_join_warning`, from the
dispatcher's GetOrCreateIterationResponse `earlier_consumers*`).

Trainers are subprocesses of the test (a repetition index is per process), the
cluster is in the test's process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import dataservice as ds

N = 3000

_TRAINER = textwrap.dedent(
    """
    import os, sys
    import dataservice as ds

    target, job = sys.argv[1], sys.argv[2]
    die_in_epoch, die_after = int(sys.argv[3]), int(sys.argv[4])
    dataset = ds.Dataset.range(__N__)
    if len(sys.argv) > 5:  # start together: wait for the other trainers, read slower
        import time

        barrier, count = sys.argv[5], int(sys.argv[6])
        open(os.path.join(barrier, str(os.getpid())), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir(barrier)) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        dataset = dataset.map(lambda x: (time.sleep(0.0005), x)[1])
    dataset = dataset.apply(ds.distribute("dynamic", target, job_name=job))
    for epoch in range(2):
        got = []
        for x in dataset:
            got.append(int(x))
            if epoch == die_in_epoch and len(got) == die_after:
                os._exit(9)  # as SIGKILL: no release, no goodbye
        print(f"epoch {epoch}: {len(got)} {len(set(got))}", flush=True)
    """
).replace("__N__", str(N))


def _env(cluster: ds.LocalCluster) -> dict[str, str]:
    return {**os.environ, "DATASERVICE_AUTH_TOKEN": cluster.auth_token}


def _trainer(cluster: ds.LocalCluster, job: str, die_in_epoch: int = -1, die_after: int = 0):
    return subprocess.run(
        [sys.executable, "-c", _TRAINER, cluster.target, job, str(die_in_epoch), str(die_after)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(cluster),
    )


@pytest.fixture
def cluster():
    with ds.LocalCluster(num_workers=2) as c:
        yield c


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "this iterator joined repetition" in line]


@pytest.mark.timeout(180)
def test_a_trainer_restarted_mid_epoch_is_told_it_gets_only_what_is_left(cluster):
    first = _trainer(cluster, "rejoin", die_in_epoch=0, die_after=1000)
    assert first.returncode == 9, first.stderr
    again = _trainer(cluster, "rejoin")
    assert again.returncode == 0, again.stderr
    epochs = again.stdout.split("\n")
    got0 = int(epochs[0].split()[2])
    # DYNAMIC: what the killed trainer took (and what its workers had sent it
    # ahead) is gone from repetition 0; the next repetition is whole.
    assert got0 < N - 1000 + 1 and epochs[1] == f"epoch 1: {N} {N}", again.stdout
    (warning,) = _warnings(again.stderr)
    assert "job 'rejoin'" in warning and "repetition 0 after its earlier consumers" in warning
    assert "1 attached, each exited or not heard from lately" in warning
    assert "DYNAMIC splits handed out" in warning and "new job_name" in warning


@pytest.mark.timeout(180)
def test_a_trainer_restarted_in_its_second_epoch_is_told_its_first_is_empty(cluster):
    first = _trainer(cluster, "rejoin2", die_in_epoch=1, die_after=1000)
    assert first.returncode == 9 and first.stdout.startswith(f"epoch 0: {N} {N}"), first
    again = _trainer(cluster, "rejoin2")
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("epoch 0: 0 0\n"), again.stdout
    warnings = _warnings(again.stderr)
    assert len(warnings) == 2, again.stderr
    assert "repetition 0, which earlier consumers already read to its end" in warnings[0]
    assert "repetition 1 after its earlier consumers" in warnings[1]


@pytest.mark.timeout(180)
def test_consumers_reading_a_named_job_together_are_not_warned(cluster, tmp_path):
    """Two live trainers sharing one named job (its intended use): no warning,
    and together they read each element of each repetition once. (They start
    their reads together and each repetition takes ~1 s: one started a second
    after the other ended a repetition would rightly be warned.)"""
    argv = [sys.executable, "-c", _TRAINER, cluster.target, "shared", "-1", "0", str(tmp_path), "2"]
    procs = [
        subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(cluster),
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    for _, stderr in outs:
        assert not _warnings(stderr), stderr
    per_epoch = [sum(int(o[0].split("\n")[e].split()[2]) for o in outs) for e in range(2)]
    assert per_epoch == [N, N], outs
