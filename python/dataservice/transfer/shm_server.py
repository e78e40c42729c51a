"""The worker's end of the "shm" transfer protocol (the protocol: shm.py).

`ShmTransferServer` is what the worker's `TransferHost` starts for "shm"
(`base.register_server`): it binds the abstract socket `shm_socket_name(address)`,
hands each connection to `shm_admission.ShmAdmission` (peer uid, token
handshake, connection limits), and serves each authenticated connection on a
thread of its own (`_Connection`): it asks the host's `element_source` for the
HELLO's read (the worker's one decision of which source serves it, as for gRPC),
then feeds a ring of its own (a sealed memfd within the worker's ring budget,
`shm_budget.py`: halved down to `MIN_RING_BYTES`, then refused) or, for a trainer
whose cross-trainer cache keeps a shared window (`shm.TrainerWindow`), names the
window's frames. A consumer that goes away gives back what it did not take: a
first come, first served one's elements go back to the task (also those of the
reply that ends the stream: that reply holds the task's end for the other
consumers until its consumer took it or hung up), a trainer's to its next read
(a window read until DONE or the next request acknowledges it). This module
knows the worker only through its `TransferHost`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

from dataservice import _core, errors
from dataservice.transfer import base
from dataservice.transfer.shm import (
    DONE,
    END_FLAG,
    END_IN_REPLY_ONLY,
    ERROR_FLAG,
    HANDSHAKE_TIMEOUT_S,
    PROTOCOL,
    REBIND,
    REQUEST,
    RESPONSE,
    TrainerWindow,
    shm_socket_name,
)
from dataservice.transfer.shm_admission import ShmAdmission
from dataservice.transfer.shm_budget import ring_budget_bytes

# The endpoint logs under one name, the "shm" module's, whichever module does the work.
log = logging.getLogger("dataservice.transfer.shm")

DEFAULT_RING_BYTES = 64 << 20
MIN_RING_BYTES = 8 << 20
_TASK_WAIT_S = 4.0  # a worker learns of a new task by its next heartbeat
_PUT_SLICE_MS = 200


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


class _RefusedRead(base.ElementSource):
    """A read the worker refused (FailedPreconditionError, e.g. a trainer read of a
    task without a cross-trainer cache): every request is answered with its error."""

    def __init__(self, task_id: int, error: errors.RemoteErrorInfo) -> None:
        self.task_id = task_id
        self._error = error

    def read(self, max_elements: int, max_bytes: int, timeout_s: float) -> base.TaskRead:
        return base.TaskRead([], True, self._error)


class _Connection:
    """One authenticated client's ring and the producer thread feeding it."""

    def __init__(
        self, server: ShmTransferServer, sock: socket.socket, hello: dict[str, Any], peer_pid: int
    ) -> None:
        self._server = server
        self._sock = sock
        self._hello = hello
        self._peer_pid = peer_pid
        self.ring: Any = None
        self.ring_bytes = 0
        self.thread = threading.Thread(target=self._run, name="ds-shm-producer", daemon=True)
        # The last reply's elements until the consumer has taken them all (it asks again
        # only then): if it goes away first, what it did not take goes back to the task.
        self._reply_elements: list[Any] = []
        self._reply_first = 0  # elements written into the ring before the last reply
        self._written = 0  # elements written into the ring
        # A trainer's last window read, (first index, count), until it acknowledges it.
        self._unacked_read: tuple[int, int] | None = None
        # The client keeps this connection (and its ring) for its next iterators:
        # the end of a task's stream is announced, not written into the ring, and a
        # REBIND moves the connection to another task (shm.END_IN_REPLY_ONLY).
        self._reusable = bool(hello.get(END_IN_REPLY_ONLY)) and not hello.get("trainer_id")
        self._rebind_to: int | None = None  # the task a REBIND asked for
        self._pending: bytes | None = None  # a message read while awaiting the final take

    def _reply(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        data = json.dumps(message).encode()
        if fds:
            socket.send_fds(self._sock, [data], fds)
        else:
            self._sock.send(data)

    def _next_message(self) -> bytes | None:
        """The client's next control message (a request, a window reply's DONE, or a
        REBIND); None once it closed the connection or the server is stopping (checked
        every 0.2 s)."""
        if self._pending is not None:
            data, self._pending = self._pending, None
            return data
        while not self._server.stopping:
            self._sock.settimeout(0.2)
            try:
                data = self._sock.recv(64)
            except (TimeoutError, InterruptedError):
                continue
            except OSError:
                return None
            return data or None
        return None

    def _run(self) -> None:
        try:
            self._serve()
        except (errors.UnavailableError, ConnectionError) as err:
            # ConnectionError: the client closed its end before a reply (BrokenPipe,
            # ConnectionReset): gone, not a failure of this worker.
            log.debug("shm consumer gone: %s", err)
        except Exception:
            log.exception("shm producer failed")
        finally:
            self.close()

    def _source(self, request: base.ReadRequest) -> base.ElementSource | None:
        """The source the worker chose for the HELLO's read (`TransferHost.element_source`),
        waiting up to `_TASK_WAIT_S` for a task the client heard of first; None (after
        refusing the connection with the reason) if there is none to serve. A read that
        does not fit the task (FailedPreconditionError) is served as gRPC serves it:
        its requests are answered with that error, so the consumer raises it where it
        reads."""
        server = self._server
        deadline = time.monotonic() + _TASK_WAIT_S
        try:
            source = None
            while source is None and not server.stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                source = server.host.element_source(request, min(remaining, 0.2))
        except errors.FailedPreconditionError as err:
            return _RefusedRead(
                request.task_id, errors.RemoteErrorInfo(type(err).__name__, str(err))
            )
        except errors.DataServiceError as err:  # e.g. NotFoundError: the task was deleted
            self._reply({"ok": False, "error": str(err)})
            return None
        if source is None:
            self._reply({"ok": False, "error": f"worker does not run task {request.task_id}"})
        return source

    def _serve(self) -> None:
        server = self._server
        self._sock.settimeout(HANDSHAKE_TIMEOUT_S)
        hello, peer_pid = self._hello, self._peer_pid
        trainer_id = str(hello.get("trainer_id") or "")
        source = self._source(base.ReadRequest(int(hello["task_id"]), trainer_id=trainer_id))
        if source is None:
            return
        window = source.window() if hello.get("window") else None
        if window is not None:
            slot = window.attach()
            if slot is not None:
                try:
                    self._serve_window(window, trainer_id, slot, source)
                finally:
                    window.detach(slot)
                return
        try:
            self.ring, self.ring_bytes = server.take_ring()
        except Exception as err:
            self._reply({"ok": False, "error": str(err)})
            return
        self._reply(
            {
                "ok": True,
                "capacity_bytes": self.ring.capacity_bytes,
                "nonce": self.ring.nonce.hex(),
                "pid": os.getpid(),
                "worker_uid": server.host.worker_uid,  # new at each start
                "trainer_id": trainer_id,  # what the requests are served for
                END_IN_REPLY_ONLY: self._reusable,
            },
            [self.ring.fileno()],
        )
        self.ring.set_peer(self._sock.fileno(), peer_pid)
        while True:
            self._produce(source)
            task_id, self._rebind_to = self._rebind_to, None
            if task_id is None or server.stopping:
                return
            # The same ring serves the client's next task: no new memfd, no handshake.
            source = self._source(base.ReadRequest(task_id))
            if source is None:
                return  # refused with the reason; the client connects afresh
            self._sock.settimeout(HANDSHAKE_TIMEOUT_S)
            self._reply({"ok": True, "worker_uid": server.host.worker_uid})

    def _serve_window(
        self, window: TrainerWindow, trainer_id: str, slot: int, source: base.ElementSource
    ) -> None:
        """Serves a same-host trainer from the cache's shared window: the handshake
        hands over the segment's memfd and hold slot `slot`; each request is answered
        with the frames to read (position, count, first element's index, the specs and
        segment the trainer has not seen), which the trainer decodes from its own
        mapping, then acknowledges with DONE (its holds are stored by then), which
        lifts the grant the reply set. See rust/shm/window.rs."""
        generation, fd, nonce = window.segment()
        try:
            self._reply(
                {
                    "ok": True,
                    "window": True,
                    "slot": slot,
                    "generation": generation,
                    "nonce": nonce.hex(),
                    "pid": os.getpid(),
                    "worker_uid": self._server.host.worker_uid,
                    "trainer_id": trainer_id,
                },
                [fd],
            )
        finally:
            os.close(fd)
        known_specs: set[int] = set()
        try:
            # Until the trainer closes the connection (detach clears its slot).
            while (data := self._next_message()) is not None:
                # DONE or a new request: the trainer has the last reply's elements.
                self._unacked_read = None
                if data == DONE:
                    window.ungrant(slot)
                    continue
                if len(data) != REQUEST.size or data[:1] != b"G":
                    log.warning("shm: unexpected %d-byte message from a client", len(data))
                    return
                if window.closed:  # the task stopped: the trainer learns it reconnecting
                    return
                generation = self._serve_window_request(
                    window, slot, generation, known_specs, data, source
                )
        finally:
            # Gone before acknowledging its last read: its trainer reads them again.
            if self._unacked_read is not None and not self._server.stopping:
                window.give_back(*self._unacked_read)
            self._unacked_read = None

    def _serve_window_request(
        self,
        window: TrainerWindow,
        slot: int,
        generation: int,
        known_specs: set[int],
        data: bytes,
        source: base.ElementSource,
    ) -> int:
        """Answers one window request (the read stays `_unacked_read` until the
        trainer acknowledges it, the reply carries the task's `errors_ignored` after
        the read); returns the segment generation the trainer knows."""
        _, want, max_bytes, timeout_ms = REQUEST.unpack(data)
        window.ungrant(slot)  # a new request: the last reply is done with too
        got = window.read(
            slot, generation, known_specs, max(1, want), timeout_ms / 1000, max(1, max_bytes)
        )
        error = got.error
        reply: dict[str, Any] = {
            "n": 0,
            "end": got.end_of_sequence,
            "error": list(error.to_frame()) if error else None,
            "errors_ignored": source.errors_ignored,
        }
        fds = []
        read = got.frames
        if read is not None:
            self._unacked_read = (read.first_index, read.count)
            reply.update(n=read.count, pos=read.pos, seq=read.first_index, below=read.reclaim_below)
            reply["specs"] = {str(i): b.hex() for i, b in read.specs.items()}
            if read.fd is not None:
                reply.update(generation=read.generation, nonce=read.nonce.hex())
                fds = [read.fd]
        self._sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            self._reply(reply, fds)
        finally:
            for fd in fds:
                os.close(fd)
        if read is not None:  # the trainer has these now
            known_specs.update(read.specs)
            if read.fd is not None:
                generation = read.generation
        return generation

    def _produce(self, source: base.ElementSource) -> None:
        """Serves requests as gRPC's GetElements does: each request takes up to its
        number of elements from the task (waiting up to its timeout for the first),
        announces how many follow on the socket, then writes them into the ring. The
        worker never takes an element from a shared task that no request asked for.

        The elements come from `source`, the worker's choice for the HELLO: the
        task's buffer, or (a HELLO naming a `trainer_id`) the task's cross-trainer
        cache from that trainer's cursor, as gRPC's GetElements with that trainer id
        reads, each element copied into this ring.

        A consumer that goes away (crash, closed connection) before taking all of its
        last reply gives back what it did not take (`_give_back_untaken`): to the
        task's buffer when the source `gives_back`, else (a trainer's cache read) to
        that trainer's next read. That includes the reply that ends the stream (its
        last elements, then END): the connection stays until the consumer took them
        all or went away, and until then the task's other consumers get no end of
        sequence (`ElementSource.read_holding_end`)."""
        server = self._server
        max_frame = max(1, self.ring.max_frame_bytes)
        try:
            self._serve_requests(source, max_frame)
        finally:
            if not server.stopping:
                self._give_back_untaken(source)

    def _taken(self) -> int:
        """Elements the consumer took out of the ring (its `consumer_elements`)."""
        ring = self.ring
        if ring is None:
            return self._written
        return int(ring.stats().get("consumer_elements", self._written))

    def _give_back_untaken(self, source: base.ElementSource) -> None:
        """The consumer went away (or the serving ended) before asking again: the
        elements of its last reply it did not take out of the ring (the ring's
        `consumer_elements`) or that were never written go back to the front of the
        task's buffer, for the task's other consumers (first come, first served), or,
        for a source that keeps its elements (a trainer's cache read), to the
        trainer's next read. The elements it took are its own, even if it crashed
        before using them."""
        reply, self._reply_elements = self._reply_elements, []
        if not reply:
            return
        untaken = reply[max(0, self._taken() - self._reply_first) :]
        if not untaken:
            return
        if not source.gives_back:
            source.give_back_unacknowledged(len(untaken))
            return
        log.info(
            "shm consumer of task %d went away without %d of the %d elements of its "
            "last reply; they go back to the task",
            source.task_id,
            len(untaken),
            len(reply),
        )
        source.give_back(untaken)

    def _await_final_take(self) -> None:
        """After the stream's last reply: returns once the consumer took every element
        out of the ring, closed the connection, or sent anything, or the worker stops
        (checks every 5-50 ms)."""
        poll_s = 0.005
        while not self._server.stopping and self._taken() < self._written:
            self._sock.settimeout(poll_s)
            try:
                data = self._sock.recv(64)
            except (TimeoutError, InterruptedError):
                poll_s = min(0.05, poll_s * 2)
                continue
            except OSError:
                return
            if not data:
                return
            if self._reusable:  # e.g. a REBIND: the consumer took what it wanted
                self._pending = data
                return
            log.warning("shm: unexpected %d-byte message after the end of a stream", len(data))
            return

    def _serve_requests(self, source: base.ElementSource, max_frame: int) -> None:
        server = self._server
        ended = False
        while (data := self._next_message()) is not None:  # until the client closes
            if self._reusable and len(data) == REBIND.size and data[:1] == b"B":
                # Between requests: the consumer took every element of the last reply.
                self._rebind_to = REBIND.unpack(data)[1]
                return
            if ended or len(data) != REQUEST.size or data[:1] != b"G":
                log.warning("shm: unexpected %d-byte message from a client", len(data))
                return
            _, want, max_bytes, timeout_ms = REQUEST.unpack(data)
            max_bytes = max(1, min(max_bytes, 16 * max_frame))
            self._reply_elements = []  # a new request: the consumer took the last reply
            if source.stopped:
                # The worker dropped the task (or is stopping): the consumer learns it
                # reconnecting, rather than getting empty replies at once, in a loop.
                return
            read = source.read_holding_end(max(1, want), max_bytes, timeout_ms / 1000)
            go_on = False
            try:
                go_on = self._send_reply(read, source.errors_ignored)
            finally:
                if read.end_held:
                    # What the consumer did not take goes back before the others' end.
                    if not server.stopping:
                        self._give_back_untaken(source)
                    source.release_end()
            if not go_on:
                if not (self._reusable and read.end_of_sequence and read.error is None):
                    return
                # The stream ended; the connection waits for a REBIND (or its close).
                ended = True

    def _send_reply(self, read: base.TaskRead, errors_ignored: int = 0) -> bool:
        """Announces `read` on the socket and writes its elements (then END or ERROR)
        into the ring; after the stream's last reply, waits for the consumer to take
        it (`_await_final_take`). Returns whether the connection serves on (False:
        the stream ended, or the consumer or the server is going)."""
        elements, end, error = read.elements, read.end_of_sequence, read.error
        flags = (END_FLAG if end and error is None else 0) | (ERROR_FLAG if error else 0)
        self._reply_elements, self._reply_first = elements, self._written
        self._sock.settimeout(HANDSHAKE_TIMEOUT_S)
        self._sock.send(RESPONSE.pack(b"R", len(elements), flags, errors_ignored))
        on_sent = self._server.host.on_sent
        ring = self.ring
        bytes_before = ring.stats()["bytes"] if on_sent is not None and elements else 0
        put = 0
        try:
            while put < len(elements):
                try:
                    n = self.ring.put_many(elements[put:], _PUT_SLICE_MS)
                except errors.UnavailableError:
                    return False  # the consumer is gone (what it did not take goes back)
                except Exception as err:  # e.g. an unpicklable leaf: a worker error
                    self._reply_elements = []
                    self.ring.put_error(*errors.capture(err).to_frame(), None)
                    return False
                put += n
                self._written += n
                if self._server.stopping:
                    return False
        finally:
            if on_sent is not None and put:
                on_sent("shm", put, ring.stats()["bytes"] - bytes_before)
        if error is not None or end:
            # The stream's last reply: its elements are the consumer's once it took
            # them (or given back, should it go away first).
            if error is not None:
                self.ring.put_error(*error.to_frame(), None)
            elif not self._reusable:
                self.ring.put_end(None)
            self._await_final_take()
            return False
        return True

    def close(self) -> None:
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.close()
            self._server.release_ring(self.ring_bytes)
        try:
            self._sock.close()
        except OSError:
            pass
        self._server.forget(self)


_live_servers: weakref.WeakSet[ShmTransferServer] = weakref.WeakSet()


def live_servers() -> list[ShmTransferServer]:
    """The "shm" servers of this process's running workers (for tests and stats)."""
    return list(_live_servers)


class ShmTransferServer(base.TransferServer):
    """A worker's "shm" endpoint: accepts connections and feeds rings. Thread-safe."""

    def __init__(self, host: base.TransferHost) -> None:
        self.host = host
        self.stopping = False
        requested = host.shm_ring_bytes or DEFAULT_RING_BYTES
        self._ring_bytes = max(64 << 10, min(_pow2_floor(requested), 4 << 30))
        self._mu = threading.Lock()
        self._ring_total = 0  # guarded by self._mu
        self._budget = ring_budget_bytes()
        self._connections: set[_Connection] = set()  # guarded by self._mu
        # One ring made ahead of the next connection (see take_ring), and whether a
        # thread is making it; guarded by self._mu (self._spare_made waits on it).
        self._spare: tuple[Any, int] | None = None
        self._making_spare = False
        self._spare_made = threading.Condition(self._mu)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.name = shm_socket_name(host.address)
        try:
            self._listener.bind(self.name)
        except OSError:
            self._listener.close()
            raise
        self._listener.listen(64)
        self._listener.setblocking(False)
        admission = ShmAdmission(
            self._listener,
            host.address,
            host.auth_token,  # required of every HELLO when set
            host.shm_allowed_uids,
            serving=self._serving,
            admit=self._admit,
            stopping=lambda: self.stopping,
        )
        self._thread = threading.Thread(target=admission.run, name="ds-shm-accept", daemon=True)
        self._admission: ShmAdmission | None = admission
        self._thread.start()
        _live_servers.add(self)

    def _serving(self) -> int:
        """How many authenticated connections are being served (any thread)."""
        with self._mu:
            return len(self._connections)

    def _admit(self, sock: socket.socket, hello: dict[str, Any], peer_pid: int) -> None:
        """Serves an authenticated connection on a thread of its own (called by the
        accept thread once the HELLO checked out)."""
        conn = _Connection(self, sock, hello, peer_pid)
        with self._mu:
            self._connections.add(conn)
        conn.thread.start()

    def create_ring(self) -> tuple[Any, int]:
        """A new producer ring within the memory budget (halved down to 8 MiB).

        Raises:
            ResourceExhaustedError: Even the smallest ring does not fit.
        """
        size = self._ring_bytes
        floor = min(MIN_RING_BYTES, size)
        with self._mu:
            while size > floor and self._ring_total + size > self._budget:
                size //= 2
            if self._ring_total + size > self._budget:
                raise errors.ResourceExhaustedError(
                    f"shared-memory ring budget exhausted: {self._ring_total} of "
                    f"{self._budget} bytes in use, {size} more requested"
                )
            self._ring_total += size
        while True:
            try:
                return _core.ShmRingProducer(size), size
            except errors.ResourceExhaustedError:
                if size // 2 < floor:
                    self.release_ring(size)
                    raise
                with self._mu:
                    self._ring_total -= size // 2
                size //= 2

    def take_ring(self) -> tuple[Any, int]:
        """A producer ring for a new connection: the spare one made ahead (waiting
        for it if it is being made), else a new one (`create_ring`); then a new
        spare is made on a thread of its own.

        Making a ring is a memfd of `shm_ring_bytes` with its first 1 MiB allocated
        and pre-faulted (~1.5 ms; the rest is allocated as the producer's first lap
        reaches it), which a consumer's first element would otherwise wait for. A
        ring is never reused: a consumer
        gone from a ring may still hold views of it (zero-copy leaves stay valid
        after its close), so only a memfd no consumer has seen is handed out. The
        spare is made only after the first connection (a worker whose consumers are
        all remote never holds one), only at full size within the ring budget, and
        counts in `ring_bytes_in_use`; `stop` closes it.

        Raises:
            ResourceExhaustedError: No spare, and even the smallest ring does not
                fit the budget.
        """
        with self._mu:
            while self._making_spare and self._spare is None and not self.stopping:
                # Being made: sooner ready than a ring of our own (and within budget).
                self._spare_made.wait(1.0)
            spare, self._spare = self._spare, None
        ring = spare if spare is not None else self.create_ring()
        self._make_spare()
        return ring

    def _make_spare(self) -> None:
        """Starts a thread making the spare ring, unless there is one, one is being
        made, the server is stopping, or a full-size ring does not fit the budget."""
        with self._mu:
            if (
                self.stopping
                or self._spare is not None
                or self._making_spare
                or self._ring_total + self._ring_bytes > self._budget
            ):
                return
            self._making_spare = True
        threading.Thread(target=self._spare_thread, name="ds-shm-spare-ring", daemon=True).start()

    def _spare_thread(self) -> None:
        made: tuple[Any, int] | None = None
        try:
            made = self.create_ring()
            if made[1] != self._ring_bytes:  # halved: not worth holding ahead
                made[0].close()
                self.release_ring(made[1])
                made = None
        except Exception as err:  # e.g. ResourceExhaustedError: connections make their own
            log.debug("shm: no spare ring made: %s", err)
        with self._mu:
            self._making_spare = False
            if made is not None and not self.stopping:
                self._spare, made = made, None
            self._spare_made.notify_all()
        if made is not None:  # stopping meanwhile
            made[0].close()
            self.release_ring(made[1])

    def _drop_spare(self) -> None:
        """Closes the spare ring (at stop), after waiting up to 2 s for one being made."""
        with self._mu:
            deadline = time.monotonic() + 2.0
            while self._making_spare and time.monotonic() < deadline:
                self._spare_made.wait(max(0.0, deadline - time.monotonic()))
            spare, self._spare = self._spare, None
        if spare is not None:
            spare[0].close()
            self.release_ring(spare[1])

    def release_ring(self, size: int) -> None:
        with self._mu:
            self._ring_total -= size

    def forget(self, conn: _Connection) -> None:
        with self._mu:
            self._connections.discard(conn)

    def ring_bytes_in_use(self) -> int:
        with self._mu:
            return self._ring_total

    def ring_stats(self) -> list[dict[str, int]]:
        """Counters of each live ring (`buffered_bytes`: published, not yet freed)."""
        with self._mu:
            rings = [c.ring for c in self._connections if c.ring is not None]
        return [dict(r.stats()) for r in rings]

    def begin_stop(self) -> None:
        self.stopping = True

    def stop(self) -> None:
        """Stops accepting, ends every connection (their loops check `stopping` every
        0.2 s; reads waiting for elements end when the worker stops its tasks) and
        closes their rings and sockets, waiting up to 2 s for each thread."""
        self.stopping = True
        _live_servers.discard(self)
        self._thread.join(timeout=2)  # the accept loop checks `stopping` every 0.2 s
        try:
            self._listener.close()
        except OSError:
            pass
        # The admission's callbacks are this server's methods: a cycle, broken here.
        self._admission = None
        self._drop_spare()
        with self._mu:
            conns = list(self._connections)
        for conn in conns:
            conn.thread.join(timeout=2)
            if conn.thread.is_alive():
                log.warning(
                    "shm: a connection's thread of worker %s did not end within 2 s of stop",
                    self.host.address,
                )


base.register_server(PROTOCOL, ShmTransferServer)
