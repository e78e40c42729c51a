"""The "shm" transfer protocol: same-host elements through shared-memory rings.

This module owns the protocol (the socket name, the messages both ends exchange,
`TrainerWindow`: what a worker's cross-trainer cache offers a same-host trainer)
and the consumer's end (`ShmTransferClient`). The worker's end is
`shm_server.py`; its accept thread and token handshake are `shm_admission.py`'s,
its ring budget `shm_budget.py`'s.

A worker serves a Unix SOCK_SEQPACKET socket at the abstract name
`shm_socket_name(worker.address)`. A client connects once per task (one
connection per consumer iterator and task); a connection its iterator is done
with stays open for `IDLE_CONNECTION_S`, and the process's next iterator with a
task on that worker moves it to its task with one REBIND message (`reuse_idle`):
streams on such a connection end by the reply's END_FLAG alone, so its ring
goes on, and a new iterator's first element waits for no handshake and no new
ring. Any local process can connect to
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
own). This costs one relaxed atomic store per `get_many`, no RPC or copy. The
reply that ends the stream is kept the same way (the worker waits for the
consumer to take it or hang up, and the task's other consumers get their end
only after), and a trainer's cache read, not acknowledged (DONE, the next
request, the ring's count) when its connection ends, goes back to that trainer
(`TrainerWindow.give_back`, `ElementSource.give_back_unacknowledged`).

Ring bytes per worker are capped at 25 % of min(MemAvailable, cgroup limit -
usage) (`ring_budget_bytes`, in shm_budget.py); past that a new ring is halved
(down to 8 MiB), and then refused, so "auto" clients fall back to gRPC.

Zero-copy reads (numpy leaves of >= 64 KiB handed out as views of the ring,
kept valid by leases) are on by default; `distribute(..., zero_copy=False)` or
the environment variable `DATASERVICE_SHM_ZERO_COPY=0` makes a client copy
every leaf out of the ring instead.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Any

from dataservice import _core, auth, errors
from dataservice.locality import host_id
from dataservice.transfer import base
from dataservice.transfer.shm_admission import AUTH_DEADLINE_S as AUTH_DEADLINE_S
from dataservice.transfer.shm_admission import HELLO_MAX_BYTES, LAYOUT_VERSION
from dataservice.transfer.shm_admission import MAX_CONNECTIONS as MAX_CONNECTIONS
from dataservice.transfer.shm_admission import MAX_PENDING_HANDSHAKES as MAX_PENDING_HANDSHAKES
from dataservice.transfer.shm_admission import MAX_PENDING_PER_PEER as MAX_PENDING_PER_PEER

log = logging.getLogger(__name__)

PROTOCOL = "shm"
ZERO_COPY_ENV = "DATASERVICE_SHM_ZERO_COPY"
_CONNECT_RETRY_S = 3.0
_WINDOW_REPLY_BYTES = 256 << 10  # a reply: JSON, specs included (SEQPACKET: ~200 KB at most)

# The wire, after the handshake (both ends: this module's client, shm_server.py's worker).
HANDSHAKE_TIMEOUT_S = 10.0
"""Longest wait (s) for the handshake's messages, and for the worker to send a reply."""
REQUEST = struct.Struct("<cQQI")
"""A client's request: b"G", max elements, max bytes, timeout (ms)."""
RESPONSE = struct.Struct("<cQBQ")
"""The worker's ring reply: b"R", elements that follow in the ring, flags, and the
task's `ElementSource.errors_ignored` after the read."""
END_FLAG = 1
"""RESPONSE flag: an END frame follows the elements."""
ERROR_FLAG = 2
"""RESPONSE flag: an ERROR frame follows the elements."""
DONE = b"D"
"""A cache-window trainer finished decoding the frames of its last reply."""
REBIND = struct.Struct("<cQ")
"""A reusable connection's client moves it to another task: b"B", task id. Sent only
between requests (every element announced so far taken out of the ring); the worker
answers with a JSON message {ok, worker_uid} or {ok: false, error} and then closes."""
END_IN_REPLY_ONLY = "end_in_reply"
"""HELLO / handshake key: the stream's end is the RESPONSE's END_FLAG alone, no END frame
(which ends a ring for good), so the connection and its ring can serve another task
(`REBIND`) once this one ended."""


def shm_socket_name(worker_address: str) -> str:
    """The abstract Unix socket name a worker at `worker_address` listens on.

    Abstract names live in the network namespace, so another namespace (a
    container) cannot connect and falls back to gRPC; the host id's hash keeps
    two hosts' names apart should they ever share one.
    """
    digest = hashlib.sha1(host_id().encode()).hexdigest()[:16]
    return f"\0dataservice/{digest}/{worker_address}"


@dataclasses.dataclass
class WindowRead:
    """Frames of a cross-trainer cache's window a same-host trainer is to read:
    `count` frames from byte position `pos` of segment `generation`, the first being
    element `first_index`; `reclaim_below`: the writer reuses space below that
    position within its next quarter of the segment (views of frames there are
    copied, not leased). `specs`: encoded element specs (by id) the trainer has not
    seen; `fd` (with `nonce`): the segment, when the trainer has not mapped it yet
    (a new fd the server closes once sent)."""

    generation: int
    pos: int
    count: int
    first_index: int
    reclaim_below: int
    specs: dict[int, bytes] = dataclasses.field(default_factory=dict)
    fd: int | None = None
    nonce: bytes = b""


@dataclasses.dataclass(frozen=True)
class WindowReply:
    """What one `TrainerWindow.read` took: the frames to read (None: none was ready
    within the read's wait), whether the stream ends after them, and the
    pipeline's failure reported there (None if none)."""

    frames: WindowRead | None
    end_of_sequence: bool = False
    error: errors.RemoteErrorInfo | None = None


class TrainerWindow(abc.ABC):
    """A cross-trainer cache's window in one shared-memory segment, as one trainer
    reads it (`ElementSource.window`; rust/shm/window.rs). Each same-host trainer
    connection holds a hold slot: the frames of its last reply are granted to it
    (never overwritten) until it says DONE or asks again. Thread-safe."""

    @abc.abstractmethod
    def attach(self) -> int | None:
        """A hold slot for a new trainer connection (None: all slots are taken)."""

    @abc.abstractmethod
    def detach(self, slot: int) -> None:
        """The connection holding `slot` is gone: its grant and holds go."""

    @abc.abstractmethod
    def segment(self) -> tuple[int, int, bytes]:
        """(generation, a new fd, nonce) of the current segment; the caller closes
        the fd."""

    @abc.abstractmethod
    def ungrant(self, slot: int) -> None:
        """Lifts the grant of `slot`'s last reply (the trainer stored its holds)."""

    @abc.abstractmethod
    def read(
        self,
        slot: int,
        known_generation: int,
        known_specs: set[int],
        max_elements: int,
        timeout_s: float,
        max_bytes: int,
    ) -> WindowReply:
        """Names the next frames of the trainer's cursor (up to `max_elements`, about
        `max_bytes` payload bytes, always one), waiting up to `timeout_s` seconds for
        the pipeline, and grants them to `slot`. The frames carry the segment when it
        is not `known_generation`, and the specs not in `known_specs`."""

    def give_back(self, first_index: int, count: int) -> None:  # noqa: B027  (optional)
        """The trainer's connection ended before it acknowledged (DONE, or its next
        request) elements [first_index, first_index + count) of a `read`: its next
        read, on any connection, starts with them. Default: nothing."""

    @property
    def closed(self) -> bool:
        """The window was dropped (its task stopped): nothing more to read."""
        return False


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
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
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
            else:  # the connection may serve this process's next iterators (`keep_idle`)
                hello[END_IN_REPLY_ONLY] = True
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
        # Half the ring, asked for in replies of a quarter (the reader's request sent
        # ahead needs room for a reply while the last is unconsumed: fetch.py): the
        # worker can write on while the reader holds what it fetched (views into the
        # ring) and the consumer holds the chunk it takes elements from. (A window's
        # frames are the cache's: a reply is bounded as a ring's.)
        self.max_unconsumed_bytes = max(1, int(reply.get("capacity_bytes", 64 << 20)) // 2)
        self.worker_uid = str(reply.get("worker_uid", ""))
        # The end of a stream comes as the reply's END_FLAG alone: the ring can serve
        # another task (`rebind`) once this one ended.
        self._end_in_reply = bool(reply.get(END_IN_REPLY_ONLY)) and self._ring is not None
        self._between_requests = True  # false while a request's elements are on their way
        # The request sent ahead (`request_ahead`): its timeout (s) while its reply is on
        # its way.
        self._sent: float | None = None
        self.idle_key = (endpoint.worker_address, zero_copy, auth.client_token(None, auth_token))
        """Which idle connections can serve a task: (worker address, zero_copy, token)."""

    @property
    def reusable(self) -> bool:
        """Whether another task of the same worker can be read through this connection
        (`rebind`): the worker ends streams without ending the ring, no request is
        half-read, and nothing failed."""
        return (
            self._end_in_reply
            and self._between_requests
            and self._ring is not None
            and self._error is None
        )

    def fileno(self) -> int:
        """The connection's socket (-1 once closed), for poll(2)."""
        return self._sock.fileno()

    def quiet(self) -> bool:
        """Whether the worker has neither hung up nor sent anything unasked (poll(2),
        no wait): only such a connection is kept idle."""
        try:
            events = select.poll()
            events.register(self._sock.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
            return not events.poll(0)
        except (OSError, ValueError):  # closed
            return False

    def rebind(self, endpoint: base.TaskEndpoint) -> None:
        """Moves this connection and its ring to `endpoint`'s task (same worker): one
        REBIND message and its answer instead of a new connection, token handshake
        and ring.

        Raises:
            TransferUnavailable: The worker refused (e.g. it does not run the task)
                or is gone; this client is closed then.
        """
        if not self.reusable or endpoint.worker_address != self._endpoint.worker_address:
            raise base.TransferUnavailable("this shared-memory connection cannot be rebound")
        try:
            self._sock.settimeout(HANDSHAKE_TIMEOUT_S)
            self._sock.send(REBIND.pack(b"B", endpoint.task_id))
            data = self._sock.recv(HELLO_MAX_BYTES)
            reply = json.loads(data or b"{}")
            if not isinstance(reply, dict) or not reply.get("ok"):
                error = reply.get("error") if isinstance(reply, dict) else None
                raise base.TransferUnavailable(
                    f"worker {endpoint.worker_address} did not move the connection to task "
                    f"{endpoint.task_id}: {error or 'connection closed'}"
                )
            self._sock.settimeout(None)
        except (OSError, ValueError) as err:
            self.close()
            raise base.TransferUnavailable(f"shared-memory rebind failed: {err}") from err
        except BaseException:
            self.close()
            raise
        self._endpoint = endpoint
        self._end = False
        self.worker_uid = str(reply.get("worker_uid", self.worker_uid))

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
        self._between_requests = False
        sent, self._sent = self._sent, None
        try:
            if sent is None:
                self._send_request(max_elements, max_bytes, timeout_ms)
            else:
                timeout_s = sent  # the request sent ahead's
            self._sock.settimeout(timeout_s + 10.0)
            reply = self._sock.recv(64)
        except OSError:
            reply = b""
        if len(reply) != RESPONSE.size:
            return self._after_death([], 0)
        _, count, flags, errors_ignored = RESPONSE.unpack(reply)
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
                return base.ElementsResult(out, nbytes, False, self.worker_uid, errors_ignored)
        end = False
        if flags & END_FLAG and not flags & ERROR_FLAG and self._end_in_reply:
            end = self._end = True  # no END frame: the ring goes on (`rebind`)
        elif flags & (END_FLAG | ERROR_FLAG):
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
        self._between_requests = True
        return base.ElementsResult(out, nbytes, end, self.worker_uid, errors_ignored)

    def _send_request(self, max_elements: int, max_bytes: int, timeout_ms: int) -> None:
        """Sends a GET request (at least one element). Raises OSError as `send`."""
        self._sock.send(REQUEST.pack(b"G", max(1, max_elements), max_bytes, timeout_ms))

    def request_ahead(
        self, max_elements: int, max_bytes: int, timeout_s: float, trainer_id: str = ""
    ) -> bool:
        """Sends the next request now (see `TransferClient.request_ahead`): the worker
        writes its reply into the ring while the reader hands the last one to its
        consumer (a round trip and the worker's turn each reply otherwise: ~20 % of a
        stream of 150 KB elements of 100 leaves). The worker still never gets a request
        before the last reply was taken out of the ring, so what a consumer that goes
        away did not take goes back to the task. A read that ends with a request on its
        way drops that reply's elements (`settle`) before its connection serves another
        read. Not for cross-trainer cache reads (a window's DONE ends each reply)."""
        if (
            self._ring is None
            or self._window is not None
            or trainer_id != self._trainer_id
            or self._error is not None
            or self._end
            or not self._between_requests
        ):
            return False
        try:
            self._send_request(max_elements, max_bytes, max(1, int(timeout_s * 1000)))
        except OSError:
            return False
        self._sent = timeout_s
        self._between_requests = False
        return True

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
            self._send_request(max_elements, max_bytes, timeout_ms)
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
                    self._sock.send(DONE)
                except OSError:
                    pass
        error = reply.get("error")
        ignored = int(reply.get("errors_ignored") or 0)
        if error:
            self._error = errors.RemoteErrorInfo.from_frame(*error).to_exception(address)
            if not out:
                raise self._error
            return base.ElementsResult(out, nbytes, False, self.worker_uid, ignored)
        self._end = bool(reply.get("end")) and not out
        return base.ElementsResult(out, nbytes, self._end, self.worker_uid, ignored)

    def settle(self, timeout_s: float) -> bool:
        """Takes the reply to a request sent ahead and still on its way
        (`request_ahead`) and drops its elements (the read that sent it is over), so
        that the connection can serve another read (`reusable`). Returns False if the
        reply and its elements did not all come within `timeout_s` seconds, or the
        stream failed: the caller closes the connection then."""
        if self._sent is None:
            return True
        self._sent = None
        ring = self._ring
        deadline = time.monotonic() + timeout_s
        try:
            self._sock.settimeout(timeout_s)
            reply = self._sock.recv(64)
        except OSError:
            return False
        if ring is None or len(reply) != RESPONSE.size:
            return False
        _, count, flags, _ = RESPONSE.unpack(reply)
        if flags & ERROR_FLAG or (flags & END_FLAG and not self._end_in_reply):
            return False  # an END or ERROR frame follows: the ring does not go on
        taken = 0
        while taken < count:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return False
            try:
                elements, _, _, error = ring.get_many(count - taken, left_ms)
            except errors.DataServiceError:
                return False
            if error is not None:
                return False
            taken += len(elements)
            del elements  # their leases go now
        if flags & END_FLAG:
            self._end = True
        self._between_requests = True
        return True

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
        # The stored error goes (a closed client raises CancelledError first): its
        # traceback and context hold the frames it was raised through, which hold this
        # client (a cycle only gc.collect() breaks) and their callers' locals: the
        # elements of a fetch, views that keep a ring mapped and its memfd open.
        self._error = None
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


IDLE_CONNECTION_S = 5.0
"""How long (s) a connection no iterator reads is kept for the next one (`keep_idle`):
it holds its worker's ring (`shm_ring_bytes`), and a memfd fd here, meanwhile. An
epoch's next iterator comes within ms of the last; one that comes later maps a new
ring (the worker's spare, made ahead)."""
SETTLE_S = 0.1
"""Longest wait (s) for the reply to a request sent ahead by a read that is over, to
keep its connection for the next read (`ShmTransferClient.settle`); the fetch thread
waits, not the consumer."""
MAX_IDLE_PER_WORKER = 2
"""At most this many idle connections are kept per worker (and token, zero_copy)."""


class _IdleConnections:
    """This process's connections that no iterator reads, by (worker address,
    zero_copy, token), each with the time it went idle; a reaper thread closes those
    idle for `IDLE_CONNECTION_S`. Thread-safe.

    A new iterator's task on the same worker takes one (`take`) and moves it to its
    task (`ShmTransferClient.rebind`), so its first element waits for no handshake
    and no new ring, as the connections of tf.data service's client reuse a worker's
    channel across iterators.
    """

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._idle: dict[tuple[Any, ...], list[tuple[ShmTransferClient, float]]] = {}
        self._reaper: threading.Thread | None = None

    def take(self, key: tuple[Any, ...]) -> ShmTransferClient | None:
        with self._mu:
            kept = self._idle.get(key)
            if not kept:
                return None
            client, _ = kept.pop()
            if not kept:
                del self._idle[key]
            return client

    def put(self, client: ShmTransferClient) -> None:
        key = client.idle_key
        with self._mu:
            kept = self._idle.setdefault(key, [])
            kept.append((client, time.monotonic()))
            surplus = kept[:-MAX_IDLE_PER_WORKER]
            del kept[:-MAX_IDLE_PER_WORKER]
            if self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap, name="ds-shm-idle-reaper", daemon=True
                )
                self._reaper.start()
        for old, _ in surplus:
            old.close()

    def _reap(self) -> None:
        """Closes each idle connection once its worker hangs up (a stopped or
        restarted worker: its ring goes with it) or it was idle for
        `IDLE_CONNECTION_S`; ends once none is kept. Waits in poll(2) on the idle
        sockets, at most 0.25 s at a time (a connection put meanwhile is watched
        from the next wait on)."""
        while True:
            with self._mu:
                now = time.monotonic()
                watched = {c.fileno(): c for e in self._idle.values() for c, _ in e}
                next_expiry = min(
                    (t + IDLE_CONNECTION_S for e in self._idle.values() for _, t in e),
                    default=now,
                )
            poller = select.poll()
            for fd in watched:
                poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
            timeout_ms = max(1, min(250, int((next_expiry - now) * 1000) + 1))
            gone = {watched[fd] for fd, _ in poller.poll(timeout_ms) if fd in watched}
            expired = []
            with self._mu:
                now = time.monotonic()
                for key in list(self._idle):
                    kept = self._idle[key]
                    expired += [c for c, t in kept if c in gone or now - t >= IDLE_CONNECTION_S]
                    kept[:] = [
                        (c, t) for c, t in kept if c not in gone and now - t < IDLE_CONNECTION_S
                    ]
                    if not kept:
                        del self._idle[key]
                done = not self._idle
                if done:
                    self._reaper = None  # a later put starts another
            for client in expired:
                client.close()
            if done:
                return

    def close_all(self) -> None:
        """Closes every idle connection (their workers free the rings)."""
        with self._mu:
            kept = [c for entries in self._idle.values() for c, _ in entries]
            self._idle.clear()
        for client in kept:
            client.close()

    def forget_after_fork(self) -> None:
        """In a forked child: the inherited connections are the parent's (closing
        one here would mark the parent's ring closed); they are left alone, as an
        iterator inherited mid-read is. (The child's copy of a ring consumer holds
        a duplicate of its socket, so the worker keeps such a ring until the parent
        closed it and the child exited.)"""
        _inherited.append(self._idle)
        self._mu = threading.Lock()
        self._idle = {}
        self._reaper = None


_idle = _IdleConnections()
_inherited: list[Any] = []  # a forked child's copies of the parent's idle connections
os.register_at_fork(after_in_child=_idle.forget_after_fork)


def reuse_idle(
    endpoint: base.TaskEndpoint, auth_token: str | None, zero_copy: bool
) -> ShmTransferClient | None:
    """An idle connection of this process to `endpoint`'s worker, moved to its task
    (`ShmTransferClient.rebind`); None if there is none, or none could be moved (a
    restarted worker, a task it does not run): the caller connects afresh."""
    if os.environ.get(ZERO_COPY_ENV, "1") in ("0", "false", "False"):
        zero_copy = False
    key = (endpoint.worker_address, zero_copy, auth.client_token(None, auth_token))
    while (client := _idle.take(key)) is not None:
        try:
            client.rebind(endpoint)
            return client
        except base.TransferUnavailable as err:
            log.debug("idle shared-memory connection not reused: %s", err)
    return None


def keep_idle(client: base.TransferClient) -> None:
    """Done with `client`: an shm connection that can serve another task is kept for
    this process's next iterators (`reuse_idle`, for `IDLE_CONNECTION_S`); any other
    client is closed."""
    if (
        isinstance(client, ShmTransferClient)
        and client.settle(SETTLE_S)
        and client.reusable
        and client.quiet()
    ):
        _idle.put(client)
    else:
        client.close()


base.register_protocol(PROTOCOL, ShmTransferClient)
