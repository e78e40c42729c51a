"""Static sharding rewrites (`data.static_sharding.apply_static_sharding`) without servers:
the exact elements each worker index gets, FILE_OR_DATA's fallback to DATA
with fewer files than workers (C-29), and what each error names."""

from __future__ import annotations

import logging

import pytest

import dataservice as ds
from dataservice import errors
from dataservice.data.static_sharding import apply_static_sharding
from dataservice.sharding import ShardingPolicy

FILE = ShardingPolicy.FILE
FILE_OR_DATA = ShardingPolicy.FILE_OR_DATA


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    """f0.tfrecord .. f6.tfrecord, 3 records each: b"f r"."""
    d = tmp_path_factory.mktemp("sharding")
    names = []
    for f in range(7):
        path = str(d / f"f{f}.tfrecord")
        with ds.io.TFRecordWriter(path) as w:
            for r in range(3):
                w.write(b"%d %d" % (f, r))
        names.append(path)
    return names


def read(names: list[str]):
    return ds.Dataset.list_files(names, shuffle=False).flat_map(lambda f: ds.TFRecordDataset(f))


def shards(dataset, policy: ShardingPolicy, num_workers: int) -> list[list[bytes]]:
    return [
        list(apply_static_sharding(dataset, policy, num_workers, i)) for i in range(num_workers)
    ]


@pytest.mark.timeout(30)
def test_file_or_data_with_enough_files_shards_by_file(files):
    got = shards(read(files), FILE_OR_DATA, 4)
    assert got == [[b"%d %d" % (f, r) for f in range(i, 7, 4) for r in range(3)] for i in range(4)]


@pytest.mark.timeout(30)
def test_file_or_data_with_fewer_files_than_workers_shards_by_data(files, caplog):
    every = [b"%d %d" % (f, r) for f in (0, 1) for r in range(3)]
    with caplog.at_level(logging.INFO, logger="dataservice.sharding"):
        got = shards(read(files[:2]), FILE_OR_DATA, 4)
        again = shards(read(files[:2]), FILE_OR_DATA, 4)  # a later epoch: no second line
    # DATA sharding: worker i keeps elements i, i + 4, ... of the whole stream.
    assert got == again == [every[i::4] for i in range(4)]
    fallback = [r for r in caplog.records if "FILE_OR_DATA" in r.getMessage()]
    assert len(fallback) == 1 and fallback[0].levelno == logging.INFO
    assert "2 files for 4 workers" in fallback[0].getMessage()
    assert "DATA" in fallback[0].getMessage()


@pytest.mark.timeout(30)
def test_file_or_data_without_a_file_source_shards_by_data():
    assert shards(ds.Dataset.range(10), FILE_OR_DATA, 3) == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


@pytest.mark.timeout(30)
def test_file_with_fewer_files_than_workers_names_policy_and_both_counts(files):
    with pytest.raises(errors.FailedPreconditionError) as err:
        apply_static_sharding(read(files[:2]), FILE, 4, 0)
    message = str(err.value)
    assert message.startswith("FILE sharding: not enough files")
    assert "2 files for 4 workers" in message


@pytest.mark.timeout(30)
def test_file_without_a_file_source_names_policy_and_both_counts():
    with pytest.raises(errors.InvalidArgumentError) as err:
        apply_static_sharding(ds.Dataset.range(10), FILE, 4, 0)
    message = str(err.value)
    assert message.startswith("FILE sharding: the pipeline is unshardable")
    assert "0 files for 4 workers" in message
