"""Many hosts on one machine: a network namespace per host, joined by a bridge.

`Net(["disp", "w0", "w1", "t0", "t1"])` makes, for one test run:

- a *switch* namespace holding a bridge (`br0`) and one end of a veth pair
  per host (`h0`, `h1`, ...);
- a namespace per host, holding the other end (`eth0`) with an address in a
  private /24 of 10.213.0.0/16 (host i is `.10 + i`), and its own loopback.

Every name outside the namespaces is unique to the run
(`dsmh-<pid>-<hex>-<host>`), and inside them the names are fixed, so parallel
runs never collide; the test range is not used on this machine's own
interfaces (checked when `attach_root=True` puts a veth into this process's
namespace, the one case where the /24 must not clash with a route here).
Nothing reaches beyond the bridge: there is no route out, and traffic only
flows between the run's namespaces (and this one's with `attach_root`).

A process runs on a host with `ip netns exec NAME ...` (`Net.exec_argv`).
`Net.link_down(host)` / `link_up(host)` set the bridge's end of the host's
veth down/up: every packet to and from that host is dropped, both ways (a
pulled cable; the processes keep running and see no error until their own
timeouts).

`Net.close()` SIGKILLs every process still in the namespaces (`ip netns
pids`), then deletes them (which deletes their veths and the bridge). It runs
from the fixture's teardown, and from `atexit` should that be skipped; a run
that died before either (SIGKILL) is swept by the next `Net()`: namespaces
named after a pid that no longer exists are removed.

`unavailable_reason()` says why namespaces cannot be made here (not root, no
`ip`, no netns support), for a skip.
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

PREFIX = "dsmh"
TEST_RANGE = ipaddress.ip_network("10.213.0.0/16")
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-\S+$")
_IP_TIMEOUT_S = 10


class NetnsError(RuntimeError):
    """An `ip` command failed; the message holds the command and its stderr."""


def _ip(*args: str, check: bool = True) -> str:
    """Runs `ip ARGS` (at most _IP_TIMEOUT_S); returns stdout.

    Raises:
        NetnsError: It exited non-zero (with `check`), naming the command and its stderr.
    """
    done = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
    )
    if check and done.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


@functools.cache
def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here, or None when they can
    (checked once per process by making and deleting one)."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command"
    probe = f"{PREFIX}-{os.getpid()}-0-probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
    except (NetnsError, OSError, subprocess.TimeoutExpired) as err:
        return f"cannot make a network namespace with a bridge here: {err}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    # `ip netns list` prints "NAME (id: N)" or "NAME".
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def kill_netns_processes(name: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILLs (after SIGCONT) every process in namespace `name` and waits
    up to `timeout_s` for them to go; returns the pids it found.

    Raises:
        NetnsError: Some process was still there after `timeout_s`.
    """
    found: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [int(p) for p in _ip("netns", "pids", name, check=False).split()]
        if not pids:
            return found
        for pid in pids:
            if pid not in found:
                found.append(pid)
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {pids} in namespace {name} outlived SIGKILL")
        time.sleep(0.05)


def delete_netns(name: str) -> None:
    """Kills what runs in namespace `name`, then deletes it (a no-op when gone)."""
    if name not in _netns_names():
        return
    kill_netns_processes(name)
    _ip("netns", "del", name, check=False)


def sweep_stale() -> list[str]:
    """Deletes the namespaces of runs whose process is gone; returns their names."""
    stale = []
    for name in _netns_names():
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            delete_netns(name)
            stale.append(name)
    return stale


def _subnets_in_use() -> list[ipaddress.IPv4Network]:
    nets = []
    for line in _ip("-4", "route", "show", "table", "all").splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("default", "broadcast", "local", "unreachable", "blackhole"):
            first = line.split()[1] if len(line.split()) > 1 else ""
        try:
            nets.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            continue
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network)]


class Net:
    """One run's hosts (see the module docstring). Not thread-safe: one test's
    thread makes, cuts and closes it.

    Args:
        hosts: Host names (letters, digits, `-`), one namespace each.
        attach_root: Also join this process's own namespace to the bridge
            (`root_ip`), for a test whose in-process code talks to the hosts.

    Raises:
        NetnsError: A namespace, link or address could not be made (what was
            made is removed first).
    """

    def __init__(self, hosts: Sequence[str], attach_root: bool = False) -> None:
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"host names must be distinct and non-empty, got {list(hosts)}")
        for h in hosts:
            if not re.fullmatch(r"[A-Za-z0-9-]{1,20}", h):
                raise ValueError(f"host name {h!r}: use 1-20 letters, digits or '-'")
        sweep_stale()
        self.tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{PREFIX}-{self.tag}-sw"
        self.subnet = self._pick_subnet(attach_root)
        base = self.subnet.network_address
        self.hosts = list(hosts)
        self.ns = {h: f"{PREFIX}-{self.tag}-{h}" for h in hosts}
        self.ip = {h: str(base + 10 + i) for i, h in enumerate(hosts)}
        self._port = {h: f"h{i}" for i, h in enumerate(hosts)}
        self.root_ip: str | None = str(base + 1) if attach_root else None
        # In this process's namespace: unique per run, at most 15 characters.
        self._root_link = f"dsmh{secrets.token_hex(4)}" if attach_root else None
        self._closed = False
        atexit.register(self.close)
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _pick_subnet(self, attach_root: bool) -> ipaddress.IPv4Network:
        subnets = list(TEST_RANGE.subnets(new_prefix=24))
        start = os.getpid() % len(subnets)
        if not attach_root:
            # An isolated switch: the /24 is seen by the run's namespaces only.
            return subnets[start]
        in_use = _subnets_in_use()
        for k in range(len(subnets)):
            candidate = subnets[(start + k) % len(subnets)]
            if not any(candidate.overlaps(n) for n in in_use):
                return candidate
        raise NetnsError(f"every /24 of {TEST_RANGE} is routed here already")

    def _make(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for h in self.hosts:
            ns, port = self.ns[h], self._port[h]
            _ip("netns", "add", ns)
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.ip[h]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        if self._root_link is not None:
            _ip("link", "add", self._root_link, "type", "veth", "peer", "name", "root", "netns", sw)
            _ip("-n", sw, "link", "set", "root", "master", "br0", "up")
            _ip("addr", "add", f"{self.root_ip}/24", "dev", self._root_link)
            _ip("link", "set", self._root_link, "up")

    # ------------------------------------------------------------ use

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run on `host`: `ip netns exec NAME argv...` (which execs it,
        so the Popen's pid is argv's)."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def run(self, host: str, argv: Sequence[str], timeout_s: float = 30.0) -> str:
        """Runs `argv` on `host` to completion; returns its stdout.

        Raises:
            subprocess.CalledProcessError: It exited non-zero.
            subprocess.TimeoutExpired: It ran past `timeout_s`.
        """
        return subprocess.run(
            self.exec_argv(host, argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=True,
        ).stdout

    def link_down(self, host: str) -> float:
        """Cuts `host` off (its veth's bridge end down); returns when (monotonic)."""
        _ip("-n", self.switch, "link", "set", self._port[host], "down")
        return time.monotonic()

    def link_up(self, host: str) -> float:
        """Reconnects `host`; returns when (monotonic)."""
        _ip("-n", self.switch, "link", "set", self._port[host], "up")
        return time.monotonic()

    def pids(self, host: str) -> list[int]:
        """The processes running in `host`'s namespace now."""
        return [int(p) for p in _ip("netns", "pids", self.ns[host], check=False).split()]

    def close(self) -> None:
        """Kills every process in the run's namespaces and deletes them, and
        the veth in this namespace (idempotent).

        Raises:
            NetnsError: A namespace is still listed afterwards.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        names = [*self.ns.values(), self.switch]
        for name in names:
            try:
                delete_netns(name)
            except NetnsError:
                _ip("netns", "del", name, check=False)  # then checked below
        if self._root_link is not None:
            _ip("link", "del", self._root_link, check=False)  # gone with the switch, normally
        left = [n for n in names if n in _netns_names()]
        if left:
            raise NetnsError(f"namespaces not removed: {left}")
