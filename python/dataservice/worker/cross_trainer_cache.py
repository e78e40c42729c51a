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

Both transfer protocols read through `get_elements`: the worker's gRPC
GetElements handler for a request naming a trainer id, and the shared-memory
transport for a connection whose HELLO named one (same-host trainers; see
`transfer/shm.py`). The window holds decoded elements in this process; a
shared-memory reader gets its own copy of each, written into its own ring, so
N same-host trainers cost one pipeline but N copies through N rings.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from dataservice.worker.task_runner import TaskRunner


class CrossTrainerCache:
    """A sliding window of one task's elements. Thread-safe."""

    def __init__(self, runner: TaskRunner, max_bytes: int) -> None:
        self._runner = runner
        self._max_bytes = max_bytes
        self._mu = threading.Lock()
        self._fill = threading.Lock()  # one thread at a time pulls from the pipeline
        # guarded by self._mu:
        self._window: collections.deque[tuple[Any, int]] = collections.deque()
        self._first_index = 0  # global index of self._window[0]
        self._window_bytes = 0
        self._cursors: dict[str, int] = {}
        self._end = False
        self._error: tuple[str, str] | None = None

    @property
    def window_bytes(self) -> int:
        """Bytes of the elements cached now."""
        with self._mu:
            return self._window_bytes

    def get_elements(
        self,
        trainer_id: str,
        max_elements: int,
        timeout_s: float,
        max_bytes: int | None = None,
    ) -> tuple[list[Any], bool, tuple[str, str] | None]:
        """Up to `max_elements` elements for `trainer_id`, from its cursor on,
        waiting up to `timeout_s` seconds for the pipeline when it is at the newest.
        `max_bytes` (None: no bound) stops a read before the element that would
        take it past that many payload bytes (one element is always read); the
        rest stay for the trainer's next read.

        Returns:
            (elements, end_of_sequence, error), as `TaskRunner.get_elements_raw`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self._mu:
                end_index = self._first_index + len(self._window)
                cursor = max(self._cursors.get(trainer_id, self._first_index), self._first_index)
                if cursor < end_index:
                    n = min(max_elements, end_index - cursor)
                    start = cursor - self._first_index
                    out = []
                    total = 0
                    for i in range(n):
                        element, nbytes = self._window[start + i]
                        if out and max_bytes is not None and total + nbytes > max_bytes:
                            break
                        out.append(element)
                        total += nbytes
                    n = len(out)
                    self._cursors[trainer_id] = cursor + n
                    return out, False, None
                if self._end:
                    return [], True, self._error
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return [], False, None
            self._extend(end_index, remaining)

    def _extend(self, seen_end_index: int, timeout_s: float) -> None:
        """Appends the pipeline's next elements to the window, evicting the
        oldest; does nothing if another trainer extended it past
        `seen_end_index` meanwhile (its new elements are still unread)."""
        if not self._fill.acquire(timeout=timeout_s):
            return
        try:
            with self._mu:
                if self._end or self._first_index + len(self._window) > seen_end_index:
                    return
            # At most a window's worth, so the trainer that asked (at the newest
            # element) finds every new element still cached.
            elements, end, error = self._runner.get_elements_raw(64, self._max_bytes, timeout_s)
            from dataservice.transfer.codec import element_nbytes

            with self._mu:
                for element in elements:
                    nbytes = element_nbytes(element)
                    self._window.append((element, nbytes))
                    self._window_bytes += nbytes
                while len(self._window) > 1 and self._window_bytes > self._max_bytes:
                    _, nbytes = self._window.popleft()
                    self._window_bytes -= nbytes
                    self._first_index += 1
                if end:
                    self._end, self._error = True, error
        finally:
            self._fill.release()
