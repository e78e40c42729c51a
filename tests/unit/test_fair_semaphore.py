"""The reader's FIFO semaphore (max_outstanding_requests): a thread that
releases it and asks again queues behind the threads already waiting."""

from __future__ import annotations

import threading
import time

from dataservice.client.fetch import _FairSemaphore


def test_a_releasing_thread_queues_behind_the_waiters():
    sem = _FairSemaphore(1)
    order: list[str] = []
    assert sem.acquire(1.0)

    def waiter(name: str) -> None:
        assert sem.acquire(5.0)
        order.append(name)
        sem.release()

    threads = [threading.Thread(target=waiter, args=(n,)) for n in ("b", "c")]
    for t in threads:
        t.start()
        time.sleep(0.05)  # b waits first, then c
    sem.release()
    assert sem.acquire(5.0)  # the releasing thread asks again: served after b and c
    order.append("a")
    sem.release()
    for t in threads:
        t.join(5)
    assert order == ["b", "c", "a"]


def test_acquire_times_out_and_leaves_the_queue():
    sem = _FairSemaphore(1)
    assert sem.acquire(1.0)
    t0 = time.monotonic()
    assert not sem.acquire(0.1)
    assert 0.09 < time.monotonic() - t0 < 2.0
    sem.release()
    assert sem.acquire(0.1)  # the timed-out waiter does not block the next one
