"""Encoding of one element for the gRPC transfer path, and what the worker checks
of each element (`signature`, `element_nbytes`).

An element (numpy arrays, numpy scalars, bytes, str, int/float/bool/None, numpy
object arrays of bytes, nested tuple / list / dict / namedtuple of those;
anything else pickled as a leaf) is encoded by the same Rust frame codec as the
shared-memory ring's (rust/transport/codec.rs, TRANSPORT.md §6), in one call
and one buffer: its structure (the spec: dict keys, dtypes, ranks), then one
DATA frame (a descriptor per leaf, then the payloads). Each array payload is
copied once into the message and once out of it (or not at all out of a
`bytearray` the caller hands over). Decoding resolves a spec once and reuses it
for every element of that structure, so an element of many small leaves costs
a numpy view per leaf, not a pickle call. As over shared memory: dicts come
back with sorted keys (tf.nest's order), byte-swapped arrays in native byte
order, non-contiguous and Fortran-order arrays C-ordered.

Workers are trusted (they run the pipelines you registered), so unpickling a
pickled leaf is no new exposure; every length and offset of the frame is
checked before it is used.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from dataservice import _core, errors

_ZSTD_MAGIC = b"DSZ1"  # then a zstd frame of an encoded element
COMPRESSIONS = ("zstd",)
ZSTD_LEVEL = 1  # fast: a link must be slower than the codec for it to pay


def compress(data: bytes, compression: str) -> bytes:
    """An encoded element compressed with `compression` ("zstd"; "" = as is).

    Raises:
        InvalidArgumentError: An unknown compression name.
    """
    if not compression:
        return data
    if compression != "zstd":
        raise errors.InvalidArgumentError(
            f"unknown compression {compression!r}; known: {', '.join(COMPRESSIONS)}"
        )
    import zstandard

    return _ZSTD_MAGIC + zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def encode(element: Any) -> bytes:
    """Returns the bytes of `element` (one copy of each array payload).

    Raises:
        Exception: What pickling a leaf the codec does not carry as a value raises
            (e.g. `TypeError` for a lock).
    """
    return _core.encode_element(element)


# An element at least this big is encoded later (`encode_later`): its bytes are made
# as they are sent, piece by piece or straight into a message shared with others.
LATER_BYTES = 4 << 10

Encoding = _core.Encoding


def encode_later(element: Any) -> bytes | _core.Encoding:
    """`element`'s encoding (the bytes of `encode`): as `bytes` when it is small
    (under `LATER_BYTES`; a scalar, bytes or str leaf alone), else as an `Encoding`
    that copies nothing yet and makes any range of those bytes on demand
    (`Encoding.piece(start, end)`; `len()` is their size, `bytes()` all of them,
    `.element` the element; `join` copies it straight into a shared message).

    A worker sends a large element in pieces of about 1 MiB made as they go, so it
    never holds the whole copy and its allocator reuses a few blocks: measured on
    9.6 MB elements, 3 page faults in 3 s of sending against ~1,300 per element for
    one whole `bytes` (grpcio copies each message once more into memory of its own).

    Raises:
        Exception: As `encode`.
    """
    if type(element) is np.ndarray:
        if element.nbytes < LATER_BYTES:
            return _core.encode_element(element)
    elif not isinstance(element, tuple | list | dict):
        return _core.encode_element(element)  # a scalar, bytes, str, pickled object
    encoding = _core.encode_element_later(element)
    return encoding if len(encoding) >= LATER_BYTES else bytes(encoding)


def as_bytes(encoded: bytes | _core.Encoding) -> bytes:
    """The bytes of an `encode` or `encode_later` result."""
    return encoded if type(encoded) is bytes else bytes(encoded)


def join(encoded: Sequence[bytes | _core.Encoding]) -> bytes:
    """`encode` / `encode_later` results back to back in one `bytes`, each copied
    once (`b"".join` of `as_bytes` would copy an `Encoding` twice)."""
    return _core.join_encoded(list(encoded))


def plain_nbytes(data: bytes | bytearray) -> int:
    """The size of an encoded element as it was before `compress` (bytes): a zstd
    frame's recorded content size, else `len(data)`."""
    if data[:4] == _ZSTD_MAGIC:
        import zstandard

        size = zstandard.frame_content_size(memoryview(data)[4:])
        if size >= 0:
            return int(size)
    return len(data)


def decode(data: bytes | bytearray) -> Any:
    """Rebuilds an element; arrays come back writeable: one copy out of `data`, or
    views of it when `data` is a `bytearray` (the caller hands it over: a large
    element put together from gRPC pieces is not copied a second time).

    Raises:
        DataLossError: `data` is not an encoded element, or a damaged one (the
            message names the problem and where).
    """
    if data[:4] == _ZSTD_MAGIC:
        import zstandard

        data = zstandard.ZstdDecompressor().decompress(data[4:])
    return _core.decode_element(data)


def signature(element: Any) -> Any:
    """The structure of `element` with each leaf's kind and dtype (not its shape):
    two elements of one stream must have equal signatures. A numpy string's
    width (`<U3`, `|S7`) is not part of it, as a tf.string has no width: each
    element (a batch of file names, say) is as wide as its longest string."""
    if isinstance(element, np.ndarray):
        return ("ndarray", _dtype_key(element.dtype), element.ndim)
    if isinstance(element, np.generic):
        return ("scalar", _dtype_key(element.dtype))
    if isinstance(element, tuple):
        kind = type(element) if hasattr(element, "_fields") else tuple
        return (kind, tuple(signature(e) for e in element))
    if isinstance(element, list):
        return (list, tuple(signature(e) for e in element))
    if isinstance(element, dict):
        return (dict, tuple((k, signature(element[k])) for k in sorted(element)))
    if isinstance(element, (bytes, str, int, float, bool)) or element is None:
        return type(element)
    return type(element)


def _dtype_key(dtype: np.dtype) -> str:
    """`dtype.str`, without the width of a string dtype ("<U", "|S")."""
    text = dtype.str
    return text[:2] if dtype.kind in "US" else text


def describe(sig: Any) -> str:
    """A readable form of a `signature`."""
    if isinstance(sig, tuple) and sig and sig[0] == "ndarray":
        return f"ndarray({np.dtype(sig[1]).name}, ndim={sig[2]})"
    if isinstance(sig, tuple) and sig and sig[0] == "scalar":
        return np.dtype(sig[1]).name
    if isinstance(sig, tuple) and len(sig) == 2 and sig[0] is dict:
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in sig[1]) + "}"
    if isinstance(sig, tuple) and len(sig) == 2 and isinstance(sig[0], type):
        inner = ", ".join(describe(s) for s in sig[1])
        if sig[0] is list:
            return f"[{inner}]"
        if sig[0] is tuple:
            return f"({inner})"
        return f"{sig[0].__name__}({inner})"
    if isinstance(sig, type):
        return sig.__name__
    return repr(sig)


# Leaves the codecs carry as values (gRPC's pickle and the shared-memory frame
# codec alike); anything else is pickled, which an element only may when its
# pipeline opted in (`allow_pickled_elements`).
_SIMPLE_LEAVES = (bytes, str, int, float, complex, bool, type(None))
_LEAF_BYTES = 8  # a Python number or None, as counted against budgets
MAX_WALK_NODES = 10_000
"""Values `element_nbytes` visits one by one in an element; past that the rest of
a long object array or list is estimated from the mean size of the items measured
so far (their types are still all checked)."""
_MAX_DEPTH = 32  # the frame codec pickles deeper nests


class _Walk:
    """One element's walk: the node budget and whether pickled leaves may pass."""

    __slots__ = ("allow_pickled", "nodes")

    def __init__(self, allow_pickled: bool) -> None:
        self.allow_pickled = allow_pickled
        self.nodes = 0


class _NotNumpy(Exception):
    """A leaf that is not a numpy value; `steps` is its path, innermost last."""

    def __init__(self, value: Any, why: str) -> None:
        super().__init__()
        self.value = value
        self.why = why
        self.steps: list[str] = []


def element_nbytes(element: Any, *, allow_pickled: bool = True) -> int:
    """The bytes an element holds: what task buffers, the cross-trainer cache and
    the shared-memory requests count against their budgets.

    A numeric numpy array counts `nbytes` (no walk); a numpy *object* array counts
    its pointers plus what each item holds (bytes and str lengths, nested arrays,
    recursively); bytes and str their length; a numpy scalar its itemsize; a
    Python number or None 8; tuples, lists and dicts the sum of their items; any
    other object (pickled by the codecs, so only with `allow_pickled`) the size of
    its pickle (it is pickled once more to be measured). The walk visits at
    most `MAX_WALK_NODES` values one by one, then estimates the rest of a long
    sequence from the mean of its measured items; lists and object arrays of only
    bytes, str or Python numbers are summed in C, whatever their length.

    Args:
        element: One element of a pipeline.
        allow_pickled: False: a leaf that is not a numpy value (not an array, a
            numpy scalar, bytes, str, int, float, complex, bool or None: a
            dataclass instance, a set, a PIL image, ...) raises.

    Returns:
        The element's payload size in bytes.

    Raises:
        InvalidArgumentError: `allow_pickled` is False and the element holds a
            leaf that is not a numpy value; the message names its path (e.g.
            `element["meta"][2]`) and type.
    """
    if type(element) is np.ndarray and not element.dtype.hasobject:
        return int(element.nbytes)
    try:
        return _nbytes(element, _Walk(allow_pickled), 0)
    except _NotNumpy as err:
        raise errors.InvalidArgumentError(_not_numpy_message(err)) from None


def _nbytes(value: Any, walk: _Walk, depth: int) -> int:
    walk.nodes += 1
    if isinstance(value, np.ndarray):
        if type(value) is not np.ndarray and isinstance(value, np.ma.MaskedArray):
            # As a plain array its mask would be lost, and the masked values come back.
            return _other(
                value,
                walk,
                "a masked array, whose mask a plain array would lose: send "
                "np.ma.getdata(x) and np.ma.getmaskarray(x) as two leaves",
            )
        if not value.dtype.hasobject:
            return int(value.nbytes)
        if value.dtype.fields is not None:  # a structured dtype with object fields
            return _other(value, walk, "a structured array with object fields: pickled")
        flat = value.ravel()  # C order (a copy of the pointers if not contiguous)
        try:
            return int(value.nbytes) + _items_nbytes(flat, walk, depth, in_array=True)
        except _NotNumpy as err:
            index = err.steps.pop() if err.steps else ""
            if value.ndim != 1 and index:  # the flat index as the array's own
                position = np.unravel_index(int(index[1:-1]), value.shape)
                index = "[" + ", ".join(str(int(p)) for p in position) + "]"
                index = "[()]" if index == "[]" else index
            err.steps.append(index)
            raise
    if isinstance(value, (bytes, str)):
        return len(value)
    if isinstance(value, np.generic):
        return int(value.nbytes) if not isinstance(value, np.object_) else _LEAF_BYTES
    if isinstance(value, _SIMPLE_LEAVES):
        return _LEAF_BYTES
    if depth >= _MAX_DEPTH and isinstance(value, (dict, tuple, list)):
        return _other(value, walk, f"nested more than {_MAX_DEPTH} levels deep")
    if isinstance(value, dict):
        total = 0
        for key, item in value.items():
            try:
                total += _nbytes(item, walk, depth + 1)
            except _NotNumpy as err:
                err.steps.append(f"[{key!r}]")
                raise
        return total
    if isinstance(value, (tuple, list)):
        return _items_nbytes(value, walk, depth)
    return _other(value, walk, "")


def _is_known(kind: type) -> bool:
    return issubclass(kind, (np.ndarray, np.generic, dict, tuple, list, *_SIMPLE_LEAVES))


def _is_array_item(kind: type) -> bool:
    """Whether an object array may hold items of `kind` without the opt-in to
    pickled leaves: bytes and str (a string tensor), numbers and None, numpy
    arrays and scalars (a ragged array; checked in turn). Not dicts, lists or
    tuples: the array is not a nest of the element's structure, so the codecs
    pickle it whole (the shared-memory frame codec carries only object arrays of
    bytes as values)."""
    return issubclass(kind, (np.ndarray, np.generic, *_SIMPLE_LEAVES))


def _items_nbytes(items: Any, walk: _Walk, depth: int, *, in_array: bool = False) -> int:
    """The bytes of a list's, tuple's or flattened object array's items
    (`in_array`: the latter, whose items `_is_array_item` restricts)."""
    n = len(items)
    if n == 0:
        return 0
    kinds = set(map(type, items))  # in C: cheap even for millions of items
    if kinds <= {bytes, str}:
        return sum(map(len, items))
    if kinds <= {int, float, bool, type(None)}:
        return _LEAF_BYTES * n
    if not walk.allow_pickled:
        allowed = _is_array_item if in_array else _is_known
        unknown = tuple(k for k in kinds if not allowed(k))
        if unknown:  # the first one, wherever it is: checked before any estimate
            i = next(i for i, item in enumerate(items) if type(item) in unknown)
            why = ""
            if _is_known(type(items[i])):
                why = "held by a numpy object array, which is pickled; a list of them is not"
            err = _NotNumpy(items[i], why)
            err.steps.append(f"[{i}]")
            raise err
    total = 0
    for i, item in enumerate(items):
        if walk.nodes >= MAX_WALK_NODES and i:
            return total + (total // i) * (n - i)  # the rest at the mean so far
        try:
            total += _nbytes(item, walk, depth + 1)
        except _NotNumpy as err:
            err.steps.append(f"[{i}]")
            raise
    return total


def _other(value: Any, walk: _Walk, why: str) -> int:
    """A leaf the codecs pickle: counted as its pickle's size (what it holds as it
    travels: a PIL image's pixels, which `sys.getsizeof` would miss), or refused."""
    if not walk.allow_pickled:
        raise _NotNumpy(value, why)
    return _pickled_nbytes(value)


def _pickled_nbytes(value: Any) -> int:
    out_of_band: list[pickle.PickleBuffer] = []
    try:
        header = pickle.dumps(value, protocol=5, buffer_callback=out_of_band.append)
    except Exception:  # the codec will say why when it pickles the element
        import sys

        return int(sys.getsizeof(value))
    return len(header) + sum(memoryview(b).nbytes for b in out_of_band)


def _not_numpy_message(err: _NotNumpy) -> str:
    kind = type(err.value)
    name = kind.__qualname__
    if kind.__module__ != "builtins":
        name = f"{kind.__module__}.{name}"
    path = "element" + "".join(reversed(err.steps))
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return (
        f"{path} is {article} {name}"
        + (f" ({err.why})" if err.why else "")
        + ", which is not a numpy value: elements hold numpy arrays and scalars, bytes, str, "
        "int, float, bool and None, nested in tuples, lists and dicts. Convert it in the "
        "pipeline (e.g. np.asarray(image), a dict of a dataclass's fields), or let the "
        "service pickle such elements: distribute(..., allow_pickled_elements=True) or "
        "register_dataset(..., allow_pickled_elements=True)"
    )
