"""The gRPC transfer protocol: `WorkerService.GetElementsFrames` on the worker's port
(`GetElementsStream` for a worker without it).

Frames. A reply comes as small `ElementsHead` messages, each announcing the
encoded sizes of the next elements, followed by those elements' bytes as raw
messages (service.proto). Neither end copies an element into or out of a protobuf
field: the worker makes a large element's encoding in ~1 MiB pieces as it sends
them (`codec.encode_later`; gRPC's message limits are lifted, rpc/util.py), and
the client copies each message once, into one `bytearray` per element that
`codec.decode` turns into arrays without another copy (one whole `bytes` per
element: ~1,300 page faults per 9.6 MB element on the worker, half the rate).
The reader sends its next request (up to 32 MiB, `max_reply_bytes`) as soon as a
reply arrives (`request_ahead`), within its read-ahead. `compression="AUTO"` is
decided per link by measuring (`AutoCompression`). The consumer's malloc keeps
freed memory for reuse (`tune_malloc`): fresh pages cost more than the copies.

No element is lost between the worker and the consumer: each client numbers its
requests (a random `consumer_key` per client, `sequence` 1, 2, ...). The worker
keeps its reply until the next request acknowledges it, and a request retried
after a failure repeats its number and gets the same reply again
(worker/unacked_replies.py `UnackedReplies`). So a client is kept, not replaced,
after a failed request (`retry_in_place`): gRPC reconnects its channel itself.

Replies are streamed in messages of about 1 MiB (a large element's pieces; small
elements are joined into messages of up to 4 MiB) (server streaming, which gRPC
supports natively with flow control), and the call has no overall deadline:
instead it is cancelled when no message arrives for the no-progress timeout
($DATASERVICE_TRANSFER_NO_PROGRESS_MS, 30 s; `timeout_s` + up to
`_FIRST_MESSAGE_GRACE_S` for the first message). A 1 GiB element over a slow
link therefore arrives, however long it takes, while a worker that stops sending
ends the call with `DeadlineExceededError` within a bounded time. (A deadline
sized from the bytes in flight cannot work: the client does not know the reply's
size before it arrives, and one element always fits a reply.)

Slow links. A link that cannot move one message within the no-progress timeout
(1 MiB in 30 s: below ~35 KB/s; 4 MiB of joined small elements: ~140 KB/s) would
time out and resend the same reply forever.
So after a timeout the client asks again with messages a quarter the size (the
first time, a quarter of 1 MiB)
(`max_message_bytes`, down to `MIN_MESSAGE_BYTES`; an element bigger than that
comes in pieces) and replies of at most `_REPLY_MESSAGES` of them (`max_bytes`: the
worker cuts the stored reply, and the elements cut off come with the next
requests, so nothing is lost or sent twice), on a new connection (the cancelled
reply's bytes still in flight would otherwise hold the link up). Messages grow
back, doubling, while they arrive in under a quarter of the timeout, up to the
worker's default. When even
messages of `MIN_MESSAGE_BYTES` bring nothing new `STALLED_ATTEMPTS` times in a row
while the worker does answer (a reply asked for in small messages starts with its
size: the link moves less than 4 KiB per timeout), the request fails with
`TransferStalledError`, naming the worker, the reply's size and the
throughput measured, within about (4 + `STALLED_ATTEMPTS`) no-progress timeouts of
the reply's start. A wait past `_waits.FIRST_WARNING_S` logs what it waits for.
"""

from __future__ import annotations

import functools
import heapq
import logging
import threading
import time
import uuid
from concurrent import futures
from typing import Any

import grpc

from dataservice import _core, _proc, _waits, auth, errors
from dataservice.rpc import service_pb2, service_pb2_grpc
from dataservice.rpc import util as rpc_util
from dataservice.transfer import base, codec
from dataservice.transfer.auto_compression import AutoCompression

log = logging.getLogger(__name__)

NO_PROGRESS_ENV = "DATASERVICE_TRANSFER_NO_PROGRESS_MS"
# How long a reply may bring no message before the request is cancelled and retried
# (read at import, so LocalCluster's processes inherit it).
_NO_PROGRESS_S = _waits.env_ms(NO_PROGRESS_ENV, 30_000) / 1000
# The worker answers within the request's wait (timeout_s); a large reply sends an
# empty message before it starts encoding (and its size before its elements), so
# the first message comes promptly. At most the no-progress timeout.
_FIRST_MESSAGE_GRACE_S = 10.0
# The messages of a reply on a fast link: a large element's pieces, and where a
# slow link's messages start shrinking from.
_FULL_MESSAGE_BYTES = 1 << 20
# The largest message a worker sends when not asked for smaller ones (small elements
# joined, worker/serving.py's _JOIN_BYTES): messages grown back past it are asked for
# no more (the worker's default).
_DEFAULT_MESSAGE_BYTES = 4 << 20
# The smallest messages a client asks for after no-progress timeouts (a slow link).
MIN_MESSAGE_BYTES = 4 << 10
# After a timeout, messages are this many times smaller.
_SHRINK = 4
# A reply asked for with small messages holds at most this many of them (one element
# always fits): a retry resends less.
_REPLY_MESSAGES = 8
# Timeouts in a row with messages of MIN_MESSAGE_BYTES that brought nothing new
# before the request fails with TransferStalledError.
STALLED_ATTEMPTS = 3
# The read's RPC: the reply as ElementsHead messages and raw element bytes
# (service.proto); GetElementsStream serves a worker that lacks it.
_FRAMES_METHOD = (
    f"/{service_pb2.DESCRIPTOR.services_by_name['WorkerService'].full_name}/GetElementsFrames"
)


def check_announced(sizes: list[int], address: str) -> None:
    """Refuses element sizes a worker announced that cannot be received here: a
    negative one (a damaged head), or one larger than this host's memory (an element
    has no size limit of its own: one of several GiB comes in pieces).

    Raises:
        DataLossError: A negative size.
        ElementTooLargeError: A size over this host's physical memory.
    """
    if not sizes:
        return
    if min(sizes) < 0:
        raise errors.DataLossError(
            f"worker {address} announced an element of a negative size ({min(sizes)} bytes)"
        )
    largest = max(sizes)
    memory = _host_memory_bytes()
    if largest > memory:
        raise errors.ElementTooLargeError(
            f"worker {address} announced an element of {largest} bytes, more than this "
            f"host's memory ({memory} bytes): it cannot be received here"
        )


@functools.cache
def _host_memory_bytes() -> int:
    """This host's physical memory (bytes), read once: every head is checked."""
    import psutil

    return int(psutil.virtual_memory().total)


def tune_malloc() -> bool:
    """Once per consumer process (the first gRPC transfer client), asks glibc's
    malloc to keep up to `_proc.TRIM_THRESHOLD_BYTES` of freed memory for reuse
    instead of handing it back to the kernel at once (`_proc.tune_malloc`). Each
    element of a few MB read over gRPC is two fresh blocks of that size (gRPC's
    message `bytes`, then the element's own buffer); by default glibc trims its
    heap past twice the largest block freed so far, and every page of memory
    handed back and taken again costs a page fault and the kernel's zeroing:
    measured on 9.6 MB elements, 5,600 faults an element and 1.6 s of the
    consumer's CPU per GB read, against 1,200 and 0.8 s with the memory kept.
    (Workers tune it the same: `worker.server`.) $DATASERVICE_MALLOC_TUNING=0 leaves malloc
    as it is; other allocators than glibc's are left alone. Returns whether malloc
    was tuned now."""
    return _proc.tune_malloc()


class _Watchdog:
    """Cancels streaming calls that receive nothing for a while. One daemon thread,
    started on first use, that exits once no call has been watched for 10 s.
    Thread-safe."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._calls: dict[int, _Watch] = {}  # guarded by self._cv
        self._heap: list[tuple[float, int]] = []  # guarded by self._cv: (check at, id)
        self._thread: threading.Thread | None = None  # guarded by self._cv
        self._next_id = 0

    def watch(self, call: Any, timeout_s: float) -> _Watch:
        """Starts watching `call`: cancelled if `watch.deadline` (now + `timeout_s`,
        pushed on by `watch.progress`) passes before `watch.done()`."""
        with self._cv:
            self._next_id += 1
            watch = _Watch(self, self._next_id, call, time.monotonic() + timeout_s)
            self._calls[watch.id] = watch
            heapq.heappush(self._heap, (watch.deadline, watch.id))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ds-grpc-watchdog", daemon=True
                )
                self._thread.start()
            self._cv.notify()
        return watch

    def forget(self, watch_id: int) -> None:
        """Stops watching call `watch_id` (`_Watch.done`)."""
        with self._cv:
            self._calls.pop(watch_id, None)

    def _run(self) -> None:
        idle_since: float | None = None
        with self._cv:
            while True:
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    _, watch_id = heapq.heappop(self._heap)
                    watch = self._calls.get(watch_id)
                    if watch is None:
                        continue
                    if watch.deadline <= now:  # deadlines only move later
                        del self._calls[watch_id]
                        watch.expired = True
                        watch.call.cancel()
                    else:
                        heapq.heappush(self._heap, (watch.deadline, watch_id))
                if not self._calls:
                    self._heap.clear()
                    idle_since = idle_since or now
                    if now - idle_since > 10.0:
                        self._thread = None
                        return
                else:
                    idle_since = None
                wait_s = self._heap[0][0] - now if self._heap else 1.0
                self._cv.wait(max(0.01, min(wait_s, 1.0)))


class _Watch:
    def __init__(self, owner: _Watchdog, watch_id: int, call: Any, deadline: float) -> None:
        self._owner = owner
        self.id = watch_id
        self.call = call
        self.deadline = deadline  # read by the watchdog thread; only ever increases
        self.expired = False

    def progress(self, timeout_s: float) -> float:
        """A message arrived: the deadline is now + `timeout_s`. Returns now."""
        now = time.monotonic()
        self.deadline = now + timeout_s
        return now

    def done(self) -> None:
        self._owner.forget(self.id)


_watchdog = _Watchdog()


class _Attempt:
    """What one streamed reply brought, for the slow-link bookkeeping."""

    __slots__ = (
        "expired",
        "messages",
        "received",
        "largest_gap_s",
        "reply_bytes",
        "reply_elements",
        "largest_bytes",
        "payload_s",
    )

    def __init__(self) -> None:
        self.expired = False  # cancelled for the no-progress timeout
        self.messages = 0  # of any kind: the worker is alive and the link carries them
        self.received = 0  # element bytes received, in order from the reply's start
        # The longest wait for a message after the first (which waits for the worker's
        # read); a reply asked for in small messages starts with its size, so this
        # includes the time its first data message took.
        self.largest_gap_s = 0.0
        self.reply_bytes = 0  # from the reply's first message, when it takes several
        self.reply_elements = 0
        self.largest_bytes = 0
        # Seconds from each head that announced elements to the last of their bytes,
        # summed: the link's time for `received` (AUTO compression's measure).
        self.payload_s = 0.0


class GrpcTransferClient(base.TransferClient):
    """Fetches a task's elements over gRPC; one caller thread at a time."""

    protocol = "grpc"
    retry_in_place = True
    # A request costs ~1.7 ms besides its bytes: 32 MiB replies moved ~1.4x what 16 MiB
    # did (1 MiB elements); with the pipelined one, up to 64 MiB in flight per task.
    max_reply_bytes = 32 << 20

    def __init__(
        self,
        endpoint: base.TaskEndpoint,
        auth_token: str | None,
        compression: str = "",
        zero_copy: bool = True,  # elements over gRPC are always copies
        trainer_id: str = "",  # each request names its own trainer id
    ) -> None:
        tune_malloc()
        self._endpoint = endpoint
        self._compression = ""  # "" or "zstd" (set_compression)
        self._auto: AutoCompression | None = None  # "auto": chosen by measurement
        self.set_compression(compression)
        # The process's channel to this worker (never closed here), until a slow link
        # calls for a connection of this client's own (`_reconnect`).
        self._channel = rpc_util.shared_data_channel(endpoint.transfer_address)
        self._own_channel = False
        self._stub = service_pb2_grpc.WorkerServiceStub(self._channel)
        token = rpc_util.token_from_env(auth_token)
        auth.warn_if_sent_in_clear(
            endpoint.transfer_address, token, rpc_util.channel_uses_tls(endpoint.transfer_address)
        )
        self._metadata = rpc_util.call_metadata(token)
        self._error: errors.WorkerError | None = None  # the pipeline's, once reported
        self._consumer_key = uuid.uuid4().hex
        self._sequence = 1  # of the next request; repeated after a failed one
        self.no_progress_s = _NO_PROGRESS_S
        # Slow links (see the module): the message size asked for (None: the worker's
        # default, and replies as big as the caller asks), and the current request's
        # attempts: when the first began, the most of its reply any one brought, the
        # bytes all brought, how many in a row at MIN_MESSAGE_BYTES brought nothing new.
        self.message_bytes: int | None = None
        self._request_start: float | None = None
        self._best_received = 0
        self._total_received = 0
        self._attempts = 0
        self._stalled = 0
        self._reply_size = _Attempt()  # the sizes the worker announced
        self._current: _Attempt | None = None  # the try being received
        self._slow: _waits.SlowWait | None = None
        self._frames_ok = True  # False: the worker lacks GetElementsFrames
        self._frames = self._frames_stub()
        # A request sent ahead (`request_ahead`) runs on `_executor`'s thread, so the
        # worker reads, encodes and sends it while the consumer uses the last reply.
        self._executor: futures.ThreadPoolExecutor | None = None
        self._next: futures.Future[base.ElementsResult] | None = None
        self._call_mu = threading.Lock()
        self._live_call: Any = None  # guarded by _call_mu: the call being received
        self._closed = False  # guarded by _call_mu

    def get_elements(
        self,
        max_elements: int,
        max_bytes: int,
        timeout_s: float,
        consumer_index: int = -1,
        round_index: int = -1,
        trainer_id: str = "",
    ) -> base.ElementsResult:
        """One request (see `TransferClient.get_elements`), or the reply to the one
        sent ahead (`request_ahead`), or its error. A failed one may be retried by
        calling again: it repeats its sequence number, so the worker sends the same
        reply (or, after a no-progress timeout, the part of it that fits the smaller
        messages and replies asked for now; the rest comes next).

        Raises:
            As `_fetch`.
        """
        pending, self._next = self._next, None
        if pending is not None:
            return pending.result()  # bounded by that call's no-progress timeout
        return self._fetch(
            max_elements, max_bytes, timeout_s, consumer_index, round_index, trainer_id
        )

    def request_ahead(
        self, max_elements: int, max_bytes: int, timeout_s: float, trainer_id: str = ""
    ) -> bool:
        """Sends the next request now, on a thread of this client's (see
        `TransferClient.request_ahead`); it acknowledges the last reply, which is
        here. Not after the pipeline's error, nor on a closed client."""
        with self._call_mu:
            if self._closed or self._error is not None or self._next is not None:
                return False
            if self._executor is None:
                self._executor = futures.ThreadPoolExecutor(1, thread_name_prefix="ds-grpc-next")
            self._next = self._executor.submit(
                self._fetch, max_elements, max_bytes, timeout_s, -1, -1, trainer_id
            )
        return True

    def _fetch(
        self,
        max_elements: int,
        max_bytes: int,
        timeout_s: float,
        consumer_index: int,
        round_index: int,
        trainer_id: str,
    ) -> base.ElementsResult:
        """One request and its reply, on the caller's thread or the pipeline's (never
        both at once: `get_elements` waits for the pipelined one before another).

        Raises:
            DeadlineExceededError: No message from the worker for the no-progress
                timeout (`timeout_s` + up to 10 s for the first, 30 s between
                messages); the retry asks for smaller messages.
            TransferStalledError: The worker answered, but not even messages of
                `MIN_MESSAGE_BYTES` brought anything new within the no-progress
                timeout, `STALLED_ATTEMPTS` times in a row: the link is too slow for
                the timeout. Not worth retrying. (A worker that sends nothing at all
                keeps raising DeadlineExceededError: the worker-loss rules apply.)
            WorkerError, UnavailableError, NotFoundError: As `TransferClient`.
        """
        if self._error is not None:  # after the elements that came with it
            raise self._error
        if self._request_start is None:
            self._request_start = time.monotonic()
        message_bytes = self.message_bytes
        if message_bytes is not None:
            max_bytes = max(1, min(max_bytes, _REPLY_MESSAGES * message_bytes))
        auto = self._auto
        compression = auto.choose(time.monotonic()) if auto is not None else self._compression
        request = service_pb2.GetElementsRequest(
            task_id=self._endpoint.task_id,
            max_elements=max_elements,
            max_bytes=max_bytes,
            consumer_index=consumer_index,
            round_index=round_index,
            trainer_id=trainer_id,
            compression=compression,
            consumer_key=self._consumer_key,
            sequence=self._sequence,
            max_message_bytes=message_bytes or 0,
        )
        attempt = self._current = _Attempt()
        sent_at = time.monotonic()
        try:
            encoded, response = self._receive(request, timeout_s, attempt)
        except errors.DeadlineExceededError as err:
            if not attempt.expired:  # the worker's own answer, not a slow link
                raise
            raise self._after_timeout(attempt, message_bytes, timeout_s, err) from None
        finally:
            self._current = None
        self._reply_arrived(attempt, message_bytes)
        self._sequence += 1  # the reply is here: the next request acknowledges it
        if auto is not None:
            auto.observe(
                compression,
                attempt.received,
                attempt.payload_s,
                encoded,
                wall_s=time.monotonic() - sent_at,
                asked=(max_elements, max_bytes),
            )
        elements: list[Any] = [codec.decode(e) for e in encoded]
        nbytes = sum(len(e) for e in encoded)
        if response.error_type:
            self._error = errors.RemoteErrorInfo(
                response.error_type,
                response.error_message,
                response.error_traceback,
                response.error_pickle,
            ).to_exception(self._endpoint.worker_address)
            if not elements:
                raise self._error
            # The elements produced before the failure come first, as over shm.
            return base.ElementsResult(
                elements, nbytes, False, response.worker_uid, response.errors_ignored
            )
        return base.ElementsResult(
            elements,
            nbytes,
            response.end_of_sequence,
            response.worker_uid,
            response.errors_ignored,
        )

    def _reply_arrived(self, attempt: _Attempt, message_bytes: int | None) -> None:
        """A reply arrived whole: messages grow back (doubling) if they came in under a
        quarter of the no-progress timeout; the next request starts afresh."""
        if message_bytes is not None and attempt.largest_gap_s < self.no_progress_s / 4:
            grown = 2 * message_bytes
            self.message_bytes = None if grown >= _DEFAULT_MESSAGE_BYTES else grown
        if self._slow is not None:
            self._slow.done(f"GetElements from {self._endpoint.worker_address}: the reply arrived")
            self._slow = None
        self._request_start = None
        self._best_received = self._total_received = self._attempts = self._stalled = 0
        self._reply_size = _Attempt()

    def _after_timeout(
        self,
        attempt: _Attempt,
        message_bytes: int | None,
        timeout_s: float,
        err: errors.DeadlineExceededError,
    ) -> errors.DeadlineExceededError:
        """A reply brought no message for the no-progress timeout: asks for smaller
        messages next time, on a new connection. Returns the error to raise:
        `TransferStalledError` after `STALLED_ATTEMPTS` attempts in a row with the
        smallest messages that brought nothing new, else `err` (retry)."""
        self._current = None  # counted below
        self._attempts += 1
        self._total_received += attempt.received
        if attempt.received > self._best_received:
            self._best_received = attempt.received
            self._stalled = 0
        elif attempt.messages and message_bytes is not None and message_bytes <= MIN_MESSAGE_BYTES:
            # The worker answered (a reply asked for in small messages starts with its
            # size) but no piece of its data arrived: the link is too slow. A try with
            # no message at all (a stuck or frozen worker) does not count: the worker
            # loss rules handle those (`worker_loss_timeout_ms`).
            self._stalled += 1
        self.message_bytes = max(
            MIN_MESSAGE_BYTES, (message_bytes or _FULL_MESSAGE_BYTES) // _SHRINK
        )
        self._reconnect()
        now = time.monotonic()
        if self._stalled >= STALLED_ATTEMPTS:
            if self._slow is not None:
                self._slow.done()
                self._slow = None
            return errors.TransferStalledError(self._stalled_message(now))
        self._check_slow(now)
        return err

    def _check_slow(self, now: float) -> None:
        """A request older than `_waits.FIRST_WARNING_S` (a big reply on a slow link,
        arriving or retried) logs what it waits for, then again every
        `_waits.REPEAT_WARNING_S`."""
        if self._slow is None:
            start = self._request_start
            if start is None or now - start < _waits.FIRST_WARNING_S:
                return
            self._slow = _waits.SlowWait(
                log, lambda: self._slow_message(time.monotonic()), start=start
            )
        self._slow.check(now)

    def _sizes(self) -> str:
        size = self._reply_size
        if not size.reply_bytes:
            return "a reply whose size has not arrived (a reply of one message does not send it)"
        return (
            f"a reply of {size.reply_bytes} bytes ({size.reply_elements} elements, the "
            f"largest {size.largest_bytes} bytes)"
        )

    def _throughput(self, now: float) -> tuple[float, str]:
        """(bytes/s, a text): what the current request's tries brought so far."""
        elapsed_s = max(1e-3, now - (self._request_start or now))
        current = self._current
        received = self._total_received + (current.received if current is not None else 0)
        tries = self._attempts + (current is not None)
        rate = received / elapsed_s
        return rate, (
            f"{received} bytes arrived in {elapsed_s:.1f} s over {tries} "
            f"{'try' if tries == 1 else 'tries'} (~{rate:.0f} B/s)"
        )

    def _slow_message(self, now: float) -> str:
        _, measured = self._throughput(now)
        return (
            f"GetElements from worker {self._endpoint.worker_address} (task "
            f"{self._endpoint.task_id}): waiting for {self._sizes()} over a slow link: "
            f"{measured}; a try that brings no message for {self.no_progress_s:.1f} s is "
            "retried with smaller messages (now "
            f"{self.message_bytes or _FULL_MESSAGE_BYTES} bytes)"
        )

    def _stalled_message(self, now: float) -> str:
        rate, measured = self._throughput(now)
        timeout_ms = round(self.no_progress_s * 1000)
        if rate > 0:
            needed_ms = round(2000 * MIN_MESSAGE_BYTES / rate)
            advice = f"to at least {needed_ms} ms"
        else:
            advice = f"above {timeout_ms} ms (messages of {MIN_MESSAGE_BYTES} bytes need longer)"
        return (
            f"GetElements from worker {self._endpoint.worker_address} (task "
            f"{self._endpoint.task_id}): {self._sizes()} cannot cross the link: {measured}; "
            f"the worker answered, but messages of {MIN_MESSAGE_BYTES} bytes brought "
            f"nothing new within {self.no_progress_s:.1f} s, {self._stalled} times in a row "
            f"(the link moves less than {MIN_MESSAGE_BYTES / self.no_progress_s:.0f} B/s). "
            f"Raise ${NO_PROGRESS_ENV} (now {timeout_ms}) {advice} for links this slow, or "
            "read from a nearer worker"
        )

    def _reconnect(self) -> None:
        """A new connection, of this client only (a private subchannel pool): the
        cancelled reply's bytes still in flight on the old one would hold the link up
        (up to a flow-control window of them)."""
        if self._own_channel:
            self._channel.close()
        self._own_channel = True
        self._channel = rpc_util.make_data_channel(
            self._endpoint.transfer_address,
            ("grpc.use_local_subchannel_pool", 1),
            keepalive=False,  # a slow link: see make_data_channel
        )
        self._stub = service_pb2_grpc.WorkerServiceStub(self._channel)
        self._frames = self._frames_stub()

    def _frames_stub(self) -> Any:
        """GetElementsFrames on the current channel: messages come as `bytes`."""
        return self._channel.unary_stream(
            _FRAMES_METHOD,
            request_serializer=service_pb2.GetElementsRequest.SerializeToString,
            response_deserializer=None,
        )

    def _start(self, call: Any) -> None:
        """`call` is the one being received: `close` cancels it."""
        with self._call_mu:
            self._live_call = call
            if self._closed:
                call.cancel()

    def _stream_error(
        self, err: grpc.RpcError, expired: bool, attempt: _Attempt, first_s: float
    ) -> errors.DataServiceError:
        """The error a reply's stream (either RPC) ended with: a `DeadlineExceededError`
        when the no-progress watch expired (marking `attempt`), else `err` mapped."""
        if expired:
            attempt.expired = True
            return errors.DeadlineExceededError(
                f"GetElements from {self._endpoint.transfer_address}: no data for "
                f"{self.no_progress_s if attempt.messages else first_s:.1f} s "
                f"({attempt.received} bytes of the reply received); the request is "
                "retried and the worker sends the same reply again (in smaller messages)"
            )
        return rpc_util.to_error(err, self._endpoint.transfer_address, "GetElements")

    def _receive(self, request: Any, timeout_s: float, attempt: _Attempt) -> tuple[list[Any], Any]:
        """Streams one reply: (encoded elements, the last message's response);
        `attempt` records what arrived, also when it raises. GetElementsFrames, or
        GetElementsStream from a worker without it (UNIMPLEMENTED: asked once)."""
        if self._frames_ok:
            try:
                return self._receive_frames(request, timeout_s, attempt)
            except errors.UnimplementedError:
                if attempt.messages:
                    raise
                log.info(
                    "worker %s has no GetElementsFrames: reading with GetElementsStream",
                    self._endpoint.transfer_address,
                )
                self._frames_ok = False
        return self._receive_chunks(request, timeout_s, attempt)

    def _receive_frames(
        self, request: Any, timeout_s: float, attempt: _Attempt
    ) -> tuple[list[bytearray], Any]:
        """Streams one GetElementsFrames reply (service.proto's ElementsHead): each
        head's elements are received into `bytearray`s of their announced sizes,
        which `codec.decode` turns into arrays without another copy; a message that
        holds a whole element becomes its bytearray in one copy.

        Raises:
            DataLossError: The worker sent bytes beyond what a head announced, a
                head that cannot be parsed or an absurd size, or ended the reply
                without its last head or in the middle of an element.
            DeadlineExceededError, and as `rpc_util.to_error`: As `_receive_chunks`.
        """
        call = self._frames(request, metadata=self._metadata)
        self._start(call)
        first_s = timeout_s + min(_FIRST_MESSAGE_GRACE_S, self.no_progress_s)
        watch = _watchdog.watch(call, first_s)
        elements: list[bytearray] = []
        sizes: list[int] = []  # announced by the last head, not yet filled
        index = 0  # of the element being filled, in `sizes`
        part: bytearray | None = None  # that element, when it comes in pieces
        filled = 0
        head_at = 0.0  # when the head of `sizes` arrived
        last: Any = None
        last_message: float | None = None
        address = self._endpoint.worker_address
        try:
            for message in call:
                now = watch.progress(self.no_progress_s)
                attempt.messages += 1
                if last_message is not None:
                    attempt.largest_gap_s = max(attempt.largest_gap_s, now - last_message)
                last_message = now
                if index < len(sizes):  # payload: the announced elements' bytes
                    view = memoryview(message)
                    pos = 0
                    while pos < len(view):
                        if index >= len(sizes):
                            raise errors.DataLossError(
                                f"worker {address} sent {len(view) - pos} bytes beyond the "
                                "elements its head announced"
                            )
                        size = sizes[index]
                        if part is None and len(view) - pos >= size:
                            elements.append(bytearray(view[pos : pos + size]))
                            pos += size
                            index += 1
                            continue
                        if part is None:  # every byte is written before it is read
                            part, filled = _core.bytearray_to_fill(size), 0
                        n = min(size - filled, len(view) - pos)
                        part[filled : filled + n] = view[pos : pos + n]
                        filled += n
                        pos += n
                        if filled == size:
                            elements.append(part)
                            part = None
                            index += 1
                    attempt.received += len(view)
                    while index < len(sizes) and sizes[index] == 0:  # nothing to wait for
                        elements.append(bytearray())
                        index += 1
                    if index == len(sizes):
                        attempt.payload_s += now - head_at
                    self._check_slow(now)
                    continue
                head = service_pb2.ElementsHead.FromString(message)
                if head.reply_bytes:
                    attempt.reply_bytes = head.reply_bytes
                    attempt.reply_elements = head.reply_elements
                    attempt.largest_bytes = head.largest_element_bytes
                    self._reply_size = attempt
                if last is not None:
                    raise errors.DataLossError(f"worker {address} sent a head after its last")
                if head.last:
                    last = head.response
                sizes = list(head.element_bytes)
                check_announced(sizes, address)
                index, head_at = 0, now
                while index < len(sizes) and sizes[index] == 0:
                    elements.append(bytearray())
                    index += 1
        except grpc.RpcError as err:
            raise self._stream_error(err, watch.expired, attempt, first_s) from None
        except Exception as err:  # a head that does not parse
            if isinstance(err, errors.DataServiceError):
                raise
            raise errors.DataLossError(
                f"worker {address} sent a GetElementsFrames head that cannot be read: {err}"
            ) from None
        finally:
            watch.done()
            call.cancel()  # no-op once the call completed
            with self._call_mu:
                self._live_call = None
        if last is not None and index == len(sizes):
            return elements, last
        raise errors.DataLossError(
            f"worker {self._endpoint.transfer_address} ended a reply without its last message"
        )

    def _receive_chunks(
        self, request: Any, timeout_s: float, attempt: _Attempt
    ) -> tuple[list[Any], Any]:
        """Streams one GetElementsStream reply (GetElementsChunk messages)."""
        call = self._stub.GetElementsStream(request, metadata=self._metadata)
        self._start(call)
        first_s = timeout_s + min(_FIRST_MESSAGE_GRACE_S, self.no_progress_s)
        watch = _watchdog.watch(call, first_s)
        elements: list[Any] = []
        part: bytearray | None = None  # a large element being put together
        filled = 0
        last: Any = None
        last_message: float | None = None  # when the previous message arrived
        try:
            for chunk in call:
                now = watch.progress(self.no_progress_s)
                attempt.messages += 1
                if last_message is not None:
                    attempt.largest_gap_s = max(attempt.largest_gap_s, now - last_message)
                last_message = now
                if chunk.reply_bytes:
                    attempt.reply_bytes = chunk.reply_bytes
                    attempt.reply_elements = chunk.reply_elements
                    attempt.largest_bytes = chunk.largest_element_bytes
                    self._reply_size = attempt
                if chunk.element_bytes:
                    check_announced([chunk.element_bytes], self._endpoint.worker_address)
                    part, filled = _core.bytearray_to_fill(chunk.element_bytes), 0
                if chunk.element_part:
                    n = len(chunk.element_part)
                    if part is None or filled + n > len(part):
                        raise errors.DataLossError(
                            f"worker {self._endpoint.worker_address} sent a piece of an "
                            "element beyond its announced size"
                        )
                    part[filled : filled + n] = chunk.element_part
                    filled += n
                    attempt.received += n
                    if filled == len(part):
                        elements.append(part)
                        part = None
                if chunk.elements:
                    elements.extend(chunk.elements)
                    attempt.received += sum(len(e) for e in chunk.elements)
                if chunk.element_part or chunk.elements:
                    self._check_slow(now)
                if chunk.last:
                    last = chunk.response
            # The stream ended with status OK: only now is the reply the consumer's (a
            # stream cancelled after its last message may already be put back).
        except grpc.RpcError as err:
            raise self._stream_error(err, watch.expired, attempt, first_s) from None
        finally:
            watch.done()
            call.cancel()  # no-op once the call completed
            with self._call_mu:
                self._live_call = None
        if last is not None:
            return elements, last
        raise errors.DataLossError(
            f"worker {self._endpoint.transfer_address} ended a reply without its last message"
        )

    def set_compression(self, compression: str) -> None:
        """ "" (none), "zstd", or "auto": per request, by `AutoCompression`."""
        if compression == "auto":
            self._auto = self._auto or AutoCompression()
            self._compression = ""
        else:
            self._auto = None
            self._compression = compression

    def close(self) -> None:
        """Cancels a request sent ahead still on its way (the worker keeps its reply
        for a retry that does not come, then hands first come, first served elements
        to the task's other consumers: `unacked_replies.REQUEUE_AFTER_S`), waits for
        its thread, and closes the channel if it is this client's own."""
        with self._call_mu:
            self._closed = True
            if self._live_call is not None:
                self._live_call.cancel()
        pending, self._next = self._next, None
        if pending is not None:
            try:
                pending.result()
            except Exception:  # noqa: BLE001  (cancelled: nobody waits for its reply)
                pass
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        # As ShmTransferClient.close: the stored error keeps no traceback, which would
        # hold this client and its callers' frames (their elements) in a cycle.
        if self._error is not None:
            self._error = self._error.with_traceback(None)
        if self._own_channel:
            self._channel.close()


base.register_protocol("grpc", GrpcTransferClient)
