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
    kept, tags = r._eo_accept_locked(4000, "w1", [(5, 0, 50, "a"), (5, 1, 50, "b")])
    assert kept == ["a", "b"] and tags == [(50, 0), (50, 1)]
    kept, _ = r._eo_accept_locked(4001, "w2", [(5, 1, 50, "b")])
    assert kept == []  # a copy, while the receipts of split 5 are kept
    response = pb.ClientHeartbeatResponse()
    response.completed_splits.extend([5, 7])
    r._eo_on_heartbeat_locked(response)
    assert 5 not in r._eo_received  # its receipts go
    # A copy arriving after the split completed (run again elsewhere) is dropped:
    kept, _ = r._eo_accept_locked(4001, "w2", [(5, 0, 50, "a"), (6, 0, 60, "c"), (7, 2, 7, "x")])
    assert kept == ["c"]
    assert r._eo_dropped == 3
    request = pb.ClientHeartbeatRequest()
    r._eo_fill_heartbeat_locked(request)
    assert [x.ordinal for x in request.split_receipts] == [6]
