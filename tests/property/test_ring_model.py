"""Hypothesis model tests of the shared-memory ring: random put/get sequences
against a deque, and codec round trips over random nested structures, dtypes
and shapes (0-d and 0-size included)."""

from __future__ import annotations

import collections
import mmap
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dataservice import _core

pytestmark = pytest.mark.timeout(120)

Pair = collections.namedtuple("Pair", "first second")

DTYPES = st.sampled_from(
    ["?", "i1", "u1", "<i2", "<u2", "<i4", "<u8", "<f2", "<f4", "<f8", "<c8", "S3", "<U2"]
)


def arrays():
    return DTYPES.flatmap(
        lambda dt: hnp.arrays(
            np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
        )
    )


def scalars():
    return arrays().filter(lambda a: a.size > 0).map(lambda a: a.reshape(-1)[0])


leaves = st.one_of(
    arrays(),
    scalars(),
    st.binary(max_size=40),
    st.text(max_size=10),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
)

structures = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=4), inner, max_size=4),
        st.tuples(inner, inner).map(lambda t: Pair(*t)),
    ),
    max_leaves=12,
)


def same(a, b):
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        )
    if isinstance(a, np.generic):
        return type(a) is type(b) and (a == b or (a != a and b != b))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return sorted(a) == sorted(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(structures, min_size=1, max_size=8))
def test_codec_round_trip(elements):
    p = _core.ShmRingProducer(1 << 20)
    c = _core.ShmRingConsumer(p.fileno())
    assert p.put_many(elements, 5000) == len(elements)
    p.put_end(5000)
    out = []
    while True:
        got, _, end, _ = c.get_many(100, 5000)
        out.extend(got)
        if end:
            break
    assert len(out) == len(elements)
    for a, b in zip(elements, out, strict=True):
        assert same(a, b), (a, b)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 40_000), st.integers(1, 4)),
        st.tuples(st.just("get"), st.integers(1, 5), st.just(0)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=50, deadline=None)
@given(ops, st.booleans())
def test_ring_matches_a_deque(ops, zero_copy):
    """What comes out equals what went in, in order; put_many writes what fits
    (never blocks past its timeout); leases held by the test never corrupt data."""
    p = _core.ShmRingProducer(256 << 10)  # 64 KiB max frame: bigger elements chunk
    c = _core.ShmRingConsumer(p.fileno(), zero_copy=zero_copy)
    model: collections.deque = collections.deque()
    held = []
    seq = 0
    header = mmap.mmap(p.fileno(), mmap.PAGESIZE, prot=mmap.PROT_READ)
    last_read = 0
    for op, a, b in ops:
        write_pos = struct.unpack_from("<Q", header, 128)[0]
        read_pos = struct.unpack_from("<Q", header, 256)[0]
        assert last_read <= read_pos <= write_pos <= read_pos + p.capacity_bytes
        last_read = read_pos
        if op == "put":
            batch = []
            for _ in range(b):
                batch.append(np.full(a, seq % 251, dtype=np.uint8))
                seq += 1
            n = p.put_many(batch, 0)
            model.extend(batch[:n])
            seq -= len(batch) - n
        else:
            got, _, end, err = c.get_many(a, 0)
            assert not end and err is None
            assert len(got) <= a
            for g in got:
                want = model.popleft()
                assert np.array_equal(g, want)
            held.extend(got[:1])
    for h in held:
        assert h.size == 0 or (h == h[0]).all()
