"""A new iterator's first element on a warm cluster (issue 13): what it must not
wait for, asserted by counting rather than timing where possible.

- Over shared memory a process's next iterators reuse the connection (and ring)
  an earlier iterator left with the worker (`shm.reuse_idle`, REBIND): no new
  handshake and no new ring per iterator, and the elements are still exactly the
  dataset's, epoch after epoch, with views held from an earlier epoch intact.
- A worker learns of a new task when the dispatcher creates it (its WatchTasks
  long poll is answered) or when a consumer asks for it, not at its next
  heartbeat: with a 60 s heartbeat interval the first element still comes in
  seconds.
- A read joins its job and iteration and gets its tasks in one call to the
  dispatcher; a dispatcher that answers with the job alone is asked the rest.

`bench/first_element.py` measures the latencies themselves.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import dataservice as ds
from dataservice.transfer import base, shm, shm_server
from tests.conftest import to_py

pytestmark = pytest.mark.timeout(120)

OFF = ds.ShardingPolicy.OFF
DYNAMIC = ds.ShardingPolicy.DYNAMIC


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.02)


class _Counts:
    """Calls of the workers' shm handshakes and ring creations (the real methods run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.admitted = 0
        self.rings = 0
        self._mu = threading.Lock()
        admit, create = (
            shm_server.ShmTransferServer._admit,
            shm_server.ShmTransferServer.create_ring,
        )

        def counting_admit(server, *args, **kwargs):
            with self._mu:
                self.admitted += 1
            return admit(server, *args, **kwargs)

        def counting_create(server, *args, **kwargs):
            with self._mu:
                self.rings += 1
            return create(server, *args, **kwargs)

        monkeypatch.setattr(shm_server.ShmTransferServer, "_admit", counting_admit)
        monkeypatch.setattr(shm_server.ShmTransferServer, "create_ring", counting_create)


@pytest.fixture
def fresh_idle_pool():
    """No idle connection of an earlier test (their workers are gone) is offered."""
    shm._idle.close_all()
    yield
    shm._idle.close_all()


def _image(i):
    return np.full((256, 256), int(i) % 251, np.uint8)  # 64 KiB: handed out as a view


def test_next_iterators_reuse_the_connection_and_ring(make_cluster, monkeypatch, fresh_idle_pool):
    counts = _Counts(monkeypatch)
    cluster = make_cluster(1)
    dataset = ds.Dataset.range(40).map(_image).apply(ds.distribute(OFF, cluster.target))
    held = []
    for epoch in range(5):
        it = iter(dataset)
        got = list(it)
        assert [int(g[0, 0]) for g in got] == [i % 251 for i in range(40)], f"epoch {epoch}"
        assert {w["transfer_protocol"] for w in it.stats()["workers"].values()} == {"shm"}
        held.append(got[7])  # a view of the ring, kept across the next epochs
        # The fetch thread hands its connection back once it ends (the iterator ended).
        wait_until(lambda: shm._idle._idle, 10, "the connection to go idle")
    assert counts.admitted == 1, "each iterator after the first made a new shm connection"
    # The first connection's ring, and at most the worker's one spare made ahead.
    assert counts.rings <= 2
    for view in held:
        assert view.shape == (256, 256) and (view == 7).all(), "a held view changed"


def test_reused_connection_serves_named_dynamic_and_abandoned_reads(
    make_cluster, monkeypatch, fresh_idle_pool
):
    counts = _Counts(monkeypatch)
    cluster = make_cluster(1)
    named = ds.Dataset.range(30).apply(ds.distribute(DYNAMIC, cluster.target, job_name="fe"))
    for _ in range(3):  # each iterator joins the next repetition of the job
        assert sorted(to_py(x) for x in named) == list(range(30))
        wait_until(lambda: shm._idle._idle, 10, "the connection to go idle")
    # An iterator closed mid-stream leaves its connection too; the next one starts over.
    endless = ds.Dataset.range(10**9).apply(ds.distribute(OFF, cluster.target))
    it = iter(endless)
    assert [to_py(next(it)) for _ in range(5)] == list(range(5))
    it.close()
    wait_until(lambda: shm._idle._idle, 10, "the connection to go idle")
    it = iter(endless)
    assert [to_py(next(it)) for _ in range(5)] == list(range(5))
    it.close()
    assert counts.admitted == 1


def test_idle_connections_are_closed_after_the_idle_time(
    make_cluster, monkeypatch, fresh_idle_pool
):
    monkeypatch.setattr(shm, "IDLE_CONNECTION_S", 0.3)
    cluster = make_cluster(1)
    (server,) = shm_server.live_servers()  # the cluster's one worker's
    assert [to_py(x) for x in ds.Dataset.range(5).apply(ds.distribute(OFF, cluster.target))] == [
        0,
        1,
        2,
        3,
        4,
    ]
    wait_until(lambda: not shm._idle._idle, 10, "the idle connection to be closed")
    # The worker frees it: no connection, and no ring but its spare.
    wait_until(lambda: server._serving() == 0, 10, "the worker to drop the connection")
    wait_until(
        lambda: server.ring_bytes_in_use() <= server._ring_bytes,
        10,
        "the worker to free the connection's ring",
    )


@pytest.mark.parametrize(
    "mode,protocol", [(OFF, None), (DYNAMIC, None), (OFF, "grpc"), (DYNAMIC, "grpc")]
)
def test_new_task_does_not_wait_for_the_workers_heartbeat(
    make_cluster, mode, protocol, fresh_idle_pool
):
    """With a 60 s heartbeat interval, a worker hears of each new iterator's task
    when the consumer asks for it (the worker heartbeats at once), not 60 s later."""
    cluster = make_cluster(0)
    worker = cluster.add_worker(heartbeat_interval_ms=60_000)
    assert worker.wait_registered(30)
    dataset = ds.Dataset.range(10**9).apply(
        ds.distribute(mode, cluster.target, data_transfer_protocol=protocol)
    )
    for _ in range(3):
        start = time.monotonic()
        it = iter(dataset)
        first = to_py(next(it))
        elapsed_s = time.monotonic() - start
        it.close()
        assert first == 0 if mode == OFF else isinstance(first, int)
        assert elapsed_s < 15, f"the first element took {elapsed_s:.1f} s (heartbeat: 60 s)"


def test_first_fetch_asks_for_one_element_then_the_read_ahead(make_cluster, monkeypatch):
    """A worker answers a fetch with every element it has ready: the consumer's first
    fetch asks for one, so its first element does not wait for others to be encoded
    and sent (16 150 KB images over gRPC: 10-25 ms); later fetches ask for more."""
    from dataservice.transfer import grpc as grpc_transfer

    asked: list[int] = []  # each request's max elements, in the order sent
    cls = grpc_transfer.GrpcTransferClient
    original_get, original_ahead = cls.get_elements, cls.request_ahead

    def get_elements(self, max_elements, *args, **kwargs):
        if self._next is None:  # else the reply to the request sent ahead
            asked.append(max_elements)
        return original_get(self, max_elements, *args, **kwargs)

    def request_ahead(self, max_elements, *args, **kwargs):
        sent = original_ahead(self, max_elements, *args, **kwargs)
        if sent:
            asked.append(max_elements)
        return sent

    monkeypatch.setattr(cls, "get_elements", get_elements)
    monkeypatch.setattr(cls, "request_ahead", request_ahead)
    cluster = make_cluster(1)
    dataset = ds.Dataset.range(200).apply(
        ds.distribute(OFF, cluster.target, data_transfer_protocol="grpc")
    )
    assert [to_py(x) for x in dataset] == list(range(200))
    assert asked[0] == 1, asked
    assert max(asked[1:]) >= 16, asked


def test_shm_readers_send_requests_ahead_but_not_for_a_named_job(
    make_cluster, monkeypatch, fresh_idle_pool
):
    """A reader sends shared-memory requests ahead (the worker writes the next reply
    meanwhile) and the elements are still exactly the dataset's, in order; a named
    (shared) job's reader never does."""
    sent_ahead: list[bool] = []
    original = shm.ShmTransferClient.get_elements

    def recording(self, *args, **kwargs):
        sent_ahead.append(self._sent is not None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(shm.ShmTransferClient, "get_elements", recording)
    cluster = make_cluster(1)
    dataset = ds.Dataset.range(3000).map(_image).apply(ds.distribute(OFF, cluster.target))
    assert [int(x[0, 0]) for x in dataset] == [i % 251 for i in range(3000)]
    # (after a full reply only: not while the pipeline is what the read waits for)
    assert not sent_ahead[0] and sum(sent_ahead) >= 3, sent_ahead
    wait_until(lambda: shm._idle._idle, 10, "the connection to go idle")

    sent_ahead.clear()
    named = ds.Dataset.range(3000).apply(ds.distribute(OFF, cluster.target, job_name="ahead"))
    assert [to_py(x) for x in named] == list(range(3000))
    assert len(sent_ahead) > 4 and not any(sent_ahead), sent_ahead
    wait_until(lambda: shm._idle._idle, 10, "the connection to go idle")


def test_a_read_closed_with_a_request_sent_ahead_drops_its_reply(make_cluster, fresh_idle_pool):
    """`settle`: a shared-memory connection whose read ended with a request sent ahead
    takes that reply and drops its elements, so it can serve the next read (else it is
    half-way through a reply: not reusable, and closed)."""
    cluster = make_cluster(1)
    dataset = ds.Dataset.range(1000).apply(
        ds.distribute(OFF, cluster.target, job_name="settle", data_transfer_protocol="shm")
    )
    it = iter(dataset)  # its reader asks for nothing before next()
    wait_until(lambda: it._reader._tasks, 10, "the task")
    (state,) = it._reader._tasks.values()
    client = base.make_client("shm", state.endpoint, None)
    try:
        first = client.get_elements(4, 1 << 20, 1.0)
        assert client.request_ahead(4, 1 << 20, 1.0)
        assert not client.request_ahead(4, 1 << 20, 1.0)  # one at a time
        assert not client.reusable  # a reply on its way
        assert client.settle(1.0) and client.reusable
        after = client.get_elements(4, 1 << 20, 1.0)
        # The settled reply's elements (4-7) were dropped.
        assert [to_py(x) for x in first.elements + after.elements] == [0, 1, 2, 3, 8, 9, 10, 11]
    finally:
        client.close()
        it.close()


def test_a_worker_starts_a_new_iterations_task_before_any_consumer_asks(make_cluster):
    """WatchTasks: the dispatcher answers the worker's long poll when it gives the
    worker a task, and the worker heartbeats then, so the task starts while its
    consumer still connects. With a 60 s heartbeat interval and no consumer
    request, only the watch can tell it within seconds."""
    from dataservice.rpc import service_pb2 as pb
    from dataservice.sharding import sharding_policy_to_proto

    cluster = make_cluster(0)
    worker = cluster.add_worker(heartbeat_interval_ms=60_000)
    assert worker.wait_registered(30)
    for k in range(1, 4):  # the watch is held again after each answer
        dataset_id = ds.register_dataset(cluster.target, ds.Dataset.range(k, 10**9))
        joined = cluster.dispatcher._get_or_create_job(
            pb.GetOrCreateJobRequest(
                dataset_id=dataset_id,
                processing_mode=sharding_policy_to_proto(OFF),
                join_iteration=True,
            )
        )
        assert joined.iteration.iteration_client_id > 0
        wait_until(lambda k=k: worker.num_tasks() == k, 10, f"the worker to start task {k}")
    start = time.monotonic()
    worker.stop()  # its watch, held by the dispatcher, does not hold it up
    assert time.monotonic() - start < 4


def test_a_watch_is_answered_with_the_tasks_given_since_its_generation(make_cluster):
    """A worker holding many live tasks (idle named jobs wait job_gc_timeout_ms) is
    not sent all of them again for each new one: a watch that knows generation g
    gets the tasks given after g; one that knows none (-1), or a generation this
    dispatcher never reached (another incarnation's), gets every live task."""
    from dataservice.rpc import service_pb2 as pb
    from dataservice.sharding import sharding_policy_to_proto

    cluster = make_cluster(0)
    worker = cluster.add_worker(heartbeat_interval_ms=60_000)
    assert worker.wait_registered(30)
    for k in range(1, 4):
        dataset_id = ds.register_dataset(cluster.target, ds.Dataset.range(k, 10**9))
        cluster.dispatcher._get_or_create_job(
            pb.GetOrCreateJobRequest(
                dataset_id=dataset_id,
                processing_mode=sharding_policy_to_proto(OFF),
                job_name=f"idle-{k}",
                join_iteration=True,
            )
        )
    wait_until(lambda: worker.num_tasks() == 3, 10, "the worker to start 3 tasks")

    def answer(generation):
        response = cluster.dispatcher._watch_tasks(
            pb.WatchTasksRequest(
                worker_address=worker.address,
                generation=generation,
                wait_ms=0,
                worker_uid=worker._uid,
            )
        )
        return response.generation, sorted(t.task_id for t in response.tasks)

    generation, every_task = answer(-1)
    assert generation == 3 and len(every_task) == 3
    assert answer(2) == (3, every_task[2:])
    assert answer(0) == (3, every_task)
    assert answer(3) == (3, [])  # nothing new (the watch ran out at once)
    assert answer(99) == (3, every_task)


def test_a_watch_past_the_dispatchers_limit_is_refused_and_heartbeats_still_give_tasks(
    make_cluster, monkeypatch
):
    from dataservice.dispatcher import tasks
    from dataservice.rpc import service_pb2 as pb

    monkeypatch.setattr(tasks, "MAX_WATCHES", 0)
    cluster = make_cluster(0)
    worker = cluster.add_worker(heartbeat_interval_ms=100)
    assert worker.wait_registered(30)
    answer = cluster.dispatcher._watch_tasks(
        pb.WatchTasksRequest(worker_address=worker.address, generation=0, wait_ms=10_000)
    )
    assert not answer.watching and answer.generation == 0
    dataset = ds.Dataset.range(50).apply(ds.distribute(DYNAMIC, cluster.target))
    assert sorted(to_py(x) for x in dataset) == list(range(50))


def test_a_read_joins_its_iteration_and_gets_its_tasks_in_one_call(make_cluster):
    """GetOrCreateJob with `join_iteration` answers with the job, the dispatcher's
    incarnation, the iteration and its tasks (`first_heartbeat`): the fetches start
    before the client's first heartbeat, with no GetDispatcherInfo call."""
    cluster = make_cluster(2)
    d = cluster.dispatcher
    calls: dict[str, int] = {"info": 0, "heartbeat": 0}
    info, heartbeat = d._get_info, d._client_heartbeat

    def counting(name, fn):
        def call(request):
            calls[name] += 1
            return fn(request)

        return call

    # The servicer calls the instance's attributes (what an RPC reaches).
    d._get_info = counting("info", info)
    d._client_heartbeat = counting("heartbeat", heartbeat)
    dataset = ds.Dataset.range(100).apply(ds.distribute(DYNAMIC, cluster.target))
    it = iter(dataset)
    assert len(it._reader._tasks) == 2  # both workers' tasks, from the one answer
    assert calls == {"info": 0, "heartbeat": 0}
    assert sorted(to_py(x) for x in it) == list(range(100))


def test_a_dispatcher_that_answers_without_the_iteration_is_asked_for_it(make_cluster):
    """A dispatcher of an older version ignores `join_iteration` and answers with
    the job alone: the read asks GetDispatcherInfo, GetOrCreateIteration and a
    heartbeat, as before, and reads everything."""
    from dataservice.rpc import service_pb2 as pb

    cluster = make_cluster(2)
    d = cluster.dispatcher
    job, iteration = d._get_or_create_job, d._get_or_create_iteration

    def old_job(request):
        plain = pb.GetOrCreateJobRequest()
        plain.CopyFrom(request)
        plain.join_iteration = False
        return pb.GetOrCreateJobResponse(job_id=job(plain).job_id)

    def old_iteration(request):
        response = iteration(request)
        response.ClearField("first_heartbeat")
        return response

    d._get_or_create_job = old_job
    d._get_or_create_iteration = old_iteration
    for mode in (OFF, DYNAMIC):
        dataset = ds.Dataset.range(60).apply(ds.distribute(mode, cluster.target))
        expected = sorted(list(range(60)) * (2 if mode == OFF else 1))
        assert sorted(to_py(x) for x in dataset) == expected


def test_a_watch_whose_caller_went_away_gives_its_slot_back(make_cluster):
    """A held WatchTasks call cancelled by its caller (a worker that died or
    stopped) ends within a check at the dispatcher, not after its 30 s wait:
    dead workers' watches do not fill the dispatcher's `MAX_WATCHES`."""
    import grpc

    from dataservice.rpc import service_pb2 as pb
    from dataservice.rpc import service_pb2_grpc

    cluster = make_cluster(0)
    d = cluster.dispatcher
    with grpc.insecure_channel(cluster.target.split("://")[1]) as channel:
        stub = service_pb2_grpc.DispatcherServiceStub(channel)
        call = stub.WatchTasks.future(
            pb.WatchTasksRequest(worker_address="127.0.0.1:1", generation=0, wait_ms=30_000)
        )
        wait_until(lambda: d._watches == 1, 10, "the dispatcher to hold the watch")
        call.cancel()
        wait_until(lambda: d._watches == 0, 3, "the cancelled watch to give its slot back")


def test_a_watched_task_of_a_restarted_dispatcher_never_outlives_the_restart():
    """A WatchTasks answer from a dispatcher that then restarted without its state
    must not start its task after the worker dropped the old incarnation's tasks:
    the new dispatcher reuses task and dataset ids (C-03, C-04), and a stale
    runner under a reused id would serve the new task. Here the watched start is
    held between its incarnation check and the runner's start while the restart
    happens; then a read on the new dispatcher gets task 4000 again."""
    from dataservice.rpc import service_pb2 as pb
    from dataservice.worker import server as worker_server

    first = ds.DispatchServer(ds.DispatcherConfig(port=0))
    port = int(first.target.rsplit(":", 1)[1])
    worker = ds.WorkerServer(
        ds.WorkerConfig(dispatcher_address=f"127.0.0.1:{port}", heartbeat_interval_ms=100)
    )
    second = None
    try:
        assert worker.wait_registered(30)
        old_incarnation = worker._incarnation
        # What the old dispatcher's first task would be (ids start over in each).
        stale = pb.WatchTasksResponse(generation=1, watching=True, incarnation_id=old_incarnation)
        stale.tasks.add(task_id=4000, dataset_id="1000")
        release, held = threading.Event(), threading.Event()
        start_runner = worker_server.WorkerServer._start_runner

        def held_start(self, task):
            if not release.is_set():
                held.set()
                release.wait(30)
            return start_runner(self, task)

        worker._start_runner = held_start.__get__(worker)
        first.stop()
        watched = threading.Thread(target=worker._start_watched_tasks, args=(stale,))
        watched.start()
        assert held.wait(10)
        second = ds.DispatchServer(ds.DispatcherConfig(port=port))
        time.sleep(1.0)  # heartbeats reach the new dispatcher (and find it restarted)
        release.set()
        watched.join(10)
        wait_until(
            lambda: worker._incarnation not in ("", old_incarnation),
            10,
            "the worker to know the new incarnation",
        )
        dataset = ds.Dataset.range(10).apply(ds.distribute(OFF, second.target))
        assert [to_py(x) for x in dataset] == list(range(10))
    finally:
        worker.stop()
        first.stop()
        if second is not None:
            second.stop()
