"""The metrics endpoint of a server with an auth token (metrics.py): /metrics
and /readyz's reason only with `Authorization: Bearer <token>`, refusals counted
as the RPCs' are; /healthz and /readyz's status open to probes; HTTPS from the
server's TLS files, with no plain-HTTP fallback."""

from __future__ import annotations

import http.client
import ssl
import time
import urllib.error
import urllib.request

import pytest

import dataservice as ds
from tests.tls_certs import Certs, make_certs

pytestmark = pytest.mark.timeout(120)
pytest.importorskip("prometheus_client")

TOKEN = "metrics-test-token"


def _get(
    port: int,
    path: str,
    token: str | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, str, dict[str, str]]:
    """(status, body, headers) of one GET."""
    scheme = "https" if context is not None else "http"
    request = urllib.request.Request(f"{scheme}://127.0.0.1:{port}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), dict(err.headers)


def _refusals(port: int) -> float:
    status, body, _ = _get(port, "/metrics", TOKEN)
    assert status == 200, body
    (line,) = [x for x in body.splitlines() if x.startswith("dataservice_auth_refusals_total ")]
    return float(line.split()[1])


def test_metrics_need_the_token_and_refusals_are_counted() -> None:
    d = ds.DispatchServer(ds.DispatcherConfig(auth_token=TOKEN, metrics_port=0))
    try:
        port = d.metrics_port
        assert port
        assert _refusals(port) == 0
        for token in (None, "wrong-token", TOKEN + "x"):
            status, body, headers = _get(port, "/metrics", token)
            assert status == 401, (token, status)
            assert "dataservice_" not in body and "Authorization: Bearer" in body
            assert headers.get("WWW-Authenticate", "").startswith("Bearer")
        assert _refusals(port) == 3
        status, body, _ = _get(port, "/metrics", TOKEN)
        assert status == 200 and "dataservice_workers" in body
        # Probes need no token and learn nothing else.
        assert _get(port, "/healthz")[:2] == (200, "ok\n")
        assert _get(port, "/readyz")[:2] == (200, "ready\n")
    finally:
        d.stop()


def test_a_worker_tells_why_it_is_not_ready_only_to_the_token() -> None:
    # A dispatcher address where nothing listens: the worker never registers.
    w = ds.WorkerServer(
        ds.WorkerConfig(
            "localhost:1",
            auth_token=TOKEN,
            metrics_port=0,
            dispatcher_unreachable_timeout_ms=60_000,
        )
    )
    try:
        assert w.metrics_port
        assert _get(w.metrics_port, "/readyz")[:2] == (503, "not ready\n")
        status, body, _ = _get(w.metrics_port, "/readyz", TOKEN)
        assert status == 503 and body.startswith("not ready: ") and "localhost:1" in body
        assert _get(w.metrics_port, "/metrics")[0] == 401
        assert _get(w.metrics_port, "/metrics", TOKEN)[0] == 200
    finally:
        w.stop()


def test_without_a_token_metrics_stay_open() -> None:
    d = ds.DispatchServer(ds.DispatcherConfig(metrics_port=0))
    try:
        assert d.metrics_port
        status, body, _ = _get(d.metrics_port, "/metrics")
        assert status == 200 and "dataservice_workers" in body
    finally:
        d.stop()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(str(tmp_path_factory.mktemp("metrics-tls")))


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory) -> Certs:
    return make_certs(str(tmp_path_factory.mktemp("metrics-tls-other")))


@pytest.mark.parametrize("mutual", [False, True])
def test_a_tls_server_serves_metrics_over_https_only(
    certs: Certs, other_certs: Certs, mutual: bool
) -> None:
    d = ds.DispatchServer(
        ds.DispatcherConfig(
            auth_token=TOKEN,
            metrics_port=0,
            tls_cert_file=certs.server_cert,
            tls_key_file=certs.server_key,
            tls_client_ca_file=certs.ca if mutual else None,
        )
    )
    try:
        port = d.metrics_port
        assert port
        context = ssl.create_default_context(cafile=certs.ca)
        if mutual:
            # No client certificate: no metrics, token or not; probes still answer
            # (a kubelet's HTTPS probe presents none).
            status, body, _ = _get(port, "/metrics", TOKEN, context)
            assert status == 403 and "client certificate" in body
            assert _get(port, "/healthz", None, context)[:2] == (200, "ok\n")
            assert _get(port, "/readyz", None, context)[0] == 200
            # A certificate another CA signed fails the handshake.
            stranger = ssl.create_default_context(cafile=certs.ca)
            stranger.load_cert_chain(other_certs.client_cert, other_certs.client_key)
            with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
                _get(port, "/healthz", None, stranger)
            context.load_cert_chain(certs.client_cert, certs.client_key)
        status, body, _ = _get(port, "/metrics", TOKEN, context)
        assert status == 200 and "dataservice_workers" in body
        assert _get(port, "/metrics", None, context)[0] == 401
        # Plain HTTP gets no answer in clear (the token would cross in clear).
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
                conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
                conn.getresponse()
        finally:
            conn.close()
        # The endpoint still serves after the failed handshakes.
        deadline = time.monotonic() + 5
        while _get(port, "/healthz", None, context)[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _get(port, "/healthz", None, context)[:2] == (200, "ok\n")
    finally:
        d.stop()
