"""distribute's coordinated-read arguments: DYNAMIC sharding under coordinated
reads is allowed but warned about once per job name (README "Coordinated
reads": workers drift repetitions apart), OFF is not."""

from __future__ import annotations

import logging

import pytest

import dataservice as ds


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "coordinated reads under DYNAMIC" in r.getMessage()
    ]


def test_coordinated_dynamic_is_warned_about_once_per_job(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="dataservice")
    for index in range(2):
        ds.distribute(
            ds.ShardingPolicy.DYNAMIC,
            "localhost:1",
            job_name="coordinated-dynamic-warned",
            consumer_index=index,
            num_consumers=2,
        )
    (message,) = _warnings(caplog)
    assert "'coordinated-dynamic-warned'" in message and "ShardingPolicy.OFF" in message


def test_coordinated_off_and_uncoordinated_dynamic_are_not_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="dataservice")
    ds.distribute(
        ds.ShardingPolicy.OFF, "localhost:1", job_name="rounds", consumer_index=0, num_consumers=2
    )
    ds.distribute(ds.ShardingPolicy.DYNAMIC, "localhost:1", job_name="shared")
    assert _warnings(caplog) == []
