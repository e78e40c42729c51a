"""The pipeline ops of batching_ops.py, mixing_ops.py, cache_ops.py and error_ops.py
served by the data service: two in-process workers (ShardingPolicy OFF: every worker
produces the whole dataset; DYNAMIC: each element once per epoch across the workers,
batches and windows formed on each worker from its own splits), and worker processes
of a `LocalCluster`. Element specs seen through the service match the in-process ones,
and `ignore_errors`'s skipped elements reach the consumer's `stats()`."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import dataservice as ds
from tests.conftest import to_py, values
from tests.integration.modes_common import DYNAMIC, OFF, cached, dist

D = ds.Dataset
README = Path(__file__).resolve().parents[2] / "README.md"
MODES = [OFF, DYNAMIC]
pytestmark = pytest.mark.timeout(120)


def copies(mode: ds.ShardingPolicy) -> int:
    """How many times each element comes in an epoch on the 2-worker cluster."""
    return 2 if mode == OFF else 1


def rows_of(batches: list) -> list[int]:
    """The x of each padded row `[x] * n + [0] * pad` (x >= 1), checking its shape."""
    out = []
    for batch in batches:
        for row in batch:
            x = row[0]
            n = x % 5 + 1
            assert row == [x] * n + [0] * (len(row) - n), row
            out.append(x)
    return out


def flat(batches: list) -> list[int]:
    return [x for b in batches for x in b]


def read(dataset, cluster, mode, **kw) -> tuple[list, dict]:
    it = iter(dist(dataset, cluster, mode, **kw))
    got = [to_py(e) for e in it]
    return got, it.stats()


# ---------------------------------------------------------------------------- batching


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_unbatch_rebatch_window_through_the_service(cluster2, mode):
    n = copies(mode)
    unbatched = D.range(40).batch(3).unbatch()
    got, _ = read(unbatched, cluster2, mode)
    assert Counter(got) == Counter(list(range(40)) * n)
    assert dist(unbatched, cluster2, mode).element_spec == ds.TensorSpec((), np.int64)
    rebatched = D.range(40).batch(4, drop_remainder=True).rebatch(2, drop_remainder=True)
    assert dist(rebatched, cluster2, mode).element_spec == ds.TensorSpec((2,), np.int64)
    assert dist(rebatched, cluster2, mode).cardinality() == ds.UNKNOWN_CARDINALITY
    assert rebatched.cardinality() == 20
    got, _ = read(D.range(40).batch(3).rebatch(4), cluster2, mode)
    assert Counter(flat(got)) == Counter(list(range(40)) * n)
    # Only a worker's last batch may be short (none under OFF: 40 rows each).
    assert sum(len(b) != 4 for b in got) <= (0 if mode == OFF else 2)
    windows = D.range(40).window(4).flat_map(lambda w: w.batch(4))
    got, _ = read(windows, cluster2, mode)
    assert Counter(flat(got)) == Counter(list(range(40)) * n)
    if mode == OFF:
        assert sorted(got) == sorted(values(windows) * 2)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_padded_batch_and_buckets_through_the_service(cluster2, mode):
    n = copies(mode)
    ragged = D.range(1, 41).map(lambda x: np.full(int(x) % 5 + 1, x))
    padded = ragged.padded_batch(3)
    got, _ = read(padded, cluster2, mode)
    assert Counter(rows_of(got)) == Counter(list(range(1, 41)) * n)
    # The spec is not static (after a map): the service's comes from an element.
    assert padded.element_spec.is_compatible_with(dist(padded, cluster2, mode).element_spec)
    buckets = ragged.bucket_by_sequence_length(len, [3], [2, 3])
    got, _ = read(buckets, cluster2, mode)
    assert Counter(rows_of(got)) == Counter(list(range(1, 41)) * n)
    for batch in got:  # every batch holds one bucket: lengths < 3, or >= 3
        lengths = {row[0] % 5 + 1 < 3 for row in batch}
        assert len(lengths) == 1


# ---------------------------------------------------------------------------- mixing


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_sample_and_choose_through_the_service(cluster2, mode):
    n = copies(mode)
    a, b = D.range(0, 30), D.range(100, 130)
    both = list(range(30)) + list(range(100, 130))
    sample = D.sample_from_datasets([a, b], [0.3, 0.7], seed=11)
    got, _ = read(sample, cluster2, mode)
    assert Counter(got) == Counter(both * n)
    if mode == OFF:  # each worker runs the seeded pipeline whole: the same order
        assert sorted(got) == sorted(values(sample) * 2)
    choose = D.choose_from_datasets([a, b], D.range(2).repeat(), stop_on_empty_dataset=False)
    got, _ = read(choose, cluster2, mode)
    assert Counter(got) == Counter(both * n)
    # Each input's elements keep their order within a worker's stream.
    assert dist(choose, cluster2, mode).element_spec == ds.TensorSpec((), np.int64)


# ---------------------------------------------------------------------------- cache


def calls_logged(path: str):
    """A map function that appends a line to `path` per call (workers are copies)."""

    def f(x):
        with open(path, "a") as out:
            out.write(f"{int(x)}\n")
        return x

    return f


def count_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return len(f.readlines())


def test_memory_and_file_cache_under_off_read_the_input_once_per_worker(cluster2, tmp_path):
    log = str(tmp_path / "calls")
    memory = D.range(20).map(calls_logged(log)).cache()
    distributed = dist(memory, cluster2, OFF)
    for _ in range(2):
        assert Counter(to_py(e) for e in distributed) == Counter(list(range(20)) * 2)
        assert count_lines(log) == 40  # epoch 1 on each worker; epoch 2 from its cache

    log2, path = str(tmp_path / "calls2"), str(tmp_path / "cache")
    in_file = D.range(20).map(calls_logged(log2)).cache(path)
    distributed = dist(in_file, cluster2, OFF)
    assert Counter(to_py(e) for e in distributed) == Counter(list(range(20)) * 2)
    # Both workers share the path: one wrote it; the other read its input meanwhile
    # (20 more calls), or the file once it was complete.
    first = count_lines(log2)
    assert first in (20, 40) and os.path.exists(path + ".data")
    assert not os.path.exists(path + ".lockfile")
    assert Counter(to_py(e) for e in distributed) == Counter(list(range(20)) * 2)
    assert count_lines(log2) == first


def test_cache_under_dynamic_passes_elements_through(cluster2, tmp_path):
    log = str(tmp_path / "calls")
    distributed = dist(D.range(20).map(calls_logged(log)).cache(), cluster2, DYNAMIC)
    for epoch in range(2):
        assert sorted(to_py(e) for e in distributed) == list(range(20))
        assert count_lines(log) == 20 * (epoch + 1)


# ---------------------------------------------------------------------------- ignore_errors


def flaky(x):
    if int(x) % 5 == 3:
        raise ValueError(f"bad {int(x)}")
    return x


@pytest.mark.parametrize("protocol", ["grpc", "shm"])
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_ignore_errors_counted_by_workers_in_consumer_stats(cluster2, mode, protocol):
    pipeline = D.range(40).map(flaky).ignore_errors()
    got, stats = read(pipeline, cluster2, mode, data_transfer_protocol=protocol)
    kept = [x for x in range(40) if x % 5 != 3]
    assert Counter(got) == Counter(kept * copies(mode))
    assert stats["errors_ignored"] == 8 * copies(mode)
    assert {w["transfer_protocol"] for w in stats["workers"].values()} == {protocol}


def test_ignore_errors_on_the_consumer_side_adds_to_the_service_count(cluster):
    service = dist(D.range(10).map(flaky).ignore_errors(), cluster, OFF)
    it = iter(service.map(lambda x: 1 // (int(x) - 4) * 0 + x).ignore_errors())
    assert values(it) == [0, 1, 2, 5, 6, 7, 9]
    stats = it.stats()
    assert stats["errors_ignored"] == 2 + 1 and stats["elements"] == 8


def test_window_elements_cannot_leave_the_worker(cluster):
    with pytest.raises(ds.errors.DataServiceError, match="(?i)dataset|not a numpy|pickl"):
        values(dist(D.range(4).window(2), cluster, OFF))


# ---------------------------------------------------------------------------- processes


@pytest.mark.timeout(180)
def test_ops_on_local_cluster_worker_processes(tmp_path):
    pipeline = (
        D.sample_from_datasets([D.range(0, 50), D.range(100, 150)], seed=3)
        .map(flaky)
        .ignore_errors()
        .batch(4)
        .rebatch(3)
        .unbatch()
    )
    kept = [x for x in list(range(50)) + list(range(100, 150)) if x % 5 != 3]
    with ds.LocalCluster(num_workers=2) as cluster:
        for mode in MODES:
            it = iter(pipeline.apply(ds.distribute(mode, cluster.target)))
            got = [to_py(e) for e in it]
            assert Counter(got) == Counter(kept * copies(mode)), mode
            assert it.stats()["errors_ignored"] == 20 * copies(mode)


@pytest.mark.parametrize("protocol", ["grpc", "shm"])
def test_ignore_errors_counted_through_the_cross_trainer_cache(cluster, protocol):
    """A cached job's trainers read a window (over shm, the shared segment): the
    running count rides with each reply there too."""
    pipeline = D.range(10**6).map(flaky).ignore_errors().repeat()
    it = iter(cached(pipeline, cluster, "trainer-a", data_transfer_protocol=protocol))
    got = [to_py(next(it)) for _ in range(24)]
    assert got == [x for x in range(30) if x % 5 != 3]
    # Errors at 3, 8, ..., 28 come before these elements; the worker may have run ahead.
    assert it.stats()["errors_ignored"] >= 6
    it.close()


def test_readme_pipeline_ops_example_runs():
    """README.md's "Pipeline ops" example (a `py` block) runs as written."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Pipeline ops") :]
    section = section[: section.index("\n## ", 1)]
    (block,) = re.findall(r"```py\n(.*?)```", section, re.DOTALL)
    exec(compile(block, "README.md Pipeline ops block", "exec"), {})
