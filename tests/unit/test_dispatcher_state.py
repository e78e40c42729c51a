"""DispatcherState's queries against what they replace: `tasks_of_worker` looks only
at a worker's tasks that may still be live, `unfinished_iterations` only at iterations
not finished when last asked (both pruned as they are read), and must answer as a scan
of every task or iteration the dispatcher ever made would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as hs

from dataservice.dispatcher import state as st
from dataservice.sharding import ShardingPolicy
from tests.unit.test_journal_codec import scenarios


def _scan(state: st.DispatcherState, address: str) -> list[st.Task]:
    return [
        t
        for t in state.tasks.values()
        if t.worker_address == address
        and not t.finished
        and not t.removed
        and not state.iterations[t.iteration_id].finished
    ]


def _unfinished(state: st.DispatcherState) -> list[st.Iteration]:
    return [it for it in state.iterations.values() if not it.finished]


@given(scenarios(max_steps=40), hs.data())
@settings(max_examples=200, deadline=None)
def test_the_queries_answer_as_a_scan_of_every_task_and_iteration(updates, data):
    state = st.DispatcherState()
    for u in updates:
        state.apply(u)
        # Asked between updates too: a task pruned then must not be one that comes back.
        if data.draw(hs.booleans(), label="ask now"):
            for address in {t.worker_address for t in state.tasks.values()}:
                assert state.tasks_of_worker(address) == _scan(state, address)
            assert state.unfinished_iterations() == _unfinished(state)
    for address in {t.worker_address for t in state.tasks.values()} | {"nobody:1"}:
        assert state.tasks_of_worker(address) == _scan(state, address)
    assert state.unfinished_iterations() == _unfinished(state)


def test_a_removed_task_revived_is_live_again_and_a_finished_one_never():
    state = st.DispatcherState()
    for u in [
        st.RegisterDataset("d", "fp", b"", -1, False),
        st.CreateJob(st.JobId(1000), "d", "", ShardingPolicy.OFF, 0, "ANY", "h"),
        st.CreateIteration(st.IterationId(2000), st.JobId(1000), 0, 7),
        st.CreateTask(st.TaskId(4000), st.IterationId(2000), "w:1", -1, "h"),
        st.CreateTask(st.TaskId(4001), st.IterationId(2000), "w:1", -1, "h"),
        st.RemoveTask(st.TaskId(4000)),
    ]:
        state.apply(u)
    assert [t.task_id for t in state.tasks_of_worker("w:1")] == [4001]
    state.apply(st.ReviveTask(st.TaskId(4000)))
    assert [t.task_id for t in state.tasks_of_worker("w:1")] == [4000, 4001]
    state.apply(st.FinishTask(st.TaskId(4001)))
    assert [t.task_id for t in state.tasks_of_worker("w:1")] == [4000]
    assert state.task_worker_addresses() == ["w:1"]
    assert [it.iteration_id for it in state.unfinished_iterations()] == [2000]
    state.apply(st.GarbageCollectIteration(st.IterationId(2000)))
    assert state.unfinished_iterations() == []
    assert state.tasks_of_worker("w:1") == []
    assert state.task_worker_addresses() == [], "a worker with no task left is forgotten"
