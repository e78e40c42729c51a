"""Mixing several datasets element by element: `Dataset.choose_from_datasets` and
`Dataset.sample_from_datasets` (tf.data's directed interleave).

Both read `datasets` (the data inputs) and a selector: the `choice_dataset` of
`choose_from_datasets`, or for `sample_from_datasets` a seeded random choice by
`weights` (a list, or a dataset of weight lists).

DYNAMIC sharding. The data inputs pass their splits through, each its own split
sources (in their order; a worker takes them in joint grants,
`worker.splits.JointSplitFetch`), so with `stop_on_empty_dataset=False` every element
of every input is produced once per epoch across the workers. The selector never
reads splits: each worker runs the whole `choice_dataset` (or its own random
sequence), so a choice picks the next element *of that worker's splits* of the
chosen input. With `stop_on_empty_dataset=True` a worker stops when its chosen input
has no split left: what it held of the others is not produced, as a local run drops
them.

Cardinality. tf.data's DirectedInterleave says INFINITE when any data input is
infinite and UNKNOWN otherwise; here the rule is kept where it is right and made
exact where it can be: a finite selector (a `choice_dataset`, a weights dataset)
gives UNKNOWN (0 for an empty one); with `stop_on_empty_dataset` the output is
infinite only when every input is; `sample_from_datasets` with a weights list (every
weight > 0) and `stop_on_empty_dataset=False` produces every element of every input,
so finite inputs give the sum of their cardinalities.

Source: tensorflow/python/data/ops/{sample_from_datasets_op,choose_from_datasets_op}.py,
tensorflow/core/kernels/data/experimental/directed_interleave_dataset_op.cc.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np

from dataservice.data import structure
from dataservice.data.dataset import (
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
    Element,
    IterContext,
)
from dataservice.data.ops import _common_spec, as_index, node_epoch_rng
from dataservice.data.runtime import close_iterator
from dataservice.data.splits import SplitProvider
from dataservice.errors import InvalidArgumentError

__all__ = ["ChooseFromDatasetsDataset", "SampleFromDatasetsDataset"]


def _data_inputs(datasets: Any, op: str) -> list[Dataset]:
    if isinstance(datasets, Dataset) or not isinstance(datasets, list | tuple):
        raise TypeError(
            f"`{op}`: datasets must be a non-empty list of Datasets, got {type(datasets).__name__}"
        )
    out = list(datasets)
    if not out:
        raise InvalidArgumentError(f"`{op}`: datasets must be a non-empty list of Datasets")
    for i, d in enumerate(out):
        if not isinstance(d, Dataset):
            raise TypeError(f"`{op}`: datasets[{i}] is a {type(d).__name__}, not a Dataset")
    specs = [d._static_element_spec() for d in out]
    if all(s is not None for s in specs):
        merged = specs[0]
        for i, s in enumerate(specs[1:], 1):
            merged = _common_spec(merged, s)
            if merged is None:
                raise TypeError(
                    f"`{op}`: incompatible dataset elements: datasets[0] has {specs[0]} "
                    f"and datasets[{i}] has {s}"
                )
    return out


class _DirectedInterleave(Dataset):
    """The elements of `_datasets`, each time from the one the selector names.

    `_inputs()` is the data inputs, then the selector dataset (if any); only the data
    inputs take part in DYNAMIC sharding (module docstring)."""

    _passes_splits = True

    _datasets: list[Dataset]
    _selector: Dataset | None
    _stop_on_empty: bool

    def _inputs(self) -> list[Dataset]:
        return [*self._datasets, *([self._selector] if self._selector is not None else [])]

    def _with_inputs(self, inputs: list[Dataset]) -> Dataset:
        if len(inputs) != len(self._inputs()):
            raise ValueError(
                f"`{self._op_name}` has {len(self._inputs())} inputs, {len(inputs)} were given"
            )
        new = copy.copy(self)
        new._datasets = list(inputs[: len(self._datasets)])
        if self._selector is not None:
            new._selector = inputs[-1]
        return new

    def _add_split_providers(self, seed: int | None, out: list[SplitProvider]) -> None:
        for d in self._datasets:
            d._add_split_providers(seed, out)

    def _num_split_sources(self) -> int:
        return sum(d._num_split_sources() for d in self._datasets)

    def _split_source_count(self) -> int:
        return sum(d._split_source_count() for d in self._datasets)

    def _static_element_spec(self) -> Any:
        specs = [d._static_element_spec() for d in self._datasets]
        if any(s is None for s in specs):
            return None
        merged = specs[0]
        for s in specs[1:]:
            merged = _common_spec(merged, s)
        return merged

    def _mixed_cardinality(self, selector: int) -> int:
        """The cardinality for a selector of cardinality `selector` (module docstring)."""
        if selector == 0:
            return 0
        if selector != INFINITE_CARDINALITY:
            return UNKNOWN_CARDINALITY
        ns = [d.cardinality() for d in self._datasets]
        if self._stop_on_empty:
            infinite = all(n == INFINITE_CARDINALITY for n in ns)
        else:
            infinite = INFINITE_CARDINALITY in ns
        return INFINITE_CARDINALITY if infinite else UNKNOWN_CARDINALITY

    def _open(self, ctx: IterContext) -> list[Iterator[Element]]:
        contexts = self._route_contexts(self._datasets, ctx)
        return [d._make_iterator(c) for d, c in zip(self._datasets, contexts, strict=True)]

    def _selections(self, ctx: IterContext, active: list[bool]) -> Iterator[int]:
        """The index of each next input to read; `active[i]` is False once input i
        ended (a selector may use that to choose among the others)."""
        raise NotImplementedError

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        iterators = self._open(ctx)
        active = [True] * len(iterators)
        selections = self._selections(ctx, active)
        try:
            for i in selections:
                if not active[i]:
                    if self._stop_on_empty:
                        return
                    continue
                try:
                    element = next(iterators[i])
                except StopIteration:
                    active[i] = False
                    close_iterator(iterators[i])
                    if self._stop_on_empty or not any(active):
                        return
                    continue
                yield element
                del element
        finally:
            close_iterator(selections)
            for it in iterators:
                close_iterator(it)


class ChooseFromDatasetsDataset(_DirectedInterleave):
    """`Dataset.choose_from_datasets(datasets, choice_dataset, stop_on_empty_dataset)`:
    element k is the next element of `datasets[choice k]`."""

    _op_name = "choose_from_datasets"

    def __init__(self, datasets: Any, choice_dataset: Dataset, stop_on_empty_dataset: bool) -> None:
        self._datasets = _data_inputs(datasets, self._op_name)
        if not isinstance(choice_dataset, Dataset):
            raise TypeError(
                f"`choose_from_datasets`: choice_dataset must be a Dataset of int64 scalars, "
                f"got {type(choice_dataset).__name__}"
            )
        spec = choice_dataset._static_element_spec()
        if spec is not None and not (
            not structure.is_nested(spec)
            and spec.shape == ()
            and isinstance(spec.dtype, np.dtype)
            and spec.dtype.kind in "iu"
        ):
            raise TypeError(
                "`choose_from_datasets`: choice_dataset's elements must be int64 scalars, "
                f"its element_spec is {spec}"
            )
        self._selector = choice_dataset
        self._stop_on_empty = bool(stop_on_empty_dataset)

    def _compute_cardinality(self) -> int:
        assert self._selector is not None
        return self._mixed_cardinality(self._selector.cardinality())

    def _selections(self, ctx: IterContext, active: list[bool]) -> Iterator[int]:
        assert self._selector is not None
        choices = self._selector._make_iterator(ctx.for_user_dataset())
        n = len(self._datasets)
        try:
            for choice in choices:
                if not isinstance(choice, np.integer | int) or isinstance(choice, bool):
                    raise InvalidArgumentError(
                        "`choose_from_datasets`: choice_dataset produced "
                        f"{type(choice).__name__} {choice!r}, not an int64 scalar"
                    )
                i = int(choice)
                if not 0 <= i < n:
                    raise InvalidArgumentError(
                        f"`choose_from_datasets`: choice_dataset produced {i}, which is not "
                        f"an index of the {n} datasets (selector index out of range)"
                    )
                yield i
        finally:
            close_iterator(choices)


class SampleFromDatasetsDataset(_DirectedInterleave):
    """`Dataset.sample_from_datasets(datasets, weights, seed, stop_on_empty_dataset,
    rerandomize_each_iteration)`: each element from input i with probability
    `weights[i]` (normalised over the inputs not yet ended)."""

    _op_name = "sample_from_datasets"

    def __init__(
        self,
        datasets: Any,
        weights: Any,
        seed: int | None,
        stop_on_empty_dataset: bool,
        rerandomize_each_iteration: bool | None,
    ) -> None:
        self._datasets = _data_inputs(datasets, self._op_name)
        n = len(self._datasets)
        self._selector = None
        self._weights: np.ndarray | None = None
        if isinstance(weights, Dataset):
            self._selector = weights
        elif weights is None:
            self._weights = np.full(n, 1.0 / n)
        else:
            self._weights = self._check_weights(weights, n)
        self._seed = None if seed is None else as_index(seed, "seed")
        self._stop_on_empty = bool(stop_on_empty_dataset)
        self._rerandomize = bool(rerandomize_each_iteration)

    @staticmethod
    def _check_weights(weights: Any, n: int, where: str = "weights") -> np.ndarray:
        try:
            w = np.asarray(weights, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"`sample_from_datasets`: {where} must be {n} numbers, got {weights!r}"
            ) from None
        if w.shape != (n,):
            raise InvalidArgumentError(
                f"`sample_from_datasets`: {where} must have one weight per dataset ({n}), "
                f"got shape {w.shape}"
            )
        if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise InvalidArgumentError(
                f"`sample_from_datasets`: {where} must be finite, >= 0 and not all 0, "
                f"got {w.tolist()}"
            )
        return w

    def _unseeded_randomness(self) -> str | None:
        if self._seed is not None:
            return None
        return "sample_from_datasets without a seed (fix: sample_from_datasets(..., seed=...))"

    def _compute_cardinality(self) -> int:
        if self._selector is not None:
            return self._mixed_cardinality(self._selector.cardinality())
        assert self._weights is not None
        ns = [d.cardinality() for d in self._datasets]
        if not self._stop_on_empty and bool(np.all(self._weights > 0)) and all(c >= 0 for c in ns):
            return sum(ns)
        return self._mixed_cardinality(INFINITE_CARDINALITY)

    def _selections(self, ctx: IterContext, active: list[bool]) -> Iterator[int]:
        rng = node_epoch_rng(self, self._seed, self._rerandomize, ctx)
        if self._selector is None:
            assert self._weights is not None
            yield from self._draw(rng, active, None)
            return
        weights = self._selector._make_iterator(ctx.for_user_dataset())
        try:
            yield from self._draw(rng, active, weights)
        finally:
            close_iterator(weights)

    def _draw(
        self, rng: np.random.Generator, active: list[bool], weights: Iterator[Any] | None
    ) -> Iterator[int]:
        """Indices drawn by weight among the active inputs; ends when no active input
        has a weight > 0, or the weights dataset ends."""
        n = len(self._datasets)
        fixed = self._weights
        uniforms = rng.random(256)
        u = 0
        while True:
            if weights is None:
                assert fixed is not None
                w = fixed
            else:
                try:
                    w = self._check_weights(next(weights), n, "an element of weights")
                except StopIteration:
                    return
            if not self._stop_on_empty:
                w = np.where(active, w, 0.0)
            total = float(w.sum())
            if total <= 0:
                return
            if u == len(uniforms):
                uniforms, u = rng.random(256), 0
            i = int(np.searchsorted(np.cumsum(w), uniforms[u] * total, side="right"))
            u += 1
            yield min(i, n - 1)
