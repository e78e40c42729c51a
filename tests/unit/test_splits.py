"""Split providers (dispatcher side) and split sources (worker side) of DYNAMIC sharding."""

from __future__ import annotations

import collections
import itertools
import pickle
import re

import numpy as np
import pytest

from dataservice.data.dataset import Dataset, IterContext
from dataservice.data.splits import (
    FileSplitProvider,
    IndexSplitProvider,
    RepeatSplitProvider,
    SplitProvider,
)
from dataservice.errors import InvalidArgumentError


class ListSplits:
    """A split source handing out a fixed list of splits."""

    def __init__(self, splits):
        self._it = iter(list(splits))
        self.calls = 0

    def get_next(self):
        self.calls += 1
        return next(self._it, None)


def drain(provider, limit=10_000):
    out = []
    for _ in range(limit):
        split = provider.get_next()
        if split is None:
            return out
        out.append(split)
    raise AssertionError("provider did not end")


def run_with_splits(dataset, splits):
    return [np.asarray(e).tolist() for e in dataset._make_iterator(IterContext(ListSplits(splits)))]


@pytest.fixture
def files(tmp_path):
    names = []
    for i in range(6):
        p = tmp_path / f"f{i}.txt"
        p.write_text(str(i))
        names.append(str(p))
    return names


# ---------------------------------------------------------------------------- providers


def test_range_provider_is_index_based_and_lazy():
    provider = Dataset.range(10, 1_000_000_000_000, 7)._split_provider(seed=None)
    assert isinstance(provider, IndexSplitProvider)
    assert isinstance(provider, SplitProvider)
    n = len(range(10, 1_000_000_000_000, 7))
    assert provider.cardinality() == n
    assert [provider.get_next() for _ in range(3)] == [0, 1, 2]
    provider.reset()
    assert provider.get_next() == 0


def test_tensor_slices_and_from_tensors_providers():
    assert drain(Dataset.from_tensor_slices(np.zeros((4, 2)))._split_provider(None)) == [
        0,
        1,
        2,
        3,
    ]
    assert drain(Dataset.from_tensors(np.zeros(3))._split_provider(None)) == [0]


def test_providers_pass_through_unary_ops():
    ds = (
        Dataset.range(5)
        .map(lambda x: x)
        .filter(lambda x: True)
        .shuffle(3)
        .batch(2)
        .prefetch(1)
        .take(9)
        .skip(0)
        .enumerate()
        .shard(1, 0)
        .flat_map(lambda i, x: Dataset.from_tensors(x))
        .interleave(lambda x: Dataset.from_tensors(x), cycle_length=1)
    )
    assert drain(ds._split_provider(None)) == [0, 1, 2, 3, 4]


def test_repeat_provider_count_and_forever():
    p = Dataset.range(3).repeat(2)._split_provider(None)
    assert isinstance(p, RepeatSplitProvider)
    assert p.cardinality() == 6
    assert drain(p) == [0, 1, 2, 0, 1, 2]
    assert p.get_next() is None
    p.reset()
    assert drain(p) == [0, 1, 2, 0, 1, 2]

    forever = Dataset.range(2).map(lambda x: x).repeat()._split_provider(None)
    assert forever.cardinality() == -1
    assert [forever.get_next() for _ in range(7)] == [0, 1, 0, 1, 0, 1, 0]

    assert drain(Dataset.range(3).repeat(0)._split_provider(None)) == []
    empty_forever = Dataset.range(0).repeat()._split_provider(None)
    assert empty_forever.cardinality() == 0
    assert empty_forever.get_next() is None  # does not spin

    nested = Dataset.range(2).repeat(2).repeat(2)._split_provider(None)
    assert drain(nested) == [0, 1] * 4


def test_list_files_provider_shuffle_is_deterministic_with_seed(files):
    ds = Dataset.list_files(str(files[0].rsplit("/", 1)[0] + "/*.txt"))
    orders = [drain(ds._split_provider(seed=7)) for _ in range(2)]
    assert orders[0] == orders[1]
    assert sorted(orders[0]) == sorted(files)
    assert all(isinstance(f, str) for f in orders[0])
    other_seeds = {tuple(drain(ds._split_provider(seed=s))) for s in range(8)}
    assert len(other_seeds) > 1  # the seed matters
    # Each repetition reshuffles, reproducibly.
    rep = ds.repeat(3)
    a, b = drain(rep._split_provider(seed=1)), drain(rep._split_provider(seed=1))
    assert a == b and len(a) == 18
    assert a[:6] != a[6:12] or a[6:12] != a[12:]


def test_list_files_provider_uses_dataset_seed_first(files):
    pattern = str(files[0].rsplit("/", 1)[0] + "/*.txt")
    ds = Dataset.list_files(pattern, seed=3)
    assert drain(ds._split_provider(seed=1)) == drain(ds._split_provider(seed=2))
    unshuffled = Dataset.list_files(pattern, shuffle=False)
    assert drain(unshuffled._split_provider(seed=5)) == sorted(files)


def test_tfrecord_provider_splits_are_file_names():
    from dataservice.data.sources import TFRecordDataset

    ds = TFRecordDataset(["b.rec", "a.rec"]).map(lambda r: r)
    p = ds._split_provider(seed=9)
    assert isinstance(p, FileSplitProvider)
    assert drain(p) == ["b.rec", "a.rec"]
    assert p.cardinality() == 2


def test_provider_replay_by_get_next_and_save_restore(files):
    pattern = str(files[0].rsplit("/", 1)[0] + "/*.txt")
    ds = Dataset.list_files(pattern).repeat(4)
    live = ds._split_provider(seed=11)
    first = [live.get_next() for _ in range(9)]
    state = live.save()
    rest = drain(live)
    replay = ds._split_provider(seed=11)
    assert [replay.get_next() for _ in range(9)] == first
    assert drain(replay) == rest
    restored = ds._split_provider(seed=11)
    restored.restore(pickle.loads(pickle.dumps(state)))
    assert drain(restored) == rest


def test_providers_are_picklable():
    p = Dataset.range(5).repeat(2)._split_provider(None)
    p.get_next()
    q = pickle.loads(pickle.dumps(p))
    assert drain(q) == [1, 2, 3, 4, 0, 1, 2, 3, 4]


def test_from_generator_has_no_split_provider():
    ds = Dataset.from_generator(lambda: iter([1, 2])).map(lambda x: x).batch(2)
    with pytest.raises(ValueError) as e:
        ds._split_provider(seed=0)
    msg = str(e.value)
    assert "split" in msg and "`from_generator`" in msg and "OFF" in msg


def test_single_provider_api_refuses_several_sources():
    for ds, op in [
        (Dataset.zip(Dataset.range(2), Dataset.range(3)), "zip"),
        (Dataset.range(2).concatenate(Dataset.range(3)), "concatenate"),
    ]:
        with pytest.raises(ValueError, match=f"split.*`{op}`.*2 splittable sources"):
            ds.map(lambda *x: x)._split_provider(None)
    # zip of one dataset has one source.
    assert drain(Dataset.zip((Dataset.range(3),))._split_provider(None)) == [0, 1, 2]


class FakeDistributed(Dataset):
    """Stands in for the service's DistributedDataset."""

    _split_op_name = "distribute"
    _op_name = "from_dataset_id"

    def _make_iterator(self, ctx):
        return iter([np.int64(1)])

    def _inputs(self):
        return []

    def cardinality(self):
        return -2


def test_distribute_in_chain_names_distribute():
    with pytest.raises(ValueError) as e:
        FakeDistributed().map(lambda x: x).repeat(2)._split_provider(None)
    assert "split" in str(e.value) and "`distribute`" in str(e.value)


def test_has_splittable_source_and_walk():
    ds = Dataset.range(3).map(lambda x: x).batch(2)
    assert ds._has_splittable_source()
    assert [d._op_name for d in ds._walk()] == ["batch", "map", "range"]
    assert not Dataset.from_generator(lambda: iter([])).map(lambda x: x)._has_splittable_source()
    assert not FakeDistributed()._has_splittable_source()


# ---------------------------------------------------------------------------- split sources


def test_range_reads_only_the_given_splits():
    ds = Dataset.range(0, 20, 2).map(lambda x: x + 1)
    assert run_with_splits(ds, [3, 0, 7]) == [7, 1, 15]


def test_tensor_slices_and_from_tensors_read_splits():
    ds = Dataset.from_tensor_slices({"a": np.arange(5) * 10, "b": ["p", "q", "r", "s", "t"]})
    out = list(ds._make_iterator(IterContext(ListSplits([4, 1]))))
    assert [(int(e["a"]), str(e["b"])) for e in out] == [(40, "t"), (10, "q")]
    assert run_with_splits(Dataset.from_tensors(np.arange(2)), [0]) == [[0, 1]]


def test_splits_flow_through_the_input_side_only():
    # flat_map / interleave bodies are not split: each split x gives all of range(x).
    ds = Dataset.range(10).flat_map(lambda x: Dataset.range(x))
    assert run_with_splits(ds, [2, 3]) == [0, 1, 0, 1, 2]
    inter = Dataset.range(10).interleave(lambda x: Dataset.range(x), cycle_length=2)
    assert run_with_splits(inter, [2, 3]) == [0, 0, 1, 1, 2]


def test_splits_with_batch_shuffle_prefetch_take_enumerate():
    ds = Dataset.range(100).shuffle(1).batch(2).prefetch(2)
    assert run_with_splits(ds, [5, 6, 7]) == [[5, 6], [7]]
    assert run_with_splits(Dataset.range(100).take(2), [9, 8, 7]) == [9, 8]
    assert run_with_splits(Dataset.range(100).enumerate(), [9, 8]) == [[0, 9], [1, 8]]


def test_splits_with_repeat_provider_end_to_end():
    ds = Dataset.range(3).map(lambda x: x * 10).repeat(2)
    provider = ds._split_provider(seed=0)
    assert run_with_splits(ds, iter(provider.get_next, None)) == [0, 10, 20, 0, 10, 20]
    # A worker iterating with the provider itself as split source.
    provider.reset()
    assert [int(x) for x in ds._make_iterator(IterContext(provider))] == [0, 10, 20] * 2
    forever = Dataset.range(3).repeat()
    out = [
        int(x)
        for x in itertools.islice(forever._make_iterator(IterContext(ListSplits([2, 1]))), 10)
    ]
    assert out == [2, 1]  # the split source ran dry: the next epoch is empty, repeat ends


def test_list_files_and_tfrecord_names_from_splits(files):
    pattern = str(files[0].rsplit("/", 1)[0] + "/*.txt")
    ds = Dataset.list_files(pattern)
    assert list(ds._make_iterator(IterContext(ListSplits([files[3], files[1]])))) == [
        files[3],
        files[1],
    ]


def test_zip_routes_splits_to_the_first_splittable_input():
    gen = Dataset.from_generator(lambda: iter(["a", "b", "c"]))
    ds = Dataset.zip(gen, Dataset.range(100))
    out = list(ds._make_iterator(IterContext(ListSplits([50, 60]))))
    assert [(str(a), int(b)) for a, b in out] == [("a", 50), ("b", 60)]


def test_non_splittable_source_refuses_a_split_source():
    from dataservice.errors import InvalidArgumentError

    ds = Dataset.from_generator(lambda: iter([1]))
    with pytest.raises(InvalidArgumentError, match="split"):
        list(ds._make_iterator(IterContext(ListSplits([0]))))


def test_split_source_is_pulled_lazily():
    source = ListSplits(range(1000))
    it = Dataset.range(1000)._make_iterator(IterContext(source))
    assert [int(next(it)) for _ in range(3)] == [0, 1, 2]
    assert source.calls == 3


# ---------------------------------------------------------------------------- several sources


class SharedProvider:
    """A dispatcher-side provider shared by simulated workers, as their split source;
    records every split it hands out."""

    def __init__(self, provider):
        self._provider = provider
        self.handed_out = []

    def get_next(self):
        split = self._provider.get_next()
        if split is not None:
            self.handed_out.append(split)
        return split


def worker_iterators(ds, num_workers, seed=0):
    """`num_workers` iterators over `ds`, as on workers sharing one set of providers."""
    shared = tuple(SharedProvider(p) for p in ds._split_providers(seed))
    its = [ds._make_iterator(IterContext(split_sources=shared)) for _ in range(num_workers)]
    return its, shared


def pull_alternately(iterators, limit=100_000):
    """Pulls one element from each live iterator in turn until all end (or `limit`
    elements each); the per-worker streams."""
    streams = [[] for _ in iterators]
    live = list(range(len(iterators)))
    while live and all(len(s) < limit for s in streams):
        for w in list(live):
            try:
                streams[w].append(np.asarray(next(iterators[w])).tolist())
            except StopIteration:
                live.remove(w)
    return streams


def tuples(value):
    return tuple(tuples(v) for v in value) if isinstance(value, list) else value


def test_split_providers_one_per_source_in_depth_first_order():
    ds = (
        Dataset.range(3)
        .concatenate(Dataset.from_tensors(np.int64(7)))
        .map(lambda x: x)
        .concatenate(Dataset.range(5).repeat(2))
    )
    providers = ds._split_providers(seed=0)
    assert [p.cardinality() for p in providers] == [3, 1, 10]
    assert ds._num_split_sources() == 3
    assert [drain(p) for p in providers] == [[0, 1, 2], [0], [0, 1, 2, 3, 4] * 2]
    # zip: inputs in structure.flatten order (dict keys sorted).
    zipped = Dataset.zip(
        (Dataset.range(2), {"b": Dataset.range(4), "a": Dataset.from_tensor_slices(np.zeros(5))})
    )
    assert [p.cardinality() for p in zipped._split_providers(None)] == [2, 5, 4]
    assert zipped._num_split_sources() == 3


def test_split_providers_of_one_source_equal_split_provider():
    for ds in [
        Dataset.range(5).map(lambda x: x).repeat(2),
        Dataset.from_tensors(1).repeat(3).batch(2),
        Dataset.zip((Dataset.range(3),)),
    ]:
        (only,) = ds._split_providers(seed=4)
        single = ds._split_provider(seed=4)
        assert type(only) is type(single)
        assert drain(only) == drain(single)
        assert ds._num_split_sources() == 1


def test_split_providers_seeds_are_seed_plus_index_and_replayable(files):
    pattern = str(files[0].rsplit("/", 1)[0] + "/*.txt")
    lf = Dataset.list_files(pattern)
    ds = lf.concatenate(lf).repeat(2)
    first, second = ds._split_providers(seed=7)
    assert drain(first) == drain(lf.repeat(2)._split_provider(seed=7))
    assert drain(second) == drain(lf.repeat(2)._split_provider(seed=8))
    again = [drain(p) for p in ds._split_providers(seed=7)]
    assert again == [drain(p) for p in ds._split_providers(seed=7)]
    assert again[0] != again[1]  # different seeds, different orders
    assert all(p._inner._seed is None for p in ds._split_providers(seed=None))


def test_tfrecord_of_a_dataset_passes_splits_to_its_input(files):
    from dataservice.data.sources import TFRecordDataset

    pattern = str(files[0].rsplit("/", 1)[0] + "/*.txt")
    ds = TFRecordDataset(["x.rec", "y.rec"]).concatenate(
        TFRecordDataset(Dataset.list_files(pattern, shuffle=False))
    )
    assert ds._num_split_sources() == 2
    assert [drain(p) for p in ds._split_providers(seed=1)] == [["x.rec", "y.rec"], sorted(files)]


def test_num_split_sources_builds_no_provider(monkeypatch):
    from dataservice.data import sources

    def refuse(self, seed):
        raise AssertionError("built a provider")

    monkeypatch.setattr(sources.RangeDataset, "_split_provider", refuse)
    ds = (
        Dataset.range(3)
        .concatenate(Dataset.range(2))
        .repeat()
        .flat_map(
            lambda x: Dataset.range(x).concatenate(Dataset.range(x))  # a body: not counted
        )
    )
    assert ds._num_split_sources() == 2
    assert Dataset.zip(ds, Dataset.range(1), ds)._num_split_sources() == 5


def test_several_sources_errors_name_the_unsplittable_op():
    gen = Dataset.from_generator(lambda: iter([1, 2]))
    for ds in [
        Dataset.range(2).concatenate(gen.map(lambda x: x)),
        Dataset.zip(Dataset.range(2), gen).repeat(2),
    ]:
        for build, arg in [(ds._split_providers, (0,)), (ds._num_split_sources, ())]:
            with pytest.raises(ValueError) as e:
                build(*arg)
            msg = str(e.value)
            assert "split" in msg and "`from_generator`" in msg and "OFF" in msg
    with pytest.raises(ValueError, match="split.*`distribute`"):
        Dataset.range(2).concatenate(FakeDistributed())._num_split_sources()


def test_iter_context_split_source_is_a_one_tuple():
    s, t = ListSplits([]), ListSplits([])
    assert IterContext(s) == IterContext(split_sources=(s,))
    assert IterContext(s).split_sources == (s,)
    assert IterContext(split_sources=[s, t]).split_sources == (s, t)
    assert IterContext(split_sources=(s, t)).split_source is s
    assert IterContext(split_sources=()).split_sources is None
    assert IterContext(split_sources=(s, t), peek=True).for_user_dataset() == IterContext(peek=True)
    with pytest.raises(ValueError, match="split_source"):
        IterContext(s, split_sources=(t,))


def test_concatenate_two_workers_read_each_element_once():
    ds = Dataset.range(3).concatenate(Dataset.range(10, 13))
    its, shared = worker_iterators(ds, 2)
    streams = pull_alternately(its)
    assert sorted(streams[0] + streams[1]) == [0, 1, 2, 10, 11, 12]
    assert streams == [[0, 2, 11], [1, 10, 12]]
    assert [s.handed_out for s in shared] == [[0, 1, 2], [0, 1, 2]]


def test_split_sources_are_fixed_by_the_graph():
    # The first input is never iterated: the second still reads its own provider.
    first, second = ListSplits([0, 1, 2]), ListSplits([2, 0])
    ds = Dataset.range(3).take(0).concatenate(Dataset.range(10, 13)).map(lambda x: x * 2)
    out = list(ds._make_iterator(IterContext(split_sources=(first, second))))
    assert [int(x) for x in out] == [24, 20]
    assert first.calls == 0
    # zip of a dict: source 0 is key "a" (sorted), source 1 key "b".
    zipped = Dataset.zip({"b": Dataset.range(100), "a": Dataset.range(100, 200)})
    (e,) = zipped._make_iterator(IterContext(split_sources=(ListSplits([0]), ListSplits([5]))))
    assert (int(e["a"]), int(e["b"])) == (100, 5)


def test_zip_pairs_per_worker_under_splits():
    ds = Dataset.zip(Dataset.range(5), Dataset.range(5))
    its, _ = worker_iterators(ds, 2)
    streams = pull_alternately(its)
    assert sorted(tuples(streams[0] + streams[1])) == [(i, i) for i in range(5)]
    # Each input reads its own provider when the worker needs an element: pairs are
    # formed per worker, not by split index.
    ds = Dataset.zip(Dataset.range(4), Dataset.range(4).filter(lambda x: x % 2 == 0))
    its, shared = worker_iterators(ds, 2)
    streams = pull_alternately(its)
    assert [tuples(s) for s in streams] == [((0, 0),), ((1, 2),)]
    assert [s.handed_out for s in shared] == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_repeat_above_concatenate_repeats_both_providers():
    ds = Dataset.range(3).concatenate(Dataset.range(10, 12)).repeat(2)
    providers = ds._split_providers(seed=0)
    assert all(isinstance(p, RepeatSplitProvider) for p in providers)
    assert [p.cardinality() for p in providers] == [6, 4]
    its, _ = worker_iterators(ds, 2)
    streams = pull_alternately(its)
    assert sorted(streams[0] + streams[1]) == sorted([0, 1, 2, 10, 11] * 2)


def test_split_source_count_mismatch_is_refused():
    ds = Dataset.range(3).concatenate(Dataset.range(3))
    with pytest.raises(InvalidArgumentError, match="`concatenate` reads 2 splittable sources"):
        list(ds._make_iterator(IterContext(ListSplits([0]))))
    with pytest.raises(InvalidArgumentError, match="`range` is one splittable source"):
        list(
            Dataset.range(3)
            .map(lambda x: x)
            ._make_iterator(IterContext(split_sources=(ListSplits([0]), ListSplits([0]))))
        )


def test_user_function_datasets_never_see_split_sources():
    ds = Dataset.range(10).flat_map(lambda x: Dataset.range(x).concatenate(Dataset.range(100, 102)))
    assert ds._num_split_sources() == 1
    assert run_with_splits(ds, [2]) == [0, 1, 100, 101]


def test_conformance_pipeline_two_workers_read_whole_groups():
    n = 3
    ds = (
        Dataset.from_tensors(np.int64(0))
        .concatenate(Dataset.range(4096).shuffle(4096).repeat().map(lambda g: g + 1))
        .flat_map(lambda g: Dataset.range(g * n, (g + 1) * n))
    )
    assert ds._num_split_sources() == 2
    assert [p.cardinality() for p in ds._split_providers(seed=0)] == [1, -1]
    its, (zero, groups) = worker_iterators(ds, 2)
    streams = pull_alternately(its, limit=100 * n)
    seen = []
    for stream in streams:
        assert len(stream) == 100 * n
        for k in range(0, len(stream), n):
            round_ = stream[k : k + n]
            g = round_[0] // n
            assert round_ == list(range(g * n, (g + 1) * n))  # one whole group
            seen.append(g)
    assert streams[0][:n] == [0, 1, 2]  # the from_tensors group, on the first worker only
    assert seen.count(0) == 1 and zero.handed_out == [0]
    assert all(1 <= g <= 4096 for g in seen if g != 0)
    handed = collections.Counter(s + 1 for s in groups.handed_out)
    assert not collections.Counter(g for g in seen if g != 0) - handed


class BatchSplits:
    """A split source that also hands out whole batches (as a worker's fetcher)."""

    def __init__(self, batches):
        self._batches = [list(b) for b in batches]
        self.batch_calls = 0

    def get_next(self):  # never used when get_next_batch exists
        raise AssertionError("range read a batch source split by split")

    def get_next_batch(self):
        self.batch_calls += 1
        return self._batches.pop(0) if self._batches else None


def test_range_reads_a_batch_source_a_batch_at_a_time():
    source = BatchSplits([[3, 0, 7], [], [9, 1]])
    got = list(Dataset.range(5, 25, 2)._make_iterator(IterContext(source)))
    assert got == [11, 5, 19, 23, 7] and all(type(x) is np.int64 for x in got)
    assert source.batch_calls == 4  # three batches, then None


@pytest.mark.parametrize(
    ("batch", "message"), [([1, 10], "split 10, outside [0, 10)"), ([1, "a"], "not an index")]
)
def test_range_names_a_bad_split_in_a_batch(batch, message):
    it = Dataset.range(10)._make_iterator(IterContext(BatchSplits([batch])))
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        list(it)
