"""Reading across hosts: a dispatcher host, two worker hosts and two trainer
hosts, each a network namespace (conftest.py, harness.py); the trainer host
t0 also runs a worker (a third, the same host id as its trainer). Every
scenario asserts the exact elements each trainer read, and which transport
each worker's elements took (shared memory only between processes of one
host).

One cluster serves the whole module (its processes take seconds to start on a
loaded machine); each scenario uses its own jobs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator

import pytest

from . import harness
from .cluster import DISPATCHER_PORT, WORKER_PORT, Cluster
from .conftest import exactly, transports

pytestmark = pytest.mark.netns

RESULT_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def cluster(net: harness.Net, token_file: str) -> Iterator[Cluster]:
    """The dispatcher (with the fixed worker list that static sharding needs:
    w0, w1, t0's, in that order: worker indices 0, 1, 2) and the three workers."""
    c = Cluster(net, token_file)
    try:
        listed = [c.address(h, WORKER_PORT) for h in ("w0", "w1", "t0")]
        c.dispatcher(extra=("--worker-addresses", ",".join(listed)))
        target = c.address("disp", DISPATCHER_PORT)
        workers = [c.worker(h, target, wait=False) for h in ("w0", "w1", "t0")]
        for w in workers:
            w.wait_ready()
        yield c
    finally:
        c.close()


def _target(c: Cluster) -> str:
    return "grpc://" + c.address("disp", DISPATCHER_PORT)


def _addresses(c: Cluster) -> dict[str, str]:
    return {h: c.address(h, WORKER_PORT) for h in ("w0", "w1", "t0")}


def _read(c: Cluster, specs: dict[str, dict]) -> dict[str, dict]:
    """Starts a trainer per host of `specs` at once; returns each one's result
    (asserting it raised nothing)."""
    trainers = {h: c.trainer(h, target=_target(c), **spec) for h, spec in specs.items()}
    results = {h: t.wait_result(RESULT_TIMEOUT_S) for h, t in trainers.items()}
    for h, r in results.items():
        assert r["error"] is None, f"trainer on {h}: {r['error']}\n{trainers[h].stderr()}"
    return results


def _check_transports(c: Cluster, results: dict[str, dict]) -> None:
    """t0 reads t0's worker over shared memory, the others over gRPC; t1 reads all over gRPC."""
    a = _addresses(c)
    for h, r in results.items():
        want = {addr: ("shm" if h == "t0" and w == "t0" else "grpc") for w, addr in a.items()}
        got = transports(r)
        assert got == {addr: want[addr] for addr in got}, (h, got)


def test_off_every_trainer_gets_every_workers_whole_epoch(cluster: Cluster) -> None:
    n = 500
    results = _read(cluster, {h: {"mode": "off", "n": n} for h in ("t0", "t1")})
    for h, r in results.items():
        exactly(r["elements"], list(range(n)) * 3, f"OFF on {h}")
        assert set(r["stats"]["workers"]) == set(_addresses(cluster).values())
    _check_transports(cluster, results)


def test_dynamic_each_trainers_job_gets_each_element_once(cluster: Cluster) -> None:
    n = 2000
    results = _read(cluster, {h: {"mode": "dynamic", "n": n} for h in ("t0", "t1")})
    for h, r in results.items():
        exactly(r["elements"], range(n), f"DYNAMIC on {h}")
    _check_transports(cluster, results)


@pytest.mark.parametrize("mode,copies", [("dynamic", 1), ("off", 3)])
def test_a_named_job_is_shared_by_two_trainer_hosts(
    cluster: Cluster, mode: str, copies: int
) -> None:
    """Both trainers read one job ("shared-<mode>"): between them every element
    exactly once per producing worker, and each got some (slow enough for both
    to join before the end)."""
    n = 600
    spec = {"mode": mode, "n": n, "job_name": f"shared-{mode}", "read_delay_ms": 2}
    results = _read(cluster, {"t0": spec, "t1": spec})
    both = results["t0"]["elements"] + results["t1"]["elements"]
    exactly(both, list(range(n)) * copies, f"{mode} job shared by t0 and t1")
    assert all(r["count"] > 0 for r in results.values()), {
        h: r["count"] for h, r in results.items()
    }
    _check_transports(cluster, results)


def test_coordinated_reads_across_two_trainer_hosts(cluster: Cluster) -> None:
    """num_consumers=2, consumer 0 on t0 and 1 on t1: every round, each takes
    the element of its index from the round's worker; each worker's stream is
    0, 1, 2, ..., so consumer c's r-th element is 2 * (r // W) + c when rounds
    go round the W workers in turn, and over all the rounds each consumer
    reads each worker's elements c, c + 2, ... in order."""
    rounds = 300
    specs = {
        h: {
            "mode": "off",
            "n": 10**6,
            "repeat": True,
            "job_name": "coordinated",
            "consumer_index": c,
            "num_consumers": 2,
            "limit": rounds,
        }
        for c, h in enumerate(("t0", "t1"))
    }
    results = _read(cluster, specs)
    workers = len(_addresses(cluster))
    for c, h in enumerate(("t0", "t1")):
        got = results[h]["elements"]
        assert len(got) == rounds
        # Each worker's share of the rounds is its stream's next elements of index c.
        per_round = Counter(got)
        assert all(v % 2 == c for v in got), (h, got[:40])
        # W workers, each r // W rounds in: every value k appears once per worker that
        # served round k (all of them for the first rounds // W rounds).
        for k in range(rounds // workers):
            assert per_round[2 * k + c] == workers, (h, k, got[:40])
    # The two consumers read the same rounds in the same order: element i of consumer
    # 0 and of consumer 1 came from one round, one worker (values 2k and 2k + 1).
    assert [v + 1 for v in results["t0"]["elements"]] == results["t1"]["elements"]
    # Rounds are assembled over gRPC, also from the worker on the consumer's host.
    for h, r in results.items():
        assert transports(r) == {a: "grpc" for a in _addresses(cluster).values()}, h


@pytest.mark.parametrize("target_workers", ["AUTO", "LOCAL"])
def test_static_sharding_reads_the_trainers_own_hosts_worker(
    cluster: Cluster, target_workers: str
) -> None:
    """DATA sharding over the fixed list (w0, w1, t0's worker: indices 0, 1,
    2): AUTO (local, under static sharding) and LOCAL give the trainer on t0
    its host's shard only, i % 3 == 2, through shared memory."""
    n = 900
    results = _read(cluster, {"t0": {"mode": "data", "n": n, "target_workers": target_workers}})
    r = results["t0"]
    exactly(r["elements"], [i for i in range(n) if i % 3 == 2], f"DATA/{target_workers} on t0")
    assert transports(r) == {_addresses(cluster)["t0"]: "shm"}


def test_static_sharding_any_reads_every_host_shm_here_grpc_there(cluster: Cluster) -> None:
    """DATA sharding, target_workers=ANY: the trainer on t0 reads all three
    shards, its own host's worker over shared memory, the two worker hosts'
    over gRPC; t1 (no worker) reads all three over gRPC."""
    n = 900
    spec = {"mode": "data", "n": n, "target_workers": "ANY"}
    results = _read(cluster, {"t0": spec, "t1": dict(spec)})
    a = _addresses(cluster)
    for h, r in results.items():
        exactly(r["elements"], range(n), f"DATA/ANY on {h}")
    assert transports(results["t0"]) == {a["t0"]: "shm", a["w0"]: "grpc", a["w1"]: "grpc"}
    assert transports(results["t1"]) == {addr: "grpc" for addr in a.values()}


def test_a_trainer_host_without_a_worker_reading_local_workers_is_told(cluster: Cluster) -> None:
    """target_workers=LOCAL on t1, which runs no worker: a clear error (not a
    hang, not an empty epoch)."""
    t = cluster.trainer("t1", target=_target(cluster), mode="data", n=90, target_workers="LOCAL")
    r = t.wait_result(RESULT_TIMEOUT_S)
    assert r["error"] is not None and r["count"] == 0, r
    assert "local" in r["error"]["message"].lower(), r["error"]


def test_cross_trainer_cache_shares_each_production_between_trainer_hosts(
    cluster: Cluster,
) -> None:
    """Two trainers (t0, t1; trainer ids a, b) on one job with a cross-trainer
    cache: each reads, from each worker, that worker's elements 0, 1, 2, ...
    in order, and the same element from one worker is the same production
    (one nonce) for both."""
    limit = 240
    spec = {
        "mode": "off",
        "n": 10**6,
        "repeat": True,
        "job_name": "cached",
        "payload_bytes": 1024,
        "record": "cache",
        "limit": limit,
    }
    results = _read(cluster, {"t0": {**spec, "trainer_id": "a"}, "t1": {**spec, "trainer_id": "b"}})
    produced: dict[tuple[int, int], set[int]] = defaultdict(set)
    for h, r in results.items():
        assert r["count"] == limit
        per_worker: dict[int, list[int]] = defaultdict(list)
        for pid, i, nonce in r["elements"]:
            per_worker[pid].append(i)
            produced[(pid, i)].add(nonce)
        for pid, ids in per_worker.items():
            assert ids == list(range(len(ids))), (h, pid, ids[:20])
    shared = [k for k, nonces in produced.items() if len(nonces) == 1]
    assert all(len(nonces) == 1 for nonces in produced.values()), "produced twice"
    assert len(shared) >= limit // 2, len(shared)
    _check_transports(cluster, results)
