"""`TaskRunner`'s producer batch (`_pending`): elements a fast pipeline made before
it blocked reach a waiting consumer (plain reads and coordinated rounds) without
waiting for the next element, within the buffer's element and byte bounds, in order,
and counted once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np

from dataservice.worker.task_runner import TaskRunner

PROMPT_S = 1.0


def _held_after(first: list, rest: list, gate: threading.Event, reached: threading.Event):
    """An iterator factory: yields `first`, then blocks until `gate` (at most 30 s)
    while computing the next element, then yields `rest`."""

    def make() -> Iterator:
        yield from first
        reached.set()
        gate.wait(30)
        yield from rest

    return make


def test_elements_made_before_a_blocked_pipeline_reach_a_waiting_read():
    gate, reached = threading.Event(), threading.Event()
    runner = TaskRunner(1, _held_after([0, 1, 2], [3, 4], gate, reached), "w")
    try:
        assert reached.wait(10)
        start = time.monotonic()
        read = runner.get_elements_raw(64, 1 << 20, 5.0)
        assert time.monotonic() - start < PROMPT_S
        assert read.elements == [0, 1, 2] and not read.end_of_sequence
        assert runner.buffered_bytes == 0
        gate.set()
        got: list = []
        deadline = time.monotonic() + 10
        while not (got and got[-1].end_of_sequence) and time.monotonic() < deadline:
            got.append(runner.get_elements_raw(64, 1 << 20, 1.0))
        assert [e for r in got for e in r.elements] == [3, 4]
        assert got[-1].end_of_sequence and runner.finished
        assert runner._produced == 5
    finally:
        gate.set()
        runner.stop()
        assert runner.join(5)


def test_a_read_takes_the_batch_within_the_buffer_bounds():
    gate, reached = threading.Event(), threading.Event()
    elements = [np.full(128, i, np.int64) for i in range(5)]  # 1 KiB each
    runner = TaskRunner(
        1,
        _held_after(elements, [], gate, reached),
        "w",
        buffer_elements=3,
        buffer_bytes=2 << 10,
        initial_buffer_bytes=2 << 10,
    )
    try:
        assert reached.wait(10)
        got = []
        for want in (1, 10, 10):
            read = runner.get_elements_raw(want, 1 << 20, 2.0)
            # The bytes bound (2 elements) holds; what did not fit stays in the batch.
            assert 1 <= len(read.elements) <= min(want, 2)
            assert len(runner._buffer) + len(read.elements) <= 2
            assert runner._buffered_bytes == 1024 * len(runner._buffer)
            got.extend(int(e[0]) for e in read.elements)
        while len(got) < 5:
            read = runner.get_elements_raw(10, 1 << 20, 2.0)
            assert read.elements, got
            got.extend(int(e[0]) for e in read.elements)
        assert got == [0, 1, 2, 3, 4]
        assert runner._produced == 5 and runner.buffered_bytes == 0
    finally:
        gate.set()
        runner.stop()
        assert runner.join(5)


def test_a_round_of_elements_made_before_a_blocked_pipeline_forms_promptly():
    gate, reached = threading.Event(), threading.Event()
    runner = TaskRunner(1, _held_after([10, 11], [12, 13], gate, reached), "w")
    runner.num_consumers = 2
    try:
        assert reached.wait(10)
        start = time.monotonic()
        first = runner.get_round_element(0, 2, 0, 5.0)
        second = runner.get_round_element(1, 2, 0, 5.0)
        assert time.monotonic() - start < PROMPT_S
        assert (first.elements, second.elements) == ([10], [11])
        # The next round needs an element the pipeline has not made: it waits for it.
        waiter: list = []
        thread = threading.Thread(
            target=lambda: waiter.append(runner.get_round_element(1, 2, 1, 10.0))
        )
        thread.start()
        gate.set()
        thread.join(10)
        assert waiter and waiter[0].elements == [13]
    finally:
        gate.set()
        runner.stop()
        assert runner.join(5)


def test_stop_drops_the_batch_of_a_blocked_pipeline():
    gate, reached = threading.Event(), threading.Event()
    runner = TaskRunner(1, _held_after([0, 1], [2], gate, reached), "w")
    assert reached.wait(10)
    assert len(runner._pending) + len(runner._buffer) == 2
    runner.stop()
    assert not runner._pending
    gate.set()
    assert runner.join(5)
    assert not runner._pending and not runner._buffer
    assert runner.get_elements_raw(10, 1 << 20, 0.1).elements == []
