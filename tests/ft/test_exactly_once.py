"""Exactly-once DYNAMIC (`distribute(..., exactly_once=True)`, issue 17 A): every
element of the epoch reaches the job's consumers exactly once, whatever worker
processes are SIGKILLed (LocalCluster restarts them) and across a
fault-tolerant dispatcher's restart; pipelines it cannot run per split are
refused naming the op. The default (at-most-once) is checked unchanged by
test_worker_loss.py, test_crash_loop.py and test_no_silent_loss.py.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import threading
import time

import numpy as np
import pytest

import dataservice as ds
from dataservice import errors

from .conftest import Servers, report, wait_until

DYNAMIC = ds.ShardingPolicy.DYNAMIC
PROTOCOLS = [None, "grpc"]  # None: shared memory on this host ("auto")


def _slow(seconds: float):
    def fn(x):
        time.sleep(seconds)
        return x

    return fn


def _kill_one(cluster: ds.LocalCluster, rng: random.Random) -> int:
    """SIGKILLs one of the cluster's live worker processes; its pid."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = [p for p in cluster.worker_pids if p]
        if pids:
            pid = rng.choice(pids)
            try:
                os.kill(pid, signal.SIGKILL)
                return pid
            except ProcessLookupError:
                pass  # it died meanwhile (being restarted): pick again
        time.sleep(0.05)
    pytest.fail("no live worker process to kill within 30 s")


def _epoch_with_kills(n: int, kills: int, seed: int, protocol: str | None) -> None:
    rng = random.Random(seed)
    kill_at = sorted(rng.sample(range(n // 10, n - n // 10), kills))
    with ds.LocalCluster(num_workers=3, max_worker_restarts=10 * kills + 10) as cluster:
        dataset = ds.Dataset.range(n).map(_slow(0.003))
        dataset = dataset.apply(
            ds.distribute(
                DYNAMIC, cluster.target, exactly_once=True, data_transfer_protocol=protocol
            )
        )
        got: list[int] = []
        it = iter(dataset)
        killed = []
        for x in it:
            got.append(int(x))
            while kill_at and len(got) >= kill_at[0]:
                kill_at.pop(0)
                killed.append(_kill_one(cluster, rng))
        stats = it.stats()
    counts = collections.Counter(got)
    twice = sorted(k for k, c in counts.items() if c > 1)
    missing = sorted(set(range(n)) - set(counts))
    assert not twice, f"delivered more than once: {twice[:20]}"
    assert not missing, f"never delivered: {missing[:20]} ({len(missing)} in all)"
    assert sorted(got) == list(range(n))
    assert len(killed) == kills
    assert stats["splits_lost"] == 0 and stats["elements_lost"] == 0, stats["lost_workers"]
    report(f"exactly-once: {n} elements, {kills} SIGKILLs ({protocol or 'shm'}): all once")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("protocol", [None, pytest.param("grpc", marks=pytest.mark.slow)])
def test_each_element_once_under_random_sigkills(protocol) -> None:
    _epoch_with_kills(n=600, kills=3, seed=17, protocol=protocol)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_each_element_once_under_ten_sigkills(protocol) -> None:
    _epoch_with_kills(n=3000, kills=10, seed=1017, protocol=protocol)


@pytest.mark.timeout(240)
def test_a_shared_job_delivers_each_element_once_across_its_consumers() -> None:
    """Two consumers of one named job, two SIGKILLs: each element reaches exactly
    one of them."""
    n = 600
    rng = random.Random(3)
    outs: list[list[int]] = [[], []]
    errs: list[BaseException] = []
    with ds.LocalCluster(num_workers=3, max_worker_restarts=20) as cluster:
        # One dataset object per consumer: the k-th iterator of one object
        # joins the job's k-th repetition.
        datasets = [
            ds.Dataset.range(n)
            .map(_slow(0.003))
            .apply(ds.distribute(DYNAMIC, cluster.target, job_name="shared", exactly_once=True))
            for _ in outs
        ]
        outs: list[list[int]] = [[], []]
        errs: list[BaseException] = []

        def consume(dataset: ds.Dataset, out: list[int]) -> None:
            try:
                out.extend(int(x) for x in iter(dataset))
            except BaseException as err:  # reported below
                errs.append(err)

        threads = [
            threading.Thread(target=consume, args=(d, o), daemon=True)
            for d, o in zip(datasets, outs, strict=True)
        ]
        for t in threads:
            t.start()
        for target in (n // 4, n // 2):
            wait_until(lambda t=target: len(outs[0]) + len(outs[1]) >= t, 60, f"{target} elements")
            _kill_one(cluster, rng)
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads), "a consumer did not finish"
        assert not errs, errs
    assert sorted(outs[0] + outs[1]) == list(range(n))
    assert outs[0] and outs[1], "one consumer read nothing: not a shared read"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_each_element_once_across_a_fault_tolerant_dispatcher_restart(
    servers: Servers, tmp_path, seed: int
) -> None:
    """SIGKILL the fault-tolerant dispatcher at a random point of the epoch and
    restart it on its work_dir: the leases come back from the journal, the
    consumer and the workers tell it the rest, and nothing is lost or doubled
    (the default DYNAMIC mode may lose the batch of splits in flight:
    test_ft_dispatcher_restart.py)."""
    n = 2000
    rng = random.Random(seed)
    work_dir = str(tmp_path / "wd")
    dispatcher = servers.dispatcher(work_dir=work_dir, fault_tolerant=True)
    servers.workers(dispatcher, 2)
    dataset = ds.Dataset.range(n).map(_slow(0.001))
    dataset = dataset.apply(
        ds.distribute(DYNAMIC, dispatcher.target, client_timeout_ms=60_000, exactly_once=True)
    )
    kill_at = rng.randrange(n // 10, n - n // 10)
    got: list[int] = []
    restarted: dict = {}

    def restart(port: int) -> None:
        time.sleep(rng.uniform(0.0, 0.5))
        restarted["d"] = servers.dispatcher(port=port, work_dir=work_dir, fault_tolerant=True)

    thread = None
    for x in dataset:
        if len(got) == kill_at:
            dispatcher.kill()
            thread = threading.Thread(target=restart, args=(dispatcher.port,), daemon=True)
            thread.start()
        got.append(int(x))
    assert thread is not None
    thread.join(60)
    counts = collections.Counter(got)
    assert not [k for k, c in counts.items() if c > 1], "an element was delivered twice"
    assert sorted(got) == list(range(n)), f"missing {sorted(set(range(n)) - set(got))[:20]}"


# ------------------------------------------------------------------ per split
def _write_tfrecords(directory, files: int, records: int) -> list[str]:
    paths = []
    for f in range(files):
        path = os.path.join(str(directory), f"part-{f}.tfrecord")
        with ds.io.TFRecordWriter(path) as w:
            for r in range(records):
                w.write(f"{f}:{r}".encode())
        paths.append(path)
    return paths


@pytest.mark.timeout(120)
def test_batches_of_a_file_source_stay_within_one_file(tmp_path) -> None:
    """The pipeline runs once per split: a TFRecord file's records are batched
    together, and a batch never mixes two files."""
    paths = _write_tfrecords(tmp_path, files=6, records=10)
    dispatcher = ds.DispatchServer()
    workers = [ds.WorkerServer(ds.WorkerConfig(dispatcher.target)) for _ in range(2)]
    try:
        dataset = ds.TFRecordDataset(paths).batch(4)
        dataset = dataset.apply(ds.distribute(DYNAMIC, dispatcher.target, exactly_once=True))
        batches = [[bytes(b).decode() for b in batch] for batch in dataset]
    finally:
        for w in workers:
            w.stop()
        dispatcher.stop()
    records = sorted(r for batch in batches for r in batch)
    assert records == sorted(f"{f}:{r}" for f in range(6) for r in range(10))
    for batch in batches:
        assert len({r.split(":")[0] for r in batch}) == 1, batch
    assert sorted(len(b) for b in batches) == sorted([4, 4, 2] * 6)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: ds.Dataset.range(10).batch(2), ["`batch` over `range`", "one element"]),
        (
            lambda: ds.Dataset.from_tensor_slices(np.arange(10)).shuffle(4, seed=1),
            ["`shuffle` over `from_tensor_slices`"],
        ),
        (lambda: ds.Dataset.range(10).repeat(2), ["`repeat`", "once per split"]),
        (lambda: ds.Dataset.range(10).take(3), ["`take`"]),
        (
            lambda: ds.Dataset.zip((ds.Dataset.range(4), ds.Dataset.range(4))),
            ["one splittable source", "has 2"],
        ),
    ],
)
def test_pipelines_it_cannot_run_per_split_are_refused_naming_the_op(make, words) -> None:
    with pytest.raises(errors.InvalidArgumentError) as info:
        make().apply(ds.distribute(DYNAMIC, "127.0.0.1:1", exactly_once=True))
    for word in words:
        assert word in str(info.value), str(info.value)


def test_a_batch_after_a_flat_map_over_one_element_splits_is_allowed() -> None:
    dataset = ds.Dataset.range(4).flat_map(lambda x: ds.Dataset.range(3)).batch(2)
    dataset.apply(ds.distribute(DYNAMIC, "127.0.0.1:1", exactly_once=True))  # no error


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"processing_mode": ds.ShardingPolicy.OFF}, ["needs ShardingPolicy.DYNAMIC", "OFF"]),
        (
            {"job_name": "j", "num_consumers": 2, "consumer_index": 0},
            ["cannot be combined with `num_consumers`"],
        ),
        ({"exactly_once": 1}, ["must be a bool"]),
    ],
)
def test_bad_exactly_once_arguments_are_refused(kw, words) -> None:
    args = {"processing_mode": DYNAMIC, "service": "127.0.0.1:1", "exactly_once": True, **kw}
    with pytest.raises(ValueError) as info:
        ds.distribute(**args)
    for word in words:
        assert word in str(info.value)


@pytest.mark.timeout(60)
def test_from_dataset_id_refuses_a_registered_pipeline_it_cannot_run() -> None:
    dispatcher = ds.DispatchServer()
    try:
        dataset_id = ds.register_dataset(dispatcher.target, ds.Dataset.range(10).batch(2))
        dataset = ds.from_dataset_id(DYNAMIC, dispatcher.target, dataset_id, exactly_once=True)
        with pytest.raises(errors.InvalidArgumentError, match="`batch` over `range`"):
            next(iter(dataset))
        # A job's exactly_once cannot change under its name.
        worker = ds.WorkerServer(ds.WorkerConfig(dispatcher.target))
        try:
            eo_id = ds.register_dataset(dispatcher.target, ds.Dataset.range(10))
            first = iter(
                ds.from_dataset_id(
                    DYNAMIC, dispatcher.target, eo_id, job_name="k", exactly_once=True
                )
            )
            assert int(next(first)) in range(10)
            plain = ds.from_dataset_id(DYNAMIC, dispatcher.target, eo_id, job_name="k")
            with pytest.raises(errors.InvalidArgumentError, match="exactly_once"):
                next(iter(plain))
            first.close()
        finally:
            worker.stop()
    finally:
        dispatcher.stop()


@pytest.mark.timeout(300)
def test_a_resumed_exactly_once_read_survives_a_dispatcher_restart(
    servers: Servers, tmp_path
) -> None:
    """Checkpoint an exactly-once read, resume it, and SIGKILL the fault-tolerant
    dispatcher during the resumed read: before + after is the epoch, once."""
    n = 1500
    rng = random.Random(11)
    work_dir = str(tmp_path / "wd")
    dispatcher = servers.dispatcher(work_dir=work_dir, fault_tolerant=True)
    servers.workers(dispatcher, 2)

    def make() -> ds.Dataset:
        return (
            ds.Dataset.range(n)
            .map(_slow(0.001))
            .apply(
                ds.distribute(
                    DYNAMIC,
                    dispatcher.target,
                    job_name="train",
                    client_timeout_ms=60_000,
                    exactly_once=True,
                )
            )
        )

    it = iter(make())
    before = [int(next(it)) for _ in range(rng.randrange(100, n // 2))]
    state = it.state_dict()
    it.close()
    resumed = make()
    resumed.load_state_dict(state)
    kill_at = rng.randrange(50, (n - len(before)) // 2)
    after: list[int] = []
    restarted: dict = {}

    def restart(port: int) -> None:
        time.sleep(rng.uniform(0.0, 0.5))
        restarted["d"] = servers.dispatcher(port=port, work_dir=work_dir, fault_tolerant=True)

    thread = None
    for x in resumed:
        if len(after) == kill_at:
            dispatcher.kill()
            thread = threading.Thread(target=restart, args=(dispatcher.port,), daemon=True)
            thread.start()
        after.append(int(x))
    assert thread is not None
    thread.join(60)
    assert sorted(before + after) == list(range(n))


def _shared_eo(target: str, n: int, protocol: str | None, name: str = "shared") -> ds.Dataset:
    return ds.Dataset.range(n).apply(
        ds.distribute(
            DYNAMIC,
            target,
            job_name=name,
            exactly_once=True,
            data_transfer_protocol=protocol,
        )
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("how", "protocol"),
    [
        ("close", None),
        pytest.param("close", "grpc", marks=pytest.mark.slow),
        pytest.param("del", None, marks=pytest.mark.slow),
        ("del", "grpc"),
    ],
    ids=["close-None", "close-grpc", "del-None", "del-grpc"],
)
def test_a_consumer_leaving_mid_epoch_leaves_what_it_did_not_return_to_the_others(
    how, protocol
) -> None:
    """Three consumers of one named job; one leaves after 300 elements, with
    elements fetched and not returned and receipts not yet reported: the other
    two finish the epoch (they used to wait forever for splits whose receipts
    only the leaver had), and the three together got each element once."""
    n = 6000
    with ds.LocalCluster(num_workers=2) as cluster:
        iterators = [iter(_shared_eo(cluster.target, n, protocol)) for _ in range(3)]
        got: list[list[int]] = [[], [], []]
        for _ in range(300):
            for it, out in zip(iterators, got, strict=True):
                out.append(int(next(it)))
        if how == "close":
            iterators[0].close()
        else:
            del iterators[0]  # closed by its finalizer
            iterators.insert(0, None)  # type: ignore[arg-type]
        errs: list[BaseException] = []

        def rest(i: int) -> None:
            try:
                got[i].extend(int(x) for x in iterators[i])
            except BaseException as err:  # reported below
                errs.append(err)

        threads = [threading.Thread(target=rest, args=(i,), daemon=True) for i in (1, 2)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        took = time.monotonic() - start
        assert not any(t.is_alive() for t in threads), (
            f"the remaining consumers did not finish: {len(got[1])} and {len(got[2])} read"
        )
        assert not errs, errs
    counts = collections.Counter(got[0] + got[1] + got[2])
    twice = sorted(k for k, c in counts.items() if c > 1)
    missing = sorted(set(range(n)) - set(counts))
    assert not twice, f"delivered more than once: {twice[:20]} ({len(twice)} in all)"
    assert not missing, f"never delivered: {missing[:20]} ({len(missing)} in all)"
    assert len(got[0]) == 300 and got[1] and got[2]
    report(f"exactly-once, one of 3 consumers left ({how}, {protocol or 'shm'}): rest {took:.1f} s")


_CRASHING_CONSUMER = """
import sys
import dataservice as ds
dataset = ds.Dataset.range(int(sys.argv[2])).apply(ds.distribute(
    ds.ShardingPolicy.DYNAMIC, sys.argv[1], job_name="shared", exactly_once=True))
for x in dataset:
    print(int(x), flush=True)
"""


@pytest.mark.timeout(180)
def test_a_consumer_killed_mid_epoch_does_not_stall_the_others(tmp_path) -> None:
    """A consumer process SIGKILLed mid-epoch: once the dispatcher times it out
    (client_timeout_ms), the splits whose elements it received and never
    reported run again for the other consumer, which finishes; nothing it
    printed (delivered) reaches the other one. What it received and had not
    returned when killed is gone with it: at most its read-ahead."""
    import subprocess
    import sys

    n = 20000
    config = ds.DispatcherConfig(client_timeout_ms=3000)
    with ds.LocalCluster(num_workers=2, dispatcher_config=config) as cluster:
        script = tmp_path / "consumer.py"
        script.write_text(_CRASHING_CONSUMER)
        child = subprocess.Popen(
            [sys.executable, str(script), cluster.target, str(n)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "DATASERVICE_AUTH_TOKEN": cluster.auth_token or ""},
        )
        assert child.stdout is not None
        it = iter(_shared_eo(cluster.target, n, None))
        try:
            mine: list[int] = [int(next(it))]
            theirs = [int(child.stdout.readline())]
            while len(theirs) < 2000:
                theirs.append(int(child.stdout.readline()))
                mine.append(int(next(it)))
            child.send_signal(signal.SIGKILL)
            theirs.extend(int(line) for line in child.stdout.read().split())
            child.wait(10)
            start = time.monotonic()
            mine.extend(int(x) for x in it)
            took = time.monotonic() - start
        finally:
            it.close()
            child.kill()
            child.wait(10)
    assert len(set(mine)) == len(mine) and len(set(theirs)) == len(theirs)
    twice = set(mine) & set(theirs)
    missing = set(range(n)) - set(mine) - set(theirs)
    # What it delivered after its last heartbeat (about a second of its reading)
    # was reported by nobody: those splits ran again for the other consumer.
    assert len(twice) <= 1500, f"{len(twice)} delivered twice"
    # What it received and reported and had not returned: its read-ahead.
    assert len(missing) <= 1000, f"{len(missing)} never delivered"
    assert took < 60, f"the other consumer took {took:.0f} s to finish"
    report(
        f"exactly-once, a consumer SIGKILLed after {len(theirs)}: the other finished in "
        f"{took:.1f} s; {len(twice)} elements reached both, {len(missing)} went with it"
    )
