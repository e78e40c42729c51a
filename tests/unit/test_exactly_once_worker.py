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


def _lease(ordinal: int, split: int) -> pb.SplitLease:
    return pb.SplitLease(ordinal=ordinal, int_split=split)


def test_a_split_leased_twice_to_one_process_runs_once_and_is_counted_again():
    first = pb.GetSplitsResponse(leases=[_lease(0, 3), _lease(1, 4), _lease(0, 3)])
    second = pb.GetSplitsResponse(leases=[_lease(1, 4), _lease(2, 5)])
    worker = _Worker([first, second, pb.GetSplitsResponse(end_of_splits=True)])
    dataset = ds.Dataset.range(10)
    task = SimpleNamespace(iteration_id=1, task_id=2)
    got = list(exactly_once.elements(worker, task, dataset, graph.new_iter_stats()))
    assert [(o, seq, split, int(e)) for o, seq, split, e in got] == [
        (0, 0, 3, 3),
        (1, 0, 4, 4),
        (2, 0, 5, 5),
    ]
    reported = [[(p.ordinal, p.count) for p in r.produced] for r in worker.requests]
    assert reported == [[], [(0, 1), (1, 1), (0, 1)], [(1, 1), (2, 1)]]
