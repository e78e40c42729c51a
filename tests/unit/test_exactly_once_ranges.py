"""dataservice/exactly_once.py: sequence-number range sets and the pipeline
check of exactly-once DYNAMIC."""

from __future__ import annotations

import random

import pytest

import dataservice as ds
from dataservice import errors
from dataservice import exactly_once as eo


def test_ranges_match_a_set_under_random_adds() -> None:
    rng = random.Random(7)
    for _ in range(50):
        seqs = [rng.randrange(60) for _ in range(rng.randrange(80))]
        ranges: eo.Ranges = []
        for s in seqs:
            eo.add(ranges, s)
        want = set(seqs)
        assert {x for a, b in ranges for x in range(a, b)} == want
        assert all(a < b for a, b in ranges)
        assert all(b < c for (_, b), (c, _) in zip(ranges, ranges[1:], strict=False))
        assert all(eo.contains(ranges, s) == (s in want) for s in range(62))
        assert eo.unflatten(eo.flatten(ranges)) == ranges
        n = rng.randrange(62)
        assert eo.covers(ranges, n) == all(s in want for s in range(n))


def test_union_merges_overlapping_and_adjacent_ranges() -> None:
    assert eo.union([[(0, 3), (7, 9)], [(3, 5)], [(8, 12)]]) == [(0, 5), (7, 12)]
    assert eo.union([]) == []


@pytest.mark.parametrize("flat", [[1], [3, 3], [-1, 2], [5, 2]])
def test_bad_ranges_are_refused(flat) -> None:
    with pytest.raises(errors.InvalidArgumentError):
        eo.unflatten(flat)


def test_file_sources_may_batch_and_shuffle_within_a_split(tmp_path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"")
    eo.check_pipeline(ds.TFRecordDataset([str(tmp_path / "a")]).shuffle(8, seed=1).batch(4))
    eo.check_pipeline(
        ds.Dataset.list_files(str(tmp_path / "*"), seed=1).interleave(ds.TFRecordDataset).batch(4)
    )
    eo.check_pipeline(ds.Dataset.range(10).map(lambda x: x).filter(lambda x: x > 2))
    with pytest.raises(errors.InvalidArgumentError, match="`batch` over `list_files`"):
        eo.check_pipeline(ds.Dataset.list_files(str(tmp_path / "*"), seed=1).batch(4))
