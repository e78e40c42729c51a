"""`sample_from_datasets`, `choose_from_datasets`, `cache` and `ignore_errors` in-process:
values, determinism for a seed, cardinality and element_spec, the cache's rules for
partial passes and concurrent writers, the `errors_ignored` count, and the errors for
bad arguments."""

from __future__ import annotations

import logging
import os
import pickle
from collections import Counter

import numpy as np
import pytest

from dataservice import Dataset, TensorSpec
from dataservice.data import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY
from dataservice.data.graph import unseeded_random_ops
from dataservice.errors import DataLossError, InvalidArgumentError
from tests.conftest import values

pytestmark = pytest.mark.timeout(30)

A, B = Dataset.range(0, 50), Dataset.range(100, 150)


# ---------------------------------------------------------------------------- sample


def test_sample_from_datasets_is_every_element_once_and_deterministic_for_a_seed():
    ds = Dataset.sample_from_datasets([A, B], weights=[0.5, 0.5], seed=42)
    first = values(ds)
    assert sorted(first) == list(range(50)) + list(range(100, 150))
    assert values(ds) == first  # same seed, same order (rerandomize_each_iteration off)
    again = Dataset.sample_from_datasets([A, B], weights=[0.5, 0.5], seed=42)
    assert values(again) == first
    other = Dataset.sample_from_datasets([A, B], weights=[0.5, 0.5], seed=43)
    assert values(other) != first
    # Each input keeps its own order.
    assert [x for x in first if x < 100] == list(range(50))


def test_sample_rerandomize_each_iteration_gives_reproducible_new_orders():
    def epochs() -> list[list[int]]:
        ds = Dataset.sample_from_datasets([A, B], seed=1, rerandomize_each_iteration=True)
        return [values(ds) for _ in range(2)]

    e = epochs()
    assert e[0] != e[1] and e == epochs()


def test_sample_follows_the_weights():
    ds = Dataset.sample_from_datasets(
        [Dataset.from_tensors(0).repeat(), Dataset.from_tensors(1).repeat()], [0.8, 0.2], seed=3
    )
    counts = Counter(values(ds.take(4000)))
    assert 0.77 < counts[0] / 4000 < 0.83


def test_sample_stop_on_empty_dataset_and_weights_dataset():
    short = Dataset.range(3)
    endless = Dataset.from_tensors(np.int64(9)).repeat()
    stopped = values(
        Dataset.sample_from_datasets([short, endless], seed=5, stop_on_empty_dataset=True)
    )
    assert [x for x in stopped if x != 9] == [0, 1, 2] and stopped[-1] == 2
    w = Dataset.from_tensor_slices(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]))
    assert values(Dataset.sample_from_datasets([A, B], w, seed=0)) == [0, 100, 1, 101]
    # An input with weight 0 is never read; once the others end, so does the sample.
    assert values(Dataset.sample_from_datasets([short, B], [1.0, 0.0], seed=0)) == [0, 1, 2]


def test_sample_cardinality_and_spec():
    assert Dataset.sample_from_datasets([A, B], seed=1).cardinality() == 100
    assert Dataset.sample_from_datasets(
        [A, B], seed=1, stop_on_empty_dataset=True
    ).cardinality() == (UNKNOWN_CARDINALITY)
    assert Dataset.sample_from_datasets([A, B.repeat()]).cardinality() == INFINITE_CARDINALITY
    mixed = Dataset.sample_from_datasets(
        [Dataset.from_tensor_slices(np.zeros((2, 3))), Dataset.from_tensor_slices(np.ones((2, 4)))]
    )
    assert mixed.element_spec == TensorSpec((None,), np.float64)


def test_sample_errors_and_unseeded_warning():
    with pytest.raises(TypeError, match="non-empty list of Datasets"):
        Dataset.sample_from_datasets(A)
    with pytest.raises(InvalidArgumentError, match="non-empty list"):
        Dataset.sample_from_datasets([])
    with pytest.raises(TypeError, match=r"datasets\[1\] is a int"):
        Dataset.sample_from_datasets([A, 3])
    with pytest.raises(InvalidArgumentError, match="one weight per dataset"):
        Dataset.sample_from_datasets([A, B], [1.0])
    with pytest.raises(InvalidArgumentError, match="finite, >= 0 and not all 0"):
        Dataset.sample_from_datasets([A, B], [1.0, -1.0])
    with pytest.raises(TypeError, match="incompatible dataset elements"):
        Dataset.sample_from_datasets([A, Dataset.from_tensor_slices(["a"])])
    assert unseeded_random_ops(Dataset.sample_from_datasets([A, B])) == [
        "sample_from_datasets without a seed (fix: sample_from_datasets(..., seed=...))"
    ]
    assert unseeded_random_ops(Dataset.sample_from_datasets([A, B], seed=1)) == []


# ---------------------------------------------------------------------------- choose


def test_choose_from_datasets_tf_example():
    datasets = [Dataset.from_tensors(s).repeat() for s in ("foo", "bar", "baz")]
    choice = Dataset.range(3).repeat(3)
    got = values(Dataset.choose_from_datasets(datasets, choice))
    assert got == ["foo", "bar", "baz"] * 3


def test_choose_stop_on_empty_dataset():
    datasets = [Dataset.range(2), Dataset.range(10, 13)]
    choice = Dataset.from_tensor_slices(np.array([0, 0, 0, 1, 1]))
    assert values(Dataset.choose_from_datasets(datasets, choice)) == [0, 1]
    kept_on = Dataset.choose_from_datasets(datasets, choice, stop_on_empty_dataset=False)
    assert values(kept_on) == [0, 1, 10, 11]


def test_choose_cardinality_spec_and_errors():
    infinite = [A.repeat(), B.repeat()]
    assert Dataset.choose_from_datasets(infinite, Dataset.range(2).repeat()).cardinality() == (
        INFINITE_CARDINALITY
    )
    assert Dataset.choose_from_datasets(infinite, Dataset.range(2)).cardinality() == (
        UNKNOWN_CARDINALITY
    )
    assert Dataset.choose_from_datasets([A, B], Dataset.range(0)).cardinality() == 0
    assert Dataset.choose_from_datasets([A, B], Dataset.range(2)).element_spec == A.element_spec
    with pytest.raises(TypeError, match="choice_dataset must be a Dataset"):
        Dataset.choose_from_datasets([A, B], [0, 1])
    with pytest.raises(TypeError, match="int64 scalars"):
        Dataset.choose_from_datasets([A, B], Dataset.from_tensor_slices(np.array([0.5])))
    bad = Dataset.choose_from_datasets([A, B], Dataset.from_tensor_slices(np.array([0, 2])))
    with pytest.raises(InvalidArgumentError, match="produced 2, which is not an index"):
        values(bad)


# ---------------------------------------------------------------------------- cache


class Counted:
    """A map function that counts its calls (the input's work a cache saves)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return x * 2


def test_memory_cache_runs_the_input_once():
    f = Counted()
    ds = Dataset.range(5).map(f).cache()
    assert values(ds) == [0, 2, 4, 6, 8] and f.calls == 5
    assert values(ds) == [0, 2, 4, 6, 8] and f.calls == 5
    assert values(ds.repeat(3)) == [0, 2, 4, 6, 8] * 3 and f.calls == 5
    assert ds.cardinality() == 5 and ds.element_spec == TensorSpec((), np.int64)


def test_memory_cache_partial_pass_is_discarded(caplog):
    f = Counted()
    ds = Dataset.range(5).map(f).cache()
    with caplog.at_level(logging.WARNING, "dataservice.data"):
        assert values(ds.take(2)) == [0, 2]
    assert "did not read the dataset being cached to its end" in caplog.text
    assert values(ds) == [0, 2, 4, 6, 8] and f.calls == 2 + 5
    assert values(ds) == [0, 2, 4, 6, 8] and f.calls == 7


def test_memory_cache_concurrent_iterators_both_see_everything():
    f = Counted()
    ds = Dataset.range(4).map(f).cache()
    a, b = iter(ds), iter(ds)
    got_a, got_b = [], []
    for x, y in zip(a, b, strict=True):  # interleaved: b reads its input, a writes
        got_a.append(int(x))
        got_b.append(int(y))
    assert got_a == got_b == [0, 2, 4, 6] and f.calls == 8
    assert values(ds) == [0, 2, 4, 6] and f.calls == 8


def test_file_cache_written_on_a_full_pass_and_reused_by_a_new_pipeline(tmp_path):
    path = str(tmp_path / "c")
    f = Counted()
    ds = Dataset.range(6).map(f).cache(path)
    assert values(ds.take(3)) == [0, 2, 4]
    assert sorted(os.listdir(tmp_path)) == []  # partial: nothing kept, no lockfile
    assert values(ds) == [0, 2, 4, 6, 8, 10]
    assert sorted(os.listdir(tmp_path)) == ["c.data"]
    g = Counted()
    again = Dataset.range(6).map(g).cache(path)
    assert values(again) == [0, 2, 4, 6, 8, 10] and g.calls == 0


def test_file_cache_second_writer_reads_its_input(tmp_path):
    path = str(tmp_path / "c")
    ds = Dataset.range(3).cache(path)
    a = iter(ds)
    assert int(next(a)) == 0  # a holds the lockfile
    assert os.path.exists(path + ".lockfile")
    assert values(ds) == [0, 1, 2]  # reads the input, writes nothing
    assert not os.path.exists(path + ".data")
    assert [int(x) for x in a] == [1, 2]
    assert os.path.exists(path + ".data") and not os.path.exists(path + ".lockfile")


def test_file_cache_stale_lockfile_is_taken_over(tmp_path):
    import socket

    path = str(tmp_path / "c")
    with open(path + ".lockfile", "w") as f:
        f.write(f"{socket.gethostname()} 999999999\n")  # no such process
    with open(path + ".data.tmp-999999999-0", "wb") as f:
        f.write(b"what the crashed writer left")
    assert values(Dataset.range(3).cache(path)) == [0, 1, 2]
    assert os.listdir(tmp_path) == ["c.data"]


def test_file_cache_damaged_file_raises_data_loss(tmp_path):
    path = str(tmp_path / "c")
    values(Dataset.range(100).cache(path))
    with open(path + ".data", "r+b") as f:
        f.truncate(os.path.getsize(path + ".data") // 2)
    with pytest.raises(DataLossError, match="damaged after"):
        values(Dataset.range(100).cache(path))
    with open(path + ".data", "wb") as f:
        pickle.dump("something else", f)
    with pytest.raises(DataLossError, match="is not a cache"):
        values(Dataset.range(100).cache(path))


def test_cache_bad_filename():
    with pytest.raises(TypeError, match="filename must be a str"):
        Dataset.range(3).cache(3)


# ---------------------------------------------------------------------------- ignore_errors


def flaky(x):
    if x % 4 == 1:
        raise ValueError(f"bad {x}")
    return x


def test_ignore_errors_tf_example_and_count():
    ds = Dataset.from_tensor_slices(np.array([1.0, 2.0, 0.0, 4.0])).map(
        lambda x: 1.0 / x if x else 1 // 0
    )
    it = iter(ds.ignore_errors())
    assert [float(x) for x in it] == [1.0, 0.5, 0.25]
    assert it.stats() == {"errors_ignored": 1}


@pytest.mark.parametrize("parallel", [None, 3])
def test_ignore_errors_skips_map_filter_and_flat_map_failures(parallel, caplog):
    ds = Dataset.range(12).map(flaky, num_parallel_calls=parallel)
    ds = ds.filter(lambda x: 1 // (int(x) % 6) >= 0)  # raises for 0 and 6
    ds = ds.flat_map(
        lambda x: Dataset.range(int(x), int(x) + 1).map(lambda y: 1 // (int(y) - 10) * 0 + y)
    )  # the body raises for 10
    with caplog.at_level(logging.WARNING, "dataservice.data"):
        it = iter(ds.ignore_errors(log_warning=True))
        got = values(it)
    assert got == [2, 3, 4, 7, 8, 11]
    assert it.stats()["errors_ignored"] == 3 + 2 + 1
    assert caplog.text.count("ignore_errors: skipped an element") == 6


def test_ignore_errors_a_source_failure_ends_the_input():
    def gen():
        yield 1
        yield 2
        raise OSError("disk")

    it = iter(Dataset.from_generator(gen).ignore_errors())
    assert values(it) == [1, 2] and it.stats()["errors_ignored"] == 1


def test_ignore_errors_cardinality_and_no_stats_without_it():
    assert Dataset.range(5).ignore_errors().cardinality() == UNKNOWN_CARDINALITY
    assert Dataset.range(5).repeat().ignore_errors().cardinality() == INFINITE_CARDINALITY
    assert not hasattr(iter(Dataset.range(3)), "stats")
    with pytest.raises(ValueError, match="bad 1"):
        values(Dataset.range(3).map(flaky))  # no ignore_errors: raised as before
    with pytest.raises(TypeError, match="log_warning must be a bool"):
        Dataset.range(3).ignore_errors("yes")


@pytest.mark.parametrize("parallel", [None, 2])
def test_ignore_errors_in_interleave_functions_and_bodies(parallel):
    def body(x):
        if int(x) == 2:
            raise KeyError("no body for 2")

        # from_generator: its failure ends that body (a source's error)
        def gen():
            yield int(x) * 10
            raise OSError("body broke")

        return Dataset.from_generator(gen)

    ds = Dataset.range(4).interleave(body, cycle_length=2, num_parallel_calls=parallel)
    it = iter(ds.ignore_errors())
    assert sorted(values(it)) == [0, 10, 30]
    assert it.stats()["errors_ignored"] == 1 + 3
