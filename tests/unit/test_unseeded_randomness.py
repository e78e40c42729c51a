"""Static sharding that shards elements (DATA, FILE_OR_DATA without file sources, HINT)
runs the whole pipeline on each worker and keeps every n-th element: an op with
unseeded randomness gives each worker another order, so the shards overlap. The data
package names such ops (`graph.unseeded_random_ops`) and `distribute` warns about them."""

from __future__ import annotations

import logging

import pytest

import dataservice as ds
from dataservice.data import graph

API_LOG = "dataservice.client.api"


def test_names_each_unseeded_op_with_its_fix(tmp_path) -> None:
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text("x")
    files = ds.Dataset.list_files(str(tmp_path / "*.txt"))
    pipeline = files.map(lambda f: f, num_parallel_calls=2, deterministic=False).shuffle(10)
    ops = graph.unseeded_random_ops(pipeline)
    assert ops == [
        "shuffle(buffer_size=10) without a seed (fix: shuffle(10, seed=...))",
        "map(num_parallel_calls=2, deterministic=False) (its output order varies from run "
        "to run; fix: deterministic=True)",
        "list_files(shuffle=True) without a seed (fix: list_files(..., seed=...), or "
        "shuffle=False)",
    ]


def test_seeded_and_deterministic_ops_are_not_named(tmp_path) -> None:
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text("x")
    seeded = (
        ds.Dataset.list_files(str(tmp_path / "*.txt"), seed=3)
        .map(lambda f: f, num_parallel_calls=2)
        .shuffle(10, seed=1)
    )
    assert graph.unseeded_random_ops(seeded) == []
    unshuffled = ds.Dataset.list_files(str(tmp_path / "*.txt"), shuffle=False)
    assert graph.unseeded_random_ops(unshuffled) == []


def test_under_shard_hints_names_only_ops_below_the_placeholder() -> None:
    below = ds.Dataset.range(10).shuffle(4).shard(ds.SHARD_HINT, ds.SHARD_HINT)
    above = ds.Dataset.range(10).shard(ds.SHARD_HINT, ds.SHARD_HINT).shuffle(4)
    assert len(graph.unseeded_random_ops(below, under_shard_hints=True)) == 1
    assert graph.unseeded_random_ops(above, under_shard_hints=True) == []
    assert graph.unseeded_random_ops(ds.Dataset.range(3).shuffle(2), under_shard_hints=True) == []


@pytest.mark.parametrize(
    "policy,pipeline,warns",
    [
        ("DATA", lambda: ds.Dataset.range(100).shuffle(10), True),
        ("FILE_OR_DATA", lambda: ds.Dataset.range(100).shuffle(10), True),
        ("HINT", lambda: ds.Dataset.range(9).shuffle(3).shard(ds.SHARD_HINT, ds.SHARD_HINT), True),
        ("HINT", lambda: ds.Dataset.range(9).shuffle(3), False),
        ("DATA", lambda: ds.Dataset.range(100).shuffle(10, seed=1), False),
        ("OFF", lambda: ds.Dataset.range(100).shuffle(10), False),
        ("DYNAMIC", lambda: ds.Dataset.range(100).shuffle(10), False),
    ],
    ids=str,
)
def test_distribute_warns_when_elements_are_sharded_after_unseeded_randomness(
    caplog, policy, pipeline, warns
) -> None:
    with caplog.at_level(logging.WARNING, logger=API_LOG):
        pipeline().apply(ds.distribute(getattr(ds.ShardingPolicy, policy), "localhost:1"))
    msgs = [r.getMessage() for r in caplog.records if r.name == API_LOG]
    if not warns:
        assert msgs == []
        return
    assert len(msgs) == 1, msgs
    assert f"distribute({policy})" in msgs[0]
    assert "shuffle(buffer_size=" in msgs[0] and "seed=..." in msgs[0]
    assert "read twice and others never" in msgs[0]
