"""`CrossTrainerCache.get_elements` directly: a read's byte bound leaves the rest
of the window for the trainer's next read."""

from __future__ import annotations

import itertools
import os

import numpy as np

from dataservice.transfer.base import TaskRead
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
            read = cache.get_elements("t", 4, 5.0, max_bytes=2 * size)
            elements, end, error = read.elements, read.end_of_sequence, read.error
            assert (end, error) == (False, None)
            assert 1 <= len(elements) <= 2
            got.extend(int(e[0]) for e in elements)
        # One element is always read, however small the bound.
        (one,) = cache.get_elements("t", 4, 5.0, max_bytes=1).elements
        # Another trainer, unbounded, reads from the oldest element on.
        other = cache.get_elements("u", 4, 5.0).elements
        assert got == list(range(len(got)))
        assert int(one[0]) == len(got)
        assert [int(e[0]) for e in other] == [0, 1, 2, 3]
    finally:
        runner.stop()


def _float_runner():
    return TaskRunner(
        1, lambda: (np.full(16384, i, np.float32) for i in itertools.count()), "w"
    )  # 64 KiB elements


def test_the_window_is_written_once_and_grows_to_its_bound():
    runner = _float_runner()
    try:
        cache = CrossTrainerCache(runner, 4 << 20)
        assert cache.shared
        got = {t: [] for t in "abc"}
        for _ in range(30):
            for t in got:
                got[t].extend(int(e[0]) for e in cache.get_elements(t, 4, 5.0).elements)
        assert got["a"] == got["b"] == got["c"] == list(range(len(got["a"])))
        stats = cache.stats()
        assert stats["frames_written"] == stats["first_index"] + stats["elements"]
        assert stats["capacity_bytes"] == 4 << 20  # grew from 1 MiB, no further
        assert stats["window_bytes"] <= 4 << 20
    finally:
        runner.stop()


def test_a_grant_in_the_way_moves_the_window_to_a_fresh_segment():
    from dataservice import _core

    runner = _float_runner()
    try:
        cache = CrossTrainerCache(runner, 256 << 10)
        slot = cache.attach()
        # A trainer is sent element 0 and never says it is done with it.
        got = cache.get_window("t", slot, -1, set(), 1, 5.0)
        read, end, error = got.frames, got.end_of_sequence, got.error
        assert (read.count, read.first_index, end, error) == (1, 0, False, None)
        reader = _core.ShmWindowReader(read.fd, slot, read.generation, nonce=read.nonce)
        os.close(read.fd)
        for spec_id, body in read.specs.items():
            reader.add_spec(spec_id, body)
        others = []
        while len(others) < 40:  # another trainer reads on, well past the segment
            others.extend(int(e[0]) for e in cache.get_elements("u", 8, 5.0).elements)
        assert others == list(range(40))
        assert cache.stats()["abandons"] >= 1
        # The granted frame was never overwritten: the old segment was left to it.
        (element,), _ = reader.read(read.pos, 1, 0)
        assert np.all(element == 0)
        reader.close()
        cache.detach(slot)
    finally:
        runner.stop()


def _int_runner() -> TaskRunner:
    return TaskRunner(1, lambda: (np.full(100, i, np.int64) for i in itertools.count()), "w")


def _read(cache: CrossTrainerCache, trainer_id: str, n: int) -> tuple[int, list[int]]:
    first, read = cache.read_elements(trainer_id, n, 5.0)
    assert (read.end_of_sequence, read.error) == (False, None)
    return first, [int(e[0]) for e in read.elements]


def test_given_back_elements_are_the_trainers_next_read_in_order():
    runner = _int_runner()
    try:
        cache = CrossTrainerCache(runner, 1 << 20)
        assert _read(cache, "t", 5) == (0, [0, 1, 2, 3, 4])
        cache.give_back("t", 2, 3)  # its connection went away without 2, 3, 4
        reads = [_read(cache, "t", 2) for _ in range(4)]
        # The given-back range first (a read does not run past its end), then on.
        assert reads == [(2, [2, 3]), (4, [4]), (5, [5, 6]), (7, [7, 8])]
        assert _read(cache, "u", 3) == (0, [0, 1, 2])  # other trainers: unaffected
        assert cache.stats()["given_back_elements"] == 3
    finally:
        runner.stop()


def test_given_back_elements_evicted_meanwhile_are_skipped_and_counted():
    runner = _int_runner()
    try:
        size = element_nbytes(np.full(100, 0, np.int64))
        cache = CrossTrainerCache(runner, 8 * size)  # a window of 8 elements
        slow: list[int] = []
        while len(slow) < 4:
            slow += _read(cache, "t", 4 - len(slow))[1]
        assert slow == [0, 1, 2, 3]
        cache.give_back("t", 0, 4)
        fast: list[int] = []
        while len(fast) < 30:  # another trainer moves the window past 0..3
            fast += _read(cache, "u", 4)[1]
        first, got = _read(cache, "t", 4)
        assert first >= 4 and got[0] == first
        stats = cache.stats()
        assert stats["evicted_unacked_elements"] == 4
        assert stats["first_index"] > 3
    finally:
        runner.stop()


def test_close_drops_the_window_and_its_memfd_at_once():
    runner = _int_runner()
    try:
        cache = CrossTrainerCache(runner, 1 << 20)
        runner.cross_trainer_cache = cache
        assert _read(cache, "t", 3)[1] == [0, 1, 2]
        fd = cache.writer.fileno()
        inode = os.fstat(fd).st_ino
        assert "dataservice-cache-window" in os.readlink(f"/proc/self/fd/{fd}")
        runner.stop()  # closes its cache
        assert cache.writer is None and not cache.shared
        try:
            still_open = os.fstat(fd).st_ino == inode
        except OSError:
            still_open = False
        assert not still_open
        assert cache.read_elements("t", 3, 0.1) == (0, TaskRead([]))
    finally:
        runner.stop()
