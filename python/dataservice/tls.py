"""TLS for every gRPC connection: server credentials, client credentials, and
the errors that say why a TLS handshake failed.

The rule (one for every client: trainer -> dispatcher, trainer -> worker,
worker -> dispatcher, `register_dataset` / `from_dataset_id`, the coordinated
reads): **a client speaks TLS when it has a CA to trust**, else plaintext.
Addresses carry no scheme for it ("grpc://" only); tf.data service picks its
credentials by `protocol` ("grpc", "grpc+loas") in the same spirit, one
setting per process rather than per address.

Where the settings come from:

* Servers (`DispatcherConfig` / `WorkerConfig`, CLI flags of the same names):
  `tls_cert_file` + `tls_key_file` make the server speak TLS (PEM);
  `tls_client_ca_file` makes it require a client certificate signed by that CA
  (mutual TLS). A worker's own client connection to the dispatcher trusts
  `tls_ca_file` (else `$DATASERVICE_TLS_CA`) and presents the worker's own
  certificate, which mutual TLS then checks.
* Clients (trainers): `$DATASERVICE_TLS_CA` (the CA's PEM file), and for mutual
  TLS `$DATASERVICE_TLS_CERT` + `$DATASERVICE_TLS_KEY`.
* Both: `$DATASERVICE_TLS_SERVER_NAME` (or `tls_server_name`) checks every
  server's certificate against that name instead of the host in the address
  (gRPC's `grpc.ssl_target_name_override`): workers that advertise pod IPs can
  share one certificate for a name such as "dataservice-worker".

The shared-memory path between a worker and a client on one host does not use
TLS: it never leaves the host, and its handshake proves the auth token by
HMAC (`auth.challenge_response`). The auth token is still sent, and checked,
on top of TLS.

Credentials are gRPC's own (`grpc.ssl_server_credentials`,
`grpc.ssl_channel_credentials`); a server's metrics endpoint serves HTTPS from
the same files through Python's `ssl` (`metrics_ssl_context`); nothing here
does cryptography.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import ssl
from collections.abc import Mapping

import grpc

TLS_CA_ENV = "DATASERVICE_TLS_CA"
"""PEM file of the CA a client trusts; setting it turns TLS on for the client."""
TLS_CERT_ENV = "DATASERVICE_TLS_CERT"
"""PEM file of the client's certificate, for servers that require one (mutual TLS)."""
TLS_KEY_ENV = "DATASERVICE_TLS_KEY"
"""PEM file of the private key of `TLS_CERT_ENV`'s certificate."""
TLS_SERVER_NAME_ENV = "DATASERVICE_TLS_SERVER_NAME"
"""The name every server certificate is checked against, instead of the address's host."""

PROBE_TIMEOUT_S = 2.0
"""Bound on `speaks_tls`'s connect + first answer."""


def read_pem(path: str, what: str, kind: str = "CERTIFICATE") -> bytes:
    """The bytes of PEM file `path`.

    Args:
        path: The file.
        what: What it is, for errors ("the worker's --tls-cert").
        kind: "CERTIFICATE" or "PRIVATE KEY": the file must hold a PEM block of it.

    Raises:
        ValueError: The file cannot be read, or holds no PEM block of `kind`;
            the message names `what` and the file.
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"{what} must be a file path, got {path!r}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ValueError(f"cannot read {what} {path!r}: {err.strerror or err}") from None
    if b"-----BEGIN " not in data or (kind.encode() not in data):
        raise ValueError(
            f"{what} {path!r} is not a PEM file holding a {kind.lower()} (a '-----BEGIN ...' block)"
        )
    return data


@dataclasses.dataclass(frozen=True)
class ClientTls:
    """What a client needs to speak TLS: the CA it trusts, optionally its own
    certificate and key (mutual TLS), and the name to check servers against.
    Immutable: thread-safe.

    Attributes:
        ca_file: Path of the CA's PEM (for messages).
        cert_file: Path of the client's certificate, or None.
        server_name: Checked against each server's certificate instead of the
            address's host, or None.
    """

    ca_file: str
    ca_pem: bytes = dataclasses.field(repr=False)
    cert_file: str | None = None
    cert_pem: bytes | None = dataclasses.field(default=None, repr=False)
    key_pem: bytes | None = dataclasses.field(default=None, repr=False)  # never in a repr
    server_name: str | None = None
    key_file: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem,
            private_key=self.key_pem,
            certificate_chain=self.cert_pem,
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []


def client_tls(
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    server_name: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> ClientTls | None:
    """A client's TLS settings: each argument given, else its environment
    variable (`$DATASERVICE_TLS_CA`, `_CERT`, `_KEY`, `_SERVER_NAME`); None
    (plaintext) when there is no CA. Reads the files now.

    Raises:
        ValueError: A file cannot be read or is not PEM (the message names the
            file and where its path came from); a certificate without its key
            or a key without its certificate; a certificate or key without a CA.
    """
    env = os.environ if environ is None else environ

    def pick(value: str | None, var: str) -> tuple[str | None, str]:
        if value:
            return value, f"`{var.removeprefix('DATASERVICE_').lower()}_file`"
        return (env.get(var) or None), f"${var}"

    ca, ca_src = pick(ca_file, TLS_CA_ENV)
    cert, cert_src = pick(cert_file, TLS_CERT_ENV)
    key, key_src = pick(key_file, TLS_KEY_ENV)
    name = server_name or env.get(TLS_SERVER_NAME_ENV) or None
    if bool(cert) != bool(key):
        missing = key_src if cert else cert_src
        given = cert_src if cert else key_src
        raise ValueError(
            f"TLS client certificate: {given} is set but {missing} is not; "
            "a client certificate needs both the certificate and its private key"
        )
    if ca is None:
        if cert:
            raise ValueError(
                f"TLS client certificate {cert!r} given without a CA to trust: set "
                f"{TLS_CA_ENV} (the CA of the servers' certificates) to turn TLS on"
            )
        return None
    return ClientTls(
        ca_file=ca,
        ca_pem=read_pem(ca, f"the TLS CA file ({ca_src})"),
        cert_file=cert,
        cert_pem=read_pem(cert, f"the TLS client certificate ({cert_src})") if cert else None,
        key_pem=read_pem(key, f"the TLS client key ({key_src})", "PRIVATE KEY") if key else None,
        server_name=name,
        key_file=key,
    )


def server_credentials(
    cert_file: str | None,
    key_file: str | None,
    client_ca_file: str | None,
    kind: str,
) -> grpc.ServerCredentials | None:
    """The credentials of a `kind` ("dispatcher", "worker") server, or None to
    serve plaintext (no `cert_file`). Reads the files now.

    Raises:
        ValueError: Only one of `cert_file` and `key_file`; `client_ca_file`
            without a certificate; a file that cannot be read or is not PEM
            (the message names the flag and the file).
    """
    if bool(cert_file) != bool(key_file):
        raise ValueError(
            f"the {kind} needs both --tls-cert and --tls-key (`tls_cert_file` and "
            f"`tls_key_file`) to serve TLS; got only --tls-{'cert' if cert_file else 'key'}"
        )
    if not cert_file:
        if client_ca_file:
            raise ValueError(
                f"the {kind}'s --tls-client-ca (`tls_client_ca_file`) requires client "
                "certificates over TLS, which needs --tls-cert and --tls-key too"
            )
        return None
    assert key_file is not None
    cert = read_pem(cert_file, f"the {kind}'s TLS certificate (--tls-cert)")
    key = read_pem(key_file, f"the {kind}'s TLS key (--tls-key)", "PRIVATE KEY")
    client_ca = (
        read_pem(client_ca_file, f"the {kind}'s TLS client CA (--tls-client-ca)")
        if client_ca_file
        else None
    )
    try:
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )
    except Exception as err:  # grpc raises a bare RuntimeError/TypeError on bad input
        raise ValueError(
            f"the {kind}'s TLS certificate {cert_file!r} and key {key_file!r} were refused "
            f"by gRPC: {err}"
        ) from None


def metrics_ssl_context(
    cert_file: str | None, key_file: str | None, client_ca_file: str | None
) -> ssl.SSLContext | None:
    """The HTTPS context of a server's metrics endpoint (metrics.py), from the
    same files as its gRPC credentials, or None (no `cert_file`: plain HTTP).
    Call after `server_credentials` accepted the files: errors are raised there.
    With `client_ca_file`, a certificate a client presents must be one it
    signed, and /metrics is served only to a client that presented one, as
    gRPC's clients must (metrics.py checks it per request): the handshake
    itself accepts a client without one, since Kubernetes's HTTPS probes of
    /healthz and /readyz present none.
    """
    if not cert_file or not key_file:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(client_ca_file)
    return context


def worker_tls(
    cert_file: str | None,
    key_file: str | None,
    client_ca_file: str | None,
    ca_file: str | None,
    environ: Mapping[str, str] | None = None,
) -> tuple[grpc.ServerCredentials | None, ClientTls | None]:
    """A worker's server credentials and its client settings towards the
    dispatcher (CA: `ca_file`, else $DATASERVICE_TLS_CA; it presents its own
    certificate there, for mutual TLS). Reads the files now.

    Raises:
        ValueError: As `server_credentials` and `client_tls`; or the worker
            would serve plaintext while talking TLS to its dispatcher, or the
            other way round: clients use one setting for the dispatcher and
            every worker, so they could not read from it.
    """
    env = os.environ if environ is None else environ
    credentials = server_credentials(cert_file, key_file, client_ca_file, "worker")
    has_ca = bool(ca_file or env.get(TLS_CA_ENV))
    if has_ca and credentials is None:
        raise ValueError(
            "the worker talks TLS to its dispatcher (--tls-ca or $DATASERVICE_TLS_CA is set) "
            "but would serve plaintext: clients that trust the dispatcher's CA speak TLS to "
            "every worker; give the worker --tls-cert and --tls-key"
        )
    if credentials is not None and not has_ca:
        raise ValueError(
            "the worker serves TLS (--tls-cert) but would talk plaintext to its dispatcher: "
            "clients speak TLS to the dispatcher and every worker or to none; give the worker "
            f"--tls-ca (the CA of the dispatcher's certificate) or ${TLS_CA_ENV}"
        )
    if not has_ca:
        return None, None
    client = client_tls(
        ca_file, cert_file or env.get(TLS_CERT_ENV), key_file or env.get(TLS_KEY_ENV), None, env
    )
    return credentials, client


def speaks_tls(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether the server at `address` ("host:port") answers a TLS ClientHello
    with a TLS record (a ServerHello or an alert): True; with anything else or
    by closing: False; None when it cannot be reached within `timeout_s`.
    Verifies nothing: it only tells a TLS server from a plaintext one, for
    error messages."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    hello_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    hello_ctx.check_hostname = False
    hello_ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = hello_ctx.wrap_bio(incoming, outgoing, server_hostname=host or None)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = outgoing.read()
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(hello)
            first = sock.recv(3)
    except TimeoutError:
        return None
    except OSError as err:
        if isinstance(err, ConnectionResetError | BrokenPipeError):
            return False
        return None
    # A TLS record: content type 22 (handshake) or 21 (alert), then version 3.x.
    return len(first) >= 2 and first[0] in (21, 22) and first[1] == 3


def handshake_error(
    address: str,
    details: str,
    client: ClientTls | None,
    what: str,
    probe: bool = True,
) -> str | None:
    """The message for a connection to `address` that failed at the TLS
    layer, from gRPC's `details` and the client's settings (None: plaintext),
    or None when the failure is not about TLS. With `probe`, a connection
    that was closed is looked into (at most two short connections, bounded by
    `PROBE_TIMEOUT_S` each): does the server speak TLS (`speaks_tls`), does it
    refuse this client's certificate (`client_certificate_refusal`)? Only a
    positive answer makes an error: a server that is merely stopping gives
    none."""
    if client is None:
        if "Socket closed" in details and probe and speaks_tls(address):
            return (
                f"{what}: the server at {address} speaks TLS and this client does not: set "
                f"{TLS_CA_ENV} to the PEM file of the CA that signed its certificate "
                "(a worker: --tls-ca)"
            )
        return None
    ca = f"the CA in {client.ca_file!r}"
    if "CERTIFICATE_VERIFY_FAILED" in details:
        reason = details.rsplit("CERTIFICATE_VERIFY_FAILED:", 1)[-1].removesuffix(": OK").strip()
        return (
            f"{what}: the TLS certificate of the server at {address} is not signed by {ca} "
            f"(certificate verify failed: {reason}): point {TLS_CA_ENV} (a worker: --tls-ca) "
            "at the CA that signed the servers' certificates"
        )
    if "WRONG_VERSION_NUMBER" in details or "packet length too long" in details:
        return (
            f"{what}: the server at {address} does not speak TLS, and this client does "
            f"({TLS_CA_ENV} or --tls-ca is set): start the server with --tls-cert and "
            f"--tls-key, or unset {TLS_CA_ENV}"
        )
    if "Hostname Verification Check failed" in details or (
        "Peer name" in details and "not in peer certificate" in details
    ):
        checked = client.server_name or address.rpartition(":")[0]
        source = f" (${TLS_SERVER_NAME_ENV})" if client.server_name else ""
        return (
            f"{what}: the TLS certificate of the server at {address} does not name "
            f"{checked!r}{source}: give the server a certificate with that name in its "
            f"subjectAltName, or set {TLS_SERVER_NAME_ENV} to a name its certificate holds"
        )
    if "Socket closed" in details and probe:
        refusal = client_certificate_refusal(address, client)
        if refusal is None:
            return None
        mine = (
            f"its client certificate {client.cert_file!r}"
            if client.cert_file
            else f"no client certificate ({TLS_CERT_ENV} and {TLS_KEY_ENV} are unset)"
        )
        return (
            f"{what}: the server at {address} refused the TLS handshake ({refusal}): it "
            "requires a client certificate signed by the CA it trusts (mutual TLS, "
            f"--tls-client-ca), and this client presented {mine}"
        )
    return None


def client_certificate_refusal(
    address: str, client: ClientTls, timeout_s: float = PROBE_TIMEOUT_S
) -> str | None:
    """Why the TLS server at `address` refuses `client`'s certificate (or its
    lack of one), found by a handshake that presents the same certificate: a
    gRPC server that accepts it sends its HTTP/2 settings at once, one that
    refuses it closes the connection (or sends a TLS alert, named). None when
    it accepts it, cannot be reached, or does not speak TLS. Verifies nothing
    of the server: only its verdict on the client is of interest."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    if client.cert_file and client.key_file:
        try:
            ctx.load_cert_chain(client.cert_file, client.key_file)
        except (OSError, ssl.SSLError):
            return None
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as raw:
            with ctx.wrap_socket(raw, server_hostname=host or None) as sock:
                # TLS 1.3: the server judges the client's certificate after the
                # client's side of the handshake is done, and says so in an alert.
                sock.settimeout(min(1.0, timeout_s))
                first = sock.recv(1)
    except ssl.SSLError as err:
        return f"TLS alert {err.reason or err}"
    except OSError:
        return None
    return None if first else "it closed the connection after the handshake"
