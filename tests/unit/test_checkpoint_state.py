"""client/checkpoint.py: an exactly-once state's delivered sequence numbers per
split survive the JSON round trip exactly, and a state of many one-element
index splits stays small (they go in groups, not one entry each)."""

from __future__ import annotations

import json
import random

import pytest

from dataservice import errors
from dataservice.client import checkpoint


def _state(splits: dict) -> dict:
    return checkpoint.make_state(
        dataset="d",
        processing_mode="DYNAMIC",
        exactly_once=True,
        job_name="",
        elements=0,
        splits=splits,
    )


def test_splits_survive_the_round_trip_exactly() -> None:
    rng = random.Random(3)
    splits: dict = {}
    for split in rng.sample(range(10_000), 3_000):
        if rng.random() < 0.8:
            splits[split] = [(0, 1)]  # a one-element split, delivered
        else:
            start = rng.randrange(5)
            splits[split] = [(start, start + rng.randrange(1, 4)), (10, 12)]
    splits["gs://bucket/file-1.tfrecord"] = [(0, 250)]
    splits["file-2"] = [(3, 7)]
    state = json.loads(json.dumps(_state(splits)))
    assert checkpoint.splits_of(state) == splits


def test_a_hundred_thousand_one_element_splits_make_a_small_state() -> None:
    splits = {i: [(0, 1)] for i in range(100_000) if i != 50_000}
    text = json.dumps(_state(splits))
    assert len(text) < 400, len(text)
    back = checkpoint.splits_of(json.loads(text))
    assert back == splits and 50_000 not in back


@pytest.mark.parametrize(
    "groups", [[[0, 1]], [[[0, 1]]], [[[0, 1], [5, 3]]], [[[1], [0, 2]]], "x", 7, [[[0, 1], ["a"]]]]
)
def test_bad_split_groups_are_refused(groups) -> None:
    state = _state({})
    state["split_groups"] = groups
    with pytest.raises(errors.InvalidArgumentError):
        checkpoint.splits_of(state)
