"""Protobuf form of the dispatcher's journal (rpc/journal.proto) <-> state.py.

`encode_update`/`decode_update` convert one `state.Update` to and from the
bytes of a `JournalRecord`; `encode_snapshot`/`decode_snapshot` convert a whole
`state.DispatcherState` to and from the bytes of a `Snapshot`. The round trip is
exact: `decode_update(encode_update(u)) == u`, and a decoded snapshot holds
equal entities in the same (insertion) order, with each task one object shared
by `DispatcherState.tasks` and its `Iteration.tasks`, as `apply` builds it.

Every update message has the fields of its dataclass, under the same names
(tests/unit/test_journal_codec.py checks it), so updates convert field by field;
`processing_mode` is a `ShardingPolicy` in state.py and an int in the record,
converted by `sharding.sharding_policy_to_proto`/`sharding_policy_from_proto`.
Decoding raises `CodecError` for bytes that are not a message of this format:
unparseable, another `format_version`, an update kind this version does not
know, a processing mode that is no `ShardingPolicy`, or a snapshot whose parts
do not fit together.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from google.protobuf.message import DecodeError, Message

from dataservice.dispatcher import state as st
from dataservice.rpc import journal_pb2 as pb
from dataservice.sharding import (
    ShardingPolicy,
    sharding_policy_from_proto,
    sharding_policy_to_proto,
)

# The format written, and the only one read. Bump it on any change an older
# reader would misread (a new update kind, a field whose meaning changes).
# 2: consumers' and tasks' host ids (AcquireIterationClient.host_id,
# CreateTask.host_id, ...): a job that reads only local workers gives each
# host's consumers that host's tasks, which a version-1 reader would not know.
# (Exactly-once DYNAMIC added update kinds and fields in version 2: a reader
# without them refuses those records as an unknown update kind.)
FORMAT_VERSION = 2

# Update dataclass -> its field in the `JournalRecord.update` oneof.
ONEOF_FIELD: dict[type, str] = {
    st.SetIncarnation: "set_incarnation",
    st.RegisterDataset: "register_dataset",
    st.CreateJob: "create_job",
    st.CreateIteration: "create_iteration",
    st.AcquireIterationClient: "acquire_iteration_client",
    st.ReleaseIterationClient: "release_iteration_client",
    st.CreateTask: "create_task",
    st.FinishTask: "finish_task",
    st.RemoveTask: "remove_task",
    st.ReviveTask: "revive_task",
    st.ProduceSplits: "produce_splits",
    st.AssignRounds: "assign_rounds",
    st.GarbageCollectJob: "garbage_collect_job",
    st.RetireJob: "retire_job",
    st.GarbageCollectIteration: "garbage_collect_iteration",
    st.LeaseSplits: "lease_splits",
    st.SplitsProduced: "splits_produced",
    st.CompleteSplits: "complete_splits",
    st.DrainTask: "drain_task",
}
_UPDATE_CLASS = {name: cls for cls, name in ONEOF_FIELD.items()}
_FIELD_NAMES = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in ONEOF_FIELD}


class CodecError(ValueError):
    """Bytes that are not a journal record or snapshot of this format."""


def _check_version(kind: str, version: int) -> None:
    if version != FORMAT_VERSION:
        raise CodecError(
            f"{kind} has format version {version}, and this dispatcher reads only version "
            f"{FORMAT_VERSION}"
            + (" (written by a newer dataservice?)" if version > FORMAT_VERSION else "")
        )


def _policy_from_proto(value: int, where: str) -> ShardingPolicy:
    """`processing_mode` as the journal holds it -> the enum state.py carries.

    Raises:
        CodecError: `value` is no policy (a corrupt record, or one written by a
            newer dataservice that knows more policies); names `where` and the value.
    """
    try:
        return sharding_policy_from_proto(value)
    except ValueError as err:
        raise CodecError(
            f"{where}'s processing_mode: {err} (written by a newer dataservice?)"
        ) from err


def _parse(message: type[Message], data: bytes, kind: str) -> Any:
    try:
        return message.FromString(data)
    except DecodeError as err:
        raise CodecError(f"{kind} does not parse: {err}") from err


# ------------------------------------------------------------------ updates
def update_to_proto(update: st.Update) -> pb.JournalRecord:
    name = ONEOF_FIELD.get(type(update))
    if name is None:
        raise TypeError(f"not a journaled update: {update!r}")
    record = pb.JournalRecord(format_version=FORMAT_VERSION)
    message = getattr(record, name)
    message.SetInParent()  # selects the oneof even when every field is a default
    for field in _FIELD_NAMES[type(update)]:
        value = getattr(update, field)
        if isinstance(value, tuple):
            getattr(message, field).extend(value)
        elif field == "processing_mode":
            setattr(message, field, sharding_policy_to_proto(value))
        else:
            setattr(message, field, value)
    return record


def update_from_proto(record: pb.JournalRecord) -> st.Update:
    _check_version("the journal record", record.format_version)
    name = record.WhichOneof("update")
    if name is None:
        raise CodecError(
            "the journal record holds no update this dispatcher knows "
            "(an update kind added by a newer dataservice?)"
        )
    cls = _UPDATE_CLASS[name]
    message = getattr(record, name)
    values: dict[str, Any] = {}
    for field in _FIELD_NAMES[cls]:
        value = getattr(message, field)
        if field == "processing_mode":
            values[field] = _policy_from_proto(value, f"the journal record's {name}")
        else:
            # Scalars come back as int/str/bytes/bool; a repeated field as a container.
            values[field] = value if isinstance(value, int | str | bytes) else tuple(value)
    return cls(**values)


def encode_update(update: st.Update) -> bytes:
    """The bytes of `update`'s `JournalRecord`."""
    return update_to_proto(update).SerializeToString()


def decode_update(data: bytes) -> st.Update:
    """The update of a `JournalRecord`'s bytes.

    Raises:
        CodecError: `data` is not a `JournalRecord` of this format.
    """
    return update_from_proto(_parse(pb.JournalRecord, data, "the journal record"))


# ------------------------------------------------------------------ snapshot
def state_to_proto(state: st.DispatcherState) -> pb.Snapshot:
    snapshot = pb.Snapshot(
        format_version=FORMAT_VERSION,
        incarnation_id=state.incarnation_id,
        next_job_id=state.next_job_id,
        next_iteration_id=state.next_iteration_id,
        next_client_id=state.next_client_id,
        next_task_id=state.next_task_id,
        next_dataset_number=state.next_dataset_number,
    )
    for d in state.datasets.values():
        snapshot.datasets.add(
            dataset_id=d.dataset_id,
            fingerprint=d.fingerprint,
            element_spec=d.element_spec,
            cardinality=d.cardinality,
            auto_id=d.auto_id,
            definition_sha256=d.definition_sha256,
            compression=d.compression,
        )
    for fingerprint, dataset_id in state.datasets_by_fingerprint.items():
        snapshot.datasets_by_fingerprint.add(fingerprint=fingerprint, dataset_id=dataset_id)
    for job in state.jobs.values():
        message = snapshot.jobs.add(
            job_id=job.job_id,
            dataset_id=job.dataset_id,
            job_name=job.job_name,
            processing_mode=sharding_policy_to_proto(job.processing_mode),
            num_consumers=job.num_consumers,
            target_workers=job.target_workers,
            client_host_id=job.client_host_id,
            use_cross_trainer_cache=job.use_cross_trainer_cache,
            garbage_collected=job.garbage_collected,
            retired=job.retired,
            num_shards=job.num_shards,
            exactly_once=job.exactly_once,
        )
        for repetition, iteration_id in job.iterations.items():
            message.iterations.add(repetition=repetition, iteration_id=iteration_id)
    for job_name, job_id in state.jobs_by_name.items():
        snapshot.jobs_by_name.add(job_name=job_name, job_id=job_id)
    for it in state.iterations.values():
        message = snapshot.iterations.add(
            iteration_id=it.iteration_id,
            job_id=it.job_id,
            repetition=it.repetition,
            seed=it.seed,
            task_ids=list(it.tasks),
            client_ids=list(it.clients),
            num_split_providers=it.num_split_providers,
            finished=it.finished,
            ever_had_client=it.ever_had_client,
            round_numbers=list(it.rounds),
            round_task_ids=list(it.rounds.values()),
            consumer_hosts=it.consumer_hosts,
            garbage_collected=it.garbage_collected,
        )
        for lease in it.leases.values():
            message.leases.add(
                ordinal=lease.ordinal,
                task_id=lease.task_id,
                int_split=lease.split if isinstance(lease.split, int) else 0,
                str_split=lease.split if isinstance(lease.split, str) else "",
                is_str=isinstance(lease.split, str),
                count=lease.count,
            )
        indexes = list(it.splits_produced)
        indexes += [i for i in it.splits_ended_by_provider if i not in it.splits_produced]
        for index in indexes:
            cursor = message.split_providers.add(provider_index=index)
            if index in it.splits_produced:
                cursor.splits_produced = it.splits_produced[index]
            if index in it.splits_ended_by_provider:
                cursor.ended = it.splits_ended_by_provider[index]
    for client_id, iteration_id in state.clients.items():
        snapshot.clients.add(client_id=client_id, iteration_id=iteration_id)
    for client_id, host_id in state.client_hosts.items():
        snapshot.client_hosts.add(client_id=client_id, host_id=host_id)
    for task in state.tasks.values():
        snapshot.tasks.add(
            task_id=task.task_id,
            iteration_id=task.iteration_id,
            worker_address=task.worker_address,
            worker_index=task.worker_index,
            host_id=task.host_id,
            finished=task.finished,
            removed=task.removed,
            drained=task.drained,
        )
    return snapshot


def state_from_proto(snapshot: pb.Snapshot) -> st.DispatcherState:
    _check_version("the snapshot", snapshot.format_version)
    state = st.DispatcherState()
    state.incarnation_id = snapshot.incarnation_id
    for d in snapshot.datasets:
        state.datasets[d.dataset_id] = st.Dataset(
            d.dataset_id,
            d.fingerprint,
            d.element_spec,
            d.cardinality,
            d.auto_id,
            d.definition_sha256,
            d.compression,
        )
    for e in snapshot.datasets_by_fingerprint:
        state.datasets_by_fingerprint[e.fingerprint] = e.dataset_id
    for j in snapshot.jobs:
        state.jobs[st.JobId(j.job_id)] = st.Job(
            job_id=st.JobId(j.job_id),
            dataset_id=j.dataset_id,
            job_name=j.job_name,
            processing_mode=_policy_from_proto(j.processing_mode, f"the snapshot's job {j.job_id}"),
            num_consumers=j.num_consumers,
            target_workers=j.target_workers,
            client_host_id=j.client_host_id,
            use_cross_trainer_cache=j.use_cross_trainer_cache,
            iterations={e.repetition: st.IterationId(e.iteration_id) for e in j.iterations},
            garbage_collected=j.garbage_collected,
            retired=j.retired,
            num_shards=j.num_shards,
            exactly_once=j.exactly_once,
        )
    for e in snapshot.jobs_by_name:
        state.jobs_by_name[e.job_name] = st.JobId(e.job_id)
    for t in snapshot.tasks:
        state.add_task(
            st.Task(
                st.TaskId(t.task_id),
                st.IterationId(t.iteration_id),
                t.worker_address,
                t.worker_index,
                host_id=t.host_id,
                finished=t.finished,
                removed=t.removed,
                drained=t.drained,
            )
        )
    for i in snapshot.iterations:
        it = st.Iteration(st.IterationId(i.iteration_id), st.JobId(i.job_id), i.repetition, i.seed)
        for task_id in i.task_ids:
            task = state.tasks.get(st.TaskId(task_id))
            if task is None:
                raise CodecError(
                    f"the snapshot's iteration {i.iteration_id} lists task {task_id}, "
                    "which is not among its tasks"
                )
            it.tasks[task.task_id] = task
        it.clients = {st.IterationClientId(c) for c in i.client_ids}
        for cursor in i.split_providers:
            if cursor.HasField("splits_produced"):
                it.splits_produced[cursor.provider_index] = cursor.splits_produced
            if cursor.HasField("ended"):
                it.splits_ended_by_provider[cursor.provider_index] = cursor.ended
        it.num_split_providers = i.num_split_providers
        it.finished = i.finished
        it.ever_had_client = i.ever_had_client
        it.garbage_collected = i.garbage_collected
        if len(i.round_numbers) != len(i.round_task_ids):
            raise CodecError(
                f"the snapshot's iteration {i.iteration_id} has {len(i.round_numbers)} round "
                f"numbers but {len(i.round_task_ids)} round task ids"
            )
        it.rounds = {
            r: st.TaskId(t) for r, t in zip(i.round_numbers, i.round_task_ids, strict=True)
        }
        it.consumer_hosts = list(i.consumer_hosts)
        for e in i.leases:
            split: int | str = e.str_split if e.is_str else e.int_split
            it.leases[e.ordinal] = st.SplitLease(e.ordinal, st.TaskId(e.task_id), split, e.count)
        state.add_iteration(it)
    for e in snapshot.clients:
        state.clients[st.IterationClientId(e.client_id)] = st.IterationId(e.iteration_id)
    for e in snapshot.client_hosts:
        state.client_hosts[st.IterationClientId(e.client_id)] = e.host_id
    state.next_job_id = snapshot.next_job_id
    state.next_iteration_id = snapshot.next_iteration_id
    state.next_client_id = snapshot.next_client_id
    state.next_task_id = snapshot.next_task_id
    state.next_dataset_number = snapshot.next_dataset_number
    return state


def encode_snapshot(state: st.DispatcherState) -> bytes:
    """The bytes of `state`'s `Snapshot`."""
    return state_to_proto(state).SerializeToString()


def decode_snapshot(data: bytes) -> st.DispatcherState:
    """The state of a `Snapshot`'s bytes.

    Raises:
        CodecError: `data` is not a `Snapshot` of this format.
    """
    return state_from_proto(_parse(pb.Snapshot, data, "the snapshot"))
