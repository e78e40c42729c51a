"""Stacking elements into batches (`Dataset.batch`) and the element spec of a batch.

Owns how a list of elements becomes one batch, leaf by leaf in `structure.flatten`
order: numeric leaves with `np.stack`, `str` leaves as a numpy str array, `bytes` and
other objects as an object array (tf.data's `batch` semantics for numpy values).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dataservice.data import structure
from dataservice.data.structure import TensorSpec
from dataservice.errors import InvalidArgumentError

__all__ = ["batched_spec", "pad_stack", "stack"]


def _stack_leaves(values: list[Any], component: int) -> Any:
    """Stacks one leaf of each element of a batch along a new axis 0."""
    first = values[0]
    if isinstance(first, np.ndarray):
        shape, dtype = first.shape, first.dtype
        for k, v in enumerate(values):
            vshape = getattr(v, "shape", None)
            if vshape != shape:
                raise InvalidArgumentError(
                    f"Cannot batch tensors with different shapes in component {component}. "
                    f"First element had shape {shape} and element {k} had shape {vshape}."
                )
            if v.dtype != dtype:  # np.stack would cast them all to one type, silently
                raise InvalidArgumentError(
                    f"Cannot batch tensors with different dtypes in component {component}. "
                    f"First element had dtype {dtype} and element {k} had dtype {v.dtype} "
                    "(cast them to one dtype in the map that makes them)."
                )
        return np.stack(values)
    if isinstance(first, str | np.str_) and all(isinstance(v, str) for v in values):
        return np.array(values, dtype=str)
    if isinstance(first, np.generic | bool | int | float | complex):
        arr = np.array(values)
        if arr.ndim != 1:
            raise InvalidArgumentError(
                f"Cannot batch component {component}: its elements are not all scalars"
            )
        kind = type(first)
        if any(type(v) is not kind for v in values):
            _same_scalar_dtype(values, component)
        return arr
    arr = np.empty(len(values), dtype=object)  # bytes and other objects, kept as they are
    arr[:] = values
    return arr


def _same_scalar_dtype(values: list[Any], component: int) -> None:
    """Raises if the scalars `values` (one leaf of a batch) have different
    numpy dtypes: int and float, int32 and int64... (np.array would cast them
    all to one, silently).

    Raises:
        InvalidArgumentError: Names the component and the first that differs.
    """
    first = values[0]
    kind = np.asarray(first).dtype
    for k, other in enumerate(values):
        if np.asarray(other).dtype != kind:
            raise InvalidArgumentError(
                f"Cannot batch scalars of different types in component {component}. "
                f"First element was {type(first).__name__} ({kind}) and element {k} was "
                f"{type(other).__name__} ({np.asarray(other).dtype}) (make them one type "
                "in the map that makes them)."
            )


def stack(elements: list[Any]) -> Any:
    """Stacks a batch of elements leaf by leaf (leaves numbered in flatten order).

    Raises:
        InvalidArgumentError: The elements' structures or a leaf's shapes differ.
    """
    return _stack_nested(elements, [0])


def _stack_nested(elements: list[Any], component: list[int]) -> Any:
    first = elements[0]
    if not structure.is_nested(first):
        index = component[0]
        component[0] += 1
        return _stack_leaves(elements, index)
    kind = type(first)
    if isinstance(first, dict):
        keys = first.keys()
        for k, e in enumerate(elements):
            if type(e) is not kind or e.keys() != keys:
                _same_structure(first, e, k)
        by_key = {
            k: _stack_nested([e[k] for e in elements], component)
            for k in structure._sorted_keys(first)
        }
        if kind is dict:
            return {k: by_key[k] for k in first}
        return structure._sequence_like(first, [by_key[k] for k in sorted(by_key)])
    n = len(first)
    for k, e in enumerate(elements):
        if type(e) is not kind or len(e) != n:
            _same_structure(first, e, k)
    children = [_stack_nested([e[i] for e in elements], component) for i in range(n)]
    return structure._sequence_like(first, children)


def _same_structure(first: Any, element: Any, k: int) -> None:
    """Raises if `element`, the batch's k-th, has another structure than its first.

    Raises:
        InvalidArgumentError: Names batch, both elements and what differs.
    """
    try:
        structure.assert_same_structure(first, element)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(
            f"Cannot batch elements of different structures: element 0 of the batch is the "
            f"first structure below, element {k} the second. {err}"
        ) from None


def batched_spec(spec: Any, batch_dim: int | None) -> Any:
    def leaf(s: TensorSpec) -> TensorSpec:
        dtype: Any = s.dtype
        if dtype is bytes:
            dtype = np.dtype(object)
        elif dtype is str:
            dtype = np.dtype(str)
        return TensorSpec((batch_dim, *s.shape), dtype)

    return structure.map_structure(leaf, spec)


def _default_padding(dtype: np.dtype[Any]) -> Any:
    """tf.data's default padding value: 0 for numbers, "" for strings, b"" for bytes."""
    if dtype.kind == "U":
        return ""
    if dtype.kind == "S":
        return b""
    if dtype.kind == "O":
        return b""
    return 0


def pad_stack(
    elements: list[Any],
    padded_shapes: list[tuple[int | None, ...] | None],
    padding_values: list[Any],
) -> Any:
    """Stacks a batch of elements leaf by leaf, padding each leaf to one shape
    (`Dataset.padded_batch`).

    Args:
        elements: The batch, all with the first element's structure.
        padded_shapes: Per leaf (flatten order): the shape to pad to, a None entry
            meaning the largest size in this batch; None for the whole leaf: every
            dimension to the batch's largest.
        padding_values: Per leaf: the scalar to pad with, None for the default (0,
            "" or b"").
    Returns:
        The batch: each leaf `dtype[len(elements), *padded shape]`.
    Raises:
        InvalidArgumentError: The structures differ, a leaf's ranks differ (or differ
            from its padded shape's), a leaf is larger than its padded shape, or a
            padding value does not fit the leaf's dtype.
    """
    first = elements[0]
    flats = []
    for e in elements:
        structure.assert_same_structure(first, e)
        flats.append(structure.flatten(e))
    out = []
    for j in range(len(flats[0])):
        values = [f[j] for f in flats]
        if not isinstance(values[0], np.ndarray) or values[0].ndim == 0:
            out.append(_stack_leaves(values, j))  # scalars: nothing to pad
            continue
        arrays = [np.asarray(v) for v in values]
        rank = arrays[0].ndim
        for k, a in enumerate(arrays):
            if a.ndim != rank:
                raise InvalidArgumentError(
                    f"Cannot pad component {j}: element 0 has rank {rank} and element {k} "
                    f"has rank {a.ndim} (shapes {arrays[0].shape} and {a.shape})"
                )
        wanted = padded_shapes[j] or (None,) * rank
        if len(wanted) != rank:
            raise InvalidArgumentError(
                f"padded_shapes: component {j} has rank {rank} (shape {arrays[0].shape}) "
                f"but its padded shape {tuple(wanted)} has rank {len(wanted)}"
            )
        largest = [max(a.shape[d] for a in arrays) for d in range(rank)]
        target = []
        for d, (w, size) in enumerate(zip(wanted, largest, strict=True)):
            if w is None:
                target.append(size)
            elif size > w:
                raise InvalidArgumentError(
                    f"Attempted to pad to a smaller size than the input element: component "
                    f"{j} has size {size} in dimension {d}, its padded shape "
                    f"{tuple(wanted)} says {w}"
                )
            else:
                target.append(w)
        dtype = np.result_type(*arrays) if arrays[0].dtype.kind in "US" else arrays[0].dtype
        value = padding_values[j]
        if value is None:
            value = _default_padding(dtype)
        try:
            batch = np.full((len(arrays), *target), value, dtype=dtype)
        except (TypeError, ValueError) as err:
            raise InvalidArgumentError(
                f"padding_values: {value!r} cannot pad component {j} of dtype {dtype}: {err}"
            ) from None
        for k, a in enumerate(arrays):
            if a.dtype != dtype and a.dtype.kind not in "US":
                raise InvalidArgumentError(
                    f"Cannot batch component {j}: element 0 has dtype {dtype} and element "
                    f"{k} has dtype {a.dtype}"
                )
            region: tuple[Any, ...] = (k, *(slice(0, s) for s in a.shape))
            batch[region] = a
        out.append(batch)
    return structure.pack_sequence_as(first, out)
