"""`codec.element_nbytes`: budgets count the bytes elements hold (issue 10,
item 7; CASES K6), and elements that are not numpy values are refused, naming
their path and type, unless the pipeline allows pickled elements."""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np
import pytest

from dataservice import errors
from dataservice.transfer import codec
from dataservice.worker.task_runner import TaskRunner

pytestmark = pytest.mark.timeout(60)

PTR = np.dtype(object).itemsize  # bytes per pointer of an object array


def objects(*items) -> np.ndarray:
    out = np.empty(len(items), object)
    out[:] = list(items)
    return out


@dataclasses.dataclass
class Box:
    x: int


Point = collections.namedtuple("Point", "x y")


def test_numeric_arrays_and_scalars_count_nbytes():
    assert codec.element_nbytes(np.zeros((3, 5), np.float32)) == 60
    assert codec.element_nbytes(np.int16(3)) == 2
    assert codec.element_nbytes(3) == 8 and codec.element_nbytes(None) == 8
    assert codec.element_nbytes(b"abcd") == 4 and codec.element_nbytes("xyz") == 3
    # a view counts what it spans, not its base
    assert codec.element_nbytes(np.zeros(1000, np.uint8)[:10]) == 10


def test_object_array_of_bytes_counts_the_bytes_not_the_pointers():
    arr = objects(b"x" * 1000, b"y" * 10, b"")
    assert arr.nbytes == 3 * PTR
    assert codec.element_nbytes(arr) == 3 * PTR + 1010


def test_object_array_of_str_and_mixed_leaves():
    assert codec.element_nbytes(objects("abc", "de")) == 2 * PTR + 5
    assert codec.element_nbytes(objects(b"ab", "cde", 7, None)) == 4 * PTR + 2 + 3 + 8 + 8


def test_object_array_of_arrays_counts_recursively():
    inner = objects(b"z" * 500, np.zeros(4, np.float64))  # 2 pointers + 500 + 32
    arr = objects(np.zeros(100, np.uint8), inner, np.zeros((2, 3), np.int32))
    assert codec.element_nbytes(arr) == 3 * PTR + 100 + (2 * PTR + 532) + 24


def test_two_dimensional_object_array():
    arr = np.empty((2, 2), object)
    arr[0, 0], arr[0, 1], arr[1, 0], arr[1, 1] = b"a" * 10, "bb", np.ones(3), [b"c" * 7, 1]
    assert codec.element_nbytes(arr) == 4 * PTR + 10 + 2 + 24 + 7 + 8


def test_nested_dicts_lists_tuples_namedtuples():
    element = {
        "image": np.zeros((4, 4, 3), np.uint8),
        "meta": {"names": [b"ab", b"cde"], "ids": (1, 2.5)},
        "point": Point(np.int64(1), objects(b"q" * 9)),
    }
    assert codec.element_nbytes(element) == 48 + 5 + 16 + 8 + (PTR + 9)


def _counting(monkeypatch) -> list[int]:
    calls = [0]
    inner = codec._nbytes

    def counted(*args):
        calls[0] += 1
        return inner(*args)

    monkeypatch.setattr(codec, "_nbytes", counted)
    return calls


def test_long_sequences_of_simple_leaves_are_summed_without_a_walk(monkeypatch):
    calls = _counting(monkeypatch)
    many = [b"x" * 3] * 200_000
    assert codec.element_nbytes({"a": many, "b": objects(*many[:1000])}) == (
        600_000 + 1000 * PTR + 3000
    )
    assert calls[0] == 3  # the dict, the list and the object array: not their items


def test_the_walk_is_bounded_and_estimates_the_rest(monkeypatch):
    monkeypatch.setattr(codec, "MAX_WALK_NODES", 50)
    calls = _counting(monkeypatch)
    small, large = np.zeros(1, np.uint8), np.zeros(100, np.uint8)
    element = [small] * 10 + [large] * 9990  # 999_010 bytes exactly
    got = codec.element_nbytes(element)
    assert calls[0] <= 52  # the list plus at most MAX_WALK_NODES items
    # the first 49 items measured exactly (10 + 39 * 100 = 3910 bytes), the other
    # 9951 at their mean (3910 // 49 = 79 each)
    assert got == 3910 + 79 * 9951
    # the same shape with room to walk is exact
    monkeypatch.setattr(codec, "MAX_WALK_NODES", 100_000)
    assert codec.element_nbytes(element) == 999_010


def test_large_numeric_array_costs_no_walk(monkeypatch):
    calls = _counting(monkeypatch)
    assert codec.element_nbytes(np.zeros(10**6, np.float32)) == 4 * 10**6
    assert calls[0] == 0


@pytest.mark.parametrize(
    "element, path, type_name",
    [
        ({"img": np.zeros(2), "meta": [1, 2, Box(3)]}, "element['meta'][2]", "Box"),
        ((np.zeros(2), {1, 2}), "element[1]", "set"),
        ({"a": objects(b"x", frozenset())}, "element['a'][1]", "frozenset"),
        (Box(1), "element", "Box"),
    ],
)
def test_values_that_are_not_numpy_are_refused_naming_path_and_type(element, path, type_name):
    with pytest.raises(errors.InvalidArgumentError) as info:
        codec.element_nbytes(element, allow_pickled=False)
    text = str(info.value)
    assert text.startswith(f"{path} is a ")
    assert type_name in text.split(",")[0]
    assert "allow_pickled_elements=True" in text


def test_path_of_an_item_of_a_two_dimensional_object_array():
    arr = np.empty((2, 3), object)
    arr[:] = b"ok"
    arr[1, 2] = Box(0)
    with pytest.raises(errors.InvalidArgumentError, match=r"^element\['x'\]\[1, 2\] is a .*Box"):
        codec.element_nbytes({"x": arr}, allow_pickled=False)


def test_path_in_a_transposed_and_a_zero_dimensional_object_array():
    arr = np.empty((2, 3), object)
    arr[:] = b"ok"
    arr[0, 2] = {1}
    with pytest.raises(errors.InvalidArgumentError, match=r"^element\['t'\]\[2, 0\] is a set"):
        codec.element_nbytes({"t": arr.T}, allow_pickled=False)
    scalar = np.empty((), object)
    scalar[()] = {1}
    with pytest.raises(errors.InvalidArgumentError, match=r"^element\[\(\)\] is a set"):
        codec.element_nbytes(scalar, allow_pickled=False)


def test_a_bad_item_past_the_walk_bound_is_still_found(monkeypatch):
    monkeypatch.setattr(codec, "MAX_WALK_NODES", 10)
    element = [np.zeros(1)] * 1000 + [Box(1)]
    with pytest.raises(errors.InvalidArgumentError, match=r"^element\[1000\] is a "):
        codec.element_nbytes(element, allow_pickled=False)


def test_too_deep_a_nest_is_refused():
    element: list = [b"x"]
    for _ in range(40):
        element = [element]
    with pytest.raises(errors.InvalidArgumentError, match="nested more than 32 levels"):
        codec.element_nbytes(element, allow_pickled=False)


@dataclasses.dataclass
class Holder:
    payload: bytes


def test_allowed_pickled_leaves_count_what_they_hold():
    import pickle

    holder = Holder(b"p" * 100_000)
    got = codec.element_nbytes({"h": holder, "x": b"12"})
    assert got == len(pickle.dumps(holder, protocol=5)) + 2
    assert got > 100_000  # not sys.getsizeof(holder), a few dozen bytes


def test_task_buffer_bound_holds_with_object_elements():
    """Each element holds a little over 1 MiB in 16 bytes objects behind 128
    bytes of pointers: a 4 MiB buffer takes 3 of them (the producer holds a
    fourth), not 4096 (the default element bound) as when pointers were counted."""
    pulled = [0]

    def elements():
        while True:
            pulled[0] += 1
            yield {"x": objects(*[bytes(64 << 10)] * 16)}

    runner = TaskRunner(4000, elements, "w:1", buffer_bytes=4 << 20)
    try:
        deadline = time.monotonic() + 10
        while pulled[0] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pulled[0] >= 4
        # The bound holds while nobody reads: watch it for half a second.
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            with runner._cv:
                assert runner._buffered_bytes <= 4 << 20
                assert len(runner._buffer) <= 3
            assert pulled[0] <= 4
            time.sleep(0.01)
        got = runner.get_elements_raw(100, 3 << 20, 1.0).elements
        assert len(got) == 2  # a read's byte bound counts real bytes too
    finally:
        runner.stop()


def test_task_runner_delivers_the_refusal_after_the_good_elements():
    def elements():
        yield {"m": [1, 2]}
        yield {"m": [1, Box(2)]}

    runner = TaskRunner(4001, elements, "w:1")
    try:
        out: list = []
        error = None
        deadline = time.monotonic() + 10
        while error is None and time.monotonic() < deadline:
            read = runner.get_elements_raw(10, 1 << 20, 1.0)
            got, error = read.elements, read.error
            out += got
        assert len(out) == 1
        assert error is not None and error[0] == "InvalidArgumentError"
        assert error[1].startswith("element 1 of task 4001: element['m'][1] is a ")
        assert "Box" in error[1]
    finally:
        runner.stop()


def test_task_runner_may_allow_pickled_elements():
    runner = TaskRunner(4002, lambda: iter([{"s": {1, 2}}]), "w:1", allow_pickled_elements=True)
    try:
        read = runner.get_elements_raw(10, 1 << 20, 5.0)
        got, end, error = read.elements, read.end_of_sequence, read.error
        while not end and not got:
            read = runner.get_elements_raw(10, 1 << 20, 5.0)
            got, end, error = read.elements, read.end_of_sequence, read.error
        assert got == [{"s": {1, 2}}] and error is None
    finally:
        runner.stop()


def test_a_pil_image_is_refused_or_counted_by_its_pixels():
    image_module = pytest.importorskip("PIL.Image")
    image = image_module.new("RGB", (100, 100))
    with pytest.raises(errors.InvalidArgumentError, match=r"^element\['img'\] is a PIL\.Image"):
        codec.element_nbytes({"img": image, "label": 1}, allow_pickled=False)
    assert codec.element_nbytes({"img": image, "label": 1}) >= 100 * 100 * 3 + 8


@pytest.mark.parametrize(
    "element,path,type_name",
    [
        (objects({"a": 1}, {"b": 2}), "element[0]", "dict"),
        ({"x": objects(b"ok", [1, 2])}, "element['x'][1]", "list"),
        ([objects(np.zeros(2), (1, 2))], "element[0][1]", "tuple"),
        (objects(objects(b"ok", {"c": 3})), "element[0][1]", "dict"),
    ],
    ids=["dicts", "list_item", "tuple_item", "nested_array"],
)
def test_containers_inside_an_object_array_need_the_opt_in(element, path, type_name):
    # The array is pickled whole, not walked as a nest of the element's structure.
    with pytest.raises(errors.InvalidArgumentError) as info:
        codec.element_nbytes(element, allow_pickled=False)
    text = str(info.value)
    assert text.startswith(f"{path} is a {type_name} (held by a numpy object array"), text
    assert "allow_pickled_elements=True" in text
    assert codec.element_nbytes(element, allow_pickled=True) > 0


def test_object_arrays_of_values_pass_without_the_opt_in():
    for arr in (
        objects(b"ab", "cde", 7, None),
        objects(np.zeros(3), np.ones(2, np.int8)),
        objects(np.float32(1.5), b"x"),
    ):
        assert codec.element_nbytes(arr, allow_pickled=False) > 0


def test_a_structured_array_with_object_fields_needs_the_opt_in():
    arr = np.zeros(2, dtype=[("a", "O"), ("b", "i4")])
    with pytest.raises(errors.InvalidArgumentError, match="structured array with object fields"):
        codec.element_nbytes(arr, allow_pickled=False)
    assert codec.element_nbytes(arr, allow_pickled=True) > 0
