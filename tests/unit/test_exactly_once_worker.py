"""The worker's side of exactly-once DYNAMIC (worker/exactly_once.py): a split leased
twice to one process (a dispatcher restarted between two journal records) runs once."""

from __future__ import annotations

from types import SimpleNamespace

import dataservice as ds
from dataservice.data import graph
from dataservice.rpc import service_pb2 as pb
from dataservice.worker import exactly_once


class _Worker:
    """The parts of WorkerServer `elements` uses; answers GetSplits from a script."""

    _incarnation = "i"
    _uid = "u"

    def __init__(self, answers: list[pb.GetSplitsResponse]) -> None:
        self.answers = answers
        self.requests: list[pb.GetSplitsRequest] = []

    def _call_dispatcher(self, method: str, request: pb.GetSplitsRequest):
        assert method == "GetSplits"
        self.requests.append(pb.GetSplitsRequest.FromString(request.SerializeToString()))
        return self.answers.pop(0)


def _lease(ordinal: int, split: int, generation: int = 0) -> pb.SplitLease:
    return pb.SplitLease(ordinal=ordinal, int_split=split, generation=generation)


def test_a_split_leased_twice_to_one_process_runs_once_and_is_counted_again():
    first = pb.GetSplitsResponse(leases=[_lease(0, 3), _lease(1, 4), _lease(0, 3)])
    second = pb.GetSplitsResponse(leases=[_lease(1, 4), _lease(2, 5)])
    worker = _Worker([first, second, pb.GetSplitsResponse(end_of_splits=True)])
    dataset = ds.Dataset.range(10)
    task = SimpleNamespace(iteration_id=1, task_id=2, repetition=0)
    got = list(exactly_once.elements(worker, task, dataset, graph.new_iter_stats()))
    assert [(o, seq, split, int(e), g) for o, seq, split, e, g in got] == [
        (0, 0, 3, 3, 0),
        (1, 0, 4, 4, 0),
        (2, 0, 5, 5, 0),
    ]
    reported = [[(p.ordinal, p.count) for p in r.produced] for r in worker.requests]
    assert reported == [[], [(0, 1), (1, 1), (0, 1)], [(1, 1), (2, 1)]]


def test_a_new_run_of_a_split_it_ran_runs_again_tagged_with_its_generation():
    """After a consumer left, the dispatcher leases split 0 again (generation 1),
    maybe to the process that ran it: it runs again, skipping what the
    consumers received, and its elements carry generation 1."""
    first = pb.GetSplitsResponse(leases=[_lease(0, 3)])
    again = _lease(0, 3, generation=1)
    again.skip.extend([0, 2])  # seqs 0 and 1 ([0, 2))
    second = pb.GetSplitsResponse(leases=[again])
    worker = _Worker([first, second, pb.GetSplitsResponse(end_of_splits=True)])
    dataset = ds.Dataset.range(10).flat_map(lambda x: ds.Dataset.range(x, x + 3))
    task = SimpleNamespace(iteration_id=1, task_id=2, repetition=0)
    got = list(exactly_once.elements(worker, task, dataset, graph.new_iter_stats()))
    assert [(o, seq, int(e), g) for o, seq, _, e, g in got] == [
        (0, 0, 3, 0),
        (0, 1, 4, 0),
        (0, 2, 5, 0),
        (0, 2, 5, 1),
    ]
    reported = [[(p.ordinal, p.count) for p in r.produced] for r in worker.requests]
    assert reported == [[], [(0, 3)], [(0, 3)]]
