"""ParquetDataset and WebDataset through the service: OFF (every worker reads all),
DYNAMIC (row groups / shards as splits: each row or sample once across 2 workers), FILE
(each worker its every-n-th file), errors raised on a worker reaching the consumer, and
one run on LocalCluster worker processes (which import pyarrow themselves)."""

from __future__ import annotations

import io
import tarfile
from collections import Counter

import numpy as np
import pytest

import dataservice as ds
from dataservice import errors
from tests.integration.modes_common import DYNAMIC, FILE, OFF, dist, registered, static_cluster

NUM_FILES = 4
ROWS_PER_FILE = 10


@pytest.fixture(scope="module")
def parquet_files(tmp_path_factory) -> list[str]:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    root = tmp_path_factory.mktemp("parquet")
    out = []
    for f in range(NUM_FILES):
        xs = np.arange(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE)
        table = pa.table(
            {
                "x": xs,
                "name": [f"row{x}" for x in xs],
                "vec": pa.array([[float(x), -float(x)] for x in xs], pa.list_(pa.float32(), 2)),
            }
        )
        path = str(root / f"part-{f}.parquet")
        pq.write_table(table, path, row_group_size=3)  # row groups of 3, 3, 3, 1 rows
        out.append(path)
    return out


@pytest.fixture(scope="module")
def tar_shards(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("shards")
    out = []
    for k in range(NUM_FILES):
        path = str(root / f"shard-{k:03d}.tar")
        with tarfile.open(path, "w") as tar:
            for i in range(k * 5, k * 5 + 5):
                for ext, data in [("cls", b"%d" % i), ("bin", bytes([i]) * 100)]:
                    info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        out.append(path)
    return out


def xs(elements) -> list[int]:
    return sorted(int(e["x"]) for e in elements)


ALL_ROWS = list(range(NUM_FILES * ROWS_PER_FILE))


@pytest.mark.timeout(90)
def test_parquet_off_dynamic(make_cluster, parquet_files):
    c = registered(make_cluster(2))
    d = ds.ParquetDataset(parquet_files)
    off = list(dist(d, c, OFF))
    assert xs(off) == sorted(ALL_ROWS * 2)  # each worker reads every row
    row = next(e for e in off if int(e["x"]) == 17)
    assert row["name"] == "row17" and row["vec"].tolist() == [17.0, -17.0]
    dynamic = dist(d, c, DYNAMIC, job_name="parquet-dyn")
    for epoch in range(2):  # each iterator is a new epoch (repetition) of the job
        got = list(dynamic)
        assert xs(got) == ALL_ROWS, f"epoch {epoch}: each row once across the 2 workers"
    batches = list(dist(ds.ParquetDataset(parquet_files, ["x"], batch_rows=2), c, DYNAMIC))
    # per file: row groups of 3, 3, 3, 1 rows -> batches of 2, 1, 2, 1, 2, 1, 1 rows
    assert sorted(len(b["x"]) for b in batches) == [1] * 16 + [2] * 12
    assert sorted(np.concatenate([b["x"] for b in batches]).tolist()) == ALL_ROWS


@pytest.mark.timeout(90)
def test_parquet_file_sharding(make_cluster, parquet_files):
    c = static_cluster(make_cluster, 2)
    it = iter(dist(ds.ParquetDataset(parquet_files, columns=["x"]), c, FILE))
    got = list(it)
    assert xs(got) == ALL_ROWS
    per_worker = sorted(w["elements"] for w in it.stats()["workers"].values())
    assert per_worker == [20, 20]  # files 0, 2 and 1, 3


@pytest.mark.timeout(90)
def test_parquet_error_on_a_worker_names_the_file(make_cluster, parquet_files, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = str(tmp_path / "nulls.parquet")
    pq.write_table(pa.table({"v": pa.array([1.0, None])}), path)
    c = registered(make_cluster(1))
    with pytest.raises(
        errors.InvalidArgumentError, match=r"column 'v' .*nulls.parquet row group 0"
    ):
        list(dist(ds.ParquetDataset(path), c, DYNAMIC))


@pytest.mark.timeout(90)
def test_webdataset_off_dynamic_file(make_cluster, tar_shards):
    c = registered(make_cluster(2))
    d = ds.WebDataset(tar_shards, decode=True)
    keys = [f"s{i:04d}" for i in range(NUM_FILES * 5)]
    off = list(dist(d, c, OFF))
    assert Counter(s["__key__"] for s in off) == Counter(keys * 2)
    sample = next(s for s in off if s["__key__"] == "s0007")
    assert sample["cls"] == 7 and sample["bin"] == b"\x07" * 100
    dynamic = dist(d, c, DYNAMIC, job_name="wds-dyn")
    for epoch in range(2):  # each iterator is a new epoch (repetition) of the job
        got = sorted(s["__key__"] for s in dynamic)
        assert got == keys, f"epoch {epoch}: each sample once across the 2 workers"
    s = static_cluster(make_cluster, 2)
    it = iter(dist(d, s, FILE))
    assert sorted(x["__key__"] for x in it) == keys
    assert sorted(w["elements"] for w in it.stats()["workers"].values()) == [10, 10]


@pytest.mark.timeout(90)
def test_webdataset_damaged_shard_raises_on_the_consumer(make_cluster, tar_shards, tmp_path):
    raw = open(tar_shards[0], "rb").read()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(raw[:3000])
    c = registered(make_cluster(1))
    with pytest.raises(errors.DataLossError, match=r"shard .*cut.tar"):
        list(dist(ds.WebDataset([tar_shards[1], str(cut)]), c, DYNAMIC))
    got = list(dist(ds.WebDataset([tar_shards[1], str(cut)], ignore_errors=True), c, DYNAMIC))
    assert len(got) == 5 + 1  # shard 1, then the cut shard's first sample


@pytest.mark.timeout(120)
def test_parquet_dynamic_on_worker_processes(parquet_files):
    pytest.importorskip("pyarrow")
    d = ds.ParquetDataset(parquet_files, columns=["x", "vec"])
    with ds.LocalCluster(num_workers=2) as cluster:
        got = list(dist(d, cluster.target, DYNAMIC))
    assert xs(got) == ALL_ROWS
    assert all(e["vec"].tolist() == [e["x"], -e["x"]] for e in got)


@pytest.mark.timeout(90)
def test_list_files_interleave_readers_under_dynamic(make_cluster, tar_shards, parquet_files):
    """The README's pattern for a shuffled, parallel file order: `list_files(seed=...)`
    is the splittable source and each worker interleaves a reader over its files."""
    c = registered(make_cluster(2))
    root = tar_shards[0].rsplit("/", 1)[0]
    shards = ds.Dataset.list_files(f"{root}/*.tar", seed=3).interleave(
        lambda s: ds.WebDataset(s), cycle_length=2
    )
    keys = sorted(s["__key__"] for s in dist(shards, c, DYNAMIC))
    assert keys == [f"s{i:04d}" for i in range(NUM_FILES * 5)]
    pytest.importorskip("pyarrow")
    root = parquet_files[0].rsplit("/", 1)[0]
    rows = ds.Dataset.list_files(f"{root}/*.parquet", seed=3).interleave(
        lambda f: ds.ParquetDataset(f, columns=["x"]), cycle_length=2, num_parallel_calls=2
    )
    assert xs(dist(rows, c, DYNAMIC)) == ALL_ROWS
