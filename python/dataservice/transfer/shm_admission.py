"""Admission to a worker's "shm" endpoint: who may connect, and the token handshake.

Any local process can connect to the worker's abstract socket name, so one accept
thread (`ShmAdmission.run`, a selectors loop: no thread per connection until it is
authenticated) first checks the peer's uid (SO_PEERCRED: the worker's own, root, or
`shm_allowed_uids`) and sends a random challenge {v, challenge}; the client answers
with HELLO {v, task_id, pid, auth: HMAC-SHA256(token, challenge)} within
`AUTH_DEADLINE_S` (`auth.challenge_ok` checks it). At most `MAX_PENDING_HANDSHAKES`
connections wait for their HELLO at once (`MAX_PENDING_PER_PEER` from one client
process), and at most `MAX_CONNECTIONS` are served; a refused connection is told why
({ok: false, error}) and closed, and the refusal logged (rate-limited,
`auth.RefusalLog`). The rings and serving threads are `shm.ShmTransferServer`'s; the
client's side of the handshake is `shm.ShmTransferClient`'s. See SECURITY.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import selectors
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from dataservice import auth

# The endpoint logs under one name, the "shm" module's, whichever module does the work.
log = logging.getLogger("dataservice.transfer.shm")

LAYOUT_VERSION = 1
"""The handshake's version: every challenge and HELLO carries it as "v"."""
AUTH_DEADLINE_S = 5.0
"""A connection that has not sent a valid HELLO this long after it was accepted is closed."""
MAX_PENDING_HANDSHAKES = 256
"""Connections accepted but not yet authenticated, at most, per worker."""
MAX_PENDING_PER_PEER = 64
"""... of which from one client process (peer pid)."""
MAX_CONNECTIONS = 1024
"""Authenticated connections (each with a serving thread), at most, per worker."""
HELLO_MAX_BYTES = 4096
"""The largest HELLO (or challenge) message, in bytes."""


@dataclasses.dataclass
class _Pending:
    """An accepted connection waiting for its HELLO (accept thread only)."""

    sock: socket.socket
    pid: int
    uid: int
    challenge: bytes
    deadline: float  # time.monotonic()


class ShmAdmission:
    """Accepts and authenticates a worker's "shm" connections on one thread.

    `run` is the accept thread's body; the callables given are called from it and
    must be thread-safe.

    Args:
        listener: The bound, listening, non-blocking SOCK_SEQPACKET socket.
        worker_address: The worker's address (names it in refusal logs).
        token: Required of every HELLO (as HMAC-SHA256 of the challenge) when set.
        allowed_uids: User ids let in besides the worker's own and root.
        serving: How many authenticated connections are being served now.
        admit: Takes an authenticated connection (a blocking socket, its HELLO,
            the peer's pid) and serves it.
        stopping: True once the endpoint stops.
    """

    def __init__(
        self,
        listener: socket.socket,
        worker_address: str,
        token: str | None,
        allowed_uids: frozenset[int],
        serving: Callable[[], int],
        admit: Callable[[socket.socket, dict[str, Any], int], None],
        stopping: Callable[[], bool],
    ) -> None:
        self._listener = listener
        self._token = token
        self._allowed_uids = allowed_uids
        self._serving = serving
        self._admit = admit
        self._stopping = stopping
        self._refusals = auth.RefusalLog(f"worker {worker_address} (shared memory)")

    def _allowed_uid(self, uid: int) -> bool:
        return uid in (os.getuid(), 0) or uid in self._allowed_uids

    def run(self) -> None:
        """Accepts connections and authenticates them on this one thread, with
        no thread per connection until then: a peer of another user (not in
        `shm_allowed_uids`) is refused at once (SO_PEERCRED); the others get
        a challenge and have `AUTH_DEADLINE_S` to answer with a HELLO that
        proves they hold the token (`auth.challenge_ok`), within
        `MAX_PENDING_HANDSHAKES` (`MAX_PENDING_PER_PEER` per client process)
        pending at once. Only an authenticated connection is handed to `admit`
        (its serving thread), at most `MAX_CONNECTIONS` of them. Returns once
        `stopping()` is true (checked every 0.2 s)."""
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        pending: dict[int, _Pending] = {}  # by fileno
        try:
            while not self._stopping():
                timeout = 0.2
                if pending:
                    first = min(p.deadline for p in pending.values())
                    timeout = max(0.0, min(timeout, first - time.monotonic()))
                for key, _ in sel.select(timeout):
                    try:
                        if key.data is None:
                            self._accept_ready(sel, pending)
                        else:
                            self._hello_ready(sel, pending, key.data)
                    except Exception:  # one bad connection must not end the accept loop
                        log.exception("shm: handshake failed")
                        if key.data is not None and key.data.sock.fileno() in pending:
                            sel.unregister(key.data.sock)
                            del pending[key.data.sock.fileno()]
                            key.data.sock.close()
                now = time.monotonic()
                for p in [p for p in pending.values() if p.deadline <= now]:
                    self._drop(sel, pending, p, f"no HELLO within {AUTH_DEADLINE_S:.0f} s")
        finally:
            for p in list(pending.values()):
                p.sock.close()
            sel.close()

    def _accept_ready(self, sel: selectors.BaseSelector, pending: dict[int, _Pending]) -> None:
        while True:  # everything queued: a burst must not wait for the next select
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # e.g. EMFILE: leave the rest queued for now
                if not self._stopping():
                    log.warning("shm: accept failed: %s", err)
                    time.sleep(0.05)
                return
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _ = struct.unpack("3i", creds)
            peer = f"uid {uid} pid {pid}"
            if not self._allowed_uid(uid):
                self._refuse(sock, peer, f"uid {uid}", "the client runs as another user")
                continue
            per_peer = sum(1 for p in pending.values() if p.pid == pid)
            if len(pending) >= MAX_PENDING_HANDSHAKES or per_peer >= MAX_PENDING_PER_PEER:
                self._refuse(sock, peer, peer, "too many connections waiting for a handshake")
                continue
            serving = self._serving()
            if serving >= MAX_CONNECTIONS:
                self._refuse(sock, peer, peer, f"{serving} connections served already")
                continue
            challenge = auth.new_challenge()
            try:
                sock.setblocking(False)
                # A fresh SEQPACKET socket's send buffer is empty: this never blocks.
                sock.send(json.dumps({"v": LAYOUT_VERSION, "challenge": challenge.hex()}).encode())
            except OSError:
                sock.close()
                continue
            p = _Pending(sock, pid, uid, challenge, time.monotonic() + AUTH_DEADLINE_S)
            pending[sock.fileno()] = p
            sel.register(sock, selectors.EVENT_READ, p)

    def _hello_ready(
        self, sel: selectors.BaseSelector, pending: dict[int, _Pending], p: _Pending
    ) -> None:
        try:
            data = p.sock.recv(HELLO_MAX_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client hung up
            sel.unregister(p.sock)
            del pending[p.sock.fileno()]
            p.sock.close()
            return
        try:
            hello = json.loads(data)
            if not isinstance(hello, dict):
                raise ValueError("not a JSON object")
        except ValueError:
            self._drop(sel, pending, p, "a malformed HELLO")
            return
        if hello.get("v") != LAYOUT_VERSION:
            self._drop(sel, pending, p, f"layout version {hello.get('v')!r} unsupported")
            return
        token = self._token
        if token is not None and not auth.challenge_ok(token, p.challenge, hello.get("auth")):
            self._drop(sel, pending, p, "missing or wrong auth token; " + auth.HOW_TO_SET)
            return
        task_id = hello.get("task_id")
        if not isinstance(task_id, int) or isinstance(task_id, bool):
            self._drop(sel, pending, p, f"a HELLO whose task_id is not an int: {task_id!r:.40}")
            return
        sel.unregister(p.sock)
        del pending[p.sock.fileno()]
        p.sock.setblocking(True)
        self._admit(p.sock, hello, p.pid)

    def _drop(
        self, sel: selectors.BaseSelector, pending: dict[int, _Pending], p: _Pending, why: str
    ) -> None:
        sel.unregister(p.sock)
        del pending[p.sock.fileno()]
        peer = f"uid {p.uid} pid {p.pid}"
        self._refuse(p.sock, peer, peer, why)

    def _refuse(self, sock: socket.socket, peer: str, key: str, why: str) -> None:
        """Tells the client why (best effort, never blocking), logs it (rate-limited
        per `key`) and closes the connection."""
        self._refusals.refused(peer, why, key)
        try:
            sock.setblocking(False)
            sock.send(json.dumps({"ok": False, "error": why}).encode())
        except OSError:
            pass
        sock.close()
