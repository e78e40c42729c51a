"""The transfer-protocol registry: how a client fetches a task's elements.

A protocol is a name ("grpc"; "shm" plugs in here) and a factory of
`TransferClient`s. The client picks one per task from the iterator's
`data_transfer_protocol` (None/"auto": the best available for that worker,
"grpc", or an explicitly registered name).
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from dataservice import errors


@dataclasses.dataclass
class ElementsResult:
    """What one fetch returned.

    Attributes:
        elements: Decoded elements, in the worker's order.
        nbytes: Encoded size of those elements (bytes).
        end_of_sequence: The task has no more elements.
        worker_uid: The serving worker process's id ("" if the protocol does not
            say): when it changes, the worker restarted and the task started over.
    """

    elements: list[Any]
    nbytes: int
    end_of_sequence: bool
    worker_uid: str = ""


@dataclasses.dataclass(frozen=True)
class TaskEndpoint:
    """Where a task's elements come from."""

    task_id: int
    worker_address: str
    transfer_address: str
    host_id: str


class TransferClient(abc.ABC):
    """Fetches elements of one task from one worker. One caller thread at a time."""

    protocol: str = ""
    # Elements fetched from this client and not yet consumed may pin this many
    # bytes at most (None: no limit of the protocol's own). Shared-memory views
    # keep their ring slots: a reader that buffered more than the ring holds
    # would stall the worker (and force copies out of the ring).
    max_unconsumed_bytes: int | None = None
    # After a failed `get_elements`, the caller asks the same client again instead of
    # making a new one: its retry repeats the failed request's sequence number, so the
    # worker sends the reply the consumer did not get (gRPC). False: a failed client is
    # closed and replaced (a shared-memory connection needs a new handshake).
    retry_in_place: bool = False

    @abc.abstractmethod
    def get_elements(
        self,
        max_elements: int,
        max_bytes: int,
        timeout_s: float,
        consumer_index: int = -1,
        round_index: int = -1,
        trainer_id: str = "",
    ) -> ElementsResult:
        """Returns up to `max_elements` elements (and about `max_bytes` bytes);
        may return none before `timeout_s` seconds pass if none is ready.
        `trainer_id` (non-empty) reads through the task's cross-trainer cache as
        that trainer.

        Raises:
            WorkerError: The pipeline raised on the worker, after the elements it
                produced before (also an instance of the original class; see
                `errors.WorkerError`).
            UnavailableError: The worker cannot be reached.
            NotFoundError: The worker does not know the task.
        """

    def set_compression(self, compression: str) -> None:  # noqa: B027  (optional hook)
        """Asks the worker to compress elements ("zstd"); protocols that move
        bytes within one host (shared memory) ignore it."""

    def close(self) -> None:  # noqa: B027  (optional hook: most clients hold nothing)
        """Frees what the client holds (channels, rings)."""


class TransferUnavailable(Exception):
    """A protocol cannot serve this endpoint (e.g. the shared-memory handshake
    failed); in "auto" mode the client falls back to the next candidate."""


class TransferServer(abc.ABC):
    """The worker side of a protocol other than gRPC (which the worker's own
    gRPC server serves). Created by its factory when the worker starts."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stops serving and frees what it holds (sockets, rings, threads)."""


# factory(endpoint, auth_token, zero_copy=bool[, trainer_id=str]): a protocol
# whose elements are always copies (gRPC) ignores zero_copy; trainer_id is passed
# only for cross-trainer cache reads (a protocol's connection may be bound to it).
ClientFactory = Callable[..., TransferClient]
ServerFactory = Callable[[Any], TransferServer]

_lock = threading.Lock()
_factories: dict[str, ClientFactory] = {}  # guarded by _lock
_server_factories: dict[str, ServerFactory] = {}  # guarded by _lock


def register_protocol(name: str, factory: ClientFactory) -> None:
    """Makes `name` usable as `data_transfer_protocol`."""
    with _lock:
        _factories[name] = factory


def register_server(name: str, factory: ServerFactory) -> None:
    """Makes every worker started from now on serve protocol `name`:
    `factory(worker)` is called in `WorkerServer.start()`."""
    with _lock:
        _server_factories[name] = factory


def server_factories() -> dict[str, ServerFactory]:
    with _lock:
        return dict(_server_factories)


def available_protocols() -> list[str]:
    with _lock:
        return sorted(_factories)


def protocol_candidates(requested: str | None, endpoint: TaskEndpoint) -> list[str]:
    """The protocols to try for `endpoint`, in order.

    None/"auto": shared memory first when the worker is on this host (same
    host id) and "shm" is registered, then gRPC. Anything else: just that one.

    Raises:
        NotFoundError: `requested` is not registered ("... is not available").
    """
    from dataservice.locality import host_id

    if requested in (None, "auto"):
        with _lock:
            has_shm = "shm" in _factories
        if has_shm and endpoint.host_id and endpoint.host_id == host_id():
            return ["shm", "grpc"]
        return ["grpc"]
    with _lock:
        known = requested in _factories
    if not known:
        raise errors.NotFoundError(
            f"data transfer protocol {requested!r} is not available; "
            f"available: {', '.join(available_protocols())}"
        )
    return [requested]  # type: ignore[list-item]


def make_client(
    protocol: str,
    endpoint: TaskEndpoint,
    auth_token: str | None,
    *,
    zero_copy: bool = True,
    trainer_id: str = "",
) -> TransferClient:
    """A client of `protocol` for `endpoint`. `zero_copy=False` makes a protocol
    that can hand out views of shared memory copy every element instead. A
    `trainer_id` makes a client that reads through the task's cross-trainer
    cache (each `get_elements` call then passes the same `trainer_id`).

    Raises:
        NotFoundError: `protocol` is not registered.
        TransferUnavailable: The protocol cannot serve this endpoint.
    """
    with _lock:
        factory = _factories.get(protocol)
    if factory is None:
        raise errors.NotFoundError(f"data transfer protocol {protocol!r} is not available")
    if trainer_id:
        return factory(endpoint, auth_token, zero_copy=zero_copy, trainer_id=trainer_id)
    return factory(endpoint, auth_token, zero_copy=zero_copy)
