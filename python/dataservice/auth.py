"""The auth token: where a server or client gets it, how every entry point
checks it, and how refusals are logged. See SECURITY.md for the threat model.

Registering a dataset runs its code on the workers and the dispatcher, so the
token is the boundary between the holders of it and anyone else who can reach
a port or a worker's shared-memory socket. Every entry point checks it through
this module:

* gRPC (dispatcher and worker): metadata `authorization: Bearer <token>`
  (`bearer_ok`, used by `rpc.util.AuthInterceptor`); the metrics endpoint
  (metrics.py) checks its HTTP `Authorization` header with the same function.
* The shared-memory handshake (transfer/shm.py): the worker sends a random
  challenge, the client answers HMAC-SHA256(token, challenge)
  (`challenge_response` / `challenge_ok`), so the token itself never crosses
  the socket.

Comparisons are constant-time (`hmac.compare_digest`).

Where the token comes from (`resolve_token`, one order for every server): the
config's `auth_token`, else the file named by `auth_token_file` (CLI
`--auth-token-file PATH`), else `$DATASERVICE_AUTH_TOKEN`. A server that has a
token from any of the three requires it of every call. Clients
(`client_token`): the token passed in, else one a `LocalCluster` of this
process registered for that dispatcher address (`register_token`), else
`$DATASERVICE_AUTH_TOKEN`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

AUTH_ENV = "DATASERVICE_AUTH_TOKEN"
"""Environment variable holding the token, for servers and clients alike."""

REFUSAL_LOG_INTERVAL_S = 60.0
"""A refused peer is logged at most once per this many seconds."""

_CHALLENGE_CONTEXT = b"dataservice-shm-handshake-v1\0"

HOW_TO_SET = (
    f"set {AUTH_ENV} in the client's environment (or the `auth_token` argument) to the token "
    "the servers were started with (their `auth_token` / `--auth-token-file` / "
    f"{AUTH_ENV}); a LocalCluster's token is `cluster.auth_token`"
)
"""The advice every refused client's error carries."""


def check_token(token: str, source: str) -> str:
    """Returns `token` if usable as a token, else raises.

    Raises:
        ValueError: Not printable ASCII without whitespace (gRPC metadata
            values must be ASCII; whitespace is likely a copy-paste error);
            the message names `source`, never the token.
    """
    if not isinstance(token, str):
        raise ValueError(f"the auth token from {source} must be a string, got {type(token)}")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError(f"the auth token from {source} must be printable ASCII without whitespace")
    return token


def read_token_file(path: str) -> str:
    """The token in file `path` (surrounding whitespace stripped).

    Logs a WARNING when the file can be read by other users (mode & 0o077;
    mode & 0o007 when the file's group is this process's effective group).

    Raises:
        ValueError: The file cannot be read, is empty, or holds an unusable
            token; the message names the file.
    """
    try:
        with open(path, encoding="ascii") as f:
            st = os.fstat(f.fileno())
            mode = st.st_mode
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read the auth token file {path!r}: {err}") from None
    if not token:
        raise ValueError(f"the auth token file {path!r} is empty")
    # Group-readable is fine when the group is this process's own (a Kubernetes
    # secret mounted with fsGroup: root:<fsGroup> 0440).
    exposed = 0o007 if st.st_gid == os.getegid() else 0o077
    if stat.S_IMODE(mode) & exposed:
        key = (os.path.abspath(path), stat.S_IMODE(mode))
        with _warned_mu:
            first = key not in _warned_files
            _warned_files.add(key)
        if first:  # the CLI and the server it starts both resolve the token
            log.warning(
                "the auth token file %s can be read by other users (mode %o); chmod 600 it",
                path,
                stat.S_IMODE(mode),
            )
    return check_token(token, f"file {path!r}")


_warned_files: set[tuple[str, int]] = set()  # guarded by _warned_mu: (path, mode) warned of
_warned_mu = threading.Lock()


def token_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """`$DATASERVICE_AUTH_TOKEN` with surrounding whitespace stripped (a value
    set from a file, `$(cat token)` or a heredoc often ends in a newline); None
    when unset or blank.

    Raises:
        ValueError: The value holds characters a token cannot have (see
            `check_token`); the message names the variable, never the value.
    """
    value = (os.environ if environ is None else environ).get(AUTH_ENV)
    value = value.strip() if value else ""
    return check_token(value, f"the environment variable ${AUTH_ENV}") if value else None


def resolve_token(
    auth_token: str | None = None,
    auth_token_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The token a server requires (and sends, for a worker): `auth_token`,
    else the contents of `auth_token_file`, else `$DATASERVICE_AUTH_TOKEN`;
    None when none of the three is set (or all are empty).

    Raises:
        ValueError: Both `auth_token` and `auth_token_file` are set, the file
            cannot be read, or the token is unusable (see `check_token`).
    """
    if auth_token and auth_token_file:
        raise ValueError("set one of `auth_token` and `auth_token_file`, not both")
    if auth_token:
        return check_token(auth_token, "`auth_token`")
    if auth_token_file:
        return read_token_file(auth_token_file)
    return token_from_env(environ)


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe base64)."""
    return secrets.token_urlsafe(32)


def tokens_equal(given: str | bytes | None, expected: str | bytes) -> bool:
    """Constant-time comparison (`hmac.compare_digest`): the time taken does
    not depend on how many leading characters of `given` are right."""
    if given is None:
        return False
    a = given.encode("utf-8", "surrogateescape") if isinstance(given, str) else given
    b = expected.encode("utf-8", "surrogateescape") if isinstance(expected, str) else expected
    return hmac.compare_digest(a, b)


def bearer(token: str) -> str:
    """The value of an `authorization` header or metadata entry carrying `token`."""
    return f"Bearer {token}"


def bearer_ok(header_value: str | bytes | None, token: str) -> bool:
    """Whether an `authorization` value is "Bearer <token>" (constant time)."""
    return tokens_equal(header_value, bearer(token))


def new_challenge() -> bytes:
    """32 random bytes a server sends for `challenge_response`."""
    return secrets.token_bytes(32)


def challenge_response(token: str, challenge: bytes) -> str:
    """HMAC-SHA256(token, context || challenge), hex: proves holding the
    token without sending it."""
    return hmac.new(token.encode(), _CHALLENGE_CONTEXT + challenge, hashlib.sha256).hexdigest()


def challenge_ok(token: str, challenge: bytes, response: object) -> bool:
    """Whether `response` is `challenge_response(token, challenge)` (constant time)."""
    if not isinstance(response, str):
        return False
    return tokens_equal(response, challenge_response(token, challenge))


# ------------------------------------------------------------------ binding
def is_loopback_host(host: str) -> bool:
    """True for "localhost", 127.0.0.0/8 and ::1; False for anything else
    (a wildcard such as "0.0.0.0" or "", or any other name or address)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_refusal(kind: str, host: str, token: str | None, insecure: bool) -> str | None:
    """Why a server may not serve `host`, or None: beyond loopback it needs a
    token, or `insecure`."""
    if is_loopback_host(host) or token is not None or insecure:
        return None
    return (
        f"refusing to serve the {kind} on {host!r} without an auth token: anyone who "
        "can reach the port could run code as this user. Set an auth token "
        f"(`auth_token`, `--auth-token-file PATH` or {AUTH_ENV}), bind 127.0.0.1, or "
        "pass --insecure (`insecure=True`) to serve without one"
    )


def check_bind(kind: str, host: str, token: str | None, insecure: bool, tls: bool = False) -> None:
    """Refuses to serve beyond loopback without a token (`bind_refusal`), and
    warns of what such a bind exposes (a token in clear text, unless `tls`).
    Called by each server before it binds.

    Raises:
        ValueError: `host` is not loopback, there is no token, and `insecure`
            is not set; the message says how to fix it.
    """
    refusal = bind_refusal(kind, host, token, insecure)
    if refusal is not None:
        raise ValueError(refusal)
    if is_loopback_host(host):
        return
    if token is None:
        log.warning(
            "INSECURE: the %s serves %s with no auth token (--insecure): anyone who can reach "
            "the port can register datasets and run code as this user",
            kind,
            host,
        )
        return
    if tls:
        return
    log.warning(
        "the %s serves %s without TLS: its auth token travels in clear text and anyone on the "
        "network path can read it; use a private network, or serve TLS (--tls-cert, --tls-key)",
        kind,
        host,
    )


def warn_no_token(kind: str, host: str) -> None:
    """The WARNING a CLI server without a token prints at start-up."""
    log.warning(
        "NO AUTH TOKEN: anyone who can reach the %s on %s (every local user, for loopback) can "
        "register datasets and so run code as this user. Set --auth-token-file PATH or %s",
        kind,
        host,
        AUTH_ENV,
    )


_sent_in_clear: set[str] = set()
_sent_mu = threading.Lock()


def warn_if_sent_in_clear(address: str, token: str | None, tls: bool = False) -> None:
    """Warns once per address when `token` is sent to a non-loopback
    `address` ("host:port") over a connection without TLS (`tls` False)."""
    if token is None or tls:
        return
    host = address.rsplit(":", 1)[0]
    if is_loopback_host(host):
        return
    with _sent_mu:
        if address in _sent_in_clear:
            return
        _sent_in_clear.add(address)
    log.warning(
        "the auth token is sent to %s without TLS: anyone on the network path can read it; "
        "use a private network, or TLS (set DATASERVICE_TLS_CA, servers --tls-cert)",
        address,
    )


# ------------------------------------------------------------------ clients
_registry: dict[str, str] = {}  # guarded by _registry_mu: "host:port" -> token
_registry_mu = threading.Lock()


def _address_keys(address: str) -> list[str]:
    address = address.split("://", 1)[-1]
    host, _, port = address.rpartition(":")
    keys = [address]
    if is_loopback_host(host):  # 127.0.0.1, localhost and ::1 are the same dispatcher
        keys += [f"{h}:{port}" for h in ("127.0.0.1", "localhost", "[::1]")]
    return keys


def register_token(dispatcher_address: str, token: str) -> None:
    """Makes this process's clients of `dispatcher_address` send `token`
    (`LocalCluster` registers its own), unless given another explicitly."""
    with _registry_mu:
        for key in _address_keys(dispatcher_address):
            _registry[key] = token


def unregister_token(dispatcher_address: str) -> None:
    with _registry_mu:
        for key in _address_keys(dispatcher_address):
            _registry.pop(key, None)


def client_token(dispatcher_address: str | None, auth_token: str | None = None) -> str | None:
    """The token a client sends: `auth_token`, else the one a `LocalCluster`
    of this process registered for `dispatcher_address`, else
    `$DATASERVICE_AUTH_TOKEN` (stripped), else None.

    Raises:
        ValueError: The token holds characters a token cannot have (gRPC
            metadata values are printable ASCII; see `check_token`), before
            any RPC; the message names where it came from.
    """
    if auth_token:
        return check_token(auth_token, "the `auth_token` argument")
    if dispatcher_address:
        with _registry_mu:
            token = _registry.get(dispatcher_address.split("://", 1)[-1])
        if token:
            return token
    return token_from_env()


def _after_fork_in_child() -> None:
    """A forked child keeps the registered tokens (so a DataLoader worker reads
    from its parent's `LocalCluster`) but not the locks: another thread of the
    parent may have held one at fork, and nothing would release it here."""
    global _registry_mu, _sent_mu, _warned_mu
    _registry_mu = threading.Lock()
    _sent_mu = threading.Lock()
    _warned_mu = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


WORKER_HOW_TO_SET = (
    f"start the worker with the dispatcher's token: `--auth-token-file PATH` or {AUTH_ENV} "
    "in the worker's environment (`auth_token` / `auth_token_file` of its WorkerConfig)"
)
"""The advice a refused worker's error carries (it is no client)."""


def refused_message(address: str, what: str, worker: bool = False) -> str:
    """A refused caller's error: which server refused and what to set (a
    worker's own advice when `worker`, else a client's)."""
    how = WORKER_HOW_TO_SET if worker else HOW_TO_SET
    return f"{what}: {address} refused the call: missing or wrong auth token; {how}"


# ------------------------------------------------------------------ refusals
class RefusalLog:
    """Logs refused peers at WARNING, once per peer per `interval_s`.
    Thread-safe."""

    def __init__(self, kind: str, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self._kind = kind
        self._interval_s = interval_s
        self._mu = threading.Lock()
        self._last: dict[str, float] = {}  # guarded by self._mu: peer -> time.monotonic()

    def refused(self, peer: str, reason: str, key: str | None = None) -> None:
        """Notes a refusal of `peer` (an address, or "uid U pid P"), logged
        unless a refusal with the same `key` (default: `peer`) was logged
        within `interval_s`."""
        key = peer if key is None else key
        now = time.monotonic()
        with self._mu:
            last = self._last.get(key)
            if last is not None and now - last < self._interval_s:
                return
            if len(self._last) > 4096:  # a scan from many peers: forget the old ones
                self._last = {p: t for p, t in self._last.items() if now - t < self._interval_s}
            self._last[key] = now
        log.warning("%s refused a connection from %s: %s", self._kind, peer, reason)


def grpc_peer_host(peer: str) -> str:
    """The host part of a gRPC peer string ("ipv4:127.0.0.1:5050" ->
    "127.0.0.1"), the key refusals are rate-limited by."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0]
    return peer
