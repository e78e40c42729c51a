"""In-process semantics of the Dataset API, checked against tf.data's documented outputs."""

from __future__ import annotations

import collections
import gc
import threading
import time

import numpy as np
import pytest

from dataservice.data import structure
from dataservice.data.dataset import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
    IterContext,
)
from dataservice.data.sources import TFRecordDataset
from dataservice.data.static_sharding import resolve_shard_hints
from dataservice.data.structure import TensorSpec
from dataservice.errors import InvalidArgumentError
from dataservice.sharding import SHARD_HINT

Point = collections.namedtuple("Point", ["x", "y"])


def py(x):
    """An element as plain Python values, for comparisons."""
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(py(v) for v in x)
    if isinstance(x, list):
        return [py(v) for v in x]
    if isinstance(x, dict):
        return {k: py(v) for k, v in x.items()}
    return x


def values(ds):
    return [py(e) for e in ds]


def gen_dataset(items):
    return Dataset.from_generator(lambda: iter(items))


# ---------------------------------------------------------------------------- sources


def test_range_variants_and_types():
    assert values(Dataset.range(5)) == [0, 1, 2, 3, 4]
    assert values(Dataset.range(2, 5)) == [2, 3, 4]
    assert values(Dataset.range(1, 5, 2)) == [1, 3]
    assert values(Dataset.range(5, 1, -2)) == [5, 3]
    assert values(Dataset.range(0)) == []
    assert all(type(x) is np.int64 for x in Dataset.range(3))
    with pytest.raises(InvalidArgumentError, match="step"):
        Dataset.range(0, 5, 0)
    with pytest.raises(InvalidArgumentError):
        Dataset.range()


def test_every_iter_is_a_fresh_epoch():
    ds = Dataset.range(3)
    it1 = iter(ds)
    assert int(next(it1)) == 0
    assert values(ds) == [0, 1, 2]
    assert values(ds.as_numpy_iterator()) == [0, 1, 2]
    assert [int(x) for x in it1] == [1, 2]


def test_from_tensor_slices_arrays_and_nests():
    assert values(Dataset.from_tensor_slices(np.array([[1, 2], [3, 4]]))) == [[1, 2], [3, 4]]
    assert values(Dataset.from_tensor_slices([1, 2, 3])) == [1, 2, 3]
    ds = Dataset.from_tensor_slices((np.arange(3), {"b": np.ones((3, 2)), "a": [7, 8, 9]}))
    assert values(ds) == [
        (0, {"b": [1.0, 1.0], "a": 7}),
        (1, {"b": [1.0, 1.0], "a": 8}),
        (2, {"b": [1.0, 1.0], "a": 9}),
    ]
    strs = list(Dataset.from_tensor_slices(["ab", "c"]))
    assert strs == ["ab", "c"] and all(isinstance(s, str) for s in strs)
    raw = list(Dataset.from_tensor_slices([b"a\x00", b"b"]))
    assert raw == [b"a\x00", b"b"] and all(type(b) is bytes for b in raw)
    nt = list(Dataset.from_tensor_slices(Point(np.arange(2), np.arange(2) * 2)))
    assert nt == [Point(0, 0), Point(1, 2)] and type(nt[0]) is Point


def test_from_tensor_slices_copies_rows():
    source = np.zeros((2, 3))
    ds = Dataset.from_tensor_slices(source)
    row = next(iter(ds))
    row += 1
    assert values(ds) == [[0.0] * 3] * 2


def test_from_tensor_slices_errors():
    with pytest.raises(InvalidArgumentError, match="same size"):
        Dataset.from_tensor_slices((np.arange(3), np.arange(4)))
    with pytest.raises(InvalidArgumentError, match="scalar"):
        Dataset.from_tensor_slices(np.int64(3))


def test_from_tensors():
    assert values(Dataset.from_tensors([1, 2, 3])) == [[1, 2, 3]]
    (element,) = list(Dataset.from_tensors((5, "s", b"b")))
    assert type(element[0]) is np.int64 and element[1:] == ("s", b"b")
    assert values(Dataset.from_tensors({"a": np.arange(2)})) == [{"a": [0, 1]}]


def test_zip_and_concatenate():
    a, b = Dataset.range(1, 4), Dataset.range(4, 7)
    assert values(Dataset.zip((a, b))) == [(1, 4), (2, 5), (3, 6)]
    assert values(Dataset.zip(a, b)) == [(1, 4), (2, 5), (3, 6)]
    assert values(Dataset.zip({"x": a, "y": (b, Dataset.range(2))})) == [
        {"x": 1, "y": (4, 0)},
        {"x": 2, "y": (5, 1)},
    ]
    assert values(a.concatenate(b)) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(TypeError):
        Dataset.zip((a, 3))
    with pytest.raises(TypeError, match="Incompatible"):
        a.concatenate(Dataset.from_tensors("s"))


def test_zip_stops_at_shortest_without_overpulling():
    pulled = []

    def gen():
        for i in range(10):
            pulled.append(i)
            yield i

    ds = Dataset.zip(Dataset.range(2), Dataset.from_generator(gen))
    assert values(ds) == [(0, 0), (1, 1)]
    assert pulled == [0, 1]


def test_from_generator_in_process():
    calls = []

    def gen(n, scale):
        calls.append(n)
        for i in range(n):
            yield i * scale

    ds = Dataset.from_generator(gen, args=(3, 2))
    assert values(ds) == [0, 2, 4]
    assert values(ds) == [0, 2, 4]
    assert calls == [3, 3]  # called anew each epoch
    assert all(type(x) is np.int64 for x in ds)
    assert values(Dataset.from_generator(lambda: iter([(1, [2.5]), (3, [4.5])]))) == [
        (1, [2.5]),
        (3, [4.5]),
    ]
    with pytest.raises(TypeError, match="callable"):
        Dataset.from_generator(iter([1, 2]))  # type: ignore[arg-type]


def test_from_generator_output_signature():
    def bad():
        raise AssertionError("element_spec must not run the generator")

    sig = (TensorSpec((None,), np.float32), TensorSpec((), bytes))
    assert Dataset.from_generator(bad, output_signature=sig).element_spec == sig
    ds = Dataset.from_generator(lambda: iter([([1, 2], b"a"), ([3], b"b")]), output_signature=sig)
    out = list(ds)
    assert out[0][0].dtype == np.float32 and out[0][0].tolist() == [1.0, 2.0]
    assert out[1][1] == b"b"
    wrong = Dataset.from_generator(lambda: iter([([[1]], b"a")]), output_signature=sig)
    with pytest.raises(InvalidArgumentError, match="output_signature"):
        list(wrong)


def test_from_generator_closes_the_generator():
    closed = []

    def gen():
        try:
            yield from range(100)
        finally:
            closed.append(True)

    it = iter(Dataset.from_generator(gen).take(2))
    assert [int(x) for x in it] == [0, 1]
    assert closed == [True]


def test_list_files(tmp_path):
    for name in ["b.txt", "a.txt", "c.txt", "skip.dat"]:
        (tmp_path / name).write_text("x")
    pattern = str(tmp_path / "*.txt")
    expected = [str(tmp_path / n) for n in ["a.txt", "b.txt", "c.txt"]]
    ordered = Dataset.list_files(pattern, shuffle=False)
    assert list(ordered) == expected
    assert all(type(f) is str for f in ordered)
    shuffled = list(Dataset.list_files(pattern))
    assert sorted(shuffled) == expected
    seeded = [list(Dataset.list_files(pattern, seed=4)) for _ in range(2)]
    assert seeded[0] == seeded[1]
    two = Dataset.list_files([str(tmp_path / "c.*"), str(tmp_path / "a.*")], shuffle=False)
    assert list(two) == [expected[2], expected[0]]
    assert Dataset.list_files(pattern).cardinality() == 3
    assert Dataset.list_files(pattern).element_spec == TensorSpec((), str)


def test_list_files_no_match_names_the_pattern(tmp_path):
    pattern = str(tmp_path / "nothing-*.rec")
    with pytest.raises(InvalidArgumentError, match="nothing-"):
        Dataset.list_files(pattern)


# ---------------------------------------------------------------------------- map / filter


def test_map_calling_convention():
    zipped = Dataset.zip(Dataset.range(3), Dataset.range(10, 13))
    assert values(zipped.map(lambda x, y: x + y)) == [10, 12, 14]
    dicts = Dataset.from_tensor_slices({"a": [1, 2]})
    assert values(dicts.map(lambda d: d["a"] * 3)) == [3, 6]
    points = Dataset.from_tensor_slices(Point(np.arange(2), np.arange(2)))
    assert values(points.map(lambda p: p.x + p.y)) == [0, 2]  # namedtuple: one argument
    assert values(Dataset.range(3).map(lambda x: (x, x * 2))) == [(0, 0), (1, 2), (2, 4)]
    assert all(type(x) is np.int64 for x in Dataset.range(2).map(lambda x: 7))


@pytest.mark.parametrize("n", [2, 4, AUTOTUNE])
def test_parallel_map_keeps_order(n):
    def slow(x):
        time.sleep(0.001 * (int(x) % 3))
        return x * 2

    ds = Dataset.range(50).map(slow, num_parallel_calls=n)
    assert values(ds) == [2 * i for i in range(50)]


def test_parallel_map_runs_concurrently_and_non_deterministic():
    barrier = threading.Barrier(3, timeout=5)

    def wait(x):
        barrier.wait()  # only passes if 3 calls run at the same time
        return x

    assert sorted(values(Dataset.range(6).map(wait, num_parallel_calls=3))) == list(range(6))
    out = values(Dataset.range(40).map(lambda x: x, num_parallel_calls=4, deterministic=False))
    assert sorted(out) == list(range(40))


@pytest.mark.parametrize("n", [None, 3])
def test_map_errors_propagate(n):
    ds = Dataset.range(10).map(lambda x: 1 // (int(x) - 4), num_parallel_calls=n)
    it = iter(ds)
    got = [next(it) for _ in range(4)]
    assert values(got) == [1 // (i - 4) for i in range(4)]
    with pytest.raises(ZeroDivisionError):
        next(it)


def test_map_argument_validation():
    with pytest.raises(TypeError):
        Dataset.range(3).map(3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).map(lambda x: x, num_parallel_calls=0)


def test_filter():
    assert values(Dataset.range(10).filter(lambda x: x % 3 == 0)) == [0, 3, 6, 9]
    zipped = Dataset.zip(Dataset.range(4), Dataset.range(4))
    assert values(zipped.filter(lambda a, b: a + b > 3)) == [(2, 2), (3, 3)]
    assert values(Dataset.range(3).filter(lambda x: np.array(True))) == [0, 1, 2]
    with pytest.raises(InvalidArgumentError, match="scalar bool"):
        list(Dataset.range(3).filter(lambda x: x))


# ---------------------------------------------------------------------------- flat_map / interleave


def test_flat_map():
    ds = Dataset.from_tensor_slices([[1, 2, 3], [4, 5, 6]]).flat_map(Dataset.from_tensor_slices)
    assert values(ds) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(TypeError, match="must return a Dataset"):
        list(Dataset.range(2).flat_map(lambda x: [x]))


def test_interleave_tf_data_doc_example():
    # tf.data's documented example (Dataset.interleave docstring).
    ds = Dataset.range(1, 6).interleave(
        lambda x: Dataset.from_tensors(x).repeat(6), cycle_length=2, block_length=4
    )
    assert values(ds) == (
        [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 3, 3, 4, 4]
        + [5, 5, 5, 5, 5, 5]
    )


def test_interleave_cycle_block_order_with_empty_inputs():
    ds = Dataset.range(5).interleave(
        lambda x: Dataset.range(x).map(lambda _: x), cycle_length=2, block_length=1
    )
    assert values(ds) == [1, 2, 2, 3, 3, 4, 3, 4, 4, 4]


@pytest.mark.parametrize("n", [2, AUTOTUNE])
def test_parallel_interleave_same_order(n):
    def fn(x):
        return Dataset.range(x).map(lambda _: x)

    sequential = values(Dataset.range(8).interleave(fn, cycle_length=3, block_length=2))
    parallel = Dataset.range(8).interleave(fn, cycle_length=3, block_length=2, num_parallel_calls=n)
    assert values(parallel) == sequential


def test_interleave_defaults_and_validation():
    ds = Dataset.range(3).interleave(lambda x: Dataset.from_tensors(x), block_length=None)
    assert sorted(values(ds)) == [0, 1, 2]
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).interleave(lambda x: Dataset.range(1), cycle_length=0)
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).interleave(lambda x: Dataset.range(1), block_length=0)


# ---------------------------------------------------------------------------- batch


def test_batch_remainder():
    assert values(Dataset.range(8).batch(3)) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert values(Dataset.range(8).batch(3, drop_remainder=True)) == [[0, 1, 2], [3, 4, 5]]
    assert values(Dataset.range(6).batch(3)) == [[0, 1, 2], [3, 4, 5]]
    assert values(Dataset.range(0).batch(3)) == []
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).batch(0)


def test_batch_nested_and_leaf_kinds():
    ds = Dataset.range(4).map(
        lambda x: {"v": np.full((2,), x, np.float32), "id": b"k%d" % x, "s": f"s{x}"}
    )
    (first, second) = list(ds.batch(2))
    assert first["v"].dtype == np.float32 and first["v"].shape == (2, 2)
    assert first["id"].dtype == object and first["id"].tolist() == [b"k0", b"k1"]
    assert first["s"].dtype.kind == "U" and first["s"].tolist() == ["s0", "s1"]
    assert second["v"].tolist() == [[2.0, 2.0], [3.0, 3.0]]
    tuples = list(Dataset.zip(Dataset.range(3), Dataset.range(3)).batch(3))
    assert [t.tolist() for t in tuples[0]] == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda i: np.zeros(3, np.float32) if i % 2 else np.zeros(3, np.int64),
            "different dtypes in component 0. First element had dtype int64 and element 1 "
            "had dtype float32",
        ),
        (lambda i: 2.5 if i % 2 else 1, "element 1 was float"),
        (lambda i: np.int32(i) if i % 2 else np.int64(i), "element 1 was int32"),
    ],
    ids=["arrays", "int-float", "int32-int64"],
)
def test_batch_refuses_mixed_dtypes_instead_of_casting(make, message):
    """tf.data's batch refuses a component whose elements have different
    dtypes; np.stack / np.array would cast them all to one, silently."""
    with pytest.raises(InvalidArgumentError, match=message):
        list(Dataset.range(4).map(make).batch(4))
    # One dtype throughout still batches.
    assert list(Dataset.range(4).map(lambda i: np.int32(i)).batch(4))[0].dtype == np.int32


def test_batch_names_the_elements_whose_structures_differ():
    ds = Dataset.range(3).map(lambda i: [i] if i == 2 else [])
    with pytest.raises(InvalidArgumentError) as raised:
        list(ds.batch(3))
    assert str(raised.value).startswith(
        "Cannot batch elements of different structures: element 0 of the batch is the "
        "first structure below, element 2 the second."
    )


def test_batch_shape_mismatch():
    ds = Dataset.range(1, 4).map(lambda x: np.zeros(int(x)))
    with pytest.raises(InvalidArgumentError, match="different shapes in component 0"):
        list(ds.batch(2))
    nested = Dataset.range(1, 4).map(lambda x: {"b": np.zeros(int(x)), "a": x})
    with pytest.raises(InvalidArgumentError, match="component 1"):
        list(nested.batch(2))


def test_batch_structure_mismatch_and_namedtuples():
    mixed = gen_dataset([{"a": 1}, {"b": 2}])
    with pytest.raises(InvalidArgumentError, match="same nested structure"):
        list(mixed.batch(2))
    points = list(gen_dataset([Point(1, [2.0]), Point(3, [4.0])]).batch(2))
    assert type(points[0]) is Point and type(points[0].y) is list
    assert points[0].x.tolist() == [1, 3] and points[0].y[0].tolist() == [2.0, 4.0]
    keyed = list(Dataset.from_tensor_slices({"z": [1, 2], "a": [3, 4]}).batch(2))
    assert list(keyed[0]) == ["z", "a"]


# ---------------------------------------------------------------------------- shuffle


def test_shuffle_is_a_permutation_and_seeded_reproducible():
    a = values(Dataset.range(100).shuffle(10, seed=42))
    b = values(Dataset.range(100).shuffle(10, seed=42))
    assert a == b
    assert sorted(a) == list(range(100))
    assert a != list(range(100))
    assert values(Dataset.range(100).shuffle(10, seed=43)) != a


def test_shuffle_buffer_bounds_positions():
    for seed in range(5):
        out = values(Dataset.range(200).shuffle(3, seed=seed))
        # Output k can only be one of the first k + buffer_size inputs.
        assert all(v <= k + 2 for k, v in enumerate(out))
    assert values(Dataset.range(20).shuffle(1)) == list(range(20))


def test_shuffle_reshuffle_each_iteration():
    ds = Dataset.range(30).shuffle(30, seed=1)
    epochs = [values(ds) for _ in range(3)]
    assert len({tuple(e) for e in epochs}) == 3
    rebuilt = Dataset.range(30).shuffle(30, seed=1)
    assert [values(rebuilt) for _ in range(3)] == epochs  # reproducible epoch sequence
    repeated = values(Dataset.range(30).shuffle(30, seed=1).repeat(3))
    assert repeated == sum(epochs, [])
    fixed = Dataset.range(30).shuffle(30, seed=1, reshuffle_each_iteration=False)
    assert values(fixed) == values(fixed)
    unseeded_fixed = Dataset.range(30).shuffle(30, reshuffle_each_iteration=False)
    assert values(unseeded_fixed) == values(unseeded_fixed)


def test_element_spec_does_not_use_up_a_seeded_epoch():
    plain = Dataset.range(30).shuffle(30, seed=5).map(lambda x: x * 1)
    peeked = Dataset.range(30).shuffle(30, seed=5).map(lambda x: x * 1)
    assert peeked.element_spec == TensorSpec((), np.int64)
    assert [values(peeked) for _ in range(2)] == [values(plain) for _ in range(2)]


def test_shuffle_without_seed_is_fresh_per_iterator():
    ds = Dataset.range(50).shuffle(50)
    assert values(ds) != values(ds)
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).shuffle(0)


# ---------------------------------------------------------------------------- repeat / take / skip


def test_repeat():
    assert values(Dataset.range(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert values(Dataset.range(3).repeat(0)) == []
    assert values(Dataset.range(0).repeat()) == []
    assert values(Dataset.range(2).repeat().take(5)) == [0, 1, 0, 1, 0]
    assert values(Dataset.range(2).repeat(-1).take(3)) == [0, 1, 0]


class _EpochIter:
    def __init__(self, items, skip):
        self._it = iter(items)
        self.skip_empty_epoch = skip

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)


class ScriptedEpochs(Dataset):
    """Epoch i yields script[i][0]; its iterator's skip_empty_epoch is script[i][1]."""

    def __init__(self, script):
        self._script = script

    def _make_iterator(self, ctx):
        n = self.__dict__.setdefault("_t_n", [0])
        i = n[0]
        n[0] += 1
        items, skip = self._script[i] if i < len(self._script) else ([], False)
        return _EpochIter(items, skip)


def test_repeat_skip_empty_epoch():
    script = [([1], False), ([], True), ([2, 3], False), ([], False), ([9], False)]
    assert values(ScriptedEpochs(script).repeat()) == [1, 2, 3]
    # Without the attribute, the first empty epoch ends repeat().
    plain = [([1], False), ([], False), ([2], False)]
    assert values(ScriptedEpochs(plain).repeat()) == [1]
    # A finite count goes through its epochs (tf.data's FiniteIterator).
    assert values(ScriptedEpochs(plain).repeat(3)) == [1, 2]


def test_take_and_skip():
    assert values(Dataset.range(10).take(3)) == [0, 1, 2]
    assert values(Dataset.range(2).take(5)) == [0, 1]
    assert values(Dataset.range(3).take(-1)) == [0, 1, 2]
    assert values(Dataset.range(3).take(0)) == []
    assert values(Dataset.range(5).skip(2)) == [2, 3, 4]
    assert values(Dataset.range(5).skip(9)) == []
    assert values(Dataset.range(5).skip(-1)) == []


def test_take_does_not_overpull():
    pulled = []

    def gen():
        for i in range(10):
            pulled.append(i)
            yield i

    assert values(Dataset.from_generator(gen).take(3)) == [0, 1, 2]
    assert pulled == [0, 1, 2]


def test_enumerate():
    ds = Dataset.from_tensor_slices(["a", "b"]).enumerate(start=5)
    out = list(ds)
    assert [(int(i), str(s)) for i, s in out] == [(5, "a"), (6, "b")]
    assert type(out[0][0]) is np.int64


# ---------------------------------------------------------------------------- shard


def test_shard():
    assert values(Dataset.range(10).shard(3, 0)) == [0, 3, 6, 9]
    assert values(Dataset.range(10).shard(3, 1)) == [1, 4, 7]
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).shard(0, 0)
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).shard(2, 2)
    with pytest.raises(InvalidArgumentError):
        Dataset.range(3).shard(2, -3)


def test_shard_hint_only_resolved_by_the_service():
    ds = Dataset.range(10).shard(SHARD_HINT, SHARD_HINT).map(lambda x: x)
    assert ds.cardinality() == UNKNOWN_CARDINALITY
    with pytest.raises(InvalidArgumentError, match="HINT"):
        list(ds)
    resolved = resolve_shard_hints(ds, num_workers=3, worker_index=1)
    assert values(resolved) == [1, 4, 7]
    assert values(resolve_shard_hints(Dataset.range(10).shard(2, SHARD_HINT), 5, 1)) == [
        1,
        3,
        5,
        7,
        9,
    ]


# ---------------------------------------------------------------------------- prefetch / apply


def test_prefetch_and_apply():
    assert values(Dataset.range(20).prefetch(3)) == list(range(20))
    assert values(Dataset.range(5).prefetch(0)) == list(range(5))
    assert values(Dataset.range(5).prefetch(AUTOTUNE)) == list(range(5))
    assert values(Dataset.range(5).apply(lambda d: d.map(lambda x: x + 1))) == [1, 2, 3, 4, 5]
    with pytest.raises(TypeError):
        Dataset.range(3).apply(lambda d: 3)


def test_prefetch_propagates_errors_in_position():
    ds = Dataset.range(5).map(lambda x: 10 // (int(x) - 3)).prefetch(2)
    it = iter(ds)
    assert values([next(it) for _ in range(3)]) == [-4, -5, -10]
    with pytest.raises(ZeroDivisionError):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


# ---------------------------------------------------------------------------- threads


def _our_threads():
    return {t for t in threading.enumerate() if t.name.startswith("dataservice-")}


def _wait_no_new_threads(before, timeout_s=1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gc.collect()
        if not (_our_threads() - before):
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize(
    "make",
    [
        lambda: Dataset.range(10**9).prefetch(4),
        lambda: Dataset.range(10**9).map(lambda x: x, num_parallel_calls=4),
        lambda: Dataset.range(10**9).prefetch(2).map(lambda x: x + 1).prefetch(2).batch(2),
        lambda: Dataset.range(10**9).interleave(
            lambda x: Dataset.range(10**9), cycle_length=3, num_parallel_calls=3
        ),
        lambda: Dataset.range(10**9).repeat().prefetch(2).shuffle(4).take(10**8),
    ],
)
def test_abandoned_iterators_stop_their_threads(make):
    before = _our_threads()
    it = iter(make())
    for _ in range(5):
        next(it)
    assert _our_threads() - before, "expected background threads while iterating"
    del it
    assert _wait_no_new_threads(before)


def test_close_stops_threads_and_threads_are_daemons():
    before = _our_threads()
    it = iter(Dataset.range(10**9).map(lambda x: x, num_parallel_calls=2).prefetch(2))
    next(it)
    assert all(t.daemon for t in _our_threads() - before)
    it.close()
    assert _wait_no_new_threads(before)
    with pytest.raises(StopIteration):
        next(it)


def test_finished_iterators_leave_no_threads():
    before = _our_threads()
    assert len(list(Dataset.range(100).prefetch(2).map(lambda x: x, num_parallel_calls=3))) == 100
    assert _wait_no_new_threads(before)


def test_element_spec_of_prefetch_leaves_no_threads():
    before = _our_threads()
    assert Dataset.range(10**9).map(lambda x: x * 1.0).prefetch(2).element_spec == TensorSpec(
        (), np.float64
    )
    assert _wait_no_new_threads(before)


# ---------------------------------------------------------------------------- cardinality


def test_cardinality_of_each_op():
    r10 = Dataset.range(10)
    gen = gen_dataset([1, 2])
    cases = [
        (r10, 10),
        (Dataset.range(5, 0, -2), 3),
        (Dataset.range(3, 3), 0),
        (Dataset.from_tensor_slices(np.zeros((7, 2))), 7),
        (Dataset.from_tensors(1), 1),
        (gen, UNKNOWN_CARDINALITY),
        (r10.map(lambda x: x), 10),
        (r10.filter(lambda x: True), UNKNOWN_CARDINALITY),
        (r10.flat_map(lambda x: Dataset.range(1)), UNKNOWN_CARDINALITY),
        (r10.interleave(lambda x: Dataset.range(1), cycle_length=1), UNKNOWN_CARDINALITY),
        (r10.batch(3), 4),
        (r10.batch(3, drop_remainder=True), 3),
        (r10.repeat().batch(3), INFINITE_CARDINALITY),
        (gen.batch(3), UNKNOWN_CARDINALITY),
        (r10.shuffle(3), 10),
        (r10.repeat(), INFINITE_CARDINALITY),
        (r10.repeat(3), 30),
        (r10.repeat(0), 0),
        (Dataset.range(0).repeat(), 0),
        (gen.repeat(), INFINITE_CARDINALITY),
        (gen.repeat(2), UNKNOWN_CARDINALITY),
        (r10.take(3), 3),
        (r10.take(20), 10),
        (r10.take(-1), 10),
        (r10.repeat().take(5), 5),
        (r10.repeat().take(-1), INFINITE_CARDINALITY),
        (gen.take(5), UNKNOWN_CARDINALITY),
        (r10.skip(3), 7),
        (r10.skip(20), 0),
        (r10.skip(-1), 0),
        (r10.repeat().skip(3), INFINITE_CARDINALITY),
        (gen.skip(1), UNKNOWN_CARDINALITY),
        (r10.enumerate(), 10),
        (r10.shard(3, 0), 4),
        (r10.shard(3, 2), 3),
        (r10.repeat().shard(3, 2), INFINITE_CARDINALITY),
        (r10.prefetch(2), 10),
        (Dataset.zip(Dataset.range(3), r10), 3),
        (Dataset.zip(Dataset.range(3), r10.repeat()), 3),
        (Dataset.zip(r10.repeat(), r10.repeat()), INFINITE_CARDINALITY),
        (Dataset.zip(Dataset.range(3), gen), UNKNOWN_CARDINALITY),
        (Dataset.range(3).concatenate(r10), 13),
        (Dataset.range(3).concatenate(r10.repeat()), INFINITE_CARDINALITY),
        (gen.concatenate(r10), UNKNOWN_CARDINALITY),
        (TFRecordDataset(["a"]), UNKNOWN_CARDINALITY),
        (r10.apply(lambda d: d.take(2)), 2),
    ]
    for ds, expected in cases:
        assert ds.cardinality() == expected, (ds, expected)


def test_len():
    assert len(Dataset.range(4)) == 4
    with pytest.raises(TypeError, match="infinite"):
        len(Dataset.range(4).repeat())
    with pytest.raises(TypeError, match="unknown"):
        len(Dataset.range(4).filter(lambda x: True))
    assert bool(Dataset.range(0))


# ---------------------------------------------------------------------------- element_spec


def test_element_spec_static():
    i64 = TensorSpec((), np.int64)
    assert Dataset.range(3).element_spec == i64
    assert Dataset.from_tensor_slices(np.zeros((4, 2), np.float32)).element_spec == TensorSpec(
        (2,), np.float32
    )
    assert Dataset.from_tensor_slices({"a": [1, 2], "b": ["x", "yy"]}).element_spec == {
        "a": i64,
        "b": TensorSpec((), np.dtype("<U2")),
    }
    assert Dataset.from_tensor_slices([b"x", b"y"]).element_spec == TensorSpec((), bytes)
    assert Dataset.from_tensors((np.zeros((2, 3)), b"k")).element_spec == (
        TensorSpec((2, 3), np.float64),
        TensorSpec((), bytes),
    )
    assert Dataset.range(3).batch(2).element_spec == TensorSpec((None,), np.int64)
    assert Dataset.range(3).batch(2, drop_remainder=True).element_spec == TensorSpec((2,), np.int64)
    assert Dataset.from_tensors(b"x").batch(4).element_spec == TensorSpec((None,), object)
    assert Dataset.zip({"a": Dataset.range(1), "b": Dataset.from_tensors("s")}).element_spec == {
        "a": i64,
        "b": TensorSpec((), str),
    }
    assert Dataset.range(3).enumerate().element_spec == (i64, i64)
    for op in [
        lambda d: d.filter(lambda x: True),
        lambda d: d.shuffle(2),
        lambda d: d.repeat(),
        lambda d: d.take(1),
        lambda d: d.skip(1),
        lambda d: d.shard(2, 0),
        lambda d: d.prefetch(1),
        lambda d: d.shard(SHARD_HINT, SHARD_HINT),
    ]:
        assert op(Dataset.range(3)).element_spec == i64
    merged = Dataset.from_tensors(np.zeros(3)).concatenate(Dataset.from_tensors(np.zeros(4)))
    assert merged.element_spec == TensorSpec((None,), np.float64)
    assert TFRecordDataset(["x"]).element_spec == TensorSpec((), bytes)


def test_element_spec_static_does_not_run_the_pipeline():
    def boom():
        raise AssertionError("ran")

        yield  # pragma: no cover

    sig = TensorSpec((3,), np.float32)
    ds = Dataset.from_generator(boom, output_signature=sig).shuffle(3).batch(2).enumerate()
    assert ds.element_spec == (TensorSpec((), np.int64), TensorSpec((None, 3), np.float32))


def test_element_spec_from_first_element():
    ds = Dataset.range(3).map(lambda x: {"f": np.full((2,), x, np.float32), "n": b"a"})
    assert ds.element_spec == {"f": TensorSpec((2,), np.float32), "n": TensorSpec((), bytes)}
    assert ds.batch(2).element_spec == {
        "f": TensorSpec((2, 2), np.float32),
        "n": TensorSpec((2,), object),
    }
    assert gen_dataset([(1, 2.0)]).element_spec == (
        TensorSpec((), np.int64),
        TensorSpec((), np.float64),
    )
    flat = Dataset.range(3).flat_map(lambda x: Dataset.from_tensors(np.zeros((x + 1, 2))))
    assert flat.element_spec == TensorSpec((1, 2), np.float64)
    with pytest.raises(InvalidArgumentError, match="element_spec"):
        _ = gen_dataset([]).element_spec


def test_element_spec_compatible_with_elements():
    pipelines = [
        Dataset.range(5).batch(2),
        Dataset.from_tensor_slices({"a": np.ones((4, 3)), "s": [b"1", b"2", b"3", b"4"]}).batch(3),
        Dataset.zip(Dataset.range(3), Dataset.from_tensor_slices(["a", "bc", "d"])).enumerate(),
    ]
    for ds in pipelines:
        spec = ds.element_spec
        for element in ds:
            assert structure.is_compatible(spec, element), (spec, element)


# ---------------------------------------------------------------------------- graph hooks


def test_inputs_walk_and_map_graph():
    a, b = Dataset.range(2), Dataset.range(3)
    ds = Dataset.zip(a, b.map(lambda x: x)).batch(2)
    assert [d._op_name for d in ds._walk()] == ["batch", "zip", "range", "map", "range"]
    assert ds._inputs()[0]._inputs()[0] is a
    body = Dataset.range(4)
    flat = Dataset.range(2).flat_map(lambda x: body)
    assert [d._op_name for d in flat._walk()] == ["flat_map", "range"]

    def bigger(node):
        if node._op_name == "range":
            return Dataset.range(10, 13)
        return node

    assert values(ds._map_graph(bigger)) == [([10, 11], [10, 11]), ([12], [12])]
    assert values(ds) == [([0, 1], [0, 1])]  # the original is unchanged


def test_iter_context_default():
    assert IterContext().split_source is None
    assert values(Dataset.range(3)._make_iterator(IterContext())) == [0, 1, 2]


# ---------------------------------------------------------------------------- TFRecord


def test_tfrecord_dataset_reads_files_in_order(tmp_path):
    core = pytest.importorskip("dataservice._core")
    names = []
    for f in range(3):
        path = str(tmp_path / f"d{f}.tfrecord")
        with core.TFRecordWriter(path) as w:
            for r in range(f + 1):
                w.write(b"f%d-r%d" % (f, r))
        names.append(path)
    expected = [b"f0-r0", b"f1-r0", b"f1-r1", b"f2-r0", b"f2-r1", b"f2-r2"]
    assert list(TFRecordDataset(names)) == expected
    assert list(TFRecordDataset(names[0])) == [b"f0-r0"]
    listed = Dataset.list_files(str(tmp_path / "*.tfrecord"), shuffle=False)
    assert list(TFRecordDataset(listed)) == expected
    assert list(TFRecordDataset(names, num_parallel_reads=2)) == [
        b"f0-r0",
        b"f1-r0",
        b"f1-r1",
        b"f2-r0",
        b"f2-r1",
        b"f2-r2",
    ]
    # File splits on a worker.

    class Splits:
        def __init__(self):
            self._it = iter([names[2], names[0]])

        def get_next(self):
            return next(self._it, None)

    out = list(TFRecordDataset(names)._make_iterator(IterContext(Splits())))
    assert out == [b"f2-r0", b"f2-r1", b"f2-r2", b"f0-r0"]


def test_tfrecord_dataset_gzip_and_damage(tmp_path):
    core = pytest.importorskip("dataservice._core")
    from dataservice.errors import DataLossError

    path = str(tmp_path / "z.tfrecord.gz")
    with core.TFRecordWriter(path, "GZIP") as w:
        w.write(b"hello")
    assert list(TFRecordDataset(path, compression_type="GZIP")) == [b"hello"]
    bad = tmp_path / "bad.tfrecord"
    with core.TFRecordWriter(str(bad)) as w:
        w.write(b"abcdef")
    raw = bytearray(bad.read_bytes())
    raw[14] ^= 0xFF  # a data byte
    bad.write_bytes(bytes(raw))
    with pytest.raises(DataLossError):
        list(TFRecordDataset(str(bad)))


def test_tfrecord_dataset_arguments():
    with pytest.raises(ValueError, match="compression_type"):
        TFRecordDataset("x", compression_type="BZ2")
    with pytest.raises(TypeError):
        TFRecordDataset(3)
    assert TFRecordDataset("x", compression_type="").filenames == ("x",)
