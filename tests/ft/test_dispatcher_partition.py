"""A dispatcher cut off from the network (its process runs, but no RPC from any
worker or client reaches it) for longer than its worker and client timeouts
declares nobody lost: it suspects its own network, logs one WARNING, and gives
everyone a restart's grace when traffic resumes (dispatcher/liveness.py, the
silence; issue 10, item 2). A worker that really died meanwhile is still
reported.

The dispatcher and two workers are real processes (`python -m dataservice
...`); nothing is stopped. Two ways to cut the dispatcher off:

- `TcpProxy`, a TCP proxy in front of the dispatcher (one for the workers,
  one for the consumers), that the test tells to stop forwarding: it then
  holds every connection open, reads nothing and answers nothing (a link that
  drops packets), and forwards what was held once restored (TCP's
  retransmissions after the link returns). The data path (consumer to worker)
  and the dispatcher's liveness probes of the workers do not go through it:
  the probe of a killed worker is refused even while cut off.
- The dispatcher on a host of its own, a network namespace of the
  multi-host harness (tests/multihost/harness.py) bridged to the test's
  namespace (root and iproute2 needed, else skipped), whose link is set down:
  every packet to and from the dispatcher is dropped, its probes included
  (they time out), while the workers and the consumer, outside, still reach
  each other.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator

import pytest

import dataservice as ds
from dataservice import errors
from dataservice.rpc import service_pb2 as pb

from ..integration.dispatcher_handlers import register_range, worker_heartbeat
from ..multihost import harness
from .conftest import Server, Servers, report, wait_until
from .tcp_proxy import TcpProxy

TIMEOUT_MS = 3_000  # the dispatcher's worker_timeout_ms and client_timeout_ms
CUT_S = 7.0  # over twice those
_LOST = r"worker lost|timed out|lost with|is gone"


@dataclasses.dataclass
class _Cluster:
    """A CLI dispatcher (worker and client timeouts TIMEOUT_MS), two CLI
    workers that reach it only through `workers_link`, and `target` for the
    consumers, through `clients_link`."""

    dispatcher: Server
    workers: list[Server]
    workers_link: TcpProxy
    clients_link: TcpProxy

    @property
    def target(self) -> str:
        return f"grpc://{self.clients_link.address}"

    def cut(self) -> float:
        """Cuts the dispatcher off from everyone; returns when (monotonic)."""
        self.workers_link.cut()
        self.clients_link.cut()
        return time.monotonic()

    def restore(self) -> float:
        """Reconnects everyone; returns when (monotonic)."""
        self.workers_link.restore()
        self.clients_link.restore()
        return time.monotonic()


@pytest.fixture
def cluster(servers: Servers) -> Iterator[_Cluster]:
    dispatcher = servers.dispatcher(
        worker_timeout_ms=TIMEOUT_MS, extra=("--client-timeout-ms", str(TIMEOUT_MS))
    )
    links = [TcpProxy(dispatcher.address), TcpProxy(dispatcher.address)]
    try:
        workers = servers.workers(links[0].address, 2)  # type: ignore[arg-type]
        yield _Cluster(dispatcher, workers, *links)
    finally:
        for link in links:
            link.close()


class _Consumer:
    """Reads `it` on a thread: 10 ms an element while `slow` is set (so that
    an epoch outlasts the cut), else at full speed; `during` counts the
    elements read while `cut` is set (the dispatcher was cut off)."""

    def __init__(
        self, it, slow: threading.Event, cut: threading.Event, limit: int | None = None
    ) -> None:
        self.it = it
        self.out: list[int] = []
        self.during = 0
        self.error: BaseException | None = None
        self.ended_at = 0.0
        self._slow = slow
        self._cut = cut
        self._limit = limit
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for x in self.it:
                self.out.append(int(x))
                if self._cut.is_set():
                    self.during += 1
                if self._slow.is_set():
                    time.sleep(0.01)  # the reading pace, not a synchronisation
                if self._limit is not None and len(self.out) >= self._limit:
                    break
        except BaseException as err:  # noqa: BLE001  (the test inspects it)
            self.error = err
        finally:
            self.it.close()  # a coordinated read stops at `limit`; stats() remain
        self.ended_at = time.monotonic()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the consumer hung ({len(self.out)} elements read)"
        if self.error is not None:
            raise AssertionError(f"the consumer failed: {self.error!r}") from self.error


def _exactly(out: list[int], expected: collections.Counter) -> None:
    got = collections.Counter(out)
    missing = sorted((expected - got).elements())
    extra = sorted((got - expected).elements())
    assert not missing and not extra, (
        f"{len(out)} elements, expected {expected.total()}: {len(missing)} missing "
        f"(first {missing[:5]}), {len(extra)} extra (first {extra[:5]})"
    )


# The order in which the dispatcher hears from its peers again, the second
# group RESTORE_GAP_S after the first (the link to the trainers may come back
# before the link to the workers, or after).
RESTORE_GAP_S = 1.5


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "order,protocol",
    [
        pytest.param("together", "auto", marks=pytest.mark.slow),  # 12 s
        ("consumers-first", "grpc"),
        pytest.param("workers-first", "auto", marks=pytest.mark.slow),
    ],
)
def test_a_dispatcher_cut_off_past_its_timeouts_loses_no_worker_and_no_consumer(
    cluster: _Cluster, order: str, protocol: str
) -> None:
    """2 workers; a DYNAMIC, an OFF and a coordinated (2 consumers) iteration
    read while the dispatcher is cut off for CUT_S (over twice its worker and
    client timeouts). Nobody is declared lost or released, no split is counted
    lost, no round moves, every epoch is exact, and the dispatcher said why it
    waited. With "consumers-first" a consumer's heartbeat is the first RPC
    back: it must not see its workers' tasks gone."""
    dispatcher, workers = cluster.dispatcher, cluster.workers
    slow, cut = threading.Event(), threading.Event()
    slow.set()  # until the dispatcher is back
    n_dynamic, n_off, rounds = 20_000, 2_000, 1_024

    def distribute(mode, **kw):
        return ds.distribute(
            mode, cluster.target, data_transfer_protocol=protocol, client_timeout_ms=60_000, **kw
        )

    dynamic = _Consumer(iter(ds.Dataset.range(n_dynamic).apply(distribute("dynamic"))), slow, cut)
    off = _Consumer(iter(ds.Dataset.range(n_off).apply(distribute("off"))), slow, cut)
    coordinated = [
        _Consumer(
            iter(
                ds.Dataset.range(10**6)
                .repeat()
                .apply(distribute("off", job_name="coordinated", consumer_index=c, num_consumers=2))
            ),
            slow,
            cut,
            limit=rounds,
        )
        for c in range(2)
    ]
    consumers = [dynamic, off, *coordinated]
    wait_until(lambda: all(len(c.out) >= 100 for c in consumers), 60, "100 elements each")
    cut_at = cluster.cut()
    cut.set()
    try:
        # The scenario's length, not a synchronisation: the links stay down
        # this long whatever the servers do meanwhile.
        time.sleep(CUT_S)
        if order != "together":
            first, second = (
                (cluster.clients_link, cluster.workers_link)
                if order == "consumers-first"
                else (cluster.workers_link, cluster.clients_link)
            )
            first.restore()
            time.sleep(RESTORE_GAP_S)  # the gap between the two, as above
            second.restore()
    finally:
        restored_at = cluster.restore()
        cut.clear()
        slow.clear()
    for c in consumers:
        c.join(120)
    text = dispatcher.text()
    assert not dispatcher.lines_since(0, _LOST), text[-4000:]
    assert dispatcher.lines_since(cut_at, "has heard from no worker and no client for"), text
    assert dispatcher.lines_since(cut_at, "hears from its workers and clients again"), text
    for c in consumers:
        assert c.ended_at > restored_at, "an epoch ended before the dispatcher was back"
        assert c.it.stats()["lost_workers"] == []
    # The workers served their consumers while the dispatcher was cut off.
    assert off.during > 0 and all(c.during > 0 for c in coordinated)
    _exactly(dynamic.out, collections.Counter(range(n_dynamic)))
    _exactly(off.out, collections.Counter(range(n_off)) + collections.Counter(range(n_off)))
    # Coordinated: rounds alternate between the two workers, each handing
    # consumer c its elements c, c + 2, c + 4, ... in turn; a round moved to
    # another worker (or lost) would break the sequence.
    for c, consumer in enumerate(coordinated):
        assert consumer.out == [2 * (r // 2) + c for r in range(rounds)], consumer.out[:80]
    served = {w.address for w in workers}
    for c in consumers:
        assert set(c.it.stats()["workers"]) == served
    report(
        f"dispatcher cut off {restored_at - cut_at:.1f} s (timeouts {TIMEOUT_MS} ms, {order}, "
        f"{protocol}): DYNAMIC {len(dynamic.out)} ({dynamic.during} during the cut), OFF "
        f"{len(off.out)} ({off.during}), coordinated {rounds} rounds x 2 "
        f"({coordinated[0].during}); nobody lost"
    )


def _gate(flag: str, first: int, last: int, delay_s: float):
    """A map function whose elements `first`..`last` wait for the file `flag`
    (at most 60 s), then take `delay_s` each. Element `first - 1` takes 1 ms,
    so that the worker hands off what it produced before the gate at once
    (task_runner.py batches fast elements)."""

    def fn(x):
        if int(x) == first - 1:
            time.sleep(0.001)
        if first <= int(x) <= last:
            deadline = time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(delay_s)  # the element's production time, not a synchronisation
        return x

    return fn


@pytest.mark.timeout(120)
def test_coordinated_consumers_do_not_count_the_dispatchers_absence_against_each_other(
    cluster: _Cluster, tmp_path
) -> None:
    """Coordinated consumers stuck asking the dispatcher for the next block of
    rounds (GetRounds) through a cut longer than client_timeout_ms, whose
    next round then takes over a second to be produced: they read on (the
    wait for the dispatcher says nothing about the other consumer), where
    they used to raise DeadlineExceededError."""
    flag = str(tmp_path / "restored")
    slow, cut = threading.Event(), threading.Event()
    rounds = 192  # rounds 128.. are the third block of 64 (GetRounds while cut off)
    # Each worker's elements 128..131 make rounds 128 and 129: produced after the cut only.
    consumers = [
        _Consumer(
            iter(
                ds.Dataset.range(10**6)
                .repeat()
                .map(_gate(flag, 128, 131, 1.1))
                .apply(
                    ds.distribute(
                        "off",
                        cluster.target,
                        job_name="coordinated-gate",
                        consumer_index=c,
                        num_consumers=2,
                        client_timeout_ms=60_000,
                    )
                )
            ),
            slow,
            cut,
            limit=rounds,
        )
        for c in range(2)
    ]
    wait_until(lambda: all(len(c.out) >= 100 for c in consumers), 60, "100 rounds each")
    cut_at = cluster.cut()
    cut.set()
    try:
        wait_until(lambda: all(len(c.out) == 128 for c in consumers), 30, "128 rounds each")
        time.sleep(CUT_S)  # the scenario's length: the link stays down this long
    finally:
        restored_at = cluster.restore()
        open(flag, "w").close()
        cut.clear()
    for c in consumers:
        c.join(60)
    for c, consumer in enumerate(consumers):
        assert consumer.out == [2 * (r // 2) + c for r in range(rounds)], consumer.out[:80]
    assert not cluster.dispatcher.lines_since(0, _LOST)
    report(
        f"coordinated: {rounds} rounds x 2 through a {restored_at - cut_at:.1f} s cut at a "
        "GetRounds block and a slow round after it"
    )


def _wait_silence(dispatcher: Server, since: float) -> float:
    return dispatcher.wait_line("has heard from no worker and no client for", 10, since)


@pytest.mark.timeout(180)
def test_a_worker_killed_while_the_dispatcher_is_cut_off_is_still_reported(
    cluster: _Cluster,
) -> None:
    """During the silence the dispatcher's probe of a SIGKILLed worker is
    refused: that worker (only) is declared lost at once, its DYNAMIC splits
    are counted lost, and the epoch ends with the other worker once the
    dispatcher is back."""
    dispatcher, (dead, alive) = cluster.dispatcher, cluster.workers
    slow, cut = threading.Event(), threading.Event()
    slow.set()
    n = 20_000
    consumer = _Consumer(
        iter(
            ds.Dataset.range(n).apply(
                ds.distribute("dynamic", cluster.target, client_timeout_ms=60_000)
            )
        ),
        slow,
        cut,
    )
    wait_until(lambda: len(consumer.out) >= 100, 60, "100 elements")
    cut_at = cluster.cut()
    cut.set()
    try:
        _wait_silence(dispatcher, cut_at)
        killed_at = dead.kill()
        lost_at = dispatcher.wait_line(
            rf"worker lost: worker {dead.address} .*refuses connections", 10, cut_at
        )
    finally:
        restored_at = cluster.restore()
        cut.clear()
        slow.clear()
    consumer.join(120)
    assert lost_at < restored_at
    assert not dispatcher.lines_since(0, rf"{alive.address}.*(lost|gone)"), dispatcher.text()
    (loss,) = consumer.it.stats()["lost_workers"]
    assert loss["address"] == dead.address and loss["pid"] == dead.pid, loss
    got = collections.Counter(consumer.out)
    assert max(got.values()) == 1 and set(got) <= set(range(n))
    # One split is one element and one consumer: the count is exact.
    assert n - len(got) == loss["elements_lost"], loss
    report(
        f"worker SIGKILLed while the dispatcher was cut off: declared lost "
        f"{lost_at - killed_at:.1f} s after the kill (still cut off); epoch of "
        f"{len(consumer.out)} of {n} ({loss['splits_lost']} splits counted lost) "
        f"{consumer.ended_at - restored_at:.1f} s after the dispatcher was back"
    )


@pytest.mark.timeout(180)
def test_every_worker_killed_while_the_dispatcher_is_cut_off_fails_the_consumer(
    cluster: _Cluster,
) -> None:
    """All workers dying during the silence is told apart from the silence by
    the refused probes: both are declared lost while the dispatcher hears
    nobody, and the consumer raises WorkerCrashedError naming them soon after
    it reaches the dispatcher again."""
    dispatcher, workers = cluster.dispatcher, cluster.workers
    slow, cut = threading.Event(), threading.Event()
    slow.set()
    consumer = _Consumer(
        iter(
            ds.Dataset.range(10**6).apply(
                ds.distribute(
                    "off", cluster.target, client_timeout_ms=60_000, worker_loss_timeout_ms=2_000
                )
            )
        ),
        slow,
        cut,
    )
    wait_until(lambda: len(consumer.out) >= 100, 60, "100 elements")
    cut_at = cluster.cut()
    cut.set()
    try:
        _wait_silence(dispatcher, cut_at)
        for w in workers:
            w.kill()
        for w in workers:
            dispatcher.wait_line(rf"worker lost: worker {w.address} .*refuses connections", 10)
    finally:
        restored_at = cluster.restore()
        cut.clear()
        slow.clear()
    with pytest.raises(AssertionError) as failed:
        consumer.join(60)
    error = consumer.error
    assert isinstance(error, errors.WorkerCrashedError), failed.value
    assert all(w.address in str(error) for w in workers), str(error)
    took_s = consumer.ended_at - restored_at
    assert took_s < 20, f"raised {took_s:.1f} s after the dispatcher was back"
    report(f"every worker SIGKILLed while cut off: WorkerCrashedError {took_s:.1f} s after")


# ------------------------------------------------------------ a real link down


class _Netns:
    """The dispatcher's host: a network namespace of the multi-host harness
    (tests/multihost/harness.py), joined by a bridge to this process's
    namespace (`outer_ip` here, `inner_ip` there). `cut()` sets the host's
    link down: every packet between the two is dropped, both ways."""

    def __init__(self, net: harness.Net) -> None:
        self.net = net
        self.prefix = tuple(net.exec_argv("disp", []))
        self.inner_ip = net.ip["disp"]
        assert net.root_ip is not None
        self.outer_ip = net.root_ip

    def cut(self) -> float:
        return self.net.link_down("disp")

    def restore(self) -> float:
        return self.net.link_up("disp")


@pytest.fixture
def netns() -> Iterator[_Netns]:
    """A host of our own for the dispatcher, removed at the end (with
    whatever still runs in it)."""
    reason = harness.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    net = harness.Net(["disp"], attach_root=True)
    try:
        yield _Netns(net)
    finally:
        net.close()


@pytest.fixture
def ns_cluster(
    servers: Servers, netns: _Netns, monkeypatch: pytest.MonkeyPatch
) -> tuple[_Netns, Server, list[Server]]:
    """The dispatcher in `netns`, two workers and the consumers outside: a
    link down cuts the dispatcher off from everyone (its liveness probes
    too), while the workers still serve the consumers."""
    monkeypatch.setenv("DATASERVICE_AUTH_TOKEN", "partition-test-token")  # not on loopback
    dispatcher = servers.dispatcher(
        worker_timeout_ms=TIMEOUT_MS,
        extra=("--client-timeout-ms", str(TIMEOUT_MS), "--host", netns.inner_ip),
        prefix=netns.prefix,
    )
    on_link = ("--host", netns.outer_ip, "--worker-address", f"{netns.outer_ip}:%port%")
    workers = servers.workers(dispatcher, 2, extra=on_link)
    return netns, dispatcher, workers


@pytest.mark.slow  # 18 s; in CI: a dispatcher cut off past its timeouts (above)
@pytest.mark.timeout(180)
def test_a_dispatcher_whose_link_goes_down_loses_no_worker(
    ns_cluster: tuple[_Netns, Server, list[Server]],
) -> None:
    """The same with the dispatcher's link down (`ip link set down`) for
    CUT_S: its probes of the workers time out (no proof of anything), nobody
    is declared lost or released, DYNAMIC and OFF epochs are exact."""
    netns, dispatcher, workers = ns_cluster
    slow, cut = threading.Event(), threading.Event()
    slow.set()
    n_dynamic, n_off = 20_000, 2_000

    def distribute(mode):
        return ds.distribute(mode, dispatcher.target, client_timeout_ms=60_000)

    dynamic = _Consumer(iter(ds.Dataset.range(n_dynamic).apply(distribute("dynamic"))), slow, cut)
    off = _Consumer(iter(ds.Dataset.range(n_off).apply(distribute("off"))), slow, cut)
    wait_until(lambda: len(dynamic.out) >= 100 and len(off.out) >= 100, 60, "100 elements each")
    cut_at = netns.cut()
    cut.set()
    try:
        time.sleep(CUT_S)  # the scenario's length: the link stays down this long
    finally:
        restored_at = netns.restore()
        cut.clear()
        slow.clear()
    for c in (dynamic, off):
        c.join(120)
    text = dispatcher.text()
    assert not dispatcher.lines_since(0, _LOST), text[-4000:]
    assert dispatcher.lines_since(cut_at, "has heard from no worker and no client for"), text
    assert dispatcher.lines_since(cut_at, "hears from its workers and clients again"), text
    for c in (dynamic, off):
        assert c.ended_at > restored_at
        assert c.it.stats()["lost_workers"] == []
        assert set(c.it.stats()["workers"]) == {w.address for w in workers}
    assert off.during > 0
    _exactly(dynamic.out, collections.Counter(range(n_dynamic)))
    _exactly(off.out, collections.Counter(range(n_off)) + collections.Counter(range(n_off)))
    report(
        f"dispatcher's link down {restored_at - cut_at:.1f} s (timeouts {TIMEOUT_MS} ms): "
        f"DYNAMIC {len(dynamic.out)} ({dynamic.during} during), OFF {len(off.out)} "
        f"({off.during} during); nobody lost"
    )


@pytest.mark.timeout(180)
def test_a_worker_killed_while_the_dispatchers_link_is_down_is_lost_once_it_is_back(
    ns_cluster: tuple[_Netns, Server, list[Server]],
) -> None:
    """A worker SIGKILLed while the dispatcher's link is down: no probe can
    tell (they time out), so it is declared lost only after the link is back
    (a consumer's unreachable report and a refused probe, at the latest
    worker_timeout_ms after the first RPC); the epoch ends with the other
    worker and the loss counted."""
    netns, dispatcher, (dead, alive) = ns_cluster
    slow, cut = threading.Event(), threading.Event()
    slow.set()
    n = 20_000
    consumer = _Consumer(
        iter(
            ds.Dataset.range(n).apply(
                ds.distribute("dynamic", dispatcher.target, client_timeout_ms=60_000)
            )
        ),
        slow,
        cut,
    )
    wait_until(lambda: len(consumer.out) >= 100, 60, "100 elements")
    cut_at = netns.cut()
    cut.set()
    try:
        _wait_silence(dispatcher, cut_at)
        killed_at = dead.kill()
        time.sleep(CUT_S / 2)  # the scenario's length: the link stays down this long
    finally:
        restored_at = netns.restore()
        cut.clear()
        slow.clear()
    assert not dispatcher.lines_since(0, _LOST), dispatcher.text()[-4000:]
    lost_at = dispatcher.wait_line(
        rf"worker lost: worker {dead.address} ", TIMEOUT_MS / 1000 + 10, restored_at
    )
    consumer.join(120)
    assert not dispatcher.lines_since(0, rf"{alive.address}.*(lost|gone)"), dispatcher.text()
    (loss,) = consumer.it.stats()["lost_workers"]
    assert loss["address"] == dead.address and loss["pid"] == dead.pid, loss
    got = collections.Counter(consumer.out)
    assert max(got.values()) == 1 and set(got) <= set(range(n))
    assert n - len(got) == loss["elements_lost"], loss
    report(
        f"worker SIGKILLed {killed_at - cut_at:.1f} s into a link-down: declared lost "
        f"{lost_at - restored_at:.1f} s after the link was back; epoch of {len(consumer.out)} "
        f"of {n} ({loss['elements_lost']} counted lost)"
    )


# ------------------------------------------------------------ the rule, handler by handler


def _silence(d: ds.DispatchServer, seconds: float) -> None:
    """As if nobody had been heard for `seconds` (the handlers' last-seen times)."""
    with d._mu:
        d._last_heard -= seconds
        for w in d._workers.values():
            w.last_heartbeat -= seconds
        for client_id in d._client_seen:
            d._client_seen[client_id] -= seconds


@pytest.mark.timeout(60)
def test_silence_holds_the_timeouts_until_an_rpc_arrives_then_grants_the_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Driven through the handlers (unresolvable worker addresses: probes
    prove nothing). Heard from nobody past both timeouts: no worker lost, no
    client released, one WARNING. The next RPC (`_heard_rpc`, as the servicer
    calls it) gives everyone the timeouts again from then plus the silence's
    length; a worker still silent past its timeout while others are heard is
    lost after all."""
    d = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=2_000, client_timeout_ms=2_000))
    try:
        worker_heartbeat(d, "w:1", "uid-w:1")
        worker_heartbeat(d, "w:2", "uid-w:2")
        dataset_id = register_range(d, 10)
        job = d._get_or_create_job(pb.GetOrCreateJobRequest(dataset_id=dataset_id))
        client_id = d._get_or_create_iteration(
            pb.GetOrCreateIterationRequest(job_id=job.job_id)
        ).iteration_client_id
        with caplog.at_level(logging.WARNING, logger="dataservice.dispatcher.server"):
            _silence(d, 5.0)
            d._check_workers()
            d._check_clients()
            assert sorted(d._workers) == ["w:1", "w:2"]
            assert client_id in d._client_seen
            d._check_workers()  # still silent: no second WARNING
            warnings = [
                r.getMessage() for r in caplog.records if "has heard from no" in r.getMessage()
            ]
            assert len(warnings) == 1 and "for 5." in warnings[0], warnings
            d._heard_rpc()
            assert d._silent_since is None
            assert any("hears from its workers" in r.getMessage() for r in caplog.records)
        # The grace runs from the RPC plus the silence's length (TCP backoff).
        now = time.monotonic()
        assert all(w.last_heartbeat > now + 4 for w in d._workers.values())
        assert d._client_seen[client_id] > now + 4
        d._check_workers()
        d._check_clients()
        assert sorted(d._workers) == ["w:1", "w:2"] and client_id in d._client_seen
        # w:2 stays silent while w:1 and the client are heard: it is lost.
        with d._mu:
            d._workers["w:2"].last_heartbeat = time.monotonic() - 5.0
        worker_heartbeat(d, "w:1", "uid-w:1")
        d._client_heartbeat(pb.ClientHeartbeatRequest(iteration_client_id=client_id))
        d._check_workers()
        assert sorted(d._workers) == ["w:1"]
        assert d._silent_since is None
    finally:
        d.stop()


@pytest.mark.timeout(60)
def test_without_workers_a_silent_client_is_released_as_before() -> None:
    """The silence needs registered workers: a dispatcher with only a client
    that stopped heartbeating releases it after client_timeout_ms."""
    d = ds.DispatchServer(ds.DispatcherConfig(client_timeout_ms=2_000))
    try:
        dataset_id = register_range(d, 10)
        job = d._get_or_create_job(pb.GetOrCreateJobRequest(dataset_id=dataset_id))
        client_id = d._get_or_create_iteration(
            pb.GetOrCreateIterationRequest(job_id=job.job_id)
        ).iteration_client_id
        _silence(d, 5.0)
        d._check_clients()
        assert client_id not in d._client_seen
        assert d._silent_since is None
    finally:
        d.stop()


@pytest.mark.timeout(60)
def test_no_silence_is_declared_right_after_the_dispatcher_itself_could_not_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A maintenance tick that came late (its GIL held by one long call, such
    as the parse of a registration of hundreds of MB) means RPCs could not be
    taken in either: nobody heard since then says nothing of the network, so no
    "cut off" WARNING within the silence bound of it; past that bound, the
    same silence is declared as before."""
    from dataservice.dispatcher import liveness

    # The maintenance thread itself never marks a late tick here: the test does.
    monkeypatch.setattr(liveness, "_DEAF_S", 1e9)
    monkeypatch.setattr(liveness, "_STALL_S", 1e9)
    d = ds.DispatchServer(ds.DispatcherConfig(worker_timeout_ms=60_000, client_timeout_ms=60_000))
    try:
        worker_heartbeat(d, "w:1", "uid-w:1")
        with caplog.at_level(logging.WARNING, logger="dataservice.dispatcher.server"):
            with d._mu:
                d._deaf_at = time.monotonic()  # a tick just came late
                _silence(d, 5.0)
                assert not d._watch_silence_locked(time.monotonic())
                assert d._silent_since is None
                d._deaf_at = time.monotonic() - 10.0  # long before the silence bound
                assert d._watch_silence_locked(time.monotonic())
                assert d._silent_since is not None
        warnings = [r.getMessage() for r in caplog.records if "has heard from no" in r.getMessage()]
        assert len(warnings) == 1, warnings
    finally:
        d.stop()
