"""Joining an iteration at the dispatcher: the calls a read makes before its
first fetch.

`join` sends GetOrCreateJob with `join_iteration`: one call answers with the
job, the dispatcher's incarnation and client timeout, the iteration joined and,
but for exactly-once reads, its tasks (`first_heartbeat`), so the read's fetches
start before its first heartbeat. A dispatcher that answers with the job alone
(an older version) is asked GetDispatcherInfo and GetOrCreateIteration after it,
as a read did before (each unary call costs ~1-2 ms on loopback).

Imports only `rpc` of the project (and psutil: is an earlier consumer's process alive).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from dataservice.client.stats import HOST
from dataservice.rpc import service_pb2 as pb

log = logging.getLogger(__name__)

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
                counters=request.counters,
            ),
        )
    return Joined(job.job_id, incarnation, client_timeout_ms, iteration, job.dataset_compression)


def heartbeat_s(client_timeout_ms: int) -> float:
    """How often (s) a consumer heartbeats to a dispatcher whose client timeout
    is `client_timeout_ms`: a fifth of it, 0.05-0.5 s."""
    return max(0.05, min(0.5, client_timeout_ms / 5000))


def read_compression(requested: str | None, joined: Joined) -> str | None:
    """The compression a read asks its workers for: `requested` (distribute's
    "AUTO", None or "ZSTD"), or for `REGISTERED` the dataset's register_dataset
    `compression` (AUTO from a dispatcher that does not say)."""
    if requested != REGISTERED:
        return requested
    return joined.dataset_compression or "AUTO"


def late_join_warning(joined: Joined, job_name: str, repetition: int) -> str | None:
    """The WARNING for a read of named job `job_name` that joined repetition
    `repetition` after other consumers read it, with no live consumer left
    reading it: the repetition was read to its end (the read yields nothing), or
    its earlier consumers left or went quiet (killed, or stuck) after reading
    part of it (the read gets only what is left). That is what a trainer
    restarted with the same job_name meets (tf.data service's shared named jobs:
    each process's k-th iterator joins repetition k), and it is silent
    otherwise. None when the repetition is new, or others read it alongside."""
    it = joined.iteration
    if not job_name:
        return None
    advice = (
        "a named job's repetitions are shared, as tf.data service's: the k-th iterator of "
        "job_name in each process joins repetition k, also in a process restarted after "
        "another was killed; for a whole epoch, use a new job_name (or none)"
    )
    if it.already_finished:
        return (
            f"job {job_name!r}: this iterator joined repetition {repetition}, which earlier "
            f"consumers already read to its end: it yields nothing ({advice})"
        )
    gone = it.earlier_consumers_left or (
        len(it.earlier_consumers) > 0
        and all(_gone(c, joined.client_timeout_ms) for c in it.earlier_consumers)
    )
    if not gone:
        return None
    how = (
        "all left (released or timed out)"
        if it.earlier_consumers_left
        else f"{len(it.earlier_consumers)} attached, each exited or not heard from lately"
    )
    handed = f", {it.splits_handed_out} DYNAMIC splits handed out" if it.splits_handed_out else ""
    return (
        f"job {job_name!r}: this iterator joined repetition {repetition} after its earlier "
        f"consumers read part of it ({how}{handed}): it gets only what they did not "
        f"({advice})"
    )


def warn_if_late(joined: Joined, job_name: str, repetition: int, resumed: Any) -> None:
    """Logs `late_join_warning` as a WARNING, unless the read resumes a
    checkpoint (`resumed` set: it joins on purpose where it left off)."""
    message = None if resumed else late_join_warning(joined, job_name, repetition)
    if message:
        log.warning("%s", message)


def _gone(consumer: Any, client_timeout_ms: int) -> bool:
    """Whether an earlier consumer (an `EarlierConsumer`) no longer reads: its
    process on this host has exited, or the dispatcher has not heard from it for
    3 of its heartbeat intervals (`heartbeat_s`)."""
    if consumer.silent_ms > 3000 * heartbeat_s(client_timeout_ms):
        return True
    if consumer.pid and consumer.host == HOST:
        return not psutil.pid_exists(consumer.pid)
    return False
