"""`unbatch`, `padded_batch`, `rebatch`, `window`, `bucket_by_sequence_length` in-process:
values (tf.data's documented examples among them), cardinality, element_spec, and the
errors for bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

from dataservice import Dataset, TensorSpec
from dataservice.data import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, DatasetSpec, fingerprint
from dataservice.errors import InvalidArgumentError
from tests.conftest import values

pytestmark = pytest.mark.timeout(30)


def ragged(lengths: list[int]) -> Dataset:
    """Elements `[k] * n` for the k-th length n, with a static spec int64[None]."""
    rows = [np.full(n, k, np.int64) for k, n in enumerate(lengths)]
    return Dataset.from_generator(
        lambda: iter(rows), output_signature=TensorSpec((None,), np.int64)
    )


# ---------------------------------------------------------------------------- unbatch


def test_unbatch_inverts_batch_of_nested_elements():
    ds = Dataset.from_tensor_slices(
        {"a": np.arange(10).reshape(5, 2), "s": ["v", "w", "x", "y", "z"], "b": [b"1"] * 5}
    )
    got = values(ds.batch(2).unbatch())
    assert got == values(ds)
    assert all(type(e["s"]) is str and type(e["b"]) is bytes for e in got)


def test_unbatch_tf_example_of_ragged_batches():
    # tf.data's docs: [[1, 2, 3], [1, 2], [1, 2, 3, 4]] unbatched.
    rows = [np.array(r, np.int64) for r in ([1, 2, 3], [1, 2], [1, 2, 3, 4])]
    ds = Dataset.from_generator(
        lambda: iter(rows), output_signature=TensorSpec((None,), np.int64)
    ).unbatch()
    assert values(ds) == [1, 2, 3, 1, 2, 1, 2, 3, 4]
    assert ds.element_spec == TensorSpec((), np.int64)


def test_unbatch_rows_are_copies_not_views():
    batch = np.arange(6).reshape(2, 3)
    rows = list(Dataset.from_tensors(batch).unbatch())
    assert [r.tolist() for r in rows] == [[0, 1, 2], [3, 4, 5]]
    assert not any(np.shares_memory(r, batch) for r in rows)


def test_unbatch_cardinality_and_spec():
    assert Dataset.range(10).batch(3, drop_remainder=True).unbatch().cardinality() == 9
    assert Dataset.range(10).batch(3).unbatch().cardinality() == UNKNOWN_CARDINALITY
    assert Dataset.range(3).batch(2).repeat().unbatch().cardinality() == INFINITE_CARDINALITY
    spec = Dataset.from_tensor_slices(np.zeros((4, 2, 3), np.float32)).batch(2).unbatch()
    assert spec.element_spec == TensorSpec((2, 3), np.float32)


def test_unbatch_refuses_scalars():
    with pytest.raises(InvalidArgumentError, match="scalar components"):
        Dataset.range(3).unbatch()
    with pytest.raises(InvalidArgumentError, match="component 0 is a scalar"):
        list(Dataset.range(3).map(lambda x: x).unbatch())
    uneven = Dataset.from_tensors((np.arange(2), np.arange(3)))
    with pytest.raises(InvalidArgumentError, match="different sizes in axis 0"):
        list(uneven.unbatch())


# ---------------------------------------------------------------------------- padded_batch


def test_padded_batch_tf_example():
    # tf.data's docs: range(1, 5).map(lambda x: fill([x], x)).padded_batch(2)
    A = Dataset.range(1, 5).map(lambda x: np.full(x, x))
    assert values(A.padded_batch(2)) == [[[1, 0], [2, 2]], [[3, 3, 3, 0], [4, 4, 4, 4]]]
    assert values(A.padded_batch(2, padded_shapes=[5])) == [
        [[1, 0, 0, 0, 0], [2, 2, 0, 0, 0]],
        [[3, 3, 3, 0, 0], [4, 4, 4, 4, 0]],
    ]
    assert values(A.padded_batch(2, padding_values=-1)) == [
        [[1, -1], [2, 2]],
        [[3, 3, 3, -1], [4, 4, 4, 4]],
    ]


def test_padded_batch_nested_shapes_and_values():
    # tf.data's docs: components of different shapes padded separately.
    rows = [(np.array([1, 2, 3]), np.array([10])), (np.array([4, 5]), np.array([11, 12]))]
    ds = Dataset.from_generator(
        lambda: iter(rows),
        output_signature=(TensorSpec((None,), np.int64), TensorSpec((None,), np.int64)),
    )
    got = values(ds.padded_batch(2, padded_shapes=([4], [None]), padding_values=(-1, 100)))
    assert got == [([[1, 2, 3, -1], [4, 5, -1, -1]], [[10, 100], [11, 12]])]
    assert ds.padded_batch(2, padded_shapes=([4], [None]), drop_remainder=True).element_spec == (
        TensorSpec((2, 4), np.int64),
        TensorSpec((2, None), np.int64),
    )


def test_padded_batch_strings_scalars_and_dicts():
    ds = Dataset.from_tensor_slices({"n": np.arange(3)}).map(
        lambda e: {"n": e["n"], "t": np.array(["a", "bb", "ccc"][: int(e["n"]) + 1])}
    )
    got = values(ds.padded_batch(3))
    assert got == [{"n": [0, 1, 2], "t": [["a", "", ""], ["a", "bb", ""], ["a", "bb", "ccc"]]}]


def test_padded_batch_cardinality_and_static_spec_keeps_known_dims():
    ds = Dataset.from_tensor_slices(np.zeros((5, 3), np.int32))
    assert ds.padded_batch(2).cardinality() == 3
    assert ds.padded_batch(2, drop_remainder=True).cardinality() == 2
    assert ds.padded_batch(2).element_spec == TensorSpec((None, 3), np.int32)
    assert ragged([1, 2]).padded_batch(2).element_spec == TensorSpec((None, None), np.int64)
    # Not static (after a map): every dimension is padded, so unknown.
    assert ds.map(lambda x: x).padded_batch(2).element_spec == TensorSpec((None, None), np.int32)


def test_padded_batch_errors_name_the_argument():
    with pytest.raises(InvalidArgumentError, match="batch_size must be greater than zero"):
        Dataset.range(3).padded_batch(0)
    with pytest.raises(InvalidArgumentError, match="padded_shapes: expected a shape"):
        ragged([1]).padded_batch(1, padded_shapes=5)
    with pytest.raises(InvalidArgumentError, match="padded_shapes: component 0 has shape"):
        Dataset.from_tensor_slices(np.zeros((4, 2))).padded_batch(2, padded_shapes=[3, 3])
    with pytest.raises(InvalidArgumentError, match="padding_values: a padding value must be"):
        ragged([1]).padded_batch(1, padding_values=[1, 2])
    with pytest.raises(InvalidArgumentError, match=r"padded_shapes\[1\]|sequence of 2"):
        Dataset.zip(ragged([1]), ragged([1])).padded_batch(1, padded_shapes=([None],))
    with pytest.raises(InvalidArgumentError, match="smaller size than the input element"):
        list(ragged([1, 4]).padded_batch(2, padded_shapes=[3]))
    with pytest.raises(InvalidArgumentError, match="padding_values"):
        list(ragged([1, 2]).padded_batch(2, padding_values="x"))


# ---------------------------------------------------------------------------- rebatch


def test_rebatch_tf_examples():
    assert values(Dataset.range(6).batch(2).rebatch(3)) == [[0, 1, 2], [3, 4, 5]]
    assert values(Dataset.range(7).batch(4).rebatch(3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert values(Dataset.range(7).batch(2).rebatch(3, drop_remainder=True)) == [
        [0, 1, 2],
        [3, 4, 5],
    ]
    assert values(Dataset.range(8).batch(4).rebatch([1, 2])) == [[0], [1, 2], [3], [4, 5], [6], [7]]


def test_rebatch_equals_unbatch_batch_for_nested_elements():
    ds = Dataset.from_tensor_slices({"x": np.arange(22).reshape(11, 2), "y": np.arange(11)})
    for size, drop in [(3, False), (4, True), (11, False), (20, False)]:
        want = values(ds.batch(3).unbatch().batch(size, drop))
        assert values(ds.batch(3).rebatch(size, drop)) == want


def test_rebatch_cardinality_spec_and_errors():
    assert Dataset.range(12).batch(4, drop_remainder=True).rebatch(5).cardinality() == 3
    assert Dataset.range(12).batch(4, True).rebatch(5, True).cardinality() == 2
    assert Dataset.range(12).batch(4).rebatch(5).cardinality() == UNKNOWN_CARDINALITY
    assert Dataset.range(12).batch(4).rebatch(5, True).element_spec == TensorSpec((5,), np.int64)
    assert Dataset.range(12).batch(4).rebatch([2, 3]).element_spec == TensorSpec((None,), np.int64)
    with pytest.raises(InvalidArgumentError, match="batch_size must be greater than zero"):
        Dataset.range(4).batch(2).rebatch(0)
    with pytest.raises(InvalidArgumentError, match="empty list"):
        Dataset.range(4).batch(2).rebatch([])
    with pytest.raises(InvalidArgumentError, match="scalar components"):
        Dataset.range(4).rebatch(2)


# ---------------------------------------------------------------------------- window


def windows(ds: Dataset) -> list[list[int]]:
    return [values(w) for w in ds]


def test_window_tf_examples():
    assert windows(Dataset.range(7).window(3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert windows(Dataset.range(7).window(3, 2, 1, True)) == [[0, 1, 2], [2, 3, 4], [4, 5, 6]]
    assert windows(Dataset.range(7).window(3, 1, 2, True)) == [[0, 2, 4], [1, 3, 5], [2, 4, 6]]
    assert windows(Dataset.range(5).window(2, shift=3)) == [[0, 1], [3, 4]]
    assert windows(Dataset.range(4).window(3, 1)) == [[0, 1, 2], [1, 2, 3], [2, 3], [3]]


def test_window_flat_map_batch_and_tuple_windows():
    flat = Dataset.range(7).window(3, 1, drop_remainder=True).flat_map(lambda w: w.batch(3))
    assert values(flat) == [[0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 6]]
    pairs = Dataset.zip((Dataset.range(5), Dataset.range(5).map(lambda x: x * 10))).window(2)
    got = pairs.flat_map(lambda a, b: Dataset.zip((a, b)).batch(2))
    assert values(got) == [([0, 1], [0, 10]), ([2, 3], [20, 30]), ([4], [40])]


@pytest.mark.parametrize(
    "n,size,shift,stride,drop",
    [
        (7, 3, None, 1, False),
        (7, 3, 2, 1, True),
        (7, 3, 1, 2, True),
        (7, 3, 1, 2, False),
        (10, 4, 3, 2, False),
        (2, 3, 1, 1, True),
        (0, 2, 1, 1, False),
    ],
)
def test_window_cardinality_matches_count(n, size, shift, stride, drop):
    ds = Dataset.range(n).window(size, shift, stride, drop)
    assert ds.cardinality() == len(windows(ds))


def test_window_spec_and_errors():
    strings = Dataset.from_tensor_slices(["x", "y", "z"])
    ds = Dataset.zip({"a": Dataset.range(3), "b": strings})
    assert ds.window(2).element_spec == {
        "a": DatasetSpec(TensorSpec((), np.int64)),
        "b": DatasetSpec(strings.element_spec),
    }
    assert ds.map(lambda e: e).window(2).element_spec == ds.window(2).element_spec
    assert Dataset.range(3).repeat().window(2).cardinality() == INFINITE_CARDINALITY
    for kw, name in [
        ({"size": 0}, "size"),
        ({"size": 2, "shift": 0}, "shift"),
        ({"size": 2, "stride": -1}, "stride"),
    ]:
        with pytest.raises(InvalidArgumentError, match=f"{name} must be greater than zero"):
            Dataset.range(3).window(**kw)


# ---------------------------------------------------------------------------- buckets

TF_ELEMENTS = [[0], [1, 2, 3, 4], [5, 6, 7], [7, 8, 9, 10, 11], [13, 14, 15, 16, 19, 20], [21, 22]]


def tf_elements() -> Dataset:
    rows = [np.array(e, np.int64) for e in TF_ELEMENTS]
    return Dataset.from_generator(
        lambda: iter(rows), output_signature=TensorSpec((None,), np.int64)
    )


def test_bucket_by_sequence_length_tf_examples():
    ds = tf_elements().bucket_by_sequence_length(
        element_length_func=lambda e: e.shape[0],
        bucket_boundaries=[3, 5],
        bucket_batch_sizes=[2, 2, 2],
    )
    assert values(ds) == [
        [[1, 2, 3, 4], [5, 6, 7, 0]],
        [[7, 8, 9, 10, 11, 0], [13, 14, 15, 16, 19, 20]],
        [[0, 0], [21, 22]],
    ]
    ds = tf_elements().bucket_by_sequence_length(
        element_length_func=lambda e: e.shape[0],
        bucket_boundaries=[4, 7],
        bucket_batch_sizes=[2, 2, 2],
        pad_to_bucket_boundary=True,
        padding_values=-1,
    )
    assert values(ds) == [
        [[0, -1, -1], [5, 6, 7]],
        [[1, 2, 3, 4, -1, -1], [7, 8, 9, 10, 11, -1]],
        [[21, 22, -1]],
        [[13, 14, 15, 16, 19, 20]],
    ]


def test_bucket_drop_remainder_no_padding_and_spec():
    ds = tf_elements().bucket_by_sequence_length(len, [3, 5], [2, 2, 2], drop_remainder=True)
    assert [len(b) for b in values(ds)] == [2, 2, 2]
    same = Dataset.range(10).map(lambda x: np.full(x % 2 + 1, x))
    got = values(same.bucket_by_sequence_length(len, [2], [3, 2], no_padding=True))
    assert got == [[[1, 1], [3, 3]], [[0], [2], [4]], [[5, 5], [7, 7]], [[6], [8]], [[9, 9]]]
    assert tf_elements().bucket_by_sequence_length(len, [3], [2, 2]).element_spec == TensorSpec(
        (None, None), np.int64
    )
    assert tf_elements().bucket_by_sequence_length(len, [3], [2, 2]).cardinality() == (
        UNKNOWN_CARDINALITY
    )


def test_bucket_errors_name_the_argument():
    with pytest.raises(InvalidArgumentError, match=r"len\(bucket_batch_sizes\) must equal"):
        tf_elements().bucket_by_sequence_length(len, [3, 5], [2, 2])
    with pytest.raises(InvalidArgumentError, match="bucket_boundaries must be a sorted"):
        tf_elements().bucket_by_sequence_length(len, [5, 3], [2, 2, 2])
    with pytest.raises(InvalidArgumentError, match="bucket_batch_sizes must be greater"):
        tf_elements().bucket_by_sequence_length(len, [3], [2, 0])
    with pytest.raises(TypeError, match="expects a function"):
        tf_elements().bucket_by_sequence_length(3, [3], [2, 2])
    with pytest.raises(InvalidArgumentError, match="must return an int"):
        list(tf_elements().bucket_by_sequence_length(lambda e: "x", [3], [2, 2]))
    with pytest.raises(InvalidArgumentError, match="pad_to_bucket_boundary=True"):
        list(tf_elements().bucket_by_sequence_length(len, [3], [2, 2], pad_to_bucket_boundary=True))


def test_new_ops_fingerprint_deterministically():
    def build() -> Dataset:
        ds = Dataset.range(20).batch(3).padded_batch(2, padded_shapes=[4], padding_values=-1)
        return ds.unbatch().rebatch(4).window(2).flat_map(lambda w: w.batch(2)).cache()

    a, b = build(), build()
    list(a)  # an iterated cache holds elements: they are not part of the definition
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(Dataset.range(3).cache("x")) != fingerprint(Dataset.range(3).cache("y"))
