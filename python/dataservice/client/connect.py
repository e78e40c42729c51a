"""How a consumer connects to one task's worker: which transfer protocol, with
what fallback, and whether its elements are compressed.

`connect` tries the protocols `transfer.protocol_candidates` names for the task
("auto": shared memory when the worker is on this host, then gRPC; otherwise the
one asked for), falling back to the next when a handshake fails
(`TransferUnavailable`, logged once per worker and protocol) and failing a forced
protocol that cannot reach the worker. `compression_for` is `distribute`'s
`compression` for one worker: "AUTO" leaves it to the gRPC client, which
compresses only when measuring says it saves time (`transfer.auto_compression.AutoCompression`).
The fetch threads that use these clients are `reader.py`'s.
"""

from __future__ import annotations

import logging

from dataservice import _waits, errors
from dataservice.transfer import base as transfer
from dataservice.transfer import shm

# A read logs under one name, the reader's, whichever module does the work.
log = logging.getLogger("dataservice.client.reader")

# (protocol, worker address) pairs whose handshake succeeded in this process: a
# later refusal there is a worker restarting or gone, not one without the protocol.
_SERVED: set[tuple[str, str]] = set()


def compression_for(requested: str | None, endpoint: transfer.TaskEndpoint) -> str:
    """ "zstd", "" or "auto" for `endpoint`, from `distribute`'s `compression`
    ("AUTO", None or "NONE", or a codec name). AUTO: "auto", the gRPC client's
    choice by measurement (the link's throughput against the codec's, and how well
    the data compresses: `transfer.auto_compression.AutoCompression`), not by host; a
    worker's elements read over shared memory are never compressed."""
    requested = (requested or "NONE").upper()
    if requested == "AUTO":
        return "auto"
    return "" if requested == "NONE" else requested.lower()


def connect(
    endpoint: transfer.TaskEndpoint,
    protocol: str | None,
    auth_token: str | None,
    *,
    zero_copy: bool,
    trainer_id: str,
    compression: str | None,
) -> transfer.TransferClient:
    """A transfer client for `endpoint`: the first candidate protocol whose
    handshake succeeds ("auto" or None: shared memory on the same host, else
    gRPC), asking the worker for `compression_for(compression, endpoint)`.

    Args:
        endpoint: The task and its worker.
        protocol: `distribute`'s `data_transfer_protocol` (None/"auto", "grpc",
            "shm", or another registered name).
        auth_token: The token the worker requires (None: none).
        zero_copy: Shared memory may hand out views of its ring (else copies).
        trainer_id: Non-empty: the client reads through the task's cross-trainer
            cache as this trainer.
        compression: `distribute`'s `compression` ("AUTO", None, "ZSTD").

    Raises:
        UnavailableError: A forced protocol cannot reach the worker, or no
            candidate can.
        NotFoundError: An unknown protocol was requested.
    """
    candidates = transfer.protocol_candidates(protocol, endpoint)
    for candidate in candidates:
        if candidate == shm.PROTOCOL and not trainer_id:
            # A connection an earlier iterator of this process left (and its ring).
            reused = shm.reuse_idle(endpoint, auth_token, zero_copy)
            if reused is not None:
                return reused
        try:
            client = transfer.make_client(
                candidate, endpoint, auth_token, zero_copy=zero_copy, trainer_id=trainer_id
            )
        except transfer.TransferUnavailable as err:
            if len(candidates) == 1:  # forced: no fallback
                raise errors.UnavailableError(
                    f"data transfer protocol {candidate!r} cannot reach worker "
                    f"{endpoint.worker_address}: {err}"
                ) from err
            if (candidate, endpoint.worker_address) in _SERVED:
                # Not a fallback for good: the worker served this protocol before
                # (its loss or restart is the read's to report); the next
                # reconnect tries it first again.
                log.debug(
                    "%s transfer to %s refused (%s); it served this process before (the "
                    "worker is restarting or gone); trying the next protocol",
                    candidate,
                    endpoint.worker_address,
                    err,
                )
                continue
            # Once per worker and protocol: a worker without it refuses every
            # reconnect, and each would log the same line.
            _waits.warn_once(
                log,
                ("fallback", candidate, endpoint.worker_address),
                "%s transfer to %s unavailable (%s); falling back",
                candidate,
                endpoint.worker_address,
                err,
            )
            continue
        _SERVED.add((candidate, endpoint.worker_address))
        codec = compression_for(compression, endpoint)
        if codec:
            client.set_compression(codec)
        return client
    raise errors.UnavailableError(f"no transfer protocol reaches {endpoint.worker_address}")


def release(client: transfer.TransferClient) -> None:
    """A fetch thread is done with `client`: a shared-memory connection that can serve
    another task is kept for this process's next iterators (`shm.keep_idle`); any
    other client is closed."""
    shm.keep_idle(client)
