"""Static sharding with a fixed worker list of which a listed worker is missing: it never
registered, or registered, was lost and did not come back. Each listed worker holds one
shard, so the read must not end with the others' shards only: it waits for the missing
worker (warning, naming it), takes every element exactly once if it comes, and raises
MissingShardsError naming it after `worker_loss_timeout_ms` if it does not."""

from __future__ import annotations

import logging
import threading
import time

import pytest

import dataservice as ds
from dataservice import _waits, errors
from tests.conftest import to_py
from tests.integration.modes_common import (
    DATA,
    FILE_OR_DATA,
    HINT,
    dist,
    static_cluster,
    wait_until,
)


def _read_until_error(dataset) -> tuple[list, BaseException | None, float]:
    got, err = [], None
    start = time.monotonic()
    try:
        for e in dataset:
            got.append(to_py(e))
    except errors.DataServiceError as e:
        err = e
    return got, err, time.monotonic() - start


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "target_workers"),
    [
        (DATA, "ANY"),
        pytest.param(FILE_OR_DATA, "ANY", marks=pytest.mark.slow),
        pytest.param(DATA, "LOCAL", marks=pytest.mark.slow),
        (FILE_OR_DATA, "LOCAL"),
        pytest.param(DATA, "AUTO", marks=pytest.mark.slow),
        (FILE_OR_DATA, "AUTO"),
    ],
)
def test_unregistered_listed_worker_fails_the_read_naming_it(make_cluster, mode, target_workers):
    c = static_cluster(make_cluster, 2, live=[0])
    missing = c.dispatcher_config.worker_addresses[1]
    data = dist(
        ds.Dataset.range(10), c, mode, target_workers=target_workers, worker_loss_timeout_ms=1000
    )
    got, err, took_s = _read_until_error(data)
    assert got == [0, 2, 4, 6, 8]
    assert isinstance(err, errors.MissingShardsError), err
    assert isinstance(err, errors.WorkerCrashedError)
    assert f"worker {missing} (shard 1): has not registered" in str(err)
    assert "worker_loss_timeout_ms" in str(err)
    assert 1.0 <= took_s < 10, took_s


@pytest.mark.timeout(60)
def test_hint_with_placeholder_waits_for_the_missing_shard_too(make_cluster):
    c = static_cluster(make_cluster, 2, live=[1])
    data = ds.Dataset.range(10).shard(ds.SHARD_HINT, ds.SHARD_HINT)
    got, err, _ = _read_until_error(dist(data, c, HINT, worker_loss_timeout_ms=500))
    assert got == [1, 3, 5, 7, 9]
    assert isinstance(err, errors.MissingShardsError) and "(shard 0)" in str(err), err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target_workers", ["ANY", "LOCAL"])
def test_listed_worker_started_late_delivers_its_shard_exactly_once(
    make_cluster, target_workers, monkeypatch, caplog
):
    monkeypatch.setattr(_waits, "FIRST_WARNING_S", 0.2)
    c = static_cluster(make_cluster, 2, live=[0])
    late = c.dispatcher_config.worker_addresses[1]
    it = iter(dist(ds.Dataset.range(10), c, DATA, target_workers=target_workers))
    got = [to_py(next(it)) for _ in range(5)]
    assert got == [0, 2, 4, 6, 8]

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if late in r.getMessage()]

    def start_late_worker() -> None:
        # Once the consumer said it waits for the listed worker (it has nothing
        # else to read), start that worker.
        wait_until(lambda: bool(warned()), 20, "a warning naming the missing worker")
        c.add_worker(port=int(late.rsplit(":", 1)[1]), worker_address=late)

    with caplog.at_level(logging.WARNING, logger="dataservice.client.reader"):
        starter = threading.Thread(target=start_late_worker, daemon=True)
        starter.start()
        got += [to_py(e) for e in it]
        starter.join(20)
    assert got[5:] == [1, 3, 5, 7, 9]
    assert f"worker {late} (shard 1): has not registered" in warned()[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target_workers", ["ANY", "LOCAL"])
def test_listed_worker_lost_and_not_back_fails_the_read_naming_it(make_cluster, target_workers):
    c = static_cluster(make_cluster, 2)
    lost = c.dispatcher_config.worker_addresses[1]
    c.workers[1].stop()
    data = dist(
        ds.Dataset.range(10), c, DATA, target_workers=target_workers, worker_loss_timeout_ms=1000
    )
    got, err, took_s = _read_until_error(data)
    assert got == [0, 2, 4, 6, 8]
    assert isinstance(err, errors.MissingShardsError), err
    assert f"worker {lost} (shard 1): registered, then was lost" in str(err)
    assert took_s < 15, took_s


@pytest.mark.timeout(60)
def test_data_sharding_of_a_seeded_shuffle_reads_every_element_once(make_cluster):
    # The fix the unseeded-randomness warning names: the same seed on every worker.
    c = static_cluster(make_cluster, 2)
    got = [to_py(e) for e in dist(ds.Dataset.range(100).shuffle(10, seed=1), c, DATA)]
    assert sorted(got) == list(range(100))
