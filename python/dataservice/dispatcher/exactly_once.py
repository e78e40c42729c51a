"""Exactly-once DYNAMIC on the dispatcher: split leases (README "Checkpointing
and visitation guarantees"; the protocol is dataservice/exactly_once.py's).

Owns `ExactlyOnceMixin`: GetSplits of an exactly-once job (`_eo_get_splits_locked`:
lease splits, record how many elements each produced), the consumers' receipts
and completed splits (`_eo_client_heartbeat_locked`), and what a lost worker
process held (`_eo_orphan_process_locked`): its open leases wait until every
consumer of the iteration closed that process (said it takes nothing more from
it) or left, then are leased again with the sequence numbers already received.

Fields (`base.DispatcherBase`; all guarded by `self._mu`): the journaled leases
are `Iteration.leases` (state.py: LeaseSplits, SplitsProduced, CompleteSplits).
Not journaled, because the consumers and workers tell them again after a
restart: `_eo_received` (iteration -> ordinal -> client -> ranges received: a
split run again skips them), `_eo_delivered` (the same, delivered: a split
completes once its elements were all delivered),
`_eo_holder` ((iteration, ordinal) -> uid of the worker process holding it),
`_eo_orphans` (iteration -> ordinal -> the lost process's (task, uid) and the
clients still to close it), `_eo_ready` (iteration -> ordinals to lease again)
`_eo_dead_uids` (processes declared lost: a process that comes back after
that gets no lease, since the consumers drop what it sends), `_eo_unheard`
(consumers journaled before a restart and not heard since: a split leased
before the restart is not run again until they reported what they received),
`_eo_generation` (iteration -> ordinal -> the split's current run) and
`_eo_fences` (iteration -> ordinal -> consumers still to drop an older run).

A consumer that leaves (its iterator closed, or timed out) takes with it what it
received and did not report, or (closed) did not deliver, which no split's
receipts would then ever cover: every open lease of its iteration is replaced
by a new run of the split (`_eo_replace_runs_locked`), under the next
generation, once every remaining consumer said it drops the older run's elements
(which may still reach them from the worker running it); the new run skips the
sequence numbers the consumers (the leaving one's final receipts included)
received.

A split is out to one worker process at a time: a second copy running would
reach the consumers after the split completed, when they no longer keep its
receipts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dataservice import errors
from dataservice import exactly_once as eo
from dataservice.dispatcher import state as st
from dataservice.dispatcher.base import DispatcherBase, NotLoaded, log
from dataservice.rpc import service_pb2 as pb

_MAX_LEASES_PER_RPC = 64  # a worker holds at most this many unstarted splits


@dataclass
class _Orphan:
    task_id: st.TaskId
    uid: str
    waiting: set[st.IterationClientId] = field(default_factory=set)


class ExactlyOnceMixin(DispatcherBase):
    """Split leases of exactly-once DYNAMIC jobs (see the module docstring)."""

    if TYPE_CHECKING:  # SplitHandoutMixin's (split_handout.py), which DispatchServer also has

        def _build_split_providers(self, iteration_id: st.IterationId) -> None: ...

    # ------------------------------------------------------------ GetSplits
    def _eo_get_splits_locked(
        self, request: Any, iteration: st.Iteration, job: st.Job, task_id: st.TaskId
    ) -> Any:
        """GetSplits of an exactly-once job: records the element counts of the
        splits the worker ran (`request.produced`), then leases it up to
        `max_splits` splits: first a lost process's splits, then new ones.

        Raises:
            FailedPreconditionError: The job is not exactly-once (or the other way round).
            NotLoaded: The split providers are not built yet; nothing changed but
                the recorded counts, which the retry finds recorded.
        """
        if not job.exactly_once:
            raise errors.FailedPreconditionError(
                f"GetSplits: a lease asked of iteration {iteration.iteration_id}, whose job "
                f"{job.job_id} is not exactly-once"
            )
        iteration_id = iteration.iteration_id
        uid = request.worker_uid
        leases = iteration.leases
        if uid in self._eo_dead_uids:
            # Declared lost, then back (it was only slow): its leases went to
            # other workers and the consumers drop its elements, so it gets no
            # more splits and its task ends.
            return pb.GetSplitsResponse(end_of_splits=True)
        counts = [
            (p.ordinal, p.count)
            for p in request.produced
            if p.ordinal in leases and leases[p.ordinal].count < 0 and p.count >= 0
        ]
        if counts:
            self._apply_locked(
                st.SplitsProduced(
                    iteration_id, tuple(o for o, _ in counts), tuple(c for _, c in counts)
                )
            )
            self._eo_complete_locked(iteration, [o for o, _ in counts])
        response = pb.GetSplitsResponse()
        if iteration.finished:
            response.end_of_splits = True
            return response
        providers = self._split_providers.get(iteration_id)
        if providers is None and not iteration.splits_ended_by_provider.get(0, False):
            # Built outside the lock, then asked again (before any lease moves).
            raise NotLoaded(lambda: self._build_split_providers(iteration_id))
        held = set(request.held)
        ready = self._eo_ready.get(iteration_id, [])
        # After a dispatcher restart the holders are unknown: a lease of this
        # task that this process says it holds is its; one it does not hold and
        # that produced no count is given to it again. A lease without a holder
        # for another reason is a lost process's: it waits for the consumers to
        # close that process (`_eo_orphans`), then goes out once, to whichever
        # task asks first (`ready`); the lost process's task, run by its next
        # process, must not take it here as well.
        waiting = (
            self._eo_orphans.get(iteration_id, {}).keys()
            | self._eo_fences.get(iteration_id, {}).keys()
            | set(ready)
        )
        again: list[int] = []
        for lease in leases.values():
            if lease.task_id != task_id or (iteration_id, lease.ordinal) in self._eo_holder:
                continue
            if lease.ordinal in waiting:
                continue
            if lease.ordinal in held or lease.count >= 0:
                self._eo_holder[(iteration_id, lease.ordinal)] = uid
            else:
                again.append(lease.ordinal)
        unheard = sorted(self._eo_unheard & iteration.clients)
        if again and unheard:
            # Run again now, a split would skip nothing, and a consumer that got
            # some of it before the restart could get those elements twice once
            # the split completes: it waits for their receipts (consumers heartbeat
            # every second or so; one that never does times out, client_timeout_ms).
            if (iteration_id, task_id) not in self._eo_told_unheard:
                self._eo_told_unheard.add((iteration_id, task_id))
                log.info(
                    "exactly-once iteration %d: %d splits of task %d go out again once "
                    "the consumers %s report what they received before this dispatcher "
                    "restarted",
                    iteration_id,
                    len(again),
                    task_id,
                    unheard,
                )
            again = []
        max_splits = max(1, min(request.max_splits or 1, _MAX_LEASES_PER_RPC))
        take = again[:max_splits]
        while ready and len(take) < max_splits:
            take.append(ready.pop(0))
        fresh: list[Any] = []
        if len(take) < max_splits and not iteration.splits_ended_by_provider.get(0, False):
            assert providers is not None  # checked above
            provider = providers[0]
            want = max_splits - len(take)
            total = provider.cardinality()
            if total > 0:  # fair shares, as the at-most-once handout
                live = max(1, len(iteration.live_tasks()))
                remaining = max(0, total - iteration.splits_produced.get(0, 0))
                want = max(1, min(want, remaining // (2 * live)))
            end = False
            for _ in range(want):
                split = provider.get_next()
                if split is None:
                    end = True
                    break
                fresh.append(split)
            first = iteration.splits_produced.get(0, 0)
            ordinals = tuple(range(first, first + len(fresh)))
            # Leased before the cursor moves: a crash between the two journal
            # records hands the same splits out again under the same ordinals,
            # never loses them.
            if fresh:
                self._lease_locked(iteration_id, task_id, ordinals, fresh)
            self._apply_locked(st.ProduceSplits(iteration_id, len(fresh), end, 0))
            # After a crash between a LeaseSplits and its ProduceSplits, the same splits
            # come out again under the same ordinals, which `again` may already hold:
            # each goes out once (a split run twice by one process could reach its
            # consumer after the split completed, past the consumer's dedup).
            take.extend(o for o in ordinals if o not in take)
        if take:
            old = [o for o in take if leases[o].task_id != task_id]
            if old:
                self._lease_locked(
                    iteration_id, task_id, tuple(old), [leases[o].split for o in old]
                )
        generations = self._eo_generation.get(iteration_id, {})
        for ordinal in take:
            lease = leases[ordinal]
            self._eo_holder[(iteration_id, ordinal)] = uid
            message = response.leases.add(ordinal=ordinal, generation=generations.get(ordinal, 0))
            if isinstance(lease.split, str):
                message.str_split, message.is_str = lease.split, True
            else:
                message.int_split = int(lease.split)
            message.skip.extend(eo.flatten(self._eo_received_locked(iteration_id, ordinal)))
        if self._metrics is not None and take:
            self._metrics.splits_handed_out.inc(len(take))
        response.end_of_splits = (
            not take and iteration.splits_ended_by_provider.get(0, False) and not leases
        )
        return response

    def _lease_locked(
        self,
        iteration_id: st.IterationId,
        task_id: st.TaskId,
        ordinals: tuple[int, ...],
        splits: list[Any],
    ) -> None:
        if splits and isinstance(splits[0], str):
            update = st.LeaseSplits(iteration_id, task_id, ordinals, str_splits=tuple(splits))
        else:
            update = st.LeaseSplits(
                iteration_id, task_id, ordinals, int_splits=tuple(int(s) for s in splits)
            )
        self._apply_locked(update)

    def _eo_received_locked(self, iteration_id: st.IterationId, ordinal: int) -> eo.Ranges:
        """What the consumers received of split `ordinal`, all together."""
        by_client = self._eo_received.get(iteration_id, {}).get(ordinal, {})
        return eo.union(by_client.values())

    def _eo_complete_locked(self, iteration: st.Iteration, ordinals: list[int]) -> None:
        """Ends the leases among `ordinals` whose elements were all delivered (a
        consumer's next() returned them)."""
        iteration_id = iteration.iteration_id
        delivered = self._eo_delivered.get(iteration_id, {})
        done = []
        for ordinal in ordinals:
            lease = iteration.leases.get(ordinal)
            if lease is None or lease.count < 0:
                continue
            if eo.covers(eo.union(delivered.get(ordinal, {}).values()), lease.count):
                done.append(ordinal)
        if not done:
            return
        self._apply_locked(st.CompleteSplits(iteration_id, tuple(done)))
        received = self._eo_received.get(iteration_id, {})
        orphans = self._eo_orphans.get(iteration_id, {})
        fences = self._eo_fences.get(iteration_id, {})
        generations = self._eo_generation.get(iteration_id, {})
        ready = self._eo_ready.get(iteration_id, [])
        for ordinal in done:
            received.pop(ordinal, None)
            delivered.pop(ordinal, None)
            orphans.pop(ordinal, None)
            fences.pop(ordinal, None)
            generations.pop(ordinal, None)
            self._eo_holder.pop((iteration_id, ordinal), None)
            if ordinal in ready:
                ready.remove(ordinal)
        self._state._maybe_finish_iteration(iteration)

    # ------------------------------------------------------------ consumers
    def _eo_client_heartbeat_locked(
        self, client_id: st.IterationClientId, iteration: st.Iteration, request: Any, response: Any
    ) -> None:
        """A consumer's receipts, closed processes and generations taken
        (ClientHeartbeatRequest); the splits run again it must know of."""
        self._eo_unheard.discard(client_id)
        iteration_id = iteration.iteration_id
        generations = self._eo_generation.setdefault(iteration_id, {})
        if request.split_generations:
            fences = self._eo_fences.get(iteration_id, {})
            for g in request.split_generations:
                if g.ordinal not in iteration.leases:
                    continue
                current = generations.get(g.ordinal, 0)
                if g.generation > current:  # known before this dispatcher restarted
                    generations[g.ordinal] = current = g.generation
                if g.generation == current and g.ordinal in fences:
                    fences[g.ordinal].discard(client_id)
            self._eo_promote_locked(iteration_id)
        for ordinal, generation in generations.items():
            response.split_generations.add(ordinal=ordinal, generation=generation)
        if not response.waiting_for:
            response.waiting_for = self._eo_waiting_for_locked(iteration)
        if not request.split_receipts and not request.closed_processes:
            return
        received = self._eo_received.setdefault(iteration_id, {})
        delivered = self._eo_delivered.setdefault(iteration_id, {})
        touched = []
        for receipt in request.split_receipts:
            if receipt.ordinal not in iteration.leases:
                response.completed_splits.append(receipt.ordinal)
                continue
            received.setdefault(receipt.ordinal, {})[client_id] = eo.unflatten(receipt.ranges)
        for receipt in request.split_delivered:
            if receipt.ordinal in iteration.leases:
                delivered.setdefault(receipt.ordinal, {})[client_id] = eo.unflatten(receipt.ranges)
                touched.append(receipt.ordinal)
        self._eo_complete_locked(iteration, touched)
        closed = {(c.task_id, c.worker_uid) for c in request.closed_processes}
        if closed:
            for orphan in self._eo_orphans.get(iteration_id, {}).values():
                if (orphan.task_id, orphan.uid) in closed:
                    orphan.waiting.discard(client_id)
            self._eo_promote_locked(iteration_id)

    def _eo_waiting_for_locked(self, iteration: st.Iteration) -> str:
        """Once every split of `iteration` was handed out, what its open leases
        wait for, for the consumers' wait message: splits being produced (by
        which tasks), run again once consumers drop an older run, waiting for a
        worker, or produced and held by consumers that have not returned them
        (the epoch ends once they do, or leave). "" before, or when none is open."""
        iteration_id = iteration.iteration_id
        if (
            not iteration.leases
            or iteration.finished
            or not iteration.splits_ended_by_provider.get(0, False)
        ):
            return ""
        fences = self._eo_fences.get(iteration_id, {})
        waiting_out = (
            set(self._eo_orphans.get(iteration_id, {}))
            | set(self._eo_ready.get(iteration_id, []))
            | set(fences)
        )
        received = self._eo_received.get(iteration_id, {})
        delivered = self._eo_delivered.get(iteration_id, {})
        producing: set[st.TaskId] = set()
        held = 0
        holders: set[st.IterationClientId] = set()
        for ordinal, lease in iteration.leases.items():
            if ordinal in waiting_out:
                continue
            if lease.count < 0:
                producing.add(lease.task_id)
                continue
            given = delivered.get(ordinal, {})
            for client, ranges in received.get(ordinal, {}).items():
                if eo.union([ranges]) != eo.union([given.get(client, [])]):
                    holders.add(client)
            held += 1
        parts = []
        if producing:
            ntasks = len(producing)
            parts.append(f"splits being produced by {ntasks} task{'s' if ntasks > 1 else ''}")
        if waiting_out:
            dropping = sorted(set().union(*fences.values())) if fences else []
            parts.append(
                f"{len(waiting_out)} splits to run again"
                + (f" once consumers {dropping[:8]} drop an older run" if dropping else "")
            )
        if held:
            names = []
            for client in sorted(holders)[:8]:
                seen = self._client_seen_counters.get(client)
                where = f" (pid {seen.pid} on {seen.host})" if seen and seen.pid else ""
                names.append(f"consumer {client}{where}")
            parts.append(
                f"{held} splits, all produced, to be returned by next() of "
                + (", ".join(names) if names else "no consumer that said it holds them")
                + " (an exactly-once epoch ends once every element was returned: a "
                "consumer that stops reading holds what it fetched until it reads on or "
                "leaves; one that is gone is released after client_timeout_ms)"
            )
        return f"the last {len(iteration.leases)} exactly-once splits: " + "; ".join(parts)

    def _eo_final_receipts_locked(
        self, client_id: st.IterationClientId, iteration: st.Iteration, request: Any
    ) -> None:
        """A leaving consumer's receipts (ReleaseIterationClientRequest): what it
        delivered, also in place of what it received."""
        received = self._eo_received.setdefault(iteration.iteration_id, {})
        delivered = self._eo_delivered.setdefault(iteration.iteration_id, {})
        touched = []
        for receipt in request.split_receipts:
            if receipt.ordinal not in iteration.leases:
                continue
            ranges = eo.unflatten(receipt.ranges)
            for table in (received, delivered):
                if ranges:
                    table.setdefault(receipt.ordinal, {})[client_id] = ranges
                else:
                    table.get(receipt.ordinal, {}).pop(client_id, None)
            touched.append(receipt.ordinal)
        self._eo_complete_locked(iteration, touched)

    def _eo_client_left_locked(
        self, iteration_id: st.IterationId, client_id: st.IterationClientId
    ) -> None:
        """A consumer left: no lost process or replaced run waits for it any more,
        and the splits open now run again (`_eo_replace_runs_locked`). What it
        reported stays counted: it was delivered (its final receipts, when it
        closed, say what it delivered)."""
        self._eo_unheard.discard(client_id)
        for orphan in self._eo_orphans.get(iteration_id, {}).values():
            orphan.waiting.discard(client_id)
        for waiting in self._eo_fences.get(iteration_id, {}).values():
            waiting.discard(client_id)
        # Gone, it delivers nothing more: what it received and did not deliver
        # (as far as it said) is for the others, so a run of the split must not skip it.
        delivered = self._eo_delivered.get(iteration_id, {})
        for ordinal, by_client in self._eo_received.get(iteration_id, {}).items():
            if client_id in by_client:
                given = delivered.get(ordinal, {}).get(client_id)
                if given:
                    by_client[client_id] = given
                else:
                    del by_client[client_id]
        iteration = self._state.iterations.get(iteration_id)
        if (
            iteration is not None
            and not iteration.finished
            and self._state.jobs[iteration.job_id].exactly_once
        ):
            self._eo_replace_runs_locked(iteration, client_id)
        self._eo_promote_locked(iteration_id)

    def _eo_replace_runs_locked(self, iteration: st.Iteration, left: st.IterationClientId) -> None:
        """Consumer `left` left `iteration`: what it received since its last
        heartbeat, or did not deliver, is in no receipt, so a split open now
        might never complete. Each open lease (not already waiting to go out
        again) gets a new run under the next generation, leased once every
        remaining consumer said it drops the older run's elements."""
        iteration_id = iteration.iteration_id
        orphans = self._eo_orphans.get(iteration_id, {})
        ready = self._eo_ready.get(iteration_id, [])
        fences = self._eo_fences.setdefault(iteration_id, {})
        generations = self._eo_generation.setdefault(iteration_id, {})
        replaced = 0
        for ordinal, lease in iteration.leases.items():
            if ordinal in orphans or ordinal in ready or ordinal in fences:
                continue  # goes out again later, with the receipts known then
            if lease.count >= 0 and eo.covers(
                self._eo_received_locked(iteration_id, ordinal), lease.count
            ):
                continue
            generations[ordinal] = generations.get(ordinal, 0) + 1
            self._eo_holder.pop((iteration_id, ordinal), None)
            fences[ordinal] = set(iteration.clients)
            replaced += 1
        if replaced:
            log.info(
                "exactly-once iteration %d: consumer %d left; the %d splits open go out "
                "again (what it received and did not report or deliver goes to the other "
                "consumers) once the %d remaining consumers drop the older runs' elements",
                iteration_id,
                left,
                replaced,
                len(iteration.clients),
            )

    def _eo_promote_locked(self, iteration_id: st.IterationId) -> None:
        """Orphans and replaced runs no consumer waits for can be leased again."""
        orphans = self._eo_orphans.get(iteration_id, {})
        ready = self._eo_ready.setdefault(iteration_id, [])
        for ordinal, orphan in list(orphans.items()):
            if not orphan.waiting:
                del orphans[ordinal]
                if ordinal not in ready:
                    ready.append(ordinal)
        fences = self._eo_fences.get(iteration_id, {})
        for ordinal, waiting in list(fences.items()):
            if not waiting:
                del fences[ordinal]
                if ordinal not in ready:
                    ready.append(ordinal)
        ready.sort()

    # ------------------------------------------------------------ worker loss
    def _eo_orphan_process_locked(self, task: st.Task, uid: str) -> None:
        """Worker process `uid` of `task` was lost: its open leases wait for
        the consumers to close it, then go to other workers."""
        iteration = self._state.iterations[task.iteration_id]
        if not self._state.jobs[iteration.job_id].exactly_once:
            return
        iteration_id = iteration.iteration_id
        if uid:
            self._eo_dead_uids.add(uid)
        orphans = self._eo_orphans.setdefault(iteration_id, {})
        # (an earlier lost process's split not leased again yet is no one's)
        ready = set(self._eo_ready.get(iteration_id, []))
        moved = 0
        for lease in iteration.leases.values():
            if (
                lease.task_id != task.task_id
                or lease.ordinal in orphans
                or lease.ordinal in ready
                or lease.ordinal in self._eo_fences.get(iteration_id, {})
            ):
                continue
            holder = self._eo_holder.get((iteration_id, lease.ordinal))
            if holder is not None and uid and holder != uid:
                continue  # the task's newer process holds it
            self._eo_holder.pop((iteration_id, lease.ordinal), None)
            orphans[lease.ordinal] = _Orphan(task.task_id, uid, set(iteration.clients))
            moved += 1
        if moved:
            log.info(
                "exactly-once iteration %d: %d splits leased to lost worker process %s (task %d) "
                "go to other workers once its consumers closed it",
                iteration_id,
                moved,
                uid or "unknown",
                task.task_id,
            )
        self._eo_promote_locked(iteration_id)
