"""gRPC plumbing shared by the dispatcher, workers and clients: channel and
server options, TLS (every channel is made by `make_channel`, every port bound
by `add_port`; see `dataservice.tls`), the auth token, status <-> exception
mapping, and retries.

Message size limits are lifted to 2 GiB - 1 (gRPC's hard limit), so elements
bigger than gRPC's 4 MiB default arrive in one message.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from dataservice import _waits, auth, config, errors, tls
from dataservice.rpc import service_pb2

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 2**31 - 1
AUTH_ENV = auth.AUTH_ENV
ERROR_TYPE_KEY = "ds-error-type"
UNREACHABLE_ENV = "DATASERVICE_UNREACHABLE_TIMEOUT_MS"
DEFAULT_UNREACHABLE_TIMEOUT_MS = 8_000  # with DNS and start-up, an error within 10 s
# The first attempt of a dispatcher RPC; each after a timed-out one gets twice as long.
DISPATCHER_ATTEMPT_S = 10.0
# A large dispatcher request (a pipeline capturing big arrays) gets a second per this
# many bytes on its first attempt, and the client timeout is raised to that sending
# time: resent at a fixed deadline, a request of a GB was sent, parsed and stored
# again and again until the client timeout (a pessimistic link, and the dispatcher
# storing it).
LARGE_REQUEST_BYTES_PER_S = 10_000_000
# A dispatcher request at least this large, to a dispatcher this process never
# reached, is preceded by a small GetDispatcherInfo (see `call_dispatcher`).
PROBE_FIRST_BYTES = 64 << 10

# Addresses that answered an RPC of this process (see `was_reached`).
_REACHED_MU = threading.Lock()
_REACHED: set[str] = set()  # guarded by _REACHED_MU
# The TLS settings of the last channel made to each address (None: plaintext), for
# the errors of a failed handshake. Guarded by _REACHED_MU.
_CHANNEL_TLS: dict[str, tls.ClientTls | None] = {}


def _renew_reached_mu_after_fork() -> None:
    """A forked child gets a fresh `_REACHED_MU`: a thread of the parent may have held
    it at fork, and no thread here would ever release it."""
    global _REACHED_MU
    _REACHED_MU = threading.Lock()


os.register_at_fork(after_in_child=_renew_reached_mu_after_fork)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
    # Reconnect quickly after a server restart (tests restart dispatchers).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# Keepalive of the data channels (a consumer's to its workers): while a call is in
# flight the client pings every DATA_KEEPALIVE_TIME_MS and closes the connection
# when a ping is not acknowledged within DATA_KEEPALIVE_TIMEOUT_MS, so a read from
# a worker whose link went dead (cable, host, partition: no RST ever comes) fails
# with UNAVAILABLE in ~10 s, instead of waiting for TCP's retransmission timeout
# (~15 min) or a reply's no-progress timeout. Idle connections send no pings.
DATA_KEEPALIVE_TIME_MS = 5_000
DATA_KEEPALIVE_TIMEOUT_MS = 5_000

SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Accept the data channels' keepalive pings during long polls, when no data
    # flows (gRPC's default allows one per 5 min and then sends GOAWAY).
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
]

T = TypeVar("T")

_STATUS_BY_ERROR: dict[type[errors.DataServiceError], grpc.StatusCode] = {
    errors.InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExistsError: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DispatcherRestartedError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.OutOfRangeError: grpc.StatusCode.OUT_OF_RANGE,
    errors.UnavailableError: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DataLossError: grpc.StatusCode.DATA_LOSS,
    errors.UnimplementedError: grpc.StatusCode.UNIMPLEMENTED,
    errors.CancelledError: grpc.StatusCode.CANCELLED,
    # Not UNAVAILABLE: the workers are gone for good, retrying cannot help.
    errors.WorkerCrashedError: grpc.StatusCode.ABORTED,
}

# CANCELLED: a server that stops cancels its in-flight RPCs (a restart).
RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


def parse_address(service: str) -> str:
    """'grpc://host:port' or 'host:port' -> 'host:port'.

    Raises:
        ValueError: Empty, several '://', a protocol other than grpc, no port,
            or a port outside [1, 65535].
    """
    if not isinstance(service, str):
        raise ValueError(f"`service` must be a string, got {service!r}")
    if not service:
        raise ValueError("`service` must not be empty")
    parts = service.split("://")
    if len(parts) > 2:
        raise ValueError(f"Malformed `service` string has multiple '://': {service}")
    if len(parts) == 2:
        protocol, address = parts
        if protocol != "grpc":
            raise ValueError(
                f"Unknown protocol {protocol!r} in service {service!r}: "
                "no credentials factory is registered for it; use 'grpc://host:port'"
            )
    else:
        address = parts[0]
    if ":" not in address or not address.rsplit(":", 1)[1].isdigit():
        raise ValueError(f"`service` must be 'host:port' or 'grpc://host:port', got {service!r}")
    config.check_address_port(address, "the dispatcher address")
    return address


def token_from_env(token: str | None = None) -> str | None:
    """The auth token to send: the one given, else $DATASERVICE_AUTH_TOKEN
    (clients of a known dispatcher use `auth.client_token`, which also
    consults the tokens of this process's `LocalCluster`s)."""
    return auth.client_token(None, token)


def call_metadata(token: str | None) -> list[tuple[str, str]] | None:
    return [("authorization", auth.bearer(token))] if token else None


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses, UNAUTHENTICATED, every RPC that lacks the configured token
    (compared in constant time by `auth.bearer_ok`), and logs the refused
    peer at WARNING (once per peer host per minute).

    Args:
        token: The token every call must carry.
        kind: "dispatcher" or "worker", for the log line.
    """

    def __init__(
        self, token: str, kind: str = "server", on_refused: Callable[[], None] | None = None
    ) -> None:
        self._token = token
        self._refusals = auth.RefusalLog(kind)

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            peer = context.peer() or "unknown peer"
            if on_refused is not None:
                on_refused()
            self._refusals.refused(peer, "missing or wrong auth token", auth.grpc_peer_host(peer))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and auth.bearer_ok(value, self._token):
                return continuation(handler_call_details)
        return self._deny


def server_interceptors(
    token: str | None, kind: str, on_refused: Callable[[], None] | None = None
) -> list[grpc.ServerInterceptor]:
    """The interceptors of a server that requires `token` (none without one);
    `on_refused` is called at each refused RPC (the auth refusals metric)."""
    return [AuthInterceptor(token, kind, on_refused)] if token else []


_FROM_ENV: Any = object()


def make_channel(
    address: str,
    client_tls: tls.ClientTls | None = _FROM_ENV,
    options: list[tuple[str, Any]] | None = None,
) -> grpc.Channel:
    """A channel to `address` ("host:port"): TLS when the client has a CA to
    trust, else plaintext (see `dataservice.tls`).

    Args:
        client_tls: The client's TLS settings (None: plaintext); by default
            those of the environment (`tls.client_tls()`: $DATASERVICE_TLS_CA...).
        options: gRPC channel options added to `CHANNEL_OPTIONS`.

    Raises:
        ValueError: (settings from the environment) a TLS file cannot be read
            or is not PEM; the message names it.
    """
    if client_tls is _FROM_ENV:
        client_tls = tls.client_tls()
    with _REACHED_MU:
        _CHANNEL_TLS[address] = client_tls
    opts = [*CHANNEL_OPTIONS, *(options or [])]
    if client_tls is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(
        address, client_tls.credentials(), options=[*opts, *client_tls.channel_options()]
    )


# Channels `shared_channel` made: (address, TLS settings, options) -> channel, for the
# process whose pid is _SHARED_PID (a forked child makes its own). Guarded by _REACHED_MU.
_SHARED: dict[tuple[str, tls.ClientTls | None, tuple[tuple[str, Any], ...]], grpc.Channel] = {}
_SHARED_PID = os.getpid()


def shared_channel(address: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
    """A channel to `address` as `make_channel(address, options=options)` makes (TLS
    from the environment), one per address, TLS settings and options for the whole
    process: its callers never close it (a caller that must end its calls cancels
    them). A new iterator's calls then skip a channel's set-up (measured: a first
    call on a new channel 2.5 ms, on this one 1.0 ms); the connection is the same
    either way (gRPC shares it between channels of equal settings). A channel
    reconnects by itself after a server restart (within
    `grpc.max_reconnect_backoff_ms`). A forked child gets channels of its own: gRPC's
    are not usable across fork.

    Raises:
        ValueError: As `make_channel`.
    """
    global _SHARED_PID
    client_tls = tls.client_tls()
    key = (address, client_tls, tuple(options or ()))
    with _REACHED_MU:
        if _SHARED_PID != os.getpid():
            _SHARED.clear()  # the parent's, unusable here: dropped, not closed
            _SHARED_PID = os.getpid()
        channel = _SHARED.get(key)
        if channel is not None:
            _CHANNEL_TLS[address] = client_tls
            return channel
    channel = make_channel(address, client_tls, options)
    with _REACHED_MU:
        existing = _SHARED.setdefault(key, channel)
    if existing is not channel:
        channel.close()  # another thread made one first
    return existing


def channel_uses_tls(address: str) -> bool:
    """Whether the last channel made to `address` speaks TLS."""
    with _REACHED_MU:
        return _CHANNEL_TLS.get(address) is not None


def add_port(server: grpc.Server, bind: str, credentials: grpc.ServerCredentials | None) -> int:
    """Binds `bind` ("host:port") on `server`, TLS when `credentials` are given
    (`tls.server_credentials`); returns the port (0: not bound). A server of this
    process marked gone on that port (`mark_gone`: an earlier LocalCluster's) is
    not there any more: calls to the new one must not fail with its reason."""
    if credentials is None:
        port = server.add_insecure_port(bind)
    else:
        port = server.add_secure_port(bind, credentials)
    if port:
        mark_back_port(port)
    return port


def tls_error(address: str, what: str, details: str) -> errors.UnavailableError | None:
    """The error for a first connection to `address` that failed at the TLS
    layer (a plaintext client at a TLS server, an untrusted certificate, a
    refused client certificate...), or None when `details` say otherwise."""
    with _REACHED_MU:
        if address not in _CHANNEL_TLS:
            return None
        client = _CHANNEL_TLS[address]
    message = tls.handshake_error(address, details, client, what)
    return errors.UnavailableError(message) if message else None


# gRPC's details when the server at the address answered in another protocol
# (an HTTP/1.x server, a database...): its first bytes are not an HTTP/2 frame.
_NOT_HTTP2 = ("Failed parsing HTTP/2", "Expected SETTINGS frame")


def not_grpc_error(address: str, what: str, details: str) -> errors.UnavailableError | None:
    """The error for a call whose server answered in another protocol than
    gRPC's HTTP/2 (`details` say so), or None. No retry changes that answer:
    callers raise it at the first such failure instead of retrying until their
    unreachable timeout."""
    if not any(mark in details for mark in _NOT_HTTP2):
        return None
    return errors.UnavailableError(
        f"{what}: the server at {address} is not a dataservice server: it answered in "
        f"another protocol than gRPC's HTTP/2 (an HTTP/1 server, or another service); "
        f"is the address right? ({details})"
    )


def data_channel_options(keepalive: bool = True) -> list[tuple[str, Any]]:
    """The data channels' keepalive (`DATA_KEEPALIVE_TIME_MS`), added to
    `CHANNEL_OPTIONS`; none when `keepalive` is False."""
    if not keepalive:
        return []
    return [
        ("grpc.keepalive_time_ms", DATA_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", DATA_KEEPALIVE_TIMEOUT_MS),
        # (what bounds the wait for a ping's ack in gRPC >= 1.5x; 60 s by default)
        ("grpc.http2.ping_timeout_ms", DATA_KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging a long poll
    ]


def make_data_channel(
    address: str, *options: tuple[str, Any], keepalive: bool = True
) -> grpc.Channel:
    """A channel to a worker's data service (`make_channel`: TLS as configured),
    with keepalive (`data_channel_options`).

    A ping's ack queues behind the data the worker already wrote: over a link
    slower than the worker's replies it can take longer than the keepalive
    timeout while the link is alive, so a client that found its link slow (a
    reply's no-progress timeout) connects again without keepalive
    (`keepalive=False`); the no-progress timeouts judge that link.
    """
    return make_channel(address, options=[*data_channel_options(keepalive), *options])


def shared_data_channel(address: str) -> grpc.Channel:
    """`make_data_channel(address)` (with keepalive), as `shared_channel` shares it."""
    return shared_channel(address, data_channel_options(True))


def abort_with(context: grpc.ServicerContext, err: BaseException) -> None:
    """Ends an RPC with the status that matches `err`, keeping its class name."""
    code = grpc.StatusCode.INTERNAL
    for cls in type(err).__mro__:
        if cls in _STATUS_BY_ERROR:
            code = _STATUS_BY_ERROR[cls]  # type: ignore[index]
            break
    if isinstance(err, ValueError) and code is grpc.StatusCode.INTERNAL:
        code = grpc.StatusCode.INVALID_ARGUMENT
    context.set_trailing_metadata(((ERROR_TYPE_KEY, type(err).__name__),))
    context.abort(code, str(err))


_GRPC_NO_METHOD = "Method not found!"
"""gRPC's own UNIMPLEMENTED details: the server registers no such service/method."""

_SERVICE_OF_METHOD = {
    m.name: service.name
    for service in service_pb2.DESCRIPTOR.services_by_name.values()
    for m in service.methods
}
_OTHER_SERVER = {
    "DispatcherService": ("dispatcher", "is it a worker's address?"),
    "WorkerService": ("worker", "is it the dispatcher's address?"),
}


def _wrong_server_message(address: str, what: str) -> str | None:
    """The error for a call that reached a server without the method's
    service (a worker's address given as the dispatcher's), or None when
    `what` names no method of ours."""
    service = _SERVICE_OF_METHOD.get(what.split(" ", 1)[0].rstrip(":"))
    if service is None:
        return None
    kind, hint = _OTHER_SERVER[service]
    return (
        f"{what}: the server at {address} is not a dataservice {kind} "
        f"(it does not serve {service}; {hint})"
    )


def to_error(err: grpc.RpcError, address: str, what: str) -> errors.DataServiceError:
    """Turns a failed RPC into the matching `DataServiceError`, naming the address."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    type_name = ""
    for key, value in (err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") else ():
        if key == ERROR_TYPE_KEY:
            type_name = value
    cls: type[errors.DataServiceError] = errors.error_class(type_name)
    if cls is errors.DataServiceError:
        for known, status in _STATUS_BY_ERROR.items():
            if status == code:
                cls = known
                break
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.UnauthenticatedError(auth.refused_message(address, what))
    if code == grpc.StatusCode.UNIMPLEMENTED and details == _GRPC_NO_METHOD:
        wrong = _wrong_server_message(address, what)
        if wrong:
            return errors.UnimplementedError(wrong)
    if code in RETRYABLE:
        return cls(f"{what} at {address} failed: {details}")
    if not type_name:
        # Not our server's own error (which names what it refused): gRPC's, or another
        # HTTP/2 server's at that address; say where it came from.
        hint = ""
        if "http2 header with status" in details:
            hint = (
                ": the server there is not a dataservice server (another HTTP/2 service "
                "or a proxy answered); is the address right?"
            )
        return cls(f"{what} at {address} failed: {details}{hint}")
    return cls(details)


class Backoff:
    """Exponential backoff with jitter, from `initial_s` up to `max_s`."""

    def __init__(self, initial_s: float = 0.05, max_s: float = 1.0) -> None:
        self._next = initial_s
        self._max = max_s

    def sleep(self, deadline: float, stop: threading.Event | None = None) -> None:
        delay = min(self._next * (0.5 + random.random()), max(0.0, deadline - time.monotonic()))
        self._next = min(self._next * 2, self._max)
        if stop is not None:
            stop.wait(delay)
        else:
            time.sleep(delay)


# Servers this process saw end for good (a LocalCluster's dispatcher process that
# exited): address -> (why, whether its workers ended with it). Guarded by _REACHED_MU.
_GONE: dict[str, tuple[str, bool]] = {}


def mark_gone(address: str, why: str, *, with_its_workers: bool = False) -> None:
    """Notes that the server at `address` ended for good (`why` says how): calls
    to it fail at their next failed try with that reason instead of retrying for
    their whole timeout, until a server answers there again (`mark_reached`) or
    `mark_back`. `with_its_workers`: a dispatcher whose workers were stopped
    with it (a stopped LocalCluster), so a read in progress has nothing left to
    read from (`gone_with_its_workers`)."""
    with _REACHED_MU:
        _GONE[address] = (why, with_its_workers)


def mark_back(address: str) -> None:
    """A server serves at `address` again (undoes `mark_gone`)."""
    with _REACHED_MU:
        _GONE.pop(address, None)


def mark_back_port(port: int) -> None:
    """A server of this process serves on `port` again: `mark_back` for every
    address on that port (the gone ones are this process's own servers)."""
    suffix = f":{port}"
    with _REACHED_MU:
        for address in [a for a in _GONE if a.endswith(suffix)]:
            del _GONE[address]


def gone_reason(address: str) -> str | None:
    """Why the server at `address` ended for good, if `mark_gone` said so."""
    with _REACHED_MU:
        gone = _GONE.get(address)
    return gone[0] if gone is not None else None


def gone_with_its_workers(address: str) -> bool:
    """Whether the dispatcher at `address` ended for good with its workers
    (`mark_gone(..., with_its_workers=True)`)."""
    with _REACHED_MU:
        gone = _GONE.get(address)
    return gone is not None and gone[1]


def mark_reached(address: str) -> None:
    """Notes that `address` answered an RPC in this process (see `was_reached`); a
    server marked gone there (`mark_gone`) is back."""
    with _REACHED_MU:
        _REACHED.add(address)
        _GONE.pop(address, None)


def was_reached(address: str) -> bool:
    """Whether `address` ever answered an RPC of this process: a server that
    answered once and now refuses is restarting (retried up to the caller's
    full timeout); one that never answered is likely a wrong address (given
    up after `unreachable_timeout_ms()`)."""
    with _REACHED_MU:
        return address in _REACHED


def unreachable_timeout_ms(value: int | None = None) -> int:
    """The bound on retrying an address that never answered: `value`, else
    $DATASERVICE_UNREACHABLE_TIMEOUT_MS, else 8 s.

    Raises:
        ValueError: Not a positive int (the message names the variable).
    """
    if value is not None:
        return value
    return _waits.env_ms(UNREACHABLE_ENV, DEFAULT_UNREACHABLE_TIMEOUT_MS)


def server_answered(err: grpc.RpcError) -> bool:
    """Whether a failed RPC's status came from the server (it was reached):
    any status but UNAVAILABLE / DEADLINE_EXCEEDED / CANCELLED, or one of
    those raised by our own servicer (it tags its errors with their type)."""
    code = err.code() if hasattr(err, "code") else None
    if code not in RETRYABLE:
        return True
    metadata = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    return any(key == ERROR_TYPE_KEY for key, _ in metadata or ())


def unreachable_error(
    what: str, address: str, waited_ms: int, details: str
) -> errors.UnavailableError:
    """The error for an address that never answered: names it and what was called."""
    host, _, port = address.rpartition(":")
    hint = "check the address and that the server is running"
    if host in ("localhost", "127.0.0.1", "::1", "[::1]"):
        hint = (
            f"{host!r} is this machine: nothing here answers on port {port} (a server on "
            "another host needs that host's name)"
        )
    return errors.UnavailableError(
        f"{what}: cannot reach {address}: it never answered within {waited_ms} ms ({details}); "
        f"{hint}"
    )


def call_with_retries(
    fn: Callable[..., T],
    *,
    address: str,
    what: str,
    timeout_ms: int,
    stop: threading.Event | None = None,
    attempt_timeout_s: float | None = None,
    unreachable_ms: int | None = None,
) -> T:
    """Calls `fn` (one RPC), retrying UNAVAILABLE / DEADLINE_EXCEEDED with
    backoff for up to `timeout_ms` milliseconds, or `unreachable_timeout_ms()`
    (8 s by default) if `address` never answered in this process (refused,
    unresolvable, no route: most likely a wrong address). A wait past
    `_waits.FIRST_WARNING_S` logs a WARNING naming `what` and `address`.

    Args:
        fn: Makes one attempt; called as `fn(timeout_s)` with the attempt's
            gRPC deadline if `attempt_timeout_s` is given (at most that, less
            near the end of the wait), else as `fn()`. An attempt that ran out
            of its deadline at a server that answered before makes the next one's
            twice as long (a large request or response over a slow link cannot
            fit a fixed deadline: it would be resent until `timeout_ms`).

    Raises:
        UnavailableError: Still unreachable after the bound; names `address`.
        CancelledError: `stop` was set while retrying.
        DataServiceError: The RPC failed for another reason (matching subclass).
    """
    start = time.monotonic()
    deadline = start + timeout_ms / 1000
    fast_ms = min(timeout_ms, unreachable_timeout_ms(unreachable_ms))
    fast_deadline = start + fast_ms / 1000
    backoff = Backoff()
    last = [""]
    attempt_s = attempt_timeout_s
    tried_s = 0.0  # the last attempt's deadline (s): attempt_s, or less near the end

    def describe() -> str:
        longer = ""
        if (
            attempt_s is not None
            and attempt_timeout_s is not None
            and attempt_s > attempt_timeout_s
        ):
            longer = f", each try now {attempt_s:.0f} s (the answer may be large, the link slow)"
        return (
            f"{what}: no answer from {address} ({last[0]}); retrying for up to "
            f"{timeout_ms} ms{longer}"
        )

    slow = _waits.SlowWait(log, describe, start=start)
    while True:
        reached = was_reached(address)
        end = deadline if reached else fast_deadline
        try:
            if attempt_s is None:
                result = fn()
            else:
                tried_s = min(attempt_s, max(0.05, end - time.monotonic()))
                result = fn(tried_s)
        except grpc.RpcError as err:
            if server_answered(err):
                mark_reached(address)
            if err.code() not in RETRYABLE:  # type: ignore[attr-defined]
                slow.done(f"{what}: {address} answered")
                raise to_error(err, address, what) from None
            details = f"{err.code().name}: {err.details()}"  # type: ignore[attr-defined]
            if not last[0]:
                # A TLS mismatch fails every try alike: say so at the first, not after
                # the unreachable timeout.
                mismatch = tls_error(address, what, details) or not_grpc_error(
                    address, what, details
                )
                if mismatch is not None:
                    raise mismatch from None
            last[0] = details
            gone = gone_reason(address)
            if gone is not None:
                raise errors.UnavailableError(f"{what} at {address} failed: {gone}") from None
            now = time.monotonic()
            if not was_reached(address) and now >= fast_deadline:
                raise unreachable_error(what, address, fast_ms, details) from None
            timed_out = err.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
            if now >= deadline:
                if timed_out and attempt_s is not None and was_reached(address):
                    # (UnavailableError as before: callers treat it as the dispatcher gone)
                    raise errors.UnavailableError(
                        f"{what}: {address} gave no complete answer within {timeout_ms} ms "
                        f"(the last try had {tried_s:.1f} s; {details}): the server is "
                        "stuck, or the request or answer is too large for the link"
                    ) from None
                raise errors.UnavailableError(
                    f"{what}: could not reach {address} within {timeout_ms} ms ({details})"
                ) from None
            if timed_out and attempt_s is not None and was_reached(address):
                attempt_s = min(2 * attempt_s, timeout_ms / 1000)
            if stop is not None and stop.is_set():
                raise errors.CancelledError(f"{what} to {address} cancelled") from None
            slow.check(now)
            backoff.sleep(deadline if was_reached(address) else fast_deadline, stop)
            continue
        mark_reached(address)
        slow.done(f"{what}: {address} answered")
        return result


def call_dispatcher(
    stub: Any,
    method: str,
    request: Any,
    *,
    address: str,
    metadata: list[tuple[str, str]] | None,
    timeout_ms: int,
    stop: threading.Event | None = None,
    unreachable_ms: int | None = None,
) -> Any:
    """`stub.<method>(request)` on the dispatcher, retried as `call_with_retries`
    for up to `timeout_ms` (`unreachable_ms` for a dispatcher that never
    answered; the first attempt bounded at `DISPATCHER_ATTEMPT_S`, plus a second
    per `LARGE_REQUEST_BYTES_PER_S` bytes of the request, each one after a
    timed-out one twice as long; `timeout_ms` is raised to at least that second
    per `LARGE_REQUEST_BYTES_PER_S` bytes).

    Raises:
        UnavailableError: As `call_with_retries`; when every attempt at a
            dispatcher that answered before ran out of its deadline until
            `timeout_ms`, the message says so (stuck, or a request or answer too
            large for the link) and names the last attempt's deadline.
        CancelledError, DataServiceError: As `call_with_retries`.
    """
    fn = getattr(stub, method)
    size = request.ByteSize()
    sending_s = size / LARGE_REQUEST_BYTES_PER_S
    attempt_s = DISPATCHER_ATTEMPT_S + sending_s
    timeout_ms = max(timeout_ms, int(sending_s * 1000))  # (a small request: as given)
    if size >= PROBE_FIRST_BYTES and not was_reached(address):
        # A large request that a slow link holds up past its deadline would be taken
        # for a wrong address (given up after the unreachable timeout): a small call
        # first tells the two apart.
        info = stub.GetDispatcherInfo
        call_with_retries(
            lambda timeout_s: info(
                service_pb2.DispatcherInfoRequest(), timeout=timeout_s, metadata=metadata
            ),
            address=address,
            what="GetDispatcherInfo to the dispatcher",
            timeout_ms=timeout_ms,
            stop=stop,
            attempt_timeout_s=DISPATCHER_ATTEMPT_S,
            unreachable_ms=unreachable_ms,
        )
    return call_with_retries(
        lambda timeout_s: fn(request, timeout=timeout_s, metadata=metadata),
        address=address,
        what=f"{method} to the dispatcher" + (f" ({size} bytes)" if size >= 1 << 20 else ""),
        timeout_ms=timeout_ms,
        stop=stop,
        attempt_timeout_s=attempt_s,
        unreachable_ms=unreachable_ms,
    )
