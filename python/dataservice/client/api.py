"""The client API: `distribute`, `register_dataset`, `from_dataset_id`, as
`tf.data.experimental.service`'s functions of the same names.

A distributed dataset is a `Dataset` whose elements come from the service:
ops applied after `distribute` run in the consumer's process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import threading
from collections.abc import Callable
from typing import Any

from dataservice import _waits, auth
from dataservice import exactly_once as visitation
from dataservice.client import checkpoint, join
from dataservice.client.reader import DataServiceIterator, ReadOptions
from dataservice.data import graph
from dataservice.data.dataset import (
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
    IterContext,
)
from dataservice.data.ops import AllowPickledElementsDataset
from dataservice.data.serialize import definition_fingerprint
from dataservice.data.serialize import serialize as serialize_dataset
from dataservice.rpc import service_pb2 as pb
from dataservice.rpc import util as rpc_util
from dataservice.sharding import ShardingPolicy, to_sharding_policy

log = logging.getLogger(__name__)

CLIENT_TIMEOUT_ENV = "DATASERVICE_CLIENT_TIMEOUT_MS"
DEFAULT_CLIENT_TIMEOUT_MS = 60_000
_COMPRESSIONS = ("AUTO", "NONE", "ZSTD")
_TARGET_WORKERS = ("AUTO", "ANY", "LOCAL")


class CrossTrainerCache:
    """Marks a read as one trainer of a cross-trainer cache (tf.data service's
    CrossTrainerCache): trainers with different `trainer_id`s share one
    sliding window of a job's elements on each worker.

    Args:
        trainer_id: Non-empty string naming this trainer.

    Raises:
        ValueError: `trainer_id` is empty or not a string.
    """

    def __init__(self, trainer_id: str) -> None:
        if not isinstance(trainer_id, str) or not trainer_id:
            raise ValueError(f"`trainer_id` must be a non-empty string, got {trainer_id!r}")
        self.trainer_id = trainer_id


# ---------------------------------------------------------------- validation
def _service_address(service: Any) -> str:
    target = getattr(service, "target", None)
    if target is not None and not isinstance(service, str):
        return rpc_util.parse_address(target)
    if not isinstance(service, str):
        raise ValueError(
            f'`service` must be a string ("grpc://host:port" or "host:port") or a '
            f"DispatchServer, got {service!r}"
        )
    return rpc_util.parse_address(service)


def _check_job_name(job_name: Any) -> str:
    if job_name is None:
        return ""
    if not isinstance(job_name, str):
        raise ValueError(f"`job_name` must be a string, got {job_name!r}")
    if not job_name:
        raise ValueError("`job_name` must not be empty")
    return job_name


def _check_allow_pickled(allow_pickled_elements: Any) -> None:
    if not isinstance(allow_pickled_elements, bool):
        raise ValueError(f"`allow_pickled_elements` must be a bool, got {allow_pickled_elements!r}")


def _check_compression(compression: Any) -> None:
    if compression is None:
        return
    if not isinstance(compression, str) or compression.upper() not in _COMPRESSIONS:
        raise ValueError(
            f"Invalid `compression` argument: {compression!r}. Must be one of "
            f"{list(_COMPRESSIONS)} or None."
        )


def _check_consumers(
    job_name: str, consumer_index: Any, num_consumers: Any, policy: ShardingPolicy
) -> int:
    if (consumer_index is None) != (num_consumers is None):
        raise ValueError(
            "Must either set both `consumer_index` and `num_consumers`, or neither. "
            f"Got consumer_index={consumer_index!r}, num_consumers={num_consumers!r}"
        )
    if num_consumers is None:
        return 0
    if not isinstance(num_consumers, int) or num_consumers <= 0:
        raise ValueError(f"`num_consumers` must be a positive int, got {num_consumers!r}")
    if not isinstance(consumer_index, int) or not 0 <= consumer_index < num_consumers:
        raise ValueError(
            f"`consumer_index` must be an int in [0, num_consumers={num_consumers}), "
            f"got {consumer_index!r}"
        )
    if not job_name:
        raise ValueError("`job_name` must be set when using `num_consumers` (coordinated reads)")
    if policy == ShardingPolicy.DYNAMIC:
        _waits.warn_once(
            log,
            ("coordinated DYNAMIC", job_name),
            "job %r: coordinated reads under DYNAMIC sharding: each worker holds the splits "
            "of what it buffered, and the rounds take as many elements from every worker, so "
            "a worker that got ahead stays repetitions ahead: a window of rounds may hold some "
            "elements twice and others not at all (each split still goes out once per "
            "repetition). For an even mix use ShardingPolicy.OFF with an unseeded shuffle "
            "(README: Coordinated reads)",
            job_name,
        )
    return num_consumers


def _check_cache(cache: Any, job_name: str, num_consumers: int) -> None:
    if cache is None:
        return
    if not isinstance(cache, CrossTrainerCache):
        raise ValueError(f"`cross_trainer_cache` must be a CrossTrainerCache, got {cache!r}")
    if not job_name:
        raise ValueError(
            "`cross_trainer_cache` needs a named job: set `job_name` (trainers share the "
            "job's elements through the cache)"
        )
    if num_consumers:
        raise ValueError(
            "`cross_trainer_cache` cannot be used with coordinated reads "
            "(`num_consumers` / `consumer_index`)"
        )


def _check_target_workers(target_workers: Any) -> str:
    if not isinstance(target_workers, str) or target_workers.upper() not in _TARGET_WORKERS:
        raise ValueError(
            f"`target_workers` must be one of {list(_TARGET_WORKERS)} (case-insensitive), "
            f"got {target_workers!r}"
        )
    return target_workers.upper()


def _check_max_outstanding(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"`max_outstanding_requests` must be a positive int, got {value!r}")
    return value


def _client_timeout_ms(value: int | None) -> int:
    if value is not None:
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"`client_timeout_ms` must be a positive int, got {value!r}")
        return value
    env = os.environ.get(CLIENT_TIMEOUT_ENV)
    return int(env) if env else DEFAULT_CLIENT_TIMEOUT_MS


DEFAULT_WORKER_LOSS_TIMEOUT_MS = 60_000


def _worker_loss_timeout_ms(value: Any) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(
            f"`worker_loss_timeout_ms` must be a positive int or None (wait forever), got {value!r}"
        )
    return value


def _check_exactly_once(
    exactly_once: Any, policy: ShardingPolicy, num_consumers: int, cache: Any
) -> None:
    """`exactly_once` is a bool, and True only for a DYNAMIC read that is no
    coordinated read and has no cross-trainer cache.

    Raises:
        ValueError: Names the argument at fault.
    """
    if not isinstance(exactly_once, bool):
        raise ValueError(f"`exactly_once` must be a bool, got {exactly_once!r}")
    if not exactly_once:
        return
    if policy != ShardingPolicy.DYNAMIC:
        raise ValueError(
            f"`exactly_once=True` needs ShardingPolicy.DYNAMIC, got {policy.name}: under OFF "
            "and static sharding a restarted worker produces its share again"
        )
    if num_consumers:
        raise ValueError("`exactly_once=True` cannot be combined with `num_consumers`")
    if cache is not None:
        raise ValueError("`exactly_once=True` cannot be combined with `cross_trainer_cache`")


def _warn_unseeded_randomness(dataset: Dataset, policy: ShardingPolicy) -> None:
    """Logs a WARNING when `policy` shards `dataset`'s elements (DATA, FILE_OR_DATA
    without a file source, HINT below its `shard(SHARD_HINT, ...)`) and the pipeline
    has ops with unseeded randomness (`graph.unseeded_random_ops`): each worker then
    runs them in another order and keeps every n-th element, so some elements come
    twice and others never (tf.data has the same pitfall). A warning, not an error:
    such a read is valid where the exact set of elements does not matter (an
    infinite, repeated, randomly sampled stream)."""
    if policy == ShardingPolicy.DATA or (
        policy == ShardingPolicy.FILE_OR_DATA and not graph.file_sources(dataset)
    ):
        ops = graph.unseeded_random_ops(dataset)
    elif policy == ShardingPolicy.HINT:
        ops = graph.unseeded_random_ops(dataset, under_shard_hints=True)
    else:
        return
    if not ops:
        return
    log.warning(
        "distribute(%s): the pipeline has unseeded randomness: %s. Under %s sharding "
        "each worker runs the whole pipeline and keeps every n-th element, so with a "
        "different order on each worker the shards overlap: some elements are read "
        "twice and others never. Give each such op a seed (the same on every worker), "
        "or use ShardingPolicy.FILE or DYNAMIC",
        policy.name,
        "; ".join(ops),
        "HINT (element)" if policy == ShardingPolicy.HINT else "DATA",
    )


def _dispatcher_call(
    address: str, method: str, request: Any, timeout_ms: int, auth_token: str | None = None
) -> Any:
    from dataservice.rpc import service_pb2_grpc

    channel = rpc_util.make_channel(address)
    try:
        stub = service_pb2_grpc.DispatcherServiceStub(channel)
        token = auth.client_token(address, auth_token)
        auth.warn_if_sent_in_clear(address, token, rpc_util.channel_uses_tls(address))
        metadata = rpc_util.call_metadata(token)
        return rpc_util.call_dispatcher(
            stub, method, request, address=address, metadata=metadata, timeout_ms=timeout_ms
        )
    finally:
        channel.close()


def _check_splittable(dataset: Dataset) -> None:
    """Raises ValueError naming the first op of `dataset` that cannot be split
    (without building split providers, which would glob files here)."""
    graph.check_splittable(dataset)


# ---------------------------------------------------------------- the dataset
class DistributedDataset(Dataset):
    """A dataset read from the data service (the result of `distribute` or
    `from_dataset_id`). Iterating it joins the next repetition of its job: the
    k-th iterator of this object joins iteration k of a named job (tf.data's
    rule), and an anonymous job is new each time (at repetition k). The workers
    run repetition k as epoch k: a seeded shuffle (`reshuffle_each_iteration`)
    takes epoch k's order on every worker, also when a checkpoint of it is
    resumed (`IterContext.epoch`).

    Iterators have `.stats()` (see `DataServiceIterator.stats`).
    """

    _op_name = "distribute"
    _split_op_name = "distribute"

    def __init__(
        self,
        *,
        address: str,
        processing_mode: ShardingPolicy,
        job_name: str,
        num_consumers: int,
        consumer_index: int,
        max_outstanding_requests: int | None,
        data_transfer_protocol: str | None,
        target_workers: str,
        client_timeout_ms: int,
        cross_trainer_cache: CrossTrainerCache | None,
        compression: str | None,
        zero_copy: bool = True,
        worker_loss_timeout_ms: int | None = DEFAULT_WORKER_LOSS_TIMEOUT_MS,
        input_dataset: Dataset | None = None,
        dataset_id: str | None = None,
        element_spec: Any = None,
        exactly_once: bool = False,
    ) -> None:
        super().__init__()
        self._exactly_once = exactly_once
        self._address = address
        self._processing_mode = processing_mode
        self._job_name = job_name
        self._num_consumers = num_consumers
        self._consumer_index = consumer_index
        self._max_outstanding_requests = max_outstanding_requests
        self._data_transfer_protocol = data_transfer_protocol
        self._target_workers = target_workers
        self._client_timeout_ms = client_timeout_ms
        self._cross_trainer_cache = cross_trainer_cache
        self._compression = compression
        self._zero_copy = zero_copy
        self._worker_loss_timeout_ms = worker_loss_timeout_ms
        self._input_dataset = input_dataset
        self._dataset_id = dataset_id
        self._given_spec = element_spec
        self._mu = threading.Lock()
        self._repetition = 0  # guarded by self._mu
        self._fingerprint: str | None = None  # client/checkpoint.py; guarded by self._mu
        self._resume: dict[str, Any] | None = None  # load_state_dict's; guarded by self._mu
        self._cardinality: int | None = None  # registered one, read by id; guarded by self._mu

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_mu"] = None
        state["_repetition"] = 0
        if self._input_dataset is not None:
            state["_dataset_id"] = None  # registered again from wherever it is read
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mu = threading.Lock()

    def _inputs(self) -> list[Dataset]:
        return []

    def _compute_cardinality(self) -> int:
        """As tf.data service: INFINITE for a coordinated read; 0 for an empty
        dataset; INFINITE for an infinite one under OFF, DYNAMIC and DATA (which
        shard after `repeat`), UNKNOWN under FILE, FILE_OR_DATA and HINT (sharding
        files may leave a worker nothing); UNKNOWN for a finite one. A dataset
        read by id asks the dispatcher the cardinality it was registered with.

        Source: tensorflow/core/data/service/common.cc, `EstimateCardinality`.

        Raises:
            DataServiceError: (read by id) the dispatcher cannot say, e.g.
                `NotFoundError` for an unknown dataset id.
        """
        if self._num_consumers:  # coordinated reads need an infinite dataset
            return INFINITE_CARDINALITY
        if self._input_dataset is not None:
            card = self._input_dataset.cardinality()
        else:
            card = self._registered_cardinality()
        if card == 0:
            return 0
        if card == INFINITE_CARDINALITY and self._processing_mode in (
            ShardingPolicy.OFF,
            ShardingPolicy.DYNAMIC,
            ShardingPolicy.DATA,
        ):
            return INFINITE_CARDINALITY
        return UNKNOWN_CARDINALITY

    def _registered_cardinality(self) -> int:
        """The cardinality `dataset_id` was registered with (one GetElementSpec
        RPC, bounded by `client_timeout_ms`; cached). UNKNOWN from a dispatcher
        that does not say."""
        with self._mu:
            if self._cardinality is not None:
                return self._cardinality
        response = _dispatcher_call(
            self._address,
            "GetElementSpec",
            pb.GetElementSpecRequest(dataset_id=self._dataset_id),
            self._client_timeout_ms,
        )
        card = response.cardinality if response.HasField("cardinality") else UNKNOWN_CARDINALITY
        with self._mu:
            self._cardinality = card
        return card

    def _static_element_spec(self) -> Any:
        if self._given_spec is not None:
            return self._given_spec
        if self._input_dataset is not None:
            spec = graph.static_element_spec(self._input_dataset)
            if spec is not None:
                return spec
        if self._dataset_id is not None:
            response = _dispatcher_call(
                self._address,
                "GetElementSpec",
                pb.GetElementSpecRequest(dataset_id=self._dataset_id),
                self._client_timeout_ms,
            )
            if response.element_spec:
                return pickle.loads(response.element_spec)
        return None

    def _ensure_registered(self) -> str:
        with self._mu:
            if self._dataset_id is None:
                assert self._input_dataset is not None
                if self._processing_mode == ShardingPolicy.DYNAMIC:
                    # At registration, as tf.data service: names the op that can't be split.
                    _check_splittable(self._input_dataset)
                self._dataset_id = _register(
                    self._address,
                    self._input_dataset,
                    self._compression,
                    None,
                    self._client_timeout_ms,
                )
            return self._dataset_id

    def _dataset_fingerprint(self) -> str:
        """What identifies this dataset in an iterator state (client/checkpoint.py):
        the SHA-256 of the pipeline's definition, or for a dataset read by id,
        "dataset_id:<id>"."""
        with self._mu:
            if self._fingerprint is None:
                if self._input_dataset is not None:
                    data = serialize_dataset(self._input_dataset)
                    self._fingerprint = hashlib.sha256(data).hexdigest()
                else:
                    self._fingerprint = f"dataset_id:{self._dataset_id}"
            return self._fingerprint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes this dataset's next `iter()` continue where the iterator whose
        `state_dict()` gave `state` was (torchdata's StatefulDataLoader
        convention; client/checkpoint.py gives the semantics per mode). The
        read after that one starts the next epoch as usual.

        Raises:
            InvalidArgumentError: `state` is no iterator state, or one of
                another dataset (the message names both fingerprints), another
                processing mode or another exactly_once setting.
        """
        checkpoint.check_state(
            state,
            dataset=self._dataset_fingerprint(),
            processing_mode=self._processing_mode.name,
            exactly_once=bool(getattr(self, "_exactly_once", False)),
        )
        with self._mu:
            self._resume = json.loads(json.dumps(state))  # the caller's dict stays theirs

    def _make_iterator(self, ctx: IterContext) -> DataServiceIterator:
        dataset_id = self._ensure_registered()
        fingerprint = self._dataset_fingerprint()
        peek = getattr(ctx, "peek", False)
        with self._mu:
            repetition = self._repetition
            resume = None if peek else getattr(self, "_resume", None)
            job_name = self._job_name
            if resume is not None:
                # A job of its own (checkpoint.resumed_job_name), at the saved
                # repetition: the workers run that epoch again with its shuffle
                # orders. The read after it joins the original job's next repetition.
                self._resume = None
                job_name = checkpoint.resumed_job_name(self._job_name, resume)
                repetition = int(resume.get("repetition", 0))
                self._repetition = repetition + 1
            elif not peek:
                self._repetition += 1
        options = ReadOptions(
            dispatcher_address=self._address,
            # Peeking at the first element (element_spec of an op after this one)
            # reads an anonymous OFF job, so it consumes nothing of the real job.
            processing_mode=ShardingPolicy.OFF if peek else self._processing_mode,
            job_name="" if peek else job_name,
            num_consumers=self._num_consumers,
            consumer_index=self._consumer_index,
            max_outstanding_requests=self._max_outstanding_requests,
            data_transfer_protocol=self._data_transfer_protocol,
            target_workers=self._target_workers,
            client_timeout_ms=self._client_timeout_ms,
            compression=self._compression,
            zero_copy=self._zero_copy,
            worker_loss_timeout_ms=getattr(
                self, "_worker_loss_timeout_ms", DEFAULT_WORKER_LOSS_TIMEOUT_MS
            ),
            trainer_id=""
            if peek or self._cross_trainer_cache is None
            else self._cross_trainer_cache.trainer_id,
            exactly_once=getattr(self, "_exactly_once", False) and not peek,
            fingerprint=fingerprint,
            user_job_name=self._job_name,
            resume=resume,
            repetition=repetition,
        )
        iterator = DataServiceIterator(options, dataset_id, repetition)
        stats = getattr(ctx, "stats", None)
        if stats is not None:
            # An in-process iterator above this one (`ignore_errors` after the
            # service) reports this read's stats() with its own.
            stats.add_source(iterator.stats, iterator.state_dict)
        return iterator


# A definition this large is worth a WARNING at registration (see `_register`).
LARGE_DEFINITION_BYTES = 256 << 20


def _register(
    address: str,
    dataset: Dataset,
    compression: str | None,
    dataset_id: str | None,
    timeout_ms: int,
) -> str:
    data = serialize_dataset(dataset)
    if len(data) >= LARGE_DEFINITION_BYTES:
        log.warning(
            "the pipeline's definition is %d MiB (arrays its functions or sources "
            "capture): it goes to the dispatcher %s in one request, which takes "
            "seconds per 100 MiB and more (one gRPC message), and is kept there; a "
            "large array read in the pipeline from a file (np.load(path, mmap_mode='r') "
            "in a map, the path captured) costs nothing to register",
            len(data) >> 20,
            address,
        )
    spec = graph.static_element_spec(dataset)
    request = pb.RegisterDatasetRequest(
        dataset=data,
        element_spec=pickle.dumps(spec) if spec is not None else b"",
        dataset_id=dataset_id or "",
        fingerprint=definition_fingerprint(data),
        compression=compression or "",
        cardinality=dataset.cardinality(),
    )
    response = _dispatcher_call(address, "RegisterDataset", request, timeout_ms)
    if response.other_definition:
        log.warning(
            "dataset id %r is registered already with another pipeline (another "
            "definition, the same element_spec): reads of it get the one registered "
            "first, not this one (as tf.data service); register this pipeline under "
            "a new dataset_id to read it",
            response.dataset_id,
        )
    return response.dataset_id


# ---------------------------------------------------------------- public API
def distribute(
    processing_mode: Any,
    service: Any,
    job_name: str | None = None,
    consumer_index: int | None = None,
    num_consumers: int | None = None,
    max_outstanding_requests: int | None = None,
    data_transfer_protocol: str | None = None,
    compression: str | None = "AUTO",
    cross_trainer_cache: CrossTrainerCache | None = None,
    target_workers: str = "AUTO",
    *,
    client_timeout_ms: int | None = None,
    zero_copy: bool = True,
    allow_pickled_elements: bool = False,
    worker_loss_timeout_ms: int | None = DEFAULT_WORKER_LOSS_TIMEOUT_MS,
    exactly_once: bool = False,
) -> Callable[[Dataset], Dataset]:
    """A transformation that runs a dataset on the data service, for `Dataset.apply`.

    As `tf.data.experimental.service.distribute`: the pipeline before this
    point is shipped to the workers (cloudpickle), the ops after it run here.

    Args:
        processing_mode: A `ShardingPolicy`, or "parallel_epochs" (OFF) /
            "distributed_epoch" (DYNAMIC).
        service: "grpc://host:port", "host:port", or a `DispatchServer`.
        job_name: Consumers with the same name share one job, first come first served.
        consumer_index, num_consumers: Coordinated reads (both or neither; needs `job_name`).
        max_outstanding_requests: Most concurrent element requests (default: one per worker).
        data_transfer_protocol: None/"auto", "grpc", or another registered protocol.
        compression: "AUTO" (zstd over gRPC when measuring says it saves time: a
            link slower than the codec and data that compresses, re-measured every
            few seconds; never on shared memory), None (never), or "zstd" (always
            over gRPC; never on shared memory).
        cross_trainer_cache: A `CrossTrainerCache` to share a job's elements between trainers.
        target_workers: "AUTO", "ANY" or "LOCAL" (case-insensitive).
        client_timeout_ms: How long to retry an unreachable dispatcher (ms); default
            $DATASERVICE_CLIENT_TIMEOUT_MS or 60,000.
        zero_copy: Same-host shared-memory reads hand out numpy arrays of >= 64 KiB
            as views of the ring, no copy (`flags.owndata` False; each stays valid
            while referenced: one the consumer keeps is copied out when the ring
            runs short or closes). False: every array is the caller's own copy.
            (Not in tf.data service, which always copies.)
        allow_pickled_elements: Let elements hold leaves that are not numpy values
            (a dataclass instance, a set, a PIL image, ...): the workers pickle them.
            False (the default): such an element fails the read with
            `InvalidArgumentError` naming its path and type (e.g.
            `element['meta'][2] is a mymodule.Box`). (Not in tf.data service,
            whose elements are tensors.)
        worker_loss_timeout_ms: How long a consumer waiting for an element
            waits for a worker to come back, once the iteration lost its
            workers (exited, killed, or timed out at the dispatcher) and none
            is left to run it, or every worker left stopped heartbeating to
            the dispatcher (SIGSTOP, hung), before `next()` raises
            `errors.WorkerCrashedError` naming each worker, its pid and how it
            was lost (ms; default 60,000). None waits forever, as tf.data
            service does. Only time spent in `next()` counts: a slow consumer
            never trips it, nor does a slow pipeline whose worker is alive
            (it keeps heartbeating). (Not in tf.data service.) Under static
            sharding it also bounds the wait for a listed worker
            (`DispatcherConfig.worker_addresses`) whose shard nobody reads
            (it never registered, or was lost): with nothing else to read,
            `next()` raises `errors.MissingShardsError` naming each missing
            worker address and shard index; until then the iteration does not
            end, and a listed worker that registers late delivers its shard.
            It also bounds how long a worker that this consumer reached before
            and can no longer connect to, while the dispatcher still hears it
            (a partition between the two hosts), is retried before `next()`
            raises `errors.UnavailableError` naming its address; an address
            never reached is given up after $DATASERVICE_UNREACHABLE_TIMEOUT_MS
            (8 s) instead.
        exactly_once: DYNAMIC only. Every element of the epoch reaches the
            job's consumers exactly once, whatever workers are killed,
            restarted or added, and across a fault-tolerant dispatcher's
            restart: a split stays leased until its elements were received,
            and a lost worker's splits are produced again by another worker,
            which skips what was received already (dataservice/exactly_once.py).
            The pipeline runs once per split on the workers, so it must be
            deterministic (seeded randomness), and `batch`/`shuffle` work
            within one split (refused over one-element splits such as
            `range`'s: `InvalidArgumentError` names the op). Default False:
            at-most-once, as tf.data service (a lost worker's splits are lost).
            (Not in tf.data service.)

    Returns:
        A function `Dataset -> Dataset` for `dataset.apply(...)`.

    Raises:
        ValueError: A bad argument (the message names it), or a function in the
            pipeline that cannot be pickled (named). When the dataset is registered
            (its first iteration), a DYNAMIC read of a pipeline that cannot be split
            raises ValueError naming the op (e.g. `from_generator`).
    """
    policy = to_sharding_policy(processing_mode)
    address = _service_address(service)
    name = _check_job_name(job_name)
    consumers = _check_consumers(name, consumer_index, num_consumers, policy)
    outstanding = _check_max_outstanding(max_outstanding_requests)
    _check_compression(compression)
    target = _check_target_workers(target_workers)
    timeout_ms = _client_timeout_ms(client_timeout_ms)
    _check_cache(cross_trainer_cache, name, consumers)
    if not isinstance(zero_copy, bool):
        raise ValueError(f"`zero_copy` must be a bool, got {zero_copy!r}")
    _check_allow_pickled(allow_pickled_elements)
    loss_timeout_ms = _worker_loss_timeout_ms(worker_loss_timeout_ms)
    _check_exactly_once(exactly_once, policy, consumers, cross_trainer_cache)

    def _apply(dataset: Dataset) -> Dataset:
        if not isinstance(dataset, Dataset):
            raise ValueError(f"distribute() applies to a Dataset, got {dataset!r}")
        if allow_pickled_elements:
            dataset = AllowPickledElementsDataset(dataset)
        serialize_dataset(dataset)  # fails now, naming a function that cannot be shipped
        _warn_unseeded_randomness(dataset, policy)
        if exactly_once:
            visitation.check_pipeline(dataset)
        return DistributedDataset(
            address=address,
            processing_mode=policy,
            job_name=name,
            num_consumers=consumers,
            consumer_index=consumer_index if consumer_index is not None else -1,
            max_outstanding_requests=outstanding,
            data_transfer_protocol=data_transfer_protocol,
            target_workers=target,
            client_timeout_ms=timeout_ms,
            cross_trainer_cache=cross_trainer_cache,
            compression=compression,
            zero_copy=zero_copy,
            worker_loss_timeout_ms=loss_timeout_ms,
            input_dataset=dataset,
            exactly_once=exactly_once,
        )

    return _apply


def register_dataset(
    service: Any,
    dataset: Dataset,
    compression: str | None = "AUTO",
    dataset_id: str | None = None,
    *,
    client_timeout_ms: int | None = None,
    allow_pickled_elements: bool = False,
) -> str:
    """Registers `dataset` with the dispatcher, as tf.data service's `register_dataset`.

    Registering an equal pipeline again returns the same id (and keeps the
    first registration's `compression`). Registering under an existing
    `dataset_id` a dataset of another structure is an error; another pipeline
    of the same structure keeps the first one and logs a WARNING.
    `compression` ("AUTO", None, "ZSTD", as `distribute`'s) is what
    `from_dataset_id` reads it with, as tf.data service.
    `allow_pickled_elements` as `distribute`'s (it makes another dataset id).

    Returns:
        The dataset id (str): `dataset_id` if given, else one the dispatcher assigned.

    Raises:
        ValueError: A bad argument, or a function in the pipeline that cannot
            be pickled (the message names it).
        InvalidArgumentError: `dataset_id` exists with a different structure.
        UnavailableError: The dispatcher cannot be reached within the client timeout.
    """
    address = _service_address(service)
    _check_compression(compression)
    if dataset_id is not None and (not isinstance(dataset_id, str) or not dataset_id):
        raise ValueError(f"`dataset_id` must be a non-empty string, got {dataset_id!r}")
    if not isinstance(dataset, Dataset):
        raise ValueError(f"register_dataset() needs a Dataset, got {dataset!r}")
    timeout_ms = _client_timeout_ms(client_timeout_ms)
    _check_allow_pickled(allow_pickled_elements)
    if allow_pickled_elements:
        dataset = AllowPickledElementsDataset(dataset)
    return _register(address, dataset, compression, dataset_id, timeout_ms)


def from_dataset_id(
    processing_mode: Any,
    service: Any,
    dataset_id: str,
    element_spec: Any = None,
    job_name: str | None = None,
    consumer_index: int | None = None,
    num_consumers: int | None = None,
    max_outstanding_requests: int | None = None,
    data_transfer_protocol: str | None = None,
    cross_trainer_cache: CrossTrainerCache | None = None,
    target_workers: str = "AUTO",
    *,
    client_timeout_ms: int | None = None,
    zero_copy: bool = True,
    worker_loss_timeout_ms: int | None = DEFAULT_WORKER_LOSS_TIMEOUT_MS,
    exactly_once: bool = False,
) -> Dataset:
    """Reads a registered dataset, as tf.data service's `from_dataset_id`.

    The job name is scoped by the dataset id ("dataset_id=<id>/<job_name>"),
    as tf.data does, so one name over two datasets makes two jobs. Arguments
    as `distribute`'s; the elements come with the `compression` the dataset
    was registered with (`register_dataset`), as tf.data service.

    Raises:
        ValueError: A bad argument.
        NotFoundError: (when iterated) `dataset_id` is not registered.
        InvalidArgumentError: (when iterated) `exactly_once` and a pipeline it
            cannot run (`distribute`'s `exactly_once`).
    """
    policy = to_sharding_policy(processing_mode)
    address = _service_address(service)
    name = _check_job_name(job_name)
    consumers = _check_consumers(name, consumer_index, num_consumers, policy)
    _check_cache(cross_trainer_cache, name, consumers)
    _check_exactly_once(exactly_once, policy, consumers, cross_trainer_cache)
    if not isinstance(dataset_id, str) or not dataset_id:
        raise ValueError(f"`dataset_id` must be a non-empty string, got {dataset_id!r}")
    if not isinstance(zero_copy, bool):
        raise ValueError(f"`zero_copy` must be a bool, got {zero_copy!r}")
    return DistributedDataset(
        address=address,
        processing_mode=policy,
        job_name=f"dataset_id={dataset_id}/{name}" if name else "",
        num_consumers=consumers,
        consumer_index=consumer_index if consumer_index is not None else -1,
        max_outstanding_requests=_check_max_outstanding(max_outstanding_requests),
        data_transfer_protocol=data_transfer_protocol,
        target_workers=_check_target_workers(target_workers),
        client_timeout_ms=_client_timeout_ms(client_timeout_ms),
        cross_trainer_cache=cross_trainer_cache,
        compression=join.REGISTERED,  # register_dataset's, as tf.data service
        zero_copy=zero_copy,
        worker_loss_timeout_ms=_worker_loss_timeout_ms(worker_loss_timeout_ms),
        dataset_id=dataset_id,
        element_spec=element_spec,
        exactly_once=exactly_once,
    )
