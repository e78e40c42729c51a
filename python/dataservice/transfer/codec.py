"""Encoding of one element for the gRPC transfer path.

An element (numpy arrays, numpy scalars, bytes, str, nested tuple / list /
dict / namedtuple of those) is pickled with protocol 5 and its array payloads
travel out of band, so an array costs one copy into the message and one out.
Layout of an encoded element (little-endian):

    b"DSE1" | u32 n_buffers | u64 header_bytes | u64 buffer_bytes[n_buffers]
    | header | buffer 0 | buffer 1 | ...

Workers are trusted (they run the pipelines you registered), so decoding
pickles is no new exposure; the shared-memory ring has its own frame codec.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

import numpy as np

from dataservice import errors

_MAGIC = b"DSE1"
_ZSTD_MAGIC = b"DSZ1"  # then a zstd frame of an encoded element
_PREFIX = struct.Struct("<4sIQ")
COMPRESSIONS = ("zstd",)


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

    return _ZSTD_MAGIC + zstandard.ZstdCompressor(level=1).compress(data)


def encode(element: Any) -> bytes:
    """Returns the bytes of `element` (one copy of each array payload)."""
    buffers: list[pickle.PickleBuffer] = []
    header = pickle.dumps(element, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    parts: list[Any] = [
        _PREFIX.pack(_MAGIC, len(raws), len(header)),
        struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws)),
        header,
    ]
    parts.extend(raws)
    return b"".join(parts)


def decode(data: bytes) -> Any:
    """Rebuilds an element; arrays come back writeable (one copy out of `data`).

    Raises:
        DataLossError: `data` is not an encoded element.
    """
    if data[:4] == _ZSTD_MAGIC:
        import zstandard

        data = zstandard.ZstdDecompressor().decompress(data[4:])
    view = memoryview(data)
    if len(view) < _PREFIX.size or bytes(view[:4]) != _MAGIC:
        raise errors.DataLossError("received an element that is not in the dataservice format")
    _, n_buffers, header_bytes = _PREFIX.unpack_from(view)
    pos = _PREFIX.size
    sizes = struct.unpack_from(f"<{n_buffers}Q", view, pos)
    pos += 8 * n_buffers
    header = view[pos : pos + header_bytes]
    pos += header_bytes
    if not n_buffers:
        return pickle.loads(header)
    # One writeable copy of all payloads; each buffer is a slice of it.
    payload = bytearray(view[pos:])
    if len(payload) != sum(sizes):
        raise errors.DataLossError(
            f"element payload is {len(payload)} bytes, its header says {sum(sizes)}"
        )
    out = memoryview(payload)
    bufs = []
    off = 0
    for size in sizes:
        bufs.append(out[off : off + size])
        off += size
    return pickle.loads(header, buffers=bufs)


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


def element_nbytes(element: Any) -> int:
    """Approximate size of an element's payload in bytes (array nbytes, bytes
    and str lengths, 8 per other scalar): what buffers count against budgets."""
    if isinstance(element, np.ndarray):
        return int(element.nbytes)
    if isinstance(element, (bytes, str)):
        return len(element)
    if isinstance(element, dict):
        return sum(element_nbytes(v) for v in element.values())
    if isinstance(element, (tuple, list)):
        return sum(element_nbytes(v) for v in element)
    return 8
