"""The dispatcher journal: replay equals live state, torn tails are dropped,
damage elsewhere stops start-up naming the file and offset."""

from __future__ import annotations

import os

import pytest

import dataservice as ds
from dataservice import errors
from dataservice.dispatcher import journal as journal_module
from dataservice.dispatcher import state as st
from dataservice.dispatcher.journal import Journal
from dataservice.sharding import ShardingPolicy


def _updates() -> list:
    return [
        st.SetIncarnation("abc"),
        st.RegisterDataset("1000", "f" * 64, b"", -1, True),
        st.CreateJob(st.JobId(1000), "1000", "job", ShardingPolicy.DYNAMIC, 0, "AUTO", "host"),
        st.CreateIteration(st.IterationId(2000), st.JobId(1000), 0, 7),
        st.CreateTask(st.TaskId(4000), st.IterationId(2000), "w:1", -1),
        st.ProduceSplits(st.IterationId(2000), 16, False),
    ]


def _write(work_dir: str, updates: list) -> str:
    journal = Journal(work_dir)
    for u in updates:
        journal.append(u)
    journal.close()
    (segment,) = os.listdir(os.path.join(work_dir, "journal"))
    return os.path.join(work_dir, "journal", segment)


def _replay(work_dir: str) -> st.DispatcherState:
    state = st.DispatcherState()
    for u in Journal(work_dir).replay():
        state.apply(u)
    return state


def test_replay_rebuilds_the_live_state(tmp_path):
    live = st.DispatcherState()
    for u in _updates():
        live.apply(u)
    _write(str(tmp_path), _updates())
    replayed = _replay(str(tmp_path))
    assert replayed.incarnation_id == "abc"
    assert replayed.iterations[2000].splits_produced == live.iterations[2000].splits_produced
    assert replayed.iterations[2000].splits_produced == {0: 16}
    assert set(replayed.tasks) == {4000} and replayed.jobs[1000].job_name == "job"


def test_torn_tail_is_dropped_and_truncated(tmp_path):
    path = _write(str(tmp_path), _updates())
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 5)  # the last record's write was cut short
    replayed = _replay(str(tmp_path))
    assert replayed.iterations[2000].splits_produced == {}  # the last update is gone
    assert 4000 in replayed.tasks  # everything before it is kept
    assert os.path.getsize(path) < size - 5  # truncated to the last whole record


def test_damage_before_the_last_record_stops_start_up(tmp_path):
    path = _write(str(tmp_path), _updates())
    data = bytearray(open(path, "rb").read())
    data[30] ^= 0xFF  # inside the first records
    open(path, "wb").write(bytes(data))
    with pytest.raises(errors.DataLossError, match=r"segment-000000.tfrecord.*offset \d+"):
        _replay(str(tmp_path))


def test_empty_segment_replays_to_nothing(tmp_path):
    os.makedirs(tmp_path / "journal")
    (tmp_path / "journal" / "segment-000000.tfrecord").write_bytes(b"")
    assert _replay(str(tmp_path)).incarnation_id == ""


def test_snapshot_replaces_older_segments_and_replay_continues(tmp_path):
    work_dir = str(tmp_path)
    journal = Journal(work_dir)
    live = st.DispatcherState()
    for u in _updates():
        journal.append(u)
        live.apply(u)
    journal.snapshot(live)
    more = st.ProduceSplits(st.IterationId(2000), 8, True)
    journal.append(more)
    live.apply(more)
    journal.close()
    names = sorted(os.listdir(tmp_path / "journal"))
    assert names == ["segment-000001.tfrecord", "snapshot-000001.tfrecord"]
    restored = Journal(work_dir).load_snapshot()
    assert restored is not None
    for u in Journal(work_dir).replay():
        restored.apply(u)
    assert restored.iterations[2000].splits_produced == {0: 24}
    assert restored.iterations[2000].splits_ended
    assert restored.incarnation_id == "abc"


def test_dispatcher_snapshots_every_n_records_and_restarts_from_it(tmp_path, monkeypatch):
    """End to end through a fault-tolerant DispatchServer: after
    SNAPSHOT_EVERY_RECORDS records it writes a snapshot and deletes the
    segments it replaces; a restart loads it and replays the rest."""
    monkeypatch.setattr(journal_module, "SNAPSHOT_EVERY_RECORDS", 3)
    config = ds.DispatcherConfig(work_dir=str(tmp_path), fault_tolerant_mode=True)
    ids = [f"ds-{i}" for i in range(7)]
    with ds.DispatchServer(config) as d:
        for dataset_id in ids:
            ds.register_dataset(d.target, ds.Dataset.range(3), dataset_id=dataset_id)
        live = d._state  # the dispatcher's state (private: compared whole below)
    # SetIncarnation + 7 RegisterDataset = 8 records: snapshots after 3 and 6.
    names = sorted(os.listdir(tmp_path / "journal"))
    assert names == ["segment-000002.tfrecord", "snapshot-000002.tfrecord"], names
    with ds.DispatchServer(config) as d:
        restored = d._state
        assert list(restored.datasets) == ids
        assert vars(restored) == vars(live)


def test_short_runs_of_a_restarting_dispatcher_add_up_to_a_snapshot(tmp_path, monkeypatch):
    """Replay stays bounded when each dispatcher run writes fewer than
    SNAPSHOT_EVERY_RECORDS records: the count spans segments and restarts."""
    monkeypatch.setattr(journal_module, "SNAPSHOT_EVERY_RECORDS", 4)
    config = ds.DispatcherConfig(work_dir=str(tmp_path), fault_tolerant_mode=True)
    for run in range(3):  # each run: 1 dataset (+ SetIncarnation in the first)
        with ds.DispatchServer(config) as d:
            ds.register_dataset(d.target, ds.Dataset.range(3), dataset_id=f"ds-{run}")
    # records: SetIncarnation, ds-0 | ds-1 | ds-2 -> the 4th (run 3) snapshots
    names = sorted(os.listdir(tmp_path / "journal"))
    assert [n for n in names if n.startswith("snapshot-")] == ["snapshot-000003.tfrecord"], names
    with ds.DispatchServer(config) as d:
        assert list(d._state.datasets) == ["ds-0", "ds-1", "ds-2"]
