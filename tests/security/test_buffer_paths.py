"""The dispatcher never opens a path that a client sent (issue 11).

A `DatasetDef` whose buffer names a file (`DatasetBuffer.path`: /etc/passwd,
a FIFO, a relative path, `..`) or the dispatcher's own digest field is refused
with INVALID_ARGUMENT naming the field, at once, and the dispatcher goes on
answering: before, `GetDatasetDef` returned the named file's bytes, and a
FIFO blocked a handler thread for good. Buffers sent inline are kept under
the dispatcher's own names (their SHA-256), which is all a worker maps.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

import dataservice as ds
from dataservice.locality import host_id
from dataservice.rpc import dataset_pb2, service_pb2_grpc
from dataservice.rpc import service_pb2 as pb

serialize = importlib.import_module("dataservice.data.serialize")  # the module, not the function
pytestmark = pytest.mark.timeout(120)

SOURCE = np.arange(1 << 18, dtype=np.int64)  # 2 MiB: out of band
REFUSED_WITHIN_S = 5.0


@pytest.fixture
def dispatcher():
    with ds.DispatchServer() as d:
        yield d


@pytest.fixture
def stub(dispatcher):
    channel = grpc.insecure_channel(dispatcher.target.split("://")[1])
    yield service_pb2_grpc.DispatcherServiceStub(channel)
    channel.close()


@pytest.fixture
def fifo(tmp_path) -> str:
    path = str(tmp_path / "fifo")
    os.mkfifo(path)
    return path


def _request(buffer: dataset_pb2.DatasetBuffer, dataset_id: str = "") -> pb.RegisterDatasetRequest:
    """A RegisterDatasetRequest of a real pipeline whose one buffer is `buffer`."""
    definition = serialize.parse(serialize.serialize(ds.Dataset.from_tensor_slices(SOURCE)))
    definition.buffers[0].CopyFrom(buffer)
    data = definition.SerializeToString()
    return pb.RegisterDatasetRequest(
        dataset=data, dataset_id=dataset_id, fingerprint=hashlib.sha256(data).hexdigest()
    )


def _path_buffer(path: str) -> dataset_pb2.DatasetBuffer:
    return dataset_pb2.DatasetBuffer(path=path, size_bytes=SOURCE.nbytes)


@pytest.mark.parametrize(
    "path",
    ["/etc/passwd", "FIFO", "relative/buffer", "../../../../etc/passwd", "/tmp/../etc/shadow"],
)
def test_a_buffer_path_is_refused_naming_the_field(stub, fifo, path):
    path = fifo if path == "FIFO" else path
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stub.RegisterDataset(_request(_path_buffer(path)), timeout=30)
    assert time.monotonic() - start < REFUSED_WITHIN_S
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "RegisterDatasetRequest.dataset.buffers[0].path" in info.value.details()
    # Nothing was registered: no id for GetDatasetDef to serve the file under.
    with pytest.raises(grpc.RpcError) as info:
        stub.GetDatasetDef(pb.GetDatasetDefRequest(dataset_id="0"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_path_to_a_file_of_the_right_size_is_refused_too(stub, tmp_path):
    real = tmp_path / "buffer"
    real.write_bytes(SOURCE.tobytes())
    with pytest.raises(grpc.RpcError) as info:
        stub.RegisterDataset(_request(_path_buffer(str(real)), "ds"), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "buffer, field",
    [
        (
            dataset_pb2.DatasetBuffer(
                data=SOURCE.tobytes(), size_bytes=SOURCE.nbytes, sha256="0" * 64
            ),
            "buffers[0].sha256",
        ),
        (dataset_pb2.DatasetBuffer(data=SOURCE.tobytes(), size_bytes=7), "buffers[0].size_bytes"),
    ],
    ids=["sha256", "size_bytes"],
)
def test_other_fields_of_the_dispatchers_own_are_refused(stub, buffer, field):
    with pytest.raises(grpc.RpcError) as info:
        stub.RegisterDataset(_request(buffer), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"RegisterDatasetRequest.dataset.{field}" in info.value.details()


def test_the_dispatcher_answers_after_100_fifo_paths(dispatcher, stub, fifo):
    """A FIFO path blocked a handler thread each: 64 of them stopped every RPC."""
    request = _request(_path_buffer(fifo))
    start = time.monotonic()
    with futures.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda _: _code(stub.RegisterDataset, request), range(100)))
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 100
    assert time.monotonic() - start < 30
    info = stub.GetDispatcherInfo(pb.DispatcherInfoRequest(), timeout=5)
    assert info.incarnation_id
    dataset_id = ds.register_dataset(dispatcher.target, ds.Dataset.from_tensor_slices(SOURCE))
    definition = stub.GetDatasetDef(pb.GetDatasetDefRequest(dataset_id=dataset_id), timeout=10)
    assert definition.dataset.buffers[0].data == SOURCE.tobytes()


def _code(method, request) -> grpc.StatusCode:
    try:
        method(request, timeout=10)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_a_worker_on_the_host_gets_the_dispatchers_file_named_by_its_digest(dispatcher, stub):
    dataset_id = ds.register_dataset(dispatcher.target, ds.Dataset.from_tensor_slices(SOURCE))
    local = stub.GetDatasetDef(
        pb.GetDatasetDefRequest(dataset_id=dataset_id, host_id=host_id()), timeout=10
    ).dataset
    (buffer,) = local.buffers
    digest = hashlib.sha256(SOURCE.tobytes()).hexdigest()
    assert buffer.sha256 == digest and os.path.basename(buffer.path) == digest
    assert not buffer.data and buffer.size_bytes == SOURCE.nbytes
    assert [int(x) for x in serialize.load(local).take(3)] == [0, 1, 2]


def test_a_worker_maps_no_file_but_the_one_named_by_the_digest(tmp_path, fifo):
    """Defence in depth on the worker: a path that is not the digest's name,
    or a FIFO under it, is an OSError at once (the worker then asks for the
    bytes inline), never a hang."""
    definition = serialize.parse(serialize.serialize(ds.Dataset.from_tensor_slices(SOURCE)))
    digest = hashlib.sha256(SOURCE.tobytes()).hexdigest()
    buffer = definition.buffers[0]
    buffer.data, buffer.path, buffer.sha256 = b"", "/etc/passwd", digest
    with pytest.raises(OSError, match="not the dispatcher's file"):
        serialize.load(definition)
    named = str(tmp_path / digest)
    os.mkfifo(named)
    buffer.path = named
    start = time.monotonic()
    with pytest.raises(OSError, match="not a regular file"):
        serialize.load(definition)
    assert time.monotonic() - start < REFUSED_WITHIN_S
    os.unlink(named)
    os.symlink("/etc/passwd", named)
    with pytest.raises(OSError):
        serialize.load(definition)
