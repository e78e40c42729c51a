"""Lengths read from a file or the wire never size an allocation beyond what
their source holds: a TFRecord header declaring 1 GiB over a 47-byte stream is
truncation (DataLossError naming the file and offset), found before a 1 GiB
buffer is allocated; an encoded element's counts are checked against its size."""

from __future__ import annotations

import gzip
import os
import re
import struct
import subprocess
import sys
import textwrap
import zlib

import pytest

from dataservice import _core, errors
from dataservice.transfer import codec

pytestmark = pytest.mark.timeout(120)

GIB = 1 << 30


def _claiming(declared: int, data: bytes = b"tiny") -> bytes:
    """One TFRecord header declaring `declared` bytes (its CRC right), then `data`."""
    length = struct.pack("<Q", declared)
    return length + struct.pack("<I", _core.masked_crc32c(length)) + data


def _write(path: str, compression: str, raw: bytes) -> None:
    with open(path, "wb") as f:
        f.write(
            gzip.compress(raw)
            if compression == "GZIP"
            else zlib.compress(raw)
            if compression == "ZLIB"
            else raw
        )


@pytest.mark.parametrize("compression", ["", "GZIP", "ZLIB"])
def test_declared_length_past_the_stream_is_data_loss_naming_file_and_offset(tmp_path, compression):
    path = str(tmp_path / "claims-1gib.tfrecord")
    good = _claiming(3, b"abc") + struct.pack("<I", _core.masked_crc32c(b"abc"))
    _write(path, compression, good + _claiming(GIB))
    assert os.path.getsize(path) < 80
    reader = _core.TFRecordReader(path, compression)
    assert next(reader) == b"abc"
    with pytest.raises(errors.DataLossError) as info:
        next(reader)
    message = str(info.value)
    assert path in message and "offset 19" in message and str(GIB) in message, message
    with pytest.raises(errors.DataLossError):
        _core.read_tfrecord_file(path, compression)


def test_a_1gib_claim_costs_no_1gib_allocation(tmp_path):
    """Peak RSS of a fresh process reading 47-byte GZIP/ZLIB files that each
    claim 1 GiB stays far below 1 GiB (before: a zeroed 1 GiB `bytes` each)."""
    paths = []
    for compression in ("GZIP", "ZLIB", ""):
        path = str(tmp_path / f"claim-{compression or 'none'}.tfrecord")
        _write(path, compression, _claiming(GIB))
        paths.append((path, compression))
    assert os.path.getsize(paths[0][0]) < 64
    script = textwrap.dedent(
        f"""
        import resource
        from dataservice import _core, errors
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for path, compression in {paths!r}:
            try:
                next(_core.TFRecordReader(path, compression))
            except errors.DataLossError:
                pass
            else:
                raise SystemExit("no DataLossError for " + path)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) * 1024)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    grown_bytes = int(out.stdout.strip())
    assert grown_bytes < 64 << 20, f"peak RSS grew by {grown_bytes} bytes"


def test_tfrecord_dataset_reports_the_bad_file(tmp_path):
    from dataservice.data.sources import TFRecordDataset

    path = str(tmp_path / "bad.tfrecord.gz")
    _write(path, "GZIP", _claiming(GIB))
    with pytest.raises(errors.DataLossError, match="bad.tfrecord.gz"):
        list(TFRecordDataset([path], compression_type="GZIP"))


def _element_field(data: bytes, field: str) -> tuple[int, int]:
    """(offset, width in bytes) of a length or count field of an encoded element."""
    frame = (8 + struct.unpack_from("<I", data, 4)[0] + 63) // 64 * 64
    return {
        "spec_bytes": (4, 4),
        "frame_bytes": (frame + 8, 8),
        "n_leaves": (frame + 28, 2),
        "leaf_offset": (frame + 32 + 8, 8),
        "leaf_nbytes": (frame + 32 + 16, 8),
        "leaf_dim": (frame + 32 + 24, 8),
    }[field]


@pytest.mark.parametrize(
    "field, value, what",
    [
        ("spec_bytes", 2**32 - 1, "runs past the end"),
        ("frame_bytes", 2**63, "declares"),
        ("frame_bytes", 10, "declares"),
        ("n_leaves", 2**16 - 1, "leaves, its spec"),
        ("leaf_offset", 2**64 - 8, "overflows|outside its frame"),
        ("leaf_nbytes", 1 << 40, "outside its frame"),
        ("leaf_dim", 2**63, "does not match|overflows"),
    ],
)
def test_element_counts_are_checked_against_its_size(field, value, what):
    import numpy as np

    data = bytearray(codec.encode({"a": np.arange(10), "b": b"xyz"}))
    offset, width = _element_field(bytes(data), field)
    data[offset : offset + width] = value.to_bytes(width, "little")
    with pytest.raises(errors.DataLossError, match="damaged element") as info:
        codec.decode(bytes(data))
    assert re.search(what, str(info.value)), str(info.value)


def test_element_round_trip_still_decodes():
    import numpy as np

    element = {"a": np.arange(10), "b": b"xyz"}
    back = codec.decode(codec.encode(element))
    assert back["b"] == b"xyz" and back["a"].tolist() == list(range(10))


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_a_compressed_record_over_16_mib_reads_back(tmp_path, compression):
    """Above 16 MiB a compressed record's length is not trusted to size the
    `bytes` up front: it is read into a growing buffer, and must come back whole."""
    path = str(tmp_path / "big.tfrecord")
    big = bytes(range(256)) * ((20 << 20) // 256)
    with _core.TFRecordWriter(path, compression) as writer:
        writer.write(big)
        writer.write(b"after")
    assert list(_core.TFRecordReader(path, compression)) == [big, b"after"]
