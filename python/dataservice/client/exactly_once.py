"""The consumer's side of exactly-once DYNAMIC (dataservice/exactly_once.py):
strip each element's `(ordinal, seq)` tag, drop what this consumer already
received or what comes from a worker process it closed, and tell the
dispatcher, heartbeat by heartbeat, what it received and which processes it
closed. A part of `reader._Reader`; the `_locked` methods expect `_cv` held.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from dataservice import exactly_once as eo

log = logging.getLogger("dataservice.client")


class ExactlyOnceReceipts:
    """Receipts of one consumer's exactly-once read (see the module docstring)."""

    _cv: threading.Condition

    def _init_receipts(self) -> None:
        # guarded by self._cv:
        self._eo_received: dict[int, eo.Ranges] = {}  # split ordinal -> seqs received
        self._eo_closed: set[tuple[int, str]] = set()  # (task id, worker uid) closed
        self._eo_dropped = 0  # duplicates and elements of closed processes dropped

    def _eo_accept_locked(self, task_id: int, worker_uid: str, elements: list[Any]) -> list[Any]:
        """The elements of one fetch from `task_id`'s process `worker_uid`,
        untagged, less those already received here or sent by a closed process."""
        if (task_id, worker_uid) in self._eo_closed:
            self._eo_dropped += len(elements)
            return []
        kept = []
        received = self._eo_received
        for ordinal, seq, element in elements:
            ordinal, seq = int(ordinal), int(seq)
            ranges = received.get(ordinal)
            if ranges is None:
                ranges = received[ordinal] = []
            elif eo.contains(ranges, seq):
                self._eo_dropped += 1
                continue
            eo.add(ranges, seq)
            kept.append(element)
        return kept

    def _eo_close_locked(self, task_id: int, worker_uid: str) -> None:
        """Takes nothing more from worker process `worker_uid` of `task_id`
        (the dispatcher said it was lost): its unfinished splits go to other
        workers once every consumer closed it."""
        self._eo_closed.add((task_id, worker_uid))

    def _eo_fill_heartbeat_locked(self, request: Any) -> None:
        for ordinal, ranges in self._eo_received.items():
            request.split_receipts.add(ordinal=ordinal, ranges=eo.flatten(ranges))
        for task_id, uid in sorted(self._eo_closed):
            request.closed_processes.add(task_id=task_id, worker_uid=uid)

    def _eo_on_heartbeat_locked(self, response: Any) -> None:
        for ordinal in response.completed_splits:
            self._eo_received.pop(ordinal, None)
