"""`from_tensor_slices` over lists of `bytes` (data/arena.py): the items are held in
one uint8 buffer plus int64 offsets, which travel out of band, while the elements
are exactly those of the list (CASES C-19)."""

from __future__ import annotations

import mmap
import pickle

import numpy as np
import pytest

from dataservice.data.arena import BytesArena, arena_of
from dataservice.data.dataset import Dataset, IterContext
from dataservice.data.serialize import (
    MIN_SHARED_BUFFER_BYTES,
    deserialize,
    load,
    parse,
    serialize,
)
from dataservice.data.structure import TensorSpec
from dataservice.errors import InvalidArgumentError
from tests.unit.test_splits import ListSplits

HUGE = bytes(np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8))
ITEMS = [
    b"",
    "héllo wörld ✓ 日本".encode(),
    b"\x00",
    b"trailing NULs\x00\x00",
    bytes(range(256)),
    HUGE,  # one item of 3 MiB
    b"",
    b"last",
]


def elements(dataset: Dataset) -> list:
    return list(dataset)


def assert_same_items(got: list, want: list) -> None:
    assert got == want
    assert [type(x) for x in got] == [type(x) for x in want]


def test_elements_are_the_items_of_the_list():
    dataset = Dataset.from_tensor_slices(ITEMS)
    assert isinstance(dataset._value, BytesArena)
    assert dataset.element_spec == TensorSpec((), bytes)
    assert dataset.cardinality() == len(ITEMS)
    assert_same_items(elements(dataset), ITEMS)
    assert_same_items(elements(dataset), ITEMS)  # a second epoch
    assert_same_items(elements(deserialize(serialize(dataset))), ITEMS)


def test_nested_components_and_object_arrays():
    labels = np.arange(len(ITEMS))
    nest = {"image": ITEMS, "meta": (labels, list(reversed(ITEMS)))}
    dataset = Dataset.from_tensor_slices(nest)
    assert dataset.element_spec == {
        "image": TensorSpec((), bytes),
        "meta": (TensorSpec((), np.int64), TensorSpec((), bytes)),
    }
    for copy in (dataset, deserialize(serialize(dataset))):
        got = elements(copy)
        assert [e["image"] for e in got] == ITEMS
        assert [e["meta"][1] for e in got] == ITEMS[::-1]
        assert [int(e["meta"][0]) for e in got] == labels.tolist()
    # An object array of bytes, or of str (kept as UTF-8, lone surrogates too).
    as_array = np.empty(len(ITEMS), dtype=object)
    as_array[:] = ITEMS
    assert serialize(Dataset.from_tensor_slices(as_array)) == serialize(
        Dataset.from_tensor_slices(ITEMS)
    )
    strings = ["", "héllo", "日本語", "lone \ud800 surrogate", "\x00"]
    str_array = np.array(strings, dtype=object)
    dataset = Dataset.from_tensor_slices(str_array)
    assert isinstance(dataset._value, BytesArena)
    assert dataset.element_spec == TensorSpec((), str)
    assert_same_items(elements(deserialize(serialize(dataset))), strings)


def test_other_lists_keep_their_elements_as_before():
    # Zero elements: a float64 array, as numpy makes it.
    empty = Dataset.from_tensor_slices([])
    assert (empty.cardinality(), empty.element_spec) == (0, TensorSpec((), np.float64))
    assert elements(empty) == []
    assert elements(Dataset.from_tensor_slices({"a": [], "b": np.zeros(0)})) == []
    # str lists are numpy str arrays (np.str_ elements), not arenas.
    strings = Dataset.from_tensor_slices(["a", "bé"])
    assert strings.element_spec == TensorSpec((), np.dtype("<U2"))
    assert_same_items(elements(strings), [np.str_("a"), np.str_("bé")])
    # np.bytes_ items, and rows of bytes: object arrays as before.
    np_bytes = [np.bytes_(b"a"), np.bytes_(b"bc")]
    got = elements(Dataset.from_tensor_slices(np_bytes))
    assert_same_items(got, np_bytes)
    rows = elements(Dataset.from_tensor_slices([[b"a", b"b"], [b"c", b"d"]]))
    assert [r.tolist() for r in rows] == [[b"a", b"b"], [b"c", b"d"]]
    assert rows[0].dtype == object
    assert arena_of([b"a", np.bytes_(b"b")]) is None
    assert arena_of(np.array([b"a", "b"], dtype=object)) is None
    assert arena_of(np.array([[b"a"]], dtype=object)) is None
    with pytest.raises(InvalidArgumentError, match="same size"):
        Dataset.from_tensor_slices({"a": [b"x", b"y"], "b": [1]})
    with pytest.raises(InvalidArgumentError, match="scalar"):
        Dataset.from_tensor_slices(b"not a list")


def test_splits_shard_shuffle_and_batch_see_the_same_elements():
    dataset = Dataset.from_tensor_slices(ITEMS)
    splits = [5, 0, 7, 1]
    got = list(dataset._make_iterator(IterContext(ListSplits(splits))))
    assert_same_items(got, [ITEMS[i] for i in splits])
    assert elements(dataset.shard(3, 1)) == ITEMS[1::3]
    shuffled = elements(dataset.shuffle(len(ITEMS), seed=4))
    assert sorted(shuffled) == sorted(ITEMS) and shuffled != ITEMS
    batches = elements(dataset.batch(3))
    assert [b.tolist() for b in batches] == [ITEMS[0:3], ITEMS[3:6], ITEMS[6:]]
    assert batches[0].dtype == object
    assert elements(dataset.skip(5).take(1)) == [HUGE]


def test_the_definition_of_a_64_mib_source_is_small():
    # 131072 items of 512 bytes: the 64 MiB of items and the 1 MiB of offsets
    # both go out of band; the pickle holds only the pipeline.
    rng = np.random.default_rng(64)
    data = rng.bytes(64 << 20)
    items = [data[i : i + 512] for i in range(0, len(data), 512)]
    definition = parse(serialize(Dataset.from_tensor_slices(items).batch(32)))
    assert len(definition.pickle) < 4096
    sizes = sorted(b.size_bytes for b in definition.buffers)
    assert sizes == [(len(items) + 1) * 8, 64 << 20]
    assert min(sizes) >= MIN_SHARED_BUFFER_BYTES
    # Before the arena, the definition held every item in band.
    as_objects = np.empty(len(items), dtype=object)
    as_objects[:] = items
    in_band = pickle.dumps(as_objects, protocol=5)
    assert len(in_band) > 64 << 20


def test_a_mapped_arena_reads_the_file_in_place(tmp_path):
    definition = parse(serialize(Dataset.from_tensor_slices(ITEMS)))
    (buffer,) = definition.buffers  # the data (3 MiB); the offsets are small
    assert buffer.size_bytes == sum(map(len, ITEMS))
    path = tmp_path / "buffer"
    path.write_bytes(buffer.data)
    buffer.path, buffer.data = str(path), b""
    loaded = load(definition)
    base = loaded._value.data
    while isinstance(base, np.ndarray | memoryview):
        base = base.obj if isinstance(base, memoryview) else base.base
    assert isinstance(base, mmap.mmap)
    assert_same_items(elements(loaded), ITEMS)


def test_arena_indexing_and_pickling():
    arena = BytesArena.from_items(ITEMS, bytes)
    assert len(arena) == len(ITEMS)
    assert arena.offsets.dtype == np.int64 and arena.data.dtype == np.uint8
    assert arena.offsets[0] == 0 and arena.offsets[-1] == arena.data.nbytes
    assert [arena[i] for i in range(len(arena))] == ITEMS
    for bad in (-1, len(ITEMS)):
        with pytest.raises(IndexError):
            arena[bad]
    copy = pickle.loads(pickle.dumps(arena, protocol=5))
    assert [copy[i] for i in range(len(copy))] == ITEMS
    assert "8 bytes items" in repr(arena)
    with pytest.raises(TypeError):
        BytesArena(arena.data, arena.offsets, bytearray)
