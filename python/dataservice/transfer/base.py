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
    """

    elements: list[Any]
    nbytes: int
    end_of_sequence: bool


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

    @abc.abstractmethod
    def get_elements(
        self,
        max_elements: int,
        max_bytes: int,
        timeout_s: float,
        consumer_index: int = -1,
        round_index: int = -1,
    ) -> ElementsResult:
        """Returns up to `max_elements` elements (and about `max_bytes` bytes);
        may return none before `timeout_s` seconds pass if none is ready.

        Raises:
            WorkerError: The pipeline raised on the worker (original type name kept).
            UnavailableError: The worker cannot be reached.
            NotFoundError: The worker does not know the task.
        """

    def close(self) -> None:
        """Frees what the client holds (channels, rings)."""


ClientFactory = Callable[[TaskEndpoint, "str | None"], TransferClient]

_lock = threading.Lock()
_factories: dict[str, ClientFactory] = {}  # guarded by _lock


def register_protocol(name: str, factory: ClientFactory) -> None:
    """Makes `name` usable as `data_transfer_protocol`."""
    with _lock:
        _factories[name] = factory


def available_protocols() -> list[str]:
    with _lock:
        return sorted(_factories)


def resolve_protocol(requested: str | None, endpoint: TaskEndpoint) -> str:
    """The protocol to use for `endpoint`: `requested`, or for None/"auto" the
    best registered one that can reach the worker.

    Raises:
        NotFoundError: `requested` is not registered ("... is not available").
    """
    if requested in (None, "auto"):
        return "grpc"
    with _lock:
        known = requested in _factories
    if not known:
        raise errors.NotFoundError(
            f"data transfer protocol {requested!r} is not available; "
            f"available: {', '.join(available_protocols())}"
        )
    return requested  # type: ignore[return-value]


def make_client(protocol: str, endpoint: TaskEndpoint, auth_token: str | None) -> TransferClient:
    with _lock:
        factory = _factories.get(protocol)
    if factory is None:
        raise errors.NotFoundError(f"data transfer protocol {protocol!r} is not available")
    return factory(endpoint, auth_token)
