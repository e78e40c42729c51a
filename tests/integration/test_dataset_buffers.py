"""Big buffers of registered datasets kept in the dispatcher's files (C-19):
the worker's inline fallback, and fault-tolerant restarts that rebuild them."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import logging
import os

import numpy as np
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
