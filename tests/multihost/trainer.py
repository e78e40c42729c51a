"""A trainer process for the multi-host tests: `python trainer.py SPEC_JSON`
(run on a host with `ip netns exec`), reading one service-backed dataset and
printing JSON lines on stdout.

SPEC_JSON keys (all but `target` optional):
    target: the dispatcher, "grpc://HOST:PORT".
    mode: processing mode ("off", "dynamic", "data", ...; default "off").
    n: elements of `Dataset.range(n)` (default 1000); `repeat`: repeat it forever.
    payload_bytes: > 0 makes each element {"i": int64[], "x": uint8[payload_bytes]
        (random bytes, the same in every element of a worker),
        "pid": the producing worker's pid, "nonce": a random int64 drawn when
        it was produced} (a cross-trainer cache shares one production).
    map_delay_ms: time each element takes on the worker.
    read_delay_ms: time the trainer spends per element (its step).
    limit: stop after this many elements (then close the iterator).
    job_name, consumer_index, num_consumers, target_workers, trainer_id (a
        CrossTrainerCache), data_transfer_protocol, client_timeout_ms,
        worker_loss_timeout_ms: passed to `distribute`.
    record: "ids" (default: every element's id, in order), "count" (only
        the number and bytes; for throughput), "cache" ([pid, id, nonce] per element).
    progress_every: print {"progress": count} every this many elements.
    warmup: the first this many elements are not timed (`timed_s`,
        `timed_bytes`, `timed_count` cover the rest).
    compression: `distribute`'s compression ("AUTO", "NONE" for None, "ZSTD").

Output: {"ready": true} once the iterator exists, {"progress": n} lines, then
one {"result": {...}} line: `elements` (as `record` says), `count`, `bytes`,
`elapsed_s` (first element to last), `timed_s`, `timed_bytes`,
`timed_count` (after `warmup`), `stats` (`it.stats()`), `error`
({"type", "message"} or null). Exit code 0 also when the read raised (the
error is in the result); 2 on a bad spec.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import dataservice as ds


def _payload(size: int):
    # Random bytes (compression gains nothing, as on real images), drawn once
    # per worker process: producing an element costs no more than a lookup.
    buffers: dict[int, np.ndarray] = {}

    def fn(i):
        if size not in buffers:
            buffers[size] = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
        return {
            "i": np.int64(i),
            "x": buffers[size],
            "pid": np.int64(os.getpid()),
            "nonce": np.int64(np.random.randint(0, 2**62)),
        }

    return fn


def _delay(ms: float):
    def fn(x):
        time.sleep(ms / 1000)  # the element's production time, not a synchronisation
        return x

    return fn


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def main(spec: dict) -> None:
    dataset = ds.Dataset.range(int(spec.get("n", 1000)))
    if spec.get("repeat"):
        dataset = dataset.repeat()
    if spec.get("map_delay_ms"):
        dataset = dataset.map(_delay(float(spec["map_delay_ms"])))
    if spec.get("payload_bytes"):
        dataset = dataset.map(_payload(int(spec["payload_bytes"])))
    kw = {
        k: spec[k]
        for k in (
            "job_name",
            "consumer_index",
            "num_consumers",
            "target_workers",
            "data_transfer_protocol",
            "client_timeout_ms",
            "worker_loss_timeout_ms",
        )
        if spec.get(k) is not None
    }
    if spec.get("compression") is not None:
        kw["compression"] = None if spec["compression"] == "NONE" else spec["compression"]
    if spec.get("trainer_id") is not None:
        kw["cross_trainer_cache"] = ds.CrossTrainerCache(spec["trainer_id"])
    dataset = dataset.apply(ds.distribute(spec.get("mode", "off"), spec["target"], **kw))
    record = spec.get("record", "ids")
    limit = spec.get("limit")
    every = int(spec.get("progress_every", 0))
    read_delay_s = float(spec.get("read_delay_ms", 0)) / 1000
    warmup = int(spec.get("warmup", 0))
    timed_from = None
    timed_bytes = 0
    elements: list = []
    count = nbytes = 0
    error = None
    first = last = time.monotonic()
    try:
        it = iter(dataset)
    except Exception as err:  # noqa: BLE001  (reported to the test)
        _emit(
            {
                "result": {
                    "elements": [],
                    "count": 0,
                    "bytes": 0,
                    "elapsed_s": 0.0,
                    "stats": None,
                    "error": {"type": type(err).__name__, "message": str(err)},
                }
            }
        )
        return
    _emit({"ready": True})
    try:
        for x in it:
            if count == 0:
                first = time.monotonic()
            count += 1
            if count == warmup + 1:
                timed_from = time.monotonic()
            if isinstance(x, dict):
                nbytes += int(x["x"].nbytes)
                if count > warmup:
                    timed_bytes += int(x["x"].nbytes)
                if record == "ids":
                    elements.append(int(x["i"]))
                elif record == "cache":
                    elements.append([int(x["pid"]), int(x["i"]), int(x["nonce"])])
            elif record == "ids":
                elements.append(int(x))
            del x  # a shared-memory view: let the ring reuse its bytes
            if every and count % every == 0:
                _emit({"progress": count})
            if read_delay_s:
                time.sleep(read_delay_s)  # the trainer's step time, not a synchronisation
            if limit is not None and count >= limit:
                break
        last = time.monotonic()
    except Exception as err:  # noqa: BLE001  (reported to the test)
        last = time.monotonic()
        error = {"type": type(err).__name__, "message": str(err)}
    finally:
        it.close()
    stats = it.stats()
    _emit(
        {
            "result": {
                "elements": elements,
                "count": count,
                "bytes": nbytes,
                "elapsed_s": last - first,
                "timed_s": last - timed_from if timed_from is not None else 0.0,
                "timed_bytes": timed_bytes,
                "timed_count": max(0, count - warmup),
                "stats": stats,
                "error": error,
            }
        }
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write(__doc__ or "")
        sys.exit(2)
    main(json.loads(sys.argv[1]))
