"""Checkpointable service iterators (torchdata's StatefulDataLoader convention):
`DataServiceIterator.state_dict()` -> a small JSON-serialisable dict;
`DistributedDataset.load_state_dict(state)`, after which the dataset's next
`iter()` continues from that point. README "Checkpointing and visitation
guarantees" has the semantics per mode; in short:

* Every mode but exactly-once DYNAMIC: the state counts the elements `next()`
  returned (for coordinated reads, the rounds), and the resumed iterator
  reads a new job and skips that many first (a replay: the workers produce
  them again). Exact where the sequence is deterministic: OFF with one worker
  and a seeded pipeline, coordinated reads (all consumers resume at the same
  round when their states are taken at the same round).
* Exactly-once DYNAMIC: the state holds, per split (its index or file name),
  the sequence numbers of the elements `next()` returned. The resumed
  iterator's job runs the epoch again and the consumer drops those elements
  (counting them received, so their splits complete): delivered-before +
  delivered-after is the epoch, each element once, with any number of
  workers. The consumers of a shared job each load the same merged state
  (`merge_state_dicts` of all their states); a consumer's state alone would
  not tell the others what it had.

A resumed read of a named job uses the job name `<name>/resume-<digest of the
state>`, so consumers that load the same state share one new job, and the old
job (possibly still held by the dispatcher) is left alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from dataservice import errors
from dataservice import exactly_once as eo

FORMAT = "dataservice.iterator.v1"
_KEYS = ("format", "dataset", "processing_mode", "exactly_once", "job_name", "elements")


def make_state(
    *,
    dataset: str,
    processing_mode: str,
    exactly_once: bool,
    job_name: str,
    elements: int,
    splits: dict[Any, eo.Ranges] | None = None,
    repetition: int = 0,
) -> dict[str, Any]:
    """An iterator's state: plain str/int/bool/list values only (JSON as it is)."""
    state: dict[str, Any] = {
        "format": FORMAT,
        "dataset": dataset,
        "processing_mode": processing_mode,
        "exactly_once": exactly_once,
        "job_name": job_name,
        "elements": int(elements),
        "repetition": int(repetition),  # the epoch: the iterator's order among its object's
    }
    if exactly_once:
        # Index splits (range, from_tensor_slices: one element each, often whole) go in
        # groups of those with the same sequence numbers delivered, each group's splits
        # as ranges: a state after 100,000 one-element splits is one group of a few
        # numbers, not 100,000 entries (it was 1.7 MB and took 1.3 s to make).
        groups: dict[tuple[int, ...], list[int]] = {}
        named = []
        for split, ranges in (splits or {}).items():
            if not ranges:
                continue
            if isinstance(split, int):
                groups.setdefault(tuple(eo.flatten(ranges)), []).append(split)
            else:
                named.append([split, eo.flatten(ranges)])
        state["splits"] = sorted(named, key=lambda entry: str(entry[0]))
        state["split_groups"] = [
            [list(seqs), eo.flatten(_ranges_of(indices))]
            for seqs, indices in sorted(groups.items())
        ]
    return state


def _ranges_of(numbers: list[int]) -> eo.Ranges:
    """Distinct ints as sorted [start, end) ranges (O(n log n))."""
    out: eo.Ranges = []
    for n in sorted(numbers):
        if out and n <= out[-1][1]:
            if n == out[-1][1]:
                out[-1] = (out[-1][0], n + 1)
        else:
            out.append((n, n + 1))
    return out


def check_state(state: Any, *, dataset: str, processing_mode: str, exactly_once: bool) -> None:
    """Checks that `state` is an iterator state of this very dataset and mode.

    Raises:
        InvalidArgumentError: Not such a dict, or from another dataset (names
            both fingerprints), mode or exactly_once setting.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise errors.InvalidArgumentError(
            f"load_state_dict needs a state from DataServiceIterator.state_dict() (format "
            f"{FORMAT!r}); got {_show(state)}"
        )
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise errors.InvalidArgumentError(f"the iterator state lacks {missing}: {_show(state)}")
    if state["dataset"] != dataset:
        raise errors.InvalidArgumentError(
            f"the iterator state is of another dataset: its fingerprint is {state['dataset']}, "
            f"this dataset's is {dataset}"
        )
    if state["processing_mode"] != processing_mode or bool(state["exactly_once"]) != exactly_once:
        raise errors.InvalidArgumentError(
            f"the iterator state was read with processing mode {state['processing_mode']} "
            f"(exactly_once={state['exactly_once']}); this dataset reads {processing_mode} "
            f"(exactly_once={exactly_once})"
        )
    if not isinstance(state["elements"], int) or state["elements"] < 0:
        raise errors.InvalidArgumentError(
            f"the iterator state's `elements` must be a count >= 0, got {state['elements']!r}"
        )
    if exactly_once:
        splits_of(state)  # checks them


def splits_of(state: dict[str, Any]) -> dict[Any, eo.Ranges]:
    """An exactly-once state's delivered sequence numbers, per split.

    Raises:
        InvalidArgumentError: `splits` is not a list of [split, ranges] pairs, or
            `split_groups` not one of [sequence ranges, split ranges] pairs.
    """
    out: dict[Any, eo.Ranges] = {}
    for key in ("splits", "split_groups"):
        if not isinstance(state.get(key, []), list | tuple):
            raise errors.InvalidArgumentError(
                f"the iterator state's `{key}` must be a list; got {_show(state[key])}"
            )
    for entry in state.get("split_groups", []):
        if not (
            isinstance(entry, list | tuple)
            and len(entry) == 2
            and all(
                isinstance(part, list | tuple)
                and all(isinstance(n, int) and not isinstance(n, bool) for n in part)
                for part in entry
            )
        ):
            raise errors.InvalidArgumentError(
                "the iterator state's `split_groups` holds [sequence ranges, split ranges] "
                f"pairs of ints; got {_show(entry)}"
            )
        seqs = eo.unflatten(list(entry[0]))
        for start, end in eo.unflatten(list(entry[1])):
            for split in range(start, end):
                have = out.get(split)
                out[split] = seqs if have is None else eo.union([have, seqs])
    for entry in state.get("splits", []):
        if not (isinstance(entry, list | tuple) and len(entry) == 2):
            raise errors.InvalidArgumentError(
                f"the iterator state's `splits` holds [split, ranges] pairs; got {_show(entry)}"
            )
        split, flat = entry
        if not isinstance(split, int | str) or isinstance(split, bool):
            raise errors.InvalidArgumentError(f"bad split {split!r} in the iterator state")
        out[split] = eo.union([out.get(split, []), eo.unflatten(list(flat))])
    return out


def merge_state_dicts(states: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One state from the states of all consumers of a shared job, for each of
    them to load: the elements any of them was handed count as delivered.

    Raises:
        InvalidArgumentError: No state, or states of different datasets or modes.
    """
    states = list(states)
    if not states:
        raise errors.InvalidArgumentError("merge_state_dicts needs at least one state")
    first = states[0]
    for s in states:
        check_state(
            s,
            dataset=first.get("dataset", ""),
            processing_mode=first.get("processing_mode", ""),
            exactly_once=bool(first.get("exactly_once")),
        )
    splits: dict[Any, eo.Ranges] = {}
    for s in states:
        for split, ranges in splits_of(s).items():
            splits[split] = eo.union([splits.get(split, []), ranges])
    return make_state(
        dataset=first["dataset"],
        processing_mode=first["processing_mode"],
        exactly_once=bool(first["exactly_once"]),
        job_name=first["job_name"],
        elements=sum(s["elements"] for s in states),
        splits=splits,
        repetition=int(first.get("repetition", 0)),
    )


def resumed_job_name(job_name: str, state: dict[str, Any]) -> str:
    """The job a resumed read of named job `job_name` joins (module docstring)."""
    if not job_name:
        return ""
    digest = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]
    return f"{job_name}/resume-{digest}"


def _show(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
