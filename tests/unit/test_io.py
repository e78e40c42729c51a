"""`dataservice.io`: parsing tf.train.Example records TensorFlow wrote, and writing our own.

The fixture tests need ../shared/fixtures next to the repository and skip without it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dataservice import _core, io
from dataservice.errors import InvalidArgumentError
from dataservice.rpc import example_pb2

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "tfrecord"
EXPECTED_JSON = FIXTURES / "expected.json"

# Feature kinds in expected.json -> our dtypes.
DTYPE = {"int64": np.int64, "float": np.float32, "bytes": bytes}
_pb: Any = example_pb2  # generated: message classes are built at import time
Features = dict[str, io.FixedLenFeature | io.VarLenFeature]
WRONG_DTYPE = {"int64": np.float32, "float": bytes, "bytes": np.int64}
SCALARS = ["image/class/label", "image/height", "image/width", "index"]


@pytest.fixture(scope="module")
def examples() -> list[tuple[str, list[bytes], list[dict[str, Any]]]]:
    """(file name, records, expected records) of every Example file, compressed ones too."""
    if not EXPECTED_JSON.is_file():
        pytest.skip(f"no TensorFlow-written fixtures at {FIXTURES} (a clone without ../shared)")
    files = json.loads(EXPECTED_JSON.read_text())["files"]
    out = []
    for name, spec in sorted(files.items()):
        if spec["kind"] == "example":
            records = _core.read_tfrecord_file(FIXTURES / name, spec["compression"] or None)
            out.append((name, records, spec["records"]))
    assert len(out) == 9
    return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_values(kind: str, got: Any, want: dict[str, Any], where: str) -> None:
    if kind == "bytes":
        assert [_sha256(v) for v in got] == want["sha256"], where
        assert [len(v) for v in got] == want["len"], where
    elif kind == "float":
        assert np.array_equal(np.asarray(got, np.float32), np.asarray(want["values"], np.float32))
        assert [float(v) for v in got] == want["values"], where
    else:
        assert [int(v) for v in got] == want["values"], where


def test_decode_example_matches_tensorflow(examples: list[Any]) -> None:
    for name, records, expected in examples:
        for i, (record, want) in enumerate(zip(records, expected, strict=True)):
            assert _sha256(record) == want["sha256"]
            decoded = io.decode_example(record)
            assert set(decoded) == set(want["features"]), (name, i)
            for feature, spec in want["features"].items():
                _check_values(spec["kind"], decoded[feature], spec, f"{name}[{i}] {feature}")


def test_var_len_features_match_tensorflow(examples: list[Any]) -> None:
    for name, records, expected in examples:
        for i, (record, want) in enumerate(zip(records, expected, strict=True)):
            features: Features = {
                f: io.VarLenFeature(DTYPE[s["kind"]]) for f, s in want["features"].items()
            }
            parsed = io.parse_single_example(record, features)
            for feature, spec in want["features"].items():
                where = f"{name}[{i}] {feature}"
                value = parsed[feature]
                assert value.ndim == 1, where
                assert value.dtype == {"int64": np.int64, "float": np.float32}.get(
                    spec["kind"], object
                )
                _check_values(spec["kind"], value, spec, where)
                # The stored kind is what expected.json says, even for empty lists.
                with pytest.raises(InvalidArgumentError, match="data types don't match"):
                    io.parse_single_example(
                        record, {feature: io.VarLenFeature(WRONG_DTYPE[spec["kind"]])}
                    )


def test_fixed_len_scalars_match_tensorflow(examples: list[Any]) -> None:
    features: Features = {f: io.FixedLenFeature([], np.int64) for f in SCALARS}
    features["image/encoded"] = io.FixedLenFeature((), bytes)
    features["image/format"] = io.FixedLenFeature([1], "string")
    features["image/source"] = io.FixedLenFeature([], "bytes")
    for name, records, expected in examples:
        for record, want in zip(records, expected, strict=True):
            parsed = io.parse_single_example(record, features)
            for feature in SCALARS:
                assert parsed[feature].shape == ()
                assert parsed[feature].dtype == np.int64
                assert int(parsed[feature]) == want["features"][feature]["values"][0]
            encoded = parsed["image/encoded"]
            assert isinstance(encoded, bytes)
            assert _sha256(encoded) == want["features"]["image/encoded"]["sha256"][0]
            assert encoded.startswith(b"\xff\xd8")  # a JPEG
            assert parsed["image/format"].shape == (1,)
            assert parsed["image/format"].dtype == object
            assert parsed["image/format"][0] == b"jpeg"
            assert _sha256(parsed["image/source"]) == want["features"]["image/source"]["sha256"][0]
        assert name


def test_parse_example_batch(examples: list[Any]) -> None:
    features: Features = {
        "index": io.FixedLenFeature([], np.int64),
        "image/encoded": io.FixedLenFeature([], bytes),
        "image/format": io.FixedLenFeature([1], bytes),
        "tokens": io.VarLenFeature(np.int64),
        "bbox/xmin": io.VarLenFeature(np.float32),
        "absent": io.FixedLenFeature([2], np.float32, default_value=[1.5, 2.5]),
    }
    for _name, records, expected in examples:
        batch = io.parse_example(records, features)
        assert batch["index"].shape == (12,) and batch["index"].dtype == np.int64
        assert batch["index"].tolist() == [r["features"]["index"]["values"][0] for r in expected]
        assert batch["image/encoded"].shape == (12,) and batch["image/encoded"].dtype == object
        assert [_sha256(v) for v in batch["image/encoded"]] == [
            r["features"]["image/encoded"]["sha256"][0] for r in expected
        ]
        assert batch["image/format"].shape == (12, 1)
        assert batch["absent"].shape == (12, 2) and batch["absent"].dtype == np.float32
        assert (batch["absent"] == np.array([1.5, 2.5], dtype=np.float32)).all()
        for column in ("tokens", "bbox/xmin"):
            assert batch[column].shape == (12,) and batch[column].dtype == object
        for i, record in enumerate(records):
            single = io.parse_single_example(record, features)
            assert np.array_equal(batch["tokens"][i], single["tokens"])
            assert np.array_equal(batch["bbox/xmin"][i], single["bbox/xmin"])
    batch = io.parse_example(np.array(records, dtype=object), features)
    assert batch["index"].shape == (12,)
    empty = io.parse_example([], features)
    assert empty["index"].shape == (0,) and empty["absent"].shape == (0, 2)


def test_reserialized_fixture_is_the_same_example(examples: list[Any]) -> None:
    checked = 0
    for _name, records, _expected in examples:
        for record in records:
            decoded = io.decode_example(record)
            if any(len(v) == 0 for v in decoded.values()):
                continue  # an empty list has no type to re-infer
            again = io.serialize_example(decoded)
            assert _pb.Example.FromString(again) == _pb.Example.FromString(record)
            checked += 1
    assert checked > 10


# ---------------------------------------------------------------- without fixtures


def _example() -> bytes:
    return io.serialize_example(
        {
            "label": 7,
            "flag": True,
            "weights": [0.25, 1.0, -2.5],
            "mixed": [1, 2.5],
            "ids": np.array([[1, 2], [3, 4]], dtype=np.int32),
            "probs": np.array([0.5, 0.125], dtype=np.float64),
            "name": "café",
            "blob": b"\x00\xff",
            "tags": [b"a", "b"],
            "words": np.array(["x", "yz"]),
            "nothing": [],
            "huge": [2**63 - 1, -(2**63)],
        }
    )


def test_serialize_example_round_trip() -> None:
    decoded = io.decode_example(_example())
    assert decoded == {
        "blob": [b"\x00\xff"],
        "flag": [1],
        "huge": [2**63 - 1, -(2**63)],
        "ids": [1, 2, 3, 4],
        "label": [7],
        "mixed": [1.0, 2.5],
        "name": ["café".encode()],
        "nothing": [],
        "probs": [0.5, 0.125],
        "tags": [b"a", b"b"],
        "weights": [0.25, 1.0, -2.5],
        "words": [b"x", b"yz"],
    }
    kinds = _pb.Example.FromString(_example()).features.feature
    assert kinds["label"].WhichOneof("kind") == "int64_list"
    assert kinds["weights"].WhichOneof("kind") == "float_list"
    assert kinds["name"].WhichOneof("kind") == "bytes_list"
    assert kinds["nothing"].WhichOneof("kind") is None
    assert io.serialize_example({"b": 1, "a": 2}) == io.serialize_example({"a": 2, "b": 1})


def test_serialize_example_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="'bad'"):
        io.serialize_example({"bad": [1, b"x"]})
    with pytest.raises(TypeError, match="'obj'"):
        io.serialize_example({"obj": object()})
    with pytest.raises(TypeError, match="'c'"):
        io.serialize_example({"c": np.array([1j])})


def test_fixed_len_shapes_and_defaults() -> None:
    record = _example()
    parsed = io.parse_single_example(
        record,
        {
            "ids": io.FixedLenFeature([2, 2], np.int64),
            "weights": io.FixedLenFeature([3], "float32"),
            "name": io.FixedLenFeature([], bytes),
            "missing_int": io.FixedLenFeature([3], np.int64, default_value=-1),
            "missing_floats": io.FixedLenFeature([2], np.float32, default_value=[0.5, 1.5]),
            "missing_name": io.FixedLenFeature([], bytes, default_value="none"),
            "missing_tags": io.FixedLenFeature([2], bytes, default_value=[b"p", "q"]),
            "nothing": io.FixedLenFeature([1], np.float32, default_value=9.0),
        },
    )
    assert parsed["ids"].tolist() == [[1, 2], [3, 4]] and parsed["ids"].dtype == np.int64
    assert parsed["weights"].dtype == np.float32
    assert parsed["weights"].tolist() == [0.25, 1.0, -2.5]
    assert parsed["name"] == "café".encode()
    assert parsed["missing_int"].tolist() == [-1, -1, -1]
    assert parsed["missing_floats"].tolist() == [0.5, 1.5]
    assert parsed["missing_name"] == b"none"
    assert parsed["missing_tags"].tolist() == [b"p", b"q"]
    assert parsed["nothing"].tolist() == [9.0]  # an empty Feature counts as missing
    parsed["missing_int"][0] = 5  # a fresh array each time, not the shared default
    again = io.parse_single_example(
        record, {"missing_int": io.FixedLenFeature([3], np.int64, default_value=-1)}
    )
    assert again["missing_int"].tolist() == [-1, -1, -1]


def test_var_len_missing_is_empty() -> None:
    parsed = io.parse_single_example(
        _example(),
        {
            "absent": io.VarLenFeature(np.int64),
            "nothing": io.VarLenFeature(bytes),
            "tags": io.VarLenFeature("string"),
        },
    )
    assert parsed["absent"].shape == (0,) and parsed["absent"].dtype == np.int64
    assert parsed["nothing"].shape == (0,) and parsed["nothing"].dtype == object
    assert parsed["tags"].tolist() == [b"a", b"b"]


def test_missing_fixed_len_feature_is_an_error() -> None:
    with pytest.raises(InvalidArgumentError, match="'absent'.*missing"):
        io.parse_single_example(_example(), {"absent": io.FixedLenFeature([], np.int64)})
    with pytest.raises(InvalidArgumentError, match="'absent' in example 1"):
        io.parse_example(
            [io.serialize_example({"absent": 1}), io.serialize_example({"other": 1})],
            {"absent": io.FixedLenFeature([], np.int64, default_value=None)},
        )


def test_wrong_number_of_values_is_an_error() -> None:
    with pytest.raises(InvalidArgumentError, match=r"'weights'.*needs 2 float values.* has 3"):
        io.parse_single_example(_example(), {"weights": io.FixedLenFeature([2], np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"'label'.*needs 4 .* has 1"):
        io.parse_single_example(_example(), {"label": io.FixedLenFeature([2, 2], np.int64)})
    with pytest.raises(InvalidArgumentError, match=r"'tags'.*needs 1 .* has 2"):
        io.parse_single_example(_example(), {"tags": io.FixedLenFeature([], bytes)})


def test_wrong_type_and_bad_input() -> None:
    with pytest.raises(InvalidArgumentError, match="'label'.*expected float, stored int64"):
        io.parse_single_example(_example(), {"label": io.FixedLenFeature([], np.float32)})
    with pytest.raises(InvalidArgumentError, match="could not parse"):
        io.parse_single_example(b"\xff\xff\xff", {"x": io.VarLenFeature(np.int64)})
    with pytest.raises(InvalidArgumentError, match="could not parse"):
        io.decode_example(b"\x0a\x05\x0a")
    with pytest.raises(ValueError, match="1-D batch"):
        io.parse_example(_example(), {"label": io.VarLenFeature(np.int64)})


def test_feature_specs_validate() -> None:
    assert io.FixedLenFeature([], "int64") == io.FixedLenFeature((), np.int64)
    assert io.FixedLenFeature(3, np.float32).shape == (3,)
    assert io.VarLenFeature(np.dtype("float32")).dtype == "float32"
    for bad in (np.float64, np.int32, "float", str.upper):
        with pytest.raises(ValueError, match="unsupported feature dtype"):
            io.VarLenFeature(bad)
    with pytest.raises(ValueError, match="default_value has 2 values"):
        io.FixedLenFeature([3], np.int64, default_value=[1, 2])
    with pytest.raises(ValueError, match="negative"):
        io.FixedLenFeature([-1], np.int64)


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_tfrecord_writer(tmp_path: Path, compression: str | None) -> None:
    path = tmp_path / "data.tfrecord"
    records = [io.serialize_example({"index": i, "text": f"#{i}"}) for i in range(20)]
    with io.TFRecordWriter(path, compression) as writer:
        assert writer.path == str(path)
        for record in records:
            writer.write(record)
        writer.write("a str record")
        writer.flush()
    assert _core.read_tfrecord_file(path, compression) == records + [b"a str record"]
    batch = io.parse_example(records, {"index": io.FixedLenFeature([], np.int64)})
    assert batch["index"].tolist() == list(range(20))
    writer.close()
    with pytest.raises(ValueError):
        writer.write(b"closed")
    with pytest.raises(ValueError, match="LZ4"):
        io.TFRecordWriter(path, "LZ4")
