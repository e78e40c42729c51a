"""The gRPC read (GetElementsFrames: heads and raw element bytes, transfer/grpc.py
and worker/serving.py): elements of every kind arrive equal, also in pieces past
the message limit; compression off, on and AUTO (decided by measuring the link and
the data); the pipelined next request; a read cancelled mid-element leaves
nothing behind; the token and the request's field rules still apply; a worker
without GetElementsFrames is read with GetElementsStream."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

import dataservice as ds
from dataservice import errors
from dataservice.rpc import service_pb2 as pb
from dataservice.transfer import base, codec
from dataservice.transfer import grpc as grpc_transfer
from dataservice.worker import serving, unacked_replies
from dataservice.worker.server import WorkerServer
from tests.conftest import FAST, InProcessCluster
from tests.ft.tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(120)

OFF = ds.ShardingPolicy.OFF
TOKEN = "frames-token"


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def read(dataset: ds.Dataset, cluster: InProcessCluster, **kw: Any) -> tuple[list[Any], dict]:
    it = iter(
        dataset.apply(ds.distribute(OFF, cluster.target, data_transfer_protocol="grpc", **kw))
    )
    got = list(it)
    return got, it.stats()


def _elements() -> list[Any]:
    """Elements of many kinds: every numeric dtype, zero-size and 0-d arrays,
    non-contiguous views (strided, transposed, Fortran order), strings and bytes
    (numpy and Python), object arrays of bytes, nests."""
    rng = np.random.default_rng(7)
    base_ = rng.integers(0, 250, size=(6, 10, 4)).astype(np.float64)
    out: list[Any] = []
    for dtype in (
        np.bool_,
        np.int8,
        np.uint8,
        np.int16,
        np.uint16,
        np.int32,
        np.uint32,
        np.int64,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
    ):
        a = base_.astype(dtype)
        out += [a, a[::2, ::3], a.transpose(2, 0, 1), np.asfortranarray(a)]
    out += [
        np.zeros((0,), np.float32),
        np.zeros((3, 0, 2), np.int64),
        np.array(5, np.int16),  # 0-d
        np.float32(2.5),  # numpy scalar
        np.array(["a", "bcd", ""], dtype="<U3"),
        np.array([b"x", b"yz"], dtype="|S2"),
        np.array([b"ragged", b"", b"\x00\xff" * 100], dtype=object),
        np.arange(np.datetime64("2020-01-01"), np.datetime64("2020-01-11")).astype("<M8[s]"),
        b"raw bytes \x00\x01",
        b"",
        "unicode ✓",
        {"image": base_.astype(np.uint8)[:, ::-1], "label": np.int64(3), "names": (b"a", "b")},
    ]
    return out


def assert_same(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert sorted(got) == sorted(want)
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, tuple | list):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    elif isinstance(want, np.ndarray | np.generic):
        got_a, want_a = np.asarray(got), np.asarray(want)
        assert got_a.dtype == want_a.dtype and got_a.shape == want_a.shape, (got_a, want_a)
        assert (
            (got_a == want_a).all() if want_a.dtype != object else got_a.tolist() == want_a.tolist()
        )
        if isinstance(got, np.ndarray) and got.size:
            assert got.flags.writeable
    else:
        assert type(got) is type(want) and got == want


@pytest.mark.parametrize("compression", [None, "zstd", "AUTO"])
def test_every_kind_of_element_arrives_equal(make_cluster, compression):
    """One element holding every kind of leaf (an element's structure is fixed:
    each kind is a leaf of it), several times."""
    cluster = make_cluster(1)
    want = tuple(_elements())
    dataset = ds.Dataset.range(3).map(lambda i: want)
    got, _ = read(dataset, cluster, compression=compression)
    assert len(got) == 3
    for element in got:
        assert_same(element, want)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_elements_larger_than_the_message_limit_arrive_in_pieces(
    make_cluster, monkeypatch, compression
):
    """Past the worker's frame limit an element goes in pieces (here 64 KiB), also
    mixed with small elements joined into shared messages."""
    monkeypatch.setattr(serving, "_FRAME_BYTES", 64 << 10)
    monkeypatch.setattr(serving, "_OWN_FRAME_BYTES", 16 << 10)
    monkeypatch.setattr(serving, "_JOIN_BYTES", 48 << 10)
    pieces: list[int] = []
    original = serving.ElementServing._frames

    def frames(self, reply, request, *rest):  # counts the payload messages and their sizes
        for message in original(self, reply, request, *rest):
            if type(message) is bytes:
                pieces.append(len(message))
            yield message

    monkeypatch.setattr(serving.ElementServing, "_frames", frames)
    cluster = make_cluster(1)
    rng = np.random.default_rng(1)
    sizes = [1 << 20, 3, (1 << 20) + 7, 5000, 5000, 5000, 200_000, 1]
    want = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    dataset = ds.Dataset.range(len(want)).map(lambda i: want[i])
    got, _ = read(dataset, cluster, compression=compression)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert pieces and max(pieces) <= 64 << 10
    if compression is None:  # random bytes: the 1 MiB ones came in 16+ pieces each
        assert len(pieces) >= 32


def test_large_elements_go_in_pieces_made_as_they_are_sent(make_cluster, monkeypatch):
    """Uncompressed, an element of at least `codec.LATER_BYTES` is encoded later
    (`codec.Encoding`) and goes in equal pieces of about `_PIECE_BYTES` (at most a
    quarter over), each made just before it is sent: the worker never makes the whole
    encoding. A 1 MiB array and its header go as one message."""
    sent: list[int] = []
    original = serving.ElementServing._frames

    def frames(self, reply, request, *rest):
        for message in original(self, reply, request, *rest):
            if type(message) is bytes:
                sent.append(len(message))
            yield message

    monkeypatch.setattr(serving.ElementServing, "_frames", frames)
    whole: list[int] = []
    original_encode = codec.encode

    def encode(element):
        whole.append(codec.element_nbytes(element))
        return original_encode(element)

    monkeypatch.setattr(codec, "encode", encode)
    cluster = make_cluster(1)
    rng = np.random.default_rng(2)
    sizes = [9_600_000, 1 << 20, 300_000, 5, 6]
    want = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    dataset = ds.Dataset.range(len(want)).map(lambda i: want[i])
    got, _ = read(dataset, cluster, compression=None)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert not whole, "an element was encoded whole"
    piece = serving._PIECE_BYTES
    big = [n for n in sent if n > 400_000]
    # 9.6 MB: 8 pieces of ~1.2 MB; 1 MiB + header: one message.
    assert len(big) == 9 and max(big) <= piece + piece // 4, sent
    assert sum(big) > 9_600_000 + (1 << 20)
    assert any(300_000 < n < 301_000 for n in sent), sent  # its own message, whole


def test_fast_link_is_not_compressed_by_auto(make_cluster):
    """Loopback is faster than zstd on data that compresses by ~4/5 (6 bits of
    noise a byte): AUTO measures that and sends as is, also when the worker is on
    another host (before, AUTO compressed by host alone)."""
    cluster = make_cluster(0)
    mp = pytest.MonkeyPatch()
    rng = np.random.default_rng(11)
    data = rng.integers(0, 64, (40, 1 << 20), dtype=np.uint8)
    try:
        mp.setenv("DATASERVICE_HOST_ID", "worker-host")
        cluster.add_worker()
        mp.setenv("DATASERVICE_HOST_ID", "trainer-host")
        dataset = ds.Dataset.range(len(data)).map(lambda x: data[x])
        got, stats = read(dataset, cluster, compression="AUTO")
    finally:
        mp.undo()
    assert all((g == w).all() for g, w in zip(got, data, strict=True))
    assert stats["bytes"] > data.nbytes  # not compressed


def _through_slow_link(make_cluster, dataset: ds.Dataset, rate: float) -> tuple[list, dict]:
    cluster = make_cluster(0)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = TcpProxy(port, down_rate=rate)
    try:
        config = ds.WorkerConfig(
            cluster.target, port=port, worker_address=f"127.0.0.1:{proxy.port}", **FAST
        )
        cluster.workers.append(ds.WorkerServer(config))
        return read(dataset, cluster, compression="AUTO")
    finally:
        for w in cluster.workers:
            w.stop()
        proxy.close()


def test_slow_link_with_compressible_data_is_compressed_by_auto(make_cluster):
    """At 8 MB/s, compressible arrays are worth compressing: after the first reply
    (uncompressed, measured) AUTO asks for zstd."""
    n = 24
    dataset = ds.Dataset.range(n).map(lambda x: np.full(512 << 10, x, np.uint8))
    got, stats = _through_slow_link(make_cluster, dataset, 8e6)
    assert [int(a[0]) for a in got] == list(range(n))
    assert stats["bytes"] < n * (512 << 10) / 2, stats["bytes"]


def test_slow_link_with_incompressible_data_is_not_compressed_by_auto(make_cluster):
    """Random bytes do not compress: AUTO finds that on a 64 KiB sample and sends
    them as they are, however slow the link."""
    n = 12
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, (n, 512 << 10), dtype=np.uint8)
    dataset = ds.Dataset.range(n).map(lambda x: data[x])
    got, stats = _through_slow_link(make_cluster, dataset, 16e6)
    assert all((g == w).all() for g, w in zip(got, data, strict=True))
    assert stats["bytes"] >= n * (512 << 10)


def test_auto_compression_decides_on_measured_figures():
    auto = grpc_transfer.AutoCompression()
    assert auto.choose(time.monotonic()) == ""  # nothing measured: as is
    compressible = [bytearray(np.zeros(1 << 20, np.uint8).tobytes())]
    auto.observe("", 1 << 20, (1 << 20) / 5e9, compressible)  # a 5 GB/s link
    assert auto.link_bytes_per_s == pytest.approx(5e9)
    assert auto.ratio is not None and auto.ratio < 0.01
    # A link faster than the codec is never compressed.
    assert (1 - auto.ratio) / 5e9 < auto.codec_s_per_byte
    assert not auto.compressing and auto.choose(time.monotonic()) == ""
    slow = grpc_transfer.AutoCompression()
    slow.observe("", 1 << 20, (1 << 20) / 10e6, compressible)  # 10 MB/s
    assert slow.compressing and slow.choose(time.monotonic()) == "zstd"
    noise = [bytearray(np.random.default_rng(0).integers(0, 256, 1 << 20, np.uint8).tobytes())]
    random = grpc_transfer.AutoCompression()
    random.observe("", 1 << 20, (1 << 20) / 10e6, noise)
    assert random.ratio is not None and random.ratio > 0.9 and not random.compressing
    # While compressing, the link is measured again uncompressed every REMEASURE_S.
    assert slow.choose(time.monotonic() + slow.REMEASURE_S + 1) == ""
    # Compressed replies measure nothing.
    before = (slow.link_bytes_per_s, slow.ratio)
    slow.observe("zstd", 1 << 20, 1e-6, compressible)
    assert (slow.link_bytes_per_s, slow.ratio) == before


def _task_client(worker: WorkerServer, **kw: Any) -> grpc_transfer.GrpcTransferClient:
    wait_until(lambda: worker.num_tasks() == 1, 10, "the task")
    (task_id,) = worker._tasks
    endpoint = base.TaskEndpoint(task_id, worker.address, worker.address, "")
    return grpc_transfer.GrpcTransferClient(endpoint, kw.get("token"))


def test_a_request_sent_ahead_brings_the_next_elements(make_cluster):
    cluster = make_cluster(1)
    dataset = ds.Dataset.range(40).map(lambda i: np.full(1000, i, np.int32))
    it = iter(dataset.apply(ds.distribute(OFF, cluster.target, job_name="pipe")))
    client = _task_client(cluster.workers[0])
    try:
        first = client.get_elements(4, 1 << 20, 1.0)
        assert client.request_ahead(4, 1 << 20, 1.0)
        assert client._next is not None  # sent before the caller asked
        assert not client.request_ahead(4, 1 << 20, 1.0)  # one at a time
        second = client.get_elements(1, 1, 1.0)  # the reply to the one sent ahead
        third = client.get_elements(4, 1 << 20, 1.0)
        assert client._next is None
        ids = [int(e[0]) for e in first.elements + second.elements + third.elements]
        assert len(second.elements) == 4
        assert ids == sorted(ids) and len(set(ids)) == len(ids) == 12
    finally:
        client.close()
        it.close()


@pytest.mark.parametrize(
    "kw", [dict(max_outstanding_requests=1), dict(job_name="shared")], ids=["bounded", "named"]
)
def test_bounded_requests_and_named_jobs_send_no_request_ahead(make_cluster, monkeypatch, kw):
    """Not with max_outstanding_requests (it bounds the requests in flight), nor for a
    named job, whose small fetches are first come, first served."""
    sent: list[int] = []
    original = grpc_transfer.GrpcTransferClient.request_ahead

    def request_ahead(self, *a, **kw):
        sent.append(1)
        return original(self, *a, **kw)

    monkeypatch.setattr(grpc_transfer.GrpcTransferClient, "request_ahead", request_ahead)
    cluster = make_cluster(1)
    got, _ = read(ds.Dataset.range(3000), cluster, **kw)
    assert [int(x) for x in got] == list(range(3000))
    assert not sent
    got, _ = read(ds.Dataset.range(3000), cluster)
    assert [int(x) for x in got] == list(range(3000))
    assert sent  # the patch sees requests sent ahead where they are


def test_a_read_cancelled_mid_element_leaves_nothing_behind(make_cluster, monkeypatch):
    """Closing a client while a large element is on its way (a slow link) cancels
    the call: the client's threads end, the worker's turn ends unsent, and the
    element goes to the task's other consumer, whole, once the cancelled one does
    not come back for it (`REQUEUE_AFTER_S`)."""
    monkeypatch.setattr(unacked_replies, "REQUEUE_AFTER_S", 0.5)
    monkeypatch.setattr(serving, "_FRAME_BYTES", 256 << 10)  # received piece by piece
    cluster = make_cluster(0)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proxy = TcpProxy(port, down_rate=16e6)  # an 8 MiB element in ~0.5 s
    threads_before = {t.ident for t in threading.enumerate()}
    try:
        config = ds.WorkerConfig(
            cluster.target, port=port, worker_address=f"127.0.0.1:{proxy.port}", **FAST
        )
        worker = ds.WorkerServer(config)
        cluster.workers.append(worker)
        rng = np.random.default_rng(5)
        # More elements than the iterator can have asked for (its request and the
        # one it sends ahead, then one more as each arrives), so the test's own
        # request below always gets one on a loaded machine too.
        n = 5
        data = rng.integers(0, 256, (n, 8 << 20), dtype=np.uint8)
        dataset = ds.Dataset.range(n).map(lambda i: data[i])
        cancel = ds.distribute(
            OFF, cluster.target, job_name="cancel", data_transfer_protocol="grpc"
        )
        it = iter(dataset.apply(cancel))
        wait_until(lambda: worker.num_tasks() == 1, 10, "the task")
        (task_id,) = worker._tasks
        endpoint = base.TaskEndpoint(task_id, worker.address, worker.address, "")
        client = grpc_transfer.GrpcTransferClient(endpoint, None)
        outcome: list[BaseException | base.ElementsResult] = []

        def fetch() -> None:
            try:
                outcome.append(client.get_elements(1, 1, 5.0))
            except BaseException as err:  # noqa: BLE001
                outcome.append(err)

        fetching = threading.Thread(target=fetch)
        fetching.start()
        wait_until(
            lambda: bool(outcome) or (client._current is not None and client._current.received > 0),
            20,
            "the first bytes of the element",
        )
        assert not outcome, f"the request ended before its element was on its way: {outcome}"
        client.close()
        fetching.join(10)
        assert not fetching.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], errors.DataServiceError)
        runner = worker._tasks[task_id]
        wait_until(
            lambda: runner.unacked.stats()["failed_replies"] == 1,
            10,
            "the worker to end the cancelled reply's turn unsent",
        )
        # The task's other consumer (the iterator) gets every element once, whole: the
        # cancelled reply's element too, given back to the task once its consumer
        # did not come back for it.
        got = list(it)
        assert len(got) == n
        order = sorted(range(n), key=lambda k: int(np.flatnonzero((data == got[k]).all(1))[0]))
        for k, w in zip(order, data, strict=True):
            np.testing.assert_array_equal(got[k], w)
        assert runner.unacked.stats()["requeued_elements"] == 1
    finally:
        for w in cluster.workers:
            w.stop()
        proxy.close()
    leftover = [
        t
        for t in threading.enumerate()
        if t.ident not in threads_before and t.name.startswith("ds-grpc-next")
    ]
    assert not leftover, leftover


@pytest.fixture(scope="module")
def secured():
    cluster = InProcessCluster(0, auth_token=TOKEN)
    cluster.add_worker(auth_token=TOKEN)
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("token", [None, "wrong", TOKEN])
def test_get_elements_frames_requires_the_token(secured, token):
    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    with grpc.insecure_channel(secured.workers[0].address) as channel:
        call = channel.unary_stream(
            grpc_transfer._FRAMES_METHOD,
            request_serializer=pb.GetElementsRequest.SerializeToString,
            response_deserializer=None,
        )
        try:
            messages = list(call(pb.GetElementsRequest(task_id=1), timeout=10.0, metadata=metadata))
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            messages, code = [], err.code()
    if token == TOKEN:  # past auth: an unknown task gets an empty reply, one last head
        assert code == grpc.StatusCode.OK and len(messages) == 1
        head = pb.ElementsHead.FromString(messages[0])
        assert head.last and not head.element_bytes
    else:
        assert code == grpc.StatusCode.UNAUTHENTICATED and messages == []


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(compression="gzip"), "compression='gzip'"),
        (dict(max_message_bytes=10), "max_message_bytes=10"),
        (dict(max_elements=-1), "max_elements=-1"),
        (dict(consumer_key="k", sequence=0), "sequence"),
    ],
)
def test_get_elements_frames_checks_the_request(secured, fields, named):
    request = pb.GetElementsRequest(task_id=1, round_index=-1, consumer_index=-1, **fields)
    with grpc.insecure_channel(secured.workers[0].address) as channel:
        call = channel.unary_stream(
            grpc_transfer._FRAMES_METHOD,
            request_serializer=pb.GetElementsRequest.SerializeToString,
            response_deserializer=None,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(call(request, timeout=10.0, metadata=[("authorization", f"Bearer {TOKEN}")]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in info.value.details()


def test_a_worker_without_frames_is_read_with_get_elements_stream(make_cluster, monkeypatch):
    calls: list[str] = []

    def unimplemented(self, request, context):
        calls.append("frames")
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        yield  # pragma: no cover

    original = serving.WorkerServicer.GetElementsStream

    def stream(self, request, context):
        calls.append("stream")
        yield from original(self, request, context)

    monkeypatch.setattr(serving.WorkerServicer, "GetElementsFrames", unimplemented)
    monkeypatch.setattr(serving.WorkerServicer, "GetElementsStream", stream)
    cluster = make_cluster(1)
    dataset = ds.Dataset.range(30).map(lambda i: np.full(100_000, i, np.uint8))
    got, _ = read(dataset, cluster, compression=None)
    assert [int(a[0]) for a in got] == list(range(30))
    assert calls.count("frames") == 1 and calls.count("stream") >= 1


@pytest.mark.parametrize(
    "setting", ["", "0", "MALLOC_MMAP_THRESHOLD_=65536", "MALLOC_TRIM_THRESHOLD_=0"]
)
def test_malloc_tuning_is_once_per_process_and_can_be_turned_off(setting):
    """Off with $DATASERVICE_MALLOC_TUNING=0, and when glibc's own malloc settings are
    in the environment (the user's choice wins)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATASERVICE_MALLOC_TUNING", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
        and k != "MALLOC_TRIM_THRESHOLD_"
    }
    if setting == "0":
        env["DATASERVICE_MALLOC_TUNING"] = setting
    elif setting:
        name, value = setting.split("=")
        env[name] = value
    code = "from dataservice.transfer import grpc as g; print(g.tune_malloc(), g.tune_malloc())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    first, again = out.stdout.split()
    assert again == "False"  # once per process
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert first == str(not setting and glibc)


def test_announced_sizes_are_refused_only_when_they_cannot_be_received():
    grpc_transfer.check_announced([0, 5, 3 << 30], "w:1")  # 3 GiB: in pieces, fine
    with pytest.raises(errors.DataLossError, match="negative size"):
        grpc_transfer.check_announced([5, -1], "w:1")
    with pytest.raises(errors.ElementTooLargeError, match="more than this host's memory"):
        grpc_transfer.check_announced([1 << 50], "w:1")


@pytest.mark.slow
def test_an_element_over_2_gib_crosses_grpc():
    """One element of 2,100 MiB (over gRPC's 2 GiB message limit and the old announced
    size limit): it comes in pieces, whole."""
    nbytes = 2100 << 20

    def big(x):
        a = np.zeros(nbytes, np.uint8)
        a[::4096] = 7
        a[-1] = 9
        return a

    with ds.LocalCluster(num_workers=1) as cluster:
        dataset = (
            ds.Dataset.range(1)
            .map(big)
            .apply(ds.distribute("OFF", cluster.target, data_transfer_protocol="grpc"))
        )
        (got,) = list(dataset)
        assert got.nbytes == nbytes
        assert int(got[::4096].min()) == 7 and int(got[-1]) == 9 and int(got[1]) == 0


def test_auto_compression_goes_on_only_while_it_delivers_more():
    """The model (link vs codec speed) only decides to try zstd; once both modes were
    measured on full replies (bytes of elements as before compression per second of
    request), compressing goes on only while it delivers more than not compressing.
    Short replies (the pipeline was what the request waited for) measure nothing."""
    zeros = np.zeros(1 << 20, np.uint8).tobytes()
    plain = [bytearray(zeros)] * 4  # 4 MiB of elements
    packed = [bytearray(codec.compress(zeros, "zstd"))] * 4
    assert all(codec.plain_nbytes(e) == 1 << 20 for e in packed)
    asked = (4, 32 << 20)  # 4 elements: these replies are full
    auto = grpc_transfer.AutoCompression()
    # A link the model finds slower than the codec on this data: try zstd.
    auto.observe("", 4 << 20, (4 << 20) / 100e6, plain, wall_s=(4 << 20) / 100e6, asked=asked)
    assert auto.compressing and auto.delivered[""] == pytest.approx(100e6)
    # Compressed replies that deliver less (the worker's CPU is the bottleneck): stop.
    auto.observe("zstd", 4 << 10, 1e-3, packed, wall_s=(4 << 20) / 50e6, asked=asked)
    assert auto.delivered["zstd"] == pytest.approx(50e6)
    assert not auto.compressing and auto.choose(time.monotonic()) == ""
    # Delivering more (a slow link): go on.
    for _ in range(4):
        auto.observe("zstd", 4 << 10, 1e-3, packed, wall_s=(4 << 20) / 400e6, asked=asked)
    assert auto.delivered["zstd"] > auto.delivered[""]
    assert auto.compressing and auto.choose(time.monotonic()) == "zstd"
    # A short reply (1 element of 4 asked for, far under the bytes) measures nothing.
    before = dict(auto.delivered)
    auto.observe("zstd", 1 << 10, 1e-3, packed[:1], wall_s=10.0, asked=asked)
    assert auto.delivered == before
