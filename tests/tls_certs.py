"""Test certificates: a self-signed CA, a server certificate signed by it
(subjectAltName 127.0.0.1, localhost, dataservice-worker and dataservice; usable
as a client certificate too), and a client certificate, written as PEM files
(made with the `cryptography` package of the `test` extra; tests that use this
skip without it)."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os

import pytest

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Certs:
    """Paths of PEM files: `ca` signed the server and the client certificates."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_certs(directory: str, ca_name: str = "dataservice test CA") -> Certs:
    """Writes a CA, a server and a client certificate into `directory`."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(ca_name))
        .issuer_name(_name(ca_name))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, usages: list[x509.ObjectIdentifier], sans: list[x509.GeneralName]) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    # The servers also present their certificate as a client (a worker to the
    # dispatcher under mutual TLS), so theirs allows both uses.
    server_cert, server_key = leaf(
        "dataservice server",
        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        [
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.DNSName("localhost"),
            x509.DNSName("dataservice-worker"),
            x509.DNSName("dataservice"),
        ],
    )
    client_cert, client_key = leaf("dataservice trainer", [ExtendedKeyUsageOID.CLIENT_AUTH], [])
    pem = serialization.Encoding.PEM
    os.makedirs(directory, exist_ok=True)
    return Certs(
        ca=_write(os.path.join(directory, "ca.pem"), ca_cert.public_bytes(pem)),
        server_cert=_write(os.path.join(directory, "server.pem"), server_cert.public_bytes(pem)),
        server_key=_write(os.path.join(directory, "server.key"), _key_pem(server_key)),
        client_cert=_write(os.path.join(directory, "client.pem"), client_cert.public_bytes(pem)),
        client_key=_write(os.path.join(directory, "client.key"), _key_pem(client_key)),
    )
