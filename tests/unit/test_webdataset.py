"""WebDataset in-process: grouping a tar's files into samples by key (webdataset's rules),
decoders, compressed shards, shards as splits, FILE sharding, fingerprints, and the
errors for missing, truncated and damaged shards (and `ignore_errors`)."""

from __future__ import annotations

import io
import logging
import os
import tarfile

import numpy as np
import pytest

import dataservice as ds
from dataservice import errors
from dataservice.data import graph
from dataservice.data.serialize import deserialize, fingerprint, serialize
from dataservice.data.static_sharding import shard_files
from dataservice.sharding import ShardingPolicy

pytestmark = pytest.mark.timeout(60)


def write_tar(path, files, mode="w") -> str:
    with tarfile.open(str(path), mode) as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def sample_files(first: int, n: int) -> list[tuple[str, bytes]]:
    out = []
    for i in range(first, first + n):
        out += [
            (f"train/s{i:04d}.jpg", b"\xff\xd8jpeg%d" % i),
            (f"train/s{i:04d}.cls", b"%d" % (i % 10)),
            (f"train/s{i:04d}.txt", f"caption {i}".encode()),
            (f"train/s{i:04d}.seg.npy", npy(np.full((2, 2), i, np.int32))),
        ]
    return out


@pytest.fixture
def shards(tmp_path) -> list[str]:
    return [write_tar(tmp_path / f"shard-{k}.tar", sample_files(5 * k, 5)) for k in range(4)]


def test_files_are_grouped_by_key_into_dicts_of_bytes(shards):
    got = list(ds.WebDataset(shards[0]))
    assert len(got) == 5
    assert got[1] == {
        "__key__": "train/s0001",
        "__url__": shards[0],
        "jpg": b"\xff\xd8jpeg1",
        "cls": b"1",
        "txt": b"caption 1",
        "seg.npy": npy(np.full((2, 2), 1, np.int32)),
    }
    assert [s["__key__"] for s in ds.WebDataset(shards)] == [f"train/s{i:04d}" for i in range(20)]


def test_decode_applies_webdataset_basic_decoders(shards):
    s = list(ds.WebDataset(shards[1], decode=True))[2]
    assert s["cls"] == 7 and isinstance(s["cls"], np.int64)
    assert s["txt"] == "caption 7"
    assert s["seg.npy"].dtype == np.int32 and s["seg.npy"].tolist() == [[7, 7], [7, 7]]
    assert s["jpg"] == b"\xff\xd8jpeg7"  # images stay bytes without a decoder


def test_custom_decoders_win_over_defaults_and_can_decode_images(shards):
    d = ds.WebDataset(
        shards[0], decode=True, decoders={"jpg": lambda b: np.frombuffer(b, np.uint8), "txt": len}
    )
    s = next(iter(d))
    assert s["jpg"].tolist() == list(b"\xff\xd8jpeg0")
    assert s["txt"] == len(b"caption 0") and s["cls"] == 0
    only = next(iter(ds.WebDataset(shards[0], decoders={".CLS": int})))
    assert only["cls"] == 0 and only["txt"] == b"caption 0"


def test_decoder_errors_keep_their_type_and_name_the_sample(shards):
    def boom(_: bytes):
        raise KeyError("no such label")

    with pytest.raises(KeyError) as info:
        list(ds.WebDataset(shards[0], decoders={"cls": boom}))
    assert any(
        "sample 'train/s0000'" in note and shards[0] in note for note in info.value.__notes__
    )


def test_webdataset_key_rules(tmp_path):
    path = write_tar(
        tmp_path / "rules.tar",
        [
            ("__meta__/info.json", b"{}"),  # metadata (webdataset's skip_meta): skipped
            ("README", b"no dot: skipped"),
            ("a.b.c.TXT", b"1"),  # key "a", extension "b.c.txt" (lower-cased)
            ("a.png", b"2"),
            ("dir.v1/x.txt", b"3"),  # the key's directory may contain dots
            ("b.txt", b"4"),
            ("a.txt", b"5"),  # not adjacent to the first "a": a new sample
        ],
    )
    got = [{k: v for k, v in s.items() if k != "__url__"} for s in ds.WebDataset(path)]
    assert got == [
        {"__key__": "a", "b.c.txt": b"1", "png": b"2"},
        {"__key__": "dir.v1/x", "txt": b"3"},
        {"__key__": "b", "txt": b"4"},
        {"__key__": "a", "txt": b"5"},
    ]


def test_duplicate_extension_in_a_sample_is_an_error(tmp_path):
    path = write_tar(tmp_path / "dup.tar", [("k.txt", b"1"), ("k.txt", b"2")])
    with pytest.raises(errors.InvalidArgumentError, match=r"dup.tar: 'k.txt'.*sample 'k'"):
        list(ds.WebDataset(path))


@pytest.mark.parametrize("mode", ["w:gz", "w:bz2", "w:xz"])
def test_compressed_shards(tmp_path, mode):
    path = write_tar(tmp_path / "c.tar.x", sample_files(0, 3), mode)
    assert [s["txt"] for s in ds.WebDataset(path, decode=True)] == [
        "caption 0",
        "caption 1",
        "caption 2",
    ]


def _cuts(raw: bytes) -> list[int]:
    """Lengths to truncate a 3-sample tar to: in a header, in data, at a member's end."""
    return [100, 512 + 3, 1024, 2048 + 200, len(raw) // 2]


def test_truncated_or_damaged_shards_raise_data_loss_naming_the_shard(tmp_path):
    raw = open(write_tar(tmp_path / "good.tar", sample_files(0, 3)), "rb").read()
    for cut in _cuts(raw):
        path = tmp_path / f"cut-{cut}.tar"
        path.write_bytes(raw[:cut])
        with pytest.raises(errors.DataLossError, match=f"shard {path}"):
            list(ds.WebDataset(str(path)))
    garbled = bytearray(raw)
    garbled[1024 + 100 : 1024 + 200] = b"x" * 100  # the second member's header
    path = tmp_path / "garbled.tar"
    path.write_bytes(bytes(garbled))
    with pytest.raises(errors.DataLossError, match=r"garbled.tar .*after member 'train/s0000.jpg'"):
        list(ds.WebDataset(str(path)))
    gz = open(write_tar(tmp_path / "good.tgz", sample_files(0, 30), "w:gz"), "rb").read()
    path = tmp_path / "cut.tgz"
    path.write_bytes(gz[: len(gz) - 20])
    with pytest.raises(errors.DataLossError, match=r"cut.tgz .*EOFError"):
        list(ds.WebDataset(str(path)))
    text = tmp_path / "text.tar"
    text.write_text("hello")
    with pytest.raises(errors.DataLossError, match="text.tar is not a tar file"):
        list(ds.WebDataset(str(text)))
    with pytest.raises(errors.NotFoundError, match="missing.tar: no such file"):
        list(ds.WebDataset(str(tmp_path / "missing.tar")))


def test_ignore_errors_skips_the_rest_of_a_bad_shard_and_warns(tmp_path, shards, caplog):
    raw = open(shards[1], "rb").read()
    cut = tmp_path / "cut.tar"
    # samples of 4 files of 1 KiB each (header + data): cut in the third sample
    cut.write_bytes(raw[: 4 * 1024 * 2 + 1024 + 700])
    names = [shards[0], str(cut), str(tmp_path / "missing.tar"), shards[2]]
    with caplog.at_level(logging.WARNING, logger="dataservice.data.webdataset"):
        got = [s["__key__"] for s in ds.WebDataset(names, ignore_errors=True)]
    want = [f"train/s{i:04d}" for i in [*range(5), 5, 6, *range(10, 15)]]
    assert got == want
    assert sum("ignore_errors" in r.getMessage() for r in caplog.records) == 2

    def bad_cls(b: bytes):
        if b == b"2":
            raise ValueError("bad label")
        return int(b)

    d = ds.WebDataset(shards[0], decoders={"cls": bad_cls}, ignore_errors=True)
    assert [s["cls"] for s in d] == [0, 1, 3, 4]


def test_num_parallel_reads_interleaves_shards(shards):
    d = ds.WebDataset(shards[:3], num_parallel_reads=2)
    # shards 0 and 1 alternate; shard 2 takes the slot of the first to end (shard 0)
    want = [0, 5, 1, 6, 2, 7, 3, 8, 4, 9, *range(10, 15)]
    assert [s["__key__"] for s in d] == [f"train/s{i:04d}" for i in want]
    (provider,) = graph.split_providers(d, seed=0)
    assert len(list(graph.make_iterator(d, (provider,)))) == 15
    with pytest.raises(errors.InvalidArgumentError, match="positive or AUTOTUNE"):
        ds.WebDataset(shards, num_parallel_reads=-3)


def test_shards_are_splits_and_file_shardable(shards):
    d = ds.WebDataset(shards)
    assert graph.source_files(d) == tuple(shards)
    (provider,) = graph.split_providers(d, seed=0)
    assert provider.cardinality() == 4
    provider.get_next()
    provider.get_next()
    got = [s["__key__"] for s in graph.make_iterator(d, (provider,))]
    assert got == [f"train/s{i:04d}" for i in range(10, 20)]
    shard = shard_files(d, ShardingPolicy.FILE, 3, 1)
    assert [s["__url__"] for s in shard][::5] == [shards[1]]
    with pytest.raises(errors.FailedPreconditionError, match="4 files for 5 workers"):
        shard_files(d, ShardingPolicy.FILE, 5, 0)


def test_fingerprint_and_round_trip(shards):
    d = ds.WebDataset(shards, decode=True)
    assert fingerprint(d) == fingerprint(ds.WebDataset(list(shards), decode=True))
    assert fingerprint(d) != fingerprint(ds.WebDataset(shards))
    blob = serialize(d)
    assert os.path.dirname(ds.__file__).encode() not in blob  # decoders by reference
    assert [s["txt"] for s in deserialize(blob)][:2] == ["caption 0", "caption 1"]


def test_bad_arguments(shards):
    with pytest.raises(TypeError, match="decoders"):
        ds.WebDataset(shards, decoders={"jpg": "not callable"})
    with pytest.raises(errors.InvalidArgumentError, match="only local paths"):
        ds.WebDataset("https://example.com/shard-0.tar")
    with pytest.raises(errors.InvalidArgumentError, match="no shards"):
        ds.WebDataset([])
    with pytest.raises(TypeError, match="interleave"):
        ds.WebDataset(ds.Dataset.list_files(shards[0]))
    assert next(iter(ds.WebDataset("file://" + shards[0])))["__key__"] == "train/s0000"


def test_docstring_example_runs():
    import doctest

    from dataservice.data import webdataset

    result = doctest.testmod(webdataset, raise_on_error=False, verbose=False)
    assert result.attempted >= 4 and result.failed == 0
