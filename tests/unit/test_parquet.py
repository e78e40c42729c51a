"""ParquetDataset in-process: values by Arrow type, column selection, record batches,
element_spec / cardinality from the footers, row groups as splits, FILE sharding,
fingerprints, and the errors (each naming the file / column / type at fault)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import dataservice as ds
from dataservice import errors
from dataservice.data import graph
from dataservice.data.serialize import deserialize, fingerprint, serialize
from dataservice.data.static_sharding import shard_files
from dataservice.sharding import ShardingPolicy
from tests.conftest import to_py

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.timeout(60)


def write(path, table, row_group_size=None) -> str:
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


def numbered(path, first: int, n: int, row_group_size: int) -> str:
    """A file of rows first..first+n-1: x int64, name str, raw bytes, vec list<float32>."""
    xs = list(range(first, first + n))
    table = pa.table(
        {
            "x": pa.array(xs, pa.int64()),
            "name": [f"row{x}" for x in xs],
            "raw": [bytes([x % 256]) * 2 for x in xs],
            "vec": pa.array([[float(x)] * (x % 3) for x in xs], pa.list_(pa.float32())),
        }
    )
    return write(path, table, row_group_size)


@pytest.fixture
def files(tmp_path) -> list[str]:
    # 3 files, 10 rows each, row groups of 4 rows: 3 row groups per file (4, 4, 2)
    return [numbered(tmp_path / f"part-{i}.parquet", 10 * i, 10, 4) for i in range(3)]


def test_rows_are_dicts_of_numpy_values(files):
    got = list(ds.ParquetDataset(files[0]))
    assert len(got) == 10
    row = got[4]
    assert list(row) == ["x", "name", "raw", "vec"]
    assert isinstance(row["x"], np.int64) and row["x"] == 4
    assert row["name"] == "row4" and type(row["name"]) is str
    assert row["raw"] == b"\x04\x04" and type(row["raw"]) is bytes
    assert row["vec"].dtype == np.float32 and row["vec"].tolist() == [4.0]
    assert [int(r["x"]) for r in ds.ParquetDataset(files)] == list(range(30))


def test_element_spec_and_cardinality_come_from_the_footers(files):
    d = ds.ParquetDataset(files)
    assert d.cardinality() == 30
    assert d.element_spec == {
        "x": ds.TensorSpec((), np.int64),
        "name": ds.TensorSpec((), str),
        "raw": ds.TensorSpec((), bytes),
        "vec": ds.TensorSpec((None,), np.float32),
    }
    b = ds.ParquetDataset(files, columns=["x", "name"], batch_rows=3)
    # per file: row groups of 4, 4, 2 rows -> 2 + 2 + 1 batches
    assert b.cardinality() == 15 == len(list(b))
    assert b.element_spec == {
        "x": ds.TensorSpec((None,), np.int64),
        "name": ds.TensorSpec((None,), np.dtype(str)),
    }
    for element in d.take(3):
        assert ds.data.structure.is_compatible(d.element_spec, element)


def test_column_selection_keeps_the_given_order(files):
    got = list(ds.ParquetDataset(files[1], columns=["name", "x"]))
    assert [list(r) for r in got[:1]] == [["name", "x"]]
    assert [(r["name"], int(r["x"])) for r in got[:2]] == [("row10", 10), ("row11", 11)]


def test_batch_rows_cuts_each_row_group_and_never_spans_two(files):
    got = list(ds.ParquetDataset(files[0], columns=["x", "name", "raw"], batch_rows=3))
    assert [b["x"].tolist() for b in got] == [[0, 1, 2], [3], [4, 5, 6], [7], [8, 9]]
    assert got[0]["name"].tolist() == ["row0", "row1", "row2"]
    assert got[0]["raw"].dtype == object
    assert got[0]["raw"].tolist() == [b"\0\0", b"\1\1", b"\2\2"]
    # vec lists of rows 0, 1, 2 have lengths 0, 1, 2: they cannot be stacked
    with pytest.raises(errors.InvalidArgumentError, match=r"column 'vec'.*row group 0"):
        list(ds.ParquetDataset(files[0], batch_rows=3))
    ok = list(ds.ParquetDataset(files[0], columns=["x"], batch_rows=100))
    assert [b["x"].tolist() for b in ok] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_batch_rows_larger_than_pyarrow_batches_is_recut(tmp_path):
    path = write(tmp_path / "big.parquet", pa.table({"x": np.arange(10_000)}), 10_000)
    got = list(ds.ParquetDataset(path, batch_rows=3000))
    assert [len(b["x"]) for b in got] == [3000, 3000, 3000, 1000]
    assert np.concatenate([b["x"] for b in got]).tolist() == list(range(10_000))


def test_nested_types(tmp_path):
    table = pa.table(
        {
            "fixed": pa.array([[1, 2], [3, 4]], pa.list_(pa.int16(), 2)),
            "points": pa.array(
                [[[0.0, 1.0, 2.0]], [[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]],
                pa.large_list(pa.list_(pa.float64(), 3)),
            ),
            "s": pa.array([{"a": 1, "b": "u"}, {"a": 2, "b": "v"}]),
            "cat": pa.array(["p", "q"]).dictionary_encode(),
            "t": pa.array(np.array([5, 6], dtype="datetime64[ms]")),
            "flag": [True, False],
        }
    )
    d = ds.ParquetDataset(write(tmp_path / "n.parquet", table))
    assert d.element_spec == {
        "fixed": ds.TensorSpec((2,), np.int16),
        "points": ds.TensorSpec((None, 3), np.float64),
        "s": {"a": ds.TensorSpec((), np.int64), "b": ds.TensorSpec((), str)},
        "cat": ds.TensorSpec((), str),
        "t": ds.TensorSpec((), np.dtype("datetime64[ms]")),
        "flag": ds.TensorSpec((), np.bool_),
    }
    rows = list(d)
    assert rows[1]["points"].shape == (2, 3) and rows[1]["points"][1].tolist() == [6, 7, 8]
    assert rows[0]["fixed"].dtype == np.int16
    assert to_py(rows[1]) == {
        "fixed": [3, 4],
        "points": [[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]],
        "s": {"a": 2, "b": "v"},
        "cat": "q",
        "t": rows[1]["t"].item(),
        "flag": False,
    }
    assert rows[1]["t"] == np.datetime64(6, "ms")
    columns = ["fixed", "s", "cat"]  # not `points`: its lists have lengths 1 and 2
    batch = next(iter(ds.ParquetDataset(d.filenames, columns, batch_rows=2)))
    assert batch["fixed"].shape == (2, 2) and batch["s"]["a"].tolist() == [1, 2]
    assert batch["cat"].tolist() == ["p", "q"]


def test_unsupported_types_are_refused_naming_the_column(tmp_path):
    table = pa.table(
        {
            "ok": [1, 2],
            "m": pa.array([[("k", 1)], [("j", 2)]], pa.map_(pa.string(), pa.int64())),
            "tags": pa.array([["a"], ["b", "c"]]),
            "ragged": pa.array([[[1], [2, 3]], [[4]]]),
        }
    )
    path = write(tmp_path / "u.parquet", table)
    with pytest.raises(errors.InvalidArgumentError, match=r"column 'm' has Arrow type map<"):
        ds.ParquetDataset(path)
    with pytest.raises(errors.InvalidArgumentError, match=r"column 'tags'.*list<.*string"):
        ds.ParquetDataset(path, columns=["tags"])
    with pytest.raises(errors.InvalidArgumentError, match=r"column 'ragged'.*ragged"):
        ds.ParquetDataset(path, columns=["ragged"])
    assert [int(r["ok"]) for r in ds.ParquetDataset(path, columns=["ok"])] == [1, 2]


def test_nulls_are_refused_when_read_naming_column_file_and_row_group(tmp_path):
    path = write(tmp_path / "nulls.parquet", pa.table({"v": [1.0, None, 3.0]}), 2)
    d = ds.ParquetDataset(path)
    with pytest.raises(errors.InvalidArgumentError) as info:
        list(d)
    assert "column 'v'" in str(info.value) and f"{path} row group 0" in str(info.value)


def test_errors_name_the_file_or_column(tmp_path, files):
    missing = str(tmp_path / "missing.parquet")
    with pytest.raises(errors.NotFoundError, match=f"{missing}: no such file"):
        ds.ParquetDataset([files[0], missing])
    text = tmp_path / "notes.parquet"
    text.write_text("not parquet at all, just text")
    with pytest.raises(errors.InvalidArgumentError, match=f"{text} is not a readable Parquet"):
        ds.ParquetDataset(str(text))
    with pytest.raises(errors.InvalidArgumentError, match=r"column 'nope' is not in .*part-0"):
        ds.ParquetDataset(files[0], columns=["x", "nope"])
    other = write(tmp_path / "other.parquet", pa.table({"x": pa.array([1], pa.int32())}))
    with pytest.raises(errors.InvalidArgumentError, match=r"'x' has type int32 in .*other"):
        ds.ParquetDataset([files[0], other], columns=["x"])
    with pytest.raises(errors.InvalidArgumentError, match=r"other.parquet has columns"):
        ds.ParquetDataset([files[0], other])
    with pytest.raises(errors.InvalidArgumentError, match="batch_rows"):
        ds.ParquetDataset(files[0], batch_rows=0)
    with pytest.raises(TypeError, match="columns"):
        ds.ParquetDataset(files[0], columns="x")
    with pytest.raises(TypeError, match="interleave"):
        ds.ParquetDataset(ds.Dataset.list_files(files[0]))


def test_a_file_changed_or_removed_after_building_is_an_error_at_read(tmp_path, files):
    d = ds.ParquetDataset(files[0])
    numbered(files[0], 0, 5, 5)  # now 1 row group of 5 rows
    with pytest.raises(errors.FailedPreconditionError, match="changed since the dataset"):
        list(d)
    os.remove(files[0])
    with pytest.raises(errors.NotFoundError, match="part-0.parquet: no such file"):
        list(d)


class _Worker:
    """One worker's split source: pulls from the shared dispatcher-side provider."""

    def __init__(self, provider) -> None:
        self.provider = provider
        self.taken = 0

    def get_next(self):
        split = self.provider.get_next()
        self.taken += split is not None
        return split


def test_row_groups_are_splits_each_row_once_across_two_workers(files):
    d = ds.ParquetDataset(files, columns=["x"])
    (provider,) = graph.split_providers(d, seed=0)
    assert provider.cardinality() == 9  # 3 files x 3 row groups
    workers = [_Worker(provider), _Worker(provider)]
    its = [graph.make_iterator(d, (w,)) for w in workers]
    got: list[list[int]] = [[], []]
    live = [0, 1]
    while live:
        for k in list(live):
            row = next(its[k], None)
            if row is None:
                live.remove(k)
            else:
                got[k].append(int(row["x"]))
    assert sorted(got[0] + got[1]) == list(range(30))
    assert workers[0].taken > 0 and workers[1].taken > 0


def test_batches_from_splits_match_the_row_groups(files):
    d = ds.ParquetDataset(files, columns=["x"], batch_rows=4)
    (provider,) = graph.split_providers(d, seed=0)
    for _ in range(4):  # skip to split 4: file 1, row group 1 (rows 14..17)
        provider.get_next()
    got = [b["x"].tolist() for b in graph.make_iterator(d, (_Worker(provider),))]
    assert got == [[14, 15, 16, 17], [18, 19], [20, 21, 22, 23], [24, 25, 26, 27], [28, 29]]


def test_file_sharding_gives_each_worker_every_nth_file(files):
    d = ds.ParquetDataset(files, columns=["x"])
    assert graph.source_files(d) == tuple(files)
    shard = shard_files(d, ShardingPolicy.FILE, 2, 1)
    assert shard.cardinality() == 10
    assert [int(r["x"]) for r in shard] == list(range(10, 20))
    assert [int(r["x"]) for r in shard_files(d, ShardingPolicy.FILE, 2, 0)] == [
        *range(10),
        *range(20, 30),
    ]


def test_fingerprint_depends_on_the_arguments_not_on_where_the_code_is(files):
    a = ds.ParquetDataset(files, columns=["x"])
    assert fingerprint(a) == fingerprint(ds.ParquetDataset(files, ["x"]))
    assert fingerprint(a) != fingerprint(ds.ParquetDataset(files))
    blob = serialize(a.map(lambda r: r["x"]))
    package = os.path.dirname(ds.__file__)
    assert package.encode() not in blob  # classes by reference, not by file
    back = deserialize(blob)
    assert [int(x) for x in back] == list(range(30))


def test_relative_names_are_kept_as_given(tmp_path, files, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = ds.ParquetDataset(["part-2.parquet"], columns=["x"])
    assert d.filenames == ("part-2.parquet",)
    other = tmp_path / "elsewhere"
    other.mkdir()
    shutil.copy(files[2], other / "part-2.parquet")
    monkeypatch.chdir(other)
    fp = fingerprint(ds.ParquetDataset(["part-2.parquet"], columns=["x"]))
    assert fp == fingerprint(d)


def test_import_dataservice_does_not_import_pyarrow():
    code = "import sys, dataservice; print('pyarrow' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


def test_docstring_example_runs():
    import doctest

    from dataservice.data import parquet

    result = doctest.testmod(parquet, raise_on_error=False, verbose=False)
    assert result.attempted >= 4 and result.failed == 0


def _interleaved(groups: list[list[int]], cycle: int) -> list[int]:
    """tf.data's interleave order with block_length 1 over `groups`."""
    pending, slots, out = list(groups), [], []
    while pending or slots:
        while len(slots) < cycle and pending:
            slots.append(list(pending.pop(0)))
        for slot in list(slots):
            out.append(slot.pop(0))
        for slot in [s for s in slots if not s]:
            slots.remove(slot)
    return out


def test_num_parallel_reads_interleaves_row_groups(files):
    d = ds.ParquetDataset(files[:2], columns=["x"], num_parallel_reads=2)
    groups = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16, 17], [18, 19]]
    assert [int(r["x"]) for r in d] == _interleaved(groups, 2)
    (provider,) = graph.split_providers(d, seed=0)
    got = [int(r["x"]) for r in graph.make_iterator(d, (_Worker(provider),))]
    assert got == _interleaved(groups, 2)
    auto = ds.ParquetDataset(files, columns=["x"], num_parallel_reads=ds.AUTOTUNE)
    assert sorted(int(r["x"]) for r in auto) == list(range(30))
    assert fingerprint(auto) == fingerprint(ds.ParquetDataset(files, ["x"], None, ds.AUTOTUNE))
    with pytest.raises(errors.InvalidArgumentError, match="positive or AUTOTUNE"):
        ds.ParquetDataset(files, num_parallel_reads=0)
