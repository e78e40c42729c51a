"""One iterator read by several threads (a loader's threads sharing it): next()
is safe to call concurrently, every element goes to one thread, and when the
iteration ends every thread's loop ends with StopIteration, not only the one
that took the end."""

from __future__ import annotations

import collections
import threading

import pytest

import dataservice as ds

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("mode", [ds.ShardingPolicy.DYNAMIC, ds.ShardingPolicy.OFF])
def test_threads_sharing_an_iterator_all_end_at_its_end(make_cluster, mode) -> None:
    cluster = make_cluster(2)
    n = 5000
    it = iter(ds.Dataset.range(n).apply(ds.distribute(mode, cluster.target)))
    got: list[list[int]] = [[] for _ in range(4)]
    raised: list[BaseException | None] = [None] * 4

    def read(k: int) -> None:
        try:
            for x in it:
                got[k].append(int(x))
        except BaseException as err:  # noqa: BLE001  (the test inspects it)
            raised[k] = err

    threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread still waits after the end"
    assert raised == [None] * 4, raised
    counts = collections.Counter(x for part in got for x in part)
    copies = 1 if mode == ds.ShardingPolicy.DYNAMIC else 2  # OFF: one copy per worker
    assert sorted(counts) == list(range(n))
    assert set(counts.values()) == {copies}, collections.Counter(counts.values())
