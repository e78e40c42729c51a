"""The transfer-protocol registry: how a client fetches a task's elements, and
what a worker gives the servers of its protocols.

A protocol is a name ("grpc"; "shm" plugs in here) and a factory of
`TransferClient`s. The client picks one per task from the iterator's
`data_transfer_protocol` (None/"auto": the best available for that worker,
"grpc", or an explicitly registered name).

On the worker, a protocol other than gRPC registers a `TransferServer` factory
(`register_server`), which the worker calls with one `TransferHost` when it starts,
as tf.data service's data-transfer server registry hands each server one
`GetElement` function: the host's address, token, process id and settings, and
`element_source`, the worker's one decision of which `ElementSource` serves a read
(a task's first come, first served buffer, a coordinated round, or the task's
cross-trainer cache for a trainer). A transfer server knows nothing else of the
worker; this package imports nothing of `worker`, `client` or `dispatcher`
(tests/unit/test_layers.py).
"""

from __future__ import annotations

import abc
import dataclasses
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dataservice import errors

if TYPE_CHECKING:
    from dataservice.transfer.shm import TrainerWindow


@dataclasses.dataclass
class ElementsResult:
    """What one fetch returned.

    Attributes:
        elements: Decoded elements, in the worker's order.
        nbytes: Encoded size of those elements (bytes).
        end_of_sequence: The task has no more elements.
        worker_uid: The serving worker process's id ("" if the protocol does not
            say): when it changes, the worker restarted and the task started over.
        errors_ignored: The task's count of elements `ignore_errors` skipped on that
            worker process so far (`ElementSource.errors_ignored`; 0 if the
            protocol does not say).
    """

    elements: list[Any]
    nbytes: int
    end_of_sequence: bool
    worker_uid: str = ""
    errors_ignored: int = 0


@dataclasses.dataclass(frozen=True)
class TaskRead:
    """What one read of a task's `ElementSource` took, on the worker.

    Attributes:
        elements: Raw elements (nested numpy values, not encoded), in the task's
            order; empty when none was ready within the read's wait.
        end_of_sequence: The source has no element after these.
        error: The pipeline's failure (or the element the codec could not carry),
            reported once the elements before it were read; None if none.
        end_held: These elements end the stream, and the task holds its end for
            its other consumers until the reader calls `ElementSource.release_end()`
            (having given back what its consumer did not take): only from
            `ElementSource.read_holding_end`.
    """

    elements: list[Any]
    end_of_sequence: bool = False
    error: errors.RemoteErrorInfo | None = None
    end_held: bool = False


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    """Which elements of a task a consumer asks for: what chooses its source.

    Attributes:
        task_id: The task read.
        trainer_id: Non-empty: read through the task's cross-trainer cache as this
            trainer (its cursor).
        consumer_index: A coordinated read's consumer (-1: not coordinated).
        round_index: A coordinated read's round (-1: not coordinated).
    """

    task_id: int
    trainer_id: str = ""
    consumer_index: int = -1
    round_index: int = -1


class ElementSource(abc.ABC):
    """Where one consumer's reads of a task take elements from, as the worker chose
    it for a `ReadRequest` (`TransferHost.element_source`). Thread-safe.

    Attributes:
        task_id: The task it reads.
        gives_back: True when a read takes its elements out of the task's buffer
            shared by the task's consumers (first come, first served): elements a
            consumer never got must be handed to `give_back`. False when the source
            keeps them (a trainer's cursor in the cross-trainer cache, a round).
    """

    task_id: int
    gives_back: bool = False

    @abc.abstractmethod
    def read(self, max_elements: int, max_bytes: int, timeout_s: float) -> TaskRead:
        """Takes up to `max_elements` elements (about `max_bytes` payload bytes at
        most, but always one), waiting up to `timeout_s` seconds for the first.

        Raises:
            FailedPreconditionError: The read no longer fits the task (e.g. a
                round every consumer already read).
        """

    def give_back(self, elements: list[Any]) -> None:  # noqa: B027  (optional hook)
        """Puts raw elements taken by `read` and never delivered back at the front
        of the task's buffer, in their order, for the task's other consumers. Only
        meaningful when `gives_back`; other sources keep their elements."""

    def give_back_unacknowledged(self, count: int) -> None:  # noqa: B027  (optional hook)
        """For a source that keeps its elements (not `gives_back`): the consumer's
        connection ended before it acknowledged the last `count` elements of this
        source's last `read`; a trainer's cross-trainer cache read then hands them
        to that trainer's next read. Default: nothing (a round's element is kept)."""

    @property
    def errors_ignored(self) -> int:
        """Elements the task's pipeline skipped so far (`ignore_errors`): read after
        a read, the count its reply carries; final once the read ended the stream.
        Default: 0."""
        return 0

    @property
    def stopped(self) -> bool:
        """The task stopped (the worker dropped it, or is stopping): reads return
        nothing from now on, never an end of sequence. Default: False."""
        return False

    def read_holding_end(self, max_elements: int, max_bytes: int, timeout_s: float) -> TaskRead:
        """As `read`, for a server that learns whether its consumer took a reply (the
        "shm" ring's count): a read whose elements end the stream comes `end_held`,
        and the task's other consumers get no end of sequence until `release_end()`.
        Default: `read` (never held)."""
        return self.read(max_elements, max_bytes, timeout_s)

    def release_end(self) -> None:  # noqa: B027  (optional hook)
        """Ends the hold of an `end_held` read: its consumer took its elements, or
        what it did not take was given back (`give_back`) before this call."""

    def window(self) -> TrainerWindow | None:
        """The cross-trainer cache's shared-memory window for this source's trainer,
        when the cache keeps one (same-host trainers then map it: see
        `shm.TrainerWindow`); None for every other source."""
        return None


@dataclasses.dataclass(frozen=True)
class TransferHost:
    """Everything a worker gives a transfer server (`register_server`'s factory):
    the server may use nothing else of the worker. Source: tf.data service's
    `DataTransferServer::ServerFactoryT`, which gets one `GetElementT` function.

    Attributes:
        address: The worker's "host:port", as advertised to the dispatcher and
            clients (the "shm" endpoint's socket name is derived from it).
        auth_token: The token every client must prove (None: none required).
        worker_uid: Id of the worker process, new at each start (hex string):
            sent to clients, which notice a restarted worker by it.
        element_source: `element_source(request, timeout_s)` returns the
            `ElementSource` that serves `request` (a `ReadRequest`), waiting up to
            `timeout_s` seconds for a task the client heard of before the worker
            (and asking the dispatcher now); None if the task is still unknown then.
            It is the worker's one decision of which source serves a read, shared
            with its gRPC servicer. Thread-safe. Raises `NotFoundError` (the
            dispatcher deleted the task) and `FailedPreconditionError` (the read
            does not fit the task: a trainer read of a task without a cross-trainer
            cache, a plain read of a coordinated task, a consumer index out of
            range).
        shm_ring_bytes: Bytes asked for each shared-memory ring (None: the
            protocol's default); rounded down to a power of two by the server.
        shm_allowed_uids: User ids let into shared memory besides the worker's own
            and root.
        on_sent: `on_sent(protocol, elements, nbytes)` after a server wrote
            elements for a consumer (the worker's metrics); None: not counted.
    """

    address: str
    auth_token: str | None
    worker_uid: str
    element_source: Callable[[ReadRequest, float], ElementSource | None]
    shm_ring_bytes: int | None = None
    shm_allowed_uids: frozenset[int] = frozenset()
    on_sent: Callable[[str, int, int], None] | None = None


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
    # The most bytes one request asks for (one element always comes, whatever its size).
    max_reply_bytes: int = 16 << 20
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

    def request_ahead(
        self, max_elements: int, max_bytes: int, timeout_s: float, trainer_id: str = ""
    ) -> bool:
        """Sends the next request now, before the caller asks for its reply, so that
        the worker prepares it while the consumer uses the last one (pipelining, as
        tf.data service's client keeps requests in flight). The next `get_elements`
        call returns that request's reply (its own arguments are not sent). The caller
        counts the request against its read-ahead: up to `max_elements` elements and
        about `max_bytes` bytes may arrive. `trainer_id` as `get_elements`'s. Not for
        coordinated reads, whose next round differs.

        Returns False, having sent nothing, when this client cannot send a request
        ahead now (the default; a failure to send is left to the next call, which
        then learns the connection's fate)."""
        del max_elements, max_bytes, timeout_s, trainer_id
        return False

    def set_compression(self, compression: str) -> None:  # noqa: B027  (optional hook)
        """Asks the worker to compress elements ("zstd"); protocols that move
        bytes within one host (shared memory) ignore it."""

    def close(self) -> None:  # noqa: B027  (optional hook: most clients hold nothing)
        """Frees what the client holds (channels, rings)."""


def reply_filled(count: int, nbytes: int, max_elements: int, max_bytes: int) -> bool:
    """Whether a reply of `count` elements and `nbytes` bytes filled the request that
    asked for up to `max_elements` elements and `max_bytes` bytes: all the elements,
    or bytes enough that one more element of the reply's mean size would not have fit.
    A reply that did not fill its request waited for the pipeline (the worker had no
    more ready)."""
    return count > 0 and (count >= max_elements or nbytes + nbytes // count > max_bytes)


class TransferUnavailable(Exception):
    """A protocol cannot serve this endpoint (e.g. the shared-memory handshake
    failed); in "auto" mode the client falls back to the next candidate."""


class TransferServer(abc.ABC):
    """The worker side of a protocol other than gRPC (which the worker's own
    gRPC server serves). Created by its factory, from the worker's `TransferHost`,
    when the worker starts."""

    def begin_stop(self) -> None:  # noqa: B027  (optional hook)
        """Takes no new connection or request from now on (returns at once); the
        worker then stops its tasks (waking reads that wait for elements) and calls
        `stop()`. Default: nothing, `stop()` does it all."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stops serving and frees what it holds (sockets, rings, threads) before
        it returns."""


# factory(endpoint, auth_token, zero_copy=bool[, trainer_id=str]): a protocol
# whose elements are always copies (gRPC) ignores zero_copy; trainer_id is passed
# only for cross-trainer cache reads (a protocol's connection may be bound to it).
ClientFactory = Callable[..., TransferClient]
ServerFactory = Callable[[TransferHost], TransferServer]

_lock = threading.Lock()
_factories: dict[str, ClientFactory] = {}  # guarded by _lock
_server_factories: dict[str, ServerFactory] = {}  # guarded by _lock


def _renew_lock_after_fork() -> None:
    """A forked child gets a fresh `_lock`: a thread of the parent may have held
    it at fork, and no thread here would ever release it."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_renew_lock_after_fork)


def register_protocol(name: str, factory: ClientFactory) -> None:
    """Makes `name` usable as `data_transfer_protocol`."""
    with _lock:
        _factories[name] = factory


def register_server(name: str, factory: ServerFactory) -> None:
    """Makes every worker started from now on serve protocol `name`:
    `factory(host)` is called in `WorkerServer.start()` with the worker's
    `TransferHost`; what it raises is logged and the worker serves gRPC only."""
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
