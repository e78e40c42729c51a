"""Nested element structures: flatten/pack (as `tf.nest`) and per-leaf `TensorSpec`s.

An *element* is a leaf or a nest of `tuple` / `list` / `dict` / namedtuple. Leaves are
numpy values (`np.ndarray`, numpy scalars), `bytes` or `str`; anything else that is not
a `tuple`, `list` or `dict` is a leaf too. As in `tf.nest`:

* dicts flatten in sorted-key order and are rebuilt in the key order of the structure
  given to `pack_sequence_as`;
* namedtuples (and `defaultdict`s, `OrderedDict`s) keep their type when rebuilt;
* `None` is a leaf.

An *element spec* is the same nest with a `TensorSpec(shape, dtype)` per leaf.

Everything here is pure and thread-safe.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataservice._core import copy_if_plain
from dataservice.errors import InvalidArgumentError

__all__ = [
    "TensorSpec",
    "assert_same_structure",
    "flatten",
    "is_compatible",
    "is_nested",
    "map_structure",
    "normalize_element",
    "pack_sequence_as",
    "spec_of",
]

# A leaf's dtype: a numpy dtype, or the Python type `bytes` / `str` for bytes/str leaves.
DType = np.dtype[Any] | type


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of one leaf of an element.

    Attributes:
        shape: A tuple with one entry per dimension: an `int` (>= 0), or `None` for a
            dimension whose size is unknown (e.g. the batch dimension of `batch(n)`
            without `drop_remainder`). `()` for scalars, `bytes` and `str` leaves.
        dtype: A `np.dtype` for numeric and numpy-string leaves (e.g. `int64`, `<U5`,
            `object` for a batch of `bytes`), or the Python type `bytes` / `str` for
            single `bytes` / `str` leaves. Numpy string dtypes match by kind: `<U3` is
            compatible with `<U7` and with `str`.

    Raises:
        ValueError: A dimension is negative or not an int, or `dtype` is not a dtype.
    """

    shape: tuple[int | None, ...]
    dtype: DType

    def __post_init__(self) -> None:
        shape = tuple(None if d is None else _to_dim(d) for d in self.shape)
        object.__setattr__(self, "shape", shape)
        dtype = self.dtype
        if dtype is not bytes and dtype is not str:
            try:
                dtype = np.dtype(dtype)
            except TypeError as e:
                raise ValueError(f"TensorSpec: {self.dtype!r} is not a dtype") from e
        object.__setattr__(self, "dtype", dtype)

    def __repr__(self) -> str:
        dtype = self.dtype.__name__ if isinstance(self.dtype, type) else str(self.dtype)
        return f"TensorSpec(shape={self.shape}, dtype={dtype})"

    def is_compatible_with(self, other: TensorSpec | Any) -> bool:
        """True if `other` (a `TensorSpec` or a leaf value) fits this spec.

        Shapes must have the same rank and equal sizes where this spec's size is not
        None (a None in `other` only matches a None here); dtypes must be equal, string
        dtypes only of the same kind.
        """
        if not isinstance(other, TensorSpec):
            other = _leaf_spec(other)
        if len(self.shape) != len(other.shape):
            return False
        for mine, theirs in zip(self.shape, other.shape, strict=True):
            if mine is not None and mine != theirs:
                return False
        return _dtypes_compatible(self.dtype, other.dtype)

    def most_specific_common_supertype(self, other: TensorSpec) -> TensorSpec | None:
        """The narrowest spec both this and `other` fit, or None if dtypes or ranks differ.

        Dimensions that differ become None (as tf.data does for `concatenate`).
        """
        if len(self.shape) != len(other.shape) or not _dtypes_compatible(self.dtype, other.dtype):
            return None
        shape = tuple(a if a == b else None for a, b in zip(self.shape, other.shape, strict=True))
        dtype = self.dtype
        if self.dtype != other.dtype:  # strings of one kind, different widths or types
            dtype = np.dtype(_string_kind(self.dtype))
        return TensorSpec(shape, dtype)


def _to_dim(d: Any) -> int:
    try:
        n = int(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"TensorSpec: dimension {d!r} is not an int or None") from e
    if n < 0 or n != d:
        raise ValueError(f"TensorSpec: dimension {d!r} is not a non-negative int")
    return n


def _string_kind(dtype: DType) -> str | None:
    """'S' for bytes-like dtypes, 'U' for str-like ones, None otherwise."""
    if dtype is bytes:
        return "S"
    if dtype is str:
        return "U"
    if isinstance(dtype, np.dtype) and dtype.kind in "SU":
        return dtype.kind
    return None


def _dtypes_compatible(a: DType, b: DType) -> bool:
    if a == b:
        return True
    kind = _string_kind(a)
    return kind is not None and kind == _string_kind(b)


# ---------------------------------------------------------------------------- nesting


_NEST_TYPES = (tuple, list, dict)


def is_nested(value: Any) -> bool:
    """True for `tuple` (incl. namedtuple), `list` and `dict` values: the non-leaves."""
    return isinstance(value, _NEST_TYPES)


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _sorted_keys(d: dict[Any, Any]) -> list[Any]:
    try:
        return sorted(d)
    except TypeError as e:
        raise TypeError(f"nest only supports dicts with sortable keys, got keys {list(d)}") from e


def _children(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [value[k] for k in _sorted_keys(value)]
    return list(value)


def _sequence_like(instance: Any, children: list[Any]) -> Any:
    """Builds a nest of `instance`'s type from children in flatten order."""
    if isinstance(instance, dict):
        by_key = dict(zip(_sorted_keys(instance), children, strict=True))
        if type(instance) is dict:
            return {k: by_key[k] for k in instance}
        if isinstance(instance, collections.defaultdict):
            result = type(instance)(instance.default_factory)
            for k in instance:
                result[k] = by_key[k]
            return result
        try:
            return type(instance)((k, by_key[k]) for k in instance)
        except TypeError:
            return {k: by_key[k] for k in instance}
    if _is_namedtuple(instance):
        return type(instance)(*children)
    if type(instance) is tuple:
        return tuple(children)
    if type(instance) is list:
        return children
    try:
        return type(instance)(children)
    except TypeError:
        return tuple(children) if isinstance(instance, tuple) else children


def flatten(element: Any) -> list[Any]:
    """The leaves of `element` in depth-first order (dict values by sorted key).

    Returns:
        A new list; `[element]` when `element` is itself a leaf.
    Raises:
        TypeError: A dict has keys that cannot be sorted together.
    """
    if not is_nested(element):
        return [element]
    out: list[Any] = []
    _flatten_into(element, out)
    return out


def _flatten_into(value: Any, out: list[Any]) -> None:
    if is_nested(value):
        for child in _children(value):
            _flatten_into(child, out)
    else:
        out.append(value)


def pack_sequence_as(structure: Any, leaves: Sequence[Any]) -> Any:
    """Builds a nest shaped like `structure` whose leaves are `leaves`, in flatten order.

    Raises:
        InvalidArgumentError: `leaves` does not have one value per leaf of `structure`.
    """
    leaves = list(leaves)
    if not is_nested(structure):
        if len(leaves) != 1:
            raise InvalidArgumentError(
                f"pack_sequence_as: the structure is a single leaf but {len(leaves)} "
                "values were given"
            )
        return leaves[0]
    packed, used = _pack(structure, leaves, 0)
    if used != len(leaves):
        raise InvalidArgumentError(
            f"pack_sequence_as: the structure {_structure_repr(structure)} has {used} "
            f"leaves but {len(leaves)} values were given"
        )
    return packed


def _pack(structure: Any, leaves: list[Any], index: int) -> tuple[Any, int]:
    if not is_nested(structure):
        if index >= len(leaves):
            raise InvalidArgumentError(
                f"pack_sequence_as: too few values ({len(leaves)}) for the structure"
            )
        return leaves[index], index + 1
    children = []
    for child in _children(structure):
        value, index = _pack(child, leaves, index)
        children.append(value)
    return _sequence_like(structure, children), index


def map_structure(fn: Callable[..., Any], *structures: Any) -> Any:
    """Applies `fn` to corresponding leaves of `structures`; result shaped like the first.

    Raises:
        InvalidArgumentError: The structures differ (see `assert_same_structure`).
        ValueError: No structure was given.
    """
    if not structures:
        raise ValueError("map_structure needs at least one structure")
    first = structures[0]
    for other in structures[1:]:
        assert_same_structure(first, other)
    if not is_nested(first):
        return fn(*structures)
    flat = [flatten(s) for s in structures]
    return pack_sequence_as(first, [fn(*leaves) for leaves in zip(*flat, strict=True)])


def _structure_repr(value: Any) -> str:
    """`value` with every leaf shown as `.`, e.g. `(., {'a': ., 'b': [., .]})`."""
    if isinstance(value, dict):
        inner = ", ".join(f"{k!r}: {_structure_repr(value[k])}" for k in value)
        name = "" if type(value) is dict else type(value).__name__
        return f"{name}{{{inner}}}"
    if _is_namedtuple(value):
        inner = ", ".join(
            f"{f}={_structure_repr(v)}" for f, v in zip(value._fields, value, strict=True)
        )
        return f"{type(value).__name__}({inner})"
    if isinstance(value, tuple):
        inner = ", ".join(_structure_repr(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(_structure_repr(v) for v in value) + "]"
    return "."


def _structure_mismatch(a: Any, b: Any, check_types: bool) -> str | None:
    """Why `a` and `b` differ in structure, or None if they match."""
    if is_nested(a) != is_nested(b):
        return f"{_structure_repr(a)} vs {_structure_repr(b)}: one is a nest, the other a leaf"
    if not is_nested(a):
        return None
    if isinstance(a, dict) != isinstance(b, dict):
        return f"{_structure_repr(a)} and {_structure_repr(b)} are not both dicts"
    if check_types and type(a) is not type(b):
        return f"type {type(a).__name__} != type {type(b).__name__}"
    if isinstance(a, dict):
        if set(a) != set(b):
            return f"dict keys {sorted(map(repr, a))} != {sorted(map(repr, b))}"
    elif len(a) != len(b):
        return f"{_structure_repr(a)} has length {len(a)} but {_structure_repr(b)} has {len(b)}"
    for ca, cb in zip(_children(a), _children(b), strict=True):
        why = _structure_mismatch(ca, cb, check_types)
        if why is not None:
            return why
    return None


def assert_same_structure(a: Any, b: Any, check_types: bool = True) -> None:
    """Checks that `a` and `b` nest the same way (leaf values are not compared).

    Args:
        check_types: Also require the same container types (tuple vs list vs a
            namedtuple type); dict key sets must match either way.
    Raises:
        InvalidArgumentError: They differ; the message shows both structures (leaves
            as `.`) and the first difference.
    """
    why = _structure_mismatch(a, b, check_types)
    if why is not None:
        raise InvalidArgumentError(
            "The two structures don't have the same nested structure.\n"
            f"  First structure:  {_structure_repr(a)}\n"
            f"  Second structure: {_structure_repr(b)}\n"
            f"  More specifically: {why}"
        )


# ---------------------------------------------------------------------------- specs


def _leaf_spec(leaf: Any) -> TensorSpec:
    if isinstance(leaf, np.ndarray):
        return TensorSpec(leaf.shape, leaf.dtype)
    if isinstance(leaf, np.generic):  # before bytes/str: np.str_ is a str too
        return TensorSpec((), leaf.dtype)
    if isinstance(leaf, bytes):
        return TensorSpec((), bytes)
    if isinstance(leaf, str):
        return TensorSpec((), str)
    if isinstance(leaf, bool | int | float | complex):
        return TensorSpec((), np.asarray(leaf).dtype)
    return TensorSpec((), np.dtype(object))


def spec_of(element: Any) -> Any:
    """The element spec of a value: its structure with a `TensorSpec` per leaf.

    `np.ndarray` -> (its shape, its dtype); numpy scalar -> ((), its dtype); `bytes` /
    `str` -> ((), bytes / str); Python bool/int/float/complex -> ((), numpy's dtype for
    it); any other leaf -> ((), object).
    """
    return map_structure(_leaf_spec, element)


def is_compatible(spec: Any, element: Any) -> bool:
    """True if `element` has `spec`'s structure and each leaf fits its `TensorSpec`.

    `spec` may also be a nest of `TensorSpec`s to compare with another spec.
    """
    if _structure_mismatch(spec, element, check_types=True) is not None:
        return False
    for s, leaf in zip(flatten(spec), flatten(element), strict=True):
        if not isinstance(s, TensorSpec) or not s.is_compatible_with(leaf):
            return False
    return True


# ---------------------------------------------------------------------------- values


def _normalize_leaf(leaf: Any) -> Any:
    if isinstance(leaf, bool):
        return np.bool_(leaf)
    if isinstance(leaf, int) and not isinstance(leaf, np.generic):
        try:
            return np.int64(leaf)
        except OverflowError:
            return np.asarray(leaf)[()]
    if isinstance(leaf, float) and not isinstance(leaf, np.generic):
        return np.float64(leaf)
    if isinstance(leaf, complex) and not isinstance(leaf, np.generic):
        return np.complex128(leaf)
    return leaf


_PASS_THROUGH = (np.ndarray, np.generic, bytes, str)
# Exact types of leaves `_normalize_leaf` keeps as they are (grown with the numpy scalar
# types and str/bytes/ndarray subclasses met): one set lookup per leaf, no call.
_PASS_TYPES: set[type] = {np.ndarray, bytes, str, type(None)}


def normalize_element(element: Any) -> Any:
    """Turns Python scalar leaves into numpy scalars (int -> int64, float -> float64,
    bool -> bool_, complex -> complex128); other leaves and the structure are kept (the
    nest is rebuilt: new dicts, lists and tuples, in their own key order), as
    `map_structure(_normalize_leaf, element)` does (a tuple whose items are all kept is
    returned as is: it is immutable). Plain dicts, lists and tuples are rebuilt with one
    comprehension each (or one copy when no item changes: `_core.copy_if_plain` checks a
    dict of str keys, a list or a tuple in one walk), not through `flatten` and
    `pack_sequence_as`: an element of many leaves costs a set lookup per leaf.

    Raises:
        TypeError: A dict has keys that cannot be sorted together (as `flatten`).
        InvalidArgumentError: The element nests deeper than Python's recursion
            limit lets it be walked (an element holds at most 32 levels).
    """
    if isinstance(element, _PASS_THROUGH):
        return element
    try:
        return _normalized(element)
    except RecursionError:
        raise InvalidArgumentError(
            f"the element is a {type(element).__name__} nested deeper than Python's "
            "recursion limit lets it be walked: elements hold numpy arrays and scalars in "
            "dicts, lists and tuples nested at most 32 levels deep"
        ) from None


def _normalized(value: Any) -> Any:
    kind = type(value)
    if kind in _PASS_TYPES:
        return value
    pass_types = _PASS_TYPES
    if kind is dict or kind is list or kind is tuple:
        copied = copy_if_plain(value, pass_types)  # str keys and kept leaves: one walk in Rust
        if copied is not None:
            return copied
    keep = pass_types.__contains__
    if kind is dict:
        _sorted_keys(value)  # unsortable keys raise, as map_structure's flatten does
        if all(map(keep, map(type, value.values()))):  # in C: no Python call per leaf
            return dict(value)
        return {k: v if type(v) in pass_types else _normalized(v) for k, v in value.items()}
    if kind is list:
        if all(map(keep, map(type, value))):
            return list(value)
        return [v if type(v) in pass_types else _normalized(v) for v in value]
    if kind is tuple:
        if all(map(keep, map(type, value))):
            return value  # immutable, and every item kept
        return tuple([v if type(v) in pass_types else _normalized(v) for v in value])
    if isinstance(value, _PASS_THROUGH):
        _PASS_TYPES.add(kind)
        return value
    if is_nested(value):  # namedtuples, dict/list/tuple subclasses
        return map_structure(_normalize_leaf, value)
    return _normalize_leaf(value)
