"""Fuzz of every RPC and of the shared-memory handshake socket, against a live
in-process dispatcher and worker.

* Structured: hypothesis requests for every method of DispatcherService and
  WorkerService, each field present or missing, with random and boundary ints
  (negative, huge), random and meaningful strings and bytes, random enum values.
* Raw bytes: random bytes as the serialized request of each method (a generic
  `unary_unary` call with identity serializers).
* The shm handshake: random, truncated and oversized messages on the worker's
  abstract socket, before and after a valid hello.

Asserted: no INTERNAL or UNKNOWN status for any input, the servers answer a
good request afterwards, thread and fd counts come back within a bound.

The default set runs a few examples per method (`-m 'not slow'`, ~20 s); the
`slow` variant runs many more (under 2 minutes on 2 busy cores).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dataservice as ds
from dataservice.data.serialize import serialize as serialize_dataset
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import service_pb2_grpc
from dataservice.sharding import ShardingPolicy
from dataservice.transfer import shm, shm_server

pytestmark = pytest.mark.timeout(300)

BAD_STATUSES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
RPC_TIMEOUT_S = 15.0  # GetElements waits up to 1 s for a task it does not know yet


class Live:
    """An in-process dispatcher and worker, a dataset and a plain and a
    coordinated task to aim the fuzz at, and stubs."""

    def __init__(self) -> None:
        self.dispatcher = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=60_000))
        self.worker = ds.WorkerServer(
            ds.WorkerConfig(self.dispatcher.target, heartbeat_interval_ms=100)
        )
        assert self.worker.wait_registered(10)
        self.dispatcher_address = self.dispatcher.target.split("://")[1]
        self.dchannel = grpc.insecure_channel(self.dispatcher_address)
        self.wchannel = grpc.insecure_channel(self.worker.address)
        self.stub = service_pb2_grpc.DispatcherServiceStub(self.dchannel)
        self.wstub = service_pb2_grpc.WorkerServiceStub(self.wchannel)
        self.dataset_id = self._register(ds.Dataset.range(1000).repeat())
        self.plain_task = self._task("plain", 0)
        self.coordinated_task = self._task("coordinated", 2)

    def _register(self, dataset: ds.Dataset) -> str:
        data = serialize_dataset(dataset)
        request = pb.RegisterDatasetRequest(
            dataset=data,
            fingerprint=hashlib.sha256(data).hexdigest(),
            cardinality=dataset.cardinality(),
        )
        return self.stub.RegisterDataset(request, timeout=10).dataset_id

    def _task(self, job_name: str, num_consumers: int) -> int:
        job = self.stub.GetOrCreateJob(
            pb.GetOrCreateJobRequest(
                dataset_id=self.dataset_id,
                job_name=job_name,
                num_consumers=num_consumers,
                processing_mode=ShardingPolicy.OFF,
            ),
            timeout=10,
        )
        it = self.stub.GetOrCreateIteration(
            pb.GetOrCreateIterationRequest(job_id=job.job_id), timeout=10
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            response = self.stub.ClientHeartbeat(
                pb.ClientHeartbeatRequest(iteration_client_id=it.iteration_client_id),
                timeout=10,
            )
            if response.tasks and self.worker.task_runner(response.tasks[0].task_id):
                return response.tasks[0].task_id
            time.sleep(0.05)
        raise AssertionError(f"job {job_name}: no task on the worker within 10 s")

    def assert_still_serving(self) -> None:
        """A good request of each server is answered."""
        info = self.stub.GetDispatcherInfo(pb.DispatcherInfoRequest(), timeout=10)
        assert info.incarnation_id
        response = self.wstub.GetElements(
            pb.GetElementsRequest(task_id=self.plain_task, consumer_index=-1, round_index=-1),
            timeout=10,
        )
        assert response.elements or response.end_of_sequence

    def stop(self) -> None:
        self.dchannel.close()
        self.wchannel.close()
        self.worker.stop()
        self.dispatcher.stop()


@pytest.fixture(scope="module")
def live():
    servers = Live()
    yield servers
    servers.stop()


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


class Resources:
    """Thread and fd counts before a fuzz; `check` waits (with a deadline)
    for them to come back within a bound afterwards."""

    THREAD_SLACK = 48  # gRPC pool threads started on demand (up to 64 + 32), kept idle
    FD_SLACK = 32

    def __init__(self) -> None:
        self.threads = threading.active_count()
        self.fds = _fd_count()

    def check(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            threads, fds = threading.active_count(), _fd_count()
            if threads <= self.threads + self.THREAD_SLACK and fds <= self.fds + self.FD_SLACK:
                return
            if time.monotonic() > deadline:
                names = sorted(t.name for t in threading.enumerate())
                raise AssertionError(
                    f"threads {self.threads} -> {threads}, fds {self.fds} -> {fds} after "
                    f"the fuzz (waited {timeout_s} s): {names}"
                )
            time.sleep(0.1)


# ---------------------------------------------------------------- strategies
_INT_BOUNDS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
}
_MEANINGFUL_STRINGS = [
    "",
    "0",
    "1",
    "AUTO",
    "ANY",
    "LOCAL",
    "local",
    "FOO",
    "zstd",
    "ZSTD",
    "gzip",
    "localhost:1",
    "127.0.0.1:65535",
    "[::1]:5000",
    "h:0",
    "h:99999",
    ":",
    "nohost",
    "x" * 5000,
    "\x00",
    "a\nb",
    "é☃",
]


def _scalar(field: FieldDescriptor, live: Live) -> st.SearchStrategy:
    if field.type in _INT_BOUNDS:
        lo, hi = _INT_BOUNDS[field.type]
        known = [0, 1, 2, 3, -1, -2, 64, 4096, lo, hi, live.plain_task, live.coordinated_task]
        return st.one_of(st.sampled_from(known), st.integers(lo, hi), st.integers(-5, 10))
    if field.type == FieldDescriptor.TYPE_STRING:
        known = [*_MEANINGFUL_STRINGS, live.dataset_id]
        return st.one_of(st.sampled_from(known), st.text(max_size=40))
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        known = [0.0, 1.5, -1.0, float("nan"), float("inf"), -float("inf"), 1e300]
        return st.one_of(st.sampled_from(known), st.floats())
    if field.type == FieldDescriptor.TYPE_MESSAGE:  # a nested message: its own fields
        from google.protobuf import message_factory

        return request_strategy(message_factory.GetMessageClass(field.message_type), live)
    raise AssertionError(f"no strategy for {field.full_name} (type {field.type})")


def request_strategy(message_class, live: Live) -> st.SearchStrategy:
    """Requests of `message_class`: each field missing or drawn from its strategy."""
    optional = {}
    for field in message_class.DESCRIPTOR.fields:
        value = _scalar(field, live)
        if field.is_repeated:
            value = st.lists(value, max_size=4)
        optional[field.name] = value
    fields = st.fixed_dictionaries({}, optional=optional)
    if message_class is pb.RegisterDatasetRequest:
        # Half of them with the right fingerprint, to get past it to the parse.
        def with_fingerprint(kw: dict, right: bool) -> dict:
            if right:
                kw["fingerprint"] = hashlib.sha256(kw.get("dataset", b"")).hexdigest()
            return kw

        fields = st.builds(with_fingerprint, fields, st.booleans())
    return fields.map(lambda kw: message_class(**kw))


def _methods() -> list[tuple[str, str, object]]:
    out = []
    for service in pb.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            out.append((service.name, method.name, getattr(pb, method.input_type.name)))
    return out


METHODS = _methods()
METHOD_IDS = [f"{s}.{m}" for s, m, _ in METHODS]


def _call(live: Live, service: str, method: str, request) -> grpc.StatusCode:
    stub = live.wstub if service == "WorkerService" else live.stub
    try:
        getattr(stub, method)(request, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as err:
        assert err.code() not in BAD_STATUSES, (
            f"{method}({request!r}): {err.code()} {err.details()}"
        )
        return err.code()
    return grpc.StatusCode.OK


def _raw_call(live: Live, service: str, method: str, data: bytes) -> None:
    channel = live.wchannel if service == "WorkerService" else live.dchannel
    call = channel.unary_unary(
        f"/dataservice.rpc.{service}/{method}",
        request_serializer=None,
        response_deserializer=None,
    )
    try:
        call(data, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as err:
        status = f"{err.code()} {err.details()}"
        assert err.code() not in BAD_STATUSES, f"{method}({data!r}): {status}"


def _structured_fuzz(live: Live, service: str, method: str, request_class, examples: int) -> None:
    # GetElements of a task the worker does not know waits 1 s: fewer of those.
    if method == "GetElements":
        examples = max(4, examples // 3)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(request_strategy(request_class, live))
    def run(request) -> None:
        _call(live, service, method, request)

    run()


def _raw_fuzz(live: Live, service: str, method: str, examples: int) -> None:
    if method == "GetElements":
        examples = max(4, examples // 3)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.binary(max_size=256))
    def run(data: bytes) -> None:
        _raw_call(live, service, method, data)

    run()


@pytest.mark.parametrize("service, method, request_class", METHODS, ids=METHOD_IDS)
def test_fuzz_rpc_quick(live, service, method, request_class):
    resources = Resources()
    _structured_fuzz(live, service, method, request_class, examples=12)
    _raw_fuzz(live, service, method, examples=6)
    live.assert_still_serving()
    resources.check()


@pytest.mark.slow
@pytest.mark.parametrize("service, method, request_class", METHODS, ids=METHOD_IDS)
def test_fuzz_rpc_slow(live, service, method, request_class):
    resources = Resources()
    _structured_fuzz(live, service, method, request_class, examples=120)
    _raw_fuzz(live, service, method, examples=60)
    live.assert_still_serving()
    resources.check()


# ---------------------------------------------------------------- shm handshake
def _shm_server(live: Live) -> shm_server.ShmTransferServer:
    for server in live.worker._transfer_servers:
        if isinstance(server, shm_server.ShmTransferServer):
            return server
    pytest.skip("the worker serves no shared-memory transfer here")


def _shm_exchange(live: Live, messages: list[bytes], wait_reply: bool) -> None:
    """Connects to the worker's handshake socket, sends `messages`, reads what
    comes back (bounded), closes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(5.0)
    try:
        sock.connect(shm.shm_socket_name(live.worker.address))
        for message in messages:
            try:
                sock.send(message)
            except OSError:  # EMSGSIZE for an oversized one, EPIPE once refused
                break
            if wait_reply:
                try:
                    _, fds, _, _ = socket.recv_fds(sock, 1 << 18, 4)
                except OSError:
                    break
                for fd in fds:
                    os.close(fd)
    finally:
        sock.close()


def _hello(live: Live, **extra) -> bytes:
    return json.dumps({"v": shm.LAYOUT_VERSION, "task_id": live.plain_task, **extra}).encode()


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10) | st.floats(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)
_HELLO_KEYS = ["v", "task_id", "trainer_id", "window", "pid"]


def _shm_messages(live: Live) -> st.SearchStrategy:
    raw = st.binary(max_size=512)
    json_hello = st.dictionaries(st.sampled_from(_HELLO_KEYS), _json_values, max_size=5).map(
        lambda d: json.dumps(d).encode()
    )
    # A valid hello for a task the worker runs, then random or short requests.
    after_hello = st.lists(st.binary(max_size=64), min_size=1, max_size=3).map(
        lambda rest: [_hello(live), *rest]
    )
    return st.one_of(
        raw.map(lambda b: [b]),
        json_hello.map(lambda b: [b]),
        st.just([b""]),
        st.just([b"{"]),
        st.sampled_from([[b"[1]"], [b"5"], [b'"v"'], [b"null"]]),  # JSON, not an object
        st.just([b"\xff" * 70_000]),  # larger than the 4 KiB the handshake reads
        st.just([_hello(live, task_id="7")]),
        st.just([_hello(live, task_id=[1])]),
        after_hello,
    )


def _shm_fuzz(live: Live, examples: int) -> None:
    _shm_server(live)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(_shm_messages(live), st.booleans())
    def run(messages: list[bytes], wait_reply: bool) -> None:
        _shm_exchange(live, messages, wait_reply)

    run()


def _shm_connections_close(live: Live, timeout_s: float = 20.0) -> None:
    server = _shm_server(live)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with server._mu:
            left = len(server._connections)
        if left == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"{left} shm connections still open {timeout_s} s after the fuzz")


def _no_failure_logged(caplog) -> None:
    """Bad input and clients that hang up are the client's doing: the worker
    logs no ERROR (a traceback per connection would be a log flood)."""
    errors_logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors_logged, errors_logged[:5]


def test_fuzz_shm_handshake_quick(live, caplog):
    resources = Resources()
    with caplog.at_level(logging.WARNING):
        _shm_fuzz(live, examples=25)
        _shm_connections_close(live)
    live.assert_still_serving()
    resources.check()
    _no_failure_logged(caplog)


@pytest.mark.slow
def test_fuzz_shm_handshake_slow(live, caplog):
    resources = Resources()
    with caplog.at_level(logging.WARNING):
        _shm_fuzz(live, examples=250)
        _shm_connections_close(live)
    live.assert_still_serving()
    resources.check()
    _no_failure_logged(caplog)
