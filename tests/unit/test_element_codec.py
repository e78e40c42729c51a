"""One element in one frame (issue 13, many-leaf elements): the gRPC codec
(`codec.encode` / `codec.decode` over `_core.encode_element` / `decode_element`)
round-trips every leaf kind the frame codec carries, structures that change
from element to element, and refuses damaged bytes with a DataLossError; the
shared-memory ring hands an element of many small leaves out as views of one
buffer; the worker's structure check (`_core.ElementCheck`) agrees with
`codec.signature` and `codec.element_nbytes`; `normalize_element` agrees with
`map_structure(_normalize_leaf, ...)`."""

from __future__ import annotations

import collections
import dataclasses
import random

import numpy as np
import pytest

from dataservice import _core, errors
from dataservice.data import structure
from dataservice.transfer import codec
from dataservice.worker.task_runner import _StructureCheck

pytestmark = pytest.mark.timeout(120)

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Box:
    x: int
    tag: str


DTYPES = ["?", "i1", "u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8",
          "<c8", "<c16", "S5", "<U3", "<M8[ns]", "<m8[s]", "V4"]  # fmt: skip


def _array(dtype: str) -> np.ndarray:
    raw = np.random.default_rng(0).integers(0, 100, size=24).astype("<i8")
    if dtype.startswith("S"):
        return np.array([b"ab", b"", b"xyzzy"] * 8, dtype=dtype)
    if dtype.startswith("<U"):
        return np.array(["é", "ab", "xyz"] * 8, dtype=dtype)
    if dtype == "V4":
        return raw.astype("<i4").view("V4")
    return raw.astype(dtype)


def assert_same(a, b, *, native=True):
    """Equal values, types and dtypes (byte-swapped arrays come back native)."""
    if isinstance(a, np.ndarray):
        assert type(b) is np.ndarray
        want = a.dtype.newbyteorder("=") if native and a.dtype.byteorder == ">" else a.dtype
        assert b.dtype == want and b.shape == a.shape, (b.dtype, want, b.shape, a.shape)
        if a.dtype == object:
            assert a.tolist() == b.tolist()
        else:
            assert a.tobytes() == b.astype(a.dtype).tobytes()
        return
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y, native=native)
    elif isinstance(a, dict):
        assert sorted(a, key=repr) == sorted(b, key=repr)
        for k in a:
            assert_same(a[k], b[k], native=native)
    else:
        assert a == b


def grpc_roundtrip(element):
    data = codec.encode(element)
    assert isinstance(data, bytes)
    out = codec.decode(data)
    again = codec.decode(bytearray(data))
    assert_same(element, out)
    assert_same(element, again)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_fixed_size_dtype_round_trips(dtype):
    arr = _array(dtype)
    for element in (
        arr.reshape(2, 3, 4),
        arr[0],  # a numpy scalar
        np.array(arr[3]),  # a 0-d array
        arr[:0],  # zero-size
        arr.reshape(0, 4, 0) if arr.size == 0 else arr[:0].reshape(0, 3),
        arr.reshape(2, 12)[:, ::2],  # not contiguous
        np.asfortranarray(arr.reshape(4, 6)),  # Fortran order
        {"x": arr, "y": [arr[:5], (arr[7], arr.reshape(3, 8).T)]},
    ):
        grpc_roundtrip(element)


def test_non_contiguous_and_fortran_arrays_come_back_c_ordered_with_equal_values():
    a = np.arange(24, dtype=np.int32).reshape(4, 6)
    for view in (np.asfortranarray(a), a[:, ::2], a.T, a[::-1]):
        out = grpc_roundtrip(view)
        assert out.flags.c_contiguous
        np.testing.assert_array_equal(out, view)


def test_big_endian_arrays_come_back_native_as_over_shared_memory():
    a = np.arange(10, dtype=">i4")
    out = codec.decode(codec.encode(a))
    assert out.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(out, a)
    (ring_out,) = ring_roundtrip([a])
    assert ring_out.dtype == out.dtype
    # A big-endian scalar is pickled: it keeps its dtype.
    s = np.array([5], ">i8")[0]
    assert_same(s, codec.decode(codec.encode(s)), native=False)


def test_python_and_string_leaves_and_nests():
    elements = [
        (np.int64(1), b"x", "héllo", 3, 2.5, True, False, None, 1 + 2j),
        {"b": [np.zeros((2, 2), np.float32), {"c": np.uint8(7)}], "a": "s"},
        Point(np.arange(3), Point(1, b"")),
        [],
        (),
        {},
        "",
        b"",
        np.str_("numpy str"),
        np.bytes_(b"numpy bytes"),
        10**40,  # does not fit int64: pickled
        -(2**63),
        float("inf"),
        "lone \udcff surrogate",  # not UTF-8: pickled
        {1: "non-string keys are pickled"},
        collections.OrderedDict(b=1, a=2),  # not a plain dict: pickled, order kept
        collections.defaultdict(list, {"k": [1]}),
        Box(3, "dataclass instances are pickled"),
        np.array([b"a", b"", b"ccc", b"dd"], dtype=object).reshape(2, 2),  # bytes items
        np.array([1, "two", None], dtype=object),  # other items: pickled
        np.ma.masked_array([1, 2], mask=[0, 1]).data,
    ]
    for element in elements:
        grpc_roundtrip(element)
    od = codec.decode(codec.encode(collections.OrderedDict(b=1, a=2)))
    assert list(od) == ["b", "a"]


def test_dict_keys_come_back_sorted_as_over_shared_memory():
    out = codec.decode(codec.encode({"z": 1, "a": 2, "m": {"y": 1, "b": 2}}))
    assert list(out) == ["a", "m", "z"] and list(out["m"]) == ["b", "y"]


def test_deep_nests_and_huge_leaf_counts():
    deep: object = np.int8(1)
    for _ in range(40):  # deeper than the codec walks: the rest is pickled
        deep = [deep]
    grpc_roundtrip(deep)
    many = list(range(70_000))  # more leaves than a frame counts (u16): pickled whole
    assert codec.decode(codec.encode(many)) == many
    (ring_many,) = ring_roundtrip([many])
    assert ring_many == many


def test_an_unpicklable_leaf_raises_the_pickle_error():
    import threading

    with pytest.raises(TypeError, match="lock"):
        codec.encode({"ok": np.zeros(3), "bad": threading.Lock()})


def test_many_small_leaves_decode_to_views_of_one_buffer():
    element = {f"f{i:03d}": np.full(20, i, np.float32) for i in range(100)}
    element["label"] = np.int64(7)
    data = codec.encode(element)
    out = codec.decode(data)
    assert_same(element, out)
    bases = {id(v.base) for k, v in out.items() if k != "label"}
    assert len(bases) == 1  # one copy for all the small arrays, not one per leaf
    assert all(v.flags.writeable for k, v in out.items() if k != "label")
    out["f000"][:] = -1  # a write stays inside its own leaf
    assert (out["f001"] == 1).all() and (out["f000"] == -1).all()
    # From a bytearray: views of the caller's buffer, which cannot be resized under them.
    buf = bytearray(data)
    out = codec.decode(buf)
    assert_same(element, out)
    assert out["f005"].base.obj is buf
    with pytest.raises(BufferError):
        buf.clear()
    out["f005"][0] = 99.0
    assert out["f005"][0] == 99.0


def test_large_leaves_from_bytes_are_writeable_copies():
    a = np.arange(200_000, dtype=np.float32)
    out = codec.decode(codec.encode({"a": a, "b": np.int32(1)}))
    assert out["a"].flags.writeable and out["a"].flags.owndata
    np.testing.assert_array_equal(out["a"], a)


def test_structures_that_change_between_elements():
    rng = random.Random(0)
    keys = [f"k{i}" for i in range(8)]
    elements = []
    for i in range(200):
        ks = rng.sample(keys, rng.randint(0, len(keys)))
        e = {k: np.full(rng.randint(0, 4), i, np.int16) for k in ks}
        if i % 7 == 0:
            e["nested"] = (np.float64(i), [b"x" * (i % 3)])
        if i % 11 == 0:
            e = [e, Point(i, "p")]
        elements.append(e)
    for e in elements:  # the encoder's compiled structures change under it
        grpc_roundtrip(e)
    out = ring_roundtrip(elements)
    for a, b in zip(elements, out, strict=True):
        assert_same(a, b)
    # Same keys, other dtypes or ranks: not mistaken for the compiled structure.
    for e in ({"a": np.zeros(3, np.int16)}, {"a": np.zeros(3, np.int32)},
              {"a": np.zeros((1, 3), np.int32)}, {"a": np.int32(4)}, {"a": 4},
              {"a": 4.0}, {"a": True}, {"a": None}, {"a": "s"}, {"a": b"b"},
              {"b": np.zeros(3, np.int16)}, {"a": np.zeros(3, np.int16), "b": 1},
              {"a": np.zeros(3, np.int16).T[::2]}, {"a": np.zeros(3, ">i2")}):  # fmt: skip
        grpc_roundtrip(e)


def _damages(data: bytes):
    yield b"", "bad magic"
    yield b"DSE1" + data[4:], "bad magic"  # the old pickled format
    yield data[:6], "bad magic"
    yield data[:-64], "declares"
    yield data + bytes(64), "declares"
    long_spec = bytearray(data)
    long_spec[4:8] = (1 << 31).to_bytes(4, "little")
    yield bytes(long_spec), "runs past the end"


def test_damaged_elements_raise_data_loss_naming_the_problem():
    data = codec.encode({"a": np.arange(10), "b": [b"xy", "z"]})
    for bad, what in _damages(data):
        with pytest.raises(errors.DataLossError, match="damaged element") as info:
            codec.decode(bad)
        assert what in str(info.value)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # a damaged dtype may be "a"
def test_random_damage_never_crashes_or_leaks_a_panic():
    element = {
        "a": np.arange(12, dtype=np.int32).reshape(3, 4),
        "b": [b"xy", "z", np.int64(5), 1.5, None],
        "c": Point(np.float32(1), np.array([b"q", b"rr"], dtype=object)),
    }
    data = codec.encode(element)
    rng = random.Random(1)
    outcomes = collections.Counter()
    for _ in range(3000):
        bad = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        try:
            codec.decode(bytes(bad))
            outcomes["decoded"] += 1  # a flipped payload byte is still an element
        except errors.DataLossError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and outcomes["decoded"] > 100


def test_not_a_buffer_is_a_type_error():
    with pytest.raises(TypeError):
        _core.decode_element(12)


# ---------------------------------------------------------------- shared memory


def ring_roundtrip(elements, capacity=4 << 20):
    p = _core.ShmRingProducer(capacity)
    c = _core.ShmRingConsumer(p.fileno(), nonce=p.nonce)
    try:
        assert p.put_many(elements, 5000) == len(elements)
        p.put_end(5000)
        out = []
        while True:
            got, _, end, err = c.get_many(1024, 5000)
            assert err is None
            out.extend(got)
            if end:
                return out
    finally:
        p.close()
        c.close()


def test_ring_small_element_of_many_leaves_shares_one_private_buffer():
    element = {f"f{i:02d}": np.full(10, i, np.int32) for i in range(50)}
    (out,) = ring_roundtrip([element])
    assert_same(element, out)
    bases = {id(v.base) for v in out.values()}
    assert len(bases) == 1
    base = out["f00"].base
    assert isinstance(base, _core.RingLease) and len(base) >= 50 * 40
    assert all(v.flags.writeable and v.ctypes.data % 16 == 0 for v in out.values())


def test_ring_large_element_of_many_leaves_is_one_lease_of_the_frame():
    element = {f"f{i:03d}": np.full(400, i, np.float32) for i in range(100)}  # 160 KB
    p = _core.ShmRingProducer(4 << 20)
    c = _core.ShmRingConsumer(p.fileno(), nonce=p.nonce)
    try:
        p.put_many([element, element], 5000)
        got, _, _, _ = c.get_many(10, 5000)
        assert len(got) == 2
        for out in got:
            assert_same(element, out)
            assert len({id(v.base) for v in out.values()}) == 1
        assert c.stats()["leased"] == 200
        assert got[0]["f000"].base is not got[1]["f000"].base
    finally:
        p.close()
        c.close()


# ---------------------------------------------------------------- worker checks


def test_element_check_agrees_with_signature_and_element_nbytes():
    base = {
        "img": np.zeros((4, 5), np.uint8),
        "vec": [np.float32(1), np.arange(3)],
        "meta": Point(b"abc", "dé"),
        "n": 3,
        "f": 1.5,
        "ok": True,
        "none": None,
        "t": (np.int16(2),),
    }
    check = _core.ElementCheck()
    assert check.nbytes_if_same(base) is None  # nothing learnt yet
    assert check.learn(base)
    assert check.nbytes_if_same(base) == codec.element_nbytes(base)
    same = {**base, "img": np.ones((9, 1), np.uint8), "meta": Point(b"", "xyzw")}
    assert codec.signature(same) == codec.signature(base)
    assert check.nbytes_if_same(same) == codec.element_nbytes(same)
    others = [
        {**base, "img": np.zeros((4, 5), np.int8)},
        {**base, "img": np.zeros(20, np.uint8)},
        {**base, "n": 3.0},
        {**base, "ok": 1},
        {**base, "none": 0},
        {**base, "t": [np.int16(2)]},
        {**base, "meta": (b"abc", "dé")},
        {**base, "extra": 1},
        {k: v for k, v in base.items() if k != "f"},
        {**{k: v for k, v in base.items() if k != "f"}, "g": 1.5},
        {**base, "vec": [np.float64(1), np.arange(3)]},
        [base],
    ]
    for other in others:
        assert check.nbytes_if_same(other) is None, other
    for unplain in (
        {"x": np.array([b"a"], dtype=object)},
        {"x": np.str_("s")},
        {"x": collections.OrderedDict()},
        {1: np.zeros(1)},
        {"x": Box(1, "b")},
        {"x": np.ma.masked_array([1])},
    ):
        assert not check.learn(unplain)
        assert check.nbytes_if_same(unplain) is None


def _fresh(key: str) -> str:
    """A str equal to `key` that is another object (as keys built per element are)."""
    return "".join(list(key))


def _keyed(keys: list[str]) -> dict[str, np.ndarray]:
    """A dict inserted in the order of `keys`, each value telling its key apart."""
    return {k: np.full(3, sum(map(ord, k)), np.int32 if k != "beta" else np.int64) for k in keys}


# Dicts of one stream: the encoder and the structure check read a dict of a structure
# they know in one pass over its entries while it lists the same keys in the same order;
# another order (learnt first, or met midway), equal keys that are other objects, or
# another key must never put a value under another key.
_KEY_ORDERS = [
    ["alpha", "beta", "gamma"],
    ["alpha", "beta", "gamma"],
    ["alpha", "gamma", "beta"],  # differs at the second entry, after one leaf
    ["gamma", "beta", "alpha"],
    [_fresh("alpha"), _fresh("beta"), _fresh("gamma")],
    ["alpha", "beta", "delta"],
    ["alpha", "beta", "gamma"],
]


@pytest.mark.parametrize("first", [0, 3], ids=["learnt-in-order", "learnt-out-of-order"])
@pytest.mark.parametrize("path", ["ring", "encode_element"])
def test_dicts_keep_each_value_under_its_key_whatever_their_key_order(path, first):
    orders = _KEY_ORDERS[first:] + _KEY_ORDERS[:first]
    elements = [_keyed(order) for order in orders for _ in range(2)]
    if path == "ring":
        p = _core.ShmRingProducer(1 << 20)
        c = _core.ShmRingConsumer(p.fileno(), nonce=p.nonce)
        assert p.put_many(elements, 5000) == len(elements)
        out: list = []
        while len(out) < len(elements):
            got, _, _, err = c.get_many(64, 5000)
            assert err is None
            out.extend(got)
    else:
        out = [_core.decode_element(_core.encode_element(e)) for e in elements]
    for sent, got in zip(elements, out, strict=True):
        assert list(got) == sorted(sent)
        for key, value in sent.items():
            assert got[key].dtype == value.dtype
            assert got[key].tolist() == value.tolist(), key


def test_element_check_reads_a_dict_in_any_key_order_and_refuses_swapped_values():
    learnt = {"b": np.zeros(4, np.float32), "a": np.zeros(2, np.int64)}
    check = _core.ElementCheck()
    assert check.learn(learnt)
    assert check.nbytes_if_same(dict(learnt)) == 32
    assert check.nbytes_if_same({"a": np.zeros(5, np.int64), "b": learnt["b"]}) == 56
    assert check.nbytes_if_same({_fresh("b"): learnt["b"], _fresh("a"): learnt["a"]}) == 32
    # The same keys with each other's values (a float32 array under "a"): not the structure.
    assert check.nbytes_if_same({"b": np.zeros(2, np.int64), "a": np.zeros(4, np.float32)}) is None
    assert check.nbytes_if_same({"a": np.zeros(4, np.float32), "b": np.zeros(2, np.int64)}) is None
    assert check.nbytes_if_same({"b": learnt["b"], "c": learnt["a"]}) is None


def test_structure_check_still_refuses_a_changed_structure():
    check = _StructureCheck(task_id=4001)
    e = {f"f{i}": np.zeros(3, np.float32) for i in range(100)}
    assert check(e) == 1200
    assert check({**e, "f0": np.zeros(7, np.float32)}) == 1216  # shapes may change
    with pytest.raises(errors.InvalidArgumentError, match="has structure"):
        check({**e, "f0": np.zeros(3, np.float64)})
    with pytest.raises(errors.InvalidArgumentError, match="has structure"):
        check({**e, "extra": np.zeros(3, np.float32)})
    wider = {**e, "f0": np.zeros(3, np.dtype(np.float32).newbyteorder("<"))}
    assert check(wider) == 1200  # an equal dtype that is another object: Python decides


# ---------------------------------------------------------------- normalize_element


def test_normalize_element_matches_map_structure():
    cases = [
        {"a": 1, "b": [2.5, True, None, (3, np.int8(1))], "c": {"d": 1 + 2j}},
        {f"k{i}": np.zeros(2) for i in range(50)},
        [np.zeros(1), "s", b"b"],
        (np.float32(1), np.int64(2)),
        Point(1, [2.0]),
        collections.OrderedDict(z=1, a=np.zeros(1)),
        {"z": 1, "a": 2},
        10**30,
        (),
        [],
        {},
    ]
    for case in cases:
        got = structure.normalize_element(case)
        want = structure.map_structure(structure._normalize_leaf, case)
        assert repr(got) == repr(want)
        assert type(got) is type(want)
    d = {"z": np.zeros(1), "a": np.zeros(1)}
    out = structure.normalize_element(d)
    assert out == d.__class__(out) and out is not d and list(out) == ["z", "a"]
    with pytest.raises(TypeError, match="sortable"):
        structure.normalize_element({1: np.zeros(1), "a": np.zeros(1)})


def test_encoding_writes_every_byte_whatever_memory_it_gets():
    """`encode_element` fills a `bytes` object that is not zeroed first (rust/py/element.rs
    `new_bytes_filled`): the gaps between leaves (alignment) must be written too, or an
    encoding would carry whatever memory malloc handed out, and differ from call to call."""
    element = {
        "a": np.arange(3, dtype=np.int8),  # 3 bytes: the next leaf is aligned past a gap
        "b": np.arange(5, dtype=np.float64),
        "c": [np.int16(7), b"xyz", "text", 1.5],
        "d": np.ones((3, 5), np.uint16),
    }
    clean = codec.encode(element)
    for size in (len(clean), 4 << 10, 1 << 20):
        for _ in range(20):
            dirty = b"\xa5" * size  # freed just before: malloc may hand these bytes out again
            del dirty
            assert codec.encode(element) == clean
    decoded = codec.decode(clean)
    assert np.array_equal(decoded["b"], element["b"]) and decoded["c"][1] == b"xyz"


def _large_elements() -> list:
    rng = np.random.default_rng(3)
    return [
        rng.integers(0, 255, 1 << 20, dtype=np.uint8),
        {
            "a": np.arange(3, dtype=np.int8),  # a gap before the next (aligned) leaf
            "image": rng.standard_normal((600, 601)).astype(np.float32)[:, ::2],  # strided
            "label": np.int64(7),
            "names": [b"x" * 70_000, "y"],
        },
        (rng.integers(0, 9, (512, 512), dtype=np.int16), np.float16(1.5)),
    ]


@pytest.mark.parametrize("index", range(3))
def test_encode_later_pieces_are_the_bytes_of_encode(index):
    """`codec.encode_later` (rust/py/element.rs `Encoding`) copies nothing until a piece
    is asked for; any split of it into pieces joins to exactly `encode`'s bytes."""
    element = _large_elements()[index]
    want = codec.encode(element)
    encoding = codec.encode_later(element)
    assert isinstance(encoding, codec.Encoding) and len(encoding) == len(want)
    assert encoding.element is element
    assert bytes(encoding) == want and codec.as_bytes(encoding) == want
    for piece_bytes in (1, 7, 4096, 100_003, 1 << 20, len(want)):
        if piece_bytes == 1 and len(want) > 200_000:
            piece_bytes = 64  # the same split points, fewer calls
        pieces = [
            encoding.piece(start, min(start + piece_bytes, len(want)))
            for start in range(0, len(want), piece_bytes)
        ]
        assert all(type(p) is bytes for p in pieces)
        assert b"".join(pieces) == want, piece_bytes
    assert encoding.piece(5, 5) == b""
    decoded = codec.decode(bytearray(bytes(encoding)))
    if isinstance(element, np.ndarray):
        np.testing.assert_array_equal(decoded, element)


def test_encode_later_keeps_small_elements_as_bytes():
    """Below `LATER_BYTES` (and for scalars, bytes, strings) there is nothing to gain:
    `encode_later` returns `encode`'s bytes themselves."""
    small = [
        np.arange(10, dtype=np.float64),
        np.int64(3),
        b"abc",
        "text",
        {"x": np.zeros(100, np.uint8), "y": [1, 2]},
        np.zeros(codec.LATER_BYTES - 64, np.uint8),
    ]
    for element in small:
        got = codec.encode_later(element)
        assert type(got) is bytes and got == codec.encode(element)
    big_bytes = b"z" * (2 * codec.LATER_BYTES)  # a bytes leaf alone: one copy either way
    assert type(codec.encode_later(big_bytes)) is bytes


def test_encoding_pieces_out_of_range_raise_index_error():
    encoding = codec.encode_later(np.zeros(1 << 20, np.uint8))
    n = len(encoding)
    for start, end in ((0, n + 1), (10, 5), (n + 1, n + 2)):
        with pytest.raises(IndexError, match=f"of an encoding of {n} bytes"):
            encoding.piece(start, end)


def test_encoding_pins_its_arrays():
    """An `Encoding` holds its element's buffers: the arrays stay alive (and a
    bytearray cannot be resized) while pieces are still to be made."""
    buf = bytearray(b"\x01" * (1 << 20))
    element = {"a": np.frombuffer(buf, np.uint8), "b": buf}
    encoding = codec.encode_later(element)
    want = bytes(encoding)
    del element
    with pytest.raises(BufferError):
        buf.extend(b"x")
    assert bytes(encoding) == want
    del encoding
    buf.extend(b"x")  # released with the encoding


def test_bytearray_to_fill_is_a_bytearray_of_the_size():
    """`_core.bytearray_to_fill` (the gRPC client's buffer for an element that comes in
    pieces) skips the zeroing `bytearray(n)` does; its bytes are the caller's to write."""
    for n in (0, 1, 4096, 9_600_000):
        b = _core.bytearray_to_fill(n)
        assert type(b) is bytearray and len(b) == n
        b[:] = b"\x07" * n
        assert b.count(7) == n


def test_join_copies_bytes_and_encodings_back_to_back():
    """`codec.join` (`_core.join_encoded`): the worker's message of several small
    elements, each encoded straight into it."""
    rng = np.random.default_rng(4)
    elements = [
        rng.integers(0, 255, 5000, dtype=np.uint8),
        np.int64(3),
        {"a": rng.standard_normal(2000), "b": b"q" * 10},
        b"",
        rng.integers(0, 255, 300_000, dtype=np.uint8),  # past the GIL-free copy size
    ]
    encoded = [codec.encode_later(e) for e in elements]
    assert {type(e) for e in encoded} == {bytes, codec.Encoding}
    joined = codec.join(encoded)
    assert joined == b"".join(codec.encode(e) for e in elements)
    assert codec.join([]) == b""
    with pytest.raises(TypeError, match="not bytearray"):
        codec.join([bytearray(b"x")])


def test_small_leaves_share_one_buffer_whose_gaps_are_zeros():
    # Leaves under 64 KiB are copied into one buffer, each at a 16-byte boundary; the
    # buffer (the views' base, which exports all of it) holds nothing but them and zeros.
    for _ in range(20):  # reuse freed blocks: a gap left unwritten would show old bytes
        junk = _core.decode_element(_core.encode_element({"j": np.full(40, 0xEE, np.uint8)}))
        del junk
        element = {
            "a": np.arange(3, dtype=np.uint8) + 1,
            "b": np.arange(5, dtype=np.uint8) + 10,
            "c": np.ones(7, np.uint8),
        }
        out = _core.decode_element(_core.encode_element(element))
        assert out["a"].base is out["c"].base
        expected = bytes([1, 2, 3]) + bytes(13) + bytes(range(10, 15)) + bytes(11) + bytes([1] * 7)
        assert bytes(memoryview(out["a"].base)) == expected
