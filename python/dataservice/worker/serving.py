"""Serving a worker's elements over gRPC: `WorkerService.GetElements`,
`GetElementsStream` and `GetElementsFrames` (the "grpc" transfer protocol, as
tf.data service's worker; clients read with GetElementsFrames).

`WorkerServicer` is the gRPC servicer; `ElementServing` (a base class of
`WorkerServer`) owns what a read does: finding the request's task (waiting a
moment for one the client heard of before the worker did) and its source
(`element_source`, which also serves every other transfer protocol through the
worker's `TransferHost`; the choice itself is `sources.py`'s: a cross-trainer
cache read, a coordinated round, or first come, first served), taking its
elements, encoding and compressing them into a reply, keeping an acknowledged
reply with its consumer until the next request (`unacked_replies.UnackedReplies`),
and streaming a reply: in GetElementsChunk messages of about `_CHUNK_BYTES`, or
as frames of raw element bytes behind small heads (`_frames`). Registration,
heartbeats and starting or stopping tasks are `server.py`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from dataservice import errors
from dataservice.metrics import WorkerCounters
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import service_pb2_grpc, validate
from dataservice.rpc import util as rpc_util
from dataservice.transfer import codec
from dataservice.transfer.base import ReadRequest, TaskRead
from dataservice.worker.sources import TaskSource, choose_source
from dataservice.worker.task_runner import TaskRunner, encode_elements
from dataservice.worker.unacked_replies import Reply

log = logging.getLogger(__name__)

_GET_ELEMENTS_WAIT_S = 1.0
_CHUNK_BYTES = 1 << 20  # GetElementsStream: about this many bytes per message
# GetElementsFrames (`_frames`): an element this large goes in messages of its own,
# whole up to _FRAME_BYTES (gRPC's limits are lifted on both ends: rpc/util.py), or, when
# encoded later (`codec.encode_later`), in pieces of _PIECE_BYTES made as they go; smaller
# ones are joined into messages of about _JOIN_BYTES.
_FRAME_BYTES = 64 << 20
_PIECE_BYTES = 1 << 20
_OWN_FRAME_BYTES = 256 << 10
# Each message costs grpcio's Python server a wait for its send to complete: 150 KB
# elements joined 4 MiB a message moved ~20 % more per second than 1 MiB (8 of 8
# alternating runs, one by 0.5 %); 8 and 16 MiB no more. (Pieces of a large element stay 1 MiB:
# 4 MiB ones were no faster.) transfer/grpc.py's `_DEFAULT_MESSAGE_BYTES` is this.
_JOIN_BYTES = 4 << 20
# GetElementsFrames sends an alive head before encoding a reply whose first element is
# this large (encoding it takes long enough to matter: ~0.1 s); GetElementsStream
# before any of more than one message.
_ALIVE_FIRST_BYTES = 64 << 20


def _element_messages(element: Any, limit: int, piece: int) -> Iterator[Any]:
    """GetElementsFrames messages of one element's (or joined elements') encoding: a
    `codec.Encoding` in pieces of about `piece` bytes, each made just before it is
    sent; `bytes` whole (the very object, no copy) up to `limit`, else in pieces of
    `limit`."""
    if isinstance(element, codec.Encoding):
        n = len(element)
        # Equal pieces, none over `piece` by more than a quarter: a 1 MiB array and its
        # header go as one message, not a second of a few bytes.
        count = -(-n // min(limit, piece + piece // 4))
        size = -(-n // count)
        for offset in range(0, n, size):
            yield element.piece(offset, min(offset + size, n))
    elif len(element) <= limit:
        yield element
    else:
        view = memoryview(element)
        for offset in range(0, len(element), limit):
            yield bytes(view[offset : offset + limit])


class WorkerServicer(service_pb2_grpc.WorkerServiceServicer):
    """`WorkerService` on the worker's gRPC server: checks each request's fields
    (`rpc/validate.py`) and maps what the read raises to a gRPC status."""

    def __init__(self, worker: ElementServing) -> None:
        self._w = worker

    def GetElements(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            validate.check_request(request)  # rpc/validate.py: every field at the edge
            return self._w._get_elements(request)
        except (errors.DataServiceError, ValueError) as err:
            rpc_util.abort_with(context, err)
        except Exception as err:
            log.exception("GetElements failed")
            rpc_util.abort_with(context, errors.InternalError(f"{type(err).__name__}: {err}"))

    def GetElementsStream(self, request: Any, context: grpc.ServicerContext) -> Any:
        yield from self._stream("GetElementsStream", self._w._get_elements_stream, request, context)

    def GetElementsFrames(self, request: Any, context: grpc.ServicerContext) -> Any:
        yield from self._stream("GetElementsFrames", self._w._get_elements_frames, request, context)

    @staticmethod
    def _stream(
        name: str,
        serve: Callable[[Any], Iterator[Any]],
        request: Any,
        context: grpc.ServicerContext,
    ) -> Iterator[Any]:
        try:
            validate.check_request(request)  # rpc/validate.py: every field at the edge
            yield from serve(request)
        except (errors.DataServiceError, ValueError) as err:
            rpc_util.abort_with(context, err)
        except Exception as err:
            log.exception("%s failed", name)
            rpc_util.abort_with(context, errors.InternalError(f"{type(err).__name__}: {err}"))


class ElementServing:
    """The GetElements and GetElementsStream reads of a worker, as a base class
    of `WorkerServer`, whose state it reads: the task table (`_tasks`,
    `_deleted`, guarded by `_mu`), `_wake` (set to heartbeat now), `_address`
    and `_uid`. Thread-safe (each read runs on its own gRPC thread).
    """

    _mu: threading.Lock
    _tasks_changed: threading.Condition  # over _mu: notified when the task table changes
    _wake: threading.Event
    _address: str
    _uid: str
    _tasks: dict[int, TaskRunner]  # guarded by _mu
    _deleted: OrderedDict[int, None]  # guarded by _mu
    _counters: WorkerCounters  # elements and bytes sent (metrics.py)

    def _runner_now(self, task_id: int) -> tuple[TaskRunner | None, bool]:
        """(The runner of `task_id` or None, whether the dispatcher deleted the task).
        A consumer asks for the task: one the worker does not know yet makes it
        heartbeat now; a runner waiting for a consumer (`lazy_tasks`) starts."""
        with self._mu:
            runner = self._tasks.get(task_id)
            deleted = task_id in self._deleted
        if runner is None and not deleted:
            # The client heard of the task before this worker did: heartbeat now.
            self._wake.set()
        if runner is not None:
            runner.start_producing()
        return runner, deleted

    def element_source(self, request: ReadRequest, timeout_s: float) -> TaskSource | None:
        """The source that serves `request` (`sources.choose_source`), waiting up to
        `timeout_s` seconds for a task the client heard of before this worker did;
        None if the task is still unknown then. The `element_source` of the worker's
        `TransferHost` (every transfer protocol's servers use it) and of its gRPC reads.

        Raises:
            NotFoundError: The dispatcher deleted the task.
            FailedPreconditionError: The read does not fit the task (`choose_source`).
        """
        deadline = time.monotonic() + timeout_s
        runner, deleted = self._runner_now(request.task_id)
        if runner is None and not deleted:
            # The heartbeat `_runner_now` asked for adds the task: woken when it does.
            with self._tasks_changed:
                while True:
                    runner = self._tasks.get(request.task_id)
                    deleted = request.task_id in self._deleted
                    remaining = deadline - time.monotonic()
                    if runner is not None or deleted or remaining <= 0:
                        break
                    self._tasks_changed.wait(remaining)
            if runner is not None:
                runner.start_producing()
        if runner is None:
            if not deleted:
                return None
            raise errors.NotFoundError(
                f"worker {self._address} no longer runs task {request.task_id} "
                "(the dispatcher deleted it)"
            )
        return choose_source(runner, request)

    def _source(self, request: Any, deadline: float) -> TaskSource | None:
        """`element_source` of a GetElements request."""
        read = ReadRequest(
            request.task_id, request.trainer_id, request.consumer_index, request.round_index
        )
        return self.element_source(read, max(0.0, deadline - time.monotonic()))

    @staticmethod
    def _read(source: TaskSource, request: Any, deadline: float) -> TaskRead:
        """Takes the request's elements from its source.

        Raises:
            FailedPreconditionError: A round every consumer already read.
        """
        # A first come, first served source ends the stream only once the replies
        # other consumers did not get have settled (sources.py BufferSource).
        return source.read(
            max(1, request.max_elements or 1),
            request.max_bytes or (16 << 20),
            max(0.0, deadline - time.monotonic()),
        )

    def _response(
        self, reply: Reply | None, request: Any, with_elements: bool, errors_ignored: int = 0
    ) -> Any:
        """The GetElementsResponse of `reply` (None: no element ready, nothing to say),
        with the task's `errors_ignored` count as read after the reply's elements."""
        response = pb.GetElementsResponse(
            worker_uid=self._uid, sequence=request.sequence, errors_ignored=errors_ignored
        )
        if reply is None:
            return response
        if reply.elements:  # sent now (again, for a retry's replay)
            self._counters.sent("grpc", len(reply.elements), sum(map(len, reply.elements)))
        if with_elements:
            response.elements.extend(map(codec.as_bytes, reply.elements))
        response.end_of_sequence = reply.end_of_sequence
        error = reply.error
        if error is not None:
            response.error_type, response.error_message = error.type_name, error.message
            response.error_traceback, response.error_pickle = error.traceback, error.pickled
        if reply.end_of_sequence:
            self._wake.set()  # report the finished task promptly
        return response

    @staticmethod
    def _encoded(read: TaskRead, request: Any, later: bool = False) -> Reply:
        """A reply of `read`'s raw elements, encoded and compressed as the request
        asks (with `later` and no compression, large elements as `codec.Encoding`s,
        for `_frames`); an element the codec cannot carry ends the reply (and the
        read) with its error, after the elements before it."""
        encoded = encode_elements(read, later=later and not request.compression)
        elements = encoded.elements
        if request.compression:
            elements = [codec.compress(e, request.compression) for e in elements]
        return Reply(elements, encoded.end_of_sequence, encoded.error)

    def _get_elements(self, request: Any) -> Any:
        """GetElements: one reply in one message (see `_get_elements_stream`)."""
        deadline = time.monotonic() + _GET_ELEMENTS_WAIT_S
        source = self._source(request, deadline)
        if source is None:
            return pb.GetElementsResponse()
        if not request.consumer_key:
            read = self._read(source, request, deadline)
            encoded = self._encoded(read, request)
            return self._response(encoded, request, True, source.errors_ignored)
        turn = source.runner.unacked.begin(
            request.consumer_key, request.sequence, max(0.0, deadline - time.monotonic())
        )
        try:
            reply = turn.replay
            if reply is None:
                reply = self._encoded(self._read(source, request, deadline), request)
                reply.requeue_on_failure = source.gives_back
                turn.store(reply)
            # A unary reply's delivery is not observable here: it counts as sent and
            # stays until the consumer's next request acknowledges it.
            return self._response(reply, request, True, source.errors_ignored)
        finally:
            turn.finish(sent=True)

    def _get_elements_stream(self, request: Any) -> Iterator[Any]:
        """GetElementsStream: the reply of `_serve_reply` in GetElementsChunk
        messages of about `_CHUNK_BYTES` (`_chunks`).

        Yields:
            GetElementsChunk messages; the last has `last` set and the response.
        """
        yield from self._serve_reply(
            request, pb.GetElementsChunk, self._chunks, _CHUNK_BYTES, later=False
        )

    def _get_elements_frames(self, request: Any) -> Iterator[Any]:
        """GetElementsFrames: the reply of `_serve_reply` as ElementsHead messages
        and the raw bytes of the elements they announce (`_frames`).

        Yields:
            ElementsHead messages and `bytes` payloads; the last is a head with
            `last` set and the response.
        """
        yield from self._serve_reply(
            request, pb.ElementsHead, self._frames, _ALIVE_FIRST_BYTES, later=True
        )

    def _serve_reply(
        self,
        request: Any,
        alive: Callable[[], Any],
        emit: Callable[[Reply, Any, int], Iterator[Any]],
        alive_first_bytes: int,
        later: bool,
    ) -> Iterator[Any]:
        """Takes (or, for a retry, takes again) the request's elements and streams
        their reply as `emit(reply, request, errors_ignored)` yields it (the task's
        count of ignored errors); `alive()` is the message that only says the worker
        is alive, and `emit(empty reply, None, 0)` the answer of a task not known in
        time.

        With a `consumer_key`, the reply stays with the consumer until its next
        request acknowledges it (`UnackedReplies`): a retry of the same sequence
        number gets it again, also after the stream broke (a first come, first
        served reply whose consumer does not come back goes back to the task).
        `later`: large elements are encoded as `codec.Encoding`s (`emit` makes their
        bytes as it sends them). A reply whose first element holds at least
        `alive_first_bytes` first sends
        `alive()` (and another every second of encoding), so the client's
        no-progress timeout measures the worker's liveness, not the element's size.

        Yields:
            The messages of `alive` and `emit`.
        """
        deadline = time.monotonic() + _GET_ELEMENTS_WAIT_S
        source = self._source(request, deadline)
        if source is None:
            yield from emit(Reply([], False, None), None, 0)
            return
        turn = None
        if request.consumer_key:
            turn = source.runner.unacked.begin(
                request.consumer_key, request.sequence, max(0.0, deadline - time.monotonic())
            )
        raw: list[Any] = []  # taken from the task, not yet stored as a reply
        fcfs = source.gives_back
        sent = False
        try:
            reply = turn.replay if turn is not None else None
            if reply is None and turn is not None:
                # Elements a cut left with this consumer (a slow link) come first.
                reply = turn.take_rest(request.max_bytes)
                if reply is not None:
                    turn.store(reply)
            if reply is None:
                read = self._read(source, request, deadline)
                raw, end, error = read.elements, read.end_of_sequence, read.error
                if fcfs and raw and codec.element_nbytes(raw[0]) >= alive_first_bytes:
                    # Large elements: one at a time, telling the client the worker is
                    # alive while it encodes (and it can still take them back, raw).
                    yield alive()
                    elements: list[bytes] = []
                    last_yield = time.monotonic()
                    for element in raw:
                        if time.monotonic() - last_yield > 1.0:
                            yield alive()
                            last_yield = time.monotonic()
                        one = self._encoded(TaskRead([element], end, error), request, later)
                        elements.extend(one.elements)
                        if not one.elements:  # it cannot be encoded: its error ends the read
                            end, error = one.end_of_sequence, one.error
                            break
                    reply = Reply(elements, end, error)
                else:
                    reply = self._encoded(read, request, later)
                reply.requeue_on_failure = fcfs
                if turn is not None:
                    turn.store(reply)
                    raw = []
            if turn is not None and request.max_bytes and request.max_message_bytes:
                # A client on a slow link (it asks for small messages) may ask for less
                # than the reply it repeats: the part that fits now, the rest with the
                # next requests. (Not otherwise: a fresh read already fits max_bytes,
                # counted in raw bytes, and cutting on the encoded ones would churn.)
                reply = turn.cut(request.max_bytes) or reply
            yield from emit(reply, request, source.errors_ignored)
            sent = True
        finally:
            if turn is not None:
                turn.finish(sent)
            if raw and fcfs and not sent:
                source.give_back(raw)  # taken, never stored nor sent completely

    def _chunks(self, reply: Reply, request: Any, errors_ignored: int = 0) -> Iterator[Any]:
        """`reply` as GetElementsChunk messages of about `request.max_message_bytes`
        each (0: `_CHUNK_BYTES`; never more); `request` None: the empty answer of a
        task not known in time. A reply that takes more than one message,
        or that was asked for in small messages (a slow link), first sends its size
        (`reply_bytes`, `reply_elements`, `largest_element_bytes`): the client can say
        what it waits for, and tell a slow link (this arrives) from a stuck worker."""
        if request is None:
            yield pb.GetElementsChunk(last=True, response=pb.GetElementsResponse())
            return
        chunk_bytes = min(request.max_message_bytes or _CHUNK_BYTES, _CHUNK_BYTES)
        elements = [codec.as_bytes(e) for e in reply.elements]
        sizes = [len(e) for e in elements]
        if sizes and (request.max_message_bytes or sum(sizes) > chunk_bytes):
            yield pb.GetElementsChunk(
                reply_bytes=sum(sizes), reply_elements=len(sizes), largest_element_bytes=max(sizes)
            )
        batch: list[bytes] = []
        batch_bytes = 0
        for element in elements:
            n = len(element)
            if n > chunk_bytes:
                if batch:
                    yield pb.GetElementsChunk(elements=batch)
                    batch, batch_bytes = [], 0
                for offset in range(0, n, chunk_bytes):
                    yield pb.GetElementsChunk(
                        element_part=element[offset : offset + chunk_bytes],
                        element_bytes=n if offset == 0 else 0,
                    )
                continue
            if batch and batch_bytes + n > chunk_bytes:
                yield pb.GetElementsChunk(elements=batch)
                batch, batch_bytes = [], 0
            batch.append(element)
            batch_bytes += n
        yield pb.GetElementsChunk(
            elements=batch,
            last=True,
            response=self._response(reply, request, False, errors_ignored),
        )

    def _frames(self, reply: Reply, request: Any, errors_ignored: int = 0) -> Iterator[Any]:
        """`reply` as GetElementsFrames messages (service.proto's ElementsHead): a
        head announcing the sizes of the next elements, then their encoded bytes,
        then the next head; the last head (of the last elements, or alone for a
        reply without elements) carries the response. Elements of at least
        `_OWN_FRAME_BYTES` in a row are announced by one head (up to the message
        limit in all), each then sent in messages of its own: encoded later (a
        `codec.Encoding`), it goes in pieces of `_PIECE_BYTES` (at most the message
        limit: `request.max_message_bytes`, else `_FRAME_BYTES`), each made just
        before it is sent; as `bytes`, it goes as the very object the encoder made
        (no copy) when it fits the message limit, else in pieces of it. Smaller
        ones are joined into messages of about `_JOIN_BYTES` (`codec.join`: each
        encoded straight into the message, one copy as a protobuf message would
        make, for far fewer messages). `request` None: the empty answer of a task
        not known in time."""
        if request is None:
            yield pb.ElementsHead(last=True, response=pb.GetElementsResponse())
            return
        limit = request.max_message_bytes or _FRAME_BYTES
        piece = min(limit, _PIECE_BYTES)
        elements = [
            e if type(e) is bytes or isinstance(e, codec.Encoding) else bytes(e)
            for e in reply.elements
        ]
        sizes = [len(e) for e in elements]
        announce = bool(sizes) and (
            bool(request.max_message_bytes)
            or sum(sizes) > limit
            or any(isinstance(e, codec.Encoding) and len(e) > piece for e in elements)
        )
        if not elements:
            response = self._response(reply, request, False, errors_ignored)
            yield pb.ElementsHead(last=True, response=response)
            return
        first = True
        k = 0
        while k < len(elements):
            group_end = k + 1
            large = sizes[k] >= _OWN_FRAME_BYTES
            # Small elements: joined into one message. Large ones: announced together up
            # to the message limit, each then sent on its own (a head per 1 MiB element
            # was every other message of the stream, and a message costs grpcio's Python
            # server about as much as its bytes).
            cap = limit if large else min(_JOIN_BYTES, limit)
            total = sizes[k]
            while (
                group_end < len(elements)
                and (sizes[group_end] >= _OWN_FRAME_BYTES) == large
                and total + sizes[group_end] <= cap
            ):
                total += sizes[group_end]
                group_end += 1
            head = pb.ElementsHead(element_bytes=sizes[k:group_end])
            if group_end == len(elements):  # the reply ends with these elements
                head.last = True
                head.response.CopyFrom(self._response(reply, request, False, errors_ignored))
            if first and announce:
                head.reply_bytes = sum(sizes)
                head.reply_elements = len(sizes)
                head.largest_element_bytes = max(sizes)
            first = False
            yield head
            if large or group_end == k + 1:
                for element in elements[k:group_end]:
                    yield from _element_messages(element, limit, piece)
            else:
                yield from _element_messages(codec.join(elements[k:group_end]), limit, piece)
            k = group_end
