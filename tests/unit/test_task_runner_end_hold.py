"""`TaskRunner`'s final-reply hold (`get_elements_raw(hold_end=True)`): while a
consumer's final reply is unsettled, the task's other consumers get no end of
sequence, and what it gives back reaches them first. And a stopped runner is freed
by reference counts alone (no cycle through its cache, closure or replies)."""

from __future__ import annotations

import gc
import itertools
import threading
import weakref

import numpy as np

from dataservice.transfer.base import TaskRead
from dataservice.worker.cross_trainer_cache import CrossTrainerCache
from dataservice.worker.task_runner import TaskRunner


def _finished_runner(n: int) -> TaskRunner:
    runner = TaskRunner(1, lambda: iter(range(n)), "w")
    runner._thread.join(5)
    assert runner._end and len(runner._buffer) == n
    return runner


def test_other_consumers_wait_for_a_held_final_reply_then_get_what_it_gave_back():
    runner = _finished_runner(5)
    try:
        read = runner.get_elements_raw(10, 1 << 20, 1.0, hold_end=True)
        assert read == TaskRead([0, 1, 2, 3, 4], True, None, end_held=True)
        # Held: the buffer is empty and the pipeline ended, yet no end for the others.
        assert runner.get_elements_raw(10, 1 << 20, 0.2) == TaskRead([], False)
        got: list = []

        def other() -> None:
            got.append(runner.get_elements_raw(10, 1 << 20, 10.0))

        waiter = threading.Thread(target=other)
        waiter.start()
        runner.requeue([3, 4])  # the consumer took 0..2 and went away
        runner.release_end_hold()
        waiter.join(10)
        assert got == [TaskRead([3, 4], True)]
        assert runner.get_elements_raw(10, 1 << 20, 0.2) == TaskRead([], True)
    finally:
        runner.stop()


def test_a_final_reply_taken_whole_releases_the_end_at_once():
    runner = _finished_runner(3)
    try:
        assert runner.get_elements_raw(10, 1 << 20, 1.0, hold_end=True).end_held
        runner.release_end_hold()
        assert runner.get_elements_raw(10, 1 << 20, 0.2) == TaskRead([], True)
    finally:
        runner.stop()


def test_without_hold_end_the_end_is_not_held():
    runner = _finished_runner(3)
    try:
        assert runner.get_elements_raw(10, 1 << 20, 1.0) == TaskRead([0, 1, 2], True)
        assert runner.get_elements_raw(10, 1 << 20, 0.2) == TaskRead([], True)
    finally:
        runner.stop()


def test_a_stopped_runner_and_its_cache_are_freed_without_the_garbage_collector():
    gc.collect()
    gc.disable()
    try:
        runner = TaskRunner(1, lambda: (np.full(100, i, np.int64) for i in itertools.count()), "w")
        cache = CrossTrainerCache(runner, 1 << 20)
        runner.cross_trainer_cache = cache
        assert len(cache.get_elements("t", 4, 5.0).elements) > 0
        refs = [weakref.ref(runner), weakref.ref(cache), weakref.ref(runner.unacked)]
        runner.stop()
        assert runner.join(5)
        del runner, cache
        assert [r for r in refs if r() is not None] == []
    finally:
        gc.enable()


def test_a_stopped_runner_never_reports_an_end_of_sequence():
    # Its producer ends early (stopped), which sets the runner's end: a read racing a
    # worker's stop must not take that for the stream's end (its elements would be
    # lost without a word).
    runner = TaskRunner(1, lambda: (np.full(100, i, np.int64) for i in itertools.count()), "w")
    assert runner.get_elements_raw(1, 1 << 20, 5.0).elements
    runner.stop()
    assert runner.join(5)
    assert runner._end  # the producer ended
    assert runner.get_elements_raw(10, 1 << 20, 0.1) == TaskRead([], False)
    assert runner.get_round_element(0, 2, 0, 0.1) == TaskRead([], False)
