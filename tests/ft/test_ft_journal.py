"""The dispatcher's journal under damage (issue 5, "Journal" tests).

Documented outcomes (python/dataservice/dispatcher/journal.py and the issue):

* a torn last record of a segment (a crash mid-write: cut short, or whole but
  failing its data CRC) is dropped, and the segment is truncated to its last
  whole record; start-up goes on with every earlier update;
* any other damage (a record that is not the last one fails its CRC) stops
  start-up with `DataLossError` naming the file and the record's offset, and
  leaves the file as it was;
* an empty segment (a crash right after it was created) holds no update;
  a start never appends to an older segment;
* a missing `work_dir` is created (`os.makedirs`);
* a `work_dir` that cannot be written (a path that is a file, or an immutable
  directory: root ignores chmod, so `chattr +i`) fails the start with an error
  naming the path, and an update that cannot be journaled fails its RPC and is
  not applied (journal first, then apply).

In-process `DispatchServer`s; records are found with an independent TFRecord
parser (u64 length, u32 masked CRC of the length, data, u32 masked CRC).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys

import grpc
import pytest

import dataservice as ds
from dataservice import errors
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import service_pb2_grpc

from .conftest import server_env

pytestmark = pytest.mark.timeout(120)

DATASETS = ("ds-a", "ds-b", "ds-c")


def _config(work_dir: str) -> ds.DispatcherConfig:
    return ds.DispatcherConfig(work_dir=work_dir, fault_tolerant_mode=True)


def _known(dispatcher: ds.DispatchServer, dataset_id: str) -> bool:
    channel = grpc.insecure_channel(dispatcher.target.split("://")[1])
    try:
        stub = service_pb2_grpc.DispatcherServiceStub(channel)
        stub.GetElementSpec(pb.GetElementSpecRequest(dataset_id=dataset_id), timeout=10)
        return True
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND, err
        return False
    finally:
        channel.close()


def _known_ids(work_dir: str, ids=DATASETS) -> list[str]:
    with ds.DispatchServer(_config(work_dir)) as d:
        return [i for i in ids if _known(d, i)]


def _register(dispatcher: ds.DispatchServer, dataset_id: str, n: int = 10) -> None:
    got = ds.register_dataset(dispatcher.target, ds.Dataset.range(n), dataset_id=dataset_id)
    assert got == dataset_id


def _segments(work_dir: str) -> list[str]:
    jdir = os.path.join(work_dir, "journal")
    return sorted(
        os.path.join(jdir, n)
        for n in os.listdir(jdir)
        if n.startswith("segment-") and n.endswith(".tfrecord")
    )


def _records(path: str) -> list[tuple[int, int]]:
    """(offset, data length) of each whole record of a TFRecord file."""
    with open(path, "rb") as f:
        data = f.read()
    out, offset = [], 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        if offset + 16 + length > len(data):
            break
        out.append((offset, length))
        offset += 16 + length
    assert offset == len(data), f"{path}: {len(data) - offset} trailing bytes"
    return out


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def journaled(tmp_path) -> tuple[str, str, list[tuple[int, int]]]:
    """A work_dir whose one segment holds SetIncarnation and 3 RegisterDataset
    records (ds-a, ds-b, ds-c, in that order)."""
    work_dir = str(tmp_path / "wd")
    with ds.DispatchServer(_config(work_dir)) as d:
        for i, dataset_id in enumerate(DATASETS):
            _register(d, dataset_id, 10 + i)
    (segment,) = _segments(work_dir)
    records = _records(segment)
    assert len(records) == 1 + len(DATASETS), records
    return work_dir, segment, records


def test_intact_journal_restores_every_dataset(journaled) -> None:
    work_dir, _, _ = journaled
    assert _known_ids(work_dir) == list(DATASETS)


@pytest.mark.parametrize("cut", ["in_data", "in_header"])
def test_torn_tail_is_dropped_and_truncated(journaled, cut: str) -> None:
    work_dir, segment, records = journaled
    last_offset, _ = records[-1]
    size = os.path.getsize(segment)
    keep = size - 3 if cut == "in_data" else last_offset + 5
    with open(segment, "r+b") as f:
        f.truncate(keep)
    with ds.DispatchServer(_config(work_dir)) as d:
        assert [i for i in DATASETS if _known(d, i)] == ["ds-a", "ds-b"]
        # Truncated to the last whole record, so the file reads clean again.
        assert os.path.getsize(segment) == last_offset
        _register(d, "ds-d")
    assert _known_ids(work_dir, (*DATASETS, "ds-d")) == ["ds-a", "ds-b", "ds-d"]
    # The start after the crash wrote a new segment, it did not append to the old one.
    assert len(_segments(work_dir)) == 2


def test_garbled_last_record_is_dropped_as_a_torn_write(journaled) -> None:
    """A whole last record whose data fails its CRC (a torn page) is a torn tail."""
    work_dir, segment, records = journaled
    offset, length = records[-1]
    _flip(segment, offset + 12 + length // 2)
    assert _known_ids(work_dir) == ["ds-a", "ds-b"]
    assert os.path.getsize(segment) == offset


@pytest.mark.parametrize("where", ["data", "length"])
def test_flipped_byte_in_a_middle_record_stops_startup(journaled, where: str) -> None:
    """Damage that is not at the tail is not a torn write: start-up must fail
    with DataLossError naming the segment and the damaged record's offset, and
    must not truncate (destroy) the journal."""
    work_dir, segment, records = journaled
    offset, length = records[1]  # ds-a's record; two whole records follow it
    _flip(segment, offset + (12 + length // 2 if where == "data" else 3))
    with open(segment, "rb") as f:
        before = f.read()
    with pytest.raises(errors.DataLossError) as info:
        ds.DispatchServer(_config(work_dir)).stop()
    message = str(info.value)
    print(f"[ft] start-up refused: {message}")
    assert segment in message
    assert f"offset {offset}" in message
    with open(segment, "rb") as f:
        assert f.read() == before, "the damaged segment was modified"


def test_empty_last_segment_is_harmless(journaled) -> None:
    work_dir, segment, _ = journaled
    empty = os.path.join(os.path.dirname(segment), "segment-000001.tfrecord")
    open(empty, "wb").close()
    with ds.DispatchServer(_config(work_dir)) as d:
        assert [i for i in DATASETS if _known(d, i)] == list(DATASETS)
        _register(d, "ds-d")
    names = [os.path.basename(p) for p in _segments(work_dir)]
    assert names == [
        "segment-000000.tfrecord",
        "segment-000001.tfrecord",
        "segment-000002.tfrecord",
    ]
    assert os.path.getsize(empty) == 0
    assert len(_records(_segments(work_dir)[-1])) == 1  # RegisterDataset(ds-d)
    assert _known_ids(work_dir, (*DATASETS, "ds-d")) == [*DATASETS, "ds-d"]


def test_only_an_empty_segment_starts_fresh(tmp_path) -> None:
    work_dir = tmp_path / "wd"
    (work_dir / "journal").mkdir(parents=True)
    (work_dir / "journal" / "segment-000000.tfrecord").write_bytes(b"")
    with ds.DispatchServer(_config(str(work_dir))) as d:
        assert not _known(d, "ds-a")
        _register(d, "ds-a")
    assert _known_ids(str(work_dir)) == ["ds-a"]


def test_missing_work_dir_is_created(tmp_path) -> None:
    work_dir = str(tmp_path / "does" / "not" / "exist")
    with ds.DispatchServer(_config(work_dir)) as d:
        assert os.path.isdir(os.path.join(work_dir, "journal"))
        assert os.path.isdir(os.path.join(work_dir, "datasets"))
        _register(d, "ds-a")
    assert _known_ids(work_dir) == ["ds-a"]


def test_work_dir_that_is_a_file_fails_start_naming_the_path(tmp_path) -> None:
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    with pytest.raises((OSError, errors.DataServiceError)) as info:
        ds.DispatchServer(_config(str(path))).stop()
    assert str(path) in str(info.value)
    # The CLI: one clear line and exit code 1.
    proc = subprocess.run(
        [sys.executable, "-m", "dataservice", "dispatcher", "--port", "0"]
        + ["--work-dir", str(path), "--fault-tolerant-mode"],
        capture_output=True,
        text=True,
        timeout=60,
        env=server_env(),
    )
    assert proc.returncode == 1, proc.stderr
    assert "listening" not in proc.stdout
    assert str(path) in proc.stderr


def _chattr(flag: str, path: str) -> None:
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed (as root, chmod cannot make a directory read-only)")
    proc = subprocess.run(["chattr", flag, path], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"chattr {flag} is not supported here: {proc.stderr.strip()}")


@pytest.fixture
def immutable():
    made: list[str] = []

    def _make(path: str) -> None:
        _chattr("+i", path)
        made.append(path)

    yield _make
    for path in made:
        subprocess.run(["chattr", "-i", path], check=False)


def test_read_only_work_dir_fails_start_naming_the_path(tmp_path, immutable) -> None:
    work_dir = tmp_path / "ro"
    work_dir.mkdir()
    immutable(str(work_dir))
    with pytest.raises((OSError, errors.DataServiceError)) as info:
        ds.DispatchServer(_config(str(work_dir))).stop()
    assert str(work_dir) in str(info.value)


def test_read_only_journal_fails_the_rpc_and_applies_nothing(journaled, immutable) -> None:
    """Journal first, then apply: an update that cannot be written is not answered as done."""
    work_dir, _, _ = journaled
    immutable(os.path.join(work_dir, "journal"))
    with ds.DispatchServer(_config(work_dir)) as d:
        assert [i for i in DATASETS if _known(d, i)] == list(DATASETS)  # replay only reads
        with pytest.raises(errors.DataServiceError) as info:
            _register(d, "ds-d")
        print(f"[ft] register on a read-only journal: {type(info.value).__name__}: {info.value}")
        assert not _known(d, "ds-d")
    subprocess.run(["chattr", "-i", os.path.join(work_dir, "journal")], check=True)
    assert _known_ids(work_dir, (*DATASETS, "ds-d")) == list(DATASETS)
