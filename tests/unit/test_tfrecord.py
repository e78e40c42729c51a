"""TFRecord reading and writing in `dataservice._core`, checked against files TensorFlow wrote.

The fixture tests need ../shared/fixtures next to the repository and skip without it; the
framing and round-trip tests do not.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import struct
import threading
import zlib
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from dataservice import _core
from dataservice.errors import DataLossError, NotFoundError

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "tfrecord"
EXPECTED_JSON = FIXTURES / "expected.json"
_HAVE_FIXTURES = EXPECTED_JSON.is_file()
FIXTURE_NAMES = (
    sorted(json.loads(EXPECTED_JSON.read_text())["files"]) if _HAVE_FIXTURES else ["(none)"]
)
COMPRESSIONS = [None, "GZIP", "ZLIB"]


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    if not _HAVE_FIXTURES:
        pytest.skip(f"no TensorFlow-written fixtures at {FIXTURES} (a clone without ../shared)")
    files: dict[str, Any] = json.loads(EXPECTED_JSON.read_text())["files"]
    return files


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# A CRC32C written independently of the Rust code: bitwise table for the reflected
# Castagnoli polynomial 0x82F63B78.
def _make_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _make_table()


def _crc32c_py(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_py(data: bytes) -> int:
    crc = _crc32c_py(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _frame_py(record: bytes) -> bytes:
    length = struct.pack("<Q", len(record))
    return (
        length
        + struct.pack("<I", _masked_py(length))
        + record
        + struct.pack("<I", _masked_py(record))
    )


def _write(path: Path, records: list[bytes], compression: str | None = None) -> None:
    with _core.TFRecordWriter(str(path), compression) as writer:
        for record in records:
            writer.write(record)


# ---------------------------------------------------------------- TensorFlow's files


def test_every_fixture_file_is_described(expected: dict[str, Any]) -> None:
    on_disk = {p.name for p in FIXTURES.iterdir() if p.name != "expected.json"}
    assert on_disk == set(expected)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_matches_tensorflow(expected: dict[str, Any], name: str) -> None:
    spec = expected[name]
    path = FIXTURES / name
    compression = spec["compression"] or None
    reader = _core.TFRecordReader(str(path), compression)
    got: list[bytes] = []
    if spec["kind"] == "damaged":
        assert spec["tensorflow_outcome"] == "DataLossError"
        with pytest.raises(DataLossError) as raised:
            for record in reader:
                got.append(record)
        assert len(got) == spec["records_before_error"]
        message = str(raised.value)
        assert str(path) in message
        assert f"offset {reader.offset}" in message
        # The reader stays failed, and the whole-file read fails too.
        with pytest.raises(DataLossError):
            next(reader)
        with pytest.raises(DataLossError, match=str(path)):
            _core.read_tfrecord_file(str(path), compression)
        return
    got = list(reader)
    records = spec["records"]
    assert [_sha256(r) for r in got] == [r["sha256"] for r in records]
    if spec["kind"] == "raw":
        assert [len(r) for r in got] == [r["len"] for r in records]
        assert [len(r) for r in got] == [0, 1, 7, 65535, 65536, 65537, 3 * 2**20 + 5]
    assert reader.offset == sum(len(r) + 16 for r in got)
    if compression is None:
        assert reader.offset == path.stat().st_size
    assert _core.read_tfrecord_file(path, compression) == got


def test_damaged_files_keep_good_records(expected: dict[str, Any]) -> None:
    # The damaged files are examples-00000 with one flipped byte or its tail cut: whatever
    # comes out before the error must be exactly that shard's records.
    shard = [r["sha256"] for r in expected["examples-00000-of-00003.tfrecord"]["records"]]
    for name in ("corrupt-data.tfrecord", "corrupt-length.tfrecord", "truncated.tfrecord"):
        good: list[str] = []
        with pytest.raises(DataLossError):
            for record in _core.TFRecordReader(str(FIXTURES / name)):
                good.append(_sha256(record))
        assert good == shard[: len(good)], name
    with pytest.raises(DataLossError, match="data CRC"):
        list(_core.TFRecordReader(FIXTURES / "corrupt-data.tfrecord"))
    with pytest.raises(DataLossError, match="length CRC"):
        list(_core.TFRecordReader(FIXTURES / "corrupt-length.tfrecord"))
    with pytest.raises(DataLossError, match="truncated record at offset"):
        list(_core.TFRecordReader(FIXTURES / "truncated.tfrecord"))


def test_compressed_fixture_read_as_wrong_compression(expected: dict[str, Any]) -> None:
    path = str(FIXTURES / "examples-00001-of-00003.tfrecord.gz")
    with pytest.raises(DataLossError, match="offset 0"):
        next(_core.TFRecordReader(path))
    with pytest.raises(DataLossError):
        _core.read_tfrecord_file(path, "ZLIB")


def test_small_read_buffer(expected: dict[str, Any]) -> None:
    for name in ("raw.tfrecord", "examples-00002-of-00003.tfrecord.gz"):
        compression = expected[name]["compression"] or None
        got = list(_core.TFRecordReader(FIXTURES / name, compression, buffer_bytes=1))
        assert [_sha256(r) for r in got] == [r["sha256"] for r in expected[name]["records"]]


# ---------------------------------------------------------------- framing and CRC


def test_crc32c_known_values() -> None:
    assert _crc32c_py(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert _masked_py(b"") == 0xA282EAD8
    assert _core.crc32c(b"123456789") == 0xE3069283
    assert _core.masked_crc32c(b"") == 0xA282EAD8
    for data in [b"", b"a", b"hello world", bytes(range(256)) * 5, struct.pack("<Q", 3)]:
        assert _core.crc32c(data) == _crc32c_py(data)
        assert _core.masked_crc32c(data) == _masked_py(data)
    assert _core.crc32c(bytearray(b"abc")) == _crc32c_py(b"abc")
    assert _core.crc32c(memoryview(b"xabc")[1:]) == _crc32c_py(b"abc")


def test_writer_emits_tensorflow_framing(tmp_path: Path) -> None:
    path = tmp_path / "tiny.tfrecord"
    _write(path, [b"abc", b""])
    # Hand-computed: 8-byte LE length, its masked CRC, the data, the data's masked CRC.
    abc = b"\x03\x00\x00\x00\x00\x00\x00\x00" + struct.pack("<I", _masked_py(b"\x03" + 7 * b"\0"))
    abc += b"abc" + struct.pack("<I", _masked_py(b"abc"))
    empty = 8 * b"\0" + struct.pack("<I", _masked_py(8 * b"\0")) + struct.pack("<I", 0xA282EAD8)
    assert path.read_bytes() == abc + empty
    assert path.read_bytes() == _frame_py(b"abc") + _frame_py(b"")


def test_compressed_files_are_plain_gzip_and_zlib(tmp_path: Path) -> None:
    records = [b"one", b"", b"three" * 1000]
    framed = b"".join(_frame_py(r) for r in records)
    _write(tmp_path / "a.gz", records, "GZIP")
    _write(tmp_path / "a.zlib", records, "ZLIB")
    assert gzip.decompress((tmp_path / "a.gz").read_bytes()) == framed
    assert zlib.decompress((tmp_path / "a.zlib").read_bytes()) == framed
    # And files compressed by other tools read back.
    (tmp_path / "b.gz").write_bytes(gzip.compress(framed))
    (tmp_path / "b.zlib").write_bytes(zlib.compress(framed, 9))
    assert _core.read_tfrecord_file(tmp_path / "b.gz", "GZIP") == records
    assert _core.read_tfrecord_file(tmp_path / "b.zlib", "ZLIB") == records


@pytest.mark.parametrize("compression", COMPRESSIONS + [""])
def test_round_trip(tmp_path: Path, compression: str | None) -> None:
    rng = np.random.default_rng(0)
    records = [
        b"",
        b"x",
        b"",
        rng.bytes(65536),
        rng.bytes(5 * 2**20),
        b"tail",
        b"",
    ]
    path = tmp_path / "round.tfrecord"
    _write(path, records, compression)
    reader = _core.TFRecordReader(path, compression)
    assert reader.offset == 0
    got = []
    for record in reader:
        assert isinstance(record, bytes)
        got.append(record)
        assert reader.offset == sum(len(r) + 16 for r in got)
    assert got == records
    assert _core.read_tfrecord_file(str(path), compression) == records


def test_writer_accepts_bytes_like(tmp_path: Path) -> None:
    path = tmp_path / "bytes-like.tfrecord"
    with _core.TFRecordWriter(path) as writer:
        writer.write(bytearray(b"ab"))
        writer.write(memoryview(b"__cd")[2:])
        writer.write(cast(Any, np.frombuffer(b"ef", dtype=np.uint8)))
        with pytest.raises(TypeError):
            writer.write("not bytes")  # type: ignore[arg-type]
    assert _core.read_tfrecord_file(path) == [b"ab", b"cd", b"ef"]


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_flush_and_sync_make_records_visible(tmp_path: Path, compression: str | None) -> None:
    path = tmp_path / "journal.tfrecord"
    writer = _core.TFRecordWriter(path, compression)
    writer.write(b"first")
    writer.flush()
    assert list(_core.TFRecordReader(path, compression)) == [b"first"]
    writer.write(b"second")
    writer.sync()
    assert list(_core.TFRecordReader(path, compression)) == [b"first", b"second"]
    assert not writer.closed
    writer.close()
    writer.close()
    assert writer.closed
    with pytest.raises(ValueError, match="closed"):
        writer.write(b"late")
    assert _core.read_tfrecord_file(path, compression) == [b"first", b"second"]


def test_empty_and_partial_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.tfrecord"
    empty.write_bytes(b"")
    assert list(_core.TFRecordReader(empty)) == []
    assert _core.read_tfrecord_file(empty) == []
    for compression in ("GZIP", "ZLIB"):
        assert _core.read_tfrecord_file(empty, compression) == []
        _write(tmp_path / "none.z", [], compression)
        assert _core.read_tfrecord_file(tmp_path / "none.z", compression) == []
        (tmp_path / "text.z").write_bytes(b"not a compressed stream")
        with pytest.raises(DataLossError, match=f"corrupted {compression} stream at offset 0"):
            _core.read_tfrecord_file(tmp_path / "text.z", compression)
    # A stream that ends inside a header is damage, as is one ending inside the data.
    one = _frame_py(b"good")
    for tail in (_frame_py(b"next")[:5], _frame_py(b"next")[:14], _frame_py(b"next")[:-1]):
        path = tmp_path / "cut.tfrecord"
        path.write_bytes(one + tail)
        reader = _core.TFRecordReader(path)
        assert next(reader) == b"good"
        with pytest.raises(DataLossError, match=f"truncated record at offset {len(one)} of"):
            next(reader)


def test_flipped_bytes_are_detected(tmp_path: Path) -> None:
    good = _frame_py(b"first") + _frame_py(b"second record")
    for position in range(len(_frame_py(b"first")), len(good)):
        damaged = bytearray(good)
        damaged[position] ^= 0x04
        path = tmp_path / "flip.tfrecord"
        path.write_bytes(bytes(damaged))
        reader = _core.TFRecordReader(path)
        assert next(reader) == b"first"
        with pytest.raises(DataLossError, match=f"offset 21 of {path}"):
            next(reader)


def test_missing_file_is_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "missing.tfrecord"
    with pytest.raises(NotFoundError, match=str(missing)):
        _core.TFRecordReader(str(missing))
    with pytest.raises(NotFoundError, match=str(missing)):
        _core.read_tfrecord_file(missing)
    with pytest.raises(NotFoundError, match=str(missing)):
        _core.TFRecordWriter(missing)


def test_bad_compression_name(tmp_path: Path) -> None:
    path = tmp_path / "a.tfrecord"
    _write(path, [b"x"])
    for bad in ("gzip", "zip", "SNAPPY"):
        with pytest.raises(ValueError, match=bad):
            _core.TFRecordReader(path, bad)
        with pytest.raises(ValueError, match=bad):
            _core.read_tfrecord_file(path, bad)
        with pytest.raises(ValueError, match=bad):
            _core.TFRecordWriter(tmp_path / "b.tfrecord", bad)


def test_reader_close_and_context_manager(tmp_path: Path) -> None:
    path = tmp_path / "a.tfrecord"
    _write(path, [b"1", b"2", b"3"])
    with _core.TFRecordReader(path) as reader:
        assert next(reader) == b"1"
        assert reader.path == str(path)
    assert reader.offset == 17
    with pytest.raises(ValueError, match="closed"):
        next(reader)
    reader.close()
    assert "closed" in repr(reader)


def test_readers_in_threads(tmp_path: Path) -> None:
    records = [bytes([i]) * (1000 * i) for i in range(50)]
    paths = []
    for compression in COMPRESSIONS:
        path = tmp_path / f"t-{compression}.tfrecord"
        _write(path, records, compression)
        paths.append((path, compression))
    results: dict[int, list[bytes]] = {}

    def read(index: int) -> None:
        path, compression = paths[index % len(paths)]
        results[index] = list(_core.TFRecordReader(path, compression, buffer_bytes=4096))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(results[i] == records for i in range(6))


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_cut_compressed_file_is_data_loss(tmp_path: Path, compression: str) -> None:
    rng = np.random.default_rng(1)
    records = [b"small", rng.bytes(200_000)]
    path = tmp_path / "cut.z"
    _write(path, records, compression)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    reader = _core.TFRecordReader(path, compression)
    assert next(reader) == b"small"
    with pytest.raises(DataLossError, match="truncated record at offset 21 of"):
        next(reader)
