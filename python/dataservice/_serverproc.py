"""A server process's contract with whoever starts it (`LocalCluster`, scripts).

Two lines on stdout, written by `dataservice dispatcher|worker` (cli.py) and
read by its launcher (cluster.py, through `_proc.OutputPump`):

* the ready line, `dataservice dispatcher listening on 127.0.0.1:5050`, once
  the server serves (a worker: once registered); `READY_RE` matches it, group 2
  is the address ("host:port"). A server bound to every interface (`--host
  0.0.0.0`) names an address other hosts can use (this host's name or primary
  IP, `advertised_address`) and adds ` (on all interfaces, 0.0.0.0)`. A
  dispatcher bound to port 0 tells its launcher the chosen port this way, so
  there is no port race.
* the first-element line, `dataservice worker handed out its first element`,
  once per worker process, before that element leaves it; `FIRST_ELEMENT_RE`
  matches it (`LocalCluster`'s sign that a restarted worker made progress).

Both are written whole under one lock (`announce_ready`,
`announce_first_element`), so a line never interleaves with the other.

`DispatcherStub` is how these tools talk to a dispatcher they did not build a
client for: the CLI worker waits for it to be reachable, `LocalCluster`
reports worker exits to it. gRPC is imported when a stub is opened, so the
CLI's flag parsing does not load it.
"""

from __future__ import annotations

import re
import sys
import threading
from types import TracebackType
from typing import Any

from dataservice._netaddr import WILDCARD_HOSTS

READY_RE = re.compile(r"^dataservice (dispatcher|worker) listening on (\S+)")
"""Matches the ready line; group 1 is the kind, group 2 the address ("host:port")."""

FIRST_ELEMENT_LINE = "dataservice worker handed out its first element"
FIRST_ELEMENT_RE = re.compile("^" + re.escape(FIRST_ELEMENT_LINE) + "$")
"""Matches the line a worker prints when it hands out its first element."""

_STDOUT_MU = threading.Lock()  # whole lines: the ready line and the first-element line


def ready_line(
    kind: str, address: str, bound_host: str | None = None, metrics_port: int | None = None
) -> str:
    """The ready line of a `kind` ("dispatcher" or "worker") server at `address`
    ("host:port"), without its newline; `READY_RE` matches it. With a
    wildcard `bound_host` the line says so after the address; with a
    `metrics_port`, " (metrics on port N)" follows (METRICS_RE)."""
    line = f"dataservice {kind} listening on {address}"
    if bound_host is not None and bound_host in WILDCARD_HOSTS:
        line += f" (on all interfaces, {bound_host or '0.0.0.0'})"
    if metrics_port is not None:
        line += f" (metrics on port {metrics_port})"
    return line


METRICS_RE = re.compile(r"\(metrics on port (\d+)\)")
"""Finds the metrics port in a ready line (group 1)."""


def announce_ready(
    kind: str, address: str, bound_host: str | None = None, metrics_port: int | None = None
) -> None:
    """Writes `ready_line(kind, address, bound_host, metrics_port)` to stdout and
    flushes it."""
    with _STDOUT_MU:
        print(ready_line(kind, address, bound_host, metrics_port), flush=True)


def reachable_host() -> str:
    """A name other hosts can use for this one (`_netaddr.reachable_host`)."""
    from dataservice import _netaddr

    return _netaddr.reachable_host()


def advertised_address(address: str, bound_host: str) -> str:
    """`address` ("host:port") with a wildcard or loopback placeholder host
    replaced by `reachable_host()` when the server bound `bound_host` is a
    wildcard (every interface); else `address` unchanged."""
    if bound_host not in WILDCARD_HOSTS:
        return address
    _, _, port = address.rpartition(":")
    return f"{reachable_host()}:{port}"


def announce_first_element() -> None:
    """Writes `FIRST_ELEMENT_LINE` to stdout and flushes it (called on the
    worker's serving thread, before the element is sent)."""
    with _STDOUT_MU:
        sys.stdout.write(FIRST_ELEMENT_LINE + "\n")
        sys.stdout.flush()


def strip_scheme(target: str) -> str:
    """'grpc://host:port' -> 'host:port'; 'host:port' unchanged."""
    return target.split("://", 1)[1] if "://" in target else target


class DispatcherStub:
    """A channel to the dispatcher at `address` ('host:port' or
    'grpc://host:port') and its `DispatcherService` stub, with the call metadata
    of `auth_token` (None: no token). Closes the channel on `close()` or at the
    end of a `with` block. Thread-safe (gRPC channels and stubs are).

    Attributes:
        address: 'host:port'.
        stub: the `service_pb2_grpc.DispatcherServiceStub`.
        metadata: what each call sends (`rpc.util.call_metadata`).
    """

    def __init__(self, address: str, auth_token: str | None = None, client_tls: Any = None) -> None:
        from dataservice.rpc import service_pb2_grpc
        from dataservice.rpc import util as rpc_util

        self.address = strip_scheme(address)
        self.metadata = rpc_util.call_metadata(auth_token)
        # client_tls: a `tls.ClientTls` (None: the environment's, $DATASERVICE_TLS_CA).
        self._client_tls = client_tls
        self._channel = self._new_channel()
        self.stub: Any = service_pb2_grpc.DispatcherServiceStub(self._channel)

    def wait_connected(self, timeout_ms: int, what: str) -> None:
        """Blocks until a TCP/HTTP2 connection to the dispatcher is up (no RPC
        is made, so no token is checked), for at most `timeout_ms` milliseconds.
        A wait past `_waits.FIRST_WARNING_S` logs a WARNING naming `what`, the
        address and gRPC's last reason (refused, DNS resolution failed...).

        Raises:
            UnavailableError: Not connected within `timeout_ms`, with gRPC's
                last reason; or at once, a TLS handshake that failed
                (`rpc.util.tls_error`: plaintext to a TLS server, an untrusted
                certificate...) or a server that answered in another protocol
                (`rpc.util.not_grpc_error`). The message names `what` waited
                and the address.
        """
        import logging
        import time

        import grpc  # type: ignore[import-untyped,unused-ignore]

        from dataservice import _waits
        from dataservice.rpc import util as rpc_util

        start = time.monotonic()
        future = grpc.channel_ready_future(self._channel)
        deadline = start + timeout_ms / 1000
        try:
            # A connection not up within a moment may be a TLS mismatch, which no wait
            # cures: one RPC's failure details tell.
            future.result(timeout=min(0.5, timeout_ms / 1000))
            return
        except grpc.FutureTimeoutError:
            pass
        reason = self._why_not_connected()

        def describe() -> str:  # reads `reason` as the loop last set it
            return f"{what}: no connection to {self.address} yet ({reason})"

        slow = _waits.SlowWait(logging.getLogger(__name__), describe, start=start)
        while True:
            # Every try, not only the first: a name with several addresses
            # (localhost: ::1 refused, 127.0.0.1 an HTTP server) reports whichever
            # failed last, and only some tries show the mismatch.
            mismatch = rpc_util.tls_error(self.address, what, reason) or (
                rpc_util.not_grpc_error(self.address, what, reason)
            )
            if mismatch is not None:
                future.cancel()
                raise mismatch from None
            left = deadline - time.monotonic()
            if left <= 0:
                future.cancel()
                raise rpc_util.unreachable_error(what, self.address, timeout_ms, reason) from None
            try:
                future.result(timeout=min(left, 0.5))
            except grpc.FutureTimeoutError:
                slow.check()
                reason = self._why_not_connected()
                continue
            slow.done(f"{what}: connected to {self.address}")
            return

    def _new_channel(self, options: list[tuple[str, Any]] | None = None) -> Any:
        from dataservice.rpc import util as rpc_util

        if self._client_tls is None:
            return rpc_util.make_channel(self.address, options=options)
        return rpc_util.make_channel(self.address, self._client_tls, options=options)

    def _why_not_connected(self) -> str:
        """gRPC's reason the dispatcher cannot be reached ("UNAVAILABLE: DNS
        resolution failed for ...", "... Connection refused", "Failed parsing
        HTTP/2"): the details of one GetDispatcherInfo that fails before reaching
        the servicer (so no token is checked), or "no connection" when it gives
        none. Made on a channel of its own, with its own connections: the
        waiting channel's connections back off after a failure, and a name of
        several addresses (localhost: ::1 refused, 127.0.0.1 an HTTP server)
        would then report only the address tried last."""
        import grpc  # type: ignore[import-untyped,unused-ignore]

        from dataservice.rpc import service_pb2, service_pb2_grpc

        channel = self._new_channel([("grpc.use_local_subchannel_pool", 1)])
        try:
            service_pb2_grpc.DispatcherServiceStub(channel).GetDispatcherInfo(
                service_pb2.DispatcherInfoRequest(), timeout=1.0, metadata=self.metadata
            )
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}"  # type: ignore[attr-defined]
        finally:
            channel.close()
        return "no connection"

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DispatcherStub:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
