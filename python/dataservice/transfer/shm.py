"""The "shm" transfer protocol: same-host elements through shared-memory rings.

A worker serves a Unix SOCK_SEQPACKET socket at the abstract name
`shm_socket_name(worker.address)`. A client connects once per task (one
connection per consumer iterator and task). Any local process can connect to
an abstract name, so the worker's accept thread first checks the peer's uid
(SO_PEERCRED: the worker's own, root, or `shm_allowed_uids`) and sends a
random challenge; the client (having checked the worker's uid the same way)
answers with HELLO {task_id, pid, auth: HMAC-SHA256(token, challenge)}, within
`AUTH_DEADLINE_S`, and only then does the connection get a serving thread
(see shm_admission.py, which owns the worker's side of it, and SECURITY.md). The worker creates
a ring (a sealed memfd, see `_core.ShmRingProducer`), replies {capacity,
nonce} with the memfd attached (SCM_RIGHTS), and runs a producer thread that
moves the task's elements into the ring. The socket stays open for
the ring's life: it carries the client's credit grants (how many elements it
wants; the worker never runs further ahead) and is the liveness channel (HUP).

A cross-trainer cache read names its trainer in the HELLO {trainer_id}; every
request on that connection is then served from the task's `CrossTrainerCache`
for that trainer (its cursor; a lagging trainer skips to the oldest cached
element), as gRPC's GetElements with that trainer id is. There is no ring
then: the cache's window is one shared-memory segment (rust/shm/window.rs)
holding each cached element once, as a frame. The handshake hands the trainer
that segment's memfd and a hold slot; a reply names the frames to read
(position, count, first element's index, plus any spec and newer segment the
trainer has not seen) and the trainer decodes them from its own mapping,
leasing large numpy leaves as views (private copy-on-write mappings, so one
trainer's writes never reach another), then sends DONE. The pipeline runs once
and the data is in memory once, however many trainers read it. A worker whose
cache could not get shared memory, or has all 64 hold slots taken, serves the
trainer through a ring of its own as before (each element copied into it).

No element of a shared task is lost with a consumer that goes away mid-read:
the consumer asks for its next reply only once it took the last one out of the
ring, and the ring's header counts the elements it took; when its connection
ends first, the elements of its last reply it never took go back to the front
of the task's buffer for the task's other consumers (the ones it took are its
own). This costs one relaxed atomic store per `get_many`, no RPC or copy.

Ring bytes per worker are capped at 25 % of min(MemAvailable, cgroup limit -
usage) (`ring_budget_bytes`, in shm_budget.py); past that a new ring is halved
(down to 8 MiB), and then refused, so "auto" clients fall back to gRPC.

Zero-copy reads (numpy leaves of >= 64 KiB handed out as views of the ring,
kept valid by leases) are on by default; `distribute(..., zero_copy=False)` or
the environment variable `DATASERVICE_SHM_ZERO_COPY=0` makes a client copy
every leaf out of the ring instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import threading
import time
import weakref
from typing import Any

from dataservice import _core, auth, errors
from dataservice.locality import host_id
from dataservice.transfer import base
from dataservice.transfer.shm_admission import AUTH_DEADLINE_S as AUTH_DEADLINE_S
from dataservice.transfer.shm_admission import (
    HELLO_MAX_BYTES,
    LAYOUT_VERSION,
    ShmAdmission,
)
from dataservice.transfer.shm_admission import MAX_CONNECTIONS as MAX_CONNECTIONS
from dataservice.transfer.shm_admission import MAX_PENDING_HANDSHAKES as MAX_PENDING_HANDSHAKES
from dataservice.transfer.shm_admission import MAX_PENDING_PER_PEER as MAX_PENDING_PER_PEER
from dataservice.transfer.shm_budget import ring_budget_bytes

log = logging.getLogger(__name__)

PROTOCOL = "shm"
DEFAULT_RING_BYTES = 64 << 20
MIN_RING_BYTES = 8 << 20
ZERO_COPY_ENV = "DATASERVICE_SHM_ZERO_COPY"
_HANDSHAKE_TIMEOUT_S = 10.0
_TASK_WAIT_S = 4.0  # a worker learns of a new task by its next heartbeat
_CONNECT_RETRY_S = 3.0
_REQUEST = struct.Struct("<cQQI")  # b"G", max elements, max bytes, timeout (ms)
_RESPONSE = struct.Struct("<cQB")  # b"R", elements that follow in the ring, flags
_END_FLAG = 1  # an END frame follows them
_ERROR_FLAG = 2  # an ERROR frame follows them
_PUT_SLICE_MS = 200
_DONE = b"D"  # a cache-window trainer finished decoding the frames of its last reply
_WINDOW_REPLY_BYTES = 256 << 10  # a reply: JSON, specs included (SEQPACKET: ~200 KB at most)


def shm_socket_name(worker_address: str) -> str:
    """The abstract Unix socket name a worker at `worker_address` listens on.

    Abstract names live in the network namespace, so another namespace (a
    container) cannot connect and falls back to gRPC; the host id's hash keeps
    two hosts' names apart should they ever share one.
    """
    digest = hashlib.sha1(host_id().encode()).hexdigest()[:16]
    return f"\0dataservice/{digest}/{worker_address}"


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


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

    def _reply(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        data = json.dumps(message).encode()
        if fds:
            socket.send_fds(self._sock, [data], fds)
        else:
            self._sock.send(data)

    def _next_message(self) -> bytes | None:
        """The client's next control message (a request, or a window reply's DONE);
        None once it closed the connection or the server is stopping (checked every
        0.2 s)."""
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

    def _serve(self) -> None:
        server = self._server
        self._sock.settimeout(_HANDSHAKE_TIMEOUT_S)
        hello, peer_pid = self._hello, self._peer_pid
        task_id = int(hello["task_id"])
        trainer_id = str(hello.get("trainer_id") or "")
        runner = server.worker.task_runner(task_id)
        deadline = time.monotonic() + _TASK_WAIT_S
        while runner is None and time.monotonic() < deadline and not server.stopping:
            time.sleep(0.01)
            runner = server.worker.task_runner(task_id)
        if runner is None:
            self._reply({"ok": False, "error": f"worker does not run task {task_id}"})
            return
        cache = runner.cross_trainer_cache if trainer_id else None
        if cache is not None and hello.get("window") and cache.shared:
            slot = cache.attach()
            if slot is not None:
                try:
                    self._serve_window(cache, trainer_id, slot, peer_pid)
                finally:
                    cache.detach(slot)
                return
        try:
            self.ring, self.ring_bytes = server.create_ring()
        except Exception as err:
            self._reply({"ok": False, "error": str(err)})
            return
        self._reply(
            {
                "ok": True,
                "capacity_bytes": self.ring.capacity_bytes,
                "nonce": self.ring.nonce.hex(),
                "pid": os.getpid(),
                "worker_uid": getattr(server.worker, "_uid", ""),  # new at each start
                "trainer_id": trainer_id,  # what the requests are served for
            },
            [self.ring.fileno()],
        )
        self.ring.set_peer(self._sock.fileno(), peer_pid)
        self._produce(runner, trainer_id)

    def _serve_window(self, cache: Any, trainer_id: str, slot: int, peer_pid: int) -> None:
        """Serves a same-host trainer from the cache's shared window: the handshake
        hands over the segment's memfd and hold slot `slot`; each request is answered
        with the frames to read (position, count, first element's index, the specs and
        segment the trainer has not seen), which the trainer decodes from its own
        mapping, then acknowledges with DONE (its holds are stored by then), which
        lifts the grant the reply set. See rust/shm/window.rs."""
        server = self._server
        generation, fd, nonce = cache.segment()
        try:
            self._reply(
                {
                    "ok": True,
                    "window": True,
                    "slot": slot,
                    "generation": generation,
                    "nonce": nonce.hex(),
                    "pid": os.getpid(),
                    "worker_uid": getattr(server.worker, "_uid", ""),
                    "trainer_id": trainer_id,
                },
                [fd],
            )
        finally:
            os.close(fd)
        known_specs: set[int] = set()
        # Until the trainer closes the connection (detach clears its slot).
        while (data := self._next_message()) is not None:
            if data == _DONE:
                cache.writer.ungrant(slot)
                continue
            if len(data) != _REQUEST.size or data[:1] != b"G":
                log.warning("shm: unexpected %d-byte message from a client", len(data))
                return
            _, want, max_bytes, timeout_ms = _REQUEST.unpack(data)
            cache.writer.ungrant(slot)  # a new request: the last reply is done with too
            read, end, error = cache.get_window(
                trainer_id,
                slot,
                generation,
                known_specs,
                max(1, want),
                timeout_ms / 1000,
                max_bytes=max(1, max_bytes),
            )
            reply: dict[str, Any] = {
                "n": 0,
                "end": end,
                "error": list(error.to_frame()) if error else None,
            }
            fds = []
            if read is not None:
                reply.update(
                    n=read.count, pos=read.pos, seq=read.first_index, below=read.reclaim_below
                )
                reply["specs"] = {str(i): b.hex() for i, b in read.specs.items()}
                known_specs.update(read.specs)
                if read.fd is not None:
                    generation = read.generation
                    reply.update(generation=generation, nonce=read.nonce.hex())
                    fds = [read.fd]
            self._sock.settimeout(_HANDSHAKE_TIMEOUT_S)
            try:
                self._reply(reply, fds)
            finally:
                for fd in fds:
                    os.close(fd)

    def _produce(self, runner: Any, trainer_id: str = "") -> None:
        """Serves requests as gRPC's GetElements does: each request takes up to its
        number of elements from the task (waiting up to its timeout for the first),
        announces how many follow on the socket, then writes them into the ring. The
        worker never takes an element from a shared task that no request asked for.

        A connection whose HELLO named a `trainer_id` reads through the task's
        cross-trainer cache instead, as gRPC's GetElements with that trainer id
        does: from that trainer's cursor, each element copied into this ring.

        A consumer that goes away (crash, closed connection) before taking all of its
        last reply gives back what it did not take (`_give_back_untaken`), except for
        a trainer's cache reads and the reply that ends the stream."""
        server = self._server
        max_frame = max(1, self.ring.max_frame_bytes)
        cache = runner.cross_trainer_cache if trainer_id else None
        try:
            self._serve_requests(runner, trainer_id, cache, max_frame)
        finally:
            if not trainer_id and not server.stopping:
                self._give_back_untaken(runner)

    def _give_back_untaken(self, runner: Any) -> None:
        """The consumer went away (or the serving ended) before asking again: the
        elements of its last reply it did not take out of the ring (the ring's
        `consumer_elements`) or that were never written go back to the front of the
        task's buffer, for the task's other consumers (first come, first served). The
        elements it took are its own, even if it crashed before using them."""
        reply, self._reply_elements = self._reply_elements, []
        if not reply:
            return
        taken = self._written
        ring = self.ring
        if ring is not None:
            taken = int(ring.stats().get("consumer_elements", self._written))
        untaken = reply[max(0, taken - self._reply_first) :]
        if untaken:
            log.info(
                "shm consumer of task %d went away without %d of the %d elements of its "
                "last reply; they go back to the task",
                runner.task_id,
                len(untaken),
                len(reply),
            )
            runner.requeue(untaken)

    def _serve_requests(self, runner: Any, trainer_id: str, cache: Any, max_frame: int) -> None:
        server = self._server
        while (data := self._next_message()) is not None:  # until the client closes
            if len(data) != _REQUEST.size or data[:1] != b"G":
                log.warning("shm: unexpected %d-byte message from a client", len(data))
                return
            _, want, max_bytes, timeout_ms = _REQUEST.unpack(data)
            max_bytes = max(1, min(max_bytes, 16 * max_frame))
            self._reply_elements = []  # a new request: the consumer took the last reply
            if not trainer_id:
                elements, end, error = runner.get_elements_raw(
                    max(1, want), max_bytes, timeout_ms / 1000
                )
            elif cache is not None:
                elements, end, error = cache.get_elements(
                    trainer_id, max(1, want), timeout_ms / 1000, max_bytes=max_bytes
                )
            else:
                elements, end = [], True
                error = errors.RemoteErrorInfo(
                    "FailedPreconditionError",
                    f"task {runner.task_id} does not use a cross-trainer cache, but a "
                    f"read for trainer {trainer_id!r} asked for one",
                )
            flags = (_END_FLAG if end and error is None else 0) | (_ERROR_FLAG if error else 0)
            if not trainer_id:
                self._reply_elements, self._reply_first = elements, self._written
            self._sock.settimeout(_HANDSHAKE_TIMEOUT_S)
            self._sock.send(_RESPONSE.pack(b"R", len(elements), flags))
            put = 0
            while put < len(elements):
                try:
                    n = self.ring.put_many(elements[put:], _PUT_SLICE_MS)
                except errors.UnavailableError:
                    return  # the consumer is gone (what it did not take goes back)
                except Exception as err:  # e.g. an unpicklable leaf: a worker error
                    self._reply_elements = []
                    self.ring.put_error(*errors.capture(err).to_frame(), None)
                    return
                put += n
                self._written += n
                if server.stopping:
                    return
            if error is not None or end:
                # The stream's last reply: the connection ends with it, so it is not
                # waited on (nor given back should the consumer crash reading it).
                self._reply_elements = []
                if error is not None:
                    self.ring.put_error(*error.to_frame(), None)
                else:
                    self.ring.put_end(None)
                return

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

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.stopping = False
        config = getattr(worker, "_config", None)
        requested = getattr(config, "shm_ring_bytes", None) or DEFAULT_RING_BYTES
        self._ring_bytes = max(64 << 10, min(_pow2_floor(requested), 4 << 30))
        self._mu = threading.Lock()
        self._ring_total = 0  # guarded by self._mu
        self._budget = ring_budget_bytes()
        self._connections: set[_Connection] = set()  # guarded by self._mu
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.name = shm_socket_name(worker.address)
        try:
            self._listener.bind(self.name)
        except OSError:
            self._listener.close()
            raise
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._admission = ShmAdmission(
            self._listener,
            worker.address,
            worker.auth_token,  # required of every HELLO when set
            frozenset(getattr(config, "shm_allowed_uids", None) or ()),
            serving=self._serving,
            admit=self._admit,
            stopping=lambda: self.stopping,
        )
        self._thread = threading.Thread(
            target=self._admission.run, name="ds-shm-accept", daemon=True
        )
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

    def stop(self) -> None:
        self.stopping = True
        _live_servers.discard(self)
        self._thread.join(timeout=2)  # the accept loop checks `stopping` every 0.2 s
        try:
            self._listener.close()
        except OSError:
            pass
        with self._mu:
            conns = list(self._connections)
        for conn in conns:
            conn.thread.join(timeout=2)


class ShmTransferClient(base.TransferClient):
    """Reads one task's elements from a worker's ring; one caller thread at a time.

    Raises:
        TransferUnavailable: No worker socket on this host, or the handshake or
            ring mapping failed (the caller may fall back to gRPC).
    """

    protocol = PROTOCOL
    worker_uid = ""  # the worker process's id, from the handshake

    def __init__(
        self,
        endpoint: base.TaskEndpoint,
        auth_token: str | None = None,
        zero_copy: bool = True,
        trainer_id: str = "",
    ) -> None:
        self._endpoint = endpoint
        self._trainer_id = trainer_id
        if os.environ.get(ZERO_COPY_ENV, "1") in ("0", "false", "False"):
            zero_copy = False
        self._end = False
        self._error: BaseException | None = None
        self._ring: Any = None
        self._window: Any = None  # a cross-trainer cache's shared window, instead of a ring
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(_HANDSHAKE_TIMEOUT_S)
            self._connect(sock, endpoint.worker_address)
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            peer_pid, peer_uid, _ = struct.unpack("3i", creds)
            if peer_uid not in (os.getuid(), 0):
                # Checked before anything is sent: a process of another user that
                # took the worker's socket name learns nothing of the token.
                raise base.TransferUnavailable("the worker runs as another user")
            challenge = self._challenge(sock, endpoint.worker_address)
            hello: dict[str, Any] = {
                "v": LAYOUT_VERSION,
                "task_id": endpoint.task_id,
                "pid": os.getpid(),
            }
            token = auth.client_token(None, auth_token)
            if token is not None:  # proof of the token, not the token
                hello["auth"] = auth.challenge_response(token, challenge)
            if trainer_id:  # every request reads through the cross-trainer cache
                hello["trainer_id"] = trainer_id
                hello["window"] = True  # ... from its shared window, if the worker has one
            sock.send(json.dumps(hello).encode())
            try:
                data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
            except OSError as err:
                raise base.TransferUnavailable(f"shared-memory handshake failed: {err}") from err
            try:
                reply = json.loads(data or b"{}")
                if not reply.get("ok") or len(fds) != 1:
                    raise base.TransferUnavailable(
                        f"worker {endpoint.worker_address} refused a shared-memory ring: "
                        f"{reply.get('error', 'connection closed')}"
                    )
                if reply.get("trainer_id", "") != trainer_id:  # a worker that predates it
                    raise base.TransferUnavailable(
                        f"worker {endpoint.worker_address} does not serve cross-trainer "
                        "cache reads through shared memory"
                    )
                try:
                    if reply.get("window"):
                        self._window = _core.ShmWindowReader(
                            fds[0],
                            int(reply["slot"]),
                            int(reply["generation"]),
                            nonce=bytes.fromhex(reply["nonce"]),
                            control_fd=sock.fileno(),
                            zero_copy=zero_copy,
                        )
                    else:
                        self._ring = _core.ShmRingConsumer(
                            fds[0],
                            control_fd=sock.fileno(),
                            pid=peer_pid,
                            nonce=bytes.fromhex(reply["nonce"]),
                            zero_copy=zero_copy,
                        )
                except (errors.DataServiceError, OSError, ValueError) as err:
                    raise base.TransferUnavailable(f"cannot map the ring: {err}") from err
            finally:
                for fd in fds:
                    os.close(fd)
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        # A quarter of the ring: the worker can write on while the reader holds
        # what it fetched (views into the ring) and the consumer holds one more.
        # (A window's frames are the cache's: a reply is bounded as a ring's.)
        self.max_unconsumed_bytes = max(1, int(reply.get("capacity_bytes", 64 << 20)) // 4)
        self.worker_uid = str(reply.get("worker_uid", ""))

    @staticmethod
    def _challenge(sock: socket.socket, worker_address: str) -> bytes:
        """The worker's first message: the challenge to answer with the token.

        Raises:
            TransferUnavailable: The worker refused the connection (its reason)
                or sent no challenge.
        """
        try:
            data = sock.recv(HELLO_MAX_BYTES)
        except OSError as err:
            raise base.TransferUnavailable(f"shared-memory handshake failed: {err}") from err
        try:
            message = json.loads(data or b"{}")
            if message.get("ok") is False:
                raise base.TransferUnavailable(
                    f"worker {worker_address} refused a shared-memory connection: "
                    f"{message.get('error')}"
                )
            if message.get("v") != LAYOUT_VERSION:
                raise ValueError(f"layout version {message.get('v')!r}")
            return bytes.fromhex(message["challenge"])
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise base.TransferUnavailable(
                f"worker {worker_address} sent no shared-memory challenge: {err}"
            ) from err

    @staticmethod
    def _connect(sock: socket.socket, worker_address: str) -> None:
        """Connects to the worker's socket, retrying a refused connection for up to
        `_CONNECT_RETRY_S` seconds: a worker being restarted (same address) comes
        back, while one without a shm endpoint makes the caller fall back then."""
        name = shm_socket_name(worker_address)
        deadline = time.monotonic() + _CONNECT_RETRY_S
        delay = 0.02
        while True:
            try:
                sock.connect(name)
                return
            except (ConnectionRefusedError, FileNotFoundError) as err:
                if time.monotonic() + delay > deadline:
                    raise base.TransferUnavailable(
                        f"no shared-memory endpoint for worker {worker_address}: {err}"
                    ) from err
            except OSError as err:
                raise base.TransferUnavailable(
                    f"no shared-memory endpoint for worker {worker_address}: {err}"
                ) from err
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def get_elements(
        self,
        max_elements: int,
        max_bytes: int,
        timeout_s: float,
        consumer_index: int = -1,
        round_index: int = -1,
        trainer_id: str = "",
    ) -> base.ElementsResult:
        """One request, as gRPC's GetElements: the worker answers with how many
        elements follow (at most `max_elements`; none if none came within
        `timeout_s`), then they arrive through the ring. A cross-trainer cache
        read names the trainer id the client was made with (its HELLO's).

        Raises:
            InvalidArgumentError: `trainer_id` is not the connection's.
        """
        ring = self._ring
        if ring is None and self._window is None:
            raise errors.CancelledError("shm transfer client is closed")
        if trainer_id != self._trainer_id:
            raise errors.InvalidArgumentError(
                f"this shared-memory connection reads for trainer {self._trainer_id!r}, "
                f"not {trainer_id!r}"
            )
        if self._error is not None:
            raise self._error
        if self._end:
            return base.ElementsResult([], 0, True)
        timeout_ms = max(1, int(timeout_s * 1000))
        if self._window is not None:
            return self._get_window_elements(max_elements, max_bytes, timeout_s, timeout_ms)
        try:
            self._sock.send(_REQUEST.pack(b"G", max(1, max_elements), max_bytes, timeout_ms))
            self._sock.settimeout(timeout_s + 10.0)
            reply = self._sock.recv(64)
        except OSError:
            reply = b""
        if len(reply) != _RESPONSE.size:
            return self._after_death([], 0)
        _, count, flags = _RESPONSE.unpack(reply)
        out: list[Any] = []
        nbytes = 0
        while len(out) < count:
            try:
                elements, n, _, error = ring.get_many(count - len(out), 30_000)
            except errors.UnavailableError:
                return self._after_death(out, nbytes)
            out.extend(elements)
            nbytes += n
            if error is not None:  # an element could not be encoded: the rest never come
                self._error = errors.RemoteErrorInfo.from_frame(*error).to_exception(
                    self._endpoint.worker_address
                )
                if not out:
                    raise self._error
                return base.ElementsResult(out, nbytes, False, self.worker_uid)
        end = False
        if flags & (_END_FLAG | _ERROR_FLAG):
            try:
                _, _, end, error = ring.get_many(1, 30_000)
            except errors.UnavailableError:
                return self._after_death(out, nbytes)
            if error is not None:
                self._error = errors.RemoteErrorInfo.from_frame(*error).to_exception(
                    self._endpoint.worker_address
                )
                if not out:
                    raise self._error
            self._end = end
        return base.ElementsResult(out, nbytes, end, self.worker_uid)

    def _get_window_elements(
        self, max_elements: int, max_bytes: int, timeout_s: float, timeout_ms: int
    ) -> base.ElementsResult:
        """One request to a worker serving the cache's shared window: the reply names
        the frames, which are decoded from this process's mapping of the segment
        (large leaves leased: views), then DONE lets the worker reuse what is not
        held."""
        window = self._window
        address = self._endpoint.worker_address
        try:
            self._sock.send(_REQUEST.pack(b"G", max(1, max_elements), max_bytes, timeout_ms))
            self._sock.settimeout(timeout_s + 10.0)
            data, fds, _, _ = socket.recv_fds(self._sock, _WINDOW_REPLY_BYTES, 1)
        except OSError:
            data, fds = b"", []
        if not data:
            for fd in fds:
                os.close(fd)
            self._error = errors.UnavailableError(
                f"shared-memory connection to worker {address} lost"
            )
            raise self._error
        out: list[Any] = []
        nbytes = 0
        count = 0
        try:
            reply = json.loads(data)
            count = int(reply.get("n", 0))
            if fds:
                window.set_segment(
                    fds[0], int(reply["generation"]), nonce=bytes.fromhex(reply["nonce"])
                )
            for spec_id, body in (reply.get("specs") or {}).items():
                window.add_spec(int(spec_id), bytes.fromhex(body))
            if count:
                elements, nbytes = window.read(
                    int(reply["pos"]), count, int(reply["seq"]), reply.get("below")
                )
                out = list(elements)
        finally:
            for fd in fds:
                os.close(fd)
            if count:  # the holds of what we leased are stored: lift the grant
                try:
                    self._sock.send(_DONE)
                except OSError:
                    pass
        error = reply.get("error")
        if error:
            self._error = errors.RemoteErrorInfo.from_frame(*error).to_exception(address)
            if not out:
                raise self._error
            return base.ElementsResult(out, nbytes, False, self.worker_uid)
        self._end = bool(reply.get("end")) and not out
        return base.ElementsResult(out, nbytes, self._end, self.worker_uid)

    def _after_death(self, out: list[Any], nbytes: int) -> base.ElementsResult:
        """The worker side is gone: hand out what it published, then UnavailableError."""
        ring = self._ring
        while ring is not None:
            try:
                elements, n, _, error = ring.get_many(1024, 0)
            except errors.UnavailableError:
                break
            out.extend(elements)
            nbytes += n
            if error is not None:
                self._error = errors.RemoteErrorInfo.from_frame(*error).to_exception(
                    self._endpoint.worker_address
                )
                break
            if not elements:
                break
        if self._error is None:
            self._error = errors.UnavailableError(
                f"shared-memory connection to worker {self._endpoint.worker_address} lost"
            )
        if out:
            return base.ElementsResult(out, nbytes, False, self.worker_uid)
        raise self._error

    def stats(self) -> dict[str, Any]:
        if self._window is not None:
            return dict(self._window.stats())
        return dict(self._ring.stats()) if self._ring is not None else {}

    def close(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()
        window, self._window = self._window, None
        if window is not None:
            window.close()  # views alive become private copies before the worker hears
        try:
            self._sock.close()
        except OSError:
            pass


base.register_protocol(PROTOCOL, ShmTransferClient)
base.register_server(PROTOCOL, ShmTransferServer)
