"""torchdata's `StatefulDataLoader` over `dataservice.torch.ServiceDataset`:
the loader's `state_dict()` carries the service iterator's position (the
dataset is torchdata's `Stateful`: it has `state_dict`/`load_state_dict`), and
a new loader over a new dataset that loads it reads on from there: OFF with one
worker, exactly the rest of the sequence; DYNAMIC exactly-once with two
workers, the rest of the epoch, each element once (README, "Checkpointing and
visitation guarantees").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
pytest.importorskip("torch")

import dataservice as ds  # noqa: E402
from dataservice.torch import ServiceDataset  # noqa: E402
from tests.conftest import InProcessCluster  # noqa: E402

pytestmark = [
    pytest.mark.timeout(120),
    # torchdata 0.11 calls torch.set_vital, which torch 2.15 deprecates: not ours.
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

OFF = ds.ShardingPolicy.OFF
DYNAMIC = ds.ShardingPolicy.DYNAMIC
N = 120


@pytest.fixture
def one_worker() -> Iterator[InProcessCluster]:
    s = InProcessCluster(1)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def two_workers() -> Iterator[InProcessCluster]:
    s = InProcessCluster(2)
    try:
        yield s
    finally:
        s.stop()


def _plus_one(x):
    return x + 1


def _loader(dataset: ds.Dataset):
    return stateful_dataloader.StatefulDataLoader(
        ServiceDataset(dataset), batch_size=None, num_workers=0
    )


def _read_then_resume(make: Callable[[], ds.Dataset], k: int) -> tuple[list[int], list[int]]:
    """Reads `k` elements through a StatefulDataLoader, saves its state (through
    JSON, as a checkpoint file), then reads the rest through a new loader over a
    new dataset that loaded it; returns (before, after)."""
    loader = _loader(make())
    it = iter(loader)
    before = [int(next(it)) for _ in range(k)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it, loader
    resumed = _loader(make())
    resumed.load_state_dict(state)
    after = [int(x) for x in resumed]
    return before, after


def test_state_dict_carries_the_service_position(one_worker: InProcessCluster) -> None:
    dataset = ds.Dataset.range(N).apply(ds.distribute(OFF, one_worker.dispatcher.target))
    loader = _loader(dataset)
    it = iter(loader)
    for _ in range(7):
        next(it)
    # The loader's state holds ServiceDataset.state_dict(), the service
    # iterator's position (client/checkpoint.py), under a key of torchdata's.
    state = loader.state_dict()
    ours = [v for v in state.values() if isinstance(v, dict) and "format" in v]
    assert len(ours) == 1, state
    assert ours[0]["format"] == "dataservice.iterator.v1"
    assert ours[0]["processing_mode"] == "OFF"
    assert ours[0]["elements"] == 7


@pytest.mark.parametrize("k", [1, 45, N - 1])
def test_off_one_worker_resumes_with_exactly_the_rest(one_worker: InProcessCluster, k: int) -> None:
    def make() -> ds.Dataset:
        return (
            ds.Dataset.range(N)
            .map(_plus_one)
            .apply(ds.distribute(OFF, one_worker.dispatcher.target))
        )

    before, after = _read_then_resume(make, k)
    assert before == list(range(1, k + 1))
    assert after == list(range(k + 1, N + 1))


@pytest.mark.parametrize("k", [13, 80])
def test_dynamic_exactly_once_resumes_with_the_rest_of_the_epoch(
    two_workers: InProcessCluster, k: int
) -> None:
    def make() -> ds.Dataset:
        return (
            ds.Dataset.range(N)
            .map(_plus_one)
            .apply(ds.distribute(DYNAMIC, two_workers.dispatcher.target, exactly_once=True))
        )

    before, after = _read_then_resume(make, k)
    assert len(before) == k
    assert not set(before) & set(after), sorted(set(before) & set(after))
    assert sorted(before + after) == list(range(1, N + 1))


def test_states_at_the_epoch_edges(one_worker: InProcessCluster) -> None:
    def make() -> ds.Dataset:
        return ds.Dataset.range(N).apply(ds.distribute(OFF, one_worker.dispatcher.target))

    whole = list(range(N))
    # Taken before any element: the resumed loader reads the whole epoch.
    fresh = _loader(make())
    state = json.loads(json.dumps(fresh.state_dict()))
    resumed = _loader(make())
    resumed.load_state_dict(state)
    assert [int(x) for x in resumed] == whole

    # Taken after the epoch ended: torchdata starts the next epoch afresh, so
    # the resumed loader reads one whole epoch, not an empty or a doubled one.
    done = _loader(make())
    assert [int(x) for x in done] == whole
    state = json.loads(json.dumps(done.state_dict()))
    resumed = _loader(make())
    resumed.load_state_dict(state)
    assert [int(x) for x in resumed] == whole
    assert [int(x) for x in resumed] == whole  # and the epoch after it
