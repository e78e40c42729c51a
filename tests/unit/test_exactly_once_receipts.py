"""client/exactly_once.py: what an exactly-once consumer keeps of the elements it
receives (tags stripped, copies dropped)."""

from __future__ import annotations

import threading

from dataservice.client.exactly_once import ExactlyOnceReceipts
from dataservice.rpc import service_pb2 as pb


class _Receipts(ExactlyOnceReceipts):
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._init_receipts()


def test_a_copy_of_a_completed_split_is_dropped_whatever_its_seq() -> None:
    r = _Receipts()
    kept, tags = r._eo_accept_locked(4000, "w1", [(5, 0, 50, "a", 0), (5, 1, 50, "b", 0)])
    assert kept == ["a", "b"] and tags == [(5, 0), (5, 1)]
    kept, _ = r._eo_accept_locked(4001, "w2", [(5, 1, 50, "b", 0)])
    assert kept == []  # a copy, while the receipts of split 5 are kept
    response = pb.ClientHeartbeatResponse()
    response.completed_splits.extend([5, 7])
    r._eo_on_heartbeat_locked(response)
    assert 5 not in r._eo_received  # its receipts go
    # A copy arriving after the split completed (run again elsewhere) is dropped:
    kept, _ = r._eo_accept_locked(
        4001, "w2", [(5, 0, 50, "a", 0), (6, 0, 60, "c", 0), (7, 2, 7, "x", 0)]
    )
    assert kept == ["c"]
    assert r._eo_dropped == 3
    request = pb.ClientHeartbeatRequest()
    r._eo_fill_heartbeat_locked(request)
    assert [x.ordinal for x in request.split_receipts] == [6]


def test_a_replaced_run_is_dropped_and_the_drop_is_acknowledged() -> None:
    """The dispatcher runs split 3 again (generation 1) after a consumer left:
    elements of run 0 are dropped from then on, what was accepted before stays
    received, and the next heartbeat says generation 1 is taken."""
    r = _Receipts()
    kept, _ = r._eo_accept_locked(4000, "w1", [(3, 0, 30, "a", 0)])
    assert kept == ["a"]
    response = pb.ClientHeartbeatResponse()
    response.split_generations.add(ordinal=3, generation=1)
    r._eo_on_heartbeat_locked(response)
    kept, _ = r._eo_accept_locked(4000, "w1", [(3, 1, 30, "b", 0)])
    assert kept == [] and r._eo_dropped == 1  # the old run's
    kept, _ = r._eo_accept_locked(4001, "w2", [(3, 0, 30, "a", 1), (3, 1, 30, "b", 1)])
    assert kept == ["b"]  # seq 0 was received already
    request = pb.ClientHeartbeatRequest()
    r._eo_fill_heartbeat_locked(request)
    assert [(g.ordinal, g.generation) for g in request.split_generations] == [(3, 1)]
    assert [(x.ordinal, list(x.ranges)) for x in request.split_receipts] == [(3, [0, 2])]
    # A newer run than it was told of (it joined after the run was replaced):
    # the older run is over for it too.
    kept, _ = r._eo_accept_locked(4001, "w2", [(4, 0, 40, "c", 2), (4, 1, 40, "d", 1)])
    assert kept == ["c"] and r._eo_generation[4] == 2
    response = pb.ClientHeartbeatResponse()
    response.completed_splits.append(3)
    r._eo_on_heartbeat_locked(response)
    assert 3 not in r._eo_generation


def test_heartbeats_say_what_was_received_and_delivered_and_leaving_what_was_delivered() -> None:
    """Received (a run of the split skips it) and delivered (the split completes
    once all is) go separately; leaving, only what was delivered counts."""
    r = _Receipts()
    _, tags = r._eo_accept_locked(
        4000, "w1", [(1, 0, 10, "a", 0), (1, 1, 10, "b", 0), (2, 0, 20, "c", 0)]
    )
    r._eo_yielded_one(tags[0])  # next() returned "a" only
    request = pb.ClientHeartbeatRequest()
    r._eo_fill_heartbeat_locked(request)
    assert {x.ordinal: list(x.ranges) for x in request.split_receipts} == {1: [0, 2], 2: [0, 1]}
    assert {x.ordinal: list(x.ranges) for x in request.split_delivered} == {1: [0, 1]}
    release = pb.ReleaseIterationClientRequest()
    r._eo_release_receipts_locked(release)
    assert {x.ordinal: list(x.ranges) for x in release.split_receipts} == {1: [0, 1], 2: []}
    # A resumed read: what the checkpoint had delivered counts delivered.
    r._eo_preloaded = {30: [(0, 2)]}
    r._eo_accept_locked(4000, "w1", [(3, 0, 30, "x", 0), (3, 1, 30, "y", 0), (3, 2, 30, "z", 0)])
    request = pb.ClientHeartbeatRequest()
    r._eo_fill_heartbeat_locked(request)
    assert {x.ordinal: list(x.ranges) for x in request.split_delivered} == {1: [0, 1], 3: [0, 2]}
