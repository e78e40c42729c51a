"""Budgets count real bytes, and elements that are not numpy values (issue 10,
items 7 and 8; CASES K6): a cross-trainer cache over numpy object arrays keeps
a worker process's memory near its bound; an element holding a dataclass, a set
or another non-numpy value fails the read naming its path and type (gRPC and
shared memory alike) unless the pipeline allows pickled elements."""

from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pytest

import dataservice as ds
from dataservice import errors

pytestmark = pytest.mark.timeout(120)

PROTOCOLS = ["grpc", "shm"]


@dataclasses.dataclass
class Box:
    x: int


def with_box(i):
    return {"img": np.full(4, i, np.uint8), "meta": [int(i), b"tag", Box(int(i))]}


def box_from_2(i):
    """Two good elements, then one holding a dataclass instance."""
    return {"img": np.full(4, i, np.uint8), "meta": [int(i), b"tag", Box(1) if i >= 2 else 0]}


def held_mib(i):
    """An object array whose 16 bytes items hold 1 MiB (its pointers: 128 bytes)."""
    out = np.empty(16, object)
    for k in range(16):
        out[k] = bytes([i % 251]) * (64 << 10)
    return {"i": i, "x": out}


def dist(dataset, cluster, protocol, **kw):
    return dataset.apply(
        ds.distribute(ds.ShardingPolicy.OFF, cluster.target, data_transfer_protocol=protocol, **kw)
    )


def transports(it) -> set[str]:
    return {w["transfer_protocol"] for w in it.stats()["workers"].values()}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_non_numpy_leaf_fails_the_read_naming_its_path_and_type(cluster, protocol):
    it = iter(dist(ds.Dataset.range(5).map(box_from_2), cluster, protocol))
    assert [int(next(it)["img"][0]) for _ in range(2)] == [0, 1]
    with pytest.raises(errors.InvalidArgumentError) as info:
        next(it)
    text = str(info.value)
    assert re.search(r"\belement 2 of task \d+: element\[", text), text
    assert "element['meta'][2] is a " in text and "Box" in text
    assert "allow_pickled_elements=True" in text
    assert transports(it) == {protocol}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_allow_pickled_elements_pickles_them(cluster, protocol):
    it = iter(
        dist(ds.Dataset.range(5).map(with_box), cluster, protocol, allow_pickled_elements=True)
    )
    got = list(it)
    assert [int(e["img"][0]) for e in got] == [0, 1, 2, 3, 4]
    assert [e["meta"][2] for e in got] == [Box(i) for i in range(5)]
    assert [bytes(e["meta"][1]) for e in got] == [b"tag"] * 5
    assert transports(it) == {protocol}


def test_register_dataset_with_allow_pickled_elements(cluster):
    dataset = ds.Dataset.range(3).map(lambda i: {"s": {int(i)}})
    plain = ds.register_dataset(cluster.target, dataset)
    pickled = ds.register_dataset(cluster.target, dataset, allow_pickled_elements=True)
    assert plain != pickled
    read = ds.from_dataset_id(ds.ShardingPolicy.OFF, cluster.target, pickled)
    assert [e["s"] for e in read] == [{0}, {1}, {2}]
    with pytest.raises(errors.InvalidArgumentError, match=r"element\['s'\] is a set"):
        list(ds.from_dataset_id(ds.ShardingPolicy.OFF, cluster.target, plain))


def test_allow_pickled_elements_must_be_a_bool(cluster):
    with pytest.raises(ValueError, match="allow_pickled_elements"):
        ds.distribute(ds.ShardingPolicy.OFF, cluster.target, allow_pickled_elements="yes")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_object_arrays_of_str_and_bytes_still_travel(cluster, protocol):
    def element(i):
        names = np.array([f"file-{int(i)}", "b"], dtype=object)
        blobs = np.array([b"x" * int(i), b"yz"], dtype=object)
        return {"names": names, "blobs": blobs}

    got = list(dist(ds.Dataset.range(4).map(element), cluster, protocol))
    assert [list(e["names"]) for e in got] == [[f"file-{i}", "b"] for i in range(4)]
    assert [[bytes(b) for b in e["blobs"]] for e in got] == [[b"x" * i, b"yz"] for i in range(4)]


def _rss_anon_bytes(pid: int) -> int:
    """The process's anonymous resident memory (its heap; a shared-memory window
    is RssShmem, not counted here)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon in /proc/{pid}/status")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cross_trainer_cache_over_object_arrays_keeps_worker_memory_near_its_bound(protocol):
    """A 16 MiB cache over elements holding 1 MiB each, read 300 times: the
    worker's anonymous memory grows by about the bound (the window, the task's
    buffer of a quarter of it, one read in flight), not by hundreds of
    elements (on main, counting pointers: +801 MiB with a 32 MiB cache)."""
    cache_bytes = 16 << 20
    with ds.LocalCluster(1, worker_options={"cross_trainer_cache_size_bytes": cache_bytes}) as c:
        (pid,) = c.worker_pids
        dataset = ds.Dataset.range(10**9).map(held_mib).repeat()
        dataset = dataset.apply(
            ds.distribute(
                ds.ShardingPolicy.OFF,
                c.target,
                job_name="cached",
                cross_trainer_cache=ds.CrossTrainerCache("t0"),
                data_transfer_protocol=protocol,
            )
        )
        base = _rss_anon_bytes(pid)
        it = iter(dataset)
        peak = base
        last = -1
        deadline = time.monotonic() + 60
        for n in range(300):
            e = next(it)
            assert int(e["i"]) > last and len(e["x"][15]) == 64 << 10
            last = int(e["i"])
            if n % 5 == 0:
                peak = max(peak, _rss_anon_bytes(pid))
            assert time.monotonic() < deadline, f"300 elements took over 60 s ({n} read)"
        peak = max(peak, _rss_anon_bytes(pid))
        assert transports(it) == {protocol}
        it.close()
        growth = peak - base
        print(
            f"[rss] {protocol}: worker RssAnon +{growth >> 20} MiB, cache {cache_bytes >> 20} MiB"
        )
        assert growth < 3 * cache_bytes + (24 << 20), f"worker grew by {growth >> 20} MiB"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_client_counts_the_bytes_object_arrays_hold(cluster, protocol):
    """The reader's result-buffer accounting (`stats()["bytes"]`) is the encoded
    size: with object arrays, the items' bytes, not the pointers."""
    # Uncompressed: these elements compress ~5,000x, and compression="AUTO" turns
    # on once it has measured the link, so `bytes` would count the compressed size.
    read = dist(ds.Dataset.range(4).map(held_mib), cluster, protocol, compression=None)
    it = iter(read)
    got = [int(e["i"]) for e in it]
    assert got == [0, 1, 2, 3]
    assert it.stats()["bytes"] >= 4 << 20, it.stats()["workers"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_non_numpy_leaf_reaches_a_cross_trainer_cache_reader(make_cluster, protocol):
    cluster = make_cluster(0)
    cluster.add_worker(cross_trainer_cache_size_bytes=1 << 20)
    dataset = ds.Dataset.range(10**9).map(lambda i: {"x": np.zeros(2), "s": {1}}).repeat()
    it = iter(
        dist(
            dataset,
            cluster,
            protocol,
            job_name="cached",
            cross_trainer_cache=ds.CrossTrainerCache("t0"),
        )
    )
    with pytest.raises(errors.InvalidArgumentError, match=r"element\['s'\] is a set"):
        next(it)


def test_an_object_array_of_dicts_needs_allow_pickled_elements(cluster):
    def records(i):
        arr = np.empty(2, object)
        arr[0], arr[1] = {"id": int(i)}, {"id": -int(i)}
        return {"rows": arr}

    dataset = ds.Dataset.range(3).map(records)
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"element\['rows'\]\[0\] is a dict \(held by a numpy object array",
    ):
        list(dataset.apply(ds.distribute(ds.ShardingPolicy.OFF, cluster.target)))
    read = dataset.apply(
        ds.distribute(ds.ShardingPolicy.OFF, cluster.target, allow_pickled_elements=True)
    )
    assert [[r["id"] for r in e["rows"]] for e in read] == [[0, 0], [1, -1], [2, -2]]


def masked(i):
    return {"x": np.ma.array([int(i), 2, 3], mask=[0, 1, 0])}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_masked_array_keeps_its_mask_or_is_refused(cluster, protocol):
    """As a plain array a masked array would lose its mask (the masked values
    come back): refused naming the way out, or pickled whole when allowed."""
    with pytest.raises(errors.InvalidArgumentError) as info:
        list(dist(ds.Dataset.range(2).map(masked), cluster, protocol))
    text = str(info.value)
    assert "element['x'] is a numpy.ma.MaskedArray" in text and "getmaskarray" in text, text
    got = list(
        dist(ds.Dataset.range(2).map(masked), cluster, protocol, allow_pickled_elements=True)
    )
    assert [type(e["x"]) for e in got] == [np.ma.MaskedArray] * 2
    assert [e["x"].mask.tolist() for e in got] == [[False, True, False]] * 2
    assert [e["x"].data.tolist() for e in got] == [[0, 2, 3], [1, 2, 3]]
