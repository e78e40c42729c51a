"""The shared-memory ring of `dataservice._core` in one process: codec round
trips, zero-copy leases, copy on pressure, detach, chunked elements, errors,
timeouts, corruption and peer death (TRANSPORT.md)."""

from __future__ import annotations

import collections
import mmap
import os
import socket
import threading
import time

import numpy as np
import pytest

from dataservice import _core, errors

pytestmark = pytest.mark.timeout(60)

Point = collections.namedtuple("Point", "x y")


def pair(capacity=1 << 20, **kw):
    p = _core.ShmRingProducer(capacity)
    c = _core.ShmRingConsumer(p.fileno(), nonce=p.nonce, **kw)
    return p, c


def roundtrip(elements, capacity=4 << 20, **kw):
    p, c = pair(capacity, **kw)
    assert p.put_many(elements, 5000) == len(elements)
    p.put_end(5000)
    out = []
    while True:
        got, _, end, err = c.get_many(1024, 5000)
        assert err is None
        out.extend(got)
        if end:
            return out


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.dtype == object:
            assert a.tolist() == b.tolist()
        else:
            np.testing.assert_array_equal(a, b)
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and (a == b or (a != a and b != b))
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


DTYPES = ["?", "i1", "u1", "<i2", "<u4", "<i8", "<f2", "<f4", "<f8", "<c8", "<c16",
          "S5", "<U3", "<M8[ns]", "<m8[s]"]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_arrays_and_scalars_of_every_fixed_size_dtype(dtype):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 100, size=24).astype("<i8")
    if dtype.startswith("S"):
        arr = np.array([b"ab", b"", b"xyzzy"] * 8, dtype=dtype)
    elif dtype.startswith("<U"):
        arr = np.array(["é", "ab", "xyz"] * 8, dtype=dtype)
    else:
        arr = raw.astype(dtype)
    elements = [
        arr.reshape(2, 3, 4),
        arr[0],
        arr.reshape(2, 12)[:, ::2],
        arr[:0],
        arr.reshape(24)[5],
    ]
    elements.append(np.array(arr[3]))  # 0-d array, not a scalar
    out = roundtrip(elements)
    assert len(out) == len(elements)
    for a, b in zip(elements, out, strict=True):
        assert_same(a, b)


def test_big_endian_arrays_come_back_native():
    a = np.arange(10, dtype=">i4")
    (b,) = roundtrip([a])
    assert b.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(a, b)


def test_nested_structures_and_python_leaves():
    elements = [
        (np.int64(1), b"x", "héllo", 3, 2.5, True, None),
        {"b": [np.zeros((2, 2), np.float32), {"c": np.uint8(7)}], "a": "s"},
        Point(np.arange(3), Point(1, b"")),
        [],
        (),
        {},
        np.array([b"a", b"", b"ccc", b"dd"], dtype=object).reshape(2, 2),
        10**40,  # does not fit int64: pickled
        {1: "non-string keys are pickled"},
        collections.OrderedDict(a=1),  # not a plain dict: pickled
    ]
    out = roundtrip(elements)
    for a, b in zip(elements, out, strict=True):
        assert_same(a, b)


def test_dict_keys_come_back_sorted_like_tf_nest():
    (d,) = roundtrip([{"z": 1, "a": 2}])
    assert list(d) == ["a", "z"]


def test_structure_change_mid_stream_sends_a_new_spec():
    elements = [np.int64(1), (np.int64(2), b"x"), np.int64(3), {"k": np.float32(4)}]
    out = roundtrip(elements)
    for a, b in zip(elements, out, strict=True):
        assert_same(a, b)


def test_many_scalars_in_one_call():
    xs = [np.int64(i) for i in range(10_000)]
    out = roundtrip(xs)
    assert [int(x) for x in out] == list(range(10_000))
    assert all(type(x) is np.int64 for x in out)


def test_large_leaves_are_writeable_page_aligned_views():
    p, c = pair(1 << 20)
    a = np.arange(100_000, dtype=np.uint16)
    p.put_many([(a, np.arange(10))], 1000)
    (got,), _, _, _ = c.get_many(10, 1000)
    big, small = got
    np.testing.assert_array_equal(big, a)
    np.testing.assert_array_equal(small, np.arange(10))
    assert big.flags.writeable and small.flags.writeable
    assert big.ctypes.data % 4096 == 0
    # The element's array bytes pass the threshold: its small leaf is a view of the
    # frame too (one lease for the element, no copy per leaf).
    assert c.stats()["leased"] == 2
    assert isinstance(small.base, _core.RingLease) and small.base is big.base
    big[0] = 7  # a consumer may write into its own frame
    assert big[0] == 7


def test_zero_copy_off_copies_everything():
    p, c = pair(1 << 20, zero_copy=False)
    p.put_many([np.arange(100_000, dtype=np.uint16)], 1000)
    (got,), _, _, _ = c.get_many(10, 1000)
    assert c.stats()["leased"] == 0 and got.flags.writeable and got.flags.owndata


def test_views_stay_valid_while_the_ring_is_reused_many_times():
    """Holding more than the ring: copy on pressure, then detach, never a hang."""
    p, c = pair(1 << 20)  # 1 MiB ring, 256 KiB max frame
    held = []
    stop = threading.Event()

    def produce():
        for i in range(60):
            p.put_many([np.full(100_000, i, dtype=np.uint16)], 10_000)
        p.put_end(10_000)
        stop.set()

    t = threading.Thread(target=produce)
    t.start()
    while True:
        got, _, end, _ = c.get_many(4, 10_000)
        held.extend(got)  # keep everything, as list(ds) does
        if end:
            break
    t.join(5)
    assert len(held) == 60
    for i, a in enumerate(held):
        assert a[0] == i and a[-1] == i
    stats = c.stats()
    assert stats["detaches"] >= 1 or stats["leased"] < 60


def test_elements_bigger_than_the_ring_travel_in_chunks():
    p, c = pair(1 << 20)  # max frame 256 KiB
    big = np.random.default_rng(1).integers(0, 255, size=3_000_001, dtype=np.uint8)
    result = {}

    def consume():
        out = []
        while True:
            got, _, end, _ = c.get_many(4, 10_000)
            out.extend(got)
            if end:
                result["out"] = out
                return

    t = threading.Thread(target=consume)
    t.start()
    p.put_many([(big, b"tail"), np.int64(5)], 10_000)
    p.put_end(10_000)
    t.join(20)
    (b, tail), five = result["out"]
    np.testing.assert_array_equal(b, big)
    assert tail == b"tail" and five == 5


def test_a_ring_allocates_its_memory_as_its_first_lap_reaches_it():
    """Making a 64 MiB ring allocates 1 MiB of it (the kernel zeroes what it
    allocates, ~1 ms per MiB: 8 workers' rings and spare rings took a second of a
    consumer's first element); frames then allocate in doubling steps, and every
    element arrives intact across them."""
    p = _core.ShmRingProducer(64 << 20)
    c = _core.ShmRingConsumer(p.fileno(), nonce=p.nonce, zero_copy=False)

    def allocated():
        return os.fstat(p.fileno()).st_blocks * 512 - mmap.PAGESIZE

    assert p.reserved_bytes == 1 << 20
    assert allocated() == 1 << 20
    elements = [np.full(250_000, i, np.uint8) for i in range(12)]  # 3 MB
    assert p.put_many(elements, 5000) == 12
    assert p.reserved_bytes == 4 << 20
    assert allocated() == 4 << 20
    got, _, _, err = c.get_many(100, 5000)
    assert err is None
    assert [int(g[0]) for g in got] == list(range(12))
    assert all((g == i).all() for i, g in enumerate(got))


def test_element_above_max_element_bytes_names_both_sizes():
    p = _core.ShmRingProducer(1 << 20, max_element_bytes=1 << 20)
    with pytest.raises(
        errors.ElementTooLargeError, match=r"of \d+ bytes exceeds the limit of 1048576"
    ):
        p.put_many([np.zeros(2 << 20, np.uint8)], 1000)


def test_error_frame_after_the_elements_before_it():
    p, c = pair()
    p.put_many([np.int64(1), np.int64(2)], 1000)
    p.put_error("ValueError", "boom", 1000)
    got, _, end, err = c.get_many(10, 1000)
    assert [int(x) for x in got] == [1, 2] and not end and err is None
    got, _, end, err = c.get_many(10, 1000)
    assert got == [] and end and err == ("ValueError", "boom")


def test_get_many_times_out_empty_and_put_many_times_out_partial():
    p, c = pair(64 << 10)  # max frame 16 KiB
    t = time.monotonic()
    got, _, end, err = c.get_many(10, 100)
    assert got == [] and not end and err is None
    assert 0.08 <= time.monotonic() - t < 2
    n = p.put_many([np.zeros(10_000, np.uint8)] * 20, 100)
    assert 0 < n < 20


def test_peer_death_drains_then_raises_unavailable():
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    p = _core.ShmRingProducer(1 << 20)
    c = _core.ShmRingConsumer(p.fileno(), control_fd=here.fileno())
    p.put_many([np.int64(i) for i in range(5)], 1000)
    there.close()  # the producer side goes away
    got, _, _, _ = c.get_many(100, 1000)
    assert [int(x) for x in got] == list(range(5))
    t = time.monotonic()
    with pytest.raises(errors.UnavailableError, match="closed its control socket"):
        c.get_many(100, 5000)
    assert time.monotonic() - t < 1.0


def test_producer_notices_a_dead_consumer_within_a_second():
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    p = _core.ShmRingProducer(64 << 10)
    p.set_peer(here.fileno(), None)
    _c = _core.ShmRingConsumer(p.fileno())
    there.close()
    t = time.monotonic()
    with pytest.raises(errors.UnavailableError):
        p.put_many([np.zeros(10_000, np.uint8)] * 100, 10_000)
    assert time.monotonic() - t < 1.0


def test_wrong_nonce_and_non_ring_fds_are_refused():
    p = _core.ShmRingProducer(1 << 20)
    with pytest.raises(errors.FailedPreconditionError, match="nonce"):
        _core.ShmRingConsumer(p.fileno(), nonce=b"x" * 16)
    fd = os.memfd_create("not-a-ring")
    try:
        os.ftruncate(fd, 1 << 20)
        with pytest.raises(errors.FailedPreconditionError):
            _core.ShmRingConsumer(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("capacity", [0, 1000, 3 << 20, 8 << 30])
def test_bad_ring_sizes(capacity):
    with pytest.raises(ValueError, match="power of two"):
        _core.ShmRingProducer(capacity)


def _poke(p, offset, data, write_pos):
    """Writes raw bytes into the data area and publishes `write_pos`."""
    page = mmap.PAGESIZE
    m = mmap.mmap(p.fileno(), page + p.capacity_bytes)
    try:
        m[page + offset : page + offset + len(data)] = data
        m[128:136] = write_pos.to_bytes(8, "little")
    finally:
        m.close()


@pytest.mark.parametrize("seed", range(30))
def test_random_bytes_in_the_ring_are_ring_corrupted(seed):
    rng = np.random.default_rng(seed)
    p, c = pair(64 << 10)
    if seed % 3 == 0:
        # A valid stream first, then garbage after it.
        p.put_many([np.int64(1), np.arange(100)], 1000)
        c.get_many(10, 1000)
    data = rng.integers(0, 256, size=int(rng.integers(64, 4096)), dtype=np.uint8).tobytes()
    if seed % 2:
        # Keep the frame magic so the parser goes deeper.
        data = bytes([rng.integers(1, 7), 0xD5, 0, 0]) + data[4:]
    stats_pos = 0 if seed % 3 else 64 * 10
    _ = stats_pos
    import struct

    m = mmap.mmap(p.fileno(), mmap.PAGESIZE)
    write_pos = struct.unpack_from("<Q", m, 128)[0]
    m.close()
    _poke(p, write_pos % p.capacity_bytes, data, write_pos + len(data))
    with pytest.raises(errors.DataLossError, match="ring corrupted"):
        for _ in range(3):
            c.get_many(10, 50)


def test_forked_child_cannot_use_a_ring_end():
    p, c = pair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        try:
            c.get_many(1, 10)
        except RuntimeError as err:
            os._exit(0 if "forked child" in str(err) else 1)
        os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_one_thread_per_ring_end():
    p, c = pair()
    errs = []

    def reader():
        try:
            c.get_many(1, 500)
        except RuntimeError as err:
            errs.append(err)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errs) == 1 and "in use" in str(errs[0])


def _positions(p):
    import struct

    m = mmap.mmap(p.fileno(), mmap.PAGESIZE, prot=mmap.PROT_READ)
    try:
        return struct.unpack_from("<Q", m, 128)[0], struct.unpack_from("<Q", m, 256)[0]
    finally:
        m.close()


def test_read_pos_never_moves_back_over_a_pad():
    """Regression: a copied frame, then a PAD, then a leased frame, read in one
    get_many, used to store read_pos at the PAD's end and then back at the
    copied frame's end; a producer that had trusted the first value then
    overran the ring."""
    p, c = pair(1 << 20)
    small = np.zeros(1000, np.uint8)
    while True:  # fill up to ~40 KB before the end, draining as we go
        write, _ = _positions(p)
        if (1 << 20) - (write % (1 << 20)) < 40_000:
            break
        p.put_many([small], 1000)
        c.get_many(100, 1000)
    write, read = _positions(p)
    assert read == write
    p.put_many([small, np.ones(100_000, np.uint8)], 1000)  # the big one needs a PAD
    got, _, _, _ = c.get_many(10, 1000)
    assert len(got) == 2 and c.stats()["leased"] == 1
    _, read_after = _positions(p)
    assert read_after % (1 << 20) == 0  # freed through the PAD, up to the leased frame
    del got
    _, read_final = _positions(p)
    assert read_final >= read_after
