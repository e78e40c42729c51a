"""The harness itself (harness.py): hosts reach each other over the bridge
and nothing else; a link down drops their packets until it is up again;
two runs at once do not collide; closing kills what still runs in the
namespaces and removes them; a dead run's namespaces are swept."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from . import harness

pytestmark = pytest.mark.netns

# Connects to HOST:PORT within TIMEOUT s; prints "ok" or the error's class.
_CONNECT = textwrap.dedent(
    """
    import socket, sys
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
        print("ok")
    except OSError as err:
        print(type(err).__name__)
    """
)
# Listens on HOST:PORT, accepting forever.
_LISTEN = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    while True:
        s.accept()
    """
)


@pytest.fixture
def needs_netns() -> None:
    reason = harness.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _listen(net: harness.Net, host: str, port: int = 7000) -> subprocess.Popen:
    p = subprocess.Popen(
        net.exec_argv(host, [sys.executable, "-c", _LISTEN, net.ip[host], str(port)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "listening"
    return p


def _connect(net: harness.Net, host: str, ip: str, port: int = 7000, timeout_s=2.0) -> str:
    return net.run(host, [sys.executable, "-c", _CONNECT, ip, str(port), str(timeout_s)]).strip()


@pytest.mark.timeout(120)
def test_hosts_reach_each_other_only_within_their_run_and_links_cut_both_ways(
    needs_netns: None,
) -> None:
    a = harness.Net(["x", "y"])
    b = harness.Net(["x", "y"])  # the same host names: another run's, at once
    try:
        assert set(a.ns.values()).isdisjoint(b.ns.values())
        server = _listen(a, "y")
        try:
            assert _connect(a, "x", a.ip["y"]) == "ok"
            # b's x has its own network: a's addresses, even in the same /24, are not a's y.
            assert _connect(b, "x", a.ip["y"]) != "ok"
            # Nothing beyond the bridge: no route out of the run's /24.
            assert _connect(a, "x", "198.51.100.1") == "OSError"  # ENETUNREACH
            a.link_down("y")
            assert _connect(a, "x", a.ip["y"], timeout_s=1.0) == "TimeoutError"
            a.link_up("y")
            assert _connect(a, "x", a.ip["y"]) == "ok"
        finally:
            server.kill()
            server.wait(10)
    finally:
        a.close()
        b.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert a.tag not in listed and b.tag not in listed


@pytest.mark.timeout(60)
def test_close_kills_what_runs_in_the_namespaces_and_removes_them(needs_netns: None) -> None:
    net = harness.Net(["x"])
    p = subprocess.Popen(
        net.exec_argv("x", [sys.executable, "-c", "import time; time.sleep(600)"]),
        start_new_session=True,  # not in our process group: only the harness can end it
    )
    deadline = time.monotonic() + 10  # `ip netns exec` enters the namespace, then execs
    while net.pids("x") != [p.pid] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert net.pids("x") == [p.pid]
    net.close()
    assert p.wait(10) == -9
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert net.tag not in listed


@pytest.mark.timeout(60)
def test_a_dead_runs_namespaces_are_swept_by_the_next_run(needs_netns: None) -> None:
    """A run SIGKILLed before its cleanup leaves its namespaces (named after
    its pid); the next Net() removes them, and what runs in them."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"{harness.PREFIX}-{dead.pid}-abc-x"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    p = subprocess.Popen(
        ["ip", "netns", "exec", name, sys.executable, "-c", "import time; time.sleep(600)"]
    )
    try:
        assert name in harness.sweep_stale()
        assert p.wait(10) == -9
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert os.path.exists(f"/run/netns/{name}") is False


def test_bad_host_names_are_refused_before_anything_is_made() -> None:
    with pytest.raises(ValueError, match="distinct"):
        harness.Net(["a", "a"])
    with pytest.raises(ValueError, match="letters, digits"):
        harness.Net(["a b"])


def test_the_skip_reason_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not root, or no `ip`: the reason says which (the multi-host tests skip with it)."""
    check = harness.unavailable_reason.__wrapped__  # uncached
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert check() == "needs root to make network namespaces (ip netns)"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(harness.shutil, "which", lambda name: None)
    assert check() == "needs iproute2's `ip` command"
