"""The batching ops beyond `batch`: `unbatch`, `padded_batch`, `rebatch`, `window` and
`bucket_by_sequence_length`, with tf.data's semantics for numpy elements.

Each is a unary op (`ops._UnaryDataset`): the splits of its input flow through it, so
under DYNAMIC sharding a worker applies it to the elements of the splits it was
handed (a batch, window or bucket never mixes elements of two workers; a worker's
last batch may be partial, as tf.data service's).

Static element specs follow tf.data where the input's spec is static; when it is not
(after a `map`), a dimension that padding decides is None (unknown).

`window` yields datasets: each window is a nest shaped like the input's elements whose
leaves are small in-memory `Dataset`s (tf.data's "dataset of windows"), so
`ds.window(3).flat_map(lambda w: w.batch(3))` works; its `element_spec` leaves are
`DatasetSpec`s. A window is not a numpy value: a pipeline served by the data service
must turn windows back into elements (`flat_map`, `interleave`) before it ends.

Source: tensorflow/python/data/ops/{unbatch_op,padded_batch_op,rebatch_op,window_op,
grouping}.py and the kernels they call.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataservice.data import structure
from dataservice.data.batching import batched_spec, pad_stack, stack
from dataservice.data.dataset import (
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
    Element,
    IterContext,
)
from dataservice.data.ops import _call, _check_callable, _UnaryDataset, as_index
from dataservice.data.runtime import close_iterator
from dataservice.data.structure import TensorSpec
from dataservice.errors import InvalidArgumentError

__all__ = [
    "BucketBySequenceLengthDataset",
    "DatasetSpec",
    "PaddedBatchDataset",
    "RebatchDataset",
    "UnbatchDataset",
    "WindowDataset",
]

Shape = tuple[int | None, ...]


@dataclass(frozen=True)
class DatasetSpec:
    """The spec of a leaf that is itself a `Dataset` (a `window`'s): its elements'
    spec. tf.data's `tf.data.DatasetSpec`."""

    element_spec: Any

    def __repr__(self) -> str:
        return f"DatasetSpec({self.element_spec!r})"


# ---------------------------------------------------------------------------- helpers


def _positive(value: Any, name: str, op: str) -> int:
    n = as_index(value, name)
    if n <= 0:
        raise InvalidArgumentError(f"`{op}`: {name} must be greater than zero, got {n}")
    return n


def _leaf_count(spec: Any) -> int:
    return len(structure.flatten(spec))


def _up_to(spec: Any, value: Any, name: str, leaf: Callable[[Any, str], Any]) -> list[Any]:
    """`value` matched against `spec`'s structure, one `leaf(v, where)` per leaf of
    `spec` in flatten order. None anywhere stands for every leaf below it; a value
    that is not nested where `spec` is (a scalar padding value) applies to every
    leaf below it when `leaf` accepts it.

    Raises:
        InvalidArgumentError: `value`'s structure does not match `spec`'s.
    """
    out: list[Any] = []

    def walk(s: Any, v: Any, where: str) -> None:
        if not structure.is_nested(s):
            out.append(leaf(v, where))
            return
        if v is None:
            out.extend([leaf(None, where)] * _leaf_count(s))
            return
        if isinstance(s, dict):
            if not isinstance(v, dict) or set(v) != set(s):
                if not structure.is_nested(v) and name == "padding_values":
                    out.extend(leaf(v, where) for _ in range(_leaf_count(s)))
                    return
                raise InvalidArgumentError(
                    f"{name}{where}: expected a dict with keys {sorted(s)} matching the "
                    f"elements, got {v!r}"
                )
            for k in structure._sorted_keys(s):
                walk(s[k], v[k], f"{where}[{k!r}]")
            return
        if not isinstance(v, tuple | list) or len(v) != len(s):
            if not structure.is_nested(v) and name == "padding_values":
                out.extend(leaf(v, where) for _ in range(_leaf_count(s)))
                return
            raise InvalidArgumentError(
                f"{name}{where}: expected a sequence of {len(s)} entries matching the "
                f"elements' structure {structure._structure_repr(s)}, got {v!r}"
            )
        for i, (si, vi) in enumerate(zip(s, v, strict=True)):
            walk(si, vi, f"{where}[{i}]")

    walk(spec, value, "")
    return out


def _as_shape(value: Any, where: str) -> Shape | None:
    """One leaf of `padded_shapes`: a sequence of sizes (None or -1: the batch's
    largest), a `TensorSpec` (its shape), or None (every dimension the largest)."""
    if value is None:
        return None
    if isinstance(value, TensorSpec):
        return value.shape
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = value.tolist()
    if not isinstance(value, tuple | list):
        raise InvalidArgumentError(
            f"padded_shapes{where}: expected a shape (a list of sizes, None or -1 for "
            f"the largest in the batch), got {type(value).__name__}: {value!r}"
        )
    dims: list[int | None] = []
    for d in value:
        if d is None:
            dims.append(None)
            continue
        try:
            n = operator.index(d)
        except TypeError:
            raise InvalidArgumentError(
                f"padded_shapes{where}: a size must be an int, None or -1, got {d!r}"
            ) from None
        if n < -1:
            raise InvalidArgumentError(f"padded_shapes{where}: size {n} is negative")
        dims.append(None if n == -1 else n)
    return tuple(dims)


def _as_padding_value(value: Any, where: str) -> Any:
    if value is None:
        return None
    if np.ndim(value) != 0:
        raise InvalidArgumentError(
            f"padding_values{where}: a padding value must be a scalar, got {value!r}"
        )
    return value


def _resolved_shapes(spec: Any, padded_shapes: Any) -> list[Shape | None]:
    """`padded_shapes` per leaf of `spec`, checked against the leaves' ranks where the
    spec knows them."""
    shapes = _up_to(spec, padded_shapes, "padded_shapes", _as_shape)
    for j, (s, shape) in enumerate(zip(structure.flatten(spec), shapes, strict=True)):
        if shape is not None and isinstance(s, TensorSpec) and len(s.shape) != len(shape):
            raise InvalidArgumentError(
                f"padded_shapes: component {j} has shape {s.shape} (rank {len(s.shape)}), "
                f"its padded shape {shape} has rank {len(shape)}"
            )
    return shapes


def _padded_spec(spec: Any, shapes: list[Shape | None], batch_dim: int | None, static: bool) -> Any:
    """The spec of padded batches of `spec`: a fixed padded size stays, a size the batch
    decides is None (kept from `spec` when it is static and no padded shape is given)."""
    batched = structure.flatten(batched_spec(spec, batch_dim))
    out = []
    for s, shape in zip(batched, shapes, strict=True):
        inner = s.shape[1:]
        if shape is not None:
            inner = shape
        elif not static:
            inner = (None,) * len(inner)
        out.append(TensorSpec((batch_dim, *inner), s.dtype))
    return structure.pack_sequence_as(spec, out)


def _first_dim(flat: list[Any], op: str) -> int:
    """The common size in axis 0 of an element's leaves (unbatch/rebatch input)."""
    sizes = set()
    for j, leaf in enumerate(flat):
        if not isinstance(leaf, np.ndarray) or leaf.ndim == 0:
            raise InvalidArgumentError(
                f"`{op}`: component {j} is a scalar ({type(leaf).__name__}); its input's "
                "elements must be batches (arrays of rank >= 1)"
            )
        sizes.add(leaf.shape[0])
    if len(sizes) > 1:
        raise InvalidArgumentError(
            f"`{op}`: the components of an element have different sizes in axis 0: {sorted(sizes)}"
        )
    return sizes.pop()


def _row(leaf: np.ndarray, i: int) -> Any:
    """Row `i` of a batched leaf as its own value: an array copy (not a view of the
    batch), a numpy scalar, or the `str` / `bytes` a batch of strings held."""
    value = leaf[i]
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, np.str_):
        return str(value)
    if isinstance(value, np.bytes_):
        return bytes(value)
    return value


def _static_batch_dim(spec: Any) -> int | None:
    """The common static size in axis 0 of a static spec's leaves, else None."""
    dims = set()
    for s in structure.flatten(spec):
        if not isinstance(s, TensorSpec) or not s.shape or s.shape[0] is None:
            return None
        dims.add(s.shape[0])
    return dims.pop() if len(dims) == 1 else None


def _unbatched_spec(spec: Any, op: str) -> Any:
    """The spec of one row of `spec`'s batches; None where it depends on values (object
    arrays: bytes or other objects)."""
    out = []
    for j, s in enumerate(structure.flatten(spec)):
        if not isinstance(s, TensorSpec):
            return None
        if not s.shape:
            raise InvalidArgumentError(
                f"`{op}`: cannot unbatch an input with scalar components (component {j} "
                f"has spec {s})"
            )
        if isinstance(s.dtype, type) or s.dtype.kind == "O":
            return None
        dtype: Any = s.dtype
        if s.dtype.kind == "U" and len(s.shape) == 1:
            dtype = str
        elif s.dtype.kind == "S" and len(s.shape) == 1:
            dtype = bytes
        out.append(TensorSpec(s.shape[1:], dtype))
    return structure.pack_sequence_as(spec, out)


# ---------------------------------------------------------------------------- unbatch


class UnbatchDataset(_UnaryDataset):
    """`ds.unbatch()`: each element's rows (axis 0 of every leaf) as elements."""

    _op_name = "unbatch"

    def __init__(self, input_dataset: Dataset) -> None:
        super().__init__(input_dataset)
        spec = input_dataset._static_element_spec()
        if spec is not None:
            _unbatched_spec(spec, "unbatch")  # scalar components: refused now

    def _compute_cardinality(self) -> int:
        n = self._input.cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        spec = self._input._static_element_spec()
        d = None if spec is None else _static_batch_dim(spec)
        return UNKNOWN_CARDINALITY if d is None else n * d

    def _static_element_spec(self) -> Any:
        spec = self._input._static_element_spec()
        return None if spec is None else _unbatched_spec(spec, "unbatch")

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = self._input._make_iterator(ctx)
        try:
            for element in source:
                flat = structure.flatten(element)
                n = _first_dim(flat, "unbatch")
                for i in range(n):
                    yield structure.pack_sequence_as(element, [_row(leaf, i) for leaf in flat])
        finally:
            close_iterator(source)


# ---------------------------------------------------------------------------- padded_batch


class PaddedBatchDataset(_UnaryDataset):
    """`ds.padded_batch(batch_size, padded_shapes, padding_values, drop_remainder)`."""

    _op_name = "padded_batch"

    def __init__(
        self,
        input_dataset: Dataset,
        batch_size: int,
        padded_shapes: Any,
        padding_values: Any,
        drop_remainder: bool,
    ) -> None:
        super().__init__(input_dataset)
        self._batch_size = _positive(batch_size, "batch_size", "padded_batch")
        self._padded_shapes = padded_shapes
        self._padding_values = padding_values
        self._drop_remainder = bool(drop_remainder)
        spec = input_dataset._static_element_spec()
        if spec is not None:  # bad arguments are refused now, not at the first batch
            self._resolve(spec)

    def _resolve(self, spec: Any) -> tuple[list[Shape | None], list[Any]]:
        shapes = _resolved_shapes(spec, self._padded_shapes)
        values = _up_to(spec, self._padding_values, "padding_values", _as_padding_value)
        return shapes, values

    def _compute_cardinality(self) -> int:
        n = self._input.cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        return n // self._batch_size if self._drop_remainder else -(-n // self._batch_size)

    def _spec(self, spec: Any, static: bool) -> Any:
        shapes, _ = self._resolve(spec)
        batch_dim = self._batch_size if self._drop_remainder else None
        return _padded_spec(spec, shapes, batch_dim, static)

    def _static_element_spec(self) -> Any:
        spec = self._input._static_element_spec()
        return None if spec is None else self._spec(spec, static=True)

    @property
    def element_spec(self) -> Any:
        spec = self._input._static_element_spec()
        if spec is not None:
            return self._spec(spec, static=True)
        return self._spec(self._input.element_spec, static=False)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = self._input._make_iterator(ctx)
        size = self._batch_size
        static = self._input._static_element_spec()
        resolved = None if static is None else self._resolve(static)
        try:
            while True:
                chunk = list(itertools.islice(source, size))
                if not chunk or (self._drop_remainder and len(chunk) < size):
                    return
                if resolved is None:
                    resolved = self._resolve(structure.spec_of(chunk[0]))
                yield pad_stack(chunk, *resolved)
                if len(chunk) < size:
                    return
        finally:
            close_iterator(source)


# ---------------------------------------------------------------------------- rebatch


class RebatchDataset(_UnaryDataset):
    """`ds.rebatch(batch_size, drop_remainder)`: the rows of the input's batches, in
    batches of `batch_size` (a list of sizes: used in turn), i.e.
    `ds.unbatch().batch(batch_size, drop_remainder)` with one copy."""

    _op_name = "rebatch"

    def __init__(self, input_dataset: Dataset, batch_size: Any, drop_remainder: bool) -> None:
        super().__init__(input_dataset)
        if isinstance(batch_size, list | tuple | np.ndarray):
            sizes = [_positive(b, "batch_size", "rebatch") for b in list(batch_size)]
            if not sizes:
                raise InvalidArgumentError("`rebatch`: batch_size is an empty list")
        else:
            sizes = [_positive(batch_size, "batch_size", "rebatch")]
        self._sizes = sizes
        self._drop_remainder = bool(drop_remainder)
        spec = input_dataset._static_element_spec()
        if spec is not None:
            _unbatched_spec(spec, "rebatch")

    def _compute_cardinality(self) -> int:
        n = self._input.cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        spec = self._input._static_element_spec()
        d = None if spec is None else _static_batch_dim(spec)
        if d is None or len(self._sizes) != 1:
            return UNKNOWN_CARDINALITY
        rows, b = n * d, self._sizes[0]
        return rows // b if self._drop_remainder else -(-rows // b)

    def _static_element_spec(self) -> Any:
        spec = self._input._static_element_spec()
        if spec is None:
            return None
        fixed = self._drop_remainder and len(self._sizes) == 1
        dim = self._sizes[0] if fixed else None
        return structure.map_structure(lambda s: TensorSpec((dim, *s.shape[1:]), s.dtype), spec)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = self._input._make_iterator(ctx)
        sizes = itertools.cycle(self._sizes)
        pieces: deque[list[Any]] = deque()  # flat leaves of not yet batched rows
        template: Any = None
        buffered = 0
        want = next(sizes)

        def take(count: int) -> Any:
            nonlocal buffered
            parts: list[list[Any]] = []
            left = count
            while left:
                flat = pieces[0]
                n = flat[0].shape[0]
                if n <= left:
                    parts.append(flat)
                    pieces.popleft()
                    left -= n
                else:
                    parts.append([leaf[:left] for leaf in flat])
                    pieces[0] = [leaf[left:] for leaf in flat]
                    left = 0
            buffered -= count
            leaves = [
                np.concatenate([p[j] for p in parts]) if len(parts) > 1 else parts[0][j].copy()
                for j in range(len(parts[0]))
            ]
            return structure.pack_sequence_as(template, leaves)

        try:
            for element in source:
                flat = structure.flatten(element)
                n = _first_dim(flat, "rebatch")
                if template is None:
                    template = element
                else:
                    structure.assert_same_structure(template, element)
                if n == 0:
                    continue
                pieces.append(flat)
                buffered += n
                while buffered >= want:
                    yield take(want)
                    want = next(sizes)
            if buffered and not self._drop_remainder:
                yield take(buffered)
        finally:
            close_iterator(source)


# ---------------------------------------------------------------------------- window


class _WindowElementsDataset(Dataset):
    """One leaf of a window: its values, in order, as a small in-memory dataset."""

    _op_name = "window_elements"

    def __init__(self, values: list[Any], spec: Any) -> None:
        self._values = values
        self._spec = spec

    def _compute_cardinality(self) -> int:
        return len(self._values)

    def _static_element_spec(self) -> Any:
        return self._spec

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        return iter(list(self._values))


class WindowDataset(_UnaryDataset):
    """`ds.window(size, shift, stride, drop_remainder)`: windows of `size` input
    elements `stride` apart, starting every `shift` elements; each a nest of
    datasets shaped like the input's elements (module docstring)."""

    _op_name = "window"

    def __init__(
        self,
        input_dataset: Dataset,
        size: int,
        shift: int | None,
        stride: int,
        drop_remainder: bool,
    ) -> None:
        super().__init__(input_dataset)
        self._size = _positive(size, "size", "window")
        self._shift = self._size if shift is None else _positive(shift, "shift", "window")
        self._stride = _positive(stride, "stride", "window")
        self._drop_remainder = bool(drop_remainder)

    def _compute_cardinality(self) -> int:
        n = self._input.cardinality()
        if n in (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY):
            return n
        if self._drop_remainder:
            rest = n - ((self._size - 1) * self._stride + 1)
            return 0 if rest < 0 else rest // self._shift + 1
        return -(-n // self._shift)

    def _static_element_spec(self) -> Any:
        spec = self._input._static_element_spec()
        return None if spec is None else structure.map_structure(DatasetSpec, spec)

    @property
    def element_spec(self) -> Any:
        return structure.map_structure(DatasetSpec, self._input.element_spec)

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = self._input._make_iterator(ctx)
        size, shift, stride = self._size, self._shift, self._stride
        span = (size - 1) * stride + 1  # input elements one full window covers
        buffer: deque[Any] = deque()  # input elements from the window's start on
        exhausted = False
        try:
            while True:
                while not exhausted and len(buffer) < span:
                    try:
                        buffer.append(next(source))
                    except StopIteration:
                        exhausted = True
                rows = [buffer[k] for k in range(0, min(span, len(buffer)), stride)]
                if not rows or (self._drop_remainder and len(rows) < size):
                    return
                yield self._window(rows)
                # The next window starts `shift` elements on: drop (or skip) those.
                for _ in range(shift):
                    if buffer:
                        buffer.popleft()
                    elif exhausted:
                        break
                    else:
                        try:
                            next(source)
                        except StopIteration:
                            exhausted = True
                            break
        finally:
            close_iterator(source)

    @staticmethod
    def _window(rows: list[Any]) -> Any:
        first = rows[0]
        flats = [structure.flatten(r) for r in rows]
        leaf_specs = structure.flatten(structure.spec_of(first))
        leaves = [
            _WindowElementsDataset([f[j] for f in flats], leaf_specs[j])
            for j in range(len(flats[0]))
        ]
        return structure.pack_sequence_as(first, leaves)


# ---------------------------------------------------------------------------- buckets


class BucketBySequenceLengthDataset(_UnaryDataset):
    """`ds.bucket_by_sequence_length(...)`: elements grouped by
    `element_length_func(element)` into buckets, each batched (padded) on its own;
    a bucket's batch comes out when it is full, the partial ones at the end in bucket
    order (tf.data's `group_by_window`)."""

    _op_name = "bucket_by_sequence_length"
    _fn_attrs = ("_length_fn",)

    def __init__(
        self,
        input_dataset: Dataset,
        element_length_func: Callable[..., Any],
        bucket_boundaries: Any,
        bucket_batch_sizes: Any,
        padded_shapes: Any,
        padding_values: Any,
        pad_to_bucket_boundary: bool,
        no_padding: bool,
        drop_remainder: bool,
    ) -> None:
        super().__init__(input_dataset)
        op = "bucket_by_sequence_length"
        _check_callable(element_length_func, op)
        boundaries = [as_index(b, "bucket_boundaries") for b in list(bucket_boundaries)]
        if any(a >= b for a, b in itertools.pairwise(boundaries)):
            raise InvalidArgumentError(
                f"`{op}`: bucket_boundaries must be a sorted list of distinct lengths, "
                f"got {boundaries}"
            )
        sizes = [_positive(b, "bucket_batch_sizes", op) for b in list(bucket_batch_sizes)]
        if len(sizes) != len(boundaries) + 1:
            raise InvalidArgumentError(
                f"`{op}`: len(bucket_batch_sizes) must equal len(bucket_boundaries) + 1, "
                f"got {len(sizes)} batch sizes for {len(boundaries)} boundaries"
            )
        self._length_fn = element_length_func
        self._boundaries = boundaries
        self._sizes = sizes
        self._padded_shapes = padded_shapes
        self._padding_values = padding_values
        self._pad_to_bucket_boundary = bool(pad_to_bucket_boundary)
        self._no_padding = bool(no_padding)
        self._drop_remainder = bool(drop_remainder)
        spec = input_dataset._static_element_spec()
        if spec is not None and not self._no_padding:
            self._resolve(spec, static=True)

    def _resolve(self, spec: Any, static: bool) -> tuple[list[Shape], list[Any]]:
        """Per leaf: its padded shape, None where the batch's largest size (or, with
        `pad_to_bucket_boundary`, the bucket's boundary - 1) goes; and its padding
        value. Without `padded_shapes`, the dimensions a static `spec` knows stay
        (tf.data's rule), and every dimension is padded when `spec` came from an
        element (`static` False)."""
        given = _resolved_shapes(spec, self._padded_shapes)
        shapes: list[Shape] = []
        for s, shape in zip(structure.flatten(spec), given, strict=True):
            rank = len(s.shape) if isinstance(s, TensorSpec) else 0
            if shape is not None:
                shapes.append(shape)
            elif static and self._padded_shapes is None and isinstance(s, TensorSpec):
                shapes.append(s.shape)
            else:
                shapes.append((None,) * rank)
        values = _up_to(spec, self._padding_values, "padding_values", _as_padding_value)
        return shapes, values

    def _compute_cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    def _static_element_spec(self) -> Any:
        spec = self._input._static_element_spec()
        if spec is None:
            return None
        if self._no_padding:
            return batched_spec(spec, None)
        shapes, _ = self._resolve(spec, static=True)
        if self._pad_to_bucket_boundary:  # the padded size depends on the bucket
            shapes = [tuple(None for _ in sh) for sh in shapes]
        return _padded_spec(spec, list(shapes), None, static=True)

    def _bucket(self, element: Element) -> int:
        length = _call(self._length_fn, element)
        try:
            n = operator.index(length)
        except TypeError:
            raise InvalidArgumentError(
                "`bucket_by_sequence_length`: element_length_func must return an int, "
                f"got {type(length).__name__}: {length!r}"
            ) from None
        bucket = bisect.bisect_right(self._boundaries, n)
        if self._pad_to_bucket_boundary and bucket == len(self._boundaries):
            raise InvalidArgumentError(
                "When pad_to_bucket_boundary=True, elements must have length < "
                f"max(bucket_boundaries) = {self._boundaries[-1] if self._boundaries else None}"
                f"; element_length_func returned {n}"
            )
        return bucket

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        source = self._input._make_iterator(ctx)
        static = self._input._static_element_spec()
        resolved = None
        if static is not None and not self._no_padding:
            resolved = self._resolve(static, static=True)
        buckets: dict[int, list[Any]] = {}

        def emit(bucket: int, chunk: list[Any]) -> Any:
            nonlocal resolved
            if self._no_padding:
                return stack(chunk)
            if resolved is None:
                resolved = self._resolve(structure.spec_of(chunk[0]), static=False)
            shapes, values = resolved
            if self._pad_to_bucket_boundary:
                fill = self._boundaries[bucket] - 1
                shapes = [tuple(fill if d is None else d for d in sh) for sh in shapes]
            return pad_stack(chunk, list(shapes), values)

        try:
            for element in source:
                bucket = self._bucket(element)
                chunk = buckets.setdefault(bucket, [])
                chunk.append(element)
                if len(chunk) == self._sizes[bucket]:
                    del buckets[bucket]
                    yield emit(bucket, chunk)
            if not self._drop_remainder:
                for bucket in sorted(buckets):
                    yield emit(bucket, buckets[bucket])
        finally:
            close_iterator(source)
