"""The dispatcher's state: datasets, jobs, iterations, tasks, iteration clients.

State changes only through `DispatcherState.apply(update)`, and every update
is a small frozen dataclass, so the journal (journal.py) replays exactly what
happened live: replaying the updates of a run rebuilds the same state. The
journal stores updates, and snapshots of the whole state, as protobuf
(rpc/journal.proto, converted by journal_codec.py): a new update kind, or a
new field of an update, an entity or `DispatcherState`, needs its field there
too (tests/unit/test_journal_codec.py fails until it has one).
Thread-compatible: the dispatcher's lock guards it.

Ids of each kind start in their own range (datasets are strings; jobs from
1000, iterations from 2000, iteration clients from 3000, tasks from 4000) so a
mixed-up id stands out in logs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NewType

from dataservice.sharding import STATIC_POLICIES, ShardingPolicy

JobId = NewType("JobId", int)
IterationId = NewType("IterationId", int)
IterationClientId = NewType("IterationClientId", int)
TaskId = NewType("TaskId", int)

FIRST_JOB_ID = 1000
FIRST_ITERATION_ID = 2000
FIRST_CLIENT_ID = 3000
FIRST_TASK_ID = 4000
ID_STRIDE = 1_000_000  # each kind's range: [first, first + stride)


# ------------------------------------------------------------------ updates
@dataclass(frozen=True)
class SetIncarnation:
    incarnation_id: str


@dataclass(frozen=True)
class RegisterDataset:
    dataset_id: str
    fingerprint: str
    element_spec: bytes
    cardinality: int
    auto_id: bool
    # Hex SHA-256 of the definition file that the dispatcher wrote (journal.py);
    # "" without a journal, and in journals written before it.
    definition_sha256: str = ""
    # register_dataset's `compression` (upper case; "": none), read by
    # from_dataset_id; "" in journals written before it.
    compression: str = ""


@dataclass(frozen=True)
class CreateJob:
    job_id: JobId
    dataset_id: str
    job_name: str
    processing_mode: ShardingPolicy
    num_consumers: int
    target_workers: str
    client_host_id: str
    use_cross_trainer_cache: bool = False
    num_shards: int = 0  # static sharding: listed workers (Job.num_shards)
    exactly_once: bool = False  # Job.exactly_once


@dataclass(frozen=True)
class CreateIteration:
    iteration_id: IterationId
    job_id: JobId
    repetition: int
    seed: int
    num_split_providers: int = 1


@dataclass(frozen=True)
class AcquireIterationClient:
    """A consumer joined the iteration from host `host_id` (its client's host
    id; a job that reads only local workers gives it that host's tasks)."""

    client_id: IterationClientId
    iteration_id: IterationId
    host_id: str = ""


@dataclass(frozen=True)
class ReleaseIterationClient:
    client_id: IterationClientId


@dataclass(frozen=True)
class CreateTask:
    task_id: TaskId
    iteration_id: IterationId
    worker_address: str
    worker_index: int
    host_id: str = ""  # of the worker, when it registered


@dataclass(frozen=True)
class FinishTask:
    task_id: TaskId


@dataclass(frozen=True)
class RemoveTask:
    """The task's worker was lost: its remaining elements will never come."""

    task_id: TaskId


@dataclass(frozen=True)
class ReviveTask:
    """A worker declared lost came back (same process: it was only slow) and
    still runs the task: the task is live again."""

    task_id: TaskId


@dataclass(frozen=True)
class DrainTask:
    """The task's worker is draining (retire.py) and was refused splits while
    the iteration's split providers had more: the task's end is not the end
    of the iteration's splits (`Iteration` stays open for other tasks)."""

    task_id: TaskId


@dataclass(frozen=True)
class ProduceSplits:
    """`count` more splits of the iteration's provider `provider_index` were
    handed out; `end` once that split provider is exhausted."""

    iteration_id: IterationId
    count: int
    end: bool
    provider_index: int = 0


@dataclass(frozen=True)
class LeaseSplits:
    """Exactly-once DYNAMIC (dispatcher/exactly_once.py): splits `ordinals` are
    leased to task `task_id`, handed out for the first time or again after the
    process that held them was lost. Their values are `int_splits` or
    `str_splits` (parallel to `ordinals`; the other one is empty)."""

    iteration_id: IterationId
    task_id: TaskId
    ordinals: tuple[int, ...]
    int_splits: tuple[int, ...] = ()
    str_splits: tuple[str, ...] = ()


@dataclass(frozen=True)
class SplitsProduced:
    """Exactly-once DYNAMIC: leased split `ordinals[i]` produced `counts[i]`
    elements in all (the worker ran it to its end)."""

    iteration_id: IterationId
    ordinals: tuple[int, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True)
class CompleteSplits:
    """Exactly-once DYNAMIC: the consumers received every element of these
    splits; their leases end."""

    iteration_id: IterationId
    ordinals: tuple[int, ...]


@dataclass(frozen=True)
class AssignRounds:
    """Coordinated reads: rounds [first_round, first_round + len(task_ids)) are
    served by these tasks (a new block, or a rewrite off a lost task)."""

    iteration_id: IterationId
    first_round: int
    task_ids: tuple[TaskId, ...]


@dataclass(frozen=True)
class GarbageCollectJob:
    job_id: JobId


@dataclass(frozen=True)
class GarbageCollectIteration:
    """An iteration of a named job that no consumer read for `job_gc_timeout_ms`
    after its last one left (liveness.py `_collect_iterations`): it is over, its
    tasks are deleted on the workers, and its repetition cannot be joined again."""

    iteration_id: IterationId


@dataclass(frozen=True)
class RetireJob:
    """A named job with no consumer left gave its name to a new job (another
    dataset or parameters, `GetOrCreateJob`): as `GarbageCollectJob`, and the
    job remembers it was replaced, for the errors of its late readers."""

    job_id: JobId


Update = (
    SetIncarnation
    | RegisterDataset
    | CreateJob
    | CreateIteration
    | AcquireIterationClient
    | ReleaseIterationClient
    | CreateTask
    | FinishTask
    | RemoveTask
    | ReviveTask
    | DrainTask
    | ProduceSplits
    | AssignRounds
    | GarbageCollectJob
    | GarbageCollectIteration
    | RetireJob
    | LeaseSplits
    | SplitsProduced
    | CompleteSplits
)


# ------------------------------------------------------------------ entities
@dataclass
class Dataset:
    dataset_id: str
    fingerprint: str
    element_spec: bytes
    cardinality: int
    auto_id: bool
    definition_sha256: str = ""  # RegisterDataset.definition_sha256
    compression: str = ""  # RegisterDataset.compression


@dataclass
class Job:
    job_id: JobId
    dataset_id: str
    job_name: str
    processing_mode: ShardingPolicy
    num_consumers: int
    target_workers: str
    client_host_id: str
    use_cross_trainer_cache: bool = False
    # Static sharding: len(DispatcherConfig.worker_addresses) at creation, one shard
    # per listed worker, each read by every iteration (unread_shards); 0 otherwise.
    num_shards: int = 0
    iterations: dict[int, IterationId] = field(default_factory=dict)  # repetition -> id
    garbage_collected: bool = False
    retired: bool = False  # replaced under its name by another job (RetireJob)
    # Exactly-once DYNAMIC (distribute(exactly_once=True)): splits are leased
    # until their elements reached the consumers (Iteration.leases).
    exactly_once: bool = False

    @property
    def reads_local_workers_only(self) -> bool:
        """Whether each consumer reads only the workers on its own host:
        target_workers="LOCAL", or "AUTO" with static sharding (API.md: local
        workers are the ones static sharding reads from; tf.data's AUTO would
        read every worker not colocated with another trainer). A coordinated
        read (num_consumers) reads every worker. "ANY" reads every worker."""
        if self.target_workers == "LOCAL":
            return True
        return (
            self.target_workers == "AUTO"
            and self.processing_mode in STATIC_POLICIES
            and not self.num_consumers
        )


@dataclass
class Iteration:
    iteration_id: IterationId
    job_id: JobId
    repetition: int
    seed: int
    tasks: dict[TaskId, Task] = field(default_factory=dict)
    clients: set[IterationClientId] = field(default_factory=set)
    # per split provider (one per splittable source): splits handed out, ended
    splits_produced: dict[int, int] = field(default_factory=dict)
    splits_ended_by_provider: dict[int, bool] = field(default_factory=dict)
    num_split_providers: int = 1
    finished: bool = False
    ever_had_client: bool = False
    rounds: dict[int, TaskId] = field(default_factory=dict)  # coordinated reads
    # Host ids of the consumers that joined, in order of their first consumer.
    consumer_hosts: list[str] = field(default_factory=list)
    # Collected after its consumers left (GarbageCollectIteration); also finished.
    garbage_collected: bool = False
    # Exactly-once DYNAMIC: the open leases, by split ordinal (handout order).
    leases: dict[int, SplitLease] = field(default_factory=dict)

    @property
    def splits_ended(self) -> bool:
        """Every split provider of the iteration is exhausted."""
        ended = self.splits_ended_by_provider
        return len(ended) >= self.num_split_providers and all(ended.values())

    def live_tasks(self) -> list[Task]:
        return [t for t in self.tasks.values() if not t.finished and not t.removed]


@dataclass
class SplitLease:
    """Exactly-once DYNAMIC: split `split` (an index or a file name), the
    `ordinal`-th handed out by the iteration, leased to task `task_id` until the
    consumers received its `count` elements (-1: not known yet)."""

    ordinal: int
    task_id: TaskId
    split: int | str
    count: int = -1


@dataclass
class Task:
    task_id: TaskId
    iteration_id: IterationId
    worker_address: str
    worker_index: int
    host_id: str = ""  # of the worker, when it registered
    finished: bool = False
    removed: bool = False
    # Cut short by its worker's draining (DrainTask): finishing does not end
    # its iteration, and the worker may get a new task in it if un-drained.
    drained: bool = False


class DispatcherState:
    """Everything the dispatcher knows that must survive a restart."""

    def __init__(self) -> None:
        self.incarnation_id = ""
        self.datasets: dict[str, Dataset] = {}
        self.datasets_by_fingerprint: dict[str, str] = {}  # auto-id datasets only
        self.jobs: dict[JobId, Job] = {}
        self.jobs_by_name: dict[str, JobId] = {}  # job_name -> its live (not collected) job
        self.iterations: dict[IterationId, Iteration] = {}
        self.clients: dict[IterationClientId, IterationId] = {}
        self.client_hosts: dict[IterationClientId, str] = {}  # a live client -> its host id
        self.tasks: dict[TaskId, Task] = {}
        # Per worker address, its tasks that may still be live (see `tasks_of_worker`).
        self._maybe_live_tasks: dict[str, dict[TaskId, Task]] = {}
        # Iterations that may not be finished yet (see `unfinished_iterations`).
        self._maybe_unfinished: dict[IterationId, Iteration] = {}
        self.next_job_id = FIRST_JOB_ID
        self.next_iteration_id = FIRST_ITERATION_ID
        self.next_client_id = FIRST_CLIENT_ID
        self.next_task_id = FIRST_TASK_ID
        self.next_dataset_number = 1000

    # The one write path.
    def apply(self, update: Update) -> None:
        handler = getattr(self, "_apply_" + type(update).__name__)
        handler(update)

    def _apply_SetIncarnation(self, u: SetIncarnation) -> None:
        self.incarnation_id = u.incarnation_id

    def _apply_RegisterDataset(self, u: RegisterDataset) -> None:
        self.datasets[u.dataset_id] = Dataset(
            u.dataset_id,
            u.fingerprint,
            u.element_spec,
            u.cardinality,
            u.auto_id,
            u.definition_sha256,
            u.compression,
        )
        if u.auto_id:
            self.datasets_by_fingerprint[u.fingerprint] = u.dataset_id
            if u.dataset_id.isdigit():
                self.next_dataset_number = max(self.next_dataset_number, int(u.dataset_id) + 1)

    def _apply_CreateJob(self, u: CreateJob) -> None:
        fields = {f.name: getattr(u, f.name) for f in dataclasses.fields(u)}
        job = Job(**fields)
        self.jobs[u.job_id] = job
        if u.job_name:
            self.jobs_by_name[u.job_name] = u.job_id
        self.next_job_id = max(self.next_job_id, u.job_id + 1)

    def _apply_CreateIteration(self, u: CreateIteration) -> None:
        it = Iteration(u.iteration_id, u.job_id, u.repetition, u.seed)
        it.num_split_providers = u.num_split_providers
        self.add_iteration(it)
        self.jobs[u.job_id].iterations[u.repetition] = u.iteration_id
        self.next_iteration_id = max(self.next_iteration_id, u.iteration_id + 1)

    def _apply_AcquireIterationClient(self, u: AcquireIterationClient) -> None:
        self.clients[u.client_id] = u.iteration_id
        self.client_hosts[u.client_id] = u.host_id
        it = self.iterations[u.iteration_id]
        it.clients.add(u.client_id)
        it.ever_had_client = True
        if u.host_id not in it.consumer_hosts:
            it.consumer_hosts.append(u.host_id)
        self.next_client_id = max(self.next_client_id, u.client_id + 1)

    def _apply_ReleaseIterationClient(self, u: ReleaseIterationClient) -> None:
        iteration_id = self.clients.pop(u.client_id, None)
        self.client_hosts.pop(u.client_id, None)
        if iteration_id is not None and iteration_id in self.iterations:
            self.iterations[iteration_id].clients.discard(u.client_id)

    def _apply_CreateTask(self, u: CreateTask) -> None:
        task = Task(u.task_id, u.iteration_id, u.worker_address, u.worker_index, u.host_id)
        self.add_task(task)
        self.iterations[u.iteration_id].tasks[u.task_id] = task
        self.next_task_id = max(self.next_task_id, u.task_id + 1)

    def add_iteration(self, it: Iteration) -> None:
        """Adds `it` to `iterations` and, unless it is finished, to those
        `unfinished_iterations` looks at; the snapshot loader adds iterations through
        here too."""
        self.iterations[it.iteration_id] = it
        if not it.finished:
            self._maybe_unfinished[it.iteration_id] = it

    def add_task(self, task: Task) -> None:
        """Adds `task` to `tasks` and to its worker's tasks (`tasks_of_worker`); the
        journal's snapshot loader adds tasks through here too."""
        self.tasks[task.task_id] = task
        self._maybe_live_tasks.setdefault(task.worker_address, {})[task.task_id] = task

    def _apply_FinishTask(self, u: FinishTask) -> None:
        task = self.tasks.get(u.task_id)
        if task is None:
            return
        task.finished = True
        self._maybe_finish_iteration(self.iterations[task.iteration_id])

    def _apply_RemoveTask(self, u: RemoveTask) -> None:
        task = self.tasks.get(u.task_id)
        if task is None:
            return
        task.removed = True
        self._maybe_finish_iteration(self.iterations[task.iteration_id])

    def _apply_ReviveTask(self, u: ReviveTask) -> None:
        task = self.tasks.get(u.task_id)
        if task is not None and not self.iterations[task.iteration_id].finished:
            task.removed = False

    def _apply_DrainTask(self, u: DrainTask) -> None:
        task = self.tasks.get(u.task_id)
        if task is not None:
            task.drained = True

    def _apply_ProduceSplits(self, u: ProduceSplits) -> None:
        it = self.iterations[u.iteration_id]
        i = u.provider_index
        it.splits_produced[i] = it.splits_produced.get(i, 0) + u.count
        it.splits_ended_by_provider[i] = it.splits_ended_by_provider.get(i, False) or u.end

    def _apply_LeaseSplits(self, u: LeaseSplits) -> None:
        leases = self.iterations[u.iteration_id].leases
        splits: tuple[int | str, ...] = u.str_splits or u.int_splits
        for ordinal, split in zip(u.ordinals, splits, strict=True):
            lease = leases.get(ordinal)
            if lease is None:
                leases[ordinal] = SplitLease(ordinal, u.task_id, split)
            else:
                lease.task_id = u.task_id

    def _apply_SplitsProduced(self, u: SplitsProduced) -> None:
        leases = self.iterations[u.iteration_id].leases
        for ordinal, count in zip(u.ordinals, u.counts, strict=True):
            lease = leases.get(ordinal)
            if lease is not None:
                lease.count = count

    def _apply_CompleteSplits(self, u: CompleteSplits) -> None:
        leases = self.iterations[u.iteration_id].leases
        for ordinal in u.ordinals:
            leases.pop(ordinal, None)

    def _apply_AssignRounds(self, u: AssignRounds) -> None:
        rounds = self.iterations[u.iteration_id].rounds
        for i, task_id in enumerate(u.task_ids):
            rounds[u.first_round + i] = task_id

    def _apply_GarbageCollectJob(self, u: GarbageCollectJob) -> None:
        job = self.jobs[u.job_id]
        job.garbage_collected = True
        if job.job_name and self.jobs_by_name.get(job.job_name) == u.job_id:
            del self.jobs_by_name[job.job_name]
        for iteration_id in job.iterations.values():
            it = self.iterations[iteration_id]
            it.finished = True
            for client_id in list(it.clients):
                self.clients.pop(client_id, None)
                self.client_hosts.pop(client_id, None)
            it.clients.clear()

    def _apply_GarbageCollectIteration(self, u: GarbageCollectIteration) -> None:
        it = self.iterations[u.iteration_id]
        it.finished = True
        it.garbage_collected = True
        for client_id in list(it.clients):
            self.clients.pop(client_id, None)
            self.client_hosts.pop(client_id, None)
        it.clients.clear()

    def _apply_RetireJob(self, u: RetireJob) -> None:
        self._apply_GarbageCollectJob(GarbageCollectJob(u.job_id))
        self.jobs[u.job_id].retired = True

    def _maybe_finish_iteration(self, it: Iteration) -> None:
        # Finished once some task ran to its end and no live task remains
        # (an iteration whose workers were all lost waits for new workers).
        # Where each host's consumers read their own workers' full share (OFF
        # or static sharding, local workers only), one host's end is not the
        # iteration's: a consumer on another host may still come and read its
        # own workers, so such an iteration ends per host (host_part_finished)
        # and as a whole only when its job is collected.
        if it.finished:
            return
        job = self.jobs[it.job_id]
        if job.reads_local_workers_only and job.processing_mode != ShardingPolicy.DYNAMIC:
            return
        if self.unread_shards(it):
            return
        if it.leases:
            return  # exactly-once: a lost worker's splits are still to be produced
        # A task cut short by its worker's draining did not run to the end of
        # the splits: the splits left wait for another task.
        ended = any(t.finished and not t.drained for t in it.tasks.values())
        if ended and not it.live_tasks():
            it.finished = True

    # Queries: they change no state (`tasks_of_worker` and `unfinished_iterations` prune
    # their own private indexes of what cannot come back).
    def job_of_iteration(self, iteration_id: IterationId) -> Job:
        return self.jobs[self.iterations[iteration_id].job_id]

    def live_job_named(self, job_name: str) -> Job | None:
        job_id = self.jobs_by_name.get(job_name)
        return self.jobs[job_id] if job_id is not None else None

    def host_part_finished(self, it: Iteration, host_id: str) -> bool:
        """Whether the consumers on `host_id` have read all of `it` they will
        get, for a job that reads only local workers: the iteration is over,
        or the tasks on that host's workers are, one of them to its end (as
        `_maybe_finish_iteration` for a whole iteration), or, under DYNAMIC
        sharding, every split is handed out and none of them runs there."""
        if it.finished:
            return True
        mine = [t for t in it.tasks.values() if t.host_id == host_id]
        if any(not t.finished and not t.removed for t in mine):
            return False
        if any(t.finished for t in mine):
            return True
        return self.jobs[it.job_id].processing_mode == ShardingPolicy.DYNAMIC and it.splits_ended

    def unread_shards(self, it: Iteration) -> list[int]:
        """Under static sharding with a fixed worker list: the shards (worker
        indices, positions in DispatcherConfig.worker_addresses) of `it` that
        no task read to its end. As in tf.data service, each listed worker
        holds one shard and an iteration is not over until every shard was
        read, so one whose worker has not registered yet (or was lost) keeps
        the iteration open for it instead of ending it with part of the data.
        Empty for other policies."""
        job = self.jobs[it.job_id]
        if not job.num_shards or job.processing_mode not in STATIC_POLICIES:
            return []
        done = {t.worker_index for t in it.tasks.values() if t.finished}
        return [i for i in range(job.num_shards) if i not in done]

    def unfinished_iterations(self) -> list[Iteration]:
        """The iterations not finished, oldest first. Looks only at those that were
        not the last time (an iteration never comes back from finished) and drops the
        ones that finished since: the dispatcher keeps every iteration it made, and the
        liveness checks ask for these every few hundred ms."""
        unfinished = []
        over = []
        for iteration_id, it in self._maybe_unfinished.items():
            if it.finished:
                over.append(iteration_id)
            else:
                unfinished.append(it)
        for iteration_id in over:
            del self._maybe_unfinished[iteration_id]
        return unfinished

    def tasks_of_worker(self, worker_address: str) -> list[Task]:
        """The live tasks of worker `worker_address`: not finished, not removed, of an
        iteration not finished. Looks only at that worker's tasks that may still be
        live: a finished task, or one of a finished iteration, never is again (neither
        state is undone; a removed task can be revived), so it is dropped from that set
        here. The dispatcher keeps every task it made (`tasks`), so a scan of all of
        them grew with every iteration ever created, on each worker heartbeat and each
        WatchTasks answer."""
        maybe_live = self._maybe_live_tasks.get(worker_address)
        if not maybe_live:
            return []
        live = []
        over = []
        for task_id, t in maybe_live.items():
            if t.finished or self.iterations[t.iteration_id].finished:
                over.append(task_id)
            elif not t.removed:
                live.append(t)
        for task_id in over:
            del maybe_live[task_id]
        if not maybe_live:
            del self._maybe_live_tasks[worker_address]
        return live

    def task_worker_addresses(self) -> list[str]:
        """The worker addresses that may have live tasks (`tasks_of_worker`)."""
        return list(self._maybe_live_tasks)
