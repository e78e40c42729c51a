"""Checkpointable service iterators (issue 17 B): `state_dict()` of an iterator,
`load_state_dict()` of a distributed dataset, and where the resumed read
continues, compared with an uninterrupted read: OFF with one worker, DYNAMIC
exactly-once with another number of workers and with two consumers of a shared
job, coordinated reads; states of another dataset are refused; the torch
adapter forwards both.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator

import pytest

import dataservice as ds
from dataservice import errors
from tests.conftest import InProcessCluster

pytestmark = pytest.mark.timeout(120)

OFF = ds.ShardingPolicy.OFF
DYNAMIC = ds.ShardingPolicy.DYNAMIC
PROTOCOLS = [None, "grpc"]  # None: shared memory on this host


@pytest.fixture
def service() -> Iterator[InProcessCluster]:
    s = InProcessCluster(2)
    try:
        yield s
    finally:
        s.stop()


def _plus_one(x):
    return x + 1


def _plus_one_read(
    service: InProcessCluster, n: int, policy: ds.ShardingPolicy, **distribute_kw
) -> ds.Dataset:
    """range(n).map(_plus_one) read from `service`."""
    return (
        ds.Dataset.range(n)
        .map(_plus_one)
        .apply(ds.distribute(policy, service.dispatcher.target, **distribute_kw))
    )


def _roundtrip(state: dict) -> dict:
    """As a checkpoint file would give it back."""
    return json.loads(json.dumps(state))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_off_resume_reads_exactly_the_rest_of_the_sequence(protocol) -> None:
    s = InProcessCluster(1)
    try:
        n = 200

        def make() -> ds.Dataset:
            return (
                ds.Dataset.range(n)
                .map(_plus_one)
                .apply(ds.distribute(OFF, s.dispatcher.target, data_transfer_protocol=protocol))
            )

        whole = [int(x) for x in make()]
        assert whole == list(range(1, n + 1))
        for stop_at in random.Random(5).sample(range(1, n), 3):
            it = iter(make())
            before = [int(next(it)) for _ in range(stop_at)]
            state = _roundtrip(it.state_dict())
            it.close()
            assert state["elements"] == stop_at
            resumed = make()
            resumed.load_state_dict(state)
            it2 = iter(resumed)
            after = [int(x) for x in it2]
            assert before + after == whole, stop_at
            assert it2.state_dict()["elements"] == n
    finally:
        s.stop()


def test_a_seeded_reshuffle_resumes_in_the_order_it_was_read_in_every_epoch() -> None:
    """shuffle(seed=..., reshuffle_each_iteration=True) through an OFF job on one
    worker: the k-th iterator of a distributed dataset is epoch k on the worker,
    whatever the worker ran before, so epoch 0 is the in-process first order,
    epoch 1 another, and a state taken in epoch k resumes in epoch k's order
    (the worker's shuffle used to count every iterator it made, so the resumed
    job got the next epoch's order: 259 of 3,000 elements twice, as many never)."""
    s = InProcessCluster(1)
    try:
        n = 600

        def pipeline() -> ds.Dataset:
            return ds.Dataset.range(n).shuffle(100, seed=7).map(_plus_one)

        def make() -> ds.Dataset:
            return pipeline().apply(ds.distribute(OFF, s.dispatcher.target))

        in_process = [int(x) for x in pipeline()]
        dataset = make()
        epochs = [[int(x) for x in dataset] for _ in range(2)]
        assert epochs[0] == in_process
        assert epochs[1] != epochs[0] and sorted(epochs[1]) == sorted(epochs[0])
        for epoch in range(2):
            dataset = make()
            for _ in range(epoch):
                for _ in dataset:  # the epochs before
                    pass
            it = iter(dataset)
            before = [int(next(it)) for _ in range(234)]
            state = _roundtrip(it.state_dict())
            it.close()
            assert state["repetition"] == epoch
            resumed = make()
            resumed.load_state_dict(state)
            after = [int(x) for x in resumed]
            assert before + after == epochs[epoch], epoch
            if epoch == 0:  # the read after the resumed one is the next epoch
                assert [int(x) for x in resumed] == epochs[1]
    finally:
        s.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_exactly_once_resume_completes_the_epoch_with_another_number_of_workers(
    service: InProcessCluster, protocol
) -> None:
    n = 300

    def make() -> ds.Dataset:
        return (
            ds.Dataset.range(n)
            .map(_plus_one)
            .apply(
                ds.distribute(
                    DYNAMIC,
                    service.dispatcher.target,
                    exactly_once=True,
                    data_transfer_protocol=protocol,
                )
            )
        )

    for stop_at, change in ((37, "add"), (211, "stop")):
        it = iter(make())
        before = [int(next(it)) for _ in range(stop_at)]
        state = _roundtrip(it.state_dict())
        it.close()
        if change == "add":
            service.add_worker()  # 3 workers resume what 2 began
        else:
            service.workers.pop().stop()
        resumed = make()
        resumed.load_state_dict(state)
        it2 = iter(resumed)
        after = [int(x) for x in it2]
        assert sorted(before + after) == list(range(1, n + 1)), (stop_at, change)
        end = it2.state_dict()
        assert end["elements"] == n


@pytest.mark.parametrize("exactly_once", [True, False])
def test_resuming_the_same_state_again_reads_from_the_checkpoint_again(
    service: InProcessCluster, exactly_once: bool
) -> None:
    """A named job's state resumed, read halfway and left (a trainer that
    crashed again), then resumed once more: the second resume reads all that
    follows the checkpoint, not what the first left of its job (it used to
    join the first resume's half-read iteration, and under exactly-once got
    only the rest)."""
    n = 1200
    policy = DYNAMIC if exactly_once else OFF

    def make() -> ds.Dataset:
        return _plus_one_read(service, n, policy, job_name="ck", exactly_once=exactly_once)

    it = iter(make())
    before = [int(next(it)) for _ in range(300)]
    state = _roundtrip(it.state_dict())
    it.close()
    first = make()
    first.load_state_dict(state)
    it = iter(first)
    for _ in range(400):
        next(it)
    it.close()
    again = make()
    again.load_state_dict(state)
    after = [int(x) for x in again]
    if exactly_once:
        assert sorted(before + after) == list(range(1, n + 1))
    else:  # OFF on 2 workers: each worker's copy, the first 300 elements skipped
        assert len(before) + len(after) == 2 * n


def test_a_pipeline_with_ops_after_distribute_checkpoints_and_resumes(
    service: InProcessCluster,
) -> None:
    """`distribute(...).map(f).batch(8)` (the ops the exactly-once errors tell to
    apply after distribute): its iterator has stats() with the read's wait and
    state_dict(), the pipeline load_state_dict(), and the resumed batches
    complete the epoch once; an op that reads ahead is refused, named."""
    n = 400

    def make() -> ds.Dataset:
        read = ds.Dataset.range(n).apply(
            ds.distribute(DYNAMIC, service.dispatcher.target, exactly_once=True)
        )
        return read.map(_plus_one).batch(8)

    it = iter(make())
    before = [next(it) for _ in range(7)]
    assert "wait_ms" in it.stats() and it.stats()["elements"] == 56
    state = _roundtrip(it.state_dict())
    it.close()
    assert state["elements"] == 56
    resumed = make()
    resumed.load_state_dict(state)
    after = list(resumed)
    got = sorted(int(x) for batch in before + after for x in batch)
    assert got == list(range(1, n + 1))
    assert all(len(b) == 8 for b in before + after)  # 56 taken: the batches stay aligned

    ahead = make().prefetch(2)
    it = iter(ahead)
    next(it)
    with pytest.raises(ValueError, match="`prefetch` after `distribute`"):
        it.state_dict()
    it.close()
    with pytest.raises(ValueError, match="`prefetch` after `distribute`"):
        ahead.load_state_dict(state)
    with pytest.raises(ValueError, match="reads no data service"):
        ds.Dataset.range(3).batch(2).load_state_dict(state)


def test_exactly_once_shared_job_resumes_from_the_merged_state(service: InProcessCluster) -> None:
    """Two consumers of one job checkpoint at different counts; each loads the
    merged state: before + after, over both, is the epoch once."""
    n = 400

    def make() -> ds.Dataset:
        return _plus_one_read(service, n, DYNAMIC, job_name="shared", exactly_once=True)

    its = [iter(make()), iter(make())]
    before: list[int] = []
    for it, count in zip(its, (50, 90), strict=True):
        before += [int(next(it)) for _ in range(count)]
    states = [_roundtrip(it.state_dict()) for it in its]
    for it in its:
        it.close()
    merged = ds.merge_state_dicts(states)
    assert merged["elements"] == 140
    after: list[list[int]] = [[], []]
    failures: list[BaseException] = []

    def consume(out: list[int]) -> None:
        try:
            dataset = make()
            dataset.load_state_dict(merged)
            out.extend(int(x) for x in dataset)
        except BaseException as err:  # reported below
            failures.append(err)

    threads = [threading.Thread(target=consume, args=(o,), daemon=True) for o in after]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not failures, failures
    assert sorted(before + after[0] + after[1]) == list(range(1, n + 1))


def test_coordinated_consumers_resume_at_the_same_round() -> None:
    s = InProcessCluster(1)
    try:

        def make(index: int, job: str) -> ds.Dataset:
            return (
                ds.Dataset.range(10_000)
                .repeat()
                .apply(
                    ds.distribute(
                        OFF,
                        s.dispatcher.target,
                        job_name=job,
                        consumer_index=index,
                        num_consumers=2,
                    )
                )
            )

        def read(datasets: list[ds.Dataset], rounds: int, states=None):
            its = [iter(d) for d in datasets]
            outs: list[list[int]] = [[], []]
            errs: list[BaseException] = []

            def run(i: int) -> None:
                try:
                    outs[i] = [int(next(its[i])) for _ in range(rounds)]
                except BaseException as err:  # reported below
                    errs.append(err)

            threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errs, errs
            states = [_roundtrip(it.state_dict()) for it in its]
            for it in its:
                it.close()
            return outs, states

        whole, _ = read([make(0, "full"), make(1, "full")], 60)
        first, states = read([make(0, "cut"), make(1, "cut")], 23)
        assert [st["elements"] for st in states] == [23, 23]
        resumed = [make(0, "cut"), make(1, "cut")]
        for d, st in zip(resumed, states, strict=True):
            d.load_state_dict(st)
        rest, _ = read(resumed, 60 - 23)
        for i in (0, 1):
            assert first[i] + rest[i] == whole[i], i
    finally:
        s.stop()


def test_a_state_of_another_dataset_is_refused_naming_both(service: InProcessCluster) -> None:
    target = service.dispatcher.target
    a = ds.Dataset.range(10).apply(ds.distribute(OFF, target))
    b = ds.Dataset.range(11).apply(ds.distribute(OFF, target))
    it = iter(a)
    next(it)
    state = it.state_dict()
    it.close()
    with pytest.raises(errors.InvalidArgumentError) as info:
        b.load_state_dict(state)
    assert state["dataset"] in str(info.value)
    assert b._dataset_fingerprint() in str(info.value)
    with pytest.raises(errors.InvalidArgumentError, match="processing mode OFF"):
        ds.Dataset.range(10).apply(ds.distribute(DYNAMIC, target)).load_state_dict(state)
    with pytest.raises(errors.InvalidArgumentError, match="state_dict"):
        a.load_state_dict({"elements": 3})


def test_torch_service_dataset_forwards_state_dict(service: InProcessCluster) -> None:
    pytest.importorskip("torch")
    from dataservice.torch import ServiceDataset

    def make() -> ds.Dataset:
        return ds.Dataset.range(50).apply(
            ds.distribute(DYNAMIC, service.dispatcher.target, exactly_once=True)
        )

    loader = ServiceDataset(make())
    assert loader.state_dict() == {}
    it = iter(loader)
    before = [int(next(it)) for _ in range(20)]
    state = _roundtrip(loader.state_dict())
    it.close()
    resumed = ServiceDataset(make())
    resumed.load_state_dict(state)
    after = [int(x) for x in resumed]
    assert sorted(before + after) == list(range(50))
