"""Checks of every RPC request at the edge, before a handler sees it.

Each request message of `service.proto` has its rules here, declared per field
(`RULES`, keyed by the message's full name): enum values (processing_mode,
target_workers, compression), ids (non-negative), sizes (non-negative and
bounded), strings (bounded length, no control characters), repeated fields
(bounded count, each item checked) and addresses ("host:port"). A request that
breaks a rule is refused with `InvalidArgumentError` naming the RPC, the field
and the bad value, so the caller gets INVALID_ARGUMENT, never INTERNAL from a
handler or a failure later on a worker.

Bytes that are no valid request at all (truncated, a string that is not UTF-8)
are INVALID_ARGUMENT too: `add_service` serves each servicer with deserializers
that never raise (gRPC answers INTERNAL when one does).

What needs the server's state (an id that does not exist: NOT_FOUND; a request
that does not fit the state of what it names: FAILED_PRECONDITION, e.g.
GetSplits of an iteration that is not DYNAMIC) is checked by the handler that
holds that state under its lock; the worker's one such check, whether a read
fits its task's kind, is `check_read_fits_task` here.

`check_request` is called from each servicer's common entry point
(`dispatcher.server._Servicer._call`, `worker.serving.WorkerServicer.GetElements`).
A field added to a request message needs its rule here
(tests/security/test_rpc_validation.py checks that every field has one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dataservice import errors
from dataservice.sharding import sharding_policy_from_proto

# Bounds. Generous for real use, small enough that no field sizes a big allocation
# or makes the dispatcher's state (and its journal) grow without limit.
MAX_ID = 2**62  # ids are handed out counting from 0/1; nothing real gets near
MAX_NAME_CHARS = 1024  # dataset ids, job names, host ids, trainer ids
MAX_CONSUMER_KEY_CHARS = 64  # GetElementsRequest.consumer_key (clients send 32 hex digits)
MAX_ADDRESS_CHARS = 1024
MAX_TOKEN_CHARS = 128  # incarnation ids (uuid4 hex, 32), worker uids
MAX_REASON_CHARS = 64 * 1024  # ReportWorkerFailure.reason: goes into consumers' errors
MAX_PROTOCOL_CHARS = 64
MAX_PROTOCOLS = 64
MAX_REPEATED_IDS = 1_000_000  # task ids in one heartbeat
MAX_ELEMENT_SPEC_BYTES = 64 << 20
MAX_CONSUMERS = 1 << 16
MAX_REPETITION = 2**31 - 1
MAX_ROUND = 2**62
MAX_SPLIT_PROVIDERS = 1 << 16
MAX_JOINT_SPLIT_PROVIDERS = 1024  # sources of one pipeline fetched in one GetSplits
MAX_HEARTBEAT_INTERVAL_MS = 24 * 3600 * 1000
MAX_ELEMENTS_PER_READ = 1 << 20
MAX_BYTES_PER_READ = 2**31 - 1  # gRPC's message limit (rpc/util.py MAX_MESSAGE_BYTES)
MIN_MESSAGE_BYTES = 1 << 10  # GetElementsRequest.max_message_bytes, when set
MAX_PID = 2**22  # Linux's pid_max limit (PID_MAX_LIMIT on 64-bit)
# data/dataset.py: INFINITE_CARDINALITY = -1, UNKNOWN_CARDINALITY = -2.
MIN_CARDINALITY = -2
MAX_COUNT = 2**63 - 1  # cumulative counters (elements, bytes)
MAX_SECONDS = 1e12  # cumulative seconds (CPU, waits): ~31,700 years
MAX_STATUS_WINDOW_MS = 24 * 3600 * 1000

TARGET_WORKERS = ("AUTO", "ANY", "LOCAL")  # client/api.py sends them upper-cased
REGISTER_COMPRESSIONS = ("AUTO", "NONE", "ZSTD")  # distribute's `compression`, any case
ELEMENT_COMPRESSIONS = ("zstd",)  # transfer/codec.py COMPRESSIONS

Check = Callable[[str, Any], "str | None"]
"""A field check: (field name, value) -> why the value is refused, or None."""


@dataclass(frozen=True)
class Field:
    """One field's rule: `name` of the field, `check` of its value."""

    name: str
    check: Check


@dataclass(frozen=True)
class Across:
    """A rule over several fields of one message: `check(request)` says why
    the request is refused, or None; `fields` are named in the error."""

    fields: tuple[str, ...]
    check: Callable[[Any], str | None]


Rule = Field | Across


# ---------------------------------------------------------------- field checks
def int_range(lo: int, hi: int, what: str = "") -> Check:
    """An integer in [lo, hi]."""

    def check(name: str, value: Any) -> str | None:
        if lo <= value <= hi:
            return None
        return what or f"must be in [{lo}, {hi}]"

    return check


def _message_bytes(name: str, value: Any) -> str | None:
    """0 (the default) or in [MIN_MESSAGE_BYTES, MAX_BYTES_PER_READ]."""
    if value == 0 or MIN_MESSAGE_BYTES <= value <= MAX_BYTES_PER_READ:
        return None
    return f"must be 0 (the default) or in [{MIN_MESSAGE_BYTES}, {MAX_BYTES_PER_READ}]"


def an_id(name: str, value: Any) -> str | None:
    """An id: non-negative, below `MAX_ID`."""
    return None if 0 <= value <= MAX_ID else f"must be an id in [0, {MAX_ID}]"


def index_or_unset(hi: int) -> Check:
    """-1 (not set: not a coordinated read) or an index in [0, hi]."""
    return int_range(-1, hi, f"must be -1 (not set) or in [0, {hi}]")


def text(max_chars: int, *, required: bool = False) -> Check:
    """A string of at most `max_chars` characters and no control characters
    (they would garble logs and error messages, and no real name has them)."""

    def check(name: str, value: Any) -> str | None:
        if required and not value:
            return "must not be empty"
        if len(value) > max_chars:
            return f"is {len(value)} characters long, at most {max_chars} are allowed"
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            return "must not contain control characters"
        return None

    return check


def one_of(values: Sequence[str], *, allow_empty: bool, ignore_case: bool = False) -> Check:
    """A string among `values` (or empty, where that means the default)."""

    def check(name: str, value: Any) -> str | None:
        if allow_empty and value == "":
            return None
        if (value.upper() if ignore_case else value) in values:
            return None
        empty = ' or "" (the default)' if allow_empty else ""
        case = " (any case)" if ignore_case else ""
        return f"must be one of {list(values)}{case}{empty}"

    return check


def sharding_policy(name: str, value: Any) -> str | None:
    """A `ShardingPolicy` value."""
    try:
        sharding_policy_from_proto(value)
    except ValueError as err:
        return str(err)
    return None


def host_port(*, required: bool) -> Check:
    """ "host:port" as workers advertise it: a host (a name, an IPv4 address or
    a bracketed IPv6 address) and a port in 1..65535."""
    base = text(MAX_ADDRESS_CHARS, required=required)

    def check(name: str, value: Any) -> str | None:
        why = base(name, value)
        if why is not None or not value:
            return why
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            return "must be 'host:port' with a port in 1..65535"
        if any(c.isspace() for c in host) or "/" in host:
            return "must be 'host:port': the host has whitespace or '/'"
        if host.startswith("[") != host.endswith("]"):
            return "must be 'host:port': unbalanced brackets around an IPv6 host"
        return None

    return check


def repeated(item: Check, max_items: int) -> Check:
    """A repeated field: at most `max_items` items, each passing `item`."""

    def check(name: str, values: Any) -> str | None:
        if len(values) > max_items:
            return f"has {len(values)} items, at most {max_items} are allowed"
        for i, value in enumerate(values):
            why = item(f"{name}[{i}]", value)
            if why is not None:
                return f"item {i} ({value!r}) {why}"
        return None

    return check


def max_bytes(limit: int) -> Check:
    """A bytes field of at most `limit` bytes."""

    def check(name: str, value: Any) -> str | None:
        return None if len(value) <= limit else f"is {len(value)} bytes, at most {limit}"

    return check


def boolean(name: str, value: Any) -> str | None:
    """Any bool (declared so that every field has a rule)."""
    return None


def nonempty_bytes(name: str, value: Any) -> str | None:
    return None if value else "must not be empty"


def message_fields(rules: dict[str, Check]) -> Check:
    """A nested message: each of its fields (all named in `rules`) passes its check."""

    def check(name: str, value: Any) -> str | None:
        for field in value.DESCRIPTOR.fields:
            rule = rules.get(field.name)
            if rule is None:  # a field added without a rule: refused, as a new message
                return f"has field {field.name} without a validation rule"
            sub = getattr(value, field.name)
            why = rule(f"{name}.{field.name}", sub)
            if why is not None:
                return f"field {field.name}={_show(sub)} {why}"
        return None

    return check


def non_negative_seconds(name: str, value: Any) -> str | None:
    """A duration in seconds: finite and in [0, MAX_SECONDS]."""
    if 0.0 <= value <= MAX_SECONDS:  # NaN fails both comparisons
        return None
    return f"must be seconds in [0, {MAX_SECONDS:g}]"


def _reason(name: str, value: Any) -> str | None:
    """Free text for an error message: bounded, newlines and tabs allowed."""
    if len(value) > MAX_REASON_CHARS:
        return f"is {len(value)} characters long, at most {MAX_REASON_CHARS} are allowed"
    return None


# ---------------------------------------------------------------- cross-field checks
def _fingerprint_matches(request: Any) -> str | None:
    """RegisterDataset's dataset id dedup trusts the fingerprint: one that is
    not the `definition_fingerprint` of `dataset` (its sha256 less its code paths)
    would map another client's dataset to this one."""
    from dataservice.data.serialize import definition_fingerprint

    # A dispatcher's RegisterRequest carries the parsed definition: one parse
    # of hundreds of MB, not two.
    expected = definition_fingerprint(request.dataset, getattr(request, "definition", None))
    if request.fingerprint != expected:
        return (
            f"fingerprint={_show(request.fingerprint)} is not the fingerprint of the "
            f"{len(request.dataset)}-byte dataset ({expected}: its sha256 less its code paths)"
        )
    return None


def _round_read_fields(request: Any) -> str | None:
    """A coordinated read sets both consumer_index and round_index, a plain
    read neither; a cross-trainer cache read is not a coordinated read."""
    coordinated = request.round_index >= 0
    if coordinated != (request.consumer_index >= 0):
        return (
            f"consumer_index={request.consumer_index} and round_index={request.round_index}: "
            "a coordinated read sets both (>= 0), any other read sets both to -1"
        )
    if coordinated and request.trainer_id:
        return (
            f"trainer_id={_show(request.trainer_id)} with round_index={request.round_index}: "
            "a cross-trainer cache read is not a coordinated read (round_index must be -1)"
        )
    return None


def _acknowledged_read_fields(request: Any) -> str | None:
    """A consumer_key comes with a sequence number >= 1; without one, sequence is 0."""
    if bool(request.consumer_key) != (request.sequence > 0):
        return (
            f"consumer_key={_show(request.consumer_key)} and sequence={request.sequence}: "
            "an acknowledged read sets both (sequence >= 1), any other read neither"
        )
    return None


_INCARNATION = Field("incarnation_id", text(MAX_TOKEN_CHARS))
_COUNT = int_range(0, MAX_COUNT)
# metrics.py: a worker's and a consumer's cumulative counters, in heartbeats.
_WORKER_COUNTERS = message_fields(
    {
        "elements_produced": _COUNT,
        "bytes_sent": _COUNT,
        "pipeline_s": non_negative_seconds,
        "idle_s": non_negative_seconds,
        "buffered_elements": _COUNT,
    }
)
_CONSUMER_COUNTERS = message_fields(
    {
        "elements": _COUNT,
        "bytes": _COUNT,
        "wait_s": non_negative_seconds,
        "active_s": non_negative_seconds,
        "host": text(MAX_NAME_CHARS),
        "pid": int_range(0, MAX_PID),
        "consumer_index": index_or_unset(MAX_CONSUMERS - 1),
        "left_unreturned": _COUNT,
    }
)
_DATASET_ID = Field("dataset_id", text(MAX_NAME_CHARS, required=True))


def _seq_ranges(name: str, value: Any) -> str | None:
    """Exactly-once sequence number ranges: [start, end) pairs, 0 <= start < end."""
    if len(value) > 2 * MAX_ELEMENTS_PER_READ:
        return f"has {len(value)} items, at most {2 * MAX_ELEMENTS_PER_READ} are allowed"
    if len(value) % 2:
        return f"must hold [start, end) pairs; has {len(value)} numbers"
    for i in range(0, len(value), 2):
        if not 0 <= value[i] < value[i + 1] <= MAX_COUNT:
            return f"has the bad range [{value[i]}, {value[i + 1]})"
    return None


_SPLIT_RECEIPT = message_fields({"ordinal": an_id, "ranges": _seq_ranges})
_SPLIT_PRODUCED = message_fields({"ordinal": an_id, "count": int_range(0, MAX_COUNT)})
_SPLIT_GENERATION = message_fields({"ordinal": an_id, "generation": int_range(0, MAX_COUNT)})
_CLOSED_PROCESS = message_fields({"task_id": an_id, "worker_uid": text(MAX_TOKEN_CHARS)})
_HOST_ID = text(MAX_NAME_CHARS)

RULES: dict[str, tuple[Rule, ...]] = {
    "dataservice.rpc.DispatcherInfoRequest": (),
    "dataservice.rpc.WorkerHeartbeatRequest": (
        Field("worker_address", host_port(required=True)),
        Field("transfer_address", host_port(required=False)),
        Field("host_id", _HOST_ID),
        Field("worker_uid", text(MAX_TOKEN_CHARS, required=True)),
        Field("current_tasks", repeated(an_id, MAX_REPEATED_IDS)),
        Field("finished_tasks", repeated(an_id, MAX_REPEATED_IDS)),
        Field("transfer_protocols", repeated(text(MAX_PROTOCOL_CHARS), MAX_PROTOCOLS)),
        Field("heartbeat_interval_ms", int_range(0, MAX_HEARTBEAT_INTERVAL_MS)),
        Field("pid", int_range(0, MAX_PID)),  # 0: an older worker that does not send it
        Field("counters", _WORKER_COUNTERS),
        Field("join_running_dynamic_only", boolean),
    ),
    "dataservice.rpc.WatchTasksRequest": (
        Field("worker_address", host_port(required=True)),
        Field("generation", int_range(-1, MAX_COUNT)),
        Field("wait_ms", int_range(0, 2**31 - 1)),
        Field("worker_uid", text(MAX_TOKEN_CHARS)),
    ),
    "dataservice.rpc.RegisterDatasetRequest": (
        Field("dataset", nonempty_bytes),
        Field("element_spec", max_bytes(MAX_ELEMENT_SPEC_BYTES)),
        Field("dataset_id", text(MAX_NAME_CHARS)),
        Field("compression", one_of(REGISTER_COMPRESSIONS, allow_empty=True, ignore_case=True)),
        Field("cardinality", int_range(MIN_CARDINALITY, 2**63 - 1)),
        Across(("fingerprint", "dataset"), _fingerprint_matches),
    ),
    "dataservice.rpc.GetDatasetDefRequest": (_DATASET_ID, Field("host_id", _HOST_ID)),
    "dataservice.rpc.GetElementSpecRequest": (_DATASET_ID,),
    "dataservice.rpc.GetOrCreateJobRequest": (
        _DATASET_ID,
        Field("job_name", text(MAX_NAME_CHARS)),
        Field("processing_mode", sharding_policy),
        Field("num_consumers", int_range(0, MAX_CONSUMERS)),
        Field("target_workers", one_of(TARGET_WORKERS, allow_empty=True)),
        Field("client_host_id", _HOST_ID),
        _INCARNATION,
        Field("use_cross_trainer_cache", boolean),
        Field("exactly_once", boolean),
        Field("resumed", boolean),
        Field("join_iteration", boolean),
        Field("iteration_repetition", int_range(0, MAX_REPETITION)),
        Field("counters", _CONSUMER_COUNTERS),
    ),
    "dataservice.rpc.GetOrCreateIterationRequest": (
        Field("job_id", an_id),
        Field("repetition", int_range(0, MAX_REPETITION)),
        _INCARNATION,
        Field("client_host_id", _HOST_ID),
        Field("counters", _CONSUMER_COUNTERS),
    ),
    "dataservice.rpc.ClientHeartbeatRequest": (
        Field("iteration_client_id", an_id),
        _INCARNATION,
        Field("finished_tasks", repeated(an_id, MAX_REPEATED_IDS)),
        Field("unreachable_workers", repeated(host_port(required=True), MAX_REPEATED_IDS)),
        Field("counters", _CONSUMER_COUNTERS),
        Field("split_receipts", repeated(_SPLIT_RECEIPT, MAX_REPEATED_IDS)),
        Field("closed_processes", repeated(_CLOSED_PROCESS, MAX_REPEATED_IDS)),
        Field("split_generations", repeated(_SPLIT_GENERATION, MAX_REPEATED_IDS)),
        Field("split_delivered", repeated(_SPLIT_RECEIPT, MAX_REPEATED_IDS)),
    ),
    "dataservice.rpc.ReleaseIterationClientRequest": (
        Field("iteration_client_id", an_id),
        _INCARNATION,
        Field("counters", _CONSUMER_COUNTERS),
        Field("split_receipts", repeated(_SPLIT_RECEIPT, MAX_REPEATED_IDS)),
    ),
    "dataservice.rpc.GetSplitsRequest": (
        Field("iteration_id", an_id),
        Field("task_id", an_id),
        # 0: the default (one split); the dispatcher grants at most 4096 a call.
        Field("max_splits", int_range(0, 2**31 - 1)),
        _INCARNATION,
        Field("split_provider_index", int_range(0, MAX_SPLIT_PROVIDERS)),
        Field(
            "joint_split_provider_indices",
            repeated(int_range(0, MAX_SPLIT_PROVIDERS), MAX_JOINT_SPLIT_PROVIDERS),
        ),
        Field("exactly_once", boolean),
        Field("produced", repeated(_SPLIT_PRODUCED, MAX_REPEATED_IDS)),
        Field("worker_uid", text(MAX_TOKEN_CHARS)),
        Field("held", repeated(an_id, MAX_REPEATED_IDS)),
        Field("fetcher_id", text(MAX_TOKEN_CHARS)),
        Field("request_number", int_range(0, 2**62)),
    ),
    "dataservice.rpc.GetRoundsRequest": (
        Field("iteration_id", an_id),
        Field("first_round", int_range(0, MAX_ROUND)),
        Field("dead_task_id", an_id),  # 0: none
        _INCARNATION,
    ),
    "dataservice.rpc.ReportWorkerFailureRequest": (
        Field("worker_address", host_port(required=True)),
        Field("reason", _reason),
        Field("pid", int_range(0, MAX_PID)),  # 0: unknown
        Field("restarting", boolean),
    ),
    "dataservice.rpc.GetClusterStatusRequest": (
        Field("window_ms", int_range(0, MAX_STATUS_WINDOW_MS)),
    ),
    "dataservice.rpc.RetireWorkerRequest": (
        Field("worker_address", host_port(required=True)),
        Field("remove", boolean),
        Field("cancel", boolean),
    ),
    "dataservice.rpc.GetElementsRequest": (
        Field("task_id", an_id),
        # 0 means the default (one element; 16 MiB): proto3 cannot tell unset from 0.
        Field("max_elements", int_range(0, MAX_ELEMENTS_PER_READ)),
        Field("max_bytes", int_range(0, MAX_BYTES_PER_READ)),
        Field("consumer_index", index_or_unset(MAX_CONSUMERS - 1)),
        Field("round_index", index_or_unset(MAX_ROUND)),
        Field("trainer_id", text(MAX_NAME_CHARS)),
        Field("compression", one_of(ELEMENT_COMPRESSIONS, allow_empty=True)),
        Across(("consumer_index", "round_index", "trainer_id"), _round_read_fields),
        # Acknowledged reads (worker/unacked_replies.py UnackedReplies): a client-chosen key
        # (a uuid4 hex from ours) and its request number, 1, 2, ... (0: no key).
        Field("consumer_key", text(MAX_CONSUMER_KEY_CHARS)),
        Field("sequence", int_range(0, MAX_ROUND)),
        Across(("consumer_key", "sequence"), _acknowledged_read_fields),
        # Slow links (transfer/grpc.py): 0 is the worker's default message size.
        Field("max_message_bytes", _message_bytes),
    ),
}


def _show(value: Any, limit: int = 80) -> str:
    """`value` for an error message, cut to about `limit` characters."""
    if hasattr(value, "DESCRIPTOR"):  # a nested message: its fields on one line
        text_ = "{" + str(value).strip().replace("\n", ", ") + "}"
    else:
        text_ = repr(value)
    if len(text_) > limit:
        if not isinstance(value, (bytes, str, list)):
            return f"{text_[:limit]}..."
        size = f"{len(value)} {'bytes' if isinstance(value, bytes) else 'characters'}"
        return f"{text_[:limit]}... ({size})"
    return text_


def _method(request: Any) -> str:
    name: str = request.DESCRIPTOR.name
    return name[: -len("Request")] if name.endswith("Request") else name


@dataclass(frozen=True)
class Malformed:
    """Bytes that do not parse as `request_class` (see `tolerant_parser`)."""

    request_class: Any
    error: str


def tolerant_parser(request_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer for a gRPC method handler that never raises: bytes
    that do not parse (a truncated message, a string that is not UTF-8) become a
    `Malformed`, which `check_request` refuses with INVALID_ARGUMENT (a
    deserializer that raises makes gRPC answer INTERNAL)."""

    def parse(data: bytes) -> Any:
        try:
            return request_class.FromString(data)
        except Exception as err:  # DecodeError, or upb's own for bad UTF-8
            return Malformed(request_class, f"{type(err).__name__}: {err}")

    return parse


RAW_FRAME_METHODS = frozenset({"GetElementsFrames"})
"""Streams whose messages are heads (protobuf messages) and raw payload bytes
(service.proto's ElementsHead): their servicer yields both, and bytes go out as
they are."""


def _frame_serializer(message: Any) -> bytes:
    """A message of a `RAW_FRAME_METHODS` stream: payload `bytes` as they are (no
    copy), a head serialized."""
    if type(message) is bytes:
        return message
    return message.SerializeToString()  # type: ignore[no-any-return]


def add_service(server: Any, servicer: Any, service_name: str) -> None:
    """Serves `servicer` (one method per RPC of `service_name` in service.proto)
    on `server`, as the generated `add_<service>Servicer_to_server` does, but
    with `tolerant_parser` deserializers: malformed bytes reach the servicer's
    entry point as a `Malformed` request instead of failing inside gRPC."""
    import grpc

    from dataservice.rpc import service_pb2

    service = service_pb2.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for method in service.methods:
        request_class = getattr(service_pb2, method.input_type.name)
        response_class = getattr(service_pb2, method.output_type.name)
        make_handler = (
            grpc.unary_stream_rpc_method_handler  # GetElementsStream
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        serializer = response_class.SerializeToString
        if method.name in RAW_FRAME_METHODS:
            serializer = _frame_serializer
        handlers[method.name] = make_handler(
            getattr(servicer, method.name),
            request_deserializer=tolerant_parser(request_class),
            response_serializer=serializer,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )


def check_request(request: Any) -> None:
    """Checks `request` (a request message of service.proto) against its `RULES`.

    Raises:
        InvalidArgumentError: A field breaks its rule; the message names the
            RPC, the field and the bad value. Bytes that did not parse
            (`Malformed`) and a message type without rules are refused too (a
            new RPC must declare its rules here).
    """
    if isinstance(request, Malformed):
        name = request.request_class.DESCRIPTOR.name
        raise errors.InvalidArgumentError(
            f"{name[: -len('Request')]}: the request is not a valid {name}: {request.error}"
        )
    full_name = request.DESCRIPTOR.full_name
    rules = RULES.get(full_name)
    if rules is None:
        raise errors.InvalidArgumentError(f"no validation rules for {full_name}")
    for rule in rules:
        if isinstance(rule, Field):
            value = getattr(request, rule.name)
            why = rule.check(rule.name, value)
            if why is not None:
                raise errors.InvalidArgumentError(
                    f"{_method(request)}: invalid {rule.name}={_show(_shown(value))}: {why}"
                )
        else:
            why = rule.check(request)
            if why is not None:
                raise errors.InvalidArgumentError(f"{_method(request)}: invalid {why}")


def _shown(value: Any) -> Any:
    """Repeated fields as lists (their repr is then the values)."""
    if isinstance(value, (str, bytes, int, float)):
        return value
    if isinstance(value, Iterable):
        return list(value)
    return value


def check_read_fits_task(request: Any, task_num_consumers: int, has_cache: bool) -> None:
    """A GetElements request (or a `transfer.base.ReadRequest`: the same
    task_id, trainer_id, consumer_index and round_index, whatever the protocol)
    against the kind of the task it reads: a
    coordinated read (round_index >= 0) only of a task of a job with
    num_consumers, with consumer_index below it; a plain read of a
    coordinated task is refused too (it would take other consumers' elements).

    Raises:
        FailedPreconditionError: The read does not fit the task.
    """
    if request.trainer_id:
        return  # the cache read's own check (worker/sources.py) names the trainer
    task = request.task_id
    if request.round_index >= 0:
        if task_num_consumers <= 0:
            raise errors.FailedPreconditionError(
                f"GetElements: task {task} is not a coordinated read (its job has no "
                f"num_consumers), but round_index={request.round_index} and "
                f"consumer_index={request.consumer_index} were given: a plain read sets "
                "both to -1"
            )
        if request.consumer_index >= task_num_consumers:
            raise errors.FailedPreconditionError(
                f"GetElements: invalid consumer_index={request.consumer_index} for task {task}, "
                f"whose job has num_consumers={task_num_consumers} (indices 0..."
                f"{task_num_consumers - 1})"
            )
    elif task_num_consumers > 0 and not has_cache:
        raise errors.FailedPreconditionError(
            f"GetElements: task {task} is a coordinated read (num_consumers="
            f"{task_num_consumers}): set consumer_index and round_index"
        )
