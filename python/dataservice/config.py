"""Server configurations: `DispatcherConfig` and `WorkerConfig`.

Field names and defaults follow `tf.data.experimental.service.DispatcherConfig`
and `WorkerConfig`; units are in the field names (`_ms`, `_bytes`). Every field
has a CLI flag of the same name in kebab-case (`dataservice dispatcher
--job-gc-timeout-ms 600000`). Both are frozen dataclasses: thread-safe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DEFAULT_HEARTBEAT_INTERVAL_MS = 1_000
DEFAULT_DISPATCHER_TIMEOUT_MS = 60 * 60 * 1_000
DEFAULT_JOB_GC_CHECK_INTERVAL_MS = 10 * 60 * 1_000
DEFAULT_JOB_GC_TIMEOUT_MS = 5 * 60 * 1_000
DEFAULT_CLIENT_TIMEOUT_MS = 5 * 60 * 1_000
DEFAULT_WORKER_TIMEOUT_MS = 5 * 60 * 1_000
DEFAULT_HOST = "127.0.0.1"
PROTOCOLS = ("grpc",)


def check_address_port(address: str, what: str, template_ok: bool = False) -> None:
    """Raises unless the port of `address` ("host:port", "grpc://host:port")
    is a number in [1, 65535] (or "%port%" where `template_ok`).

    gRPC would otherwise take "127.0.0.1:99999" and dial the port modulo 65536
    for the whole connect timeout.

    Raises:
        ValueError: No port, or one out of range; the message names `what`
            and the address.
    """
    rest = address.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if template_ok and port == "%port%" and host:
        return
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{what} must be 'host:port', got {address!r}")
    if not 1 <= int(port) <= 65535:
        raise ValueError(
            f"{what} {address!r} has port {port}, out of range: a TCP port is 1 to 65535"
        )


def _check_port(port: int) -> None:
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"`port` must be an int in [0, 65535], got {port!r}")


def _check_metrics_port(port: int | None) -> None:
    if port is None:
        return
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(
            f"`metrics_port` must be None (no metrics) or an int in [0, 65535], got {port!r}"
        )


def _check_positive(name: str, value: int | None) -> None:
    """Raises ValueError naming `name` and its unit (from its suffix: `_ms`,
    `_bytes`) unless `value` is None or a positive int."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        unit = {"ms": "milliseconds", "bytes": "bytes"}.get(name.rsplit("_", 1)[-1])
        what = f"a positive int ({unit})" if unit else "a positive int"
        raise ValueError(f"`{name}` must be {what}, got {value!r}")


def _check_protocol(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"`protocol` must be one of {PROTOCOLS}, got {protocol!r}")


def _check_tls_files(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"`{name}` must be a file path, got {value!r}")
    if bool(getattr(config, "tls_cert_file")) != bool(getattr(config, "tls_key_file")):  # noqa: B009
        raise ValueError(
            "set both `tls_cert_file` and `tls_key_file` (--tls-cert, --tls-key) to serve TLS"
        )
    if getattr(config, "tls_client_ca_file") and not getattr(config, "tls_cert_file"):  # noqa: B009
        raise ValueError(
            "`tls_client_ca_file` (--tls-client-ca) requires client certificates over TLS: "
            "set `tls_cert_file` and `tls_key_file` (--tls-cert, --tls-key) too"
        )


def _check_auth(auth_token: str | None, auth_token_file: str | None) -> None:
    if auth_token is not None and not isinstance(auth_token, str):
        raise ValueError(f"`auth_token` must be a string, got {type(auth_token)}")
    if auth_token_file is not None and not isinstance(auth_token_file, str):
        raise ValueError(f"`auth_token_file` must be a path string, got {auth_token_file!r}")
    if auth_token and auth_token_file:
        raise ValueError("set one of `auth_token` and `auth_token_file`, not both")


@dataclass(frozen=True)
class DispatcherConfig:
    """Configuration of a `DispatchServer`, as tf.data service's DispatcherConfig.

    Attributes:
        port: TCP port to bind; 0 picks a free one (read it back from `.target`).
        protocol: "grpc", the only one.
        work_dir: Directory for the journal and registered datasets. Needed by
            `fault_tolerant_mode`.
        fault_tolerant_mode: Journal every state change in `work_dir` (fsync
            before the RPC that caused it is answered) and replay it on restart.
        worker_addresses: Fixed worker list for static sharding (FILE, DATA,
            FILE_OR_DATA, HINT); a worker's index is its position. "%port%"
            matches any port.
        job_gc_check_interval_ms: How often to look for abandoned jobs and
            iterations (ms); unset: every `job_gc_timeout_ms`, at most every
            10 min, so that a short `job_gc_timeout_ms` alone takes effect.
        job_gc_timeout_ms: A job with no client heartbeat for this long is
            collected (ms); default 300,000 (5 min).
        client_timeout_ms: A client missing heartbeats this long is dropped
            (ms); default 300,000 (5 min). Not the consumer's own
            `distribute(..., client_timeout_ms=...)`, how long it retries a
            dispatcher that does not answer (default 60,000).
        worker_timeout_ms: A worker missing heartbeats this long is lost (ms);
            default 300,000 (5 min).
        host: Interface to bind, "127.0.0.1" unless told otherwise; "0.0.0.0"
            serves every interface.
        auth_token: Optional. When the server has a token (from this,
            `auth_token_file` or DATASERVICE_AUTH_TOKEN), every RPC must carry
            it (metadata "authorization: Bearer <token>") or is refused
            UNAUTHENTICATED. Without one it warns at start-up and serves only
            loopback (beyond it only with `insecure`). Given as a CLI flag it
            is visible to every local user in `ps`: prefer `auth_token_file`
            or DATASERVICE_AUTH_TOKEN.
        auth_token_file: Optional. A file holding the token (mode 0600;
            surrounding whitespace stripped), read at start.
        insecure: Serve a `host` beyond loopback without a token, which is
            otherwise refused (anyone who can reach the port can run code).
        metrics_port: Serve Prometheus metrics at http://host:PORT/metrics (and
            /healthz, /readyz) on `host`; 0 picks a free port (read it back from
            `.metrics_port`); None (the default): no metrics. Needs
            prometheus-client. With an auth token, /metrics needs
            "Authorization: Bearer <token>" (401 otherwise); with a TLS
            certificate it is HTTPS only, and with a client CA /metrics also
            needs a client certificate (403). /healthz and /readyz answer
            probes without either. It tells counts, never elements.
        tls_cert_file: Optional. PEM certificate (chain) to serve TLS with
            (CLI --tls-cert); needs `tls_key_file`. Clients then need the CA
            ($DATASERVICE_TLS_CA; see `dataservice.tls`).
        tls_key_file: Optional. PEM private key of `tls_cert_file` (--tls-key).
        tls_client_ca_file: Optional. Require every client (trainers and
            workers) to present a certificate signed by this CA (PEM; mutual
            TLS; --tls-client-ca).

    Raises:
        ValueError: On a bad field (message names it), or `fault_tolerant_mode`
            without `work_dir`.
    """

    port: int = 0
    protocol: str = "grpc"
    work_dir: str | None = None
    fault_tolerant_mode: bool = False
    worker_addresses: list[str] | None = None
    job_gc_check_interval_ms: int | None = None
    job_gc_timeout_ms: int | None = None
    client_timeout_ms: int | None = None
    worker_timeout_ms: int | None = None
    host: str = DEFAULT_HOST
    auth_token: str | None = None
    auth_token_file: str | None = None
    insecure: bool = False
    metrics_port: int | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None

    def __post_init__(self) -> None:
        _check_tls_files(self, ("tls_cert_file", "tls_key_file", "tls_client_ca_file"))
        _check_port(self.port)
        _check_metrics_port(self.metrics_port)
        _check_protocol(self.protocol)
        _check_auth(self.auth_token, self.auth_token_file)
        if self.fault_tolerant_mode and not self.work_dir:
            raise ValueError(
                "`fault_tolerant_mode=True` needs a `work_dir` to journal the dispatcher's state in"
            )
        for name in (
            "job_gc_check_interval_ms",
            "job_gc_timeout_ms",
            "client_timeout_ms",
            "worker_timeout_ms",
        ):
            _check_positive(name, getattr(self, name))
        if self.worker_addresses is not None:
            object.__setattr__(self, "worker_addresses", list(self.worker_addresses))
            for entry in self.worker_addresses:
                if not isinstance(entry, str):
                    raise ValueError(f"`worker_addresses` must hold strings, got {entry!r}")
                check_address_port(entry, "`worker_addresses` entry", template_ok=True)

    @property
    def job_gc_check_interval_ms_or_default(self) -> int:
        if self.job_gc_check_interval_ms:
            return self.job_gc_check_interval_ms
        return min(DEFAULT_JOB_GC_CHECK_INTERVAL_MS, self.job_gc_timeout_ms_or_default)

    @property
    def job_gc_timeout_ms_or_default(self) -> int:
        return self.job_gc_timeout_ms or DEFAULT_JOB_GC_TIMEOUT_MS

    @property
    def client_timeout_ms_or_default(self) -> int:
        return self.client_timeout_ms or DEFAULT_CLIENT_TIMEOUT_MS

    @property
    def worker_timeout_ms_or_default(self) -> int:
        return self.worker_timeout_ms or DEFAULT_WORKER_TIMEOUT_MS


@dataclass(frozen=True)
class WorkerConfig:
    """Configuration of a `WorkerServer`, as tf.data service's WorkerConfig.

    Attributes:
        dispatcher_address: "host:port" (or "grpc://host:port") of the dispatcher.
        worker_address: The address advertised to the dispatcher and clients
            (trainers on other hosts connect to it), exactly as given ("%port%"
            is replaced by the bound port). Default "localhost:%port%" as
            tf.data service for a loopback `host`, "<host>:%port%" for one
            interface, and for every interface ("0.0.0.0", "::") an address of
            this host its dispatcher can reach: the local address of its route
            to the dispatcher, else its first non-loopback interface address
            (logged with the reason; `_netaddr.wildcard_advertised_host`). A
            consumer that cannot connect to it while the dispatcher hears the
            worker raises `UnavailableError` naming it (client/fetch.py
            `_check_unreachable_locked`).
        port: TCP port to bind; 0 picks a free one.
        protocol: "grpc".
        heartbeat_interval_ms: Time between heartbeats to the dispatcher (ms).
        dispatcher_timeout_ms: How long to retry an unreachable dispatcher (ms).
            (Once registered, the worker keeps serving its tasks meanwhile.)
        data_transfer_protocol: None/"auto" (shared memory to same-host clients,
            gRPC otherwise), "grpc" or "shm".
        shm_ring_bytes: Size of each shared-memory ring (bytes; 64 MiB by
            default). Its memory is allocated as elements first reach it (1 MiB
            at first, then doubling), so small elements hold little of it.
        cross_trainer_cache_size_bytes: Bound of the cross-trainer cache (bytes).
        host: Interface to bind, "127.0.0.1" unless told otherwise; "0.0.0.0"
            or "::" binds every interface (see `worker_address`).
        auth_token: Optional. The token this worker sends to the
            dispatcher and requires of every RPC and shared-memory handshake;
            also read from `auth_token_file` or DATASERVICE_AUTH_TOKEN.
            Without one it warns at start-up and serves only loopback (beyond
            it only with `insecure`). As a CLI flag it shows in `ps`.
        auth_token_file: Optional. A file holding the token (mode 0600;
            surrounding whitespace stripped), read at start.
        insecure: Serve a `host` beyond loopback without a token, which is
            otherwise refused (anyone who can reach the port can run code).
        shm_allowed_uids: User ids besides the worker's own (and root) whose
            processes may connect to its shared-memory socket; other users
            are refused before the handshake (they fall back to gRPC). A
            client, for its part, maps memory only from a worker of its own
            uid or root, so this lets other users in when the worker runs as
            root; otherwise they read over gRPC.
        dispatcher_unreachable_timeout_ms: How long to retry a dispatcher that
            never answered this worker (refused, unresolvable host, no route:
            likely a wrong address) before the worker stops with an error
            naming it (ms). Default $DATASERVICE_UNREACHABLE_TIMEOUT_MS, else
            8 s; at most `dispatcher_timeout_ms`.
        metrics_port: Serve Prometheus metrics at http://host:PORT/metrics (and
            /healthz, /readyz: ready once registered) on `host`; 0 picks a free
            port (read it back from `.metrics_port`); None (the default): no
            metrics. Needs prometheus-client. Guarded as the dispatcher's:
            with an auth token, /metrics needs "Authorization: Bearer
            <token>" (401 otherwise); with a TLS certificate it is HTTPS only,
            and with a client CA /metrics also needs a client certificate
            (403). /healthz and /readyz answer probes without either.
        tls_cert_file: Optional. PEM certificate to serve TLS with (--tls-cert);
            needs `tls_key_file`. The worker also presents it to a dispatcher
            that requires client certificates. Required when the worker talks
            TLS to its dispatcher: clients that trust the dispatcher's CA speak
            TLS to every worker.
        tls_key_file: Optional. PEM private key of `tls_cert_file` (--tls-key).
        tls_client_ca_file: Optional. Require every client to present a
            certificate signed by this CA (PEM; mutual TLS; --tls-client-ca).
        tls_ca_file: Optional. The CA (PEM) the worker trusts for the
            dispatcher's certificate (--tls-ca); else $DATASERVICE_TLS_CA.
            Setting either makes the worker's connection to the dispatcher TLS.

    Raises:
        ValueError: On a bad field; the message names it.
    """

    dispatcher_address: str
    worker_address: str | None = None
    port: int = 0
    protocol: str = "grpc"
    heartbeat_interval_ms: int | None = None
    dispatcher_timeout_ms: int | None = None
    data_transfer_protocol: str | None = None
    shm_ring_bytes: int | None = None
    cross_trainer_cache_size_bytes: int | None = None
    host: str = DEFAULT_HOST
    auth_token: str | None = None
    auth_token_file: str | None = None
    insecure: bool = False
    shm_allowed_uids: list[int] | None = None
    dispatcher_unreachable_timeout_ms: int | None = None
    metrics_port: int | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    tls_ca_file: str | None = None

    def __post_init__(self) -> None:
        _check_auth(self.auth_token, self.auth_token_file)
        _check_metrics_port(self.metrics_port)
        _check_tls_files(
            self, ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "tls_ca_file")
        )
        if self.shm_allowed_uids is not None:
            uids = list(self.shm_allowed_uids)
            if any(not isinstance(u, int) or isinstance(u, bool) or u < 0 for u in uids):
                raise ValueError(
                    f"`shm_allowed_uids` must be a list of user ids (ints >= 0), got {uids!r}"
                )
            object.__setattr__(self, "shm_allowed_uids", uids)
        if not isinstance(self.dispatcher_address, str) or not self.dispatcher_address:
            raise ValueError(
                f"`dispatcher_address` must be a non-empty string, got {self.dispatcher_address!r}"
            )
        check_address_port(self.dispatcher_address, "`dispatcher_address`")
        if self.worker_address:
            check_address_port(self.worker_address, "`worker_address`", template_ok=True)
        _check_port(self.port)
        _check_protocol(self.protocol)
        _check_positive("heartbeat_interval_ms", self.heartbeat_interval_ms)
        _check_positive("dispatcher_timeout_ms", self.dispatcher_timeout_ms)
        _check_positive("dispatcher_unreachable_timeout_ms", self.dispatcher_unreachable_timeout_ms)
        _check_positive("shm_ring_bytes", self.shm_ring_bytes)
        _check_positive("cross_trainer_cache_size_bytes", self.cross_trainer_cache_size_bytes)
        if self.data_transfer_protocol not in (None, "auto", "grpc", "shm"):
            raise ValueError(
                "`data_transfer_protocol` must be None, 'auto', 'grpc' or 'shm', "
                f"got {self.data_transfer_protocol!r}"
            )

    @property
    def heartbeat_interval_ms_or_default(self) -> int:
        return self.heartbeat_interval_ms or DEFAULT_HEARTBEAT_INTERVAL_MS

    @property
    def dispatcher_timeout_ms_or_default(self) -> int:
        return self.dispatcher_timeout_ms or DEFAULT_DISPATCHER_TIMEOUT_MS


def config_fields(cls: type) -> list[dataclasses.Field]:  # type: ignore[type-arg]
    """The fields of a config class, in order (the CLI makes a flag of each)."""
    return list(dataclasses.fields(cls))
