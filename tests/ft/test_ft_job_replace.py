"""A job replaced under its name (issue 10, item 8) is journaled (`RetireJob`):
a fault-tolerant dispatcher SIGKILLed and restarted on its work_dir has the
same jobs as before the kill, so the name still belongs to the new pipeline,
whose consumer reads on, and its live job is still refused to the old one."""

from __future__ import annotations

import pytest

import dataservice as ds
from dataservice import errors
from dataservice.dispatcher.journal import Journal
from dataservice.dispatcher.state import DispatcherState

from .conftest import Servers


def named(dataset, target):
    return dataset.apply(
        ds.distribute(ds.ShardingPolicy.OFF, target, job_name="train", client_timeout_ms=60_000)
    )


@pytest.mark.timeout(120)
def test_replaced_job_survives_a_fault_tolerant_restart(servers: Servers, tmp_path) -> None:
    work_dir = str(tmp_path / "wd")
    dispatcher = servers.dispatcher(work_dir=work_dir, fault_tolerant=True)
    servers.worker(dispatcher)
    target = dispatcher.target
    old = ds.Dataset.range(50)
    edited = ds.Dataset.range(50).map(lambda x: x * 10)

    assert [int(x) for x in named(old, target)] == list(range(50))
    it = iter(named(edited, target))  # replaces the finished job at once
    first = [int(next(it)) for _ in range(3)]
    assert first == [0, 10, 20]

    port = dispatcher.port
    dispatcher.kill()
    # What the restart replays: the old job retired, the name the edited one's.
    journal = Journal(work_dir)
    state = journal.load_snapshot() or DispatcherState()
    for update in journal.replay():
        state.apply(update)
    journal.close()
    (retired,) = [j for j in state.jobs.values() if j.retired]
    live = state.live_job_named("train")
    assert retired.job_name == "train" and retired.garbage_collected
    assert live is not None and live.job_id != retired.job_id and not live.retired
    assert all(state.iterations[i].finished for i in retired.iterations.values())
    dispatcher = servers.dispatcher(port=port, work_dir=work_dir, fault_tolerant=True)
    assert dispatcher.lines_since(0, r"replaced by a new job") == []  # replayed, not redone

    # The replayed state: "train" is the edited pipeline's job, read by `it`.
    with pytest.raises(errors.InvalidArgumentError) as info:
        next(iter(named(old, target)))
    text = str(info.value)
    assert "existing job with different parameters" in text
    assert "1 consumer(s) attached" in text
    # The consumer of the new job reads on through the restart.
    rest = [int(x) for x in it]
    assert first + rest == [10 * i for i in range(50)]
    # Once it is done, the name can go back to the old pipeline at once.
    assert [int(x) for x in named(old, target)] == list(range(50))
