"""The consumer's side of exactly-once DYNAMIC (dataservice/exactly_once.py):
strip each element's `(ordinal, seq, split, generation)` tag, drop what this
consumer already received, what belongs to a split the dispatcher called
complete, to a run of a split the dispatcher replaced (an older generation), or
what comes from a worker process it closed, and tell the dispatcher, heartbeat
by heartbeat, what it received (a split run again skips it), what it delivered
(a split completes once delivered), which processes it closed and which
generations it takes; when it leaves, what it delivered
(`_eo_release_receipts_locked`), so that what it received and did not deliver
goes to the other consumers. A part of
`reader._Reader`; the `_locked` methods expect `_cv` held.
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
        # Split ordinal -> the generation below which its elements are dropped: the
        # dispatcher ran the split again after a consumer left (ClientHeartbeatResponse
        # .split_generations); the older run's elements may have reached others.
        self._eo_generation: dict[int, int] = {}
        # Per open split (ordinal), the sequence numbers delivered without next()
        # (a checkpoint this read resumed from had them): part of what it delivered.
        self._eo_delivered_before: dict[int, eo.Ranges] = {}
        self._eo_dropped = 0  # duplicates and elements of closed processes dropped
        # A resumed read (client/checkpoint.py): per split, the sequence numbers
        # delivered before the checkpoint; dropped here, but counted received.
        self._eo_preloaded: dict[Any, eo.Ranges] = {}
        # Per split ordinal, the sequence numbers next() returned (the consumer's
        # thread writes it; the heartbeat thread reads it), and each ordinal's split
        # (an index or a file name: a checkpoint's key), noted when first received.
        self._eo_yielded: dict[int, eo.Ranges] = {}
        self._eo_split_of: dict[int, Any] = {}

    def _eo_accept_locked(
        self, task_id: int, worker_uid: str, elements: list[Any]
    ) -> tuple[list[Any], list[tuple[int, int]]]:
        """The elements of one fetch from `task_id`'s process `worker_uid`,
        untagged, less those already received here, of a completed split, of a
        replaced run, sent by a closed process, or delivered before a
        checkpoint; and the (ordinal, seq) of each."""
        if (task_id, worker_uid) in self._eo_closed:
            self._eo_dropped += len(elements)
            return [], []
        kept = []
        tags = []
        received = self._eo_received
        preloaded = self._eo_preloaded
        completed = self._eo_completed
        generations = self._eo_generation
        for ordinal, seq, split, element, generation in elements:
            ordinal, seq, generation = int(ordinal), int(seq), int(generation)
            split = split if isinstance(split, str) else int(split)
            current = generations.get(ordinal, 0)
            if generation != current:
                if generation < current:
                    self._eo_dropped += 1  # a replaced run's
                    continue
                # A newer run, which this consumer was not told of yet (it joined
                # after the dispatcher replaced the run): the older one is over.
                generations[ordinal] = generation
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
            if ordinal not in self._eo_split_of:
                self._eo_split_of[ordinal] = split
            before = preloaded.get(split)
            if before and eo.contains(before, seq):
                # delivered before the checkpoint
                eo.add(self._eo_delivered_before.setdefault(ordinal, []), seq)
                continue
            kept.append(element)
            tags.append((ordinal, seq))
        return kept, tags

    def _eo_yielded_one(self, tag: tuple[int, int]) -> None:
        """next() returned the element tagged `tag` (the consumer's thread)."""
        ranges = self._eo_yielded.get(tag[0])
        if ranges is None:
            ranges = self._eo_yielded[tag[0]] = []
        eo.add(ranges, tag[1])

    def _eo_release_receipts_locked(self, request: Any) -> None:
        """Fills a ReleaseIterationClientRequest's `split_receipts`: per split not
        complete, what this consumer delivered (final). (A split completes only
        once delivered, so what it holds unreturned is of open splits: they
        run again for the others.)"""
        delivered = dict(self._eo_yielded)  # a copy: next() may still run
        for ordinal in self._eo_received:
            ranges = eo.union(
                [delivered.get(ordinal, []), self._eo_delivered_before.get(ordinal, [])]
            )
            request.split_receipts.add(ordinal=ordinal, ranges=eo.flatten(ranges))

    def _eo_delivered(self) -> dict[Any, eo.Ranges]:
        """Per split, what was delivered before the checkpoint this read resumed
        from and what next() returned since (the consumer's thread)."""
        splits = dict(self._eo_preloaded)
        split_of = self._eo_split_of
        for ordinal, ranges in list(self._eo_yielded.items()):
            split = split_of[ordinal]
            before = splits.get(split)
            splits[split] = ranges if before is None else eo.union([before, ranges])
        return splits

    def _eo_close_locked(self, task_id: int, worker_uid: str) -> None:
        """Takes nothing more from worker process `worker_uid` of `task_id`
        (the dispatcher said it was lost): its unfinished splits go to other
        workers once every consumer closed it."""
        self._eo_closed.add((task_id, worker_uid))

    def _eo_fill_heartbeat_locked(self, request: Any) -> None:
        delivered = self._eo_yielded  # (next() may add to it meanwhile)
        before = self._eo_delivered_before
        for ordinal, ranges in self._eo_received.items():
            request.split_receipts.add(ordinal=ordinal, ranges=eo.flatten(ranges))
            given = delivered.get(ordinal)
            if ordinal in before:
                given = eo.union([given or [], before[ordinal]])
            if given:
                request.split_delivered.add(ordinal=ordinal, ranges=eo.flatten(given))
        for task_id, uid in sorted(self._eo_closed):
            request.closed_processes.add(task_id=task_id, worker_uid=uid)
        for ordinal, generation in self._eo_generation.items():
            request.split_generations.add(ordinal=ordinal, generation=generation)

    def _eo_on_heartbeat_locked(self, response: Any) -> None:
        for ordinal in response.completed_splits:
            self._eo_received.pop(ordinal, None)
            self._eo_generation.pop(ordinal, None)
            self._eo_delivered_before.pop(ordinal, None)
            eo.add(self._eo_completed, ordinal)
        for g in response.split_generations:
            if not eo.contains(self._eo_completed, g.ordinal) and g.generation > (
                self._eo_generation.get(g.ordinal, 0)
            ):
                self._eo_generation[g.ordinal] = g.generation
