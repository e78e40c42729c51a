"""One TCP proxy for the tests that need a link between two processes on this
host that the test controls: a slow link (bytes per second, each direction),
and a link that is cut off (held: nothing read, written or connected) and
restored. Real sockets and threads: the processes on either side see a real
TCP connection.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time


class TcpProxy:
    """Forwards TCP connections from 127.0.0.1:`port` to `upstream`.

    Args:
        upstream: "host:port", or a port on 127.0.0.1.
        down_rate: bytes/s from upstream to the client (None: as fast as it
            comes). May be changed while it runs (`proxy.down_rate = ...`).
        up_rate: bytes/s from the client to upstream (None: as fast as it comes).

    A throttled direction reads only as fast as it forwards, in steps of a
    twentieth of a second's worth, so that the sender feels the link; an idle
    link banks no bandwidth for later. `cut()` holds every connection and new
    ones (as a link that drops packets: the upstream connection of a
    connection accepted while cut is opened only once restored, as a SYN is
    retransmitted) until `restore()`. `close()` ends every connection and
    thread and asserts that none is left. Thread-safe.

    Counters (read under no lock; exact once traffic stops): `connections`
    accepted, `forwarded_bytes` from upstream to clients.
    """

    def __init__(
        self,
        upstream: str | int,
        down_rate: float | None = None,
        up_rate: float | None = None,
    ) -> None:
        if isinstance(upstream, int):
            self._upstream: tuple[str, int] = ("127.0.0.1", upstream)
        else:
            host, _, port = upstream.rpartition(":")
            self._upstream = (host, int(port))
        self.down_rate = down_rate
        self.up_rate = up_rate
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.connections = 0
        self.forwarded_bytes = 0
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._closed = threading.Event()
        self._mu = threading.Lock()
        self._sockets: list[socket.socket] = [self._listener]  # guarded by _mu
        self._threads: list[threading.Thread] = []  # guarded by _mu
        self._spawn(self._accept_loop)

    def cut(self) -> None:
        self._forwarding.clear()

    def restore(self) -> None:
        self._forwarding.set()

    def close(self) -> None:
        self._closed.set()
        self._forwarding.set()
        with self._mu:
            sockets, self._sockets = self._sockets, []
            threads = list(self._threads)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()
        for t in threads:
            t.join(5)
        assert not any(t.is_alive() for t in threads), "a proxy thread did not end"

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, name="test-proxy", daemon=True)
        with self._mu:
            self._threads.append(t)
        t.start()

    def _track(self, s: socket.socket) -> bool:
        with self._mu:
            if self._closed.is_set():
                s.close()
                return False
            self._sockets.append(s)
            return True

    def _wait_forwarding(self) -> bool:
        """Waits while cut off; False once closed."""
        while not self._forwarding.wait(0.05):
            pass
        return not self._closed.is_set()

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.1)
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self._track(conn):
                self.connections += 1
                self._spawn(self._connect, conn)

    def _connect(self, conn: socket.socket) -> None:
        if not self._wait_forwarding():
            return
        try:
            upstream = socket.create_connection(self._upstream, timeout=5)
        except OSError:
            conn.close()
            return
        upstream.settimeout(None)
        if self._track(upstream):
            self._spawn(self._pump, conn, upstream, False)
            self._spawn(self._pump, upstream, conn, True)

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        start, sent = time.monotonic(), 0
        try:
            while self._wait_forwarding():
                rate = self.down_rate if down else self.up_rate
                if not select.select([src], [], [], 0.1)[0]:
                    start, sent = time.monotonic(), 0  # idle: no bandwidth banked
                    continue
                data = src.recv(max(256, int(rate / 20)) if rate else 1 << 16)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if rate:
                    ahead_s = (sent + len(data)) / rate - (time.monotonic() - start)
                    if ahead_s > 0 and self._closed.wait(ahead_s):
                        return
                if not self._wait_forwarding():  # cut off meanwhile: held until restored
                    return
                dst.sendall(data)
                sent += len(data)
                if down:
                    with self._mu:
                        self.forwarded_bytes += len(data)
        except (OSError, ValueError):  # closed by the other direction or by close()
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()
