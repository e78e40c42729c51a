"""Liveness: the dispatcher's maintenance thread.

Owns `LivenessMixin`: `_maintenance_loop` (one tick per period), worker
timeouts and liveness probes (a refused connection means the process is
gone), tasks of workers that never came back after a restart, iteration
client timeouts, the grace given to everyone after the dispatcher itself
stalled (`_STALL_S`), was briefly deaf (`_DEAF_S`) or was cut off from the
network (the silence, below), warnings about iterations with consumers and no
worker, and garbage collection of jobs and of the released iterations of named
jobs.

A dispatcher cut off from the network (its host's link down, a partition,
a firewall that drops packets) keeps running but hears nothing: from its
side that looks like every worker and every client falling silent at once.
Declaring them all lost when their timeouts pass would tear down the tasks of
workers that go on serving their consumers on the other side (DYNAMIC splits
counted lost, coordinated rounds moved, iteration clients released, consumers
failing with `WorkerCrashedError` or `NotFoundError` when the link returns).
What tells the two apart:

- An RPC from anyone (a worker's heartbeat or GetSplits, a consumer's
  heartbeat, LocalCluster's ReportWorkerFailure) proves the dispatcher's
  network works, so a worker silent meanwhile is silent on its own account:
  it is declared lost on its timeout as always. A consumer's
  `unreachable_workers` and LocalCluster's exit reports are such RPCs, and say
  which worker died besides. (A partition that cuts the dispatcher off from
  only some of its peers looks the same from here: those are timed out.)
- A liveness probe refused (`_probe`) means a host answered that nothing
  listens on the worker's port: the process is gone, whatever else is
  silent, so it is declared lost at once even during a silence. (A firewall
  that rejects rather than drops looks the same; it is taken for a death.)
- A probe that times out or finds no route, or one that connects, proves
  nothing: a cut-off dispatcher and a host that died both time out, and a
  frozen worker still accepts.
- No RPC at all from any worker or client for `_silence_s` (2 heartbeat
  intervals of the slowest worker, at least `_SILENCE_MIN_S`; consumers
  heartbeat at least every 0.5 s) while workers are registered: every peer
  dying in the same instant is far less likely than the dispatcher's own
  network failing, and if they all died nobody is left to be misled by the
  wait. The dispatcher logs one WARNING (another every
  `_waits.REPEAT_WARNING_S` while it lasts), declares no worker lost by
  timeout and releases no client meanwhile, and when the first RPC arrives
  again (`_heard_rpc`) gives everyone the grace of a restart
  (`_grant_restart_grace_locked`), from then plus the silence's length (at
  most `_RETRANSMIT_MAX_S`): the others' connections may still be waiting
  for TCP's next retransmission, whose interval doubled while the link was
  down. A worker still silent `worker_timeout_ms` after that is declared
  lost then. Without workers, client timeouts run as before.

This needs `worker_timeout_ms` and `client_timeout_ms` longer than the
silence threshold plus a worker heartbeat interval and a maintenance period
(at most 0.5 s), else the timeouts pass before the silence is noticed: 2 s
plus 3 heartbeat intervals always is (the default 300 s is). A dispatcher cut
off for good never declares its silent workers lost, which harms nobody: no
consumer reaches it either.

Fields (`base.DispatcherBase`; all guarded by `self._mu` except `_starved`,
which only the maintenance thread uses, `_stop_event`, and `_last_heard`,
which `_heard_rpc` stores without the lock): reads `_config`,
`_state`, `_iteration_errors`; writes `_workers` (drops lost ones, moves
their last-seen times), `_lost_uids`, `_probing`, `_client_seen`,
`_job_last_used`, `_iteration_idle_since`, `_split_providers`, `_worker_losses`,
`_restart_time`, `_last_heard`, `_silent_since`, `_silence_warned_at` and
`_starved`; `_state` changes only
through `_apply_locked`. Uses worker_loss.py's `_record_losses_locked` and
jobs.py's `_release_client_locked` and `_forget_job_locked`.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from dataservice import _waits
from dataservice.dispatcher import state as st
from dataservice.dispatcher.base import DispatcherBase, _probe_after_s, _Worker, log
from dataservice.sharding import ShardingPolicy

# A maintenance tick late by more than this (and 4 periods) means the
# dispatcher itself stalled (SIGSTOP, a paused VM, swapping): everyone gets the
# grace of a restart (`_grant_stall_grace_locked`). One late by more than
# _DEAF_S (and a period) is credited (`_credit_deaf_time_locked`); shorter
# scheduling delays are ignored, so that a dead worker is still noticed on time.
_STALL_S = 2.0
_DEAF_S = 0.25

# No RPC from any worker or client for this long (and for 2 heartbeat intervals
# of the slowest registered worker) although workers are registered: the
# dispatcher suspects its own network (`_watch_silence_locked`). Consumers
# heartbeat at least every 0.5 s (client/reader.py), so a live one is heard.
_SILENCE_MIN_S = 1.0

# After a silence of S seconds the grace runs from S (at most this) after the
# first RPC back: a TCP connection that kept retransmitting while the link was
# down doubles the interval after each try, so its next one may come as long
# after the link returns as the link was down (Linux caps it at TCP_RTO_MAX,
# 120 s). Measured: a worker's heartbeat got through 6 s after a 7 s link-down.
_RETRANSMIT_MAX_S = 120.0

# A consumer's report that it cannot reach a worker is checked after this long,
# which is what a supervisor needs to say that the worker is restarting.
_SUPERVISOR_GRACE_S = 1.0


class LivenessMixin(DispatcherBase):
    """The maintenance thread of `DispatchServer` (see the module docstring)."""

    if TYPE_CHECKING:  # defined by worker_loss.py and jobs.py

        def _record_losses_locked(
            self, address: str, uid: str, pid: int, reason: str, *, restarting: bool
        ) -> None: ...

        def _release_client_locked(self, client_id: st.IterationClientId) -> None: ...

        def _forget_job_locked(self, job: st.Job) -> None: ...

    def _maintenance_loop(self) -> None:
        cfg = self._config
        period_s = (
            min(
                cfg.worker_timeout_ms_or_default / 4,
                cfg.client_timeout_ms_or_default / 4,
                cfg.job_gc_check_interval_ms_or_default,
                500,
            )
            / 1000
        )
        stall_s = max(_STALL_S, 4 * period_s)
        deaf_s = max(_DEAF_S, period_s)
        next_gc = time.monotonic() + cfg.job_gc_check_interval_ms_or_default / 1000
        # Workers that held tasks before a restart get worker_timeout_ms to come back.
        with self._mu:
            self._restart_time = self._last_heard = time.monotonic()
        last_tick = time.monotonic()
        while not self._stop_event.wait(period_s):
            # One `now` per tick, taken before any check: a stall after it only
            # makes the checks more lenient, a stall before it shows as the gap.
            now = time.monotonic()
            late_s = now - last_tick - period_s
            last_tick = now
            try:
                if late_s > deaf_s:
                    self._deaf_at = now  # a float store; read under the lock
                    with self._mu:
                        if late_s > stall_s:
                            self._grant_stall_grace_locked(late_s, now)
                        else:  # a short hiccup: the time it did not listen does not count
                            self._credit_deaf_time_locked(late_s, now)
                self._check_workers(now)
                self._check_clients(now)
                self._warn_starved_iterations(now)
                if now >= next_gc:
                    self._collect_iterations()
                    self._collect_jobs()
                    next_gc = time.monotonic() + cfg.job_gc_check_interval_ms_or_default / 1000
            except Exception:  # keep the dispatcher alive; the log has the bug
                log.exception("dispatcher maintenance failed")

    def _grant_stall_grace_locked(self, stalled_s: float, now: float) -> None:
        """The dispatcher itself could not run for `stalled_s` seconds (frozen
        by SIGSTOP, a paused VM, swapping): the heartbeats it missed meanwhile
        say nothing about its workers and clients. Give them what a restart
        gives (`_grant_restart_grace_locked`)."""
        log.warning(
            "dispatcher at %s was stalled for %.1f s (frozen, starved of CPU, or one long call "
            "held its Python threads, such as reading a registration of hundreds of MB): its %d "
            "workers and %d iteration clients get their full timeouts again, as after a restart",
            self.target,
            stalled_s,
            len(self._workers),
            len(self._client_seen),
        )
        self._grant_restart_grace_locked(now)
        if self._silent_since is not None:
            self._silent_since = now  # still nobody heard: the silence goes on

    def _grant_restart_grace_locked(self, now: float) -> None:
        """What a restart gives (`_recover`), from `now` (which may be ahead of
        the clock: the last-seen times then lie ahead too): a fresh
        `client_timeout_ms` for every iteration client, `worker_timeout_ms` for
        every worker and for the tasks of workers not registered,
        `job_gc_timeout_ms` for every job and released iteration."""
        self._last_heard = max(self._last_heard, now)
        for worker in self._workers.values():
            worker.last_heartbeat = max(worker.last_heartbeat, now)
        for client_id in self._client_seen:
            self._client_seen[client_id] = max(self._client_seen[client_id], now)
        for job_id in self._job_last_used:
            self._job_last_used[job_id] = max(self._job_last_used[job_id], now)
        for iteration_id in self._iteration_idle_since:
            self._iteration_idle_since[iteration_id] = max(
                self._iteration_idle_since[iteration_id], now
            )
        self._restart_time = max(self._restart_time, now)

    def _credit_deaf_time_locked(self, deaf_s: float, now: float) -> None:
        """Moves every last-seen time `deaf_s` seconds later (at most to
        `now`; one already ahead of `now`, a grace, stays): heartbeats that
        could not be heard while the dispatcher did not run are not held
        against the workers and clients."""

        def credit(seen: float) -> float:
            return max(seen, min(now, seen + deaf_s))

        for worker in self._workers.values():
            worker.last_heartbeat = credit(worker.last_heartbeat)
        for client_id, seen in self._client_seen.items():
            self._client_seen[client_id] = credit(seen)
        for job_id, used in self._job_last_used.items():
            self._job_last_used[job_id] = credit(used)
        for iteration_id, idle in self._iteration_idle_since.items():
            self._iteration_idle_since[iteration_id] = credit(idle)
        self._last_heard = credit(self._last_heard)
        if self._silent_since is not None:  # shifted alike: not taken for an RPC
            self._silent_since = credit(self._silent_since)

    def _heard_rpc(self) -> None:
        """An RPC from a worker or a client arrived (`server._Servicer._call`,
        before its handler runs): the dispatcher's network works. Ends a
        silence (`_end_silence_locked`) before the handler reads any last-seen
        time, so that its answer (a task's `worker_silent_ms`) already has the
        grace."""
        now = time.monotonic()
        self._last_heard = now  # a float store; the maintenance thread reads it
        if self._silent_since is not None:  # checked again under the lock
            with self._mu:
                if self._silent_since is not None:
                    self._end_silence_locked(now)

    def _silence_s(self) -> float:
        """How long the dispatcher may hear nothing from its registered workers
        before it suspects its own network (s): 2 heartbeat intervals of the
        slowest, at least `_SILENCE_MIN_S`. Caller holds `self._mu`."""
        slowest_s = max((w.heartbeat_interval_s for w in self._workers.values()), default=0.0)
        return max(_SILENCE_MIN_S, 2 * slowest_s)

    def _watch_silence_locked(self, now: float) -> bool:
        """Whether the dispatcher is in a silence as of `now` (see the module
        docstring): heard from no worker and no client for `_silence_s()`
        although workers (not restarting) are registered. Starts one (one
        WARNING, repeated every `_waits.REPEAT_WARNING_S`) or ends one
        (`_end_silence_locked`) as the last-seen times say. Handlers driven
        without the servicer move the workers' and clients' times but not
        `_last_heard`: the newest of them all counts."""
        heard = max(
            self._last_heard,
            max((w.last_heartbeat for w in self._workers.values()), default=0.0),
            max(self._client_seen.values(), default=0.0),
        )
        if self._silent_since is not None:
            if heard > self._silent_since:
                self._end_silence_locked(now)
                return False
            if now - self._silence_warned_at >= _waits.REPEAT_WARNING_S:
                self._silence_warned_at = now
                self._warn_silence_locked(now - heard)
            return True
        if not any(not w.restarting for w in self._workers.values()):
            return False
        silence_s = self._silence_s()
        if now - heard <= silence_s:
            return False
        if now - self._deaf_at <= silence_s:
            # The dispatcher itself could not run a moment ago (a late tick):
            # its Python threads, which take RPCs in, could not either (one long
            # call held the GIL, or the process was frozen). Silence since then
            # says nothing of its network yet.
            return False
        self._silent_since = heard
        self._silence_warned_at = now
        self._warn_silence_locked(now - heard)
        return True

    def _warn_silence_locked(self, quiet_s: float) -> None:
        cfg = self._config
        log.warning(
            "dispatcher at %s has heard from no worker and no client for %.1f s although %d "
            "workers are registered: it suspects its own network is cut off (not that they all "
            "died at once): it waits for an RPC to reach it again before it times out any of "
            "them, and they then get their full timeouts (worker_timeout_ms=%d, "
            "client_timeout_ms=%d); a worker whose port refuses connections is dropped at once",
            self.target,
            quiet_s,
            len(self._workers),
            cfg.worker_timeout_ms_or_default,
            cfg.client_timeout_ms_or_default,
        )

    def _end_silence_locked(self, now: float) -> None:
        """An RPC arrived after a silence: everyone gets the grace of a restart,
        from `now` plus the silence's length (at most `_RETRANSMIT_MAX_S`, the
        time a connection that retransmitted meanwhile may take to get
        through), so that only a worker or client silent past its timeout
        after that is declared lost or released."""
        assert self._silent_since is not None
        silence_s = now - self._silent_since
        extra_s = min(silence_s, _RETRANSMIT_MAX_S)
        log.warning(
            "dispatcher at %s hears from its workers and clients again after %.1f s of "
            "silence: its %d workers and %d iteration clients get their full timeouts "
            "again, as after a restart, from %.1f s on (connections that retransmitted "
            "while it was cut off may take that long to get through)",
            self.target,
            silence_s,
            len(self._workers),
            len(self._client_seen),
            extra_s,
        )
        self._silent_since = None
        self._grant_restart_grace_locked(now + extra_s)

    def _unread_shards_text_locked(self, job: st.Job, iteration: st.Iteration) -> str:
        """The shards of a static-sharding `iteration` nobody reads, in words
        ("" if none): for every consumer host of a job that reads local workers."""
        hosts: list[str | None] = (
            list(iteration.consumer_hosts) if job.reads_local_workers_only else [None]
        )
        seen: dict[int, str] = {}
        for host in hosts:
            for m in self._missing_shards_locked(iteration, host):
                seen[m.worker_index] = (
                    f"worker {m.worker_address} (shard {m.worker_index}): {m.reason}"
                )
        return "; ".join(text for _, text in sorted(seen.items()))

    def _warn_starved_iterations(self, now: float) -> None:
        """Warns (`_waits.SlowWait`: after 10 s, then every 30 s) about each
        iteration that has consumers but no worker running it, or (static
        sharding) that waits for the shards of listed workers nobody reads."""
        waits: list[_waits.SlowWait] = []
        with self._mu:
            starved: dict[st.IterationId, str] = {}
            for iteration in self._state.unfinished_iterations():
                if not iteration.clients or iteration.iteration_id in self._iteration_errors:
                    continue
                job = self._state.jobs[iteration.job_id]
                if job.garbage_collected:
                    continue
                name = f" {job.job_name!r}" if job.job_name else ""
                if any(not t.removed for t in iteration.tasks.values()):
                    missing = self._unread_shards_text_locked(job, iteration)
                    if missing:
                        starved[iteration.iteration_id] = (
                            f"dispatcher at {self.target}: iteration {iteration.iteration_id} "
                            f"of job {job.job_id}{name} (repetition {iteration.repetition}) "
                            "cannot end: static sharding reads one shard per listed worker, "
                            f"and nobody reads these: {missing}"
                        )
                    continue
                if job.processing_mode == ShardingPolicy.DYNAMIC and iteration.splits_ended:
                    continue
                if not self._workers:
                    why = "no worker is registered"
                else:
                    why = f"none of its {len(self._workers)} registered workers serves it" + (
                        f" (target_workers={job.target_workers} reads workers on the "
                        f"consumers' hosts {sorted(iteration.consumer_hosts)} only)"
                        if job.reads_local_workers_only
                        else ""
                    )
                starved[iteration.iteration_id] = (
                    f"dispatcher at {self.target}: iteration {iteration.iteration_id} of job "
                    f"{job.job_id}{name} (repetition {iteration.repetition}) has "
                    f"{len(iteration.clients)} consumers waiting and no worker: {why}"
                )
        for iteration_id in list(self._starved):
            if iteration_id not in starved:
                self._starved.pop(iteration_id).done(
                    f"dispatcher: iteration {iteration_id} has a worker again"
                )
        for iteration_id, text in starved.items():
            wait = self._starved.get(iteration_id)
            if wait is None:
                wait = self._starved[iteration_id] = _waits.SlowWait(log, text, start=now)
            wait.describe = text  # the latest reason
            waits.append(wait)
        for wait in waits:  # logged outside the lock
            wait.check(now)

    def _check_workers(self, now: float | None = None) -> None:
        """Drops the workers whose heartbeats stopped (as of `now`, default the
        current monotonic time), and tasks journaled for workers that never
        came back after a restart."""
        timeout_s = self._config.worker_timeout_ms_or_default / 1000
        now = time.monotonic() if now is None else now
        to_probe: list[_Worker] = []
        with self._mu:
            # Heard from nobody: the timeouts wait for the network (probes do not).
            silence = self._watch_silence_locked(now)
            for address, worker in list(self._workers.items()):
                # A timeout below the worker's own heartbeat interval would drop
                # healthy workers: wait for at least 3 missed heartbeats.
                worker_timeout_s = max(timeout_s, 3 * worker.heartbeat_interval_s)
                silent_s = now - worker.last_heartbeat
                if silent_s > worker_timeout_s and not silence:
                    self._declare_lost_locked(
                        worker,
                        f"worker {address} (pid {worker.pid or 'unknown'}) sent no heartbeat "
                        f"for {worker_timeout_s:.1f} s (worker_timeout_ms): it is stopped, "
                        "hung, or its host is down",
                    )
                elif (
                    silent_s > _probe_after_s(worker)
                    and not worker.restarting
                    and address not in self._probing
                    and now - worker.last_probe >= max(0.5, worker.heartbeat_interval_s)
                ):
                    worker.last_probe = now
                    self._probing.add(address)
                    to_probe.append(worker)
            if now - self._restart_time > timeout_s and not silence:
                # Tasks journaled for workers that never came back after a restart.
                for address in self._state.task_worker_addresses():
                    if address not in self._workers:
                        for task in self._state.tasks_of_worker(address):
                            self._apply_locked(st.RemoveTask(task.task_id))
        for worker in to_probe:
            threading.Thread(
                target=self._probe, args=(worker,), name="ds-dispatcher-probe", daemon=True
            ).start()

    def _probe_unreachable_locked(self, addresses: Any, now: float) -> None:
        """A consumer could not reach these workers: probe each now (at most
        every 0.5 s), rather than after it missed heartbeats."""
        for address in addresses:
            worker = self._workers.get(address)
            if (
                worker is None
                or worker.restarting
                or address in self._probing
                or now - worker.last_probe < 0.5
            ):
                continue
            worker.last_probe = now
            self._probing.add(address)
            threading.Thread(
                target=self._probe,
                args=(worker, _SUPERVISOR_GRACE_S),
                name="ds-dispatcher-probe",
                daemon=True,
            ).start()

    def _declare_lost_locked(self, worker: _Worker, reason: str) -> None:
        """Drops a registered worker and its tasks; it may come back (as the
        same process if it was only slow, or restarted on its address)."""
        log.warning("worker lost: %s", reason)
        self._record_losses_locked(worker.address, worker.uid, worker.pid, reason, restarting=False)
        del self._workers[worker.address]
        self._lost_uids[worker.address] = worker.uid
        self._remove_tasks_of_locked(worker.address)

    def _probe(self, worker: _Worker, delay_s: float = 0.0) -> None:
        """Connects to a worker that missed heartbeats or that a consumer could
        not reach (a thread of its own).

        A worker process that died (exit, SIGKILL, OOM kill) leaves no socket
        on its port, so the connection is refused at once: it is declared lost
        now, not after worker_timeout_ms. A worker that is only slow, stopped
        (SIGSTOP) or behind a network that drops packets still accepts or does
        not answer: the heartbeat timeout decides for it. `delay_s` first
        leaves a supervisor that restarts the worker (LocalCluster) time to
        say so (ReportWorkerFailure with `restarting`), so its tasks are kept.
        """
        if delay_s and self._stop_event.wait(delay_s):
            with self._mu:
                self._probing.discard(worker.address)
            return
        host, _, port = worker.address.rpartition(":")
        refused = False
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
                pass
        except ConnectionRefusedError:
            refused = True
        except (OSError, ValueError) as err:  # unreachable, unresolvable: not proof
            log.debug("probe of worker %s: %s", worker.address, err)
        if refused and self._heartbeats_after_refusal(worker):
            refused = False
        with self._mu:
            self._probing.discard(worker.address)
            current = self._workers.get(worker.address)
            if refused and current is worker and not worker.restarting:
                silent_s = max(0.0, time.monotonic() - worker.last_heartbeat)
                self._declare_lost_locked(
                    worker,
                    f"worker {worker.address} (pid {worker.pid or 'unknown'}) is gone: no "
                    f"heartbeat for {silent_s:.1f} s and its port refuses connections (the "
                    "process exited or was killed)",
                )

    def _heartbeats_after_refusal(self, worker: _Worker) -> bool:
        """Whether `worker`, whose port just refused the probe, heartbeats on
        after it: then the process is alive and its advertised address does not
        lead to it from this host (a wrong `worker_address`, a NAT, a gateway
        answering for a host it cannot reach), which is warned of once, and the
        heartbeat timeout decides for it. Waits (at most two heartbeat
        intervals and 0.2 s) only when its last heartbeat is that recent: a
        process that died heartbeats no more, so it is declared lost that much
        later; one silent for longer is declared lost at once."""
        refused_at = time.monotonic()
        with self._mu:
            heard = worker.last_heartbeat
        due_by = heard + 2 * worker.heartbeat_interval_s + 0.2
        if due_by <= refused_at:
            return False
        if self._stop_event.wait(due_by - refused_at):
            return False
        with self._mu:
            alive = worker.last_heartbeat > refused_at
        if alive:
            _waits.warn_once(
                log,
                ("refusing address", worker.address, worker.uid),
                "worker %s (pid %s) heartbeats on time, but its address %s refuses "
                "connections from the dispatcher's host: the address it advertised does not "
                "lead to it from here (its worker_address / --worker-address, or the address "
                "it chose for its bind host); consumers that cannot reach it there fail with "
                "an error naming it",
                worker.address,
                worker.pid or "unknown",
                worker.address,
            )
        return alive

    def _remove_tasks_of_locked(self, address: str) -> None:
        for task in self._state.tasks_of_worker(address):
            self._apply_locked(st.RemoveTask(task.task_id))

    def _check_clients(self, now: float | None = None) -> None:
        """Releases the iteration clients whose heartbeats stopped (as of `now`)."""
        timeout_s = self._config.client_timeout_ms_or_default / 1000
        now = time.monotonic() if now is None else now
        with self._mu:
            if self._watch_silence_locked(now):
                return  # heard from nobody: they may be fine, the network is not
            for client_id, seen in list(self._client_seen.items()):
                if now - seen > timeout_s:
                    log.info("iteration client %d timed out", client_id)
                    self._release_client_locked(client_id)

    def _collect_iterations(self) -> None:
        """Collects each unfinished iteration of a named job that had consumers,
                has none now, and has had none for `job_gc_timeout_ms` (default 5 min;
        checked every `job_gc_check_interval_ms`, by default every
        `job_gc_timeout_ms`, at most every 10 min):
                its tasks are deleted on the workers (they no longer list them), and a
                consumer that later asks for its repetition gets FailedPreconditionError.

                As tf.data service's `GcOldIterations`, in every processing mode: tf.data
                skips DYNAMIC iterations (unless `gc_dynamic_sharding_jobs`) because one
                recreated under the same key would hand out its splits again; here a
                collected iteration is never recreated (its repetition fails instead), so
                no split is visited twice. Each k-th `iter()` of a named job joins its k-th
                repetition, so an epoch loop that drops its iterators leaves one such
                iteration per epoch. The job itself is collected by `_collect_jobs`.
        """
        timeout_s = self._config.job_gc_timeout_ms_or_default / 1000
        now = time.monotonic()
        with self._mu:
            idle_since = self._iteration_idle_since
            live: set[st.IterationId] = set()
            for iteration in self._state.unfinished_iterations():
                job = self._state.jobs[iteration.job_id]
                if not job.job_name or job.garbage_collected:
                    continue  # anonymous jobs go when their consumer leaves (jobs.py)
                iteration_id = iteration.iteration_id
                if iteration.clients or not iteration.ever_had_client:
                    continue
                live.add(iteration_id)
                since = idle_since.setdefault(iteration_id, now)
                if now - since <= timeout_s:
                    continue
                log.info(
                    "garbage collecting iteration %d (repetition %d) of job %d (%s): no "
                    "consumer for %.1f s (job_gc_timeout_ms)",
                    iteration_id,
                    iteration.repetition,
                    job.job_id,
                    job.job_name,
                    now - since,
                )
                self._apply_locked(st.GarbageCollectIteration(iteration_id))
                self._split_providers.pop(iteration_id, None)
                self._split_grants.pop(iteration_id, None)
                self._worker_losses.pop(iteration_id, None)
                live.discard(iteration_id)
            for iteration_id in list(idle_since):
                if iteration_id not in live:
                    del idle_since[iteration_id]

    def _collect_jobs(self) -> None:
        timeout_s = self._config.job_gc_timeout_ms_or_default / 1000
        now = time.monotonic()
        with self._mu:
            for job in list(self._state.jobs.values()):
                if job.garbage_collected:
                    continue
                if job.processing_mode == ShardingPolicy.DYNAMIC and job.job_name:
                    continue  # as tf.data service: DYNAMIC jobs are never collected
                in_use = any(self._state.iterations[i].clients for i in job.iterations.values())
                if in_use:
                    self._job_last_used[job.job_id] = now
                    continue
                if now - self._job_last_used.get(job.job_id, now) > timeout_s:
                    log.info("garbage collecting job %d (%s)", job.job_id, job.job_name)
                    self._apply_locked(st.GarbageCollectJob(job.job_id))
                    self._forget_job_locked(job)
