"""The cross-trainer cache: a byte-bounded sliding window over one task's
elements, shared by trainers with different `trainer_id`s (tf.data service's
CrossTrainerCache).

Trainers read the same sequence of elements at their own pace. Each trainer
has a cursor (the global index of the next element it reads); a trainer not
seen before, or one that lagged behind the window, starts at the oldest
element still cached. Reads under one trainer id share its cursor, so they
split the elements between them. When a trainer reaches the newest element,
the cache takes the next one from the task's pipeline; the oldest elements are
evicted while the window holds more than `max_bytes` (the newest element is
always kept, so an element larger than the cache still passes through).

The window lives in one shared-memory segment (`_core.ShmWindowWriter`, see
rust/shm/window.rs): each element is written once, as an encoded frame, into
a sealed memfd. Same-host trainers (`transfer/shm_server.py`, a HELLO naming a
trainer id) map that memfd and read the frames the worker names in its replies
(`get_window`): large numpy leaves become views that the trainer's hold slot
keeps from being overwritten, so N trainers on one host cost one pipeline and
about one copy of the window. gRPC reads (`get_elements`: trainers on other
hosts) decode the frames on demand, copying.

The segment starts at 1 MiB and doubles (into a fresh memfd) while the window
needs more room and is below the byte bound rounded up to a power of two. A
trainer's holds never stall the others: when they are what keeps the writer
from space for `HOLD_GRACE_S`, the cache abandons the segment to its holders
(their mappings keep it alive) and moves the window into a fresh one, whose fd
the trainers get with their next reply. If no segment can be made (memory),
the window holds decoded elements in this process instead and same-host
trainers get copies through private rings, as before.

A read is the trainer's only once it acknowledges it: a same-host trainer's
connection that ends before acknowledging its last read (the next request, or
DONE for a window read; for a ring, what it took out of it) gives the rest back
to its trainer id (`give_back`), and that trainer's next read, on any
connection, starts with them (unless they were evicted meanwhile: a trainer
lagging behind the window skips, as any lagging trainer does). gRPC reads are
kept by the task's `UnackedReplies` and sent again instead.

The cache holds its task runner weakly (the runner owns the cache), and
`close()` (called by `TaskRunner.stop`) drops the window's segment at once, so a
stopped worker frees the memfd when `stop()` returns, not at the next garbage
collection.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from dataservice import errors
from dataservice.transfer.base import TaskRead
from dataservice.transfer.shm import TrainerWindow, WindowRead, WindowReply
from dataservice.transfer.shm_budget import ring_budget_bytes
from dataservice.worker.task_runner import TaskRunner

log = logging.getLogger(__name__)

HOLD_GRACE_S = 0.1  # how long the writer waits on trainers' holds before abandoning
HOLD_SLOTS = 64  # trainer connections one window serves (rust/shm/window.rs)
_MIN_SEGMENT_BYTES = 64 << 10
_FIRST_SEGMENT_BYTES = 1 << 20
_MAX_SEGMENT_BYTES = 4 << 30


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def segment_bound(max_bytes: int) -> int:
    """The largest segment for a window of `max_bytes`: rounded up to a power of two,
    within [64 KiB, 4 GiB] and a quarter of the memory available now."""
    bound = min(_pow2_ceil(max(max_bytes, 1)), _MAX_SEGMENT_BYTES)
    budget = ring_budget_bytes()
    while bound > _MIN_SEGMENT_BYTES and bound > budget:
        bound //= 2
    return max(bound, _MIN_SEGMENT_BYTES)


class CrossTrainerCache:
    """A sliding window of one task's elements. Thread-safe."""

    def __init__(self, runner: TaskRunner, max_bytes: int) -> None:
        # Weak: the runner owns the cache (`runner.cross_trainer_cache`); a strong
        # reference back would keep both, and the window's memfd, alive in a cycle.
        self._runner = weakref.ref(runner)
        self._max_bytes = max_bytes
        self._mu = threading.Lock()
        self._fill = threading.Lock()  # one thread at a time pulls from the pipeline
        self._segment_bound = segment_bound(max_bytes)
        self.writer: Any = None
        try:
            from dataservice import _core

            self.writer = _core.ShmWindowWriter(min(_FIRST_SEGMENT_BYTES, self._segment_bound))
        except Exception as err:  # no shared memory: decoded elements in this process
            log.warning("cross-trainer cache keeps its window in process memory: %s", err)
        # guarded by self._mu:
        # (decoded element, or None when it is a frame of the segment; payload bytes)
        self._window: collections.deque[tuple[Any, int]] = collections.deque()
        self._first_index = 0  # global index of self._window[0]
        self._window_bytes = 0
        self._cursors: dict[str, int] = {}  # next element not yet handed to the trainer
        # Elements handed to a trainer whose connection went away before acknowledging
        # them: [start, stop) ranges of global indices, oldest first, read again first.
        self._returned: dict[str, list[list[int]]] = {}
        self.given_back_elements = 0
        self.evicted_unacked_elements = 0
        self._closed = False
        self._free_slots = list(range(HOLD_SLOTS - 1, -1, -1))
        self._end = False
        self._error: errors.RemoteErrorInfo | None = None
        self.abandons = 0

    @property
    def window_bytes(self) -> int:
        """Bytes of the elements cached now."""
        with self._mu:
            return self._window_bytes

    def stats(self) -> dict[str, Any]:
        """The window's counters (`_core.ShmWindowWriter.stats`, plus `abandons`,
        `elements` cached and `window_bytes`)."""
        with self._mu:
            out = dict(self.writer.stats()) if self.writer is not None else {}
            out.update(
                abandons=self.abandons,
                given_back_elements=self.given_back_elements,
                evicted_unacked_elements=self.evicted_unacked_elements,
                elements=len(self._window),
                window_bytes=self._window_bytes,
                first_index=self._first_index,
                attached_slots=sorted(set(range(HOLD_SLOTS)) - set(self._free_slots)),
            )
            return out

    @property
    def closed(self) -> bool:
        """`close()` was called (the task stopped)."""
        return self._closed

    @property
    def shared(self) -> bool:
        """True if the window lives in a shared-memory segment trainers can map."""
        return self.writer is not None

    # ------------------------------------------------------------ trainers
    def attach(self) -> int | None:
        """A hold slot for a new same-host trainer connection (None: all taken)."""
        with self._mu:
            return self._free_slots.pop() if self._free_slots else None

    def detach(self, slot: int) -> None:
        """The trainer connection holding `slot` is gone: its grant and holds go."""
        with self._mu:
            if self.writer is not None:
                self.writer.release_slot(slot)
            self._free_slots.append(slot)

    def ungrant(self, slot: int) -> None:
        """Lifts the grant of `slot`'s last reply (its trainer stored its holds)."""
        writer = self.writer
        if writer is not None:  # None: closed
            writer.ungrant(slot)

    def give_back(self, trainer_id: str, first_index: int, count: int) -> None:
        """Elements [first_index, first_index + count) were handed to `trainer_id`, but
        its connection went away before it acknowledged them: its next read (on any
        connection) starts with them, in order, before anything newer."""
        if count <= 0:
            return
        with self._mu:
            if self._closed:
                return
            ranges = self._returned.setdefault(trainer_id, [])
            ranges.append([first_index, first_index + count])
            ranges.sort()
            self.given_back_elements += count
        log.info(
            "cross-trainer cache: trainer %s went away without acknowledging elements "
            "[%d, %d); they are its next read's",
            trainer_id,
            first_index,
            first_index + count,
        )

    def close(self) -> None:
        """The task stopped: drops the window and its segment (the memfd closes as soon
        as no read is using the writer any more: at once, after a worker's `stop()`,
        which joins its connections first). Reads return nothing from now on."""
        with self._mu:
            self._closed = True
            self._end = True
            self._window.clear()
            self._window_bytes = 0
            self._cursors.clear()
            self._returned.clear()
            writer, self.writer = self.writer, None
        del writer  # the last reference, unless a read is still using it

    def trainer_window(self, trainer_id: str) -> TrainerWindow | None:
        """The shared window as trainer `trainer_id` reads it (None: the window is in
        process memory, see `shared`)."""
        return _TrainerWindow(self, trainer_id) if self.shared else None

    def get_elements(
        self,
        trainer_id: str,
        max_elements: int,
        timeout_s: float,
        max_bytes: int | None = None,
    ) -> TaskRead:
        """Up to `max_elements` elements for `trainer_id`, from its cursor on,
        waiting up to `timeout_s` seconds for the pipeline when it is at the newest.
        `max_bytes` (None: no bound) stops a read before the element that would
        take it past that many payload bytes (one element is always read); the
        rest stay for the trainer's next read. Elements are decoded copies.

        Returns:
            The elements read, as `TaskRunner.get_elements_raw`'s.
        """
        return self.read_elements(trainer_id, max_elements, timeout_s, max_bytes)[1]

    def read_elements(
        self,
        trainer_id: str,
        max_elements: int,
        timeout_s: float,
        max_bytes: int | None = None,
    ) -> tuple[int, TaskRead]:
        """As `get_elements`, with the global index of the first element read
        (what `give_back` takes should the trainer not get them)."""

        def take(start: int, n: int, index: int) -> list[Any]:
            if self.writer is None:
                return [self._window[start + i][0] for i in range(n)]
            return list(self.writer.decode(start, n))

        return self._read(trainer_id, max_elements, timeout_s, max_bytes, take)

    def segment(self) -> tuple[int, int, bytes]:
        """(generation, a new fd, nonce) of the current segment; the caller closes
        the fd (a duplicate: the cache may replace its segment at any time).

        Raises:
            CancelledError: The cache was closed (its task stopped).
        """
        with self._mu:
            if self.writer is None:
                raise errors.CancelledError("the cross-trainer cache's task stopped")
            generation, fd, nonce = self.writer.segment()
            return generation, os.dup(fd), nonce

    def get_window(
        self,
        trainer_id: str,
        slot: int,
        known_generation: int,
        known_specs: set[int],
        max_elements: int,
        timeout_s: float,
        max_bytes: int | None = None,
    ) -> WindowReply:
        """As `get_elements`, for a same-host trainer in hold slot `slot`: names the
        frames instead of decoding them, and grants the slot those frames until the
        trainer says it is done (`writer.ungrant(slot)`) or hangs up (`detach`).
        The read carries the segment (a new fd the caller closes) when it is not
        `known_generation`, and the encoded specs not in `known_specs`.

        Returns:
            The frames to read (None if none was ready within `timeout_s`).
        """

        def take(start: int, n: int, index: int) -> list[WindowRead]:
            generation, pos, spec_ids, reclaim_below = self.writer.span(start, n)
            self.writer.grant(slot, pos)
            read = WindowRead(generation, pos, n, index, reclaim_below)
            read.specs = {i: self.writer.spec_bytes(i) for i in spec_ids if i not in known_specs}
            if generation != known_generation:
                _, fd, read.nonce = self.writer.segment()
                read.fd = os.dup(fd)
            return [read]

        _, got = self._read(trainer_id, max_elements, timeout_s, max_bytes, take)
        frames = got.elements[0] if got.elements else None
        return WindowReply(frames, got.end_of_sequence, got.error)

    def _read(
        self,
        trainer_id: str,
        max_elements: int,
        timeout_s: float,
        max_bytes: int | None,
        take: Callable[[int, int, int], list[Any]],
    ) -> tuple[int, TaskRead]:
        """Moves `trainer_id`'s cursor past up to `max_elements` cached elements (and
        `max_bytes`), extending the window from the pipeline for up to `timeout_s`
        seconds when the cursor is at the newest; elements given back to the trainer
        (`give_back`) come first. `take(start, n, index)` makes what the read returns
        as its elements from the `n` cached elements at window position `start`
        (global index `index`), under the lock. Returns (the first element's global
        index, the read); a closed cache reads nothing."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._mu:
                if self._closed:
                    return 0, TaskRead([])
                end_index = self._first_index + len(self._window)
                returned = self._returned_range_locked(trainer_id)
                if returned is not None:
                    cursor, stop = returned
                else:
                    cursor = max(
                        self._cursors.get(trainer_id, self._first_index), self._first_index
                    )
                    stop = end_index
                if cursor < stop:
                    start = cursor - self._first_index
                    n = 0
                    total = 0
                    for i in range(min(max_elements, stop - cursor)):
                        nbytes = self._window[start + i][1]
                        if n and max_bytes is not None and total + nbytes > max_bytes:
                            break
                        n += 1
                        total += nbytes
                    result = take(start, n, cursor)
                    if returned is not None:
                        ranges = self._returned[trainer_id]
                        ranges[0][0] = cursor + n
                        if ranges[0][0] >= ranges[0][1]:
                            ranges.pop(0)
                        if not ranges:
                            del self._returned[trainer_id]
                    else:
                        self._cursors[trainer_id] = cursor + n
                    return cursor, TaskRead(result)
                if self._end:
                    return cursor, TaskRead([], True, self._error)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return cursor, TaskRead([])
            self._extend(end_index, remaining)

    def _returned_range_locked(self, trainer_id: str) -> tuple[int, int] | None:
        """The first given-back range of `trainer_id` still (partly) in the window,
        clipped to it; the evicted parts are dropped and counted."""
        ranges = self._returned.get(trainer_id)
        while ranges:
            start, stop = ranges[0]
            if start < self._first_index:
                lost = min(stop, self._first_index) - start
                self.evicted_unacked_elements += lost
                log.warning(
                    "cross-trainer cache: %d elements trainer %s did not acknowledge were "
                    "evicted before it came back for them (it lags behind the window)",
                    lost,
                    trainer_id,
                )
                start = ranges[0][0] = min(stop, self._first_index)
            if start < stop:
                return start, stop
            ranges.pop(0)
        self._returned.pop(trainer_id, None)
        return None

    # ------------------------------------------------------------ filling
    def _extend(self, seen_end_index: int, timeout_s: float) -> None:
        """Appends the pipeline's next elements to the window, evicting the
        oldest; does nothing if another trainer extended it past
        `seen_end_index` meanwhile (its new elements are still unread)."""
        if not self._fill.acquire(timeout=timeout_s):
            return
        try:
            runner = self._runner()
            with self._mu:
                if runner is None or self._closed:
                    return
                if self._end or self._first_index + len(self._window) > seen_end_index:
                    return
            # At most a quarter of the window, so the trainer that asked (at the newest
            # element) finds every new element still cached, and one fill does not
            # sweep over the views trainers hold of what they read last.
            read = runner.get_elements_raw(64, max(1, self._max_bytes // 4), timeout_s)
            from dataservice.transfer.codec import element_nbytes

            for element in read.elements:
                if not self._append(element, element_nbytes(element)):
                    return
            if read.end_of_sequence:
                with self._mu:
                    self._end, self._error = True, read.error
        finally:
            self._fill.release()

    def _drop_oldest_locked(self, n: int) -> None:
        for _ in range(n):
            _, nbytes = self._window.popleft()
            self._window_bytes -= nbytes
            self._first_index += 1

    def _append(self, element: Any, nbytes: int) -> bool:
        """Adds one element as the newest; False if it cannot be cached (the window
        then ends with that error)."""
        grace_deadline: float | None = None
        while True:
            with self._mu:
                if self._closed:
                    return False
                # Evict by bytes first (the new element is always kept).
                n = 0
                total = self._window_bytes
                while n < len(self._window) and total + nbytes > self._max_bytes:
                    total -= self._window[n][1]
                    n += 1
                if n:
                    self._drop_oldest_locked(n)
                    if self.writer is not None:
                        self.writer.evict(n)
                if self.writer is None:
                    self._window.append((element, nbytes))
                    self._window_bytes += nbytes
                    return True
                index = self._first_index + len(self._window)
                try:
                    evicted, size = self.writer.append(element, index, self._segment_bound)
                except Exception as err:  # an element the frame codec cannot carry
                    self._end, self._error = True, errors.capture(err)
                    return False
                self._drop_oldest_locked(evicted)
                if size is not None:
                    self._window.append((None, nbytes))
                    self._window_bytes += nbytes
                    return True
                # A trainer's hold or grant is in the way.
                now = time.monotonic()
                if grace_deadline is None:
                    grace_deadline = now + HOLD_GRACE_S
                elif now >= grace_deadline:
                    try:
                        self._drop_oldest_locked(self.writer.abandon())
                    except errors.DataServiceError as err:
                        self._end, self._error = True, errors.capture(err)
                        return False
                    self.abandons += 1
                    grace_deadline = None
                    continue
            time.sleep(0.001)


class _TrainerWindow(TrainerWindow):
    """`CrossTrainerCache`'s shared window as one trainer reads it (`shm.TrainerWindow`,
    served by transfer/shm_server.py)."""

    def __init__(self, cache: CrossTrainerCache, trainer_id: str) -> None:
        self._cache = cache
        self._trainer_id = trainer_id

    def attach(self) -> int | None:
        return self._cache.attach()

    def detach(self, slot: int) -> None:
        self._cache.detach(slot)

    def segment(self) -> tuple[int, int, bytes]:
        return self._cache.segment()

    def ungrant(self, slot: int) -> None:
        self._cache.ungrant(slot)

    def give_back(self, first_index: int, count: int) -> None:
        self._cache.give_back(self._trainer_id, first_index, count)

    @property
    def closed(self) -> bool:
        return self._cache.closed

    def read(
        self,
        slot: int,
        known_generation: int,
        known_specs: set[int],
        max_elements: int,
        timeout_s: float,
        max_bytes: int,
    ) -> WindowReply:
        return self._cache.get_window(
            self._trainer_id,
            slot,
            known_generation,
            known_specs,
            max_elements,
            timeout_s,
            max_bytes=max_bytes,
        )
