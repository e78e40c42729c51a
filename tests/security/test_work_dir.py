"""A fault-tolerant dispatcher reads back only what it wrote (issue 11).

Every kind of file in `work_dir` (journal snapshot, journal segment, dataset
definition, dataset buffer file) under every kind of damage (deleted,
truncated, a flipped byte, replaced by a FIFO, replaced by a symlink to
/etc/passwd) stops start-up with `DataLossError` naming the file, quickly
(nothing is opened in a way that blocks), except where README's "Recovering
a damaged work_dir" says otherwise: a deleted buffer file is rebuilt from the
journaled definition, and the newest journal segment cut short is a crash's
torn write. A
group-readable file is tightened to 0600 and read. Dataset ids that shared a
file name before are distinct; files are 0600 and folders 0700 whatever the
umask; an old-named work_dir is migrated, checked by each dataset's
fingerprint.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest

import dataservice as ds
from dataservice import errors
from dataservice.dispatcher import journal as journal_module
from dataservice.dispatcher import state as st
from dataservice.dispatcher.journal import Journal
from dataservice.dispatcher.server import BUFFERS_SUBDIR
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import service_pb2_grpc

serialize = importlib.import_module("dataservice.data.serialize")  # the module, not the function
pytestmark = pytest.mark.timeout(120)

BIG = np.arange(1 << 18, dtype=np.int64)  # 2 MiB: a buffer file
BIG_DIGEST = hashlib.sha256(BIG.tobytes()).hexdigest()
START_UP_S = 10.0  # a start-up that takes longer blocked on something


def _config(work_dir: str) -> ds.DispatcherConfig:
    return ds.DispatcherConfig(work_dir=work_dir, fault_tolerant_mode=True)


def _definition(target: str, dataset_id: str, local: bool = False):
    """The DatasetDef the dispatcher serves for `dataset_id` (inline buffers
    unless `local`: then its own files, as a worker on its host gets them)."""
    from dataservice.locality import host_id

    channel = grpc.insecure_channel(target.split("://")[1])
    try:
        stub = service_pb2_grpc.DispatcherServiceStub(channel)
        request = pb.GetDatasetDefRequest(dataset_id=dataset_id, host_id=host_id() if local else "")
        return stub.GetDatasetDef(request, timeout=10).dataset
    finally:
        channel.close()


def _elements(target: str, dataset_id: str) -> list:
    return [np.asarray(x).tolist() for x in serialize.load(_definition(target, dataset_id))]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    """A work_dir holding one of each file kind: snapshot-000001, segment-000001
    and segment-000002 (2 records each), the definitions of 5 datasets, and
    the buffer file of dataset "big"."""
    work_dir = str(tmp_path_factory.mktemp("pristine") / "wd")
    saved = journal_module.SNAPSHOT_EVERY_RECORDS
    journal_module.SNAPSHOT_EVERY_RECORDS = 3  # SetIncarnation, a, b -> snapshot-000001
    try:
        with ds.DispatchServer(_config(work_dir)) as d:
            for dataset_id, dataset in (
                ("a", ds.Dataset.range(3)),
                ("b", ds.Dataset.range(4)),
                ("big", ds.Dataset.from_tensor_slices(BIG)),
                ("c", ds.Dataset.range(5)),
            ):
                ds.register_dataset(d.target, dataset, dataset_id=dataset_id)
    finally:
        journal_module.SNAPSHOT_EVERY_RECORDS = saved
    with ds.DispatchServer(_config(work_dir)) as d:  # a second start: segment-000002
        ds.register_dataset(d.target, ds.Dataset.range(6), dataset_id="d")
        ds.register_dataset(d.target, ds.Dataset.range(7), dataset_id="e")
    with open(os.path.join(work_dir, "journal.head")) as f:
        assert f.read().split()[0] == "2"  # the newest segment made
    names = sorted(os.listdir(os.path.join(work_dir, "journal")))
    assert names == [
        "segment-000001.tfrecord",
        "segment-000002.tfrecord",
        "snapshot-000001.tfrecord",
    ], names
    assert os.listdir(os.path.join(work_dir, BUFFERS_SUBDIR)) == [BIG_DIGEST]
    return work_dir


@pytest.fixture
def work_dir(pristine, tmp_path) -> str:
    copy = str(tmp_path / "wd")
    shutil.copytree(pristine, copy)
    return copy


def _definition_file(work_dir: str, dataset_id: str) -> str:
    """The definition file of `dataset_id`, found by what it holds."""
    folder = os.path.join(work_dir, "datasets")
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            definition = serialize.parse(f.read())
        if dataset_id == "big" and definition.buffers:
            return os.path.join(folder, name)
        if not definition.buffers and serialize.load(definition).cardinality() == {
            "a": 3,
            "b": 4,
            "c": 5,
            "d": 6,
            "e": 7,
        }.get(dataset_id):
            return os.path.join(folder, name)
    raise AssertionError(f"no definition file of {dataset_id}")


FILES = {
    "snapshot": lambda wd: os.path.join(wd, "journal", "snapshot-000001.tfrecord"),
    # segment-000001 is not the newest: deleting it leaves a gap in the numbering.
    "segment": lambda wd: os.path.join(wd, "journal", "segment-000001.tfrecord"),
    "newest-segment": lambda wd: os.path.join(wd, "journal", "segment-000002.tfrecord"),
    "head": lambda wd: os.path.join(wd, "journal.head"),
    "definition": lambda wd: _definition_file(wd, "b"),
    "big-definition": lambda wd: _definition_file(wd, "big"),
    "buffer": lambda wd: os.path.join(wd, BUFFERS_SUBDIR, BIG_DIGEST),
}


def _damage(path: str, kind: str) -> None:
    if kind == "deleted":
        os.unlink(path)
    elif kind == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif kind == "flipped":
        # In the first record of a journal file (not its torn tail): byte 20 is
        # in the data of the first record; elsewhere any byte will do.
        at = 20 if path.endswith(".tfrecord") else os.path.getsize(path) // 2
        at = 0 if path.endswith(".head") else at
        with open(path, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x01]))
    elif kind == "fifo":
        os.unlink(path)
        os.mkfifo(path, 0o600)
    elif kind == "symlink":
        os.unlink(path)
        os.symlink("/etc/passwd", path)
    else:
        raise AssertionError(kind)


DAMAGES = ["deleted", "truncated", "flipped", "fifo", "symlink"]
# Damage a start-up recovers from, as documented (README "Recovering a damaged work_dir").
# (A cut newest segment is a crash's torn write: test_the_newest_segment_cut_short...)
RECOVERED = {
    ("buffer", "deleted"),  # rebuilt from the journaled definition
    ("newest-segment", "truncated"),  # a crash's torn write (the record of "e" is dropped)
    ("head", "deleted"),  # only names the newest segment: written again with the next one
}
WHAT_IS_WRONG = {
    "deleted": "missing",
    "truncated": "",  # in words that depend on the file kind
    "flipped": "",
    "fifo": "FIFO",
    "symlink": "symlink",
}


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("kind", list(FILES))
def test_damaged_file_stops_start_up_naming_it(work_dir, kind, damage):
    path = FILES[kind](work_dir)
    _damage(path, damage)
    start = time.monotonic()
    if (kind, damage) in RECOVERED:
        with ds.DispatchServer(_config(work_dir)) as d:
            assert _elements(d.target, "a") == [0, 1, 2]
            if kind == "buffer":
                assert _elements(d.target, "big") == BIG.tolist()
                assert os.path.isfile(path)
            if kind in ("newest-segment", "head"):
                assert _elements(d.target, "d") == list(range(6))
        return
    with pytest.raises(errors.DataLossError) as info:
        ds.DispatchServer(_config(work_dir)).stop()
    assert time.monotonic() - start < START_UP_S
    message = str(info.value)
    assert path in message, message
    assert WHAT_IS_WRONG[damage] in message, message
    if kind == "buffer" and damage in ("truncated", "flipped"):
        assert "delete it" in message  # says how to recover


@pytest.mark.parametrize("kind", list(FILES))
def test_a_group_readable_file_is_tightened_and_read(work_dir, kind):
    path = FILES[kind](work_dir)
    os.chmod(path, 0o644)
    with ds.DispatchServer(_config(work_dir)) as d:
        assert _elements(d.target, "e") == list(range(7))
        assert _elements(d.target, "big") == BIG.tolist()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.parametrize("folder", ["journal", "datasets"])
def test_a_folder_replaced_by_a_symlink_stops_start_up(work_dir, folder, tmp_path):
    path = os.path.join(work_dir, folder)
    moved = str(tmp_path / "elsewhere")
    shutil.move(path, moved)
    os.symlink(moved, path)
    with pytest.raises(errors.DataLossError, match="symlink") as info:
        ds.DispatchServer(_config(work_dir)).stop()
    assert path in str(info.value)


@pytest.mark.parametrize("name", ["segment-x.tfrecord", "snapshot-.tfrecord"])
def test_a_journal_name_without_a_number_stops_start_up(work_dir, name):
    path = os.path.join(work_dir, "journal", name)
    with open(path, "wb"):
        pass
    with pytest.raises(errors.DataLossError, match="no number") as info:
        ds.DispatchServer(_config(work_dir)).stop()
    assert path in str(info.value)


def test_the_newest_segment_cut_short_is_a_torn_write(work_dir):
    path = os.path.join(work_dir, "journal", "segment-000002.tfrecord")
    os.truncate(path, os.path.getsize(path) - 3)  # the record of "e" is incomplete
    with ds.DispatchServer(_config(work_dir)) as d:
        assert _elements(d.target, "d") == list(range(6))
        with pytest.raises(grpc.RpcError) as info:
            _definition(d.target, "e")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_ids_that_shared_a_file_name_are_distinct(tmp_path):
    """'run 14' and 'run\u2014' were both datasets/run%2014.bin."""
    work_dir = str(tmp_path / "wd")
    with ds.DispatchServer(_config(work_dir)) as d:
        ds.register_dataset(d.target, ds.Dataset.range(14), dataset_id="run 14")
        ds.register_dataset(d.target, ds.Dataset.range(3), dataset_id="run\u2014")
    assert len(os.listdir(os.path.join(work_dir, "datasets"))) == 2
    with ds.DispatchServer(_config(work_dir)) as d:
        assert _elements(d.target, "run 14") == list(range(14))
        assert _elements(d.target, "run\u2014") == list(range(3))


def _legacy_name(dataset_id: str) -> str:
    """The file name a dispatcher before issue 11 gave a definition."""
    safe = "".join(c if c.isalnum() or c in "-_." else f"%{ord(c):02x}" for c in dataset_id)
    return f"{safe}.bin"


def _legacy_work_dir(work_dir: str, datasets: dict[str, ds.Dataset]) -> dict[str, bytes]:
    """A work_dir as a dispatcher before issue 11 wrote it: records without
    definition_sha256, definitions under the escaped id, mode 0644."""
    journal = Journal(work_dir)
    journal.append(st.SetIncarnation("legacy"))
    written = {}
    for dataset_id, dataset in datasets.items():
        data = serialize.serialize(dataset)
        path = os.path.join(work_dir, "datasets", _legacy_name(dataset_id))
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o644)
        written[dataset_id] = data
        fingerprint = hashlib.sha256(data).hexdigest()
        journal.append(st.RegisterDataset(dataset_id, fingerprint, b"", -1, False))
    journal.close()
    return written


def test_an_old_named_work_dir_is_migrated(tmp_path):
    work_dir = str(tmp_path / "wd")
    written = _legacy_work_dir(work_dir, {"x/1": ds.Dataset.range(4), "y": ds.Dataset.range(2)})
    with ds.DispatchServer(_config(work_dir)) as d:
        assert _elements(d.target, "x/1") == list(range(4))
        assert _elements(d.target, "y") == [0, 1]
    names = sorted(os.listdir(os.path.join(work_dir, "datasets")))
    assert names == sorted(f"{hashlib.sha256(v).hexdigest()}.def" for v in written.values())
    with ds.DispatchServer(_config(work_dir)) as d:  # and again, from the new names
        assert _elements(d.target, "x/1") == list(range(4))


def test_old_named_ids_that_collided_are_data_loss_not_each_others_data(tmp_path):
    """Before issue 11, the second registration overwrote the first one's file:
    its fingerprint no longer matches, and start-up says so."""
    work_dir = str(tmp_path / "wd")
    written = _legacy_work_dir(work_dir, {"run 14": ds.Dataset.range(14)})
    journal = Journal(work_dir)
    data = serialize.serialize(ds.Dataset.range(3))
    journal.append(
        st.RegisterDataset("run\u2014", hashlib.sha256(data).hexdigest(), b"", -1, False)
    )
    journal.close()
    path = os.path.join(work_dir, "datasets", _legacy_name("run 14"))
    assert path == os.path.join(work_dir, "datasets", _legacy_name("run\u2014"))
    with open(path, "wb") as f:
        f.write(data)  # the later registration won
    with pytest.raises(errors.DataLossError, match="SHA-256") as info:
        ds.DispatchServer(_config(work_dir)).stop()
    assert path in str(info.value) and "'run 14'" in str(info.value)
    assert written  # ("run 14"'s own bytes are gone: nothing to recover them from)


MODES_SCRIPT = textwrap.dedent(
    """
    import os, stat, sys
    import numpy as np
    import dataservice as ds

    os.umask(0)
    work_dir = sys.argv[1]
    config = ds.DispatcherConfig(work_dir=work_dir, fault_tolerant_mode=True)
    big = ds.Dataset.from_tensor_slices(np.arange(1 << 18, dtype=np.int64))
    with ds.DispatchServer(config) as d:
        ds.register_dataset(d.target, big, dataset_id="big")
        ds.register_dataset(d.target, ds.Dataset.range(3), dataset_id="small")
    with ds.DispatchServer(config) as d:  # a second segment
        ds.register_dataset(d.target, ds.Dataset.range(4), dataset_id="other")
    with ds.DispatchServer() as d:  # no work_dir: a private temporary folder
        dataset_id = ds.register_dataset(d.target, big)
        private = os.path.dirname(d._datasets[dataset_id].buffers[0].path)
        for root in (work_dir, private):
            for folder, dirs, files in os.walk(root):
                print("D", oct(stat.S_IMODE(os.lstat(folder).st_mode)), folder)
                for name in files:
                    path = os.path.join(folder, name)
                    print("F", oct(stat.S_IMODE(os.lstat(path).st_mode)), path)
    """
)


def test_files_are_0600_and_folders_0700_with_umask_0(tmp_path):
    work_dir = str(tmp_path / "wd")
    proc = subprocess.run(
        [sys.executable, "-c", MODES_SCRIPT, work_dir],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    entries = [line.split(" ", 2) for line in proc.stdout.splitlines()]
    files = {path: mode for kind, mode, path in entries if kind == "F"}
    folders = {path: mode for kind, mode, path in entries if kind == "D"}
    assert len(files) >= 7, entries  # 2 segments, 3 definitions, 2 buffer files
    assert sum(BUFFERS_SUBDIR in p for p in files) == 1, files
    assert set(files.values()) == {"0o600"}, files
    assert len(folders) == 5, folders  # work_dir, journal, datasets, buffers, private
    assert set(folders.values()) == {"0o700"}, folders


def test_a_work_dir_that_is_a_file_is_named_at_start(tmp_path):
    """A file where the work_dir should be: start-up fails naming it and saying
    it is a file (was a bare NotADirectoryError for 'wd/datasets')."""
    work_dir = tmp_path / "wd"
    work_dir.write_text("not a folder")
    with pytest.raises(NotADirectoryError, match=rf"{work_dir} is a file, not a directory"):
        ds.DispatchServer(ds.DispatcherConfig(work_dir=str(work_dir), fault_tolerant_mode=True))
