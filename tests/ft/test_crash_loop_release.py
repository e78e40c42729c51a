"""A consumer whose worker keeps crashing leaves no shared memory behind (issue 10).

Zero-copy elements (numpy leaves of >= 64 KiB) reach the consumer as views of
the worker's ring, and a view keeps the ring mapped, its memfd open. Once the
read ended in `WorkerCrashedError` and the iterator is dropped, no view is
left anywhere in the client (the fetch thread's last reply included), so the
process holds no memfd of ours and no /dev/shm name. Before, the fetch thread
kept its last reply (a local of its loop) while it went on reconnecting to the
restarting worker, and afterwards in the frames its tracebacks kept, so one
`/memfd:dataservice-ring` stayed open (and mapped) for the process's life.
"""

from __future__ import annotations

import time

import pytest

import dataservice as ds
from dataservice import errors

from .conftest import ThreadReader, memfds, our_shm_names, report
from .test_crash_loop import _exit_at_every_time, _run_cluster


def _element_of(nbytes: int):
    def fn(x):
        import numpy as np

        return {"i": x, "pad": np.full(nbytes, x % 251, np.uint8)}

    return fn


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "nbytes", [100_000, pytest.param(1_000, marks=pytest.mark.slow)], ids=["zero_copy", "copied"]
)
def test_crash_loop_leaves_no_ring_behind_once_the_iterator_is_dropped(nbytes: int) -> None:
    """OFF, a map that calls os._exit(3) at element 500 of range(1000) in every
    process, LocalCluster(1, max_worker_restarts=2): the read ends in
    WorkerCrashedError; with the error kept (no traceback) and the iterator
    dropped, no memfd of ours nor /dev/shm name remains, without gc.collect()."""
    memfds_before, shm_before = memfds(), our_shm_names()
    with _run_cluster(1, max_worker_restarts=2) as cluster:
        data = (
            ds.Dataset.range(1000)
            .map(_exit_at_every_time(500, 3))
            .map(_element_of(nbytes))
            .apply(ds.distribute("off", cluster.target, worker_loss_timeout_ms=5000))
        )
        reader = ThreadReader(iter(data))
        reader.join(90)
        error = reader.error
        assert isinstance(error, errors.WorkerCrashedError), error
        report(f"{reader.count} elements of {nbytes} bytes read before {error!r}")
        if nbytes >= 64 << 10:  # views of the ring were handed out (copies may all be lost)
            assert reader.count > 0, "no element came before the crash loop"
        del reader, data  # the iterator goes with its _Reader

        def left() -> set[str]:
            shm = {f"/dev/shm/{n}" for n in our_shm_names() - shm_before}
            return (memfds() - memfds_before) | shm

        # The reader's fetch threads end asynchronously (a reconnect to the
        # restarting worker takes up to its retry time): wait for them, no gc.
        deadline = time.monotonic() + 10.0
        while (still := left()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not still, f"left behind after the error and the iterator were dropped: {still}"
    assert isinstance(error, errors.WorkerCrashedError)
