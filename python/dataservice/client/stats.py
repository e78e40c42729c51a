"""What one consumer's read counts, and what it knows of the workers it lost.

`ReadStats` holds the counters behind `DataServiceIterator.stats()` (elements,
encoded bytes, time `__next__` waited, per worker and per task) and the worker
processes the iteration lost, as the dispatcher's heartbeat replies report them.
`WorkerLossTracking` (a part of `reader._Reader`, under its lock) records those
losses, logs one WARNING for each, describes them for `stats()["lost_workers"]`,
raises WorkerCrashedError once no worker is left to run the iteration
(`worker_loss_timeout_ms`; MissingShardsError where listed workers' static
shards are what is left), and builds `stats()`'s value.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dataservice import errors

if TYPE_CHECKING:
    from dataservice.client.fetch import _TaskState
    from dataservice.client.reader import ReadOptions

# The read logs under one name, the reader's, whichever module does the work.
log = logging.getLogger("dataservice.client.reader")

# This host's name as the consumer's counters send it (and `join` compares).
HOST = socket.gethostname()


@dataclass
class WorkerStats:
    """What one consumer read from one worker (`stats()["workers"]`'s entry)."""

    transfer_protocol: str
    elements: int = 0
    bytes: int = 0


@dataclass
class LostWorker:
    """A worker process this iteration lost (from the dispatcher's heartbeat)."""

    report: Any  # pb.WorkerLossReport
    seen_at: float  # time.monotonic() when this consumer heard of it


@dataclass
class ReadStats:
    """One consumer's counters of its read; guarded by the reader's lock, except
    `elements` and `bytes`, which only the consumer's thread changes."""

    elements: int = 0
    bytes: int = 0
    wait_s: float = 0.0
    workers: dict[str, WorkerStats] = field(default_factory=dict)
    # (task_id, worker_uid) -> elements fetched from that worker process's task
    received: dict[tuple[int, str], int] = field(default_factory=dict)
    lost: dict[tuple[str, str, int, int], LostWorker] = field(default_factory=dict)
    # elements a lost worker's fetch brought after the iteration ended here
    not_yielded: int = 0
    # close(): elements this consumer fetched and never returned
    left_unreturned: int = 0
    # the dispatcher's sum of `left_unreturned` over the consumers that left this
    # iteration (ClientHeartbeatResponse.elements_left_by_departed_consumers)
    left_by_departed: int = 0
    # (task_id, worker_uid) -> elements `ignore_errors` skipped in that worker
    # process's task, as its last reply here said (a running count)
    errors_ignored: dict[tuple[int, str], int] = field(default_factory=dict)
    # time.monotonic() of the consumer's first next() (the consumer's thread sets it)
    first_next_at: float | None = None
    # time.monotonic() since when next() has been blocked, if it is (guarded by the
    # reader's _cv): the wait under way counts in `wait_s_now`
    waiting_since: float | None = None
    ended_at: float | None = None  # when next() raised StopIteration

    def wall_s(self, now: float | None = None) -> float:
        """Seconds from the first next() to now, or to the end of the iteration
        (0 before the first next())."""
        if self.first_next_at is None:
            return 0.0
        end = self.ended_at if self.ended_at is not None else now
        return max(0.0, (time.monotonic() if end is None else end) - self.first_next_at)

    def wait_s_now(self) -> float:
        """`wait_s` plus the wait of a next() blocked now (seconds)."""
        since = self.waiting_since
        return self.wait_s + (time.monotonic() - since if since is not None else 0.0)

    def to_proto(self, consumer_index: int) -> Any:
        """The `ConsumerCounters` of this consumer's heartbeats (metrics.py)."""
        from dataservice.rpc import service_pb2 as pb

        return pb.ConsumerCounters(
            elements=self.elements,
            bytes=self.bytes,
            wait_s=self.wait_s_now(),
            active_s=self.wall_s(),
            host=HOST,
            pid=os.getpid(),
            consumer_index=consumer_index if consumer_index >= 0 else -1,
            left_unreturned=self.left_unreturned,
        )


class WorkerLossTracking:
    """Worker-loss bookkeeping of one consumer's read: a part of `reader._Reader`,
    whose state below it reads; the `_locked` methods expect `_cv` held."""

    options: ReadOptions
    stats: ReadStats
    iteration_id: int
    _cv: threading.Condition
    _tasks: dict[int, _TaskState]
    _iteration_finished: bool
    _no_live_task_since: float | None
    _missing_shards: list[Any]

    def _note_lost_workers(self, reports: Any) -> None:
        """Records the worker processes the dispatcher says the iteration lost
        and logs one WARNING for each new one, naming it and what was lost."""
        new = []
        with self._cv:
            for r in reports:
                key = (r.worker_address, r.worker_uid, r.pid, r.task_id)
                if key not in self.stats.lost:
                    lost = LostWorker(r, time.monotonic())
                    self.stats.lost[key] = lost
                    new.append(self._describe_loss_locked(lost))
        for d in new:
            who = f"worker {d['address']} (pid {d['pid'] or 'unknown'})"
            what = f"; {d['elements_received']} elements came from it"
            if d["splits_handed_out"]:
                if d["elements_lost"] is not None:
                    what = (
                        f"; {d['splits_lost']} of the {d['splits_handed_out']} DYNAMIC splits "
                        f"handed to it were not delivered ({d['elements_lost']} elements lost)"
                    )
                else:
                    what = (
                        f"; up to {d['splits_handed_out']} DYNAMIC splits handed to it are lost "
                        f"({d['elements_received']} elements came from it)"
                    )
                what += ": DYNAMIC sharding reads each split at most once, as tf.data service's"
            elif self.options.exactly_once:
                what += (
                    "; exactly_once: its unfinished splits are produced again by the "
                    "workers, without the elements already received"
                )
            elif d["restarting"]:
                what += "; its task starts over on the restarted process"
            log.warning("iteration %d lost %s: %s%s", self.iteration_id, who, d["reason"], what)

    def _loss_taken_back_locked(self, task_id: int, response: Any) -> list[Any]:
        """Task `task_id`'s worker was declared lost, then came back with the task
        as the same process (it was only slow: SIGSTOP then SIGCONT, a long
        pause), so the dispatcher no longer lists its loss (`response`, a
        ClientHeartbeatResponse, has the whole list). Drops the task's losses
        that left that list from `stats()["lost_workers"]`; returns their
        reports, for `_warn_losses_taken_back`."""
        still = {(r.worker_address, r.worker_uid, r.pid, r.task_id) for r in response.lost_workers}
        back = [k for k in self.stats.lost if k[3] == task_id and k not in still]
        return [self.stats.lost.pop(k).report for k in back]

    def _warn_losses_taken_back(self, reports: list[Any]) -> None:
        """One WARNING per loss taken back, as the loss itself was announced."""
        for r in reports:
            log.warning(
                "iteration %d: worker %s (pid %s) was only slow, not lost: it came back "
                "as the same process and serves its task again; the loss announced for "
                "it did not happen",
                self.iteration_id,
                r.worker_address,
                r.pid or "unknown",
            )

    def _describe_loss_locked(self, lost: LostWorker) -> dict[str, Any]:
        """`stats()["lost_workers"]`'s entry for one lost worker process."""
        r = lost.report
        received = self.stats.received.get((r.task_id, r.worker_uid), 0) if r.worker_uid else 0
        splits_lost: int = r.splits_handed_out
        elements_lost: int | None = None
        # One element per split and this consumer the only reader of the job:
        # what did not arrive here is lost. Otherwise an upper bound.
        if r.one_element_per_split and not self.options.job_name and r.worker_uid:
            splits_lost = max(0, r.splits_handed_out - received)
            elements_lost = splits_lost
        return {
            "address": r.worker_address,
            "pid": r.pid or None,
            "reason": r.reason,
            "task_id": r.task_id,
            "restarting": r.restarting,
            "splits_handed_out": r.splits_handed_out,
            "splits_lost": splits_lost,
            "elements_received": received,
            "elements_lost": elements_lost,
        }

    def warn_losses_at_end_locked(self) -> None:
        """At the iteration's end: one WARNING summing up the DYNAMIC splits its
        lost worker processes took with them, if any (with a crash loop most
        of an epoch may be lost, a WARNING per process at a time; this says
        how much in all, next to what was read)."""
        departed = self.stats.left_by_departed
        if departed:
            log.warning(
                "iteration %d ended after %d elements read here; %d elements were fetched by "
                "consumers that left the job mid-epoch and never returned them: no other "
                "consumer got them (stats()['elements_left_by_departed_consumers']; "
                "distribute(..., exactly_once=True) hands them to the others)",
                self.iteration_id,
                self.stats.elements,
                departed,
            )
        entries = [self._describe_loss_locked(lost) for lost in self.stats.lost.values()]
        dynamic = [d for d in entries if d["splits_handed_out"]]
        splits_lost = sum(d["splits_lost"] for d in dynamic)
        if not splits_lost:
            return
        read = self.stats.elements
        if all(d["elements_lost"] is not None for d in dynamic):
            lost = sum(d["elements_lost"] for d in dynamic)
            what = (
                f"{lost} elements, {100 * lost / (lost + read):.0f} % of the "
                f"{lost + read} this consumer's epoch had"
            )
        else:
            what = "an upper bound: another consumer of the job may have read some"
        log.warning(
            "iteration %d ended after %d elements read here; %d DYNAMIC %s (%s) lost "
            "with %d worker %s that died or stopped answering: DYNAMIC sharding reads "
            "each split at most once, as tf.data service's (stats()['lost_workers'] "
            "lists each)",
            self.iteration_id,
            read,
            splits_lost,
            "split was" if splits_lost == 1 else "splits were",
            what,
            len(dynamic),
            "process" if len(dynamic) == 1 else "processes",
        )

    def stats_locked(self) -> dict[str, Any]:
        """`DataServiceIterator.stats()`'s value (see there), from `stats`."""
        s = self.stats
        lost = [self._describe_loss_locked(entry) for entry in s.lost.values()]
        wall_s = s.wall_s()
        wait_s = s.wait_s_now()  # with a next() blocked now, its wait so far
        return {
            "elements": s.elements,
            "bytes": s.bytes,
            "wait_ms": wait_s * 1000,
            "wait_s": wait_s,
            "wall_s": wall_s,
            "wait_fraction": min(1.0, wait_s / wall_s) if wall_s > 0 else 0.0,
            "workers": {
                addr: {
                    "transfer_protocol": w.transfer_protocol,
                    "elements": w.elements,
                    "bytes": w.bytes,
                }
                for addr, w in s.workers.items()
            },
            "lost_workers": lost,
            "splits_lost": sum(d["splits_lost"] for d in lost),
            "elements_lost": (
                sum(d["elements_lost"] for d in lost if d["elements_lost"] is not None)
                if all(d["elements_lost"] is not None for d in lost if d["splits_handed_out"])
                else None
            ),
            "elements_not_yielded": s.not_yielded,
            "elements_left_by_departed_consumers": s.left_by_departed,
            "errors_ignored": sum(s.errors_ignored.values()),
        }

    def _lost_lines_locked(self) -> list[str]:
        """One line per worker process the iteration lost: address, pid, reason."""
        lines = []
        for lost in self.stats.lost.values():
            d = self._describe_loss_locked(lost)
            lines.append(f"worker {d['address']} (pid {d['pid'] or 'unknown'}): {d['reason']}")
        return lines

    def _check_worker_loss_locked(self, wait_start: float) -> None:
        """Raises WorkerCrashedError when no task can produce and next() has
        waited `worker_loss_timeout_ms` for that to change (only time spent
        waiting here counts, so a slow consumer never trips it): either the
        iteration lost its workers and none came back, or every worker it
        still has went silent (no heartbeat to the dispatcher: stopped, e.g.
        SIGSTOP, or hung) and stayed so. A worker that is alive but slow
        keeps heartbeating and never trips it. Under static sharding, when
        what is left unread is the shards of listed workers nobody reads (the
        dispatcher's `missing_shards`: never registered, or lost and not
        back), MissingShardsError (a WorkerCrashedError) naming them."""
        timeout_ms = self.options.worker_loss_timeout_ms
        if timeout_ms is None or self._iteration_finished:
            return
        live = [s for s in self._tasks.values() if not s.finished and not s.removed]
        if live:
            if any(s.silent_since is None for s in live):
                return
            since = max(s.silent_since for s in live if s.silent_since is not None)
        else:
            if self._no_live_task_since is None or not (self.stats.lost or self._missing_shards):
                return
            since = self._no_live_task_since
        now = time.monotonic()
        waited_s = now - max(since, wait_start)
        if waited_s * 1000 < timeout_ms:
            return
        if not live and self._missing_shards:
            raise errors.MissingShardsError(
                f"iteration {self.iteration_id} cannot end: static sharding reads one shard "
                "per listed worker (DispatcherConfig.worker_addresses), and the shards of "
                f"{len(self._missing_shards)} listed worker(s) were not read and nobody reads "
                f"them; waited {timeout_ms / 1000:.1f} s (worker_loss_timeout_ms) with nothing "
                "else to read. Start the missing workers (or fix their addresses), or pass "
                "worker_loss_timeout_ms=None to wait for them forever:\n  "
                + describe_missing_shards(self._missing_shards, sep="\n  ")
                + "".join(f"\n  lost {line}" for line in self._lost_lines_locked())
            )
        lines = self._lost_lines_locked()
        for s in live:
            assert s.silent_since is not None
            how = "stopped, e.g. SIGSTOP, or hung"
            if s.unreachable_since is not None:  # nor can this host reach it
                how = (
                    "stopped, hung, or its host cut off from the network: this consumer "
                    f"cannot reach it either ({s.fetch_error})"
                )
            lines.append(
                f"worker {s.endpoint.worker_address} (pid {s.worker_pid or 'unknown'}): sent "
                f"the dispatcher no heartbeat for {now - s.silent_since:.1f} s ({how})"
            )
        if live:
            what = "the worker" + ("s" if len(live) > 1 else "") + " it still waits for"
            what += " stopped answering"
        else:
            what = "it lost its workers"
        raise errors.WorkerCrashedError(
            f"iteration {self.iteration_id} cannot go on: {what} and none came "
            f"back within {timeout_ms / 1000:.1f} s (worker_loss_timeout_ms):\n  "
            + "\n  ".join(lines)
        )


def describe_missing_shards(shards: Any, sep: str = "; ") -> str:
    """One line per `pb.MissingShard`: "worker ADDRESS (shard I): why"."""
    return sep.join(
        f"worker {m.worker_address} (shard {m.worker_index}): {m.reason}" for m in shards
    )
