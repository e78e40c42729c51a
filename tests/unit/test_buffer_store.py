"""The dispatcher's buffer files (dispatcher/buffer_store.py): content-addressed,
shared by equal buffers, read back inline, and nothing left behind."""

from __future__ import annotations

import glob
import hashlib
import os
import tempfile

import numpy as np
import pytest

from dataservice import errors
from dataservice.data.dataset import Dataset
from dataservice.data.serialize import MIN_SHARED_BUFFER_BYTES, load, parse, serialize
from dataservice.dispatcher import buffer_store
from dataservice.dispatcher.buffer_store import BufferStore

N = MIN_SHARED_BUFFER_BYTES // 8  # int64 items in one MiB


def definition_of(*arrays: np.ndarray):
    dataset = Dataset.from_tensor_slices(arrays[0])
    for a in arrays[1:]:
        dataset = dataset.concatenate(Dataset.from_tensor_slices(a))
    return parse(serialize(dataset))


def test_put_writes_each_buffer_once_named_by_its_hash(tmp_path):
    a, b = np.arange(N, dtype=np.int64), np.arange(N, dtype=np.int64) + 1
    store = BufferStore(str(tmp_path / "buffers"))
    first = store.put(definition_of(a, b))
    second = store.put(definition_of(b, a, a.copy()))  # equal buffers share the files
    paths = [x.path for x in first.buffers]
    assert [os.path.basename(p) for p in paths] == [
        hashlib.sha256(a.tobytes()).hexdigest(),
        hashlib.sha256(b.tobytes()).hexdigest(),
    ]
    assert [x.path for x in second.buffers] == [paths[1], paths[0], paths[0]]
    assert sorted(os.listdir(tmp_path / "buffers")) == sorted(os.path.basename(p) for p in paths)
    assert all(not x.data and x.size_bytes == a.nbytes for x in first.buffers)
    assert [int(x) for x in load(second).take(2)] == [1, 2]
    inline = store.inline(second)
    assert [x.data for x in inline.buffers] == [b.tobytes(), a.tobytes(), a.tobytes()]
    assert inline.pickle == second.pickle


def test_private_directory_is_made_on_demand_and_deleted_by_close():
    pattern = os.path.join(tempfile.gettempdir(), f"dataservice-dispatcher-{os.getpid()}-*")
    before = set(glob.glob(pattern))
    store = BufferStore(None)
    store.put(parse(serialize(Dataset.range(3))))  # no big buffer: no directory
    assert set(glob.glob(pattern)) == before
    stored = store.put(definition_of(np.zeros(N, np.int64)))
    (made,) = set(glob.glob(pattern)) - before
    assert stored.buffers[0].path.startswith(made + os.sep)
    dataset = load(stored)  # maps the file
    store.close()
    assert not os.path.exists(made)
    assert int(next(iter(dataset))) == 0  # a mapped file outlives its deletion
    store.close()  # idempotent


def test_remove_private_dirs_of_a_dead_dispatcher(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = tmp_path / "dataservice-dispatcher-4242-abc"
    other = tmp_path / "dataservice-dispatcher-42420-abc"
    for d in (mine, other):
        d.mkdir()
        (d / "f").write_bytes(b"x")
    buffer_store.remove_private_dirs(4242)
    assert not mine.exists() and other.exists()


def test_retain_only_deletes_stray_files(tmp_path):
    store = BufferStore(str(tmp_path))
    kept = store.put(definition_of(np.ones(N, np.int64)))
    (tmp_path / "stray").write_bytes(b"x")
    (tmp_path / "torn.tmp").write_bytes(b"x")
    store.retain_only([kept])
    assert os.listdir(tmp_path) == [os.path.basename(kept.buffers[0].path)]


def test_an_unwritable_directory_keeps_buffers_inline(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    stored = BufferStore(str(not_a_dir)).put(definition_of(np.ones(N, np.int64)))
    assert not stored.buffers[0].path
    assert stored.buffers[0].data == np.ones(N, np.int64).tobytes()


def test_inline_of_a_deleted_file_is_data_loss(tmp_path):
    store = BufferStore(str(tmp_path))
    stored = store.put(definition_of(np.ones(N, np.int64)))
    os.unlink(stored.buffers[0].path)
    with pytest.raises(errors.DataLossError, match="unreadable"):
        store.inline(stored)
