"""`worker.sources.choose_source`: the one decision of which source serves a read,
shared by the worker's gRPC servicer and (through `TransferHost.element_source`) the
shared-memory server. Runners are real; nothing listens on a socket."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dataservice import errors
from dataservice.transfer.base import ReadRequest, TaskRead
from dataservice.worker.cross_trainer_cache import CrossTrainerCache
from dataservice.worker.sources import BufferSource, CacheSource, RoundSource, choose_source
from dataservice.worker.task_runner import TaskRunner


def _runner(task_id: int, n: int | None = None) -> TaskRunner:
    numbers = itertools.count() if n is None else iter(range(n))
    return TaskRunner(task_id, lambda: (np.int64(i) for i in numbers), "w:1")


def _read_all(source, limit: int) -> list[int]:
    out: list[int] = []
    while len(out) < limit:
        read = source.read(4, 1 << 20, 5.0)
        assert isinstance(read, TaskRead) and read.error is None
        out.extend(int(e) for e in read.elements)
        if read.end_of_sequence:
            break
    return out


def test_a_plain_read_takes_from_the_tasks_buffer_and_gives_back_to_it():
    runner = _runner(4000, 6)
    try:
        source = choose_source(runner, ReadRequest(4000))
        assert isinstance(source, BufferSource) and source.gives_back
        assert source.task_id == 4000 and source.window() is None
        first = source.read(2, 1 << 20, 5.0)
        assert [int(e) for e in first.elements] == [0, 1] and not first.end_of_sequence
        source.give_back(first.elements)  # never delivered: the next read gets them
        other = choose_source(runner, ReadRequest(4000))  # another consumer's read
        assert _read_all(other, 10) == [0, 1, 2, 3, 4, 5]
    finally:
        runner.stop()


def test_a_trainer_read_takes_from_the_cache_at_its_own_cursor():
    runner = _runner(4001)
    try:
        runner.cross_trainer_cache = CrossTrainerCache(runner, 1 << 20)
        a = choose_source(runner, ReadRequest(4001, trainer_id="a"))
        b = choose_source(runner, ReadRequest(4001, trainer_id="b"))
        assert isinstance(a, CacheSource) and not a.gives_back
        assert _read_all(a, 8)[:8] == list(range(8))
        assert _read_all(b, 4)[:4] == [0, 1, 2, 3]  # b starts at the oldest cached element
        window = a.window()
        assert (window is not None) == runner.cross_trainer_cache.shared
    finally:
        runner.stop()


def test_a_coordinated_read_takes_its_consumers_element_of_the_round():
    runner = _runner(4002)
    runner.num_consumers = 2
    try:
        one = choose_source(runner, ReadRequest(4002, consumer_index=1, round_index=0))
        zero = choose_source(runner, ReadRequest(4002, consumer_index=0, round_index=0))
        assert isinstance(one, RoundSource) and not one.gives_back
        assert [int(e) for e in one.read(8, 1 << 20, 5.0).elements] == [1]
        assert [int(e) for e in zero.read(8, 1 << 20, 5.0).elements] == [0]
    finally:
        runner.stop()


@pytest.mark.parametrize(
    ("num_consumers", "request_", "match"),
    [
        (0, ReadRequest(4003, trainer_id="t"), "does not use a cross-trainer cache"),
        (2, ReadRequest(4003), "is a coordinated read"),
        (0, ReadRequest(4003, consumer_index=0, round_index=0), "is not a coordinated read"),
        (2, ReadRequest(4003, consumer_index=2, round_index=0), "invalid consumer_index=2"),
    ],
)
def test_a_read_that_does_not_fit_the_task_is_refused(num_consumers, request_, match):
    runner = _runner(4003, 4)
    runner.num_consumers = num_consumers
    try:
        with pytest.raises(errors.FailedPreconditionError, match=match):
            choose_source(runner, request_)
    finally:
        runner.stop()
