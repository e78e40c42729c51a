"""gRPC entry points: every dispatcher and worker RPC (service.proto's services,
unary and streamed) refuses a call without the token or with a wrong one
(UNAUTHENTICATED); servers log the refused peer, and a refused client's error
names the address and what to set."""

from __future__ import annotations

import logging

import grpc
import pytest

import dataservice as ds
from dataservice import auth, errors
from dataservice.rpc import service_pb2 as pb
from tests.conftest import InProcessCluster, values

TOKEN = "s3cret-token"
SERVICE = pb.DESCRIPTOR.services_by_name


def _call(address: str, service: str, method: str, token: str | None) -> grpc.StatusCode:
    """One RPC with an empty request; its status code (OK if it got past auth)."""
    desc = SERVICE[service].methods_by_name[method]
    request_cls = getattr(pb, desc.input_type.name)
    response_cls = getattr(pb, desc.output_type.name)
    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    with grpc.insecure_channel(address) as channel:
        make = channel.unary_stream if desc.server_streaming else channel.unary_unary
        fn = make(
            f"/{SERVICE[service].full_name}/{method}",
            request_serializer=request_cls.SerializeToString,
            response_deserializer=response_cls.FromString,
        )
        try:
            answer = fn(request_cls(), timeout=10.0, metadata=metadata)
            if desc.server_streaming:
                list(answer)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


@pytest.fixture
def secured(make_cluster, monkeypatch):
    monkeypatch.delenv(auth.AUTH_ENV, raising=False)
    c = make_cluster(0, auth_token=TOKEN)
    c.add_worker(auth_token=TOKEN)
    return c


@pytest.fixture(scope="module")
def shared_secured():
    """One secured cluster for the many refusal calls (no state is changed)."""
    c = InProcessCluster(0, auth_token=TOKEN)
    c.add_worker(auth_token=TOKEN)
    yield c
    c.stop()


DISPATCHER_METHODS = [m.name for m in SERVICE["DispatcherService"].methods]


def test_every_dispatcher_method_is_listed():
    assert len(DISPATCHER_METHODS) >= 12  # a new RPC is covered by the tests below


@pytest.mark.parametrize("method", DISPATCHER_METHODS)
@pytest.mark.parametrize("token", [None, "wrong", "", TOKEN + "x", TOKEN[:-1]])
def test_dispatcher_refuses_without_the_token(shared_secured, method, token):
    address = shared_secured.target.split("://")[1]
    assert _call(address, "DispatcherService", method, token) == grpc.StatusCode.UNAUTHENTICATED


WORKER_METHODS = [m.name for m in SERVICE["WorkerService"].methods]


def test_every_service_is_covered():
    # A service added to service.proto needs its refusal test here.
    assert sorted(SERVICE) == ["DispatcherService", "WorkerService"]
    assert {"GetElements", "GetElementsStream", "GetElementsFrames"} <= set(WORKER_METHODS)


@pytest.mark.parametrize("method", WORKER_METHODS)
@pytest.mark.parametrize("token", [None, "wrong", "", TOKEN + "x"])
def test_worker_refuses_without_the_token(shared_secured, method, token):
    address = shared_secured.workers[0].address
    code = _call(address, "WorkerService", method, token)
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_the_token_gets_past_auth(secured):
    address = secured.target.split("://")[1]
    # Past auth: the handler answers (OK, or its own error for an empty request).
    assert _call(address, "DispatcherService", "GetDispatcherInfo", TOKEN) == grpc.StatusCode.OK
    for method in WORKER_METHODS:
        code = _call(secured.workers[0].address, "WorkerService", method, TOKEN)
        assert code != grpc.StatusCode.UNAUTHENTICATED, method


def test_worker_with_the_token_only_in_its_environment_requires_it(make_cluster, monkeypatch):
    monkeypatch.setenv(auth.AUTH_ENV, TOKEN)
    c = make_cluster(0)  # the dispatcher reads the environment too
    worker = c.add_worker()  # no auth_token in its config
    assert worker.auth_token == TOKEN
    for token in (None, "wrong"):
        code = _call(worker.address, "WorkerService", "GetElements", token)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code = _call(c.target.split("://")[1], "DispatcherService", "GetDispatcherInfo", token)
        assert code == grpc.StatusCode.UNAUTHENTICATED
    # and the clients of this process (same environment) read through it
    assert values(ds.Dataset.range(3).apply(ds.distribute("off", c.target))) == [0, 1, 2]


def test_worker_with_a_token_file(make_cluster, monkeypatch, tmp_path):
    monkeypatch.delenv(auth.AUTH_ENV, raising=False)
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    c = make_cluster(0, auth_token_file=str(path))
    worker = c.add_worker(auth_token_file=str(path))
    assert _call(worker.address, "WorkerService", "GetElements", None) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    monkeypatch.setenv(auth.AUTH_ENV, TOKEN)
    assert values(ds.Dataset.range(3).apply(ds.distribute("off", c.target))) == [0, 1, 2]


def test_refusal_is_logged_with_the_peer_address(secured, caplog):
    address = secured.target.split("://")[1]
    with caplog.at_level(logging.WARNING, logger="dataservice.auth"):
        for _ in range(3):
            _call(address, "DispatcherService", "GetDispatcherInfo", "wrong")
        _call(secured.workers[0].address, "WorkerService", "GetElements", None)
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    # once per peer per minute: one for the dispatcher, one for the worker
    assert len(refusals) == 2, refusals
    assert refusals[0].startswith("dispatcher refused a connection from ipv")
    assert "127.0.0.1:" in refusals[0] or "[::1]:" in refusals[0]
    assert refusals[1].startswith("worker refused a connection from ipv")


def test_refused_client_error_names_address_and_variable(secured, monkeypatch):
    monkeypatch.setenv(auth.AUTH_ENV, "wrong")
    with pytest.raises(errors.UnauthenticatedError) as info:
        ds.register_dataset(secured.target, ds.Dataset.range(3))
    message = str(info.value)
    assert secured.target.split("://")[1] in message
    assert "DATASERVICE_AUTH_TOKEN" in message and "auth_token" in message
    assert isinstance(info.value, errors.FailedPreconditionError)  # as before
    monkeypatch.delenv(auth.AUTH_ENV)
    with pytest.raises(errors.UnauthenticatedError, match="DATASERVICE_AUTH_TOKEN"):
        ds.register_dataset(secured.target, ds.Dataset.range(3))


def test_worker_refused_by_its_dispatcher_says_why(make_cluster, monkeypatch):
    monkeypatch.delenv(auth.AUTH_ENV, raising=False)
    c = make_cluster(0, auth_token=TOKEN)
    worker = c.add_worker(auth_token="wrong")
    assert not worker.wait_registered(10.0)
    assert isinstance(worker.registration_error, errors.UnauthenticatedError)
    assert c.target.split("://")[1] in str(worker.registration_error)
    with pytest.raises(errors.UnauthenticatedError):
        worker.join()


@pytest.mark.parametrize("token", [None, "wrong", TOKEN])
def test_worker_get_elements_stream_refuses_without_the_token(shared_secured, token):
    """GetElementsStream (the streamed, acknowledged read) is behind the same check."""
    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    with grpc.insecure_channel(shared_secured.workers[0].address) as channel:
        fn = channel.unary_stream(
            f"/{SERVICE['WorkerService'].full_name}/GetElementsStream",
            request_serializer=pb.GetElementsRequest.SerializeToString,
            response_deserializer=pb.GetElementsChunk.FromString,
        )
        try:
            chunks = list(fn(pb.GetElementsRequest(task_id=1), timeout=10.0, metadata=metadata))
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            chunks, code = [], err.code()
    if token == TOKEN:  # past auth: the worker answers (an unknown task: an empty reply)
        assert code == grpc.StatusCode.OK and chunks and chunks[-1].last
    else:
        assert code == grpc.StatusCode.UNAUTHENTICATED and chunks == []
