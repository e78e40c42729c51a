"""Runs one task: iterates the task's pipeline on a producer thread into a
bounded buffer of elements, which consumers drain first come, first served
(tf.data service's FirstComeFirstServedTaskRunner).

The buffer holds raw elements (each transfer protocol encodes them its own
way: `get_elements` for gRPC, `get_elements_raw` for shared memory) and is
bounded by `buffer_elements` and a bytes bound (the bytes elements hold,
object arrays' items included, see `codec.element_nbytes`), so a slow consumer
back-pressures the pipeline. The bytes bound grows with demand: it starts at
`initial_buffer_bytes` (by default `INITIAL_BUFFER_BYTES`, or room for
`INITIAL_BUFFER_ELEMENTS` elements if larger) and doubles, up to `buffer_bytes`,
each time consumers have taken a bound's worth of bytes since it last grew. An
iteration nobody reads past its first elements (a dropped iterator of a named job)
then holds a few elements on the worker, not `buffer_bytes`; a consumer that reads
everything reaches the full bound after taking about `buffer_bytes` (6 doublings
from 2 MiB to 64 MiB). A pipeline error, or an element that is not a
numpy value in a pipeline that did not allow pickled elements, is delivered
after the elements produced before it.

An element leaves the worker only when its consumer has it: gRPC replies are
kept per consumer (`UnackedReplies`) until the consumer's next request
acknowledges them; a reply whose transfer failed waits for the consumer's retry,
or goes back to the front of the buffer (`requeue`) if the consumer is gone.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from dataservice import errors
from dataservice.transfer import codec
from dataservice.transfer.base import TaskRead

log = logging.getLogger(__name__)

DEFAULT_BUFFER_ELEMENTS = 4096
DEFAULT_BUFFER_BYTES = 64 << 20
# Where a task's bytes bound starts (see the module's docstring): the larger of these
# bytes and room for these many elements of the first element's size.
INITIAL_BUFFER_BYTES = 2 << 20
INITIAL_BUFFER_ELEMENTS = 4
MAX_OPEN_ROUNDS = 4
_PRODUCE_BATCH = 64  # elements per hand-off to the shared buffer (fast pipelines)
_PRODUCE_BATCH_BYTES = 1 << 20
_PRODUCE_BATCH_ELEMENT_S = 50e-6  # an element slower than this is handed off at once
# A consumer that has not asked for this long is taken for gone: its entry (and the
# reply it did not acknowledge) is dropped and counted. A live consumer re-asks within
# seconds of a failed request, so only a consumer that stopped for good loses an entry.
UNACKED_TTL_S = 300.0
# A consumer whose reply's transfer failed and that has not asked again for this long
# is taken for gone: its first come, first served elements go to the other consumers.
REQUEUE_AFTER_S = 5.0


def encode_elements(read: TaskRead) -> TaskRead:
    """`read` with each element `codec.encode`d (`bytes`), up to the first that
    cannot be encoded (e.g. a leaf that cannot be pickled): then the ones before
    it, ending the read with its error. That error reaches the consumer as the
    pipeline's own, as over shared memory."""
    out: list[bytes] = []
    for element in read.elements:
        try:
            out.append(codec.encode(element))
        except Exception as err:
            return TaskRead(out, True, errors.capture(err))
    return TaskRead(out, read.end_of_sequence, read.error)


class _StructureCheck:
    """Checks that every element of a stream has the first one's structure
    (`codec.signature`) and returns its `codec.element_nbytes`; a single array
    (of a numeric dtype) or scalar leaf of the same type and dtype object takes a
    fast path. Unless `allow_pickled`, an element holding a leaf that is not a
    numpy value raises `InvalidArgumentError` naming its path and type."""

    def __init__(self, task_id: int, allow_pickled: bool = False) -> None:
        self._task_id = task_id
        self._allow_pickled = allow_pickled
        self._index = 0
        self._signature: Any = None
        self._type: type | None = None
        self._dtype: Any = None
        self._ndim = -1

    def __call__(self, element: Any) -> int:
        self._index += 1
        kind = type(element)
        if kind is self._type:
            if kind is np.ndarray:
                if element.dtype is self._dtype and element.ndim == self._ndim:
                    return int(element.nbytes)
            elif self._dtype is not None:  # a numpy scalar
                if element.dtype is self._dtype:
                    return 8
            elif kind is bytes or kind is str:
                return len(element)
            elif kind in _PLAIN_SCALARS:
                return 8
        # Leaves that are not numpy values first: they would also differ in structure.
        try:
            nbytes = codec.element_nbytes(element, allow_pickled=self._allow_pickled)
        except errors.InvalidArgumentError as err:
            raise errors.InvalidArgumentError(
                f"element {self._index - 1} of task {self._task_id}: {err}"
            ) from None
        sig = codec.signature(element)
        if self._signature is None:
            self._signature = sig
            if (kind is np.ndarray and not element.dtype.hasobject) or (
                isinstance(element, np.generic) or kind in _PLAIN_LEAVES
            ):
                self._type = kind
                self._dtype = getattr(element, "dtype", None)
                self._ndim = getattr(element, "ndim", -1)
        elif sig != self._signature:
            raise errors.InvalidArgumentError(
                f"element {self._index - 1} of task {self._task_id} has structure "
                f"{codec.describe(sig)}, but the stream's elements so far have "
                f"{codec.describe(self._signature)}: every element of a dataset must have "
                "the same structure and dtypes"
            )
        return nbytes


_PLAIN_SCALARS = (int, float, bool, type(None))
_PLAIN_LEAVES = (*_PLAIN_SCALARS, bytes, str)


class TaskRunner:
    """Produces one task's elements. Thread-safe: any number of consumer threads
    may call `get_elements`."""

    def __init__(
        self,
        task_id: int,
        make_iterator: Callable[[], Iterator[Any]],
        worker_address: str,
        buffer_elements: int = DEFAULT_BUFFER_ELEMENTS,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        allow_pickled_elements: bool = False,
        initial_buffer_bytes: int | None = None,
    ) -> None:
        """`buffer_bytes` is the largest bytes bound; `initial_buffer_bytes` (None:
        `INITIAL_BUFFER_BYTES`, or `INITIAL_BUFFER_ELEMENTS` elements if larger) is
        where it starts, growing with what consumers take (pass `buffer_bytes` for a
        fixed bound). One element always fits, whatever its size."""
        self.task_id = task_id
        self.allow_pickled_elements = allow_pickled_elements
        self.num_consumers = 0  # > 0: a coordinated read (rounds)
        self.cross_trainer_cache: Any = None  # set for jobs with a cross-trainer cache
        self._make_iterator = make_iterator
        self._worker_address = worker_address
        self._buffer_elements = buffer_elements
        self._buffer_bytes = buffer_bytes  # the bound now (guarded by self._cv)
        self._max_buffer_bytes = buffer_bytes
        # None: size the first bound from the first element (_publish).
        self._size_bound_from_element = initial_buffer_bytes is None
        if initial_buffer_bytes is None:
            initial_buffer_bytes = INITIAL_BUFFER_BYTES
        self._buffer_bytes = max(1, min(buffer_bytes, initial_buffer_bytes))
        self._taken_since_growth = 0  # bytes consumers took at this bound
        self._cv = threading.Condition()
        # guarded by self._cv:
        self._buffer: collections.deque[tuple[Any, int]] = collections.deque()
        self._buffered_bytes = 0
        self._produced = 0
        self._end = False
        self._error: errors.RemoteErrorInfo | None = None
        self._stopped = False
        self._waiting = 0  # consumers blocked on an empty buffer
        # Final replies (their elements, then the end) that their consumers have not
        # taken yet (`get_elements_raw(hold_end=True)`): until they settle, other
        # consumers get no end of sequence (what they did not take may come back).
        self._end_holds = 0
        # coordinated reads (guarded by self._cv): round -> [element per consumer]
        self._rounds: dict[int, list[Any]] = {}
        self._round_taken: dict[int, set[int]] = {}
        self._completed_rounds: set[int] = set()
        self._max_round = -1
        # Weakly: the runner owns `unacked`; a bound method would make a cycle.
        self.unacked = UnackedReplies(task_id, requeue=_weak_method(self._requeue_encoded))
        self._thread = threading.Thread(
            target=self._produce, name=f"ds-task-{task_id}", daemon=True
        )
        self._thread.start()

    @property
    def stopped(self) -> bool:
        """`stop()` was called (the worker dropped the task, or is stopping)."""
        return self._stopped

    @property
    def finished(self) -> bool:
        """The pipeline ended and every element was handed out."""
        with self._cv:
            return self._end and not self._buffer

    def _produce(self) -> None:
        # Elements of a fast pipeline go to the shared buffer in small batches (one
        # lock and wake-up per batch, not per element); an element that took a
        # while to produce, or one a consumer is waiting for, goes at once.
        batch: list[tuple[Any, int]] = []
        batch_bytes = 0
        try:
            iterator = self._make_iterator()
            # After make_iterator: it may set allow_pickled_elements from the pipeline.
            check = _StructureCheck(self.task_id, self.allow_pickled_elements)
            clock = time.perf_counter
            last = clock()
            for element in iterator:
                nbytes = check(element)
                now = clock()
                batch.append((element, nbytes))
                batch_bytes += nbytes
                if (
                    self._waiting
                    or len(batch) >= _PRODUCE_BATCH
                    or now - last > _PRODUCE_BATCH_ELEMENT_S
                    or batch_bytes >= _PRODUCE_BATCH_BYTES
                ):
                    if not self._publish(batch, batch_bytes):
                        break
                    batch = []
                    batch_bytes = 0
                last = now
            else:
                if batch:
                    self._publish(batch, batch_bytes)
                batch = []
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        except BaseException as err:  # deliver any pipeline failure to the consumer
            if not isinstance(err, errors.DataServiceError):
                log.debug("task %d failed:\n%s", self.task_id, traceback.format_exc())
            if batch:  # the elements produced before the failure come first
                self._publish(batch, batch_bytes)
            with self._cv:
                self._error = errors.capture(err)
        finally:
            with self._cv:
                self._end = True
                self._cv.notify_all()

    def _publish(self, batch: list[tuple[Any, int]], batch_bytes: int) -> bool:
        """Appends `batch` to the shared buffer, waiting while the buffer is full
        (a full buffer takes a batch element by element, so the bounds hold to
        one element). Returns False if the runner was stopped."""
        with self._cv:
            if self._size_bound_from_element and batch:
                self._size_bound_from_element = False
                self._buffer_bytes = min(
                    self._max_buffer_bytes,
                    max(self._buffer_bytes, INITIAL_BUFFER_ELEMENTS * batch[0][1]),
                )
            buffer = self._buffer
            if (
                not self._stopped
                and len(buffer) + len(batch) <= self._buffer_elements
                and self._buffered_bytes + batch_bytes <= self._buffer_bytes
            ):  # room for all of it
                buffer.extend(batch)
                self._buffered_bytes += batch_bytes
                self._produced += len(batch)
                if self._waiting:
                    self._cv.notify_all()
                return True
            for item in batch:
                while (
                    not self._stopped
                    and self._buffer
                    and (
                        len(self._buffer) >= self._buffer_elements
                        or self._buffered_bytes + item[1] > self._buffer_bytes
                    )
                ):
                    self._cv.notify_all()
                    self._cv.wait(0.5)
                if self._stopped:
                    return False
                self._buffer.append(item)
                self._buffered_bytes += item[1]
                self._produced += 1
            if self._waiting:
                self._cv.notify_all()
        return True

    def start_producing(self) -> None:
        """A consumer asks for the task: a runner that waits for one before it runs
        the pipeline (a lazily started worker's) starts now; this one already runs."""

    def get_elements_raw(
        self, max_elements: int, max_bytes: int, timeout_s: float, hold_end: bool = False
    ) -> TaskRead:
        """Takes up to `max_elements` elements (at most ~`max_bytes` payload
        bytes, but always one), waiting up to `timeout_s` seconds for the first.
        While another consumer's final reply is held (below), a consumer that finds
        the buffer empty waits for it to settle instead of getting the end. A
        stopped runner returns nothing, never an end of sequence.

        Args:
            hold_end: The caller learns whether its consumer took what it returns:
                a final reply (elements and the end together) is then held
                (`TaskRead.end_held`) until the caller's `release_end_hold()`, so
                that what the consumer did not take (`requeue`d before the release)
                reaches the task's other consumers before their end of sequence.

        Returns:
            The raw elements taken (none if none was ready in time); its `error`,
            a pipeline failure, comes once the elements before it are taken.
        """
        deadline = time.monotonic() + timeout_s
        out: list[Any] = []
        with self._cv:
            while not self._buffer and (not self._end or self._end_holds) and not self._stopped:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return TaskRead(out)
                self._waiting += 1
                try:
                    self._cv.wait(remaining)
                finally:
                    self._waiting -= 1
            if self._stopped:
                # Never an end of sequence: a stopped task's stream did not end (its
                # producer ends early too); its consumers learn the task is gone.
                return TaskRead(out)
            total = 0
            buffer = self._buffer
            if len(buffer) <= max_elements and self._buffered_bytes <= max_bytes:
                out = [element for element, _ in buffer]  # all of it
                total = self._buffered_bytes
                buffer.clear()
                self._buffered_bytes = 0
            while self._buffer and len(out) < max_elements:
                nbytes = self._buffer[0][1]
                if out and total + nbytes > max_bytes:
                    break
                element, _ = self._buffer.popleft()
                self._buffered_bytes -= nbytes
                total += nbytes
                out.append(element)
            self._note_taken_locked(total)
            self._cv.notify_all()
            if self._buffer or not self._end:
                return TaskRead(out)
            if self._error is not None:
                if out:
                    return TaskRead(out)
                return TaskRead(out, True, self._error)
            if out and hold_end:
                self._end_holds += 1
                return TaskRead(out, True, end_held=True)
            return TaskRead(out, True)

    def release_end_hold(self) -> None:
        """The final reply a `get_elements_raw(hold_end=True)` returned (`end_held`)
        settled: its consumer took it all, or what it did not take was `requeue`d."""
        with self._cv:
            self._end_holds -= 1
            self._cv.notify_all()

    def _note_taken_locked(self, nbytes: int) -> None:
        """Grows the bytes bound (doubling, up to `buffer_bytes`) once consumers
        have taken a bound's worth since it last grew: demand, not the pipeline's
        speed, sets how much a task holds."""
        if self._buffer_bytes >= self._max_buffer_bytes:
            return
        self._taken_since_growth += nbytes
        if self._taken_since_growth >= self._buffer_bytes:
            self._taken_since_growth = 0
            self._buffer_bytes = min(self._max_buffer_bytes, 2 * self._buffer_bytes)

    @property
    def buffer_bound_bytes(self) -> int:
        """The buffer's bytes bound now (it grows with demand, see the module)."""
        with self._cv:
            return self._buffer_bytes

    @property
    def buffered_bytes(self) -> int:
        """Bytes of the elements waiting in the buffer now."""
        with self._cv:
            return self._buffered_bytes

    def requeue(self, elements: list[Any]) -> None:
        """Puts elements taken from the buffer back at its front, in their order: a
        transfer of them failed before the consumer had them (`UnackedReplies`), so the
        next read (of any consumer of the task) takes them again. The buffer's bounds
        may be exceeded by them; the producer waits until they are taken."""
        if not elements:
            return
        items = [(element, codec.element_nbytes(element)) for element in elements]
        with self._cv:
            if self._stopped:
                return
            self._buffer.extendleft(reversed(items))
            self._buffered_bytes += sum(nbytes for _, nbytes in items)
            self._cv.notify_all()

    def _requeue_encoded(self, elements: list[bytes]) -> None:
        self.requeue([codec.decode(e) for e in elements])

    def get_elements(self, max_elements: int, max_bytes: int, timeout_s: float) -> TaskRead:
        """As `get_elements_raw`, with each element encoded for gRPC (`codec.encode`,
        `bytes`); an element the codec cannot carry ends the read with its error."""
        return encode_elements(self.get_elements_raw(max_elements, max_bytes, timeout_s))

    def get_round_element(
        self, consumer_index: int, num_consumers: int, round_index: int, timeout_s: float
    ) -> TaskRead:
        """Coordinated reads (tf.data service's RoundRobinTaskRunner): consumer
        `consumer_index` of `num_consumers` takes its element of round
        `round_index`. The first request for a round takes the next
        `num_consumers` elements of the stream as that round; each consumer gets
        its own one. At most `MAX_OPEN_ROUNDS` rounds may be incomplete, so a
        consumer that stops reading stops the others (they time out) instead of
        letting its elements pile up.

        Returns:
            [element], or no element if it is not ready within `timeout_s`.

        Raises:
            FailedPreconditionError: The round was already read by every consumer
                (e.g. a restarted set of consumers asking for round 0 again).
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            if round_index in self._completed_rounds:
                raise errors.FailedPreconditionError(
                    f"Consumer {consumer_index} requested data for round {round_index}, but "
                    f"the current round has already reached {self._max_round + 1}: every "
                    "consumer already read that round (restarted consumers must use a new "
                    "job_name)"
                )
            while round_index not in self._rounds:
                if self._stopped:  # not an end of sequence (see get_elements_raw)
                    return TaskRead([])
                open_rounds = len(self._rounds)
                if open_rounds < MAX_OPEN_ROUNDS and (
                    len(self._buffer) >= num_consumers or self._end
                ):
                    if len(self._buffer) < num_consumers:  # the stream ended mid-round
                        return TaskRead([], True, self._error)
                    items = [self._buffer.popleft() for _ in range(num_consumers)]
                    taken_bytes = sum(nbytes for _, nbytes in items)
                    self._buffered_bytes -= taken_bytes
                    self._note_taken_locked(taken_bytes)
                    self._rounds[round_index] = [element for element, _ in items]
                    self._round_taken[round_index] = set()
                    self._max_round = max(self._max_round, round_index)
                    self._cv.notify_all()
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopped:
                    return TaskRead([])
                self._cv.wait(remaining)
            element = self._rounds[round_index][consumer_index]
            taken = self._round_taken[round_index]
            taken.add(consumer_index)
            if len(taken) == num_consumers:
                del self._rounds[round_index]
                del self._round_taken[round_index]
                self._completed_rounds.add(round_index)
                if len(self._completed_rounds) > 100_000:
                    floor = self._max_round - 50_000
                    self._completed_rounds = {r for r in self._completed_rounds if r > floor}
                self._cv.notify_all()
            return TaskRead([element])

    def stop(self) -> None:
        """Stops producing (the producer thread exits at its next element, see
        `join`), wakes every waiting read, and drops the buffer, the un-acknowledged
        replies and the cross-trainer cache's window (its memfd) now."""
        with self._cv:
            self._stopped = True
            self._buffer.clear()
            self._buffered_bytes = 0
            self._cv.notify_all()
        self.unacked.close()
        cache = self.cross_trainer_cache
        if cache is not None:
            cache.close()

    def join(self, timeout_s: float) -> bool:
        """Waits up to `timeout_s` seconds for the producer thread to exit after
        `stop()` (it does at its next element, or at once if it waits for room).

        Returns:
            False if it still runs (the pipeline is inside user code).
        """
        if self._thread is threading.current_thread():  # stopped by its own pipeline
            return False
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def _weak_method(method: Callable[[list[bytes]], None]) -> Callable[[list[bytes]], None]:
    """Calls `method` while its object lives (a no-op after), without keeping it alive."""
    ref = weakref.WeakMethod(method)

    def call(elements: list[bytes]) -> None:
        bound = ref()
        if bound is not None:
            bound(elements)

    return call


@dataclasses.dataclass
class Reply:
    """One reply to a consumer, as sent: encoded (and compressed) elements.

    Attributes:
        elements: Encoded elements (`codec.encode`, then `codec.compress`).
        end_of_sequence: The reply ends the task's stream.
        error: A pipeline failure (reported after the elements), or None.
        requeue_on_failure: First come, first served elements: if the transfer fails
            and the consumer does not come back for them within `REQUEUE_AFTER_S`,
            they go back to the front of the task's buffer (a coordinated round's or
            a trainer's elements are that consumer's alone: they wait for its retry).
    """

    elements: list[bytes]
    end_of_sequence: bool
    error: errors.RemoteErrorInfo | None
    requeue_on_failure: bool = False


@dataclasses.dataclass
class _Consumer:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    sequence: int = 0  # of the last request served
    reply: Reply | None = None  # its reply, until acknowledged (or requeued)
    sent: bool = False  # the reply's transfer completed (on the worker's side)
    failed_at: float | None = None  # time.monotonic() its transfer failed, if it did
    last_seen: float = 0.0  # time.monotonic() of its last request
    # Elements taken for this consumer and not sent yet: the end of a reply that a
    # retry asked to cut to a smaller max_bytes (a slow link), with that reply's end
    # of sequence and error; the next requests get them before anything else.
    rest: Reply | None = None


def _fitting(elements: list[bytes], max_bytes: int) -> int:
    """How many of `elements`, from the first, fit in `max_bytes` (at least one)."""
    total = 0
    for k, element in enumerate(elements):
        total += len(element)
        if k and total > max_bytes:
            return k
    return len(elements)


class ConsumerTurn:
    """One request's exclusive hold on its consumer's entry (`UnackedReplies.begin`).

    Attributes:
        replay: The reply to send again (the request repeats the sequence number of
            one the consumer did not get), or None: make a new reply and `store` it.
    """

    def __init__(self, owner: UnackedReplies, entry: _Consumer) -> None:
        self._owner = owner
        self._entry = entry
        self.replay: Reply | None = entry.reply
        self._done = False

    def store(self, reply: Reply) -> None:
        """Keeps `reply` as the consumer's un-acknowledged one."""
        self._entry.reply = reply
        self._entry.sent = False

    def take_rest(self, max_bytes: int) -> Reply | None:
        """The next reply from the elements a cut left with this consumer (`cut`):
        those that fit in `max_bytes` (at least one; 0: all), with the end of sequence
        and error of the reply they came from once the last of them goes. None if no
        element was left. `store` it."""
        rest = self._entry.rest
        if rest is None:
            return None
        k = _fitting(rest.elements, max_bytes) if max_bytes > 0 else len(rest.elements)
        if k == len(rest.elements):
            self._entry.rest = None
            return rest
        self._entry.rest = Reply(
            rest.elements[k:], rest.end_of_sequence, rest.error, rest.requeue_on_failure
        )
        return Reply(rest.elements[:k], False, None, rest.requeue_on_failure)

    def cut(self, max_bytes: int) -> Reply | None:
        """Cuts the stored reply to the elements that fit in `max_bytes` (at least
        one) and returns it: a client on a slow link retries with a smaller
        `max_bytes` than the reply was made for. The elements cut off are not sent
        now: first come, first served ones (of a reply without an error) go back to
        the front of the task's buffer, for the next read; others (a coordinated
        round's, a trainer's, a reply that ends with an error, or one made from such
        a rest) stay with this consumer for its next requests (`take_rest`). Nothing
        is lost or sent twice: the consumer has none of them (it asks again only for
        a reply it did not get completely, or for the next one)."""
        entry = self._entry
        reply = entry.reply
        if reply is None or max_bytes <= 0:
            return reply
        k = _fitting(reply.elements, max_bytes)
        if k == len(reply.elements):
            return reply
        head = Reply(reply.elements[:k], False, None, reply.requeue_on_failure)
        tail = Reply(
            reply.elements[k:], reply.end_of_sequence, reply.error, reply.requeue_on_failure
        )
        entry.reply = head
        owner = self._owner
        if (
            entry.rest is None
            and tail.requeue_on_failure
            and tail.error is None
            and owner._requeue is not None
        ):
            # The task still knows whether its stream ended: the end comes after them.
            owner.cut_back(tail.elements)
        elif entry.rest is None:
            entry.rest = tail
        else:  # a reply made from the rest, cut again: its tail goes before the rest
            entry.rest = Reply(
                tail.elements + entry.rest.elements,
                entry.rest.end_of_sequence,
                entry.rest.error,
                entry.rest.requeue_on_failure,
            )
        return head

    def finish(self, sent: bool) -> None:
        """Ends the turn. `sent`: the reply's transfer completed on the worker's side
        (the consumer has it unless it dies now). Either way the reply stays until the
        consumer acknowledges it; one whose transfer failed waits for the consumer's
        retry (`UnackedReplies` says how long)."""
        if self._done:
            return
        self._done = True
        entry = self._entry
        owner = self._owner
        with owner._mu:
            entry.sent = sent
            was_parked = entry.failed_at is not None
            entry.failed_at = None if sent or entry.reply is None else time.monotonic()
            owner._parked += (entry.failed_at is not None) - was_parked
            entry.last_seen = time.monotonic()
            owner._cv.notify_all()
        entry.lock.release()


class UnackedReplies:
    """The last reply to each consumer of one task, kept until the consumer
    acknowledges it, so that no element is lost between the worker's buffer and
    the consumer (a reply that misses the client's deadline, a dropped connection).
    Thread-safe.

    A consumer is a key its client chooses (one per reader and task) and numbers
    its requests 1, 2, 3, ...: request s acknowledges the reply to s - 1 (the
    consumer asks again only once it has a reply), and a retry repeats s and gets
    the same reply again. One request of a consumer is served at a time (`begin`
    waits for the previous one to end).

    What happens to un-acknowledged elements:
      - A transfer that failed on the worker's side (the stream was cancelled or
        broke: the consumer does not have the reply): the reply waits for that
        consumer's retry. First come, first served elements go back to the front of
        the task's buffer (`requeue`), for the task's other consumers, once the
        consumer has not come back for `requeue_after_s` (a live one retries within
        about a second or two); until then the task's other consumers do not get
        the end of sequence (`settle_failed`). A coordinated
        round's or a trainer's reply is that consumer's alone and keeps waiting.
      - A reply sent completely whose consumer never asks again (it finished at
        the end of sequence, was abandoned, or died just after receiving it): it
        reached the consumer's side, so it is not sent to anyone else.
      - Whatever is still held when the consumer's entry expires (no request for
        `ttl_s`) or when the task stops is counted (`dropped_elements`) and logged.
    """

    def __init__(
        self,
        task_id: int,
        requeue: Callable[[list[bytes]], None] | None = None,
        ttl_s: float | None = None,
        requeue_after_s: float | None = None,
    ) -> None:
        self.task_id = task_id
        self._requeue = requeue
        self._ttl_s = UNACKED_TTL_S if ttl_s is None else ttl_s
        self._requeue_after_s = REQUEUE_AFTER_S if requeue_after_s is None else requeue_after_s
        self._mu = threading.Lock()
        self._cv = threading.Condition(self._mu)  # notified when a failed reply settles
        # guarded by self._mu:
        self._consumers: dict[str, _Consumer] = {}
        self._parked = 0  # entries whose reply's transfer failed (failed_at set)
        self._next_sweep = time.monotonic() + self._ttl_s / 4
        self._closed = False
        self.acked_elements = 0
        self.resent_replies = 0
        self.requeued_elements = 0
        self.dropped_elements = 0
        self.cut_elements = 0  # cut off replies and given back to the task (slow links)

    def stats(self) -> dict[str, int]:
        """Counters: consumers with an entry, `unacked_elements` held now,
        (in replies and cut-off rests), `failed_replies` waiting for their consumer's
        retry, `acked_elements`, `resent_replies`, `requeued_elements`,
        `dropped_elements`, `cut_elements`."""
        with self._mu:
            return {
                "consumers": len(self._consumers),
                "unacked_elements": sum(
                    len(c.reply.elements) if c.reply else 0 for c in self._consumers.values()
                )
                + sum(len(c.rest.elements) if c.rest else 0 for c in self._consumers.values()),
                "failed_replies": self._parked,
                "acked_elements": self.acked_elements,
                "resent_replies": self.resent_replies,
                "requeued_elements": self.requeued_elements,
                "dropped_elements": self.dropped_elements,
                "cut_elements": self.cut_elements,
            }

    def begin(self, key: str, sequence: int, timeout_s: float) -> ConsumerTurn:
        """Starts serving request `sequence` of consumer `key`: waits up to `timeout_s`
        seconds for the consumer's previous request to end, then acknowledges the
        previous reply (`sequence` is one more) or hands it back to resend (`sequence`
        repeats it). A key not seen before (or expired, or from before a worker
        restart) starts at any sequence number. Call `ConsumerTurn.finish` always.

        Raises:
            DeadlineExceededError: The consumer's previous request is still being
                answered after `timeout_s` (the client retries).
            FailedPreconditionError: `sequence` is neither the last one nor the next
                (a client bug), or the task has stopped.
            InvalidArgumentError: `sequence` is not positive.
        """
        if sequence <= 0:
            raise errors.InvalidArgumentError(
                f"GetElements for task {self.task_id}: sequence must be >= 1 with a "
                f"consumer_key, got {sequence}"
            )
        now = time.monotonic()
        with self._mu:
            if self._closed:
                raise errors.FailedPreconditionError(f"task {self.task_id} has stopped")
            if now >= self._next_sweep:
                self._sweep_locked(now)
            back = self._take_failed_locked(now - self._requeue_after_s, key)
            entry = self._consumers.get(key)
            if entry is None:
                entry = self._consumers[key] = _Consumer(sequence=sequence - 1, last_seen=now)
            entry.last_seen = now
        self._give_back(back)
        if not entry.lock.acquire(timeout=max(0.0, timeout_s)):
            raise errors.DeadlineExceededError(
                f"consumer {key} of task {self.task_id}: its previous request (sequence "
                f"{entry.sequence}) was still being answered after {timeout_s:.1f} s; retry"
            )
        try:
            with self._mu:
                if sequence == entry.sequence + 1:
                    if entry.reply is not None:
                        self.acked_elements += len(entry.reply.elements)
                    entry.reply, entry.sent, entry.sequence = None, False, sequence
                elif sequence == entry.sequence:
                    if entry.reply is not None:
                        self.resent_replies += 1
                else:
                    raise errors.FailedPreconditionError(
                        f"consumer {key} of task {self.task_id} sent request {sequence} after "
                        f"request {entry.sequence}: requests must be numbered 1, 2, 3, ... "
                        "(a retry repeats its number)"
                    )
                if entry.failed_at is not None:  # its own retry (or ack) takes it
                    entry.failed_at = None
                    self._parked -= 1
                    self._cv.notify_all()
                self._consumers[key] = entry  # back, should it have expired meanwhile
        except BaseException:
            entry.lock.release()
            raise
        return ConsumerTurn(self, entry)

    def settle_failed(self, timeout_s: float) -> tuple[int, bool]:
        """Called when the task's stream is over for a consumer (its buffer is empty):
        first come, first served replies whose transfer failed are all that is left.
        Waits up to `timeout_s` seconds while such replies wait for their own
        consumers' retry, and gives back (`requeue`) those whose consumer has not come
        back within `requeue_after_s`, so the task's other consumers get them before
        the end of sequence, and the end only after them.

        Returns:
            (elements given back, whether failed replies still wait for a retry): the
            caller reports no end of sequence if either is non-zero.
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                now = time.monotonic()
                back = self._take_failed_locked(now - self._requeue_after_s, "")
                waiting = [
                    e.failed_at
                    for e in self._consumers.values()
                    if e.failed_at is not None
                    and e.reply is not None
                    and e.reply.requeue_on_failure
                ]
                if back or not waiting or now >= deadline:
                    break
                self._cv.wait(min(deadline, min(waiting) + self._requeue_after_s) - now)
        self._give_back(back)
        return len(back), bool(waiting)

    def _take_failed_locked(self, failed_before: float, skip_key: str) -> list[bytes]:
        """Takes the failed first come, first served replies (not of `skip_key`,
        whose request is coming) that failed before `failed_before`."""
        if not self._parked:
            return []
        back: list[bytes] = []
        for key, entry in self._consumers.items():
            reply = entry.reply
            if (
                key == skip_key
                or entry.failed_at is None
                or entry.failed_at >= failed_before
                or reply is None
                or not reply.requeue_on_failure
                or entry.lock.locked()
            ):
                continue
            back.extend(reply.elements)
            self.requeued_elements += len(reply.elements)
            if entry.rest is not None and entry.rest.requeue_on_failure:
                back.extend(entry.rest.elements)
                self.requeued_elements += len(entry.rest.elements)
                entry.rest = None
            entry.reply, entry.failed_at = None, None
            self._parked -= 1
        return back

    def _give_back(self, elements: list[bytes]) -> None:
        if elements and self._requeue is not None:
            self._requeue(elements)

    def cut_back(self, elements: list[bytes]) -> None:
        """Elements cut off a first come, first served reply (`ConsumerTurn.cut`) go
        back to the front of the task's buffer."""
        with self._mu:
            self.cut_elements += len(elements)
        self._give_back(elements)

    def _sweep_locked(self, now: float) -> None:
        self._next_sweep = now + self._ttl_s / 4
        for key, entry in list(self._consumers.items()):
            if now - entry.last_seen < self._ttl_s or entry.lock.locked():
                continue
            del self._consumers[key]
            if entry.failed_at is not None:
                self._parked -= 1
            self._count_dropped_locked(key, entry, f"no request for {self._ttl_s:.0f} s")

    def _count_dropped_locked(self, key: str, entry: _Consumer, why: str) -> None:
        n = len(entry.reply.elements) if entry.reply is not None else 0
        n += len(entry.rest.elements) if entry.rest is not None else 0
        if not n:
            return
        self.dropped_elements += n
        log.info(
            "task %d: consumer %s did not acknowledge its last reply (%d elements, %s) "
            "before it went away (%s); they are not sent again",
            self.task_id,
            key,
            n,
            "sent" if entry.sent else "not sent completely",
            why,
        )

    def close(self) -> None:
        """The task stopped: counts the replies still un-acknowledged and drops them."""
        with self._mu:
            if self._closed:
                return
            self._closed = True
            for key, entry in self._consumers.items():
                self._count_dropped_locked(key, entry, "the task stopped")
            self._consumers.clear()
            self._parked = 0
