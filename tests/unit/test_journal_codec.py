"""The journal's protobuf format (rpc/journal.proto, dispatcher/journal_codec.py):
every update and the whole DispatcherState round-trip exactly, replaying a
journal (with or without a snapshot) rebuilds the state applied in memory, and
a record whose CRC holds but whose data is not a JournalRecord is damage naming
the file and offset."""

from __future__ import annotations

import dataclasses
import os
import pickle
import tempfile
import typing

import hypothesis.strategies as hs
import pytest
from hypothesis import HealthCheck, given, settings

from dataservice import _core, errors
from dataservice.dispatcher import journal_codec as codec
from dataservice.dispatcher import state as st
from dataservice.dispatcher.journal import Journal
from dataservice.rpc import journal_pb2 as pb
from dataservice.sharding import ShardingPolicy

INT64 = hs.integers(-(2**63), 2**63 - 1)
TEXT = hs.text(max_size=20)
IDS = hs.integers(0, 2**40)


def _fields(message: type) -> set[str]:
    return {f.name for f in message.DESCRIPTOR.fields}


# ------------------------------------------------------------------ coverage
def test_every_update_kind_has_a_record_field():
    kinds = set(typing.get_args(st.Update))
    assert set(codec.ONEOF_FIELD) == kinds
    oneof = pb.JournalRecord.DESCRIPTOR.oneofs_by_name["update"]
    assert {f.name for f in oneof.fields} == set(codec.ONEOF_FIELD.values())
    for cls, name in codec.ONEOF_FIELD.items():
        message = pb.JournalRecord.DESCRIPTOR.fields_by_name[name].message_type
        assert message.name == cls.__name__
        dataclass_fields = {f.name for f in dataclasses.fields(cls)}
        assert {f.name for f in message.fields} == dataclass_fields, cls.__name__


def test_every_state_field_has_a_snapshot_field():
    # Private attributes are indexes derived from the others (the loader rebuilds them:
    # `_assert_same_state`), not journaled.
    public = {name for name in vars(st.DispatcherState()) if not name.startswith("_")}
    assert public == _fields(pb.Snapshot) - {"format_version"}
    for cls, message in ((st.Dataset, pb.Dataset), (st.Job, pb.Job), (st.Task, pb.Task)):
        assert {f.name for f in dataclasses.fields(cls)} == _fields(message), cls.__name__
    # Iteration's dicts and set have their own representation (journal.proto).
    iteration_fields = {f.name for f in dataclasses.fields(st.Iteration)}
    assert iteration_fields == {
        "iteration_id",
        "job_id",
        "repetition",
        "seed",
        "tasks",  # task_ids
        "clients",  # client_ids
        "splits_produced",  # split_providers
        "splits_ended_by_provider",  # split_providers
        "num_split_providers",
        "finished",
        "ever_had_client",
        "garbage_collected",
        "rounds",  # round_numbers, round_task_ids
        "consumer_hosts",
        "leases",  # leases (SplitLeaseEntry)
    }


def test_sharding_policy_enum_matches():
    values = {v.name: v.number for v in pb.ShardingPolicy.DESCRIPTOR.values}
    assert values == {f"SHARDING_POLICY_{p.name}": p.value for p in ShardingPolicy}


# ------------------------------------------------------------------ updates
def _non_default_updates() -> list[st.Update]:
    """One of each kind, every field away from its default."""
    return [
        st.SetIncarnation("inc-\u00e9"),
        st.RegisterDataset("ds/1", "f" * 64, b"\x00spec\xff", -2, True, "d" * 64, "ZSTD"),
        st.CreateJob(
            st.JobId(1001), "ds/1", "job", ShardingPolicy.HINT, 3, "ANY", "host", True, 4, True
        ),
        st.CreateIteration(st.IterationId(2001), st.JobId(1001), 4, 2**62 - 1, 3),
        st.AcquireIterationClient(st.IterationClientId(3001), st.IterationId(2001), "host-a"),
        st.ReleaseIterationClient(st.IterationClientId(3001)),
        st.CreateTask(st.TaskId(4001), st.IterationId(2001), "w:1", -1, "host-a"),
        st.FinishTask(st.TaskId(4001)),
        st.RemoveTask(st.TaskId(4002)),
        st.ReviveTask(st.TaskId(4003)),
        st.DrainTask(st.TaskId(4004)),
        st.ProduceSplits(st.IterationId(2001), 17, True, 2),
        st.AssignRounds(st.IterationId(2001), 96, (st.TaskId(4001), st.TaskId(4002))),
        st.GarbageCollectJob(st.JobId(1001)),
        st.GarbageCollectIteration(st.IterationId(2001)),
        st.RetireJob(st.JobId(1001)),
        st.LeaseSplits(st.IterationId(2001), st.TaskId(4001), (3, 4), (7, 9), ("a", "b")),
        st.SplitsProduced(st.IterationId(2001), (3, 4), (0, 12)),
        st.CompleteSplits(st.IterationId(2001), (3,)),
    ]


def test_non_default_updates_round_trip_exactly():
    updates = _non_default_updates()
    assert {type(u) for u in updates} == set(typing.get_args(st.Update))
    for u in updates:
        for f in dataclasses.fields(u):  # the example really is away from the defaults
            if f.default is not dataclasses.MISSING:
                assert getattr(u, f.name) != f.default, (u, f.name)
        back = codec.decode_update(codec.encode_update(u))
        assert back == u and type(back) is type(u)
        for f in dataclasses.fields(u):  # plain values, and processing_mode as the enum
            want = getattr(u, f.name)
            plain = int if isinstance(want, int) and not isinstance(want, bool) else type(want)
            if f.name == "processing_mode":
                plain = ShardingPolicy
            assert type(getattr(back, f.name)) is plain, (u, f.name)


def test_all_default_updates_round_trip():
    """A record whose fields are all zero values still names its kind."""
    zero = {int: 0, str: "", bytes: b"", bool: False, tuple: ()}
    for cls in codec.ONEOF_FIELD:
        u = cls(**{f.name: zero[_kind(f)] for f in dataclasses.fields(cls)})
        assert codec.decode_update(codec.encode_update(u)) == u


def _kind(f: dataclasses.Field) -> type:
    """The runtime type of a dataclass field (annotations are strings here)."""
    text = str(f.type)
    for name, kind in (("tuple", tuple), ("bytes", bytes), ("bool", bool), ("str", str)):
        if text.startswith(name):
            return kind
    return int


def _update_strategy(cls: type) -> hs.SearchStrategy:
    kinds = {
        int: INT64,
        str: TEXT,
        bytes: hs.binary(max_size=40),
        bool: hs.booleans(),
        tuple: hs.lists(INT64, max_size=6).map(tuple),
    }
    fields = {}
    for f in dataclasses.fields(cls):
        policies = hs.sampled_from(ShardingPolicy)
        fields[f.name] = policies if f.name == "processing_mode" else kinds[_kind(f)]
        if str(f.type).startswith("tuple[str"):
            fields[f.name] = hs.lists(TEXT, max_size=6).map(tuple)
    return hs.builds(cls, **fields)


ANY_UPDATE = hs.one_of([_update_strategy(cls) for cls in codec.ONEOF_FIELD])


@given(ANY_UPDATE)
@settings(max_examples=300, deadline=None)
def test_any_update_round_trips_exactly(u):
    assert codec.decode_update(codec.encode_update(u)) == u


def test_processing_mode_round_trips_as_the_enum():
    for mode in ShardingPolicy:
        u = st.CreateJob(st.JobId(1000), "d", "", mode, 0, "AUTO", "")
        record = codec.update_to_proto(u)
        assert record.create_job.processing_mode == mode.value
        back = codec.decode_update(record.SerializeToString())
        assert back == u and back.processing_mode is mode


@pytest.mark.parametrize("value", [99, 6, -7])
def test_an_unknown_processing_mode_is_a_codec_error_naming_it(value):
    """A value this version has no policy for (a newer dataservice's, or damage)
    stops the replay naming the value and the valid policies, in a record and in
    a snapshot; it is never written either."""
    record = pb.JournalRecord(format_version=codec.FORMAT_VERSION)
    record.create_job.processing_mode = value
    valid = r"0 \(OFF\), 1 \(DYNAMIC\), 2 \(FILE\), 3 \(DATA\), 4 \(FILE_OR_DATA\), 5 \(HINT\)"
    with pytest.raises(codec.CodecError, match=rf"create_job's processing_mode: {value} .*{valid}"):
        codec.decode_update(record.SerializeToString())
    snapshot = pb.Snapshot(format_version=codec.FORMAT_VERSION)
    snapshot.jobs.add(job_id=1000, processing_mode=value)
    with pytest.raises(codec.CodecError, match=rf"job 1000's processing_mode: {value} .*{valid}"):
        codec.decode_snapshot(snapshot.SerializeToString())
    with pytest.raises(ValueError, match=rf"{value} is not a ShardingPolicy value .*{valid}"):
        codec.encode_update(st.CreateJob(st.JobId(1000), "d", "", value, 0, "AUTO", ""))


# ------------------------------------------------------------------ scenarios
@hs.composite
def scenarios(draw, max_steps: int = 20) -> list[st.Update]:
    """A valid run: updates in an order the dispatcher could produce (each
    refers to entities that exist), with arbitrary values otherwise."""
    shadow = st.DispatcherState()
    updates: list[st.Update] = []
    # Cheap draws (an index, a small alphabet): shrinking a failure replays
    # this thousands of times.
    text = hs.text(alphabet="ab/\u00e9", max_size=6)

    def pick(choices: list) -> typing.Any:
        return choices[draw(hs.integers(0, len(choices) - 1))]

    def add(u: st.Update) -> None:
        shadow.apply(u)
        updates.append(u)

    add(st.SetIncarnation(draw(text)))
    for _ in range(draw(hs.integers(0, max_steps))):
        kinds = ["dataset", "job", "incarnation", "release"]
        if shadow.jobs:
            kinds += ["iteration", "gc", "retire"]
        if shadow.iterations:
            kinds += ["client", "task", "splits", "rounds", "gc_iteration", "lease", "complete"]
        if shadow.tasks:
            kinds += ["finish", "remove", "revive", "drain"]
        kind = pick(kinds)
        job_ids = sorted(shadow.jobs)
        iteration_ids = sorted(shadow.iterations)
        task_ids = sorted(shadow.tasks)
        if kind == "incarnation":
            add(st.SetIncarnation(draw(text)))
        elif kind == "dataset":
            auto = draw(hs.booleans())
            dataset_id = (
                str(shadow.next_dataset_number + draw(hs.integers(0, 3)))
                if auto and draw(hs.booleans())
                else draw(text)
            )
            add(
                st.RegisterDataset(
                    dataset_id,
                    pick(["fp1", "fp2", "fp3"]),
                    draw(hs.binary(max_size=16)),
                    draw(hs.integers(-2, 100)),
                    auto,
                )
            )
        elif kind == "job":
            add(
                st.CreateJob(
                    st.JobId(shadow.next_job_id + draw(hs.integers(0, 2))),
                    draw(text),
                    pick(["", "", "a", "b"]),
                    pick(list(ShardingPolicy)),
                    draw(hs.integers(0, 4)),
                    pick(["AUTO", "ANY", "LOCAL"]),
                    draw(text),
                    draw(hs.booleans()),
                    draw(hs.integers(0, 3)),
                    draw(hs.booleans()),
                )
            )
        elif kind == "iteration":
            add(
                st.CreateIteration(
                    st.IterationId(shadow.next_iteration_id),
                    pick(job_ids),
                    draw(hs.integers(0, 3)),
                    draw(hs.integers(0, 2**62)),
                    draw(hs.integers(1, 3)),
                )
            )
        elif kind == "gc":
            add(st.GarbageCollectJob(pick(job_ids)))
        elif kind == "retire":
            add(st.RetireJob(pick(job_ids)))
        elif kind == "gc_iteration":
            add(st.GarbageCollectIteration(pick(iteration_ids)))
        elif kind == "client":
            add(
                st.AcquireIterationClient(
                    st.IterationClientId(shadow.next_client_id),
                    pick(iteration_ids),
                    pick(["", "h1", "h2"]),
                )
            )
        elif kind == "release":
            candidates = [*shadow.clients, 3_999_999]  # and one that does not exist
            add(st.ReleaseIterationClient(pick(candidates)))
        elif kind == "task":
            add(
                st.CreateTask(
                    st.TaskId(shadow.next_task_id),
                    pick(iteration_ids),
                    pick(["w:1", "w:2", "w:3"]),
                    draw(hs.integers(-1, 3)),
                    pick(["", "h1", "h2"]),
                )
            )
        elif kind == "splits":
            add(
                st.ProduceSplits(
                    pick(iteration_ids),
                    draw(hs.integers(0, 50)),
                    draw(hs.booleans()),
                    draw(hs.integers(0, 2)),
                )
            )
        elif kind == "lease":
            ordinals = tuple(draw(hs.lists(hs.integers(0, 9), max_size=3, unique=True)))
            as_str = draw(hs.booleans())
            add(
                st.LeaseSplits(
                    pick(iteration_ids),
                    pick([*task_ids, 4000]),
                    ordinals,
                    () if as_str else tuple(o * 10 for o in ordinals),
                    tuple(f"f{o}" for o in ordinals) if as_str else (),
                )
            )
            if ordinals and draw(hs.booleans()):
                add(st.SplitsProduced(updates[-1].iteration_id, ordinals[:1], (5,)))
        elif kind == "complete":
            add(st.CompleteSplits(pick(iteration_ids), (draw(hs.integers(0, 9)),)))
        elif kind == "rounds":
            add(
                st.AssignRounds(
                    pick(iteration_ids),
                    draw(hs.integers(0, 40)),
                    tuple(pick([*task_ids, 4000]) for _ in range(draw(hs.integers(0, 4)))),
                )
            )
        else:
            cls = {
                "finish": st.FinishTask,
                "remove": st.RemoveTask,
                "revive": st.ReviveTask,
                "drain": st.DrainTask,
            }
            add(cls[kind](pick([*task_ids, 4_999_999])))
    return updates


def _applied(updates: list[st.Update]) -> st.DispatcherState:
    state = st.DispatcherState()
    for u in updates:
        state.apply(u)
    return state


def _same(got: object, want: object, what: str) -> None:
    # Not `assert got == want`: pytest's diff of two whole states, made for
    # every failing example hypothesis tries while shrinking, takes minutes.
    if got != want:
        raise AssertionError(f"{what} differs:\n got {got!r:.2000}\nwant {want!r:.2000}")


def _assert_same_state(got: st.DispatcherState, want: st.DispatcherState) -> None:
    """Equal, in the same order, with each task one object (as `apply` builds it)."""
    _same(set(vars(got)), set(vars(want)), "the attributes")
    for name, value in vars(want).items():
        if name.startswith("_"):
            continue  # a derived index, pruned as it is read: compared by what it answers
        _same(getattr(got, name), value, name)
        if isinstance(value, dict):
            _same(list(getattr(got, name)), list(value), f"the order of {name}")
    for it in got.iterations.values():
        want_it = want.iterations[it.iteration_id]
        _same(list(it.tasks), list(want_it.tasks), f"the order of iteration {it.iteration_id}")
        _same(list(it.rounds), list(want_it.rounds), f"the rounds of {it.iteration_id}")
        for task_id, task in it.tasks.items():
            if task is not got.tasks[task_id]:
                raise AssertionError(f"task {task_id} is two objects")
    _same(got.unfinished_iterations(), want.unfinished_iterations(), "the unfinished iterations")
    for address in {t.worker_address for t in want.tasks.values()}:
        got_live = got.tasks_of_worker(address)
        _same(got_live, want.tasks_of_worker(address), f"the live tasks of {address}")
        for task in got_live:
            if task is not got.tasks[task.task_id]:
                raise AssertionError(f"task {task.task_id} is two objects")
    for job in got.jobs.values():
        want_job = want.jobs[job.job_id]
        _same(list(job.iterations), list(want_job.iterations), f"job {job.job_id}")


@given(scenarios())
@settings(max_examples=150, deadline=None)
def test_snapshot_round_trips_exactly(updates):
    want = _applied(updates)
    _assert_same_state(codec.decode_snapshot(codec.encode_snapshot(want)), want)


def test_rich_snapshot_round_trips_exactly():
    """A hand-built state with every collection non-empty and every flag set."""
    # Up to CreateTask; the HINT job without shards (with them, its iteration would stay
    # open for the unread ones: DispatcherState.unread_shards); a job with shards below.
    updates = _non_default_updates()[:7]
    no_shards = [
        dataclasses.replace(u, num_shards=0) if isinstance(u, st.CreateJob) else u for u in updates
    ]
    state = _applied(no_shards)
    for u in [
        st.CreateJob(st.JobId(1002), "ds/1", "", ShardingPolicy.DATA, 0, "ANY", "h", False, 3),
        st.CreateTask(st.TaskId(4002), st.IterationId(2001), "w:2", 1, "host-b"),
        st.AcquireIterationClient(st.IterationClientId(3002), st.IterationId(2001), "host-b"),
        st.ProduceSplits(st.IterationId(2001), 5, False, 0),
        st.ProduceSplits(st.IterationId(2001), 7, True, 2),
        st.AssignRounds(st.IterationId(2001), 10, (st.TaskId(4002), st.TaskId(4001))),
        st.RemoveTask(st.TaskId(4002)),
        st.FinishTask(st.TaskId(4001)),
        st.RegisterDataset("1005", "fp", b"", -1, True),
    ]:
        state.apply(u)
    it = state.iterations[2001]
    assert it.finished and it.clients and it.rounds and it.splits_ended_by_provider
    assert state.jobs_by_name and state.datasets_by_fingerprint and state.clients
    assert state.client_hosts == {3002: "host-b"} and it.consumer_hosts == ["host-a", "host-b"]
    assert state.next_dataset_number == 1006
    assert state.jobs[1002].num_shards == 3
    _assert_same_state(codec.decode_snapshot(codec.encode_snapshot(state)), state)


def test_local_only_iteration_ends_per_host_and_the_snapshot_keeps_it():
    """A job that reads only local workers (LOCAL, or AUTO with static
    sharding): each host's part of an iteration ends with that host's tasks,
    the iteration itself stays open for consumers on other hosts; a snapshot
    keeps every host's tasks and consumers, so the restored state agrees."""
    for target, mode in (("LOCAL", ShardingPolicy.OFF), ("AUTO", ShardingPolicy.DATA)):
        state = _applied(
            [
                st.RegisterDataset("d", "fp", b"", 20, False),
                st.CreateJob(st.JobId(1000), "d", "shared", mode, 0, target, "host-a"),
                st.CreateIteration(st.IterationId(2000), st.JobId(1000), 0, 7),
                st.AcquireIterationClient(st.IterationClientId(3000), 2000, "host-a"),
                st.CreateTask(st.TaskId(4000), st.IterationId(2000), "a:1", 0, "host-a"),
                st.CreateTask(st.TaskId(4001), st.IterationId(2000), "a:2", 1, "host-a"),
                st.AcquireIterationClient(st.IterationClientId(3001), 2000, "host-b"),
                st.CreateTask(st.TaskId(4002), st.IterationId(2000), "b:1", 2, "host-b"),
                st.FinishTask(st.TaskId(4000)),
                st.RemoveTask(st.TaskId(4001)),  # lost: host-a's part ends without it
            ]
        )
        for restored in (state, codec.decode_snapshot(codec.encode_snapshot(state))):
            it = restored.iterations[2000]
            assert restored.jobs[1000].reads_local_workers_only
            assert it.consumer_hosts == ["host-a", "host-b"]
            assert restored.client_hosts == {3000: "host-a", 3001: "host-b"}
            assert [t.host_id for t in it.tasks.values()] == ["host-a"] * 2 + ["host-b"]
            assert restored.host_part_finished(it, "host-a")
            assert not restored.host_part_finished(it, "host-b")
            assert not restored.host_part_finished(it, "host-c")  # no task there yet
            assert not it.finished
        state.apply(st.FinishTask(st.TaskId(4002)))
        assert state.host_part_finished(state.iterations[2000], "host-b")
        assert not state.iterations[2000].finished  # a consumer on host-c may still come
    # ANY (and AUTO without static sharding) reads every worker: one end for all.
    state = _applied(
        [
            st.RegisterDataset("d", "fp", b"", 20, False),
            st.CreateJob(st.JobId(1000), "d", "any", ShardingPolicy.OFF, 0, "AUTO", "host-a"),
            st.CreateIteration(st.IterationId(2000), st.JobId(1000), 0, 7),
            st.CreateTask(st.TaskId(4000), st.IterationId(2000), "a:1", 0, "host-a"),
            st.FinishTask(st.TaskId(4000)),
        ]
    )
    assert not state.jobs[1000].reads_local_workers_only and state.iterations[2000].finished


def test_a_task_cut_short_by_draining_does_not_end_its_iteration():
    """DrainTask (dispatcher/retire.py): a draining worker's task ends with the
    iteration's splits not all handed out, so its end is not the iteration's;
    a task that ran to the end of the splits is, and a snapshot keeps the mark."""
    updates = [
        st.RegisterDataset("d", "fp", b"", 20, False),
        st.CreateJob(st.JobId(1000), "d", "j", ShardingPolicy.DYNAMIC, 0, "AUTO", "h"),
        st.CreateIteration(st.IterationId(2000), st.JobId(1000), 0, 7),
        st.CreateTask(st.TaskId(4000), st.IterationId(2000), "a:1", -1, "h"),
        st.ProduceSplits(st.IterationId(2000), 3, False, 0),
        st.DrainTask(st.TaskId(4000)),
        st.FinishTask(st.TaskId(4000)),
    ]
    state = _applied(updates)
    restored = codec.decode_snapshot(codec.encode_snapshot(state))
    for s in (state, restored):
        assert s.tasks[4000].drained and s.tasks[4000].finished
        assert not s.iterations[2000].finished, "the splits left would be lost"
        s.apply(st.CreateTask(st.TaskId(4001), st.IterationId(2000), "a:1", -1, "h"))
        s.apply(st.ProduceSplits(st.IterationId(2000), 17, True, 0))
        s.apply(st.FinishTask(st.TaskId(4001)))
        assert s.iterations[2000].finished


@given(scenarios(), hs.data())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_replay_with_a_snapshot_rebuilds_the_applied_state(updates, data):
    """Journal every update (a snapshot after some of them), then load and
    replay as the dispatcher's start-up does: the state applied in memory."""
    cut = data.draw(hs.integers(0, len(updates)), label="snapshot after")
    want = _applied(updates)
    with tempfile.TemporaryDirectory() as work_dir:
        journal = Journal(work_dir)
        live = st.DispatcherState()
        for u in updates[:cut]:
            journal.append(u)
            live.apply(u)
        if cut:
            journal.snapshot(live)
        for u in updates[cut:]:
            journal.append(u)
        journal.close()
        # The snapshot holds the updates before `cut`; the segment after it, the rest.
        restored = Journal(work_dir).load_snapshot()
        if cut:
            assert restored is not None
            _assert_same_state(restored, _applied(updates[:cut]))
        else:
            assert restored is None
        state = restored or st.DispatcherState()
        for u in Journal(work_dir).replay():
            state.apply(u)
        _assert_same_state(state, want)


# ------------------------------------------------------------------ damage
def _write_records(work_dir: str, records: list[bytes]) -> str:
    os.makedirs(os.path.join(work_dir, "journal"), exist_ok=True)
    path = os.path.join(work_dir, "journal", "segment-000000.tfrecord")
    writer = _core.TFRecordWriter(path)
    for r in records:
        writer.write(r)
    writer.close()
    return path


def _replay_all(work_dir: str) -> list[st.Update]:
    return list(Journal(work_dir).replay())


GOOD = codec.encode_update(st.SetIncarnation("x"))
NO_UPDATE = pb.JournalRecord(format_version=codec.FORMAT_VERSION).SerializeToString()
NEWER = codec.update_to_proto(st.FinishTask(st.TaskId(4000)))
NEWER.format_version = codec.FORMAT_VERSION + 1
OLDER = codec.update_to_proto(st.FinishTask(st.TaskId(4000)))
OLDER.format_version = 1  # before consumers' and tasks' host ids


@pytest.mark.parametrize(
    "bad, reason",
    [
        (b"\xff\xff\xff\xff", "does not parse"),
        (NO_UPDATE, "no update this dispatcher knows"),
        (NEWER.SerializeToString(), f"format version {codec.FORMAT_VERSION + 1}"),
        (OLDER.SerializeToString(), "version 1, and this dispatcher reads only version 2"),
    ],
    ids=["garbage", "no-update", "newer-version", "older-version"],
)
@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
def test_whole_record_that_is_not_a_journal_record_is_damage(tmp_path, bad, reason, last):
    """Its CRC holds, so it is not a torn write, wherever it is: DataLossError
    naming the file and offset, and the file is left as it is."""
    records = [GOOD, GOOD, bad] if last else [GOOD, bad, GOOD]
    path = _write_records(str(tmp_path), records)
    before = open(path, "rb").read()
    offset = 2 * (len(GOOD) + 16) if last else len(GOOD) + 16
    with pytest.raises(errors.DataLossError) as info:
        _replay_all(str(tmp_path))
    message = str(info.value)
    assert path in message and f"offset {offset}" in message and reason in message
    assert open(path, "rb").read() == before


def test_pickle_format_journal_is_rejected_clearly(tmp_path):
    path = _write_records(str(tmp_path), [pickle.dumps(st.SetIncarnation("x"), protocol=5)])
    with pytest.raises(errors.DataLossError, match=r"offset 0.*pickle") as info:
        _replay_all(str(tmp_path))
    assert path in str(info.value)


def test_pickle_snapshot_is_rejected_naming_it(tmp_path):
    os.makedirs(tmp_path / "journal")
    old = tmp_path / "journal" / "snapshot-000001.pickle"
    old.write_bytes(pickle.dumps(st.DispatcherState(), protocol=5))
    with pytest.raises(errors.DataLossError, match="pickle") as info:
        Journal(str(tmp_path)).load_snapshot()
    assert str(old) in str(info.value)


def test_snapshot_is_one_framed_record_renamed_into_place(tmp_path):
    state = _applied(_non_default_updates())
    journal = Journal(str(tmp_path))
    journal.snapshot(state)
    names = os.listdir(tmp_path / "journal")
    assert names == ["snapshot-000000.tfrecord"]  # no .tmp left
    path = str(tmp_path / "journal" / names[0])
    (record,) = list(_core.TFRecordReader(path))
    snapshot = pb.Snapshot.FromString(record)
    assert snapshot.format_version == codec.FORMAT_VERSION
    assert snapshot.incarnation_id == state.incarnation_id


@pytest.mark.parametrize("damage", ["flip", "garbage", "two-records", "empty"])
def test_unreadable_snapshot_names_the_file(tmp_path, damage):
    journal = Journal(str(tmp_path))
    journal.snapshot(_applied(_non_default_updates()))
    path = str(tmp_path / "journal" / "snapshot-000000.tfrecord")
    if damage == "flip":
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(path, "wb").write(bytes(data))
    else:
        writer = _core.TFRecordWriter(path)
        records = {"garbage": [b"\xff\xff"], "two-records": [GOOD, GOOD], "empty": []}[damage]
        for r in records:
            writer.write(r)
        writer.close()
    with pytest.raises(errors.DataLossError) as info:
        Journal(str(tmp_path)).load_snapshot()
    assert path in str(info.value)


def test_static_iteration_waits_for_every_shard_across_a_snapshot_and_replay():
    # Static sharding: one shard per listed worker; reading shard 0 alone ends nothing.
    updates = [
        st.RegisterDataset("ds", "fp", b"", 10, False),
        st.CreateJob(st.JobId(1000), "ds", "", ShardingPolicy.DATA, 0, "ANY", "h", False, 2),
        st.CreateIteration(st.IterationId(2000), st.JobId(1000), 0, 7, 1),
        st.CreateTask(st.TaskId(4000), st.IterationId(2000), "w:0", 0, "h"),
        st.FinishTask(st.TaskId(4000)),
    ]
    state = _applied(updates)
    it = state.iterations[2000]
    assert not it.finished and state.unread_shards(it) == [1]
    restored = codec.decode_snapshot(codec.encode_snapshot(state))
    assert restored.unread_shards(restored.iterations[2000]) == [1]
    for u in [
        st.CreateTask(st.TaskId(4001), st.IterationId(2000), "w:1", 1, "h"),
        st.FinishTask(st.TaskId(4001)),
    ]:
        restored.apply(codec.decode_update(codec.encode_update(u)))
    assert restored.iterations[2000].finished
    assert restored.unread_shards(restored.iterations[2000]) == []
