"""When a consumer's iteration is over (`_Reader._over_locked`), and what a fetch
that lands after that end does (`TaskFetching._fetch_loop`).

A task the dispatcher dropped with a fetch on its way from a live worker (another
consumer of the shared job took the task's end) holds the end until the fetch
lands; a lost worker's fetch does not, and what it brings late is logged and
counted (`elements_not_yielded`), never dropped silently. The end-to-end case is
tests/ft/test_shared_job_end.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from dataservice.client import connect
from dataservice.client.fetch import _TaskState
from dataservice.client.reader import ReadOptions, _Reader
from dataservice.client.stats import LostWorker
from dataservice.sharding import ShardingPolicy
from dataservice.transfer import base as transfer

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def reader() -> Iterator[_Reader]:
    # No call reaches the dispatcher: the channel connects lazily, never used here.
    r = _Reader(
        ReadOptions(
            dispatcher_address="localhost:1",
            processing_mode=int(ShardingPolicy.DYNAMIC),
            job_name="shared",
            num_consumers=0,
            consumer_index=0,
            max_outstanding_requests=None,
            data_transfer_protocol="grpc",
            target_workers="ANY",
            client_timeout_ms=1000,
        )
    )
    yield r
    r.close()


def _task(r: _Reader, task_id: int, **kw: Any) -> _TaskState:
    endpoint = transfer.TaskEndpoint(task_id, f"localhost:{task_id}", "", "host")
    state = _TaskState(endpoint, **kw)
    r._tasks[task_id] = state
    return state


def test_a_dropped_task_with_a_fetch_on_its_way_holds_the_end(reader: _Reader) -> None:
    _task(reader, 1, finished=True)
    other = _task(reader, 2, removed=True, fetching=True, worker_uid="uid-2")
    with reader._cv:
        assert not reader._over_locked()  # the dispatcher has not said it finished
        reader._iteration_finished = True
        assert not reader._over_locked()  # task 2's last reply is still landing
        assert "the last reply from the workers localhost:2 (task 2)" in (
            reader._describe_wait_locked()
        )
        other.fetching = False
        assert reader._over_locked()


def test_a_lost_workers_fetch_does_not_hold_the_end(reader: _Reader) -> None:
    state = _task(reader, 3, removed=True, fetching=True, worker_uid="uid-3")
    with reader._cv:
        reader._iteration_finished = True
        # Another process of that worker was lost: this fetch still holds the end.
        report = SimpleNamespace(worker_uid="uid-old", task_id=3)
        reader.stats.lost[("localhost:3", "uid-old", 7, 3)] = LostWorker(report, 0.0)
        assert not reader._over_locked()
        report = SimpleNamespace(worker_uid="uid-3", task_id=3)
        reader.stats.lost[("localhost:3", "uid-3", 8, 3)] = LostWorker(report, 0.0)
        assert reader._over_locked()
        assert state.fetching  # unchanged: the fetch thread clears it when it lands


def test_elements_landing_after_the_end_are_counted_and_logged(
    reader: _Reader, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    landed = threading.Event()
    release = threading.Event()

    class LateClient:
        protocol = "grpc"
        max_unconsumed_bytes = None
        max_reply_bytes = 16 << 20
        retry_in_place = False

        def get_elements(self, *args: Any, **kwargs: Any) -> transfer.ElementsResult:
            landed.set()
            assert release.wait(10), "the test never released the fetch"
            return transfer.ElementsResult([1, 2, 3], 24, False, "uid-4")

        def close(self) -> None:
            pass

    monkeypatch.setattr(connect, "connect", lambda *a, **kw: LateClient())
    state = _task(reader, 4)
    reader._consumer_asked = True
    thread = threading.Thread(target=reader._fetch_loop, args=(state,), daemon=True)
    caplog.set_level(logging.WARNING, logger="dataservice.client.reader")
    thread.start()
    assert landed.wait(10), "the fetch thread never asked for elements"
    with reader._cv:
        assert state.fetching
        reader._ended = True  # the consumer's next() raised StopIteration meanwhile
    release.set()
    thread.join(10)
    assert not thread.is_alive()
    with reader._cv:
        stats = reader.stats_locked()
    assert stats["elements_not_yielded"] == 3
    assert stats["workers"] == {}  # not counted as received: never queued
    assert not state.fetching and not reader._results
    assert any(
        "3 elements from worker localhost:4 (task 4) arrived after" in r.getMessage()
        for r in caplog.records
    )
