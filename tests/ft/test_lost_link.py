"""A consumer's link to a worker that is cut, or that never led to it (issue 16):

- a link cut under a fetch (no RST ever comes) fails the fetch in seconds by
  the data channels' gRPC keepalive (rpc/util.py `DATA_KEEPALIVE_TIME_MS`), not
  after the reply's no-progress timeout or TCP's retransmissions;
- a worker the dispatcher still hears from but this consumer cannot reach
  fails the read with `UnavailableError` naming its address: after
  $DATASERVICE_UNREACHABLE_TIMEOUT_MS for an address never reached, after
  `worker_loss_timeout_ms` for one reached before (it hung for ever);
- the dispatcher does not declare such a worker lost because its probe was
  refused while the worker heartbeats on time (it flapped lost/back);
- a worker host whose whole link is cut (a network namespace whose veth goes
  down) is declared lost on its heartbeat timeout and the consumer's epoch
  ends with the loss warning and `stats()` counts, as for a worker that died.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

import dataservice as ds
from dataservice import _waits, errors
from dataservice.rpc import util as rpc_util
from tests.conftest import FAST
from tests.ft.conftest import unanswered_port
from tests.ft.tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(120)

DYNAMIC = ds.ShardingPolicy.DYNAMIC
OFF = ds.ShardingPolicy.OFF


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slow(x):
    time.sleep(0.02)
    return x


def _quick(x):
    time.sleep(0.005)
    return x


def _messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_cut_link_fails_the_fetch_by_keepalive_and_then_the_read(
    make_cluster, monkeypatch, caplog
):
    # The worker's heartbeats go straight to the dispatcher; its consumers reach
    # it through the proxy only (its advertised address): cutting the proxy is a
    # partition between the consumer and a worker the dispatcher still hears.
    monkeypatch.setattr(rpc_util, "DATA_KEEPALIVE_TIME_MS", 1_000)
    monkeypatch.setattr(rpc_util, "DATA_KEEPALIVE_TIMEOUT_MS", 1_000)
    monkeypatch.setattr(_waits, "FIRST_WARNING_S", 2.0)
    caplog.set_level(logging.INFO, logger="dataservice")
    cluster = make_cluster(0)
    port = _free_port()
    link = TcpProxy(port)
    try:
        config = ds.WorkerConfig(cluster.target, port=port, worker_address=link.address, **FAST)
        cluster.workers.append(ds.WorkerServer(config))
        dataset = ds.Dataset.range(100_000).map(_slow)
        it = iter(
            dataset.apply(
                ds.distribute(
                    OFF,
                    cluster.target,
                    data_transfer_protocol="grpc",
                    worker_loss_timeout_ms=4_000,
                )
            )
        )
        assert [int(next(it)) for _ in range(20)] == list(range(20))
        cut_at = time.monotonic()
        link.cut()
        with pytest.raises(errors.UnavailableError) as info:
            for _ in it:
                pass
        took_s = time.monotonic() - cut_at
    finally:
        link.close()
    message = str(info.value)
    assert link.address in message and "answered this process before" in message, message
    assert "worker_loss_timeout_ms=4000" in message and "heartbeats" in message, message
    # The fetch in flight when the link went dead failed by keepalive (1 s + 1 s),
    # long before the reply's 30 s no-progress timeout.
    failed = [
        r
        for r in caplog.records
        if r.getMessage().startswith(f"cannot reach worker {link.address}")
    ]
    assert failed, "the first failed connection was not logged"
    noticed_s = failed[0].created - (time.time() - (time.monotonic() - cut_at))
    assert noticed_s < 8, f"the dead link was noticed {noticed_s:.1f} s after the cut"
    assert 4 <= took_s < 20, took_s
    # The wait said what it waited for meanwhile.
    waits = _messages(caplog, "is waiting for an element from the workers")
    assert waits and link.address in waits[0] and "fetches keep failing" in waits[-1], waits
    # The dispatcher kept the worker (it heartbeats): not declared lost.
    assert not _messages(caplog, "worker lost"), _messages(caplog, "worker lost")


def test_an_advertised_address_that_leads_nowhere_fails_in_seconds(
    make_cluster, monkeypatch, caplog
):
    # Nothing listens on this port: the address the worker advertises is wrong.
    wrong = f"127.0.0.1:{unanswered_port()}"
    monkeypatch.setenv(rpc_util.UNREACHABLE_ENV, "3000")
    caplog.set_level(logging.INFO, logger="dataservice")
    cluster = make_cluster(0)
    cluster.workers.append(
        ds.WorkerServer(ds.WorkerConfig(cluster.target, worker_address=wrong, **FAST))
    )
    start = time.monotonic()
    with pytest.raises(errors.UnavailableError) as info:
        list(
            ds.Dataset.range(10).apply(
                ds.distribute(OFF, cluster.target, data_transfer_protocol="grpc")
            )
        )
    took_s = time.monotonic() - start
    message = str(info.value)
    assert f"cannot reach worker {wrong}" in message, message
    assert "never answered" in message and "worker_address" in message, message
    assert 3 <= took_s < 15, took_s
    # The dispatcher's probe is refused too, but the worker heartbeats: kept, warned once.
    assert not _messages(caplog, "worker lost"), _messages(caplog, "worker lost")
    warned = _messages(caplog, "heartbeats on time, but its address")
    assert len(warned) == 1 and wrong in warned[0], warned


def test_a_probe_refused_after_the_worker_died_still_declares_it_lost_at_once(make_cluster, caplog):
    """The refused-probe check waits for a heartbeat only as long as one is
    due: a worker that stopped is still declared lost within seconds."""
    caplog.set_level(logging.INFO, logger="dataservice")
    cluster = make_cluster(1, worker_timeout_ms=60_000)
    worker = cluster.workers[0]
    assert worker.wait_registered(10)
    it = iter(
        ds.Dataset.range(100_000)
        .map(_slow)
        .apply(ds.distribute(OFF, cluster.target, data_transfer_protocol="grpc"))
    )
    next(it)
    stopped_at = time.monotonic()
    worker.stop()
    deadline = time.monotonic() + 20
    while not _messages(caplog, "worker lost") and time.monotonic() < deadline:
        time.sleep(0.05)
    lost = _messages(caplog, "worker lost")
    assert lost and "refuses connections" in lost[0], lost
    assert time.monotonic() - stopped_at < 10
    del it


# ------------------------------------------------------------ a real link cut


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@dataclasses.dataclass
class _HostNs:
    """A network namespace (another host) joined to this one by a veth pair:
    `outer_ip` here, `inner_ip` there. `cut()` sets the inner end down: packets
    between the two are dropped, and nothing answers for the inner address."""

    name: str
    inner: str
    outer: str
    outer_ip: str
    inner_ip: str

    def cut(self) -> None:
        _ip("-n", self.name, "link", "set", self.inner, "down")


@pytest.fixture
def host_ns() -> Iterator[_HostNs]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns)")
    pid = os.getpid()
    prefix = f"10.215.{(pid >> 6) & 0xFF}"
    last = (pid & 0x3F) * 4
    env = _HostNs(
        f"ds-host-{pid}", f"dsh{pid}i", f"dsh{pid}o", f"{prefix}.{last + 1}", f"{prefix}.{last + 2}"
    )
    try:
        _ip("netns", "add", env.name)
        _ip("link", "add", env.outer, "type", "veth", "peer", "name", env.inner)
        _ip("link", "set", env.inner, "netns", env.name)
        _ip("addr", "add", f"{env.outer_ip}/30", "dev", env.outer)
        _ip("link", "set", env.outer, "up")
        _ip("-n", env.name, "addr", "add", f"{env.inner_ip}/30", "dev", env.inner)
        _ip("-n", env.name, "link", "set", env.inner, "up")
        _ip("-n", env.name, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as err:
        subprocess.run(["ip", "netns", "del", env.name], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", env.outer], capture_output=True, timeout=10)
        pytest.skip(f"cannot make a network namespace here: {err.stderr.strip()}")
    try:
        yield env
    finally:
        subprocess.run(["ip", "link", "del", env.outer], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", env.name], capture_output=True, timeout=10)


def test_a_worker_host_cut_off_mid_epoch_is_reported_as_a_loss(host_ns, monkeypatch, caplog):
    """The dispatcher and one worker here, another worker (bound to every
    interface, no worker_address: it advertises its own address on the veth) in
    the namespace; the namespace's link is cut mid-epoch. The epoch ends with
    every element of the other worker, and the loss is told and counted."""
    monkeypatch.setenv("DATASERVICE_AUTH_TOKEN", "lost-link-test-token")  # beyond loopback
    monkeypatch.setattr(_waits, "FIRST_WARNING_S", 2.0)
    caplog.set_level(logging.INFO, logger="dataservice")
    dispatcher = ds.DispatchServer(
        ds.DispatcherConfig(host=host_ns.outer_ip, worker_timeout_ms=4_000)
    )
    address = dispatcher.target
    here = ds.WorkerServer(ds.WorkerConfig(address, host=host_ns.outer_ip, **FAST))
    there = subprocess.Popen(
        ["ip", "netns", "exec", host_ns.name, sys.executable, "-m", "dataservice", "worker"]
        + ["--dispatcher", address, "--host", "0.0.0.0", "--heartbeat-interval-ms", "200"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=os.environ.copy(),
    )
    try:
        assert there.stdout is not None
        ready, _, _ = select.select([there.stdout], [], [], 30)
        assert ready, "the worker in the namespace printed no ready line in 30 s"
        line = there.stdout.readline()
        assert f"listening on {host_ns.inner_ip}:" in line, line  # not localhost
        n = 2000
        it = iter(
            ds.Dataset.range(n)
            .map(_quick)
            .apply(ds.distribute(DYNAMIC, address, data_transfer_protocol="grpc"))
        )
        got = [int(next(it)) for _ in range(200)]
        cut_at = time.monotonic()
        host_ns.cut()
        got += [int(x) for x in it]
        took_s = time.monotonic() - cut_at
        stats = it.stats()
    finally:
        there.kill()
        there.wait(10)
        here.stop()
        dispatcher.stop()
    assert len(got) == len(set(got)) and len(got) < n
    (lost,) = stats["lost_workers"]
    assert lost["address"].startswith(f"{host_ns.inner_ip}:")
    assert stats["elements_lost"] == n - len(got) > 0, stats
    summary = _messages(caplog, "DYNAMIC splits were")
    assert summary and f"{n - len(got)} elements" in summary[0], summary
    assert took_s < 60, took_s
    print(f"\nlink cut: epoch ended {took_s:.1f} s later, {n - len(got)} elements lost, told")
