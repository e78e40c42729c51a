"""The worker's per-consumer reply bookkeeping (unacked_replies.UnackedReplies) and
TaskRunner.requeue: a reply leaves the worker only once its consumer acknowledges it."""

from __future__ import annotations

import threading
import time

import pytest

from dataservice import errors
from dataservice.worker.task_runner import TaskRunner
from dataservice.worker.unacked_replies import Reply, UnackedReplies

pytestmark = pytest.mark.timeout(30)


def reply(*elements: bytes, fcfs: bool = True) -> Reply:
    return Reply(list(elements), False, None, requeue_on_failure=fcfs)


class Requeued:
    def __init__(self) -> None:
        self.elements: list[bytes] = []

    def __call__(self, elements: list[bytes]) -> None:
        self.elements.extend(elements)


def test_retry_gets_the_same_reply_and_the_next_request_acknowledges_it():
    acks = UnackedReplies(4001)
    turn = acks.begin("c", 1, 1.0)
    assert turn.replay is None
    first = reply(b"a", b"b")
    turn.store(first)
    turn.finish(sent=True)
    # The client missed the reply (deadline): it asks again with the same number.
    retry = acks.begin("c", 1, 1.0)
    assert retry.replay is first
    retry.finish(sent=True)
    assert acks.stats()["resent_replies"] == 1
    assert acks.stats()["unacked_elements"] == 2
    nxt = acks.begin("c", 2, 1.0)
    assert nxt.replay is None
    nxt.store(reply(b"c"))
    nxt.finish(sent=True)
    stats = acks.stats()
    assert stats["acked_elements"] == 2
    assert stats["unacked_elements"] == 1
    assert stats["consumers"] == 1


@pytest.mark.parametrize("fcfs", [True, False])
def test_a_failed_reply_waits_for_its_consumers_retry(fcfs):
    requeued = Requeued()
    acks = UnackedReplies(4002, requeue=requeued, requeue_after_s=0.0)
    turn = acks.begin("c", 1, 1.0)
    failed = reply(b"x", b"y", fcfs=fcfs)
    turn.store(failed)
    turn.finish(sent=False)
    assert acks.stats()["failed_replies"] == 1
    retry = acks.begin("c", 1, 1.0)  # its own retry: never given to anyone else
    assert retry.replay is failed
    assert acks.stats()["failed_replies"] == 0
    retry.finish(sent=True)
    acks.begin("other", 1, 1.0).finish(sent=True)
    assert requeued.elements == []


def test_a_failed_first_come_first_served_reply_goes_to_the_others_once_its_consumer_is_gone():
    requeued = Requeued()
    acks = UnackedReplies(4003, requeue=requeued, requeue_after_s=0.2)
    turn = acks.begin("gone", 1, 1.0)
    turn.store(reply(b"x", b"y"))
    turn.finish(sent=False)
    acks.begin("other", 1, 1.0).finish(sent=True)
    assert requeued.elements == []  # not yet: "gone" may still come back
    deadline = time.monotonic() + 10
    sequence = 1
    while not requeued.elements:  # another consumer's requests give them back
        assert time.monotonic() < deadline, acks.stats()
        time.sleep(0.05)
        sequence += 1
        acks.begin("other", sequence, 1.0).finish(sent=True)
    assert requeued.elements == [b"x", b"y"]
    assert acks.stats()["requeued_elements"] == 2
    assert acks.stats()["failed_replies"] == 0
    late = acks.begin("gone", 1, 1.0)  # came back after all: a new reply
    assert late.replay is None
    late.finish(sent=True)


def test_settle_failed_waits_for_the_consumers_retry_then_gives_back_fcfs_replies_only():
    requeued = Requeued()
    acks = UnackedReplies(4004, requeue=requeued, requeue_after_s=0.3)
    for key, fcfs in (("a", True), ("round", False)):
        turn = acks.begin(key, 1, 1.0)
        turn.store(reply(key.encode(), fcfs=fcfs))
        turn.finish(sent=False)
    assert acks.settle_failed(0.0) == (0, True)  # "a" may still come back
    started = time.monotonic()
    assert acks.settle_failed(5.0) == (1, False)  # it did not: its element goes back
    assert 0.2 <= time.monotonic() - started < 3.0
    assert requeued.elements == [b"a"]
    assert acks.begin("round", 1, 1.0).replay.elements == [b"round"]  # type: ignore[union-attr]


def test_settle_failed_ends_when_the_consumer_retries():
    requeued = Requeued()
    acks = UnackedReplies(4012, requeue=requeued, requeue_after_s=30.0)
    turn = acks.begin("a", 1, 1.0)
    turn.store(reply(b"a"))
    turn.finish(sent=False)

    def retry() -> None:
        time.sleep(0.2)
        acks.begin("a", 1, 1.0).finish(sent=True)

    t = threading.Thread(target=retry)
    t.start()
    started = time.monotonic()
    assert acks.settle_failed(10.0) == (0, False)
    assert time.monotonic() - started < 5.0
    t.join(10)
    assert requeued.elements == []


def test_consumers_are_independent():
    acks = UnackedReplies(4005)
    a = acks.begin("a", 1, 1.0)
    a.store(reply(b"a1"))
    b = acks.begin("b", 7, 1.0)  # a key not seen before starts at any number
    b.store(reply(b"b7"))
    a.finish(sent=True)
    b.finish(sent=True)
    assert acks.begin("a", 1, 1.0).replay.elements == [b"a1"]  # type: ignore[union-attr]


def test_out_of_order_and_invalid_sequence_numbers_are_refused():
    acks = UnackedReplies(4006)
    acks.begin("c", 1, 1.0).finish(sent=True)
    acks.begin("c", 2, 1.0).finish(sent=True)
    with pytest.raises(errors.FailedPreconditionError, match=r"request 4 after request 2"):
        acks.begin("c", 4, 1.0)
    with pytest.raises(errors.FailedPreconditionError, match=r"request 1 after request 2"):
        acks.begin("c", 1, 1.0)
    with pytest.raises(errors.InvalidArgumentError, match="sequence must be >= 1"):
        acks.begin("c", 0, 1.0)
    # The refusals did not leave the consumer locked.
    acks.begin("c", 3, 1.0).finish(sent=True)


def test_one_request_per_consumer_at_a_time():
    acks = UnackedReplies(4007)
    first = acks.begin("c", 1, 1.0)
    first.store(reply(b"slow"))
    started = time.monotonic()
    with pytest.raises(errors.DeadlineExceededError, match="still being answered"):
        acks.begin("c", 1, 0.2)
    assert 0.15 <= time.monotonic() - started < 2.0
    got: list[Reply | None] = []

    def retry() -> None:
        turn = acks.begin("c", 1, 10.0)
        got.append(turn.replay)
        turn.finish(sent=True)

    t = threading.Thread(target=retry)
    t.start()
    first.finish(sent=True)  # the first request ends: the retry may go on
    t.join(10)
    assert not t.is_alive()
    assert got and got[0] is not None and got[0].elements == [b"slow"]


def test_a_consumer_gone_for_the_ttl_is_dropped_and_counted():
    acks = UnackedReplies(4008, ttl_s=0.2)
    turn = acks.begin("gone", 1, 1.0)
    turn.store(reply(b"1", b"2", b"3"))
    turn.finish(sent=True)
    deadline = time.monotonic() + 10
    while acks.stats()["dropped_elements"] == 0:  # requests sweep expired entries
        assert time.monotonic() < deadline, acks.stats()
        time.sleep(0.05)
        acks.begin("other", 1, 1.0).finish(sent=True)
    stats = acks.stats()
    assert stats["dropped_elements"] == 3
    assert stats["unacked_elements"] == 0
    assert stats["consumers"] == 1


def test_close_counts_what_was_never_acknowledged_and_refuses_more():
    acks = UnackedReplies(4009)
    turn = acks.begin("c", 1, 1.0)
    turn.store(reply(b"1", b"2"))
    turn.finish(sent=True)
    acks.close()
    assert acks.stats()["dropped_elements"] == 2
    with pytest.raises(errors.FailedPreconditionError, match="stopped"):
        acks.begin("c", 2, 1.0)


def test_requeue_puts_elements_back_at_the_front_in_order():
    runner = TaskRunner(4009, lambda: iter(range(10)), "localhost:0")
    try:
        read = runner.get_elements_raw(3, 1 << 20, 5.0)
        got, end, error = read.elements, read.end_of_sequence, read.error
        assert got == [0, 1, 2] and not end and error is None
        runner.requeue(got)
        out: list[int] = []
        deadline = time.monotonic() + 10
        while True:
            read = runner.get_elements_raw(100, 1 << 20, 1.0)
            elements, end = read.elements, read.end_of_sequence
            out.extend(elements)
            if end:
                break
            assert time.monotonic() < deadline
        assert out == list(range(10))
        assert runner.finished
    finally:
        runner.stop()


def test_a_runners_failed_replies_go_back_into_its_buffer_decoded():
    from dataservice.transfer import codec

    runner = TaskRunner(4011, lambda: iter(range(5)), "localhost:0")
    try:
        taken = runner.get_elements_raw(2, 1 << 20, 5.0).elements
        assert taken == [0, 1]
        turn = runner.unacked.begin("c", 1, 1.0)
        turn.store(reply(*(codec.encode(e) for e in taken)))
        turn.finish(sent=False)
        assert runner.unacked.settle_failed(0.0) == (0, True)
        runner.unacked._requeue_after_s = 0.0  # its consumer is gone
        assert runner.unacked.settle_failed(0.0) == (2, False)
        out: list[int] = []
        while True:
            read = runner.get_elements_raw(100, 1 << 20, 1.0)
            elements, end = read.elements, read.end_of_sequence
            out.extend(elements)
            if end:
                break
        assert out == [0, 1, 2, 3, 4]
    finally:
        runner.stop()


def test_requeue_after_stop_is_ignored_and_stop_closes_the_replies():
    runner = TaskRunner(4010, lambda: iter(range(3)), "localhost:0")
    turn = runner.unacked.begin("c", 1, 1.0)
    turn.store(reply(b"e"))
    turn.finish(sent=True)
    runner.stop()
    runner.requeue([1, 2])
    assert not runner._buffer
    assert runner.unacked.stats()["dropped_elements"] == 1
