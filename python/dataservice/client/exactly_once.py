"""The consumer's side of exactly-once DYNAMIC (dataservice/exactly_once.py):
strip each element's `(ordinal, seq)` tag, drop what this consumer already
received, what belongs to a split the dispatcher called complete, or what comes
from a worker process it closed, and tell the
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
        # Ordinals of the splits the dispatcher called complete: an element of one
        # arriving later is a copy (e.g. of a split run again elsewhere), whatever
        # its seq, and its receipts are gone.
        self._eo_completed: eo.Ranges = []
        self._eo_closed: set[tuple[int, str]] = set()  # (task id, worker uid) closed
        self._eo_dropped = 0  # duplicates and elements of closed processes dropped
        # A resumed read (client/checkpoint.py): per split, the sequence numbers
        # delivered before the checkpoint; dropped here, but counted received.
        self._eo_preloaded: dict[Any, eo.Ranges] = {}
        # The consumer's thread only: per split, the sequence numbers next() returned.
        self._eo_yielded: dict[Any, eo.Ranges] = {}

    def _eo_accept_locked(
        self, task_id: int, worker_uid: str, elements: list[Any]
    ) -> tuple[list[Any], list[tuple[Any, int]]]:
        """The elements of one fetch from `task_id`'s process `worker_uid`,
        untagged, less those already received here, of a completed split, sent
        by a closed process, or delivered before a checkpoint; and the (split,
        seq) of each."""
        if (task_id, worker_uid) in self._eo_closed:
            self._eo_dropped += len(elements)
            return [], []
        kept = []
        tags = []
        received = self._eo_received
        preloaded = self._eo_preloaded
        completed = self._eo_completed
        for ordinal, seq, split, element in elements:
            ordinal, seq = int(ordinal), int(seq)
            split = split if isinstance(split, str) else int(split)
            ranges = received.get(ordinal)
            if ranges is None:
                if eo.contains(completed, ordinal):
                    self._eo_dropped += 1
                    continue
                ranges = received[ordinal] = []
            elif eo.contains(ranges, seq):
                self._eo_dropped += 1
                continue
            eo.add(ranges, seq)
            before = preloaded.get(split)
            if before and eo.contains(before, seq):
                continue  # delivered before the checkpoint
            kept.append(element)
            tags.append((split, seq))
        return kept, tags

    def _eo_yielded_one(self, tag: tuple[Any, int]) -> None:
        """next() returned the element tagged `tag` (the consumer's thread)."""
        ranges = self._eo_yielded.get(tag[0])
        if ranges is None:
            ranges = self._eo_yielded[tag[0]] = []
        eo.add(ranges, tag[1])

    def _eo_delivered(self) -> dict[Any, eo.Ranges]:
        """Per split, what was delivered before the checkpoint this read resumed
        from and what next() returned since (the consumer's thread)."""
        splits = dict(self._eo_preloaded)
        for split, ranges in self._eo_yielded.items():
            splits[split] = eo.union([splits.get(split, []), ranges])
        return splits

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
            eo.add(self._eo_completed, ordinal)
