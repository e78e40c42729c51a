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
each time consumers have taken a bound's worth of bytes since it last grew; so
does its element bound, from `INITIAL_ELEMENT_BOUND` up to `buffer_elements` (a
fast pipeline's first burst then does not hold the GIL while a new iterator's
first element is being sent). An
iteration nobody reads past its first elements (a dropped iterator of a named job)
then holds a few elements on the worker, not `buffer_bytes`; a consumer that reads
everything reaches the full bound after taking about `buffer_bytes` (6 doublings
from 2 MiB to 64 MiB). A pipeline error, or an element that is not a
numpy value in a pipeline that did not allow pickled elements, is delivered
after the elements produced before it. The producer hands a fast pipeline's
elements to the buffer in batches (one lock and wake-up each); a read that finds
the buffer short takes the batch made so far, so an element the pipeline made is
never held back behind a slow or stuck next one.

An element leaves the worker only when its consumer has it: gRPC replies are
kept per consumer (`unacked_replies.UnackedReplies`, one per runner) until the
consumer's next request acknowledges them; a reply whose transfer failed waits
for the consumer's retry, or goes back to the front of the buffer (`requeue`) if
the consumer is gone. `Reply`, `UnackedReplies`, `REQUEUE_AFTER_S` and
`UNACKED_TTL_S` can also be imported from here.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from dataservice import _core, errors
from dataservice.metrics import WorkerCounters
from dataservice.transfer import codec
from dataservice.transfer.base import TaskRead
from dataservice.worker.unacked_replies import REQUEUE_AFTER_S, UNACKED_TTL_S, UnackedReplies
from dataservice.worker.unacked_replies import Reply as Reply  # re-exported

log = logging.getLogger(__name__)

DEFAULT_BUFFER_ELEMENTS = 4096
DEFAULT_BUFFER_BYTES = 64 << 20
# Where a task's bytes bound starts (see the module's docstring): the larger of these
# bytes and room for these many elements of the first element's size.
INITIAL_BUFFER_BYTES = 2 << 20
INITIAL_BUFFER_ELEMENTS = 4
# Where a growing buffer's element bound starts (doubling up to `buffer_elements` as
# consumers take it): a fast pipeline's first burst (4,096 scalars, ~5 ms of producer
# thread holding the GIL) otherwise delays the thread sending a new iterator's first
# element; measured on gRPC scalars, first element 18.5 -> 10.9 ms.
INITIAL_ELEMENT_BOUND = 64
MAX_OPEN_ROUNDS = 4
_PRODUCE_BATCH = 64  # elements per hand-off to the shared buffer (fast pipelines)
_PRODUCE_BATCH_BYTES = 1 << 20
_PRODUCE_BATCH_ELEMENT_S = 50e-6  # an element slower than this is handed off at once


def encode_elements(read: TaskRead, later: bool = False) -> TaskRead:
    """`read` with each element `codec.encode`d (`bytes`; with `later`,
    `codec.encode_later`: large ones as `codec.Encoding`s), up to the first that
    cannot be encoded (e.g. a leaf that cannot be pickled): then the ones before
    it, ending the read with its error. That error reaches the consumer as the
    pipeline's own, as over shared memory."""
    out: list[Any] = []
    encode = codec.encode_later if later else codec.encode
    for element in read.elements:
        try:
            out.append(encode(element))
        except Exception as err:
            return TaskRead(out, True, errors.capture(err))
    return TaskRead(out, read.end_of_sequence, read.error)


class _StructureCheck:
    """Checks that every element of a stream has the first one's structure
    (`codec.signature`) and returns its `codec.element_nbytes`; a single array
    (of a numeric dtype) or scalar leaf of the same type and dtype object takes a
    fast path, and an element of plain numpy values (any nest of them) is
    checked in one Rust walk against the stream's structure learnt from an
    element that passed (`_core.ElementCheck`). Unless `allow_pickled`, an element holding a
    leaf that is not a numpy value raises `InvalidArgumentError` naming its path
    and type."""

    def __init__(self, task_id: int, allow_pickled: bool = False) -> None:
        self._task_id = task_id
        self._allow_pickled = allow_pickled
        self._index = 0
        self._signature: Any = None
        self._type: type | None = None
        self._dtype: Any = None
        self._ndim = -1
        self._fast = _core.ElementCheck()  # the stream's structure, once learnt

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
        fast = self._fast.nbytes_if_same(element)
        if fast is not None:
            return fast
        # Leaves that are not numpy values first: they would also differ in structure.
        try:
            nbytes = codec.element_nbytes(element, allow_pickled=self._allow_pickled)
        except errors.InvalidArgumentError as err:
            raise errors.InvalidArgumentError(
                f"element {self._index - 1} of task {self._task_id}: {err}"
            ) from None
        sig = codec.signature(element)
        if self._signature is None or sig == self._signature:
            # An element matching this one's structure has the stream's signature.
            self._fast.learn(element)
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
        counters: WorkerCounters | None = None,
    ) -> None:
        """`buffer_bytes` is the largest bytes bound; `initial_buffer_bytes` (None:
        `INITIAL_BUFFER_BYTES`, or `INITIAL_BUFFER_ELEMENTS` elements if larger) is
        where it starts, growing with what consumers take (pass `buffer_bytes` for a
        fixed bound). One element always fits, whatever its size. `counters` (the
        worker's, metrics.py) get the elements produced, the producer thread's CPU
        seconds and when it is busy (a fresh, unshared one when None)."""
        self.task_id = task_id
        self._counters = counters if counters is not None else WorkerCounters()
        self._cpu_mark = 0.0  # the producer thread's time.thread_time() last counted
        self.allow_pickled_elements = allow_pickled_elements
        self.num_consumers = 0  # > 0: a coordinated read (rounds)
        self.cross_trainer_cache: Any = None  # set for jobs with a cross-trainer cache
        # The pipeline's counters (`data.IterStats`), set by `make_iterator` when it
        # passes them to the pipeline; read by `errors_ignored`.
        self.iter_stats: Any = None
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
        # The element bound grows as the bytes bound does, unless that one is fixed.
        grows = initial_buffer_bytes < buffer_bytes
        self._element_bound = (
            min(buffer_elements, INITIAL_ELEMENT_BOUND) if grows else buffer_elements
        )
        self._taken_elements_since_growth = 0  # elements consumers took at this bound
        self._cv = threading.Condition()
        # guarded by self._cv:
        self._buffer: collections.deque[tuple[Any, int]] = collections.deque()
        self._buffered_bytes = 0
        self._produced = 0
        self._end = False
        self._error: errors.RemoteErrorInfo | None = None
        self._stopped = False
        self._halting = False  # see halt()
        self._waiting = 0  # consumers blocked on an empty buffer (or an incomplete round)
        # Elements the producer made and has not handed to `_buffer` yet (its batch, see
        # `_produce`). Only the producer appends, without the lock; whoever holds the lock
        # moves them to `_buffer` (`_take_pending_locked`), so a consumer that finds the
        # buffer empty gets them while the producer is blocked in the pipeline.
        self._pending: collections.deque[tuple[Any, int]] = collections.deque()
        # Final replies (their elements, then the end) that their consumers have not
        # taken yet (`get_elements_raw(hold_end=True)`): until they settle, other
        # consumers get no end of sequence (what they did not take may come back).
        self._end_holds = 0
        # coordinated reads (guarded by self._cv): round -> [element per consumer]
        self._rounds: dict[int, list[Any]] = {}
        self._round_taken: dict[int, set[int]] = {}
        self._completed_rounds: set[int] = set()
        self._max_round = -1
        # Weakly: the runner owns `unacked`; a bound method would make a cycle. The
        # timings are this module's names, read when the task starts (a test may
        # shorten `task_runner.REQUEUE_AFTER_S` for the tasks it starts).
        self.unacked = UnackedReplies(
            task_id,
            requeue=_weak_method(self._requeue_encoded),
            ttl_s=UNACKED_TTL_S,
            requeue_after_s=REQUEUE_AFTER_S,
        )
        self._thread = threading.Thread(
            target=self._produce, name=f"ds-task-{task_id}", daemon=True
        )
        self._thread.start()

    @property
    def stopped(self) -> bool:
        """`stop()` was called (the worker dropped the task, or is stopping)."""
        return self._stopped

    @property
    def errors_ignored(self) -> int:
        """Elements `ignore_errors` skipped in this task's pipeline so far."""
        stats = self.iter_stats
        return 0 if stats is None else int(stats.errors_ignored)

    @property
    def finished(self) -> bool:
        """The pipeline ended and every element was handed out."""
        with self._cv:
            return self._end and not self._buffer

    def _produce(self) -> None:
        # Elements of a fast pipeline go to the shared buffer in small batches (one
        # lock and wake-up per batch, not per element); an element that took a
        # while to produce, or one a consumer is waiting for, goes at once. The batch
        # is `_pending`, which consumers may take from while the pipeline computes the
        # next element: an element made is never held back behind a slow one.
        pending = self._pending
        batch_bytes = 0  # since the last hand-off (a consumer may have taken some)
        self._cpu_mark = time.thread_time()
        activity = self._counters.activity
        busy = False
        cut = False  # failed after halt(): the stream neither fails nor ends
        try:
            iterator = self._make_iterator()
            activity.busy()
            busy = True
            # After make_iterator: it may set allow_pickled_elements from the pipeline.
            check = _StructureCheck(self.task_id, self.allow_pickled_elements)
            clock = time.perf_counter
            last = clock()
            for element in iterator:
                nbytes = check(element)
                now = clock()
                pending.append((element, nbytes))
                batch_bytes += nbytes
                # `_waiting` is read after the append: a consumer counts itself waiting
                # before it looks at `_pending`, so one of the two sees the element.
                if (
                    self._waiting
                    or len(pending) >= _PRODUCE_BATCH
                    or now - last > _PRODUCE_BATCH_ELEMENT_S
                    or batch_bytes >= _PRODUCE_BATCH_BYTES
                ):
                    if not self._publish():
                        break
                    batch_bytes = 0
                last = now
            else:
                self._publish()
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        except BaseException as err:  # deliver any pipeline failure to the consumer
            if not isinstance(err, errors.DataServiceError):
                log.debug("task %d failed:\n%s", self.task_id, traceback.format_exc())
            self._publish()  # the elements produced before the failure come first
            with self._cv:
                if self._halting:
                    cut = True
                else:
                    self._error = errors.capture(err)
        finally:
            self._count_cpu()
            if busy:
                activity.idle()
            with self._cv:
                if self._stopped:
                    pending.clear()
                self._end = not cut
                self._cv.notify_all()

    def _count_cpu(self) -> None:
        """Adds the producer thread's CPU seconds since the last call to the
        worker's pipeline CPU (the producer thread only)."""
        now = time.thread_time()
        self._counters.pipeline_cpu.add(now - self._cpu_mark)
        self._cpu_mark = now

    def _take_pending_locked(self) -> bool:
        """Moves `_pending` elements, oldest first, to the buffer while they fit its
        bounds (one always, into an empty buffer). Returns whether any moved."""
        pending = self._pending
        if not pending or self._stopped:
            return False
        buffer = self._buffer
        if self._size_bound_from_element:
            self._size_bound_from_element = False
            self._buffer_bytes = min(
                self._max_buffer_bytes,
                max(self._buffer_bytes, INITIAL_BUFFER_ELEMENTS * pending[0][1]),
            )
        # (a coordinated read's round needs one element per consumer in the buffer)
        room = max(self._element_bound, self.num_consumers) - len(buffer)
        total = self._buffered_bytes
        bound = self._buffer_bytes
        moved = 0
        while pending:
            nbytes = pending[0][1]
            if buffer and (moved >= room or total + nbytes > bound):
                break
            buffer.append(pending.popleft())
            total += nbytes
            moved += 1
        self._buffered_bytes = total
        self._produced += moved
        if moved:
            self._counters.produced(moved)
        return moved > 0

    def _publish(self) -> bool:
        """Hands `_pending` to the shared buffer, waiting while the buffer is full
        (so its bounds hold to one element). Returns False if the runner was stopped.
        While it waits the producer counts as idle (`metrics.ActivityClock`)."""
        self._count_cpu()
        idle = False
        try:
            with self._cv:
                while True:
                    if self._take_pending_locked() and self._waiting:
                        self._cv.notify_all()
                    if self._stopped:
                        return False
                    if not self._pending:
                        return True
                    self._cv.notify_all()
                    if not idle:
                        idle = True
                        self._counters.activity.idle()
                    self._cv.wait(0.5)
        finally:
            if idle:
                self._counters.activity.busy()

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
            # Counted waiting before looking at `_pending` (see `_produce`).
            self._waiting += 1
            try:
                self._take_pending_locked()
                while not self._buffer and (not self._end or self._end_holds) and not self._stopped:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return TaskRead(out)
                    self._cv.wait(remaining)
                    self._take_pending_locked()
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
            self._note_taken_locked(total, len(out))
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

    def _note_taken_locked(self, nbytes: int, count: int) -> None:
        """Grows the bytes bound (doubling, up to `buffer_bytes`) once consumers
        have taken a bound's worth of bytes since it last grew, and the element
        bound (up to `buffer_elements`) once they have taken a bound's worth of
        elements: demand, not the pipeline's speed, sets how much a task holds."""
        if self._element_bound < self._buffer_elements:
            self._taken_elements_since_growth += count
            if self._taken_elements_since_growth >= self._element_bound:
                self._taken_elements_since_growth = 0
                self._element_bound = min(self._buffer_elements, 2 * self._element_bound)
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
    def buffered_elements(self) -> int:
        """Elements waiting in the buffer now (read without the lock: a gauge)."""
        return len(self._buffer)

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

    def _requeue_encoded(self, elements: list[Any]) -> None:
        self.requeue(
            [e.element if isinstance(e, codec.Encoding) else codec.decode(e) for e in elements]
        )

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
                if len(self._buffer) < num_consumers:
                    self._take_pending_locked()
                open_rounds = len(self._rounds)
                if open_rounds < MAX_OPEN_ROUNDS and (
                    len(self._buffer) >= num_consumers or self._end
                ):
                    if len(self._buffer) < num_consumers:  # the stream ended mid-round
                        return TaskRead([], True, self._error)
                    items = [self._buffer.popleft() for _ in range(num_consumers)]
                    taken_bytes = sum(nbytes for _, nbytes in items)
                    self._buffered_bytes -= taken_bytes
                    self._note_taken_locked(taken_bytes, num_consumers)
                    self._rounds[round_index] = [element for element, _ in items]
                    self._round_taken[round_index] = set()
                    self._max_round = max(self._max_round, round_index)
                    self._cv.notify_all()
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopped:
                    return TaskRead([])
                # Counted waiting, so the producer hands over each element it makes.
                self._waiting += 1
                try:
                    if not self._take_pending_locked():
                        self._cv.wait(remaining)
                finally:
                    self._waiting -= 1
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

    def halt(self) -> None:
        """The worker is stopping (its `stop()` of this runner follows): a failure of
        the pipeline from now on is the stop's doing (a dispatcher call it cancels),
        not the pipeline's, so the stream ends neither with that error nor with an
        end of sequence: reads get what was produced, then nothing, as from a
        stopped task. Reads go on until `stop()`."""
        with self._cv:
            self._halting = True

    def stop(self) -> None:
        """Stops producing (the producer thread exits at its next element, see
        `join`), wakes every waiting read, and drops the buffer, the un-acknowledged
        replies and the cross-trainer cache's window (its memfd) now."""
        with self._cv:
            self._stopped = True
            self._buffer.clear()
            self._pending.clear()  # the producer's next append is dropped when it exits
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
