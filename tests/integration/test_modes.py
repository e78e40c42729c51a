"""Processing-mode scenarios run under both harnesses (`harness` is `inprocess`: servers in
this process, or `processes`: worker processes): static sharding (FILE, DATA, FILE_OR_DATA,
HINT), DYNAMIC over each splittable source (C-05), coordinated reads, the cross-trainer cache
and uneven data (C-29 of shared/CASES.md). Each test asserts the exact elements each consumer
(or each worker's shard) sees.

What only one harness can do lives in `test_modes_inprocess.py` (fault injection, workers
started one by one, dispatcher internals) and `test_modes_processes.py` (memory of worker
processes, killed processes, host ids, dispatcher restarts).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import dataservice as ds
from dataservice import errors
from tests.conftest import to_py, values
from tests.integration.modes_common import (
    DATA,
    DYNAMIC,
    FILE,
    FILE_OR_DATA,
    HINT,
    NUM_FILES,
    OFF,
    Consumers,
    big_elements,
    cached,
    dist,
    read_files,
    record,
    tagged,
    write_tfrecords,
)


@pytest.fixture(scope="module")
def tfrecords(tmp_path_factory) -> list[str]:
    return write_tfrecords(tmp_path_factory.mktemp("modes-tfrecords"))


STATIC = 4  # workers of a static-sharding cluster


# ================================================================ static sharding
@pytest.mark.timeout(60)
def test_data_sharding_each_worker_keeps_every_nth(harness):
    got = harness.read_shards(ds.Dataset.range(21), DATA, STATIC)
    assert got == {i: list(range(i, 21, STATIC)) for i in range(STATIC)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [FILE, FILE_OR_DATA])
def test_file_sharding_each_worker_reads_files_i_i_plus_n(harness, tfrecords, mode):
    got = harness.read_shards(read_files(tfrecords), mode, STATIC)
    assert got == {
        i: [record(f, r) for f in range(i, NUM_FILES, STATIC) for r in range(3)]
        for i in range(STATIC)
    }


@pytest.mark.timeout(60)
def test_hint_placeholders_in_each_worker(harness, tfrecords):
    by_elements = ds.Dataset.range(20).shard(ds.SHARD_HINT, ds.SHARD_HINT)
    got = harness.read_shards(by_elements, HINT, STATIC)
    assert got == {i: list(range(i, 20, STATIC)) for i in range(STATIC)}
    files = ds.Dataset.list_files(tfrecords, shuffle=False).shard(ds.SHARD_HINT, ds.SHARD_HINT)
    by_files = files.flat_map(lambda f: ds.TFRecordDataset(f))
    got = harness.read_shards(by_files, HINT, STATIC)
    assert got == {
        i: [record(f, r) for f in range(i, NUM_FILES, STATIC) for r in range(3)]
        for i in range(STATIC)
    }


@pytest.mark.timeout(60)
def test_empty_worker_list_is_an_error(harness):
    # (LocalCluster passes [] as `--worker-addresses ''`: a fixed list of zero workers.)
    c = harness.cluster(0, dispatcher={"worker_addresses": []})
    with pytest.raises(errors.InvalidArgumentError, match=r"worker_addresses.*got \[\]"):
        values(dist(ds.Dataset.range(5), c.target, DATA))


# ================================================================ DYNAMIC
def _dynamic_cases(names: list[str]) -> dict[str, tuple]:
    """name -> (dataset, expected multiset as a sorted list of plain values)."""
    every_record = sorted(record(f, r) for f in range(NUM_FILES) for r in range(3))
    return {
        "range": (ds.Dataset.range(500), list(range(500))),
        "from_tensor_slices": (
            ds.Dataset.from_tensor_slices({"a": np.arange(40), "b": np.arange(40) * 10}),
            sorted(({"a": i, "b": 10 * i} for i in range(40)), key=lambda e: e["a"]),
        ),
        "from_tensor_slices_array": (
            ds.Dataset.from_tensor_slices(np.arange(300) * 3),
            list(range(0, 900, 3)),
        ),
        "list_files": (ds.Dataset.list_files(names, shuffle=False), sorted(names)),
        "tfrecord_file_list": (ds.TFRecordDataset(names), every_record),
        "list_files_interleave": (
            ds.Dataset.list_files(names).interleave(
                lambda f: ds.TFRecordDataset(f), cycle_length=3
            ),
            every_record,
        ),
        "tfrecord_files": (
            ds.Dataset.list_files(names).interleave(
                lambda f: ds.TFRecordDataset(f), cycle_length=2
            ),
            every_record,
        ),
        "concatenate": (
            ds.Dataset.range(30).concatenate(ds.Dataset.range(100, 130)),
            list(range(30)) + list(range(100, 130)),
        ),
        "concatenate_50": (
            ds.Dataset.range(50).concatenate(ds.Dataset.range(1000, 1050)),
            list(range(50)) + list(range(1000, 1050)),
        ),
        "repeat": (ds.Dataset.range(25).repeat(2), sorted(2 * list(range(25)))),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case",
    [
        "range",
        "from_tensor_slices",
        "from_tensor_slices_array",
        "list_files",
        "tfrecord_file_list",
        "list_files_interleave",
        "tfrecord_files",
        "concatenate",
        "concatenate_50",
        "repeat",
    ],
)
def test_dynamic_produces_each_element_once(harness, tfrecords, case):
    c = harness.cluster(harness.pick(inprocess=2, processes=4))
    dataset, expected = _dynamic_cases(tfrecords)[case]
    it = iter(dist(tagged(dataset), c.target, DYNAMIC))
    tagged_got = values(it)
    got = [x for x, _ in tagged_got]
    # Produced by the cluster's workers: their processes, or this one for in-process ones.
    pids = {pid for _, pid in tagged_got}
    assert pids <= set(c.worker_pids if c.worker_pids is not None else [os.getpid()])
    assert set(it.stats()["workers"]) <= set(c.worker_addresses)
    if got and isinstance(got[0], dict):
        got = sorted(got, key=lambda e: e["a"])
    else:
        got = sorted(got)
    assert got == expected


@pytest.mark.timeout(60)
def test_dynamic_zip_produces_each_element_of_each_source_once(harness):
    # Each source of a zip has its own split provider (as tf.data): every element of
    # each side is produced once; the pairing across workers is not promised.
    # Its workers ask for the splits of both sources in one GetSplits and get equal
    # counts (a race across workers dropped the last elements in ~1 run of 10); the
    # epochs below are separate jobs, each a new race.
    c = harness.dispatcher_with_workers(harness.pick(inprocess=3, processes=3))
    grants: list[list[tuple[int, bool]]] = []
    get_splits = c.dispatcher._get_splits

    def recording(request):
        response = get_splits(request)
        grants.append(
            [(len(b.int_splits) + len(b.str_splits), b.end_of_splits) for b in response.batches]
        )
        return response

    c.dispatcher._get_splits = recording
    for _ in range(5):
        dataset = ds.Dataset.zip(
            (ds.Dataset.range(40), ds.Dataset.from_tensor_slices(np.arange(40)))
        )
        got = values(dist(dataset, c.target, DYNAMIC))
        assert sorted(a for a, _ in got) == list(range(40))
        assert sorted(b for _, b in got) == list(range(40))
    assert grants and all(len(g) == 2 and g[0][0] == g[1][0] for g in grants), grants


@pytest.mark.timeout(60)
def test_dynamic_zip_of_unequal_inputs_drops_only_the_longer_inputs_excess(harness):
    c = harness.cluster(harness.pick(inprocess=3, processes=3))
    dataset = ds.Dataset.zip((ds.Dataset.range(30), ds.Dataset.range(100, 150)))
    got = values(dist(dataset, c.target, DYNAMIC))
    assert sorted(a for a, _ in got) == list(range(30))
    b = [b for _, b in got]
    assert len(set(b)) == 30 and set(b) <= set(range(100, 150))


@pytest.mark.timeout(60)
def test_c05_dynamic_split_rpcs_are_far_fewer_than_elements(harness):
    n = 100_000
    c = harness.dispatcher_with_workers(1)
    calls: list[int] = []
    get_splits = c.dispatcher._get_splits

    def counting(request):
        response = get_splits(request)
        calls.append(len(response.int_splits) + len(response.str_splits))
        return response

    c.dispatcher._get_splits = counting
    dataset_id = ds.register_dataset(c.target, ds.Dataset.range(n))
    got = np.fromiter((int(x) for x in ds.from_dataset_id(DYNAMIC, c.target, dataset_id)), int)
    assert np.array_equal(np.sort(got), np.arange(n))
    assert sum(calls) == n
    assert 0 < len(calls) < n // 100, f"{len(calls)} GetSplits RPCs for {n} elements"


# ================================================================ coordinated reads
@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers,num_consumers", [(1, 2), (2, 3), (4, 3)])
def test_coordinated_round_from_one_worker_consumer_i_gets_ith(harness, num_workers, num_consumers):
    c = harness.cluster(num_workers)
    job = f"coord-{num_workers}-{num_consumers}"
    readers = Consumers(ds.Dataset.range(10**6).repeat(), c.target, num_consumers, job)
    try:
        rows, round_workers = [], []
        for _ in range(12):
            row, workers = readers.read_round()
            rows.append(row)
            assert len(set(workers)) == 1, f"round {len(rows) - 1} mixes workers: {workers}"
            round_workers.append(workers[0])
    finally:
        readers.close()
    # Every worker runs the whole stream (OFF); rounds go to the workers in turn and
    # round r takes the next `num_consumers` elements of its worker's stream.
    assert rows == [
        [(r // num_workers) * num_consumers + i for i in range(num_consumers)] for r in range(12)
    ]
    assert len(set(round_workers[:num_workers])) == num_workers
    assert round_workers == [round_workers[r % num_workers] for r in range(12)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size,num_consumers", [(7, 1), (9, 2)])
def test_coordinated_read_of_finite_dataset_is_rejected_naming_cardinality(
    harness, size, num_consumers
):
    c = harness.cluster(1)
    dataset = dist(
        ds.Dataset.range(size),
        c.target,
        job_name=f"fin-{size}",
        consumer_index=0,
        num_consumers=num_consumers,
    )
    with pytest.raises(errors.FailedPreconditionError, match=rf"infinite.*cardinality {size}"):
        next(iter(dataset))


# ================================================================ cross-trainer cache
INFINITE = ds.Dataset.range(10**7).repeat()
CACHE_BYTES = 400 * 800  # 400 elements of 800 B


@pytest.mark.timeout(60)
def test_cache_trainers_with_different_ids_see_the_same_elements(harness):
    c = harness.cluster(1, worker={"cross_trainer_cache_size_bytes": CACHE_BYTES})
    its = [iter(cached(INFINITE, c.target, f"trainer-{t}", job_name="same")) for t in range(3)]
    got: list[list[int]] = [[], [], []]
    for _ in range(30):  # in lockstep
        for t, it in enumerate(its):
            got[t].append(to_py(next(it)))
    for it in its:
        it.close()
    assert got == [list(range(30))] * 3


@pytest.mark.timeout(60)
def test_cache_reads_under_one_trainer_id_split_the_elements(harness):
    c = harness.cluster(1, worker={"cross_trainer_cache_size_bytes": CACHE_BYTES})
    a = iter(cached(INFINITE, c.target, "same", job_name="split"))
    b = iter(cached(INFINITE, c.target, "same", job_name="split"))
    got_a = [to_py(next(a)) for _ in range(20)]
    got_b = [to_py(next(b)) for _ in range(20)]
    a.close()
    b.close()
    # One cursor, first come first served: each sees an increasing run, none twice.
    assert got_a == sorted(got_a) and got_b == sorted(got_b)
    assert not set(got_a) & set(got_b)
    assert 0 in got_a + got_b


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "cache_bytes,first_reads,oldest",
    [(None, 200, 0), (8000, 200, 190), (CACHE_BYTES, 2000, 1600)],
    ids=["default", "8000", "320000"],
)
def test_cache_byte_bound_evicts_old_elements(harness, cache_bytes, first_reads, oldest):
    options = {"cross_trainer_cache_size_bytes": cache_bytes} if cache_bytes else {}
    c = harness.cluster(1, worker=options)
    job = f"evict-{cache_bytes}"
    first = iter(cached(big_elements(), c.target, "first", job_name=job))
    assert [int(next(first)[0]) for _ in range(first_reads)] == list(range(first_reads))
    first.close()  # its read-ahead no longer moves the window
    second = iter(cached(big_elements(), c.target, "second", job_name=job))
    got = [int(next(second)[0]) for _ in range(20)]
    second.close()
    if cache_bytes is None:  # 1 GiB by default: the newcomer starts at the first element
        assert got == list(range(20))
    else:  # the newcomer starts at the oldest element still cached (cache_bytes / 800 B)
        assert got[0] >= oldest and got == list(range(got[0], got[0] + 20))


@pytest.mark.timeout(60)
def test_cache_lagging_trainer_skips_to_the_oldest_cached_element(harness):
    c = harness.cluster(1, worker={"cross_trainer_cache_size_bytes": CACHE_BYTES})
    slow = iter(cached(big_elements(), c.target, "slow", job_name="lag"))
    assert [int(next(slow)[0]) for _ in range(5)] == list(range(5))
    fast = iter(cached(big_elements(), c.target, "fast", job_name="lag"))  # from 0
    assert [int(next(fast)[0]) for _ in range(2000)] == list(range(2000))
    fast.close()
    got = [int(next(slow)[0]) for _ in range(60)]
    slow.close()
    # What `slow` had fetched already, then a jump to the oldest element still cached
    # (the window ends at or after 2000, and holds 400 elements).
    assert got == sorted(got) and len(set(got)) == 60
    gaps = [b - a for a, b in zip(got, got[1:], strict=False)]
    assert max(gaps) > 1000, f"the lagging trainer did not skip ahead: {got}"
    jump = gaps.index(max(gaps)) + 1
    assert got[jump] >= 1600
    assert got[jump:] == list(range(got[jump], got[jump] + len(got) - jump))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [10, 12])
def test_cache_of_finite_dataset_is_rejected(harness, size):
    c = harness.cluster(1, worker={"cross_trainer_cache_size_bytes": CACHE_BYTES})
    with pytest.raises(errors.FailedPreconditionError, match=rf"infinite.*cardinality {size}"):
        next(iter(cached(ds.Dataset.range(size), c.target, "t", job_name=f"fin-{size}")))


# ========================= more coordinated reads, target_workers, named jobs, element_spec
@pytest.mark.timeout(60)
def test_coordinated_dynamic_rounds_are_consecutive_groups(harness):
    c = harness.cluster(2)
    # Groups [3g, 3g + 3) of consecutive elements; DYNAMIC hands out the g's.
    groups = ds.Dataset.range(10**6).flat_map(lambda g: ds.Dataset.range(3 * g, 3 * g + 3))
    readers = Consumers(groups.repeat(), c.target, 3, "coord-dyn", mode=DYNAMIC)
    try:
        for _ in range(10):
            row, workers = readers.read_round()
            assert len(set(workers)) == 1
            assert row[0] % 3 == 0 and row == [row[0], row[0] + 1, row[0] + 2]
    finally:
        readers.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "how", ["stops_reading", pytest.param("closes_its_iterator", marks=pytest.mark.slow)]
)
def test_c27_stopped_consumer_fails_the_other_within_client_timeout(harness, how):
    timeout_ms = 3000
    c = harness.cluster(1, dispatcher={"client_timeout_ms": timeout_ms})
    readers = Consumers(ds.Dataset.range(10**6).repeat(), c.target, 2, f"c27-{how}")
    try:
        for r in range(10):
            assert readers.read_round()[0] == [2 * r, 2 * r + 1]
        if how == "closes_its_iterator":
            readers.iterators[1].close()
        stopped = time.monotonic()
        more = []
        with pytest.raises(errors.DeadlineExceededError, match=r"consumer 0 of 2") as info:
            while True:
                more.append(to_py(next(readers.iterators[0])))
        elapsed = time.monotonic() - stopped
    finally:
        readers.close()
    # Consumer 0 got its own element of the rounds that could still open, then failed.
    assert more == [2 * r for r in range(10, 10 + len(more))]
    assert len(more) <= 8
    assert elapsed < timeout_ms / 1000 + 3.0, f"failed after {elapsed:.1f} s"
    assert "another consumer may have stopped" in str(info.value)


@pytest.mark.timeout(60)
def test_coordinated_read_needs_both_or_neither_and_a_job_name(harness):
    cluster = harness.cluster(1)
    inf = ds.Dataset.range(5).repeat()
    with pytest.raises(ValueError):
        inf.apply(ds.distribute(OFF, cluster.target, job_name="j", consumer_index=0))
    with pytest.raises(ValueError, match="job_name"):
        inf.apply(ds.distribute(OFF, cluster.target, consumer_index=0, num_consumers=2))
    with pytest.raises(ValueError):
        inf.apply(
            ds.distribute(OFF, cluster.target, job_name="j", consumer_index=2, num_consumers=2)
        )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", ["AUTO", "ANY", "LOCAL", "local"])
def test_target_workers_with_local_workers_reads_all(harness, target):
    c = harness.cluster(2)
    got = values(dist(ds.Dataset.range(10), c, target_workers=target))
    assert sorted(got) == sorted(2 * list(range(10)))


@pytest.mark.timeout(60)
def test_target_workers_must_agree_within_a_job(harness):
    cluster = harness.cluster(1)
    d_auto = dist(ds.Dataset.range(10), cluster, job_name="tw", target_workers="AUTO")
    d_any = dist(ds.Dataset.range(10), cluster, job_name="tw", target_workers="ANY")
    it = iter(d_auto)
    assert to_py(next(it)) == 0
    with pytest.raises(
        errors.InvalidArgumentError, match=r"target_workers \(existing: AUTO, requested: ANY\)"
    ):
        next(iter(d_any))
    it.close()


@pytest.mark.timeout(60)
def test_target_workers_bad_value_and_local_coordinated_read(harness):
    cluster = harness.cluster(1)
    with pytest.raises(ValueError, match="target_workers"):
        ds.distribute(OFF, cluster.target, target_workers="NEAR")
    dataset = dist(
        ds.Dataset.range(5).repeat(),
        cluster,
        job_name="tw-coord",
        consumer_index=0,
        num_consumers=1,
        target_workers="LOCAL",
    )
    with pytest.raises(errors.InvalidArgumentError, match="Coordinated reads.*LOCAL"):
        next(iter(dataset))


@pytest.mark.timeout(60)
def test_finished_named_job_reused_ends_at_once(harness):
    cluster = harness.cluster(1)
    assert values(dist(ds.Dataset.range(5), cluster, job_name="done")) == list(range(5))
    start = time.monotonic()
    assert values(dist(ds.Dataset.range(5), cluster, job_name="done")) == []
    assert time.monotonic() - start < 3


@pytest.mark.timeout(60)
def test_element_spec_of_distributed_datasets(harness):
    cluster = harness.cluster(1)
    spec = dist(ds.Dataset.range(10), cluster).element_spec
    assert spec == ds.TensorSpec((), np.int64)
    nested = ds.Dataset.from_tensor_slices(
        {"image": np.zeros((4, 2, 3), np.uint8), "label": np.arange(4)}
    )
    expected = {"image": ds.TensorSpec((2, 3), np.uint8), "label": ds.TensorSpec((), np.int64)}
    assert dist(nested, cluster, DYNAMIC).element_spec == expected
    dataset_id = ds.register_dataset(cluster.target, nested)
    # Without element_spec, from_dataset_id asks the dispatcher for it.
    assert ds.from_dataset_id(OFF, cluster.target, dataset_id).element_spec == expected
    given = {"image": ds.TensorSpec((2, None), np.uint8), "label": ds.TensorSpec((), np.int64)}
    read = ds.from_dataset_id(OFF, cluster.target, dataset_id, element_spec=given)
    assert read.element_spec == given
    assert [to_py(e)["label"] for e in read] == [0, 1, 2, 3]


@pytest.mark.timeout(60)
def test_cardinality_of_distributed_datasets(harness):
    cluster = harness.cluster(1)
    inf = ds.Dataset.range(10).repeat()
    assert dist(inf, cluster, OFF).cardinality() == ds.INFINITE_CARDINALITY
    assert dist(inf, cluster, DYNAMIC).cardinality() == ds.INFINITE_CARDINALITY
    assert dist(inf, cluster, OFF).take(5).cardinality() == 5
    # How many workers produce a finite dataset is unknown until it is read.
    assert dist(ds.Dataset.range(10), cluster, OFF).cardinality() == ds.UNKNOWN_CARDINALITY
    assert dist(ds.Dataset.range(10), cluster, DYNAMIC).cardinality() == ds.UNKNOWN_CARDINALITY
    assert dist(ds.Dataset.range(0), cluster, DYNAMIC).cardinality() == 0
    dataset_id = ds.register_dataset(cluster.target, inf)
    read = ds.from_dataset_id(OFF, cluster.target, dataset_id)
    # As tf.data service: from the cardinality registered with the dataset.
    assert read.cardinality() == ds.INFINITE_CARDINALITY


@pytest.mark.timeout(60)
def test_element_spec_and_cardinality_of_a_dynamic_read(harness):
    c = harness.cluster(harness.pick(inprocess=1, processes=4))
    nested = ds.Dataset.from_tensor_slices({"x": np.zeros((6, 2), np.float32), "y": np.arange(6)})
    expected = {"x": ds.TensorSpec((2,), np.float32), "y": ds.TensorSpec((), np.int64)}
    assert dist(nested, c.target).element_spec == expected
    dataset_id = ds.register_dataset(c.target, nested)
    read = ds.from_dataset_id(DYNAMIC, c.target, dataset_id)
    assert read.element_spec == expected
    assert sorted(to_py(e)["y"] for e in read) == list(range(6))
    inf = ds.Dataset.range(3).repeat()
    assert dist(inf, c.target).cardinality() == ds.INFINITE_CARDINALITY
    assert dist(inf, c.target, DYNAMIC).take(7).cardinality() == 7
    assert dist(ds.Dataset.range(3), c.target).cardinality() == ds.UNKNOWN_CARDINALITY


# ================================================================ C-29: uneven data
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case",
    [
        "dynamic_3_elements_and_none",
        "file_2_files_4_workers",
        "data_2_files_4_workers",
        "file_or_data_2_files_4_workers",
        "data_empty_shards",
        "coordinated_3_consumers_2_elements_per_epoch",
    ],
)
def test_c29_uneven_data_ends_cleanly(harness, tfrecords, case):
    two_files = read_files(tfrecords[:2])
    two_files_records = sorted(record(f, r) for f in (0, 1) for r in range(3))
    if case == "dynamic_3_elements_and_none":
        c = harness.cluster(harness.pick(inprocess=8, processes=4))
        assert sorted(values(dist(ds.Dataset.range(3), c.target, DYNAMIC))) == [0, 1, 2]
        assert values(dist(ds.Dataset.range(0), c.target, DYNAMIC)) == []
    elif case == "file_2_files_4_workers":
        # FILE needs a file per worker: a clear error naming both counts.
        c = harness.static(STATIC)
        with pytest.raises(errors.DataServiceError, match=r"2 files for 4 workers"):
            list(dist(two_files, c.target, FILE, target_workers="ANY"))
    elif case in ("data_2_files_4_workers", "file_or_data_2_files_4_workers"):
        c = harness.static(STATIC)
        mode = DATA if case.startswith("data") else FILE_OR_DATA
        got = list(dist(two_files, c.target, mode, target_workers="ANY"))
        assert sorted(got) == two_files_records
    elif case == "data_empty_shards":
        assert harness.read_shards(ds.Dataset.range(2), DATA, STATIC) == {0: [0], 1: [1]}
    elif case == "coordinated_3_consumers_2_elements_per_epoch":
        w, num_rounds = harness.pick(inprocess=(2, 6), processes=(4, 8))
        c = harness.cluster(w)
        readers = Consumers(ds.Dataset.range(2).repeat(), c.target, 3, "c29")
        try:
            rows = [readers.read_round()[0] for _ in range(num_rounds)]
        finally:
            readers.close()
        # Worker streams are 0, 1, 0, 1, ...; round r takes its worker's next 3.
        assert rows == [[(3 * (r // w) + i) % 2 for i in range(3)] for r in range(num_rounds)]
    else:
        raise AssertionError(case)
