"""`ignore_errors`: skipping the elements whose computation raised, and counting them.

Owns `IgnoreErrorsDataset` and `StatsIterator` (the iterator `iter(ds)` returns for a
pipeline with `ignore_errors`, whose `stats()` holds the count).

How an error is skipped. tf.data's `ignore_errors` drops an element when its input's
`GetNext` fails and asks again: tf.data iterators survive a failed call. A Python
generator does not (once it raised it is finished), so the skipping happens where the
error is raised instead: `ignore_errors` gives its input subtree an
`IterContext.error_sink`, and the element-wise user functions below it (`map`'s
function, sequential or parallel; `filter`'s predicate; `flat_map`'s and
`interleave`'s functions, and a `flat_map` body's iteration) report an exception to
the sink and drop that one element, then go on. The result is tf.data's for the
common pipeline (`source.map(f).ignore_errors()`), and elements are dropped one by one
where an aggregating op sits in between (`map(f).batch(4).ignore_errors()` keeps the
batch, one element short, where tf.data drops the whole batch). Any other failure (a
source's, e.g. a damaged TFRecord or a generator that raised, `batch` of elements of
different shapes) ends the op that raised it: `ignore_errors` counts it and its input
ends there, as tf.data's does for an input that cannot go on.

The count. Every skipped element adds one to the iterator tree's `IterStats`
(`IterContext.stats`): `iter(ds).stats()["errors_ignored"]` in-process; through the
data service, each worker counts its task's and the consumer's `stats()` adds them up
(`errors_ignored`).

Source: tensorflow/core/kernels/data/experimental/ignore_errors_dataset_op.cc.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from dataservice.data.dataset import Dataset, Element, IterContext, IterStats
from dataservice.data.ops import _UnaryDataset
from dataservice.data.runtime import close_iterator

__all__ = ["IgnoreErrorsDataset", "StatsIterator"]

log = logging.getLogger("dataservice.data")


class IgnoreErrorsDataset(_UnaryDataset):
    """`ds.ignore_errors(log_warning)`: its input's elements, less those whose
    computation raised (module docstring). Cardinality: UNKNOWN for a finite input
    (elements may be dropped), INFINITE for an infinite one (tf.data's)."""

    _op_name = "ignore_errors"

    def __init__(self, input_dataset: Dataset, log_warning: bool) -> None:
        super().__init__(input_dataset)
        if not isinstance(log_warning, bool):
            raise TypeError(
                f"`ignore_errors`: log_warning must be a bool, got {type(log_warning).__name__}"
            )
        self._log_warning = log_warning

    def _compute_cardinality(self) -> int:
        from dataservice.data.dataset import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY

        n = self._input.cardinality()
        return INFINITE_CARDINALITY if n == INFINITE_CARDINALITY else UNKNOWN_CARDINALITY

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        stats = ctx.stats
        log_warning = self._log_warning

        def sink(op: str, err: BaseException) -> None:
            if stats is not None:
                stats.add_error_ignored()
            if log_warning:
                log.warning("ignore_errors: skipped an element: `%s` raised %r", op, err)

        source = self._input._make_iterator(ctx.with_error_sink(sink))
        try:
            while True:
                try:
                    element = next(source)
                except StopIteration:
                    return
                except Exception as err:
                    # An op that cannot resume raised (its generator is finished):
                    # the input ends here (module docstring).
                    sink(self._input._op_name, err)
                    return
                yield element
        finally:
            close_iterator(source)


class StatsIterator:
    """`iter(ds)` for a pipeline with `ignore_errors` or one that reads a data
    service: the pipeline's iterator, plus `stats()`, and `state_dict()` for a
    service read under ops that take exactly what they return. One consumer
    thread, as every iterator."""

    def __init__(
        self, iterator: Iterator[Element], stats: IterStats, checkpoint_error: str | None = None
    ) -> None:
        self._it = iterator
        self._stats = stats
        self._checkpoint_error = checkpoint_error

    def state_dict(self) -> dict[str, Any]:
        """The position of the data service read in this pipeline, as its
        iterator's `state_dict()` (client/checkpoint.py): the ops after
        `distribute` (sequential `map`/`filter`, `batch`, `padded_batch`,
        `ignore_errors`, `take`) hold no element between two next() calls, so
        the read's position is the pipeline's. Load it with the pipeline's
        `load_state_dict`.

        Raises:
            ValueError: The pipeline reads no data service, or an op after
                `distribute` reads ahead or holds elements (named).
        """
        if self._checkpoint_error is not None:
            raise ValueError(self._checkpoint_error)
        state = self._stats.latest_state()
        if state is None:
            raise ValueError("state_dict: the data service read has not started yet")
        return state

    def __iter__(self) -> StatsIterator:
        return self

    def __next__(self) -> Element:
        return next(self._it)

    def close(self) -> None:
        close_iterator(self._it)

    def stats(self) -> dict[str, Any]:
        """This iterator's counters: `errors_ignored`, the elements `ignore_errors`
        skipped in this process plus those the workers of any data service read in
        the pipeline skipped; and that read's own `stats()` keys (`elements`,
        `workers`, ...; the latest epoch's under a `repeat`)."""
        return self._stats.as_dict()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)
