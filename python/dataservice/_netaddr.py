"""Which address a server bound to every interface should give to other hosts.

A server bound to a wildcard host ("0.0.0.0", "::") listens on every interface
but has no address of its own to advertise: the host's name often resolves to a
loopback address (/etc/hosts of containers, of hosts set up by hand, of network
namespaces that share the host's name), and "localhost" means the other host
to whoever reads it there. The address chosen here is one that belongs to an
interface of this host (network namespace) that is up:

1. the local address of this host's route toward a given peer (the worker's
   dispatcher): a UDP `connect` picks it and sends nothing;
2. else the first non-loopback, non-link-local address of an interface that
   is up (`psutil.net_if_addrs`), IPv4 first;
3. else "localhost" (no interface but loopback is up: nobody else can reach
   this host anyway).
"""

from __future__ import annotations

import ipaddress
import socket

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")
"""Bind hosts that mean every interface."""


def is_wildcard(host: str) -> bool:
    return host in WILDCARD_HOSTS


def format_host(ip: str) -> str:
    """`ip` as the host part of "host:port" (an IPv6 address in brackets)."""
    return f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip


def _usable(ip: str) -> bool:
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    return not (addr.is_loopback or addr.is_link_local or addr.is_unspecified)


def interface_addresses() -> list[str]:
    """The addresses of this host's interfaces that are up, without loopback,
    link-local or unspecified ones: IPv4 first, each in the interfaces' order."""
    import psutil

    stats = psutil.net_if_stats()
    v4: list[str] = []
    v6: list[str] = []
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        for a in addrs:
            if a.family == socket.AF_INET and _usable(a.address):
                v4.append(a.address)
            elif a.family == socket.AF_INET6 and _usable(a.address):
                v6.append(a.address.split("%", 1)[0])
    return v4 + v6


def local_address_toward(address: str) -> str | None:
    """The address of this host's interface on its route toward `address`
    ("host:port", "grpc://host:port"), or None when there is no route, the name
    does not resolve, or the route is loopback (the peer is on this host)."""
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port or 9), type=socket.SOCK_DGRAM)
    except (OSError, ValueError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                ip = str(s.getsockname()[0])
        except OSError:
            continue
        if _usable(ip):
            return ip.split("%", 1)[0]
    return None


def wildcard_advertised_host(peer: str | None) -> tuple[str, str]:
    """(host, why) for a server bound to every interface: the host part of the
    address to advertise (the module docstring's order; `peer` is the address
    of who must reach it first, e.g. the worker's dispatcher) and the reason
    it was chosen, in words for the log."""
    if peer:
        ip = local_address_toward(peer)
        if ip is not None:
            return format_host(ip), f"the local address of this host's route to {peer}"
    addrs = interface_addresses()
    if addrs:
        why = "the first non-loopback address of this host's interfaces"
        if peer:
            why += f" ({peer} is on this host, or has no route from it)"
        return format_host(addrs[0]), why
    return "localhost", "no interface but loopback is up"


def reachable_host() -> str:
    """A name other hosts can use for this one: its host name when that
    resolves to an address of one of its interfaces (not loopback: a network
    namespace shares the host's name but not its addresses), else the source
    address of its default route, else `wildcard_advertised_host(None)`."""
    name = socket.gethostname()
    try:
        own = set(interface_addresses())
        resolved = {str(i[4][0]).split("%", 1)[0] for i in socket.getaddrinfo(name, None)}
        if own & resolved:
            return name
    except (OSError, ValueError):
        pass
    for probe in ("192.0.2.1:9", "[2001:db8::1]:9"):  # documentation addresses: never sent to
        ip = local_address_toward(probe)
        if ip is not None:
            return format_host(ip)
    return wildcard_advertised_host(None)[0]
