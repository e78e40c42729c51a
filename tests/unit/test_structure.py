"""Unit tests of dataservice.data.structure: tf.nest-like flatten/pack and TensorSpec."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from dataservice.data.structure import (
    TensorSpec,
    assert_same_structure,
    flatten,
    is_compatible,
    map_structure,
    normalize_element,
    pack_sequence_as,
    spec_of,
)
from dataservice.errors import InvalidArgumentError

Point = collections.namedtuple("Point", ["x", "y"])


def test_flatten_leaf_is_a_one_element_list():
    assert flatten(3) == [3]
    arr = np.arange(3)
    assert flatten(arr)[0] is arr
    assert flatten(None) == [None]
    assert flatten(b"ab") == [b"ab"]


def test_flatten_dict_in_sorted_key_order():
    assert flatten({"b": 1, "a": 2, "c": (3, 4)}) == [2, 1, 3, 4]


def test_flatten_nested_depth_first():
    assert flatten((1, [2, {"z": 3, "y": 4}], Point(5, 6))) == [1, 2, 4, 3, 5, 6]


def test_pack_round_trip_keeps_types_and_key_order():
    structure = {"b": Point(1, [2, 3]), "a": (4,)}
    packed = pack_sequence_as(structure, flatten(structure))
    assert packed == structure
    assert list(packed) == ["b", "a"]  # structure's key order, not sorted
    assert type(packed["b"]) is Point
    assert type(packed["b"].y) is list


def test_pack_ordered_and_default_dicts():
    od = collections.OrderedDict([("b", 1), ("a", 2)])
    packed = pack_sequence_as(od, [20, 10])  # leaves in sorted-key order: a, b
    assert type(packed) is collections.OrderedDict
    assert list(packed.items()) == [("b", 10), ("a", 20)]
    dd = collections.defaultdict(list, {"k": 1})
    packed = pack_sequence_as(dd, [5])
    assert type(packed) is collections.defaultdict and packed.default_factory is list
    assert packed["k"] == 5


def test_pack_wrong_number_of_leaves():
    with pytest.raises(InvalidArgumentError, match="3 values"):
        pack_sequence_as((1, 2), [1, 2, 3])
    with pytest.raises(InvalidArgumentError):
        pack_sequence_as((1, 2), [1])
    with pytest.raises(InvalidArgumentError):
        pack_sequence_as(1, [1, 2])


def test_map_structure_several_structures():
    assert map_structure(lambda a, b: a + b, (1, {"x": 2}), (10, {"x": 20})) == (11, {"x": 22})
    assert map_structure(lambda a: a * 2, 4) == 8
    assert map_structure(str, Point(1, 2)) == Point("1", "2")


def test_map_structure_mismatch_raises():
    with pytest.raises(InvalidArgumentError):
        map_structure(lambda a, b: a, (1, 2), (1, 2, 3))


def test_assert_same_structure_message_shows_both():
    assert_same_structure((1, {"a": 2}), (np.zeros(3), {"a": b"x"}))
    with pytest.raises(InvalidArgumentError) as e:
        assert_same_structure((1, {"a": 2}), (1, {"b": 2}))
    msg = str(e.value)
    assert "(., {'a': .})" in msg and "(., {'b': .})" in msg
    with pytest.raises(InvalidArgumentError, match="type tuple != type list"):
        assert_same_structure((1, 2), [1, 2])
    assert_same_structure((1, 2), [1, 2], check_types=False)
    with pytest.raises(InvalidArgumentError, match="nest"):
        assert_same_structure(1, (1,))
    with pytest.raises(InvalidArgumentError, match="Point"):
        assert_same_structure(Point(1, 2), (1, 2))


def test_spec_of_leaves():
    assert spec_of(np.zeros((2, 3), np.float32)) == TensorSpec((2, 3), np.float32)
    assert spec_of(np.int64(3)) == TensorSpec((), np.int64)
    assert spec_of(b"x") == TensorSpec((), bytes)
    assert spec_of("x") == TensorSpec((), str)
    assert spec_of(np.str_("ab")) == TensorSpec((), np.dtype("<U2"))
    assert spec_of(1.5) == TensorSpec((), np.float64)
    assert spec_of(True) == TensorSpec((), np.bool_)
    assert spec_of(object()) == TensorSpec((), object)


def test_spec_of_nested():
    element = {"image": np.zeros((4, 4, 3), np.uint8), "label": np.int64(1), "id": b"k"}
    assert spec_of(element) == {
        "image": TensorSpec((4, 4, 3), np.uint8),
        "label": TensorSpec((), np.int64),
        "id": TensorSpec((), bytes),
    }
    assert spec_of(Point(np.float32(1), "a")) == Point(
        TensorSpec((), np.float32), TensorSpec((), str)
    )


def test_tensor_spec_normalises_and_validates():
    spec = TensorSpec([None, 3], "float32")
    assert spec.shape == (None, 3) and spec.dtype == np.dtype(np.float32)
    assert TensorSpec((), bytes).dtype is bytes
    assert TensorSpec((), str).dtype is str
    assert hash(TensorSpec((1,), np.int64)) == hash(TensorSpec((1,), "int64"))
    with pytest.raises(ValueError):
        TensorSpec((-1,), np.int64)
    with pytest.raises(ValueError):
        TensorSpec((1.5,), np.int64)
    with pytest.raises(ValueError):
        TensorSpec((), "not-a-dtype")
    assert repr(TensorSpec((None,), bytes)) == "TensorSpec(shape=(None,), dtype=bytes)"
    with pytest.raises(AttributeError):
        spec.shape = ()  # type: ignore[misc]


def test_is_compatible():
    spec = (TensorSpec((None, 3), np.float32), {"s": TensorSpec((), bytes)})
    assert is_compatible(spec, (np.zeros((5, 3), np.float32), {"s": b"x"}))
    assert not is_compatible(spec, (np.zeros((5, 4), np.float32), {"s": b"x"}))
    assert not is_compatible(spec, (np.zeros((5, 3), np.float64), {"s": b"x"}))
    assert not is_compatible(spec, (np.zeros((5, 3, 1), np.float32), {"s": b"x"}))
    assert not is_compatible(spec, [np.zeros((5, 3), np.float32), {"s": b"x"}])
    assert not is_compatible(spec, (np.zeros((5, 3), np.float32), {"t": b"x"}))
    assert not is_compatible(spec, (np.zeros((5, 3), np.float32), {"s": "x"}))
    # Numpy string dtypes match by kind.
    assert is_compatible(TensorSpec((), np.dtype("<U1")), np.str_("abc"))
    assert is_compatible(TensorSpec((), str), np.str_("abc"))
    assert is_compatible(TensorSpec((None,), np.dtype("<U0")), np.array(["a", "bcd"]))
    # Spec against spec.
    assert is_compatible(TensorSpec((None,), np.int64), TensorSpec((4,), np.int64))
    assert not is_compatible(TensorSpec((4,), np.int64), TensorSpec((None,), np.int64))


def test_most_specific_common_supertype():
    a, b = TensorSpec((3, 2), np.int64), TensorSpec((4, 2), np.int64)
    assert a.most_specific_common_supertype(b) == TensorSpec((None, 2), np.int64)
    assert a.most_specific_common_supertype(TensorSpec((3,), np.int64)) is None
    assert a.most_specific_common_supertype(TensorSpec((3, 2), np.float32)) is None


def test_normalize_element():
    out = normalize_element((1, 2.5, True, [3], {"a": b"x", "b": "s"}, np.zeros(2)))
    assert type(out[0]) is np.int64 and type(out[1]) is np.float64
    assert type(out[2]) is np.bool_ and type(out[3][0]) is np.int64
    assert out[4] == {"a": b"x", "b": "s"}
    arr = np.arange(3)
    assert normalize_element(arr) is arr
    assert type(normalize_element(7)) is np.int64
    assert normalize_element(None) is None


def test_normalize_element_copies_plain_nests_and_converts_the_rest():
    arrays = {f"f{i:02d}": np.full(3, i, np.float32) for i in range(40)}
    out = normalize_element(arrays)
    assert out is not arrays and list(out) == list(arrays)  # a new dict, same order
    assert all(out[k] is arrays[k] for k in arrays)  # leaves kept, not copied
    arrays["f00"] = np.zeros(1)  # the copy is the pipeline's own
    assert out["f00"].shape == (3,)
    # One leaf needing a change anywhere: the whole level is rebuilt, that leaf converted.
    mixed = {**{f"f{i}": np.zeros(2) for i in range(5)}, "label": 7}
    out = normalize_element(mixed)
    assert type(out["label"]) is np.int64 and int(out["label"]) == 7
    assert type(mixed["label"]) is int
    leaves = [np.zeros(2), b"x", "s", None]
    listed = normalize_element(leaves)
    assert listed is not leaves and all(a is b for a, b in zip(listed, leaves, strict=True))
    kept = (np.zeros(2), np.ones(2))
    assert normalize_element(kept) is kept  # immutable and unchanged
    assert normalize_element({3: np.zeros(1), 1: np.ones(1)}).keys() == {1, 3}
    with pytest.raises(TypeError, match="sortable"):
        normalize_element({1: np.zeros(1), "a": np.zeros(1)})


@pytest.mark.parametrize("kind", ["dict", "list", "namedtuple"])
def test_normalize_element_too_deep_for_python_is_an_invalid_argument(kind: str) -> None:
    """A nest deeper than the recursion limit gets the element-limit error, not a
    bare RecursionError (3,000 levels; elements hold at most 32)."""
    pair = collections.namedtuple("pair", "a b")
    value: object = 1
    for _ in range(3000):
        value = {"a": value} if kind == "dict" else [value] if kind == "list" else pair(value, 2)
    with pytest.raises(InvalidArgumentError, match="nested at most 32 levels deep"):
        normalize_element(value)
    # A nest within the limit is normalized as before (Python ints become int64).
    shallow: object = 1
    for _ in range(30):
        shallow = [shallow]
    out = normalize_element(shallow)
    for _ in range(30):
        out = out[0]
    assert type(out).__name__ == "int64" and out == 1
