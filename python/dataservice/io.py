"""Records, mirroring `tf.io`: TFRecord files and `tf.train.Example` protos, without TensorFlow.

Write a dataset with `TFRecordWriter` and `serialize_example`; read it back with
`dataservice.data.TFRecordDataset` and parse each record with `parse_single_example` (or a
batch with `parse_example`):

>>> import os, tempfile
>>> import numpy as np
>>> from dataservice import io
>>> path = os.path.join(tempfile.mkdtemp(), "data.tfrecord")
>>> with io.TFRecordWriter(path) as writer:
...     writer.write(io.serialize_example({"label": 3, "pixels": [0.5, 1.5]}))
>>> from dataservice import _core
>>> [record] = _core.read_tfrecord_file(path)
>>> parsed = io.parse_single_example(
...     record,
...     {"label": io.FixedLenFeature([], np.int64), "pixels": io.VarLenFeature(np.float32)},
... )
>>> int(parsed["label"]), parsed["pixels"].tolist()
(3, [0.5, 1.5])

Differences from `tf.io`: results are numpy arrays, not tensors; `VarLenFeature` gives a
dense 1-D array of the values (no `SparseTensor`); `FixedLenSequenceFeature`,
`SparseFeature` and `RaggedFeature` are not supported.

The `Example` schema is TensorFlow's (same field numbers), declared in
`dataservice/rpc/example.proto`, so records are interchangeable with `tf.train.Example`.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeAlias

import numpy as np

from dataservice import _core
from dataservice.errors import InvalidArgumentError
from dataservice.rpc import example_pb2

_pb: Any = example_pb2  # generated code: its message classes are built at import time
# google.protobuf has no inline types (types-protobuf is a separate, optional package).
_DecodeError: type[Exception] = importlib.import_module("google.protobuf.message").DecodeError

__all__ = [
    "FixedLenFeature",
    "TFRecordWriter",
    "VarLenFeature",
    "decode_example",
    "parse_example",
    "parse_single_example",
    "serialize_example",
]

_Kind: TypeAlias = Literal["int64", "float32", "bytes"]

# Feature.kind oneof names, by the dtype they hold.
_LIST_FIELD: dict[_Kind, str] = {
    "int64": "int64_list",
    "float32": "float_list",
    "bytes": "bytes_list",
}
_KIND_OF_FIELD: dict[str, _Kind] = {field: kind for kind, field in _LIST_FIELD.items()}
# TensorFlow's names for the kinds, used in error messages.
_TF_NAME: dict[_Kind, str] = {"int64": "int64", "float32": "float", "bytes": "string"}

_DTYPE_ALIASES: dict[Any, _Kind] = {
    "int64": "int64",
    "float32": "float32",
    "string": "bytes",
    "bytes": "bytes",
    bytes: "bytes",
    str: "bytes",
    np.bytes_: "bytes",
    np.object_: "bytes",
}


def _kind_of(dtype: Any) -> _Kind:
    """Normalizes a feature dtype: np.int64, np.float32, bytes, or their names."""
    try:
        kind = _DTYPE_ALIASES.get(dtype)
    except TypeError:  # unhashable
        kind = None
    if kind is not None:
        return kind
    try:
        numpy_dtype = np.dtype(dtype)
    except TypeError:
        numpy_dtype = None
    if numpy_dtype == np.int64:
        return "int64"
    if numpy_dtype == np.float32:
        return "float32"
    raise ValueError(
        f"unsupported feature dtype {dtype!r}: expected np.int64, np.float32 or bytes "
        '(or "int64", "float32", "string")'
    )


def _numpy_dtype(kind: _Kind) -> np.dtype[Any]:
    return np.dtype({"int64": np.int64, "float32": np.float32, "bytes": object}[kind])


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes | bytearray | memoryview | np.bytes_):
        return bytes(value)
    raise TypeError(f"expected bytes or str, got {type(value).__name__}")


def _array(kind: _Kind, values: Iterable[Any], shape: tuple[int, ...] | None = None) -> Any:
    """numpy array of `kind` holding `values` (bytes as an object array), reshaped."""
    if kind == "bytes":
        items = list(values)
        out = np.empty(len(items), dtype=object)
        out[:] = items
    else:
        out = np.array(values, dtype=_numpy_dtype(kind))
    return out if shape is None else out.reshape(shape)


@dataclass(frozen=True, init=False)
class FixedLenFeature:
    """A feature with a fixed number of values, parsed into an array of `shape`.

    Args:
        shape: The output shape; `()` or `[]` for a scalar. The feature must hold exactly
            `prod(shape)` values.
        dtype: `np.int64`, `np.float32` or `bytes` (or "int64", "float32", "string").
        default_value: Used when an example lacks the feature: a value with `prod(shape)`
            elements, or a single value repeated to fill `shape`. None: missing is an error.

    Raises:
        ValueError: Unsupported dtype, or a default that does not fit `shape`.
    """

    shape: tuple[int, ...]
    dtype: _Kind
    default_value: Any

    def __init__(self, shape: Sequence[int] | int, dtype: Any, default_value: Any = None) -> None:
        dims = (int(shape),) if isinstance(shape, int | np.integer) else tuple(map(int, shape))
        if any(d < 0 for d in dims):
            raise ValueError(f"FixedLenFeature shape {list(dims)} has a negative dimension")
        kind = _kind_of(dtype)
        default = None if default_value is None else _fill_default(kind, dims, default_value)
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "dtype", kind)
        object.__setattr__(self, "default_value", default)


@dataclass(frozen=True, init=False)
class VarLenFeature:
    """A feature with any number of values, parsed into a 1-D array of them.

    Unlike `tf.io.VarLenFeature` the result is dense (int64[n], float32[n] or an object
    array of n `bytes`), not a `SparseTensor`; a missing feature gives an empty array.

    Args:
        dtype: `np.int64`, `np.float32` or `bytes` (or "int64", "float32", "string").
    """

    dtype: _Kind

    def __init__(self, dtype: Any) -> None:
        object.__setattr__(self, "dtype", _kind_of(dtype))


Feature: TypeAlias = FixedLenFeature | VarLenFeature


def _fill_default(kind: _Kind, shape: tuple[int, ...], value: Any) -> Any:
    """The default of a FixedLenFeature as a read-only array of `shape` (bytes: object)."""
    values = [value] if isinstance(value, str | bytes) else np.asarray(value, dtype=object)
    flat = [_as_bytes(v) for v in np.ravel(values)] if kind == "bytes" else np.ravel(values)
    size = math.prod(shape)
    if len(flat) == 1 and size != 1:
        flat = list(flat) * size
    if len(flat) != size:
        raise ValueError(
            f"default_value has {len(flat)} values, but shape {list(shape)} needs {size}"
        )
    out = _array(kind, flat, shape)
    out.flags.writeable = False
    return out


def _parse_proto(serialized: Any) -> Any:
    if isinstance(serialized, np.ndarray) and serialized.ndim == 0:
        serialized = serialized.item()
    try:
        data = _as_bytes(serialized)
    except TypeError as e:
        raise TypeError(f"serialized Example must be bytes, got {type(serialized).__name__}") from e
    try:
        return _pb.Example.FromString(data)
    except _DecodeError as e:
        raise InvalidArgumentError(f"could not parse a serialized Example: {e}") from e


def _stored(example: Any, name: str) -> tuple[_Kind | None, Any]:
    """(kind, values) of feature `name`; kind is None when absent or empty."""
    feature_map = example.features.feature
    if name not in feature_map:
        return None, ()
    feature = feature_map[name]
    field = feature.WhichOneof("kind")
    if field is None:
        return None, ()
    return _KIND_OF_FIELD[field], getattr(feature, field).value


def _parse_one(example: Any, features: Mapping[str, Feature], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, spec in features.items():
        kind, values = _stored(example, name)
        if kind is not None and kind != spec.dtype:
            raise InvalidArgumentError(
                f"feature {name!r}{where}: data types don't match: expected "
                f"{_TF_NAME[spec.dtype]}, stored {_TF_NAME[kind]}"
            )
        if isinstance(spec, VarLenFeature):
            out[name] = _array(spec.dtype, values)
            continue
        if kind is None:
            if spec.default_value is None:
                raise InvalidArgumentError(
                    f"feature {name!r}{where} is required (FixedLenFeature without "
                    "default_value) but missing"
                )
            value = spec.default_value
        else:
            expected = math.prod(spec.shape)
            if len(values) != expected:
                raise InvalidArgumentError(
                    f"feature {name!r}{where}: FixedLenFeature of shape {list(spec.shape)} "
                    f"needs {expected} {_TF_NAME[kind]} values, but the example has "
                    f"{len(values)}"
                )
            value = _array(kind, values, spec.shape)
        if spec.dtype == "bytes" and spec.shape == ():
            value = value.item()
        elif value is spec.default_value:
            value = value.copy()
        out[name] = value
    return out


def parse_single_example(serialized: Any, features: Mapping[str, Feature]) -> dict[str, Any]:
    """Parses one serialized `tf.train.Example` into the requested features.

    Args:
        serialized: A serialized Example (bytes).
        features: Maps feature names to `FixedLenFeature` or `VarLenFeature`.

    Returns:
        A dict with one entry per requested feature: a FixedLenFeature gives an array of its
        shape (int64[*shape], float32[*shape], or object[*shape] of `bytes`; a scalar bytes
        feature gives `bytes`); a VarLenFeature gives a 1-D array of the stored values.

    Raises:
        InvalidArgumentError: The bytes are not an Example; a FixedLenFeature without default
            is missing; a feature holds the wrong number of values (the message names the
            feature and both counts) or the wrong type.
    """
    return _parse_one(_parse_proto(serialized), features, "")


def parse_example(serialized: Any, features: Mapping[str, Feature]) -> dict[str, Any]:
    """Parses a batch of serialized Examples, as `tf.io.parse_example`.

    Args:
        serialized: A 1-D sequence (list, tuple or object array) of serialized Examples.
        features: Maps feature names to `FixedLenFeature` or `VarLenFeature`.

    Returns:
        A dict with one entry per feature: a FixedLenFeature gives an array of shape
        [batch, *shape] (object arrays of `bytes` for bytes features); a VarLenFeature gives
        an object array of shape [batch] whose items are each example's 1-D value array.

    Raises:
        InvalidArgumentError: As `parse_single_example`; the message also names the example
            index.
    """
    if isinstance(serialized, bytes | str) or (
        isinstance(serialized, np.ndarray) and serialized.ndim != 1
    ):
        raise ValueError("parse_example expects a 1-D batch of serialized Examples")
    rows = [
        _parse_one(_parse_proto(record), features, f" in example {i}")
        for i, record in enumerate(serialized)
    ]
    out: dict[str, Any] = {}
    for name, spec in features.items():
        if isinstance(spec, VarLenFeature):
            column = np.empty(len(rows), dtype=object)
            for i, row in enumerate(rows):
                column[i] = row[name]
            out[name] = column
        elif spec.dtype == "bytes":
            out[name] = _array(
                "bytes",
                (v for row in rows for v in np.ravel(np.asarray(row[name], dtype=object))),
                (len(rows), *spec.shape),
            )
        else:
            shape = (len(rows), *spec.shape)
            if rows:
                out[name] = np.stack([row[name] for row in rows]).reshape(shape)
            else:
                out[name] = np.empty(shape, dtype=_numpy_dtype(spec.dtype))
    return out


def decode_example(serialized: Any) -> dict[str, list[int] | list[float] | list[bytes]]:
    """Every feature of a serialized Example as it is stored.

    Returns:
        {name: list[int] | list[float] | list[bytes]}, in name order; a feature with no list
        set gives [].

    Raises:
        InvalidArgumentError: The bytes are not an Example.
    """
    example = _parse_proto(serialized)
    return {name: list(_stored(example, name)[1]) for name in sorted(example.features.feature)}


def _feature_proto(name: str, value: Any) -> Any:
    """The `Feature` message holding `value` (see `serialize_example`)."""
    feature = _pb.Feature()
    if isinstance(value, np.ndarray):
        kind_char = value.dtype.kind
        flat = value.ravel()
        if kind_char in "iub":
            feature.int64_list.value.extend(flat.astype(np.int64).tolist())
        elif kind_char == "f":
            feature.float_list.value.extend(flat.astype(np.float32).tolist())
        elif kind_char in "SUO":
            feature.bytes_list.value.extend(_as_bytes(v) for v in flat)
        else:
            raise TypeError(f"feature {name!r}: unsupported array dtype {value.dtype}")
        return feature
    values = list(value) if isinstance(value, list | tuple) else [value]
    if not values:
        return feature  # no type to infer: an empty Feature, parsed as missing
    if all(isinstance(v, str | bytes | bytearray | np.bytes_ | np.str_) for v in values):
        feature.bytes_list.value.extend(_as_bytes(v) for v in values)
    elif all(isinstance(v, int | np.integer | bool | np.bool_) for v in values):
        feature.int64_list.value.extend(int(v) for v in values)
    elif all(isinstance(v, int | float | np.integer | np.floating | np.bool_) for v in values):
        feature.float_list.value.extend(float(v) for v in values)
    else:
        kinds = sorted({type(v).__name__ for v in values})
        raise TypeError(
            f"feature {name!r}: values must be all ints, all floats or all bytes/str, "
            f"got {', '.join(kinds)}"
        )
    return feature


def serialize_example(features: Mapping[str, Any]) -> bytes:
    """Serializes a dict of values as a `tf.train.Example`.

    Args:
        features: Maps names to an int, float, bytes or str, a list/tuple of them, or a numpy
            array: ints (and bools) become an Int64List, floats a FloatList (float32), bytes
            and str (UTF-8) a BytesList. A list mixing ints and floats is a FloatList; an
            empty list is an empty Feature (parsed as missing).

    Returns:
        The serialized Example; deterministic (features in name order).

    Raises:
        TypeError: A value of another type, or a list mixing numbers and bytes.
    """
    example = _pb.Example()
    feature_map = example.features.feature
    for name, value in features.items():
        feature_map[name].CopyFrom(_feature_proto(name, value))
    data: bytes = example.SerializeToString(deterministic=True)
    return data


class TFRecordWriter:
    """Writes a TFRecord file that TensorFlow (and `TFRecordDataset`) reads, like
    `tf.io.TFRecordWriter`.

    Thread-compatible (caller locks). Use as a context manager, or call `close()`: the
    file is complete only once closed.

    Args:
        path: The file to create (an existing one is truncated).
        compression_type: None or "" (uncompressed), "GZIP" or "ZLIB".

    Raises:
        ValueError: Unknown compression_type.
        NotFoundError: The directory of `path` does not exist.
        OSError: The file cannot be created.
    """

    def __init__(self, path: str | os.PathLike[str], compression_type: str | None = None) -> None:
        self._writer = _core.TFRecordWriter(os.fspath(path), compression_type)

    @property
    def path(self) -> str:
        """The file being written."""
        return self._writer.path

    def write(self, record: bytes | str) -> None:
        """Appends one record (bytes-like, or str written as UTF-8).

        Raises:
            ValueError: The writer is closed.
            OSError: Writing failed.
        """
        if isinstance(record, str):
            record = record.encode("utf-8")
        self._writer.write(record)

    def flush(self) -> None:
        """Hands buffered records to the operating system."""
        self._writer.flush()

    def close(self) -> None:
        """Finishes and closes the file. Closing twice is a no-op."""
        self._writer.close()

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
