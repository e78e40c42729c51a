"""Runs one task: iterates the task's pipeline on a producer thread into a
bounded buffer of elements, which consumers drain first come, first served
(tf.data service's FirstComeFirstServedTaskRunner).

The buffer holds raw elements (each transfer protocol encodes them its own
way: `get_elements` for gRPC, `get_elements_raw` for shared memory) and is
bounded by `buffer_elements` and `buffer_bytes` (payload bytes, see
`codec.element_nbytes`), so a slow consumer back-pressures the pipeline. A
pipeline error is delivered after the elements produced before it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from dataservice import errors
from dataservice.transfer import codec

log = logging.getLogger(__name__)

DEFAULT_BUFFER_ELEMENTS = 4096
DEFAULT_BUFFER_BYTES = 64 << 20


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
    ) -> None:
        self.task_id = task_id
        self._make_iterator = make_iterator
        self._worker_address = worker_address
        self._buffer_elements = buffer_elements
        self._buffer_bytes = buffer_bytes
        self._cv = threading.Condition()
        # guarded by self._cv:
        self._buffer: collections.deque[tuple[Any, int]] = collections.deque()
        self._buffered_bytes = 0
        self._produced = 0
        self._end = False
        self._error: tuple[str, str] | None = None
        self._stopped = False
        self._thread = threading.Thread(
            target=self._produce, name=f"ds-task-{task_id}", daemon=True
        )
        self._thread.start()

    @property
    def finished(self) -> bool:
        """The pipeline ended and every element was handed out."""
        with self._cv:
            return self._end and not self._buffer

    def _produce(self) -> None:
        signature: Any = None
        index = 0
        try:
            iterator = self._make_iterator()
            for element in iterator:
                sig = codec.signature(element)
                if signature is None:
                    signature = sig
                elif sig != signature:
                    raise errors.InvalidArgumentError(
                        f"element {index} of task {self.task_id} has structure "
                        f"{codec.describe(sig)}, but the stream's elements so far have "
                        f"{codec.describe(signature)}: every element of a dataset must have "
                        "the same structure and dtypes"
                    )
                nbytes = codec.element_nbytes(element)
                index += 1
                with self._cv:
                    while (
                        not self._stopped
                        and self._buffer
                        and (
                            len(self._buffer) >= self._buffer_elements
                            or self._buffered_bytes + nbytes > self._buffer_bytes
                        )
                    ):
                        self._cv.wait(0.5)
                    if self._stopped:
                        break
                    self._buffer.append((element, nbytes))
                    self._buffered_bytes += nbytes
                    self._produced += 1
                    self._cv.notify_all()
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        except BaseException as err:  # deliver any pipeline failure to the consumer
            if not isinstance(err, errors.DataServiceError):
                log.debug("task %d failed:\n%s", self.task_id, traceback.format_exc())
            with self._cv:
                self._error = (type(err).__name__, str(err))
        finally:
            with self._cv:
                self._end = True
                self._cv.notify_all()

    def get_elements_raw(
        self, max_elements: int, max_bytes: int, timeout_s: float
    ) -> tuple[list[Any], bool, tuple[str, str] | None]:
        """Takes up to `max_elements` elements (at most ~`max_bytes` payload
        bytes, but always one), waiting up to `timeout_s` seconds for the first.

        Returns:
            (elements, end_of_sequence, error): `error` is (type name, message)
            of a pipeline failure, reported once the elements before it are taken.
        """
        deadline = time.monotonic() + timeout_s
        out: list[Any] = []
        with self._cv:
            while not self._buffer and not self._end and not self._stopped:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return out, False, None
                self._cv.wait(remaining)
            total = 0
            while self._buffer and len(out) < max_elements:
                nbytes = self._buffer[0][1]
                if out and total + nbytes > max_bytes:
                    break
                element, _ = self._buffer.popleft()
                self._buffered_bytes -= nbytes
                total += nbytes
                out.append(element)
            self._cv.notify_all()
            if self._buffer or not self._end:
                return out, False, None
            if self._error is not None:
                if out:
                    return out, False, None
                return out, True, self._error
            return out, True, None

    def get_elements(
        self, max_elements: int, max_bytes: int, timeout_s: float
    ) -> tuple[list[bytes], bool, tuple[str, str] | None]:
        """As `get_elements_raw`, with each element encoded for gRPC (`codec.encode`)."""
        elements, end, error = self.get_elements_raw(max_elements, max_bytes, timeout_s)
        return [codec.encode(e) for e in elements], end, error

    def stop(self) -> None:
        """Stops producing (the producer thread exits at its next element)."""
        with self._cv:
            self._stopped = True
            self._buffer.clear()
            self._buffered_bytes = 0
            self._cv.notify_all()
