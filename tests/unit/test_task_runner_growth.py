"""A task's buffer bound grows with demand (worker/task_runner.py): an iteration
nobody reads holds a few elements, one read to the end reaches the full bound."""

from __future__ import annotations

import time

import numpy as np

from dataservice.worker.task_runner import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_BUFFER_ELEMENTS,
    INITIAL_BUFFER_BYTES,
    INITIAL_ELEMENT_BOUND,
    TaskRunner,
)

ELEMENT_BYTES = 256 << 10


def _elements(n: int | None, nbytes: int = ELEMENT_BYTES):
    i = 0
    while n is None or i < n:
        yield np.full(nbytes, i % 251, dtype=np.uint8)
        i += 1


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)


def test_unread_task_holds_initial_bound() -> None:
    runner = TaskRunner(1, lambda: _elements(None), "w")
    try:
        _wait_for(
            lambda: runner.buffered_bytes >= INITIAL_BUFFER_BYTES, 10, "the first buffer-full"
        )
        time.sleep(0.3)  # the producer had time to overfill, if it would
        assert runner.buffered_bytes == INITIAL_BUFFER_BYTES  # 8 elements of 256 KiB
        assert runner.buffer_bound_bytes == INITIAL_BUFFER_BYTES
        # Two elements read (a dropped iterator's first reads) do not grow it.
        read = runner.get_elements_raw(2, 16 << 20, 5)
        out, end, error = read.elements, read.end_of_sequence, read.error
        assert len(out) == 2 and not end and error is None
        assert runner.buffer_bound_bytes == INITIAL_BUFFER_BYTES
    finally:
        runner.stop()


def test_bound_doubles_as_consumer_drains_and_every_element_arrives() -> None:
    n = 400  # 100 MiB
    runner = TaskRunner(2, lambda: _elements(n), "w")
    seen: list[int] = []
    bounds = []
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline
            read = runner.get_elements_raw(64, 16 << 20, 5)
            out, end, error = read.elements, read.end_of_sequence, read.error
            assert error is None
            seen.extend(int(e[0]) for e in out)
            bounds.append(runner.buffer_bound_bytes)
            if end:
                break
    finally:
        runner.stop()
    assert seen == [i % 251 for i in range(n)]
    assert bounds[-1] == DEFAULT_BUFFER_BYTES
    # It only doubled (2, 4, ..., 64 MiB), never shrank; a read may take a whole
    # buffer-full, so the first bound recorded may already be 4 MiB.
    assert bounds == sorted(bounds)
    assert set(bounds) <= {INITIAL_BUFFER_BYTES << k for k in range(6)}


def test_large_elements_start_with_room_for_a_few() -> None:
    runner = TaskRunner(3, lambda: _elements(None, 4 << 20), "w")
    try:
        _wait_for(lambda: runner.buffered_bytes >= 16 << 20, 10, "4 elements of 4 MiB")
        assert runner.buffer_bound_bytes == 16 << 20
    finally:
        runner.stop()


def test_fixed_bound_when_initial_is_the_maximum() -> None:
    runner = TaskRunner(
        4, lambda: _elements(None), "w", buffer_bytes=8 << 20, initial_buffer_bytes=8 << 20
    )
    try:
        _wait_for(lambda: runner.buffered_bytes >= 8 << 20, 10, "8 MiB buffered")
        for _ in range(5):
            runner.get_elements_raw(64, 16 << 20, 5)
        assert runner.buffer_bound_bytes == 8 << 20
    finally:
        runner.stop()


def test_element_bound_starts_small_and_doubles_with_what_consumers_take() -> None:
    # Scalars: the bytes bound never binds, the element bound does.
    runner = TaskRunner(3, lambda: iter(range(1 << 30)), "w")
    try:
        _wait_for(
            lambda: runner.buffered_elements >= INITIAL_ELEMENT_BOUND, 10, "the first buffer-full"
        )
        time.sleep(0.3)  # the producer had time to overfill, if it would
        assert runner.buffered_elements == INITIAL_ELEMENT_BOUND
        taken: list[int] = []
        bound = INITIAL_ELEMENT_BOUND
        while bound < DEFAULT_BUFFER_ELEMENTS:
            read = runner.get_elements_raw(bound, 16 << 20, 5)
            taken += read.elements
            assert len(read.elements) == bound  # a bound's worth was buffered
            bound *= 2
            _wait_for(lambda b=bound: runner.buffered_elements >= b, 10, f"a buffer of {bound}")
            time.sleep(0.05)
            assert runner.buffered_elements == bound
        assert taken == list(range(len(taken)))  # in order, none lost
    finally:
        runner.stop()


def test_a_fixed_bytes_bound_keeps_every_element_slot() -> None:
    runner = TaskRunner(
        4, lambda: iter(range(1 << 30)), "w", buffer_bytes=1 << 20, initial_buffer_bytes=1 << 20
    )
    try:
        _wait_for(lambda: runner.buffered_elements >= DEFAULT_BUFFER_ELEMENTS, 10, "a full buffer")
        time.sleep(0.1)
        assert runner.buffered_elements == DEFAULT_BUFFER_ELEMENTS
    finally:
        runner.stop()
