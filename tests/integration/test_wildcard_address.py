"""A server bound to every interface advertises an address others can reach,
never "localhost" (the host's name often resolves to loopback: containers,
network namespaces that share the host's name), and says which it chose."""

from __future__ import annotations

import ipaddress
import logging
import socket

import pytest

import dataservice as ds
from dataservice import _netaddr


def _not_loopback(host: str) -> bool:
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host != "localhost"


def test_interface_addresses_are_this_hosts_and_not_loopback():
    addrs = _netaddr.interface_addresses()
    for a in addrs:
        ip = ipaddress.ip_address(a)
        assert not ip.is_loopback and not ip.is_link_local, a
        family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((a, 0))  # an address of this host: bindable
    assert [a for a in addrs if ":" not in a] == addrs[: len([a for a in addrs if ":" not in a])]


def test_the_route_toward_a_peer_names_its_source_address():
    if not _netaddr.interface_addresses():
        pytest.skip("no interface but loopback is up")
    assert _netaddr.local_address_toward("127.0.0.1:5050") is None  # loopback: same host
    assert _netaddr.local_address_toward("no-such-host.invalid:5050") is None
    ip = _netaddr.local_address_toward("192.0.2.1:9")  # TEST-NET-1: via the default route
    if ip is not None:
        assert ip in _netaddr.interface_addresses()


def test_wildcard_host_prefers_the_route_to_the_peer(monkeypatch):
    monkeypatch.setattr(_netaddr, "local_address_toward", lambda peer: "10.9.8.7")
    assert _netaddr.wildcard_advertised_host("d:1") == (
        "10.9.8.7",
        "the local address of this host's route to d:1",
    )
    monkeypatch.setattr(_netaddr, "local_address_toward", lambda peer: None)
    monkeypatch.setattr(_netaddr, "interface_addresses", lambda: ["fd00::5"])
    host, why = _netaddr.wildcard_advertised_host("localhost:1")
    assert host == "[fd00::5]" and "localhost:1 is on this host" in why
    monkeypatch.setattr(_netaddr, "interface_addresses", lambda: [])
    assert _netaddr.wildcard_advertised_host("x:1")[0] == "localhost"


def test_reachable_host_is_a_name_only_when_it_resolves_to_an_own_address(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "shared-name")
    monkeypatch.setattr(_netaddr, "interface_addresses", lambda: ["10.1.1.2"])
    # The name resolves to another namespace's address: not this one's.
    monkeypatch.setattr(
        socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, 1, 6, "", ("10.1.1.1", 0))]
    )
    monkeypatch.setattr(_netaddr, "local_address_toward", lambda peer: None)
    assert _netaddr.reachable_host() == "10.1.1.2"
    monkeypatch.setattr(
        socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, 1, 6, "", ("10.1.1.2", 0))]
    )
    assert _netaddr.reachable_host() == "shared-name"


def test_a_worker_bound_to_every_interface_advertises_a_reachable_address(caplog):
    if not _netaddr.interface_addresses():
        pytest.skip("no interface but loopback is up")
    caplog.set_level(logging.INFO, logger="dataservice")
    dispatcher = ds.DispatchServer(ds.DispatcherConfig(host="0.0.0.0", insecure=True))
    worker = ds.WorkerServer(
        ds.WorkerConfig(dispatcher.target, host="0.0.0.0", insecure=True, heartbeat_interval_ms=100)
    )
    try:
        assert worker.wait_registered(10)
        host, _, port = worker.address.rpartition(":")
        assert _not_loopback(host), worker.address
        assert host.strip("[]") in _netaddr.interface_addresses()
        # It is an address the worker answers on (a client of another host would use it).
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            pass
        said = [r.getMessage() for r in caplog.records if "advertises" in r.getMessage()]
        assert said and worker.address in said[0] and "worker_address" in said[0], said
        bound = [
            r.getMessage() for r in caplog.records if "dispatcher serving on" in r.getMessage()
        ]
        assert bound and "0.0.0.0:" in bound[0] and "reachable at" in bound[0], bound
        assert "localhost" not in bound[0]
        # Elements travel to that address (gRPC: as a trainer on another host reads).
        data = ds.Dataset.range(20).apply(
            ds.distribute(ds.ShardingPolicy.OFF, dispatcher.target, data_transfer_protocol="grpc")
        )
        assert sorted(int(x) for x in data) == list(range(20))
    finally:
        worker.stop()
        dispatcher.stop()


def test_worker_address_is_advertised_as_given_with_the_port():
    dispatcher = ds.DispatchServer()
    worker = ds.WorkerServer(
        ds.WorkerConfig(dispatcher.target, worker_address="127.0.0.1:%port%", port=0)
    )
    try:
        host, _, port = worker.address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
    finally:
        worker.stop()
        dispatcher.stop()
