"""Elements a worker has produced reach a waiting consumer promptly, whatever the
pipeline does next: an element stuck in the pipeline (here: held at a gate until the
test opens it) does not hold back the ones made before it. Over shared memory and
gRPC, first come, first served (OFF, DYNAMIC), coordinated reads and cross-trainer
cache reads, with in-process workers and worker processes (`LocalCluster`).

The worker's producer hands elements of a fast pipeline to the task's buffer in
batches (`worker/task_runner.py`); these tests fail if a batch waits for the next
element before its consumer can have it.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest

import dataservice as ds
from tests.conftest import to_py
from tests.integration.modes_common import (
    DYNAMIC,
    OFF,
    cached,
    dist,
)

# From the moment the pipeline reaches the stuck element to the arrival of every
# element before it (the issue: they came only after the stuck one).
PROMPT_S = 1.0
STARTUP_S = 30.0  # job creation, task assignment, connection (a loaded machine)


class Gate:
    """Holds element `index` of a pipeline (in whatever process runs it) until
    `open()`, at most 60 s; the pipeline notes (`reached_at`) when it got there."""

    def __init__(self, directory: str, index: int) -> None:
        self.index = index
        self._reached = os.path.join(directory, "reached")
        self._open = os.path.join(directory, "open")

    def map_fn(self):
        index, reached, opened = self.index, self._reached, self._open

        def gated(x):
            if int(x) == index and not os.path.exists(opened):
                with open(reached + ".tmp", "w") as f:
                    f.write(repr(time.monotonic()))  # CLOCK_MONOTONIC: one per host
                os.replace(reached + ".tmp", reached)
                deadline = time.monotonic() + 60
                while not os.path.exists(opened) and time.monotonic() < deadline:
                    time.sleep(0.005)
            return x

        return gated

    def reached_at(self, timeout_s: float) -> float:
        """time.monotonic() when the pipeline reached the gate (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self._reached):
            if time.monotonic() > deadline:
                pytest.fail(f"the pipeline did not reach element {self.index} in {timeout_s} s")
            time.sleep(0.01)
        with open(self._reached) as f:
            return float(f.read())

    def open(self) -> None:
        with open(self._open, "w"):
            pass


@pytest.fixture
def make_gate(tmp_path):
    gates: list[Gate] = []

    def make(index: int) -> Gate:
        directory = tmp_path / f"gate-{len(gates)}"
        directory.mkdir()
        gates.append(Gate(str(directory), index))
        return gates[-1]

    yield make
    for gate in gates:  # never leave a pipeline stuck behind a failed test
        gate.open()


class Arrivals:
    """Reads up to `limit` elements of `dataset` on a thread, noting when each arrives."""

    def __init__(self, dataset, limit: int) -> None:
        self.iterator = iter(dataset)
        self._q: queue.Queue = queue.Queue()
        self._limit = limit
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for n, element in enumerate(self.iterator, 1):
                self._q.put((to_py(element), time.monotonic()))
                if n == self._limit:
                    break
        except BaseException as err:  # the test thread reports it
            self._q.put((err, time.monotonic()))
        finally:
            self.iterator.close()
            self._q.put(None)

    def take(self, n: int, deadline: float, what: str) -> list[tuple[object, float]]:
        """The next `n` (element, arrival time); fails if they are not all there by
        `deadline` (time.monotonic())."""
        got: list[tuple[object, float]] = []
        while len(got) < n:
            try:
                item = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"{what}: got {[v for v, _ in got]} by the deadline, want {n}")
            if item is None:
                pytest.fail(f"{what}: the read ended after {[v for v, _ in got]}")
            if isinstance(item[0], BaseException):
                raise item[0]
            got.append(item)
        return got

    def nothing_before(self, deadline: float) -> bool:
        """No element arrives before `deadline`."""
        try:
            self._q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return True
        return False

    def join(self) -> None:
        self._thread.join(timeout=30)
        assert not self._thread.is_alive()


def _protocol_of(iterator) -> set[str]:
    return {w["transfer_protocol"] for w in iterator.stats()["workers"].values()}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("protocol", ["shm", "grpc"])
@pytest.mark.parametrize("mode", [OFF, DYNAMIC], ids=["OFF", "DYNAMIC"])
@pytest.mark.parametrize("stuck", [2, 3])
def test_elements_before_a_stuck_one_arrive_promptly(harness, make_gate, protocol, mode, stuck):
    cluster = harness.cluster(1)
    gate = make_gate(stuck)
    dataset = ds.Dataset.range(6).map(gate.map_fn())
    read = Arrivals(dist(dataset, cluster.target, mode, data_transfer_protocol=protocol), 6)
    reached = gate.reached_at(STARTUP_S)
    before = read.take(stuck, reached + PROMPT_S, f"elements 0-{stuck - 1}")
    assert [v for v, _ in before] == list(range(stuck))
    assert _protocol_of(read.iterator) == {protocol}
    gate.open()
    after = read.take(6 - stuck, time.monotonic() + STARTUP_S, "the rest")
    assert [v for v, _ in after] == list(range(stuck, 6))
    read.join()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("protocol", ["shm", "grpc"])
def test_a_stuck_first_element_holds_the_read_until_it_comes(harness, make_gate, protocol):
    cluster = harness.cluster(1)
    gate = make_gate(0)
    dataset = ds.Dataset.range(4).map(gate.map_fn())
    read = Arrivals(dist(dataset, cluster.target, data_transfer_protocol=protocol), 4)
    reached = gate.reached_at(STARTUP_S)
    assert read.nothing_before(reached + 0.5)  # nothing was produced: nothing to deliver
    gate.open()
    got = read.take(4, time.monotonic() + STARTUP_S, "every element")
    assert [v for v, _ in got] == [0, 1, 2, 3]
    read.join()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("protocol", ["shm", "grpc"])
def test_a_round_made_before_a_stuck_element_arrives_promptly(harness, make_gate, protocol):
    cluster = harness.cluster(1)
    gate = make_gate(2)
    dataset = ds.Dataset.range(6).map(gate.map_fn()).repeat()
    job = f"latency-rounds-{protocol}-{harness.name}"
    reads = [
        Arrivals(
            dist(
                dataset,
                cluster.target,
                OFF,
                job_name=job,
                consumer_index=i,
                num_consumers=2,
                data_transfer_protocol=protocol,
            ),
            3,
        )
        for i in range(2)
    ]
    reached = gate.reached_at(STARTUP_S)
    round0 = [r.take(1, reached + PROMPT_S, f"consumer {i}'s round 0") for i, r in enumerate(reads)]
    assert [got[0][0] for got in round0] == [0, 1]
    gate.open()
    rest = [r.take(2, time.monotonic() + STARTUP_S, "rounds 1-2") for r in reads]
    assert [[v for v, _ in got] for got in rest] == [[2, 4], [3, 5]]
    for r in reads:
        r.join()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("protocol", ["shm", "grpc"])
def test_a_cache_read_gets_elements_before_a_stuck_one_promptly(harness, make_gate, protocol):
    cluster = harness.cluster(1)
    gate = make_gate(2)
    dataset = ds.Dataset.range(6).map(gate.map_fn()).repeat()
    job = f"latency-cache-{protocol}-{harness.name}"
    read = Arrivals(
        cached(dataset, cluster.target, "trainer-a", job_name=job, data_transfer_protocol=protocol),
        4,
    )
    reached = gate.reached_at(STARTUP_S)
    before = read.take(2, reached + PROMPT_S, "elements 0-1")
    assert [v for v, _ in before] == [0, 1]
    gate.open()
    after = read.take(2, time.monotonic() + STARTUP_S, "elements 2-3")
    assert [v for v, _ in after] == [2, 3]
    read.join()
