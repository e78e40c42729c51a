"""`CrossTrainerCache.get_elements` directly: a read's byte bound leaves the rest
of the window for the trainer's next read."""

from __future__ import annotations

import itertools

import numpy as np

from dataservice.transfer.codec import element_nbytes
from dataservice.worker.cross_trainer_cache import CrossTrainerCache
from dataservice.worker.task_runner import TaskRunner


def test_max_bytes_bounds_a_read_and_keeps_the_cursor_on_the_rest():
    runner = TaskRunner(1, lambda: (np.full(100, i, np.int64) for i in itertools.count()), "w")
    try:
        cache = CrossTrainerCache(runner, 1 << 20)
        size = element_nbytes(np.full(100, 0, np.int64))
        got = []
        while len(got) < 10:
            elements, end, error = cache.get_elements("t", 4, 5.0, max_bytes=2 * size)
            assert (end, error) == (False, None)
            assert 1 <= len(elements) <= 2
            got.extend(int(e[0]) for e in elements)
        # One element is always read, however small the bound.
        (one,), _, _ = cache.get_elements("t", 4, 5.0, max_bytes=1)
        # Another trainer, unbounded, reads from the oldest element on.
        other, _, _ = cache.get_elements("u", 4, 5.0)
        assert got == list(range(len(got)))
        assert int(one[0]) == len(got)
        assert [int(e[0]) for e in other] == [0, 1, 2, 3]
    finally:
        runner.stop()
