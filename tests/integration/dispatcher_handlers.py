"""Driving a `DispatchServer` through its RPC handlers, without a network: the
steps the handler tests share (a worker's heartbeat, a registered dataset)."""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

import dataservice as ds
from dataservice.data.serialize import serialize
from dataservice.rpc import service_pb2 as pb


def worker_heartbeat(d: Any, address: str, uid: str, current: Iterable[int] = ()) -> Any:
    """A heartbeat of worker process `uid` at `address` running tasks `current`;
    the WorkerHeartbeatResponse."""
    return d._worker_heartbeat(
        pb.WorkerHeartbeatRequest(
            worker_address=address,
            transfer_address=address,
            host_id="h",
            worker_uid=uid,
            current_tasks=list(current),
            heartbeat_interval_ms=100,
        )
    )


def register_range(d: Any, n: int) -> str:
    """Registers `Dataset.range(n)`; its dataset id."""
    return d._register_dataset(
        pb.RegisterDatasetRequest(
            dataset=serialize(ds.Dataset.range(n)),
            element_spec=pickle.dumps(None),
            fingerprint="range",
        )
    ).dataset_id
