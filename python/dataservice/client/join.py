"""Joining an iteration at the dispatcher: the calls a read makes before its
first fetch.

`join` sends GetOrCreateJob with `join_iteration`: one call answers with the
job, the dispatcher's incarnation and client timeout, the iteration joined and,
but for exactly-once reads, its tasks (`first_heartbeat`), so the read's fetches
start before its first heartbeat. A dispatcher that answers with the job alone
(an older version) is asked GetDispatcherInfo and GetOrCreateIteration after it,
as a read did before (each unary call costs ~1-2 ms on loopback).

Imports only `rpc` of the project.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dataservice.rpc import service_pb2 as pb

# The `compression` of a read by id (from_dataset_id): the dataset's registered one.
REGISTERED = "REGISTERED"


@dataclass
class Joined:
    """What the dispatcher answered a read that joins an iteration.

    Attributes:
        job_id: The job's id.
        incarnation: The dispatcher's incarnation id (its state's identity).
        client_timeout_ms: How long (ms) the dispatcher keeps a silent client.
        dataset_compression: The dataset's register_dataset `compression` ("AUTO",
            "NONE", "ZSTD"; "" from a dispatcher that does not say).
        iteration: The GetOrCreateIterationResponse (its `first_heartbeat`
            set when the dispatcher listed the tasks).
    """

    job_id: int
    incarnation: str
    client_timeout_ms: int
    iteration: Any
    dataset_compression: str = ""


def join(call: Callable[[str, Any], Any], request: Any, repetition: int) -> Joined:
    """Joins repetition `repetition` of the job `request` (a GetOrCreateJobRequest)
    gets or creates, through `call(method, request)` (the read's dispatcher call,
    with its retries).

    Raises:
        DataServiceError: What the dispatcher answered (NotFoundError for an
            unknown dataset, InvalidArgumentError for a job's parameters, ...).
    """
    request.join_iteration = True
    request.iteration_repetition = repetition
    job = call("GetOrCreateJob", request)
    incarnation, client_timeout_ms = job.incarnation_id, job.client_timeout_ms
    if not incarnation:
        info = call("GetDispatcherInfo", pb.DispatcherInfoRequest())
        incarnation, client_timeout_ms = info.incarnation_id, info.client_timeout_ms
    if job.HasField("iteration"):
        iteration = job.iteration
    else:
        iteration = call(
            "GetOrCreateIteration",
            pb.GetOrCreateIterationRequest(
                job_id=job.job_id,
                repetition=repetition,
                incarnation_id=incarnation,
                client_host_id=request.client_host_id,
            ),
        )
    return Joined(job.job_id, incarnation, client_timeout_ms, iteration, job.dataset_compression)


def read_compression(requested: str | None, joined: Joined) -> str | None:
    """The compression a read asks its workers for: `requested` (distribute's
    "AUTO", None or "ZSTD"), or for `REGISTERED` the dataset's register_dataset
    `compression` (AUTO from a dispatcher that does not say)."""
    if requested != REGISTERED:
        return requested
    return joined.dataset_compression or "AUTO"
