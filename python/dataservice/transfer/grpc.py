"""The gRPC transfer protocol: `WorkerService.GetElementsStream` on the worker's port.

No element is lost between the worker and the consumer: each client numbers its
requests (a random `consumer_key` per client, `sequence` 1, 2, ...). The worker
keeps its reply until the next request acknowledges it, and a request retried
after a failure repeats its number and gets the same reply again
(worker/task_runner.py `UnackedReplies`). So a client is kept, not replaced,
after a failed request (`retry_in_place`): gRPC reconnects its channel itself.

Replies are streamed in messages of about 1 MiB (server streaming, which gRPC
supports natively with flow control), and the call has no overall deadline:
instead it is cancelled when no message arrives for `_NO_PROGRESS_S` seconds
(`timeout_s` + `_FIRST_MESSAGE_GRACE_S` for the first). A 1 GiB element over a
slow link therefore arrives, however long it takes, while a worker that stops
sending ends the call with `DeadlineExceededError` within a bounded time. (A
deadline sized from the bytes in flight cannot work: the client does not know
the reply's size before it arrives, and one element always fits a reply.)
"""

from __future__ import annotations

import heapq
import threading
import time
import uuid
from typing import Any

import grpc

from dataservice import auth, errors
from dataservice.rpc import service_pb2, service_pb2_grpc
from dataservice.rpc import util as rpc_util
from dataservice.transfer import base, codec

# The slowest link that still delivers: 1 MiB (one message) per 30 s, ~35 KB/s.
_NO_PROGRESS_S = 30.0
# The worker answers within the request's wait (timeout_s); a large reply sends an
# empty message before it starts encoding, so the first message comes promptly.
_FIRST_MESSAGE_GRACE_S = 10.0


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

    def progress(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s

    def done(self) -> None:
        self._owner.forget(self.id)


_watchdog = _Watchdog()


class GrpcTransferClient(base.TransferClient):
    """Fetches a task's elements over gRPC; one caller thread at a time."""

    protocol = "grpc"
    retry_in_place = True

    def __init__(
        self,
        endpoint: base.TaskEndpoint,
        auth_token: str | None,
        compression: str = "",
        zero_copy: bool = True,  # elements over gRPC are always copies
        trainer_id: str = "",  # each request names its own trainer id
    ) -> None:
        self._endpoint = endpoint
        self._compression = compression  # "" or "zstd", chosen by the reader
        self._channel = rpc_util.make_channel(endpoint.transfer_address)
        self._stub = service_pb2_grpc.WorkerServiceStub(self._channel)
        token = rpc_util.token_from_env(auth_token)
        auth.warn_if_sent_in_clear(endpoint.transfer_address, token)
        self._metadata = rpc_util.call_metadata(token)
        self._error: errors.WorkerError | None = None  # the pipeline's, once reported
        self._consumer_key = uuid.uuid4().hex
        self._sequence = 1  # of the next request; repeated after a failed one
        self.no_progress_s = _NO_PROGRESS_S

    def get_elements(
        self,
        max_elements: int,
        max_bytes: int,
        timeout_s: float,
        consumer_index: int = -1,
        round_index: int = -1,
        trainer_id: str = "",
    ) -> base.ElementsResult:
        """One request (see `TransferClient.get_elements`); a failed one may be
        retried by calling again: it repeats its sequence number, so the worker sends
        the same reply.

        Raises:
            DeadlineExceededError: No message from the worker for the no-progress
                timeout (`timeout_s` + 10 s for the first, 30 s between messages).
            WorkerError, UnavailableError, NotFoundError: As `TransferClient`.
        """
        request = service_pb2.GetElementsRequest(
            task_id=self._endpoint.task_id,
            max_elements=max_elements,
            max_bytes=max_bytes,
            consumer_index=consumer_index,
            round_index=round_index,
            trainer_id=trainer_id,
            compression=self._compression,
            consumer_key=self._consumer_key,
            sequence=self._sequence,
        )
        if self._error is not None:  # after the elements that came with it
            raise self._error
        encoded, response = self._receive(request, timeout_s)
        self._sequence += 1  # the reply is here: the next request acknowledges it
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
            return base.ElementsResult(elements, nbytes, False, response.worker_uid)
        return base.ElementsResult(elements, nbytes, response.end_of_sequence, response.worker_uid)

    def _receive(self, request: Any, timeout_s: float) -> tuple[list[Any], Any]:
        """Streams one reply: (encoded elements, the last message's response)."""
        call = self._stub.GetElementsStream(request, metadata=self._metadata)
        watch = _watchdog.watch(call, timeout_s + _FIRST_MESSAGE_GRACE_S)
        elements: list[Any] = []
        part: bytearray | None = None  # a large element being put together
        filled = 0
        received = 0
        last: Any = None
        try:
            for chunk in call:
                watch.progress(self.no_progress_s)
                if chunk.element_bytes:
                    part, filled = bytearray(chunk.element_bytes), 0
                if chunk.element_part:
                    n = len(chunk.element_part)
                    if part is None or filled + n > len(part):
                        raise errors.DataLossError(
                            f"worker {self._endpoint.worker_address} sent a piece of an "
                            "element beyond its announced size"
                        )
                    part[filled : filled + n] = chunk.element_part
                    filled += n
                    received += n
                    if filled == len(part):
                        elements.append(part)
                        part = None
                if chunk.elements:
                    elements.extend(chunk.elements)
                    received += sum(len(e) for e in chunk.elements)
                if chunk.last:
                    last = chunk.response
            # The stream ended with status OK: only now is the reply the consumer's (a
            # stream cancelled after its last message may already be put back).
        except grpc.RpcError as err:
            if watch.expired:
                raise errors.DeadlineExceededError(
                    f"GetElements from {self._endpoint.transfer_address}: no data for "
                    f"{self.no_progress_s if received else timeout_s + _FIRST_MESSAGE_GRACE_S:.0f}"
                    f" s ({received} bytes of the reply received); the request is retried "
                    "and the worker sends the same reply again"
                ) from None
            raise rpc_util.to_error(err, self._endpoint.transfer_address, "GetElements") from None
        finally:
            watch.done()
            call.cancel()  # no-op once the call completed
        if last is not None:
            return elements, last
        raise errors.DataLossError(
            f"worker {self._endpoint.transfer_address} ended a reply without its last message"
        )

    def set_compression(self, compression: str) -> None:
        self._compression = compression

    def close(self) -> None:
        self._channel.close()


base.register_protocol("grpc", GrpcTransferClient)
