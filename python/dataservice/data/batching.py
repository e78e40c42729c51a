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

__all__ = ["batched_spec", "stack"]


def _stack_leaves(values: list[Any], component: int) -> Any:
    """Stacks one leaf of each element of a batch along a new axis 0."""
    first = values[0]
    if isinstance(first, np.ndarray):
        shape = first.shape
        for k, v in enumerate(values):
            vshape = getattr(v, "shape", None)
            if vshape != shape:
                raise InvalidArgumentError(
                    f"Cannot batch tensors with different shapes in component {component}. "
                    f"First element had shape {shape} and element {k} had shape {vshape}."
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
        return arr
    arr = np.empty(len(values), dtype=object)  # bytes and other objects, kept as they are
    arr[:] = values
    return arr


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
        for e in elements:
            if type(e) is not kind or e.keys() != keys:
                structure.assert_same_structure(first, e)
        by_key = {
            k: _stack_nested([e[k] for e in elements], component)
            for k in structure._sorted_keys(first)
        }
        if kind is dict:
            return {k: by_key[k] for k in first}
        return structure._sequence_like(first, [by_key[k] for k in sorted(by_key)])
    n = len(first)
    for e in elements:
        if type(e) is not kind or len(e) != n:
            structure.assert_same_structure(first, e)
    children = [_stack_nested([e[i] for e in elements], component) for i in range(n)]
    return structure._sequence_like(first, children)


def batched_spec(spec: Any, batch_dim: int | None) -> Any:
    def leaf(s: TensorSpec) -> TensorSpec:
        dtype: Any = s.dtype
        if dtype is bytes:
            dtype = np.dtype(object)
        elif dtype is str:
            dtype = np.dtype(str)
        return TensorSpec((batch_dim, *s.shape), dtype)

    return structure.map_structure(leaf, spec)
