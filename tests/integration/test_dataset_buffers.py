"""Big buffers of registered datasets kept in the dispatcher's files (C-19):
the worker's inline fallback, and fault-tolerant restarts that rebuild them."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import psutil
import pytest

import dataservice as ds
from dataservice.dispatcher.server import BUFFERS_SUBDIR
from tests.conftest import values

serialize = importlib.import_module("dataservice.data.serialize")  # the module, not the function
SOURCE = np.arange(1 << 18, dtype=np.int64)  # 2 MiB: out of band
FILE_NAME = hashlib.sha256(SOURCE.tobytes()).hexdigest()


@pytest.mark.timeout(60)
def test_a_worker_that_cannot_map_the_files_gets_the_buffers_inline(
    make_cluster, monkeypatch, caplog
):
    def cannot_map(path: str, size_bytes: int):
        raise PermissionError(f"cannot open {path}")

    monkeypatch.setattr(serialize, "map_buffer_file", cannot_map)
    cluster = make_cluster(1)
    dataset = ds.Dataset.from_tensor_slices(SOURCE).batch(1 << 16)
    with caplog.at_level(logging.WARNING, logger="dataservice.worker.server"):
        got = values(dataset.apply(ds.distribute(ds.ShardingPolicy.OFF, cluster.target)))
    assert got == [list(range(i, i + (1 << 16))) for i in range(0, 1 << 18, 1 << 16)]
    assert "fetching them inline" in caplog.text


@pytest.mark.timeout(90)
def test_fault_tolerant_restart_rebuilds_missing_buffer_files(make_cluster):
    cluster = make_cluster(1, fault_tolerant=True)
    buffers_dir = os.path.join(cluster.work_dir, BUFFERS_SUBDIR)
    dataset_id = ds.register_dataset(cluster.target, ds.Dataset.from_tensor_slices(SOURCE))
    assert os.listdir(buffers_dir) == [FILE_NAME]
    port = int(cluster.target.rsplit(":", 1)[1])
    cluster.dispatcher.stop()
    os.unlink(os.path.join(buffers_dir, FILE_NAME))
    with open(os.path.join(buffers_dir, "stray"), "wb") as f:
        f.write(b"from a run that did not journal it")
    cluster.dispatcher = ds.DispatchServer(
        dataclasses.replace(cluster.dispatcher_config, port=port)
    )
    assert os.listdir(buffers_dir) == [FILE_NAME]
    # DYNAMIC: the restarted dispatcher maps the file for its split provider too.
    read = ds.from_dataset_id(ds.ShardingPolicy.DYNAMIC, cluster.target, dataset_id)
    assert sorted(values(read)) == SOURCE.tolist()
    cluster.dispatcher.stop()
    assert os.listdir(buffers_dir) == [FILE_NAME]  # kept with the journal


def bytes_list_source(total_bytes: int, max_item_bytes: int, seed: int) -> list[bytes]:
    """Random distinct `bytes` items of `max_item_bytes // 4` to `max_item_bytes`,
    `total_bytes` in all, after a first item that is empty."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(
        max_item_bytes // 4, max_item_bytes, size=4 * total_bytes // max_item_bytes
    )
    sizes = sizes[: int(np.searchsorted(np.cumsum(sizes), total_bytes))]
    data = rng.bytes(int(sizes.sum()))
    ends = np.cumsum(sizes).tolist()
    return [b""] + [data[e - s : e] for s, e in zip(sizes.tolist(), ends, strict=True)]


def summed_worker_pss(
    dataset: ds.Dataset, check_epoch: Callable[[Iterable[Any]], None], source_bytes: int
) -> dict[str, int]:
    """Reads `dataset` from LocalCluster(2) in OFF mode (each worker reads all of
    it) over gRPC for 2 epochs, handing each epoch's elements to `check_epoch`;
    the summed PSS (bytes) of the worker processes before, and after each epoch
    once it is under baseline + 1.5 x `source_bytes` or 10 s have passed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # freed buffers go back to the OS
        cluster = ds.LocalCluster(2)
    with cluster:
        pids = cluster.worker_pids

        def pss() -> int:
            return sum(psutil.Process(p).memory_full_info().pss for p in pids)

        result = {"baseline": pss()}
        distributed = dataset.apply(
            ds.distribute(ds.ShardingPolicy.OFF, cluster.target, data_transfer_protocol="grpc")
        )
        for epoch in (1, 2):
            check_epoch(iter(distributed))
            settled = result["baseline"] + 1.5 * source_bytes
            deadline = time.monotonic() + 10
            while pss() >= settled and time.monotonic() < deadline:
                time.sleep(0.1)  # the epoch's task buffers go away; the source stays
            result[f"after_epoch_{epoch}"] = pss()
    return result


def assert_about_one_copy(result: dict[str, int], source_bytes: int) -> None:
    for epoch in (1, 2):
        held = result[f"after_epoch_{epoch}"] - result["baseline"]
        assert held < 1.5 * source_bytes, (
            f"summed worker PSS {held >> 20} MiB over the idle workers after epoch {epoch}, "
            f"for a {source_bytes >> 20} MiB source: {result}"
        )


def read_small_items(source: list[bytes]) -> dict[str, int]:
    # Each worker reads every item and sends its CRC: the items themselves are
    # made and freed one at a time (read_small_items_whole sends them).
    expected = collections.Counter(zlib.crc32(b) for b in source * 2)

    def check_epoch(batches: Iterable[Any]) -> None:
        assert collections.Counter(c for b in batches for c in b.tolist()) == expected

    dataset = ds.Dataset.from_tensor_slices(source).map(zlib.crc32).batch(4096)
    return summed_worker_pss(dataset, check_epoch, sum(map(len, source)))


def read_small_items_whole(source: list[bytes]) -> dict[str, int]:
    # The items themselves, 4096 to a batch: each worker's task buffer holds up to
    # 64 MiB of small `bytes` objects, freed into malloc's bins as the client
    # reads them; the worker gives them back to the OS when its task ends.
    expected = collections.Counter(source * 2)

    def check_epoch(batches: Iterable[Any]) -> None:
        assert collections.Counter(item for b in batches for item in b) == expected

    dataset = ds.Dataset.from_tensor_slices(source).batch(4096)
    return summed_worker_pss(dataset, check_epoch, sum(map(len, source)))


def read_image_like_items(source: list[bytes], batch: int) -> dict[str, int]:
    # Items of 64 KiB and more: malloc gives each its own mapping, returned when
    # it is freed, so the idle workers hold only the source.
    first_of_batch = {source[i]: i for i in range(0, len(source), batch)}

    def check_epoch(batches: Iterable[Any]) -> None:
        reads = dict.fromkeys(first_of_batch.values(), 0)
        for b in batches:
            i = first_of_batch[b[0]]
            assert list(b) == source[i : i + batch]
            reads[i] += 1
        assert set(reads.values()) == {2}  # OFF: each worker read every batch once

    dataset = ds.Dataset.from_tensor_slices(source).batch(batch)
    return summed_worker_pss(dataset, check_epoch, sum(map(len, source)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_big_list_of_small_bytes_is_not_copied_once_per_worker():
    # A list of bytes is one arena of uint8 plus its offsets: both travel out of
    # band and both workers map the dispatcher's files (C-19: "8M strings of 1 KB").
    source = bytes_list_source(64 << 20, max_item_bytes=2 << 10, seed=19)
    assert_about_one_copy(read_small_items(source), sum(map(len, source)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_small_items_sent_whole_leave_no_task_buffer_behind():
    # Was 2.6-3.9x (each worker ~64 MiB up after the epoch: the freed small items
    # stayed with malloc) before workers called malloc_trim when tasks end.
    source = bytes_list_source(64 << 20, max_item_bytes=2 << 10, seed=21)
    assert_about_one_copy(read_small_items_whole(source), sum(map(len, source)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_big_list_of_encoded_images_is_not_copied_once_per_worker():
    source = bytes_list_source(64 << 20, max_item_bytes=256 << 10, seed=20)
    result = read_image_like_items(source, batch=8)
    assert_about_one_copy(result, sum(map(len, source)))
