"""Exactly-once DYNAMIC sharding (`distribute(..., exactly_once=True)`): the
pieces the client, the dispatcher and the worker share.

How it works (README "Checkpointing and visitation guarantees"):

* The dispatcher *leases* each split (dispatcher/exactly_once.py): a split
  stays leased, and journaled, until the consumers received every element of
  it. The `ordinal`-th split the iteration hands out keeps that ordinal for the
  whole epoch, also when it is handed out again.
* The worker runs the pipeline once per leased split (worker/exactly_once.py),
  so it knows which split each element came from and its sequence number
  within the split, and sends `(ordinal, seq, element)`. A split's elements
  must come out of the pipeline in the same order every time it runs:
  deterministic pipelines only (seeded randomness).
* The consumer strips the tag, and reports in its heartbeats which sequence
  numbers of which splits it received (`received` ranges below). The worker
  reports how many elements each split produced; a split is complete once the
  consumers' reports cover them all.
* A lost worker process's open leases go back to the dispatcher once every
  consumer of the iteration said it takes nothing more from that process
  (`ClientHeartbeatRequest.closed_processes`), and are leased again with the
  sequence numbers already received, which the next worker runs but skips.

Since the pipeline runs per split, ops that combine elements (`batch`,
`shuffle`, `window`, ...) combine them within one split: one file, Parquet row
group or tar shard. `check_pipeline` refuses the pipelines where that cannot
mean what the user meant (see its docstring).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from typing import Any

from dataservice import errors

# Sources whose splits are one element each (an index, a file name): an op that
# combines elements would see one at a time under exactly_once.
_ONE_ELEMENT_SPLIT_SOURCES = frozenset(
    {"range", "from_tensor_slices", "from_tensors", "list_files"}
)
# Ops that turn one element into many (of the same split): after them, elements
# of one split can be combined meaningfully.
_EXPANDING_OPS = frozenset({"flat_map", "interleave", "unbatch", "TFRecordDataset"})
# Ops that combine several elements into one, or reorder them.
_COMBINING_OPS = frozenset(
    {
        "batch",
        "padded_batch",
        "rebatch",
        "shuffle",
        "window",
        "window_elements",
        "bucket_by_sequence_length",
    }
)
# Ops that count the whole stream: per split they would mean something else.
_STREAM_OPS = frozenset({"repeat", "take", "skip", "enumerate", "shard", "cache"})


def check_pipeline(dataset: Any) -> None:
    """Refuses a pipeline that exactly-once DYNAMIC cannot run as written.

    The pipeline runs once per split on the workers, so:

    * it must have one splittable source (a `zip`, `concatenate` or
      `sample_from_datasets` of several would pair elements across splits);
    * `repeat`, `take`, `skip`, `enumerate`, `shard` and `cache` count the whole
      stream and would count per split;
    * `batch`, `shuffle`, `window`, ... directly over one-element splits
      (`range`, `from_tensor_slices`, `from_tensors`, `list_files` without a
      `flat_map`/`interleave` between) would combine one element at a time.
      Batch on the consumer instead, or use a file source (one file, row
      group or shard per split: batches stay within it).

    Raises:
        InvalidArgumentError: Names the op at fault and why.
    """
    from dataservice.data import graph

    try:
        sources = graph.num_split_sources(dataset)
    except ValueError as err:
        raise errors.InvalidArgumentError(str(err)) from err
    if sources != 1:
        raise errors.InvalidArgumentError(
            f"exactly_once needs a pipeline with one splittable source; this one has {sources} "
            "(a zip, concatenate or sample_from_datasets of several): its elements would "
            "combine elements of several splits"
        )
    chain = [graph.op_name(node) for node in graph.walk(dataset)]  # root first
    for name in chain:
        if name in _STREAM_OPS:
            raise errors.InvalidArgumentError(
                f"exactly_once cannot run `{name}`: the pipeline runs once per split on the "
                f"workers, so `{name}` would count each split's elements, not the epoch's; "
                f"apply `{name}` to the distributed dataset on the consumer instead"
            )
    # From the source up: is a combining op fed one element per split?
    one_per_split = False
    for name in reversed(chain):
        if name in _ONE_ELEMENT_SPLIT_SOURCES:
            one_per_split = True
        elif name in _EXPANDING_OPS:
            one_per_split = False
        elif name in _COMBINING_OPS and one_per_split:
            source = next(n for n in reversed(chain) if n in _ONE_ELEMENT_SPLIT_SOURCES)
            raise errors.InvalidArgumentError(
                f"exactly_once cannot run `{name}` over `{source}`: the pipeline runs once per "
                f"split on the workers, and each split of `{source}` is one element, so "
                f"`{name}` would see one element at a time. Apply `{name}` on the consumer "
                "(after distribute), or read a file source (TFRecordDataset, ParquetDataset, "
                "WebDataset, list_files + interleave), whose batches stay within one file"
            )


# ------------------------------------------------------------------ ranges
# A set of sequence numbers as sorted, disjoint, non-adjacent [start, end) pairs.
Ranges = list[tuple[int, int]]


def add(ranges: Ranges, seq: int) -> None:
    """Adds `seq` to `ranges` in place (amortised O(1) for increasing seqs)."""
    if ranges:
        start, end = ranges[-1]
        if seq == end:
            ranges[-1] = (start, end + 1)
            return
        if start <= seq < end:
            return
        if seq > end:
            ranges.append((seq, seq + 1))
            return
    merged = union([ranges, [(seq, seq + 1)]])
    ranges[:] = merged


def contains(ranges: Ranges, seq: int) -> bool:
    """Whether `seq` is in `ranges` (O(log n): a consumer checks every element)."""
    i = bisect.bisect_right(ranges, (seq, math.inf)) - 1
    return i >= 0 and seq < ranges[i][1]


def union(sets: Iterable[Ranges]) -> Ranges:
    """The union of several range sets."""
    pairs = sorted(p for ranges in sets for p in ranges)
    out: Ranges = []
    for start, end in pairs:
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def covers(ranges: Ranges, count: int) -> bool:
    """Whether `ranges` holds every number of [0, count)."""
    return count == 0 or (bool(ranges) and ranges[0][0] <= 0 and ranges[0][1] >= count)


def flatten(ranges: Ranges) -> list[int]:
    return [x for pair in ranges for x in pair]


def unflatten(values: Sequence[int]) -> Ranges:
    """`flatten`'s inverse, checking the pairs.

    Raises:
        InvalidArgumentError: An odd count, or a pair with end <= start.
    """
    if len(values) % 2:
        raise errors.InvalidArgumentError(
            f"sequence number ranges come in [start, end) pairs; got {len(values)} numbers"
        )
    pairs = [(int(values[i]), int(values[i + 1])) for i in range(0, len(values), 2)]
    for start, end in pairs:
        if not 0 <= start < end:
            raise errors.InvalidArgumentError(f"bad sequence number range [{start}, {end})")
    return union([pairs])
