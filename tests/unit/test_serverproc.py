"""`dataservice._serverproc`: the lines a server process prints for its launcher
are the ones its patterns read, and the tools' dispatcher stub bounds its wait
for a connection, naming the address."""

from __future__ import annotations

import re
import socket
import time

import pytest

from dataservice import _serverproc, errors


@pytest.mark.parametrize("kind", ["dispatcher", "worker"])
def test_the_ready_line_is_what_the_launcher_reads(kind, capsys):
    _serverproc.announce_ready(kind, "127.0.0.1:5050")
    out = capsys.readouterr().out
    assert out == f"dataservice {kind} listening on 127.0.0.1:5050\n"
    match = _serverproc.READY_RE.match(out.rstrip("\n"))
    assert match is not None and match.groups() == (kind, "127.0.0.1:5050")


def test_the_first_element_line_is_what_the_launcher_reads(capsys):
    _serverproc.announce_first_element()
    out = capsys.readouterr().out
    assert out == "dataservice worker handed out its first element\n"
    assert _serverproc.FIRST_ELEMENT_RE.match(out.rstrip("\n"))
    assert not _serverproc.READY_RE.match(out.rstrip("\n"))


def test_strip_scheme():
    assert _serverproc.strip_scheme("grpc://h:1") == "h:1"
    assert _serverproc.strip_scheme("h:1") == "h:1"


@pytest.mark.timeout(30)
def test_waiting_for_an_absent_dispatcher_is_bounded_and_names_it():
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with _serverproc.DispatcherStub(f"grpc://127.0.0.1:{port}", "token") as dispatcher:
        assert dispatcher.address == f"127.0.0.1:{port}"
        assert dispatcher.metadata == [("authorization", "Bearer token")]
        start = time.monotonic()
        with pytest.raises(errors.UnavailableError, match=rf"waiting here.*127\.0\.0\.1:{port}"):
            dispatcher.wait_connected(500, "waiting here")
        assert 0.4 < time.monotonic() - start < 5.0


@pytest.mark.timeout(30)
def test_a_long_wait_for_the_dispatcher_says_why_it_is_not_connected(monkeypatch, caplog):
    """A wait past the first-warning mark logs what is waited for and gRPC's
    reason (here: connection refused), and the final error carries the reason
    instead of a bare "no connection"."""
    import logging

    from dataservice import _waits

    monkeypatch.setattr(_waits, "FIRST_WARNING_S", 0.5)
    caplog.set_level(logging.WARNING, logger="dataservice._serverproc")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with _serverproc.DispatcherStub(f"127.0.0.1:{port}") as dispatcher:
        with pytest.raises(errors.UnavailableError) as raised:
            dispatcher.wait_connected(2500, "worker: connecting")
    assert "no connection)" not in str(raised.value)
    assert "UNAVAILABLE" in str(raised.value) and "refused" in str(raised.value).lower()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings, "no warning during a 2.5 s wait"
    assert f"worker: connecting: no connection to 127.0.0.1:{port} yet" in warnings[0]
    assert "refused" in warnings[0].lower() and "waiting" in warnings[0]


@pytest.mark.timeout(30)
def test_an_unresolvable_dispatcher_name_is_named_as_such():
    with _serverproc.DispatcherStub("no-such-host.invalid:5050") as dispatcher:
        with pytest.raises(errors.UnavailableError) as raised:
            dispatcher.wait_connected(1500, "worker: connecting")
    assert "no-such-host.invalid:5050" in str(raised.value)
    # gRPC's resolver's own words: "DNS resolution failed" (c-ares), "errors
    # resolving ... address lookup failed ... Domain name not found" (native).
    assert re.search(r"(?i)resol|lookup", str(raised.value)), str(raised.value)


@pytest.mark.timeout(30)
def test_an_http_server_at_a_name_of_two_addresses_is_named_at_once():
    """`localhost` is ::1 (refused here) and 127.0.0.1 (an HTTP/1 server): gRPC
    reports whichever address failed last, so every try is looked at, not only
    the first (a fresh user's CLI worker said "cannot reach" after 8 s in 3 of 6
    runs, "not a dataservice server" in 1.5 s in the others)."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for _ in range(3):
            start = time.monotonic()
            with _serverproc.DispatcherStub(f"localhost:{server.server_address[1]}") as dispatcher:
                with pytest.raises(errors.UnavailableError, match="not a dataservice server"):
                    dispatcher.wait_connected(8000, "worker: connecting")
            assert time.monotonic() - start < 5.0
    finally:
        server.shutdown()
        server.server_close()
