"""Fixtures of the multi-host tests: real hosts as network namespaces
(harness.py), servers started through the CLI on them (`ip netns exec NAME
python -m dataservice dispatcher|worker`, as tests/ft starts them), and
trainers as `ip netns exec NAME python trainer.py SPEC` processes.

Hosts: `disp` (the dispatcher), `w0` and `w1` (a worker each), `t0` and `t1`
(a trainer each; `t0` can also run a worker of its own: the same host id, so
its trainer reads that worker over shared memory). The servers bind their
host's address, beyond loopback, so they have an auth token (a file, mode
0600); the trainers get it in DATASERVICE_AUTH_TOKEN.

Skipped, saying why, where namespaces cannot be made (not root, no `ip`, no
netns support): `harness.unavailable_reason()`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from tests.ft.conftest import our_shm_names

from . import harness
from .cluster import HOSTS, write_token_file


@pytest.fixture(scope="module")
def net() -> Iterator[harness.Net]:
    """The five hosts, for one test module; afterwards no namespace and no
    /dev/shm name of ours is left."""
    reason = harness.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    shm_before = our_shm_names()
    n = harness.Net(HOSTS)
    try:
        yield n
    finally:
        n.close()
    deadline = time.monotonic() + 10
    while (left := our_shm_names() - shm_before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"the module left /dev/shm names: {sorted(left)}"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_token_file(str(tmp_path_factory.mktemp("multihost") / "token"))


def exactly(got: Sequence[int], expected: dict[int, int] | Sequence[int], what: str) -> None:
    """Asserts the multiset `got` equals `expected` (a sequence or value -> count)."""
    want = Counter(expected)
    have = Counter(got)
    missing = sorted((want - have).elements())
    extra = sorted((have - want).elements())
    assert not missing and not extra, (
        f"{what}: {len(got)} elements, expected {want.total()}: {len(missing)} missing "
        f"(first {missing[:5]}), {len(extra)} extra (first {extra[:5]})"
    )


def transports(result: dict[str, Any]) -> dict[str, str]:
    """worker address -> transfer protocol, from a trainer's `it.stats()`."""
    return {a: w["transfer_protocol"] for a, w in result["stats"]["workers"].items()}
