"""tf.data service side of bench/transport.py (not a test): run under the
TensorFlow venv's interpreter (`--tf-python`), never imported by our process
(TensorFlow's protobuf clashes with ours).

Starts a `tf.data.experimental.service.DispatchServer` here and one
`WorkerServer` in a child process (a worker in the consumer's own process would
hand elements over in memory, not over gRPC), then reads each workload through
`distribute(processing_mode="parallel_epochs", compression=None)` with the same
steady-state timing as bench/transport.py (the last two thirds of the elements,
one held at a time).

Usage:
    /opt/tfvenv/bin/python bench/tf_service.py --workloads '{"images": [3000, [224, 224, 3]]}'
        prints one JSON object on its last line of stdout:
        {"tensorflow": version, "results": {workload: {"elements_per_s", "mb_per_s", "n"}}}
    /opt/tfvenv/bin/python bench/tf_service.py --serve
        (bench/transport.py's way, so that each workload's tf.data service run falls
        next to its other columns' runs) prints {"ready": version}, then answers each
        line of stdin, {"name": ..., "n": ..., "shape": [...] or null}, with one line
        of JSON: that run's figures. Ends at end of input.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _worker(dispatcher_address: str) -> None:
    import tensorflow as tf

    worker = tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(dispatcher_address=dispatcher_address)
    )
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    del worker


def _dataset(tf, n: int, shape: list[int] | None):  # type: ignore[no-untyped-def]
    ds = tf.data.Dataset.range(n)
    if shape is None:
        return ds
    if shape and shape[0] >= 64:  # a batch: the cheapest fill, as np.empty on our side
        return ds.map(lambda x: tf.zeros(shape, tf.uint8))
    return ds.map(lambda x: tf.fill(shape, tf.cast(x % 256, tf.uint8)))


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of processes `pids` so far."""
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


WORKER_PID = 0  # the WorkerServer's process, once started


def _measure(tf, target: str, name: str, n: int, shape: list[int] | None) -> dict:  # type: ignore[no-untyped-def]
    dataset = _dataset(tf, n, shape).apply(
        tf.data.experimental.service.distribute(
            processing_mode="parallel_epochs",
            service=target,
            job_name=f"bench-{name}-{time.monotonic_ns()}",
            compression=None,
        )
    )
    it = iter(dataset)
    skip = n // 3
    for _ in range(skip):
        next(it)
    pids = [os.getpid(), WORKER_PID]  # the consumer (and dispatcher), the worker
    t0 = time.perf_counter()
    cpu0 = _cpu_s(pids)
    count = 0
    for _ in it:
        count += 1
    dt = time.perf_counter() - t0
    cpu = _cpu_s(pids) - cpu0
    assert skip + count == n, (skip + count, n)
    nbytes = 8 if shape is None else int(__import__("math").prod(shape))
    return {
        "n": n,
        "elements_per_s": count / dt,
        "mb_per_s": count * nbytes / dt / 1e6,
        "cpu_s_per_gb": cpu / (count * nbytes / 1e9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help="(internal) run a worker of this dispatcher")
    parser.add_argument("--workloads", default="{}", help='{"name": [n, shape or null]}')
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--serve", action="store_true", help="answer runs asked on stdin")
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    import tensorflow as tf

    dispatcher = tf.data.experimental.service.DispatchServer()
    address = dispatcher.target.split("://")[1]
    worker = subprocess.Popen(
        [sys.executable, __file__, "--worker", address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    global WORKER_PID
    WORKER_PID = worker.pid
    results: dict[str, dict] = {}
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        if args.serve:
            print(json.dumps({"ready": tf.__version__}), flush=True)
            for line in sys.stdin:
                ask = json.loads(line)
                shape = ask["shape"]
                figures = _measure(tf, dispatcher.target, ask["name"], ask["n"], shape)
                print(json.dumps(figures), flush=True)
            return
        for name, (n, shape) in json.loads(args.workloads).items():
            repeat = 1 if shape is None else max(1, args.repeat)
            runs = [_measure(tf, dispatcher.target, name, n, shape) for _ in range(repeat)]
            best = max(runs, key=lambda r: r["elements_per_s"])
            best["runs"] = [round(r["elements_per_s"], 1) for r in runs]
            results[name] = best
            print(f"tf.data service {name}: done", file=sys.stderr, flush=True)
    finally:
        if worker.stdin is not None:
            worker.stdin.close()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    print(json.dumps({"tensorflow": tf.__version__, "results": results}), flush=True)


if __name__ == "__main__":
    main()
