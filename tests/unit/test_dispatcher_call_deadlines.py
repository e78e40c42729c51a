"""rpc/util.py `call_dispatcher`: how long one attempt of a dispatcher RPC may
take, by the size of its request."""

from __future__ import annotations

import re

import grpc
import pytest

from dataservice import errors
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import util as rpc_util


class _Stub:
    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def RegisterDataset(self, request, timeout, metadata):  # noqa: N802 (a gRPC method)
        self.timeouts.append(timeout)
        return pb.RegisterDatasetResponse(dataset_id="7")


def _register(stub: _Stub, nbytes: int, timeout_ms: int) -> str:
    address = "127.0.0.1:1"
    rpc_util.mark_reached(address)  # no GetDispatcherInfo probe first
    request = pb.RegisterDatasetRequest(dataset=b"\0" * nbytes)
    return rpc_util.call_dispatcher(
        stub, "RegisterDataset", request, address=address, metadata=None, timeout_ms=timeout_ms
    ).dataset_id


def test_a_small_request_gets_the_fixed_attempt_deadline() -> None:
    stub = _Stub()
    assert _register(stub, 1000, 60_000) == "7"
    (timeout_s,) = stub.timeouts
    assert abs(timeout_s - rpc_util.DISPATCHER_ATTEMPT_S) < 0.01, timeout_s


def test_a_large_request_gets_time_for_its_bytes_even_past_the_client_timeout() -> None:
    """A pipeline capturing 50 MB: its first try may take 5 s more than a small
    one's (not resent at 10 s, sent, parsed and stored again), and a client
    timeout shorter than those 5 s does not cut it."""
    stub = _Stub()
    nbytes = 50_000_000
    assert _register(stub, nbytes, 60_000) == "7"
    (timeout_s,) = stub.timeouts
    want = rpc_util.DISPATCHER_ATTEMPT_S + nbytes / rpc_util.LARGE_REQUEST_BYTES_PER_S
    assert want - 0.5 <= timeout_s <= want + 0.01, (timeout_s, want)
    stub = _Stub()
    assert _register(stub, nbytes, 1_000) == "7"  # a client timeout of 1 s
    (timeout_s,) = stub.timeouts
    sending_s = nbytes / rpc_util.LARGE_REQUEST_BYTES_PER_S
    assert sending_s - 0.5 <= timeout_s <= sending_s + 0.01, (timeout_s, sending_s)


class _StuckStub:
    """A dispatcher that answered before and now lets every try run out of its deadline."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def GetDatasetDef(self, request, timeout, metadata):  # noqa: N802 (a gRPC method)
        self.timeouts.append(timeout)
        raise _DeadlineExceeded()


class _DeadlineExceeded(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


def test_a_stuck_dispatcher_is_named_with_the_deadline_its_last_try_had() -> None:
    """A call whose budget (0.3 s) is shorter than one attempt's deadline (10 s):
    each try gets what is left of the budget, and the error names the last one's
    deadline, not the 10 s none of them had."""
    stub = _StuckStub()
    address = "127.0.0.1:2"
    rpc_util.mark_reached(address)
    with pytest.raises(errors.UnavailableError, match=r"within 300 ms \(the last try had") as e:
        rpc_util.call_dispatcher(
            stub, "GetDatasetDef", pb.GetDatasetDefRequest(dataset_id="1"),
            address=address, metadata=None, timeout_ms=300,
        )  # fmt: skip
    assert stub.timeouts[0] <= 0.3 and all(t <= 0.3 for t in stub.timeouts), stub.timeouts
    said = float(re.search(r"last try had ([0-9.]+) s", str(e.value)).group(1))
    assert said == round(stub.timeouts[-1], 1), (said, stub.timeouts)


def test_registering_a_large_definition_warns_and_names_the_way_out(monkeypatch, caplog) -> None:
    import logging

    import numpy as np

    import dataservice as ds
    from dataservice.client import api

    monkeypatch.setattr(api, "LARGE_DEFINITION_BYTES", 1 << 20)
    big = np.ones(2 << 20, np.uint8)
    d = ds.DispatchServer(ds.DispatcherConfig())
    try:
        with caplog.at_level(logging.WARNING, logger="dataservice"):
            ds.register_dataset(d.target, ds.Dataset.range(2).map(lambda i: big[int(i)]))
            ds.register_dataset(d.target, ds.Dataset.range(2))
    finally:
        d.stop()
    warned = [r.getMessage() for r in caplog.records if "definition is" in r.getMessage()]
    assert len(warned) == 1 and "2 MiB" in warned[0] and "mmap_mode" in warned[0], warned
