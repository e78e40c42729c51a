"""Every RPC field is checked at the edge (rpc/validate.py): a bad value is
INVALID_ARGUMENT naming the RPC, the field and the value; an unknown id is
NOT_FOUND; a request that does not fit the state it names is
FAILED_PRECONDITION. Never INTERNAL, never a failure later on a worker."""

from __future__ import annotations

import hashlib
import time

import grpc
import pytest

import dataservice as ds
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import service_pb2_grpc, validate
from dataservice.sharding import ShardingPolicy

pytestmark = pytest.mark.timeout(120)

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def servers():
    dispatcher = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=5_000))
    worker = ds.WorkerServer(ds.WorkerConfig(dispatcher.target, heartbeat_interval_ms=100))
    assert worker.wait_registered(10)
    dchannel = grpc.insecure_channel(dispatcher.target.split("://")[1])
    wchannel = grpc.insecure_channel(worker.address)
    yield (
        dispatcher,
        worker,
        service_pb2_grpc.DispatcherServiceStub(dchannel),
        service_pb2_grpc.WorkerServiceStub(wchannel),
    )
    dchannel.close()
    wchannel.close()
    worker.stop()
    dispatcher.stop()


def _code(call, request):
    """(status code, details) of one RPC; (OK, response) when it succeeds."""
    try:
        return grpc.StatusCode.OK, call(request, timeout=10)
    except grpc.RpcError as err:
        return err.code(), err.details()


def _register(stub, dataset: ds.Dataset) -> str:
    from dataservice.data.serialize import serialize as serialize_dataset

    data = serialize_dataset(dataset)
    request = pb.RegisterDatasetRequest(
        dataset=data,
        fingerprint=hashlib.sha256(data).hexdigest(),
        cardinality=dataset.cardinality(),
    )
    return stub.RegisterDataset(request, timeout=10).dataset_id


# The adversarial run's findings, and one bad value per kind of rule.
BAD_DISPATCHER_REQUESTS = [
    (
        "GetOrCreateJob",
        pb.GetOrCreateJobRequest(dataset_id="0", processing_mode=99),
        "processing_mode=99: 99 is not a ShardingPolicy value (valid: 0 (OFF), 1 (DYNAMIC),",
    ),
    (
        "GetOrCreateJob",
        pb.GetOrCreateJobRequest(dataset_id="0", processing_mode=-5),
        "processing_mode=-5",
    ),
    (
        "GetOrCreateJob",
        pb.GetOrCreateJobRequest(dataset_id="0", target_workers="FOO"),
        "target_workers='FOO'",
    ),
    (
        "GetOrCreateJob",
        pb.GetOrCreateJobRequest(dataset_id="0", target_workers="local"),
        "target_workers='local'",
    ),
    (
        "GetOrCreateJob",
        pb.GetOrCreateJobRequest(dataset_id="0", num_consumers=-1),
        "num_consumers=-1",
    ),
    ("GetOrCreateJob", pb.GetOrCreateJobRequest(dataset_id="0", job_name="x" * 5000), "job_name="),
    (
        "GetOrCreateJob",
        pb.GetOrCreateJobRequest(dataset_id="0", job_name="a\nb"),
        "control characters",
    ),
    ("GetOrCreateJob", pb.GetOrCreateJobRequest(), "dataset_id=''"),
    ("GetOrCreateIteration", pb.GetOrCreateIterationRequest(job_id=-3), "job_id=-3"),
    ("GetOrCreateIteration", pb.GetOrCreateIterationRequest(repetition=-1), "repetition=-1"),
    (
        "ClientHeartbeat",
        pb.ClientHeartbeatRequest(iteration_client_id=-1),
        "iteration_client_id=-1",
    ),
    ("ClientHeartbeat", pb.ClientHeartbeatRequest(finished_tasks=[1, -2]), "finished_tasks="),
    (
        "ReleaseIterationClient",
        pb.ReleaseIterationClientRequest(iteration_client_id=-9),
        "iteration_client_id=-9",
    ),
    ("GetSplits", pb.GetSplitsRequest(max_splits=-1), "max_splits=-1"),
    ("GetSplits", pb.GetSplitsRequest(split_provider_index=-1), "split_provider_index=-1"),
    ("GetSplits", pb.GetSplitsRequest(task_id=-1), "task_id=-1"),
    ("GetRounds", pb.GetRoundsRequest(first_round=-64), "first_round=-64"),
    ("GetRounds", pb.GetRoundsRequest(dead_task_id=-1), "dead_task_id=-1"),
    ("GetDatasetDef", pb.GetDatasetDefRequest(), "dataset_id=''"),
    ("GetElementSpec", pb.GetElementSpecRequest(dataset_id="\x00"), "control characters"),
    ("WorkerHeartbeat", pb.WorkerHeartbeatRequest(worker_uid="u"), "worker_address=''"),
    (
        "WorkerHeartbeat",
        pb.WorkerHeartbeatRequest(worker_address="nohost", worker_uid="u"),
        "worker_address='nohost'",
    ),
    (
        "WorkerHeartbeat",
        pb.WorkerHeartbeatRequest(worker_address="h:0", worker_uid="u"),
        "worker_address='h:0'",
    ),
    (
        "WorkerHeartbeat",
        pb.WorkerHeartbeatRequest(worker_address="h:70000", worker_uid="u"),
        "worker_address='h:70000'",
    ),
    (
        "WorkerHeartbeat",
        pb.WorkerHeartbeatRequest(worker_address="h:1", transfer_address="a b:1", worker_uid="u"),
        "transfer_address='a b:1'",
    ),
    ("WorkerHeartbeat", pb.WorkerHeartbeatRequest(worker_address="h:1"), "worker_uid=''"),
    (
        "WorkerHeartbeat",
        pb.WorkerHeartbeatRequest(worker_address="h:1", worker_uid="u", current_tasks=[-1]),
        "current_tasks=[-1]",
    ),
    (
        "WorkerHeartbeat",
        pb.WorkerHeartbeatRequest(worker_address="h:1", worker_uid="u", heartbeat_interval_ms=-5),
        "heartbeat_interval_ms=-5",
    ),
    ("RegisterDataset", pb.RegisterDatasetRequest(), "dataset=b''"),
    (
        "RegisterDataset",
        pb.RegisterDatasetRequest(dataset=b"x", fingerprint="f"),
        "fingerprint='f'",
    ),
    (
        "RegisterDataset",
        pb.RegisterDatasetRequest(
            dataset=b"x", fingerprint=hashlib.sha256(b"x").hexdigest(), compression="lz4"
        ),
        "compression='lz4'",
    ),
    (
        "RegisterDataset",
        pb.RegisterDatasetRequest(
            dataset=b"x", fingerprint=hashlib.sha256(b"x").hexdigest(), cardinality=-7
        ),
        "cardinality=-7",
    ),
    ("ReportWorkerFailure", pb.ReportWorkerFailureRequest(), "worker_address=''"),
]


@pytest.mark.parametrize("method, request_, names", BAD_DISPATCHER_REQUESTS)
def test_bad_dispatcher_field_is_invalid_argument_naming_it(servers, method, request_, names):
    _, _, stub, _ = servers
    code, details = _code(getattr(stub, method), request_)
    assert code == INVALID, (code, details)
    assert details.startswith(f"{method}: invalid "), details
    assert names in details, details


def test_every_request_message_has_rules():
    """A new RPC must declare its rules (an unlisted message is refused at once)."""
    names = set()
    for service in pb.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            names.add(method.input_type.full_name)
    assert names == set(validate.RULES)


def test_unknown_ids_stay_not_found_and_stale_incarnation_restarted(servers):
    _, _, stub, _ = servers
    cases = [
        (stub.GetOrCreateJob, pb.GetOrCreateJobRequest(dataset_id="nope")),
        (stub.GetDatasetDef, pb.GetDatasetDefRequest(dataset_id="nope")),
        (stub.GetElementSpec, pb.GetElementSpecRequest(dataset_id="nope")),
        (stub.GetOrCreateIteration, pb.GetOrCreateIterationRequest(job_id=123456)),
        (stub.ClientHeartbeat, pb.ClientHeartbeatRequest(iteration_client_id=123456)),
        (stub.GetSplits, pb.GetSplitsRequest(iteration_id=123456)),
        (stub.GetRounds, pb.GetRoundsRequest(iteration_id=123456)),
    ]
    for call, request in cases:
        code, details = _code(call, request)
        assert code == grpc.StatusCode.NOT_FOUND, (request, code, details)
        assert "123456" in details or "nope" in details, details  # names the unknown id
    code, details = _code(
        stub.GetOrCreateJob, pb.GetOrCreateJobRequest(dataset_id="nope", incarnation_id="old")
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "restarted" in details


def test_valid_job_is_still_created(servers):
    _, _, stub, _ = servers
    dataset_id = _register(stub, ds.Dataset.range(5))
    for mode in (ShardingPolicy.OFF, ShardingPolicy.DYNAMIC):
        for target in ("", "AUTO", "ANY", "LOCAL"):
            code, response = _code(
                stub.GetOrCreateJob,
                pb.GetOrCreateJobRequest(
                    dataset_id=dataset_id, processing_mode=mode, target_workers=target
                ),
            )
            assert code == grpc.StatusCode.OK, response


def _task_of(dispatcher, job_name: str, stub, dataset_id: str, num_consumers: int = 0) -> int:
    job = stub.GetOrCreateJob(
        pb.GetOrCreateJobRequest(
            dataset_id=dataset_id, job_name=job_name, num_consumers=num_consumers
        ),
        timeout=10,
    )
    it = stub.GetOrCreateIteration(pb.GetOrCreateIterationRequest(job_id=job.job_id), timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        response = stub.ClientHeartbeat(
            pb.ClientHeartbeatRequest(iteration_client_id=it.iteration_client_id), timeout=10
        )
        if response.tasks:
            return response.tasks[0].task_id
        time.sleep(0.05)
    raise AssertionError("no task within 10 s")


def test_get_elements_default_round_fields_on_a_plain_task(servers):
    """The adversarial finding: default round fields (round_index=0,
    consumer_index=0) on a task of a job without num_consumers was INTERNAL
    (an IndexError); now FAILED_PRECONDITION naming round_index."""
    dispatcher, worker, stub, wstub = servers
    dataset_id = _register(stub, ds.Dataset.range(10))
    task_id = _task_of(dispatcher, "plain", stub, dataset_id)
    deadline = time.monotonic() + 10
    while worker.task_runner(task_id) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    code, details = _code(wstub.GetElements, pb.GetElementsRequest(task_id=task_id))
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
    assert "round_index=0" in details and f"task {task_id}" in details
    # A plain read of the same task works.
    code, response = _code(
        wstub.GetElements,
        pb.GetElementsRequest(task_id=task_id, consumer_index=-1, round_index=-1),
    )
    assert code == grpc.StatusCode.OK and response.elements


def test_get_elements_consumer_index_beyond_num_consumers(servers):
    dispatcher, worker, stub, wstub = servers
    dataset_id = _register(stub, ds.Dataset.range(10).repeat())
    task_id = _task_of(dispatcher, "coordinated", stub, dataset_id, num_consumers=2)
    deadline = time.monotonic() + 10
    while worker.task_runner(task_id) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    code, details = _code(
        wstub.GetElements, pb.GetElementsRequest(task_id=task_id, consumer_index=2, round_index=0)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
    assert "consumer_index=2" in details and "num_consumers=2" in details
    code, details = _code(
        wstub.GetElements, pb.GetElementsRequest(task_id=task_id, consumer_index=-1, round_index=-1)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "coordinated" in details


@pytest.mark.parametrize(
    "request_, names",
    [
        (pb.GetElementsRequest(task_id=-1, round_index=-1, consumer_index=-1), "task_id=-1"),
        (
            pb.GetElementsRequest(max_elements=-1, round_index=-1, consumer_index=-1),
            "max_elements=-1",
        ),
        (pb.GetElementsRequest(max_bytes=-1, round_index=-1, consumer_index=-1), "max_bytes=-1"),
        (pb.GetElementsRequest(max_bytes=2**40, round_index=-1, consumer_index=-1), "max_bytes="),
        (pb.GetElementsRequest(round_index=-2, consumer_index=-1), "round_index=-2"),
        (pb.GetElementsRequest(round_index=-1, consumer_index=3), "consumer_index=3"),
        (pb.GetElementsRequest(round_index=4, consumer_index=-1), "round_index=4"),
        (
            pb.GetElementsRequest(round_index=-1, consumer_index=-1, compression="gzip"),
            "compression='gzip'",
        ),
        (pb.GetElementsRequest(round_index=0, consumer_index=0, trainer_id="t"), "trainer_id='t'"),
        (
            pb.GetElementsRequest(round_index=-1, consumer_index=-1, consumer_key="k"),
            "consumer_key='k' and sequence=0",
        ),
        (
            pb.GetElementsRequest(round_index=-1, consumer_index=-1, sequence=3),
            "consumer_key='' and sequence=3",
        ),
        (
            pb.GetElementsRequest(round_index=-1, consumer_index=-1, consumer_key="k", sequence=-1),
            "sequence=-1",
        ),
        (
            pb.GetElementsRequest(
                round_index=-1, consumer_index=-1, consumer_key="k" * 65, sequence=1
            ),
            "consumer_key=",
        ),
    ],
)
def test_bad_get_elements_field_is_invalid_argument(servers, request_, names):
    _, _, _, wstub = servers
    code, details = _code(wstub.GetElements, request_)
    assert code == INVALID, (code, details)
    assert details.startswith("GetElements: invalid ") and names in details, details
    # GetElementsStream (the client's read) checks the same request the same way.
    with pytest.raises(grpc.RpcError) as info:
        list(wstub.GetElementsStream(request_, timeout=10))
    assert info.value.code() == INVALID, info.value.details()
    assert names in info.value.details()


def test_a_valid_worker_still_registers_and_serves(servers):
    dispatcher, _, _, _ = servers
    got = list(
        ds.Dataset.range(20)
        .apply(ds.distribute(ShardingPolicy.OFF, dispatcher.target))
        .as_numpy_iterator()
    )
    assert sorted(int(x) for x in got) == list(range(20))


def test_every_request_field_has_a_rule():
    """A field added to a request message must declare its rule in
    rpc/validate.py RULES (an unchecked field is how bad input reached workers)."""
    missing = []
    for full_name, rules in validate.RULES.items():
        covered = set()
        for rule in rules:
            covered.update((rule.name,) if isinstance(rule, validate.Field) else rule.fields)
        message = pb.DESCRIPTOR.message_types_by_name[full_name.rsplit(".", 1)[1]]
        missing += [f"{full_name}.{f.name}" for f in message.fields if f.name not in covered]
    assert not missing, f"add rules in rpc/validate.py RULES for: {missing}"


@pytest.mark.parametrize(
    "path, data",
    [
        ("/dataservice.rpc.DispatcherService/GetOrCreateJob", b"\x0a\xff\xff"),  # truncated
        ("/dataservice.rpc.DispatcherService/GetOrCreateJob", b"\x0a\x02\xff\xfe"),  # not UTF-8
        ("/dataservice.rpc.DispatcherService/WorkerHeartbeat", b"\xff" * 11),
        ("/dataservice.rpc.WorkerService/GetElements", b"\x08"),
    ],
)
def test_malformed_bytes_are_invalid_argument_not_internal(servers, path, data):
    dispatcher, worker, _, _ = servers
    address = worker.address if "Worker" in path.split("/")[1] else dispatcher.target[7:]
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        code, details = _code(call, data)
    method = path.rsplit("/", 1)[1]
    assert code == INVALID, (code, details)
    assert details.startswith(f"{method}: the request is not a valid {method}Request"), details


def _iteration(stub, dataset_id: str, job_name: str, mode=ShardingPolicy.OFF, consumers=0):
    """(iteration_id, task_id) of a new named job's first iteration, once it has a task."""
    job = stub.GetOrCreateJob(
        pb.GetOrCreateJobRequest(
            dataset_id=dataset_id,
            job_name=job_name,
            processing_mode=mode,
            num_consumers=consumers,
        ),
        timeout=10,
    )
    it = stub.GetOrCreateIteration(pb.GetOrCreateIterationRequest(job_id=job.job_id), timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        response = stub.ClientHeartbeat(
            pb.ClientHeartbeatRequest(iteration_client_id=it.iteration_client_id), timeout=10
        )
        if response.tasks:
            return it.iteration_id, response.tasks[0].task_id
        time.sleep(0.05)
    raise AssertionError(f"job {job_name}: no task within 10 s")


def test_splits_and_rounds_only_for_iterations_of_their_kind(servers):
    _, _, stub, _ = servers
    dataset_id = _register(stub, ds.Dataset.range(100).repeat())
    off_iteration, off_task = _iteration(stub, dataset_id, "kind-off")
    dyn_iteration, dyn_task = _iteration(stub, dataset_id, "kind-dyn", ShardingPolicy.DYNAMIC)
    rr_iteration, rr_task = _iteration(stub, dataset_id, "kind-rr", consumers=2)

    code, details = _code(
        stub.GetSplits, pb.GetSplitsRequest(iteration_id=off_iteration, task_id=off_task)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "OFF" in details, details
    code, details = _code(
        stub.GetSplits, pb.GetSplitsRequest(iteration_id=dyn_iteration, task_id=off_task)
    )
    assert code == grpc.StatusCode.NOT_FOUND and f"task {off_task}" in details, details
    code, response = _code(
        stub.GetSplits,
        pb.GetSplitsRequest(iteration_id=dyn_iteration, task_id=dyn_task, max_splits=4),
    )
    assert code == grpc.StatusCode.OK and len(response.int_splits) >= 1, response

    code, details = _code(stub.GetRounds, pb.GetRoundsRequest(iteration_id=off_iteration))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "coordinated" in details, details
    code, details = _code(
        stub.GetRounds, pb.GetRoundsRequest(iteration_id=rr_iteration, dead_task_id=off_task)
    )
    assert code == grpc.StatusCode.NOT_FOUND and "dead_task_id" in details, details
    code, response = _code(stub.GetRounds, pb.GetRoundsRequest(iteration_id=rr_iteration))
    assert code == grpc.StatusCode.OK and set(response.task_ids) == {rr_task}, response


def test_a_worker_cannot_finish_another_workers_task(servers):
    dispatcher, worker, stub, _ = servers
    dataset_id = _register(stub, ds.Dataset.range(100).repeat())
    iteration_id, task_id = _iteration(stub, dataset_id, "not-yours")
    request = pb.WorkerHeartbeatRequest(
        worker_address="localhost:1", worker_uid="intruder", finished_tasks=[task_id]
    )
    code, details = _code(stub.WorkerHeartbeat, request)
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
    assert f"task {task_id}" in details and worker.address in details, details
    task = dispatcher._state.tasks[task_id]
    assert not task.finished
