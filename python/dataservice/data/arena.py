"""Bytes arenas: a `from_tensor_slices` component that is a list of `bytes` (or an
object array of `bytes` or `str`) held as two numpy arrays instead of one Python
object per item (CASES C-19).

An object array is pickled in band, item by item, so every worker process that
unpickles a pipeline holds its own copy of every item. An arena is one `uint8`
buffer with the items back to back and their `int64` offsets: both are plain
arrays, so big ones travel out of band (data/serialize.py) and workers on the
dispatcher's host map the same file pages copy-on-write, and reading an item
touches no shared Python object (no refcount write dirties a shared page).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["BytesArena", "arena_of"]

_UTF8_ERRORS = "surrogatepass"  # a Python str may hold lone surrogates; keep them


class BytesArena:
    """A 1-D sequence of `bytes` (or of `str`, kept as UTF-8) items in one buffer.

    Item `i` is `data[offsets[i]:offsets[i + 1]]`, returned as a new `bytes` (or
    decoded to a new `str`), so items come out exactly as they went in. Immutable
    and thread-safe; pickles as its two arrays and `item_type`.

    Args:
        data: uint8[total_bytes], the items back to back.
        offsets: int64[n + 1], nondecreasing, from 0 to total_bytes.
        item_type: `bytes` or `str`, the type of the items.
    """

    __slots__ = (
        "_bytes_items",
        "_data_view",
        "_n",
        "_offsets_view",
        "data",
        "item_type",
        "offsets",
    )

    def __init__(self, data: np.ndarray, offsets: np.ndarray, item_type: type) -> None:
        if item_type is not bytes and item_type is not str:
            raise TypeError(f"a BytesArena holds bytes or str items, not {item_type!r}")
        self.data = data
        self.offsets = offsets
        self.item_type = item_type
        self._bytes_items = item_type is bytes
        self._n = len(offsets) - 1
        # Views index without making numpy scalars, and read the (maybe mapped)
        # buffers in place: no per-item Python object is ever held.
        self._data_view = data.data.cast("B")
        self._offsets_view = offsets.data

    @classmethod
    def from_items(cls, items: Sequence[Any], item_type: type) -> BytesArena:
        """The arena of `items`, each of type exactly `item_type` (`bytes` or `str`)."""
        if item_type is str:
            items = [s.encode("utf-8", _UTF8_ERRORS) for s in items]
        offsets = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, items), np.int64, len(items)), out=offsets[1:])
        data = np.frombuffer(b"".join(items), dtype=np.uint8)
        return cls(data, offsets, item_type)

    def __reduce__(self) -> tuple[Any, ...]:
        return (BytesArena, (self.data, self.offsets, self.item_type))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> Any:
        """Item `i` (0 <= i < len) as a new `bytes` or `str`.

        Raises:
            IndexError: `i` is out of range.
        """
        offsets = self._offsets_view
        try:
            if i < 0:
                raise IndexError
            item = self._data_view[offsets[i] : offsets[i + 1]]
        except IndexError:
            raise IndexError(f"item {i} of a {self._n}-item arena") from None
        return item.tobytes() if self._bytes_items else str(item, "utf-8", _UTF8_ERRORS)

    def __repr__(self) -> str:
        return f"BytesArena({self._n} {self.item_type.__name__} items, {self.data.nbytes} bytes)"


def arena_of(value: Any) -> BytesArena | None:
    """`value` as an arena when it is a non-empty list (or tuple) of items of type
    exactly `bytes`, or a non-empty 1-D object array of items all exactly `bytes` or
    all exactly `str`; else None (`np.bytes_`, subclasses, mixtures, nested lists:
    kept as numpy arrays as before)."""
    if isinstance(value, np.ndarray):
        if value.dtype != object or value.ndim != 1 or value.size == 0:
            return None
        items: Sequence[Any] = value.tolist()
        kinds: tuple[type, ...] = (bytes, str)
    elif isinstance(value, list | tuple):
        items, kinds = value, (bytes,)  # a str list is a numpy str array (np.str_ items)
    else:
        return None
    if not items:
        return None
    item_type = type(items[0])
    if item_type not in kinds or not all(type(x) is item_type for x in items):
        return None
    return BytesArena.from_items(items, item_type)
