"""Split providers (dispatcher side) and split sources (worker side) of DYNAMIC sharding."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest

from dataservice.data.dataset import Dataset, IterContext
from dataservice.data.splits import (
    FileSplitProvider,
    IndexSplitProvider,
    RepeatSplitProvider,
    SplitProvider,
)


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


def test_zip_and_concatenate_have_no_split_provider():
    for ds, op in [
        (Dataset.zip(Dataset.range(2), Dataset.range(3)), "zip"),
        (Dataset.range(2).concatenate(Dataset.range(3)), "concatenate"),
    ]:
        with pytest.raises(ValueError, match=f"split.*`{op}`"):
            ds.map(lambda *x: x)._split_provider(None)


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
