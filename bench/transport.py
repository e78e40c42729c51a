"""Transport benchmark (not a test): the shared-memory ring alone, the whole
service through LocalCluster with shm and with gRPC, tf.data service (under
TensorFlow's own interpreter), a raw loopback TCP socket, PyTorch's DataLoader
(if torch is importable), and single-core memcpy, on five workloads:

    scalars  200k int64 scalars (range)
    images   3,000 uint8[224, 224, 3] (150 KB) built by a cheap map
    mb1      600 uint8[1024, 1024] (1 MiB)
    batches  200 uint8[64, 224, 224, 3] (9.6 MB)
    cpu_map  2,000 elements of a ~2 ms CPU-bound map, 1 vs 2 workers (timed as
             the others: the last two thirds, for the service and DataLoader alike)

Usage:
    python bench/transport.py [--quick] [--json out.json] [--repeat 3]
        [--only ring,raw_shm,shm,grpc,bare_grpc,tf,tcp,torch,memcpy,cpu_map]
        [--tf-python /opt/tfvenv/bin/python]

Columns:
    grpc  the service with data_transfer_protocol="grpc", compression=None (as the
          tf column: the same bytes cross the socket)
    tf    tf.data service (DispatchServer, a WorkerServer process, distribute with
          compression=None), run by bench/tf_service.py under `--tf-python`
          (TensorFlow's protobuf clashes with ours: never imported here); skipped,
          saying why, when that interpreter or TensorFlow is missing
    tcp   a raw loopback TCP socket: the workload's bytes, sendall / recv_into one
          preallocated buffer, between two processes
    bare_grpc  grpcio alone: a server process streams the workload's bytes as
          prebuilt 1 MiB messages, the client drops each (the ceiling of any data
          path built on grpcio's Python API, which the gRPC column is)

Each path of the array workloads runs `--repeat` times (default 3) and its
fastest run counts, the same for every path (scalars run once: the DataLoader
takes minutes on them).

The service and DataLoader paths are timed over the last two thirds of each
workload, one element held at a time: the first third warms every path up
alike (process and ring start-up, a worker's task buffer filled before the
first read). Prints a table (elements/s and MB/s per workload and path), issue 3's targets
as ratios measured in this run (issue 13's gRPC targets: >= 2x tf.data service and
>= 40% of raw TCP for elements of 1 MB and more, >= 4x tf.data service for 150 KB),
and writes JSON (default bench/results/transport.json). The DataLoader columns need
torch installed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import numpy as np

WORKLOADS = {
    "scalars": dict(n=200_000, shape=None, nbytes=8),
    "images": dict(n=3_000, shape=(224, 224, 3), nbytes=224 * 224 * 3),
    "mb1": dict(n=600, shape=(1024, 1024), nbytes=1024 * 1024),
    "batches": dict(n=200, shape=(64, 224, 224, 3), nbytes=64 * 224 * 224 * 3),
}
DEFAULT_TF_PYTHON = "/opt/tfvenv/bin/python"

_RING_CONSUMER = textwrap.dedent(
    """
    import sys, time
    from dataservice import _core
    fd, ctl, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    c = _core.ShmRingConsumer(fd, control_fd=ctl)
    got = 0
    t0 = None
    while True:
        els, nbytes, end, err = c.get_many(64, 10_000)
        if t0 is None and els:
            t0 = time.perf_counter()
        got += len(els)
        els = None  # a training loop holds one element at a time
        if end:
            break
    dt = time.perf_counter() - t0
    print(got, dt, flush=True)
    print(c.stats(), file=sys.stderr)
    """
)


_RAW_CONSUMER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from multiprocessing import resource_tracker, shared_memory
    from multiprocessing.connection import Connection
    name, slots, slot_bytes, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    full, free = Connection(int(sys.argv[5])), Connection(int(sys.argv[6]))
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # the producer unlinks it
    buf = np.ndarray((slots, slot_bytes), np.uint8, buffer=shm.buf)
    t0 = None
    for _ in range(n):
        slot = full.recv_bytes()
        if t0 is None:
            t0 = time.perf_counter()
        view = buf[slot[0]]  # the consumer's element: a view of the slot
        view = None
        free.send_bytes(slot)
    print(n, time.perf_counter() - t0, flush=True)
    del buf, view
    shm.close()
    """
)


def bench_raw_shm(name: str, n: int, slots: int = 8) -> dict[str, float] | None:
    """The issue's "raw shared-memory hand-off": `multiprocessing.shared_memory`
    slots, the producer copies each element into a free slot and passes the slot
    index through a pipe, the consumer views it and hands the slot back."""
    from multiprocessing import shared_memory
    from multiprocessing.connection import Pipe

    spec = WORKLOADS[name]
    if spec["shape"] is None:
        return None  # a hand-off of 8-byte scalars measures the pipe, not memory
    nbytes = spec["nbytes"]
    shm = shared_memory.SharedMemory(create=True, size=slots * nbytes)
    try:
        buf = np.ndarray((slots, nbytes), np.uint8, buffer=shm.buf)
        buf[:] = 0  # pre-fault, as the ring is
        full_r, full_w = Pipe(duplex=False)
        free_r, free_w = Pipe(duplex=False)
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _RAW_CONSUMER,
                shm.name,
                str(slots),
                str(nbytes),
                str(n),
                str(full_r.fileno()),
                str(free_w.fileno()),
            ],
            pass_fds=[full_r.fileno(), free_w.fileno()],
            stdout=subprocess.PIPE,
            text=True,
        )
        elements = [e.reshape(-1) for e in _source(name, min(n, 64))]
        for k in range(slots):
            free_w.send_bytes(bytes([k]))
        for i in range(n):
            slot = free_r.recv_bytes()
            np.copyto(buf[slot[0]], elements[i % len(elements)])
            full_w.send_bytes(slot)
        out, _ = child.communicate(timeout=600)
        got, dt = out.split()
        assert int(got) == n
        secs = max(float(dt), 1e-9)
        del buf
    finally:
        shm.close()
        shm.unlink()
    return {"elements_per_s": n / secs, "mb_per_s": n * nbytes / secs / 1e6}


def _source(name: str, n: int) -> Any:
    spec = WORKLOADS[name]
    if spec["shape"] is None:
        return (np.int64(i) for i in range(n))
    proto = np.zeros(spec["shape"], np.uint8)

    def gen() -> Any:
        for i in range(n):
            a = proto.copy() if spec["nbytes"] < (1 << 20) else np.empty_like(proto)
            a.flat[0] = i % 256
            yield a

    return gen()


def bench_ring(name: str, n: int) -> dict[str, float]:
    """Python -> ring -> Python across two processes (producer here)."""
    from dataservice import _core

    spec = WORKLOADS[name]
    ring = _core.ShmRingProducer(64 << 20)
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = subprocess.Popen(
        [sys.executable, "-c", _RING_CONSUMER, str(ring.fileno()), str(there.fileno()), str(n)],
        pass_fds=[ring.fileno(), there.fileno()],
        stdout=subprocess.PIPE,
        text=True,
    )
    there.close()
    ring.set_peer(here.fileno(), child.pid)
    # Pre-build the elements for arrays (the producer cost measured is the ring's).
    elements = list(_source(name, min(n, 64)))
    t0 = time.perf_counter()
    batch = 256 if spec["shape"] is None else 16
    i = 0
    if spec["shape"] is None:
        src = [np.int64(k) for k in range(n)]
        while i < n:
            i += ring.put_many(src[i : i + batch], 10_000)
    else:
        while i < n:
            chunk = [elements[(i + k) % len(elements)] for k in range(min(batch, n - i))]
            i += ring.put_many(chunk, 10_000)
    ring.put_end(10_000)
    out, _ = child.communicate(timeout=600)
    wall = time.perf_counter() - t0
    got, dt = out.split()
    assert int(got) == n, (got, n)
    here.close()
    ring.close()
    secs = max(float(dt), 1e-9)
    _ = wall
    return {"elements_per_s": n / secs, "mb_per_s": n * spec["nbytes"] / secs / 1e6}


def _dataset(name: str, n: int) -> Any:
    import dataservice as ds

    spec = WORKLOADS[name]
    if spec["shape"] is None:
        return ds.Dataset.range(n)
    shape = spec["shape"]
    if spec["nbytes"] < (1 << 20):
        proto = np.zeros(shape, np.uint8)
        return ds.Dataset.range(n).map(lambda x: np.full_like(proto, x % 256))
    return ds.Dataset.range(n).map(lambda x: np.empty(shape, np.uint8))


def bench_service(name: str, n: int, protocol: str, cluster: Any) -> dict[str, float]:
    import dataservice as ds

    spec = WORKLOADS[name]
    dataset = _dataset(name, n).apply(
        ds.distribute(
            ds.ShardingPolicy.OFF,
            cluster.target,
            data_transfer_protocol=protocol,
            compression=None,  # as tf.data service's column: the same bytes cross
        )
    )
    it = iter(dataset)
    pids = [os.getpid(), *_descendants(os.getpid())]  # this consumer, the cluster's processes
    count, dt, cpu = _steady_state(it, n, lambda: _cpu_s(pids))  # type: ignore[misc]
    used = {w["transfer_protocol"] for w in it.stats()["workers"].values()}
    return {
        "elements_per_s": count / dt,
        "mb_per_s": count * spec["nbytes"] / dt / 1e6,
        "cpu_s_per_gb": cpu / (count * spec["nbytes"] / 1e9),
        "protocol": ",".join(sorted(used)),
    }


def _descendants(pid: int) -> list[int]:
    """The processes started by `pid`, and theirs (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _steady_state(
    it: Any, n: int, cpu: Callable[[], float] | None = None
) -> tuple[int, float] | tuple[int, float, float]:
    """Reads all `n` elements of `it` (holding one at a time, as a training loop
    does); times the last two thirds. The first third is the warm-up of every
    path alike: process and ring start-up, and the head start of a worker whose
    task buffer (up to 64 MiB or 4,096 elements) filled before the first read.

    Returns:
        (elements timed, seconds), and the CPU seconds `cpu()` grew by meanwhile
        when given.
    """
    skip = n // 3
    for _ in range(skip):
        next(it)
    t0 = time.perf_counter()
    cpu0 = cpu() if cpu is not None else 0.0
    count = sum(1 for _ in it)
    dt = time.perf_counter() - t0
    assert skip + count == n, (skip + count, n)
    if cpu is not None:
        return count, dt, cpu() - cpu0
    return count, dt


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of processes `pids` (all their threads) so far."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


_TCP_RECEIVER = textwrap.dedent(
    """
    import socket, sys, time
    import numpy as np
    port, nbytes, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sock = socket.create_connection(("127.0.0.1", port))
    buf = np.empty(nbytes, np.uint8)  # one preallocated buffer, as recv_into needs
    view = memoryview(buf)
    skip = n // 3
    t0 = None
    for i in range(n):
        if i == skip:
            t0 = time.perf_counter()
            cpu0 = time.process_time()
        got = 0
        while got < nbytes:
            k = sock.recv_into(view[got:])
            if not k:
                raise SystemExit("sender closed early")
            got += k
    print(n - skip, time.perf_counter() - t0, time.process_time() - cpu0, flush=True)
    """
)


def bench_tcp(name: str, n: int) -> dict[str, float] | None:
    """A raw loopback TCP socket: this process `sendall`s the workload's elements
    (their bytes, prebuilt), a child `recv_into`s one preallocated buffer; the
    last two thirds are timed, as the service paths are."""
    spec = WORKLOADS[name]
    if spec["shape"] is None:
        return None  # 8-byte sends measure system calls, not the link
    nbytes = spec["nbytes"]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        child = subprocess.Popen(
            [sys.executable, "-c", _TCP_RECEIVER, str(port), str(nbytes), str(n)],
            stdout=subprocess.PIPE,
            text=True,
        )
        conn, _ = listener.accept()
    elements = [np.ascontiguousarray(e).reshape(-1) for e in _source(name, min(n, 8))]
    cpu0 = time.process_time()
    with conn:
        for i in range(n):
            conn.sendall(elements[i % len(elements)])
    sender_cpu = time.process_time() - cpu0
    out, _ = child.communicate(timeout=600)
    count, dt, receiver_cpu = out.split()
    secs = max(float(dt), 1e-9)
    gb = int(count) * nbytes / 1e9
    return {
        "elements_per_s": int(count) / secs,
        "mb_per_s": gb * 1e3 / secs,
        # the sender's CPU over all n elements, counted for the timed ones
        "cpu_s_per_gb": (float(receiver_cpu) + sender_cpu * int(count) / n) / gb,
    }


_BARE_GRPC_SERVER = textwrap.dedent(
    """
    import sys
    from concurrent import futures
    import grpc
    nbytes, n, message_bytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    limit = 64 << 20
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    # One element as messages of message_bytes, prebuilt: grpcio's own cost only.
    chunks = [bytes(min(message_bytes, nbytes - o)) for o in range(0, nbytes, message_bytes)]

    def stream(request, context):
        for _ in range(n):
            yield from chunks

    server = grpc.server(futures.ThreadPoolExecutor(2), options=options)
    handler = grpc.method_handlers_generic_handler(
        "bare.Bare", {"Get": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes it
    server.stop(0)
    """
)


def bench_bare_grpc(name: str, n: int) -> dict[str, float] | None:
    """grpcio alone, the ceiling any data path built on it has: a server process
    streams the workload's elements as prebuilt `bytes` messages of 1 MiB (as the
    service's gRPC replies), this process iterates the call and drops each message
    (no copy, no decode, no request per element); the last two thirds are timed."""
    import grpc

    spec = WORKLOADS[name]
    if spec["shape"] is None:
        return None
    nbytes = spec["nbytes"]
    child = subprocess.Popen(
        [sys.executable, "-c", _BARE_GRPC_SERVER, str(nbytes), str(n), str(1 << 20)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(child.stdout.readline())  # type: ignore[union-attr]
        limit = 64 << 20
        options = [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.unary_stream("/bare.Bare/Get")(b"")
            skip = (n // 3) * nbytes
            got = 0
            t0 = cpu0 = server_cpu0 = 0.0
            for message in call:
                got += len(message)
                if got >= skip and not t0:
                    t0, cpu0 = time.perf_counter(), time.process_time()
                    server_cpu0 = _cpu_s([child.pid])
            dt = time.perf_counter() - t0
            cpu = time.process_time() - cpu0 + _cpu_s([child.pid]) - server_cpu0
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(30)
    gb = (got - skip) / 1e9
    return {
        "elements_per_s": (got - skip) / nbytes / dt,
        "mb_per_s": gb * 1e3 / dt,
        "cpu_s_per_gb": cpu / gb,
    }


class TfService:
    """tf.data service's column: bench/tf_service.py `--serve` under `tf_python` (a
    separate interpreter: TensorFlow's protobuf clashes with ours), kept running so
    that each workload's run sits next to the other columns' runs of it (the
    machine's load changes by the minute). `skipped` says why there is no column."""

    def __init__(self, tf_python: str) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.version: str | None = None
        self.skipped: str | None = None
        if not os.path.exists(tf_python):
            self.skipped = f"{tf_python} does not exist (--tf-python)"
            return
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_service.py")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        self.proc = subprocess.Popen(
            [tf_python, script, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        ready = self._answer()
        if ready is None or "ready" not in ready:
            self.close()
            self.skipped = f"{tf_python} bench/tf_service.py did not start (TensorFlow missing?)"
            return
        self.version = ready["ready"]

    def _answer(self) -> dict[str, Any] | None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:  # TensorFlow may print its own lines first
            if line.startswith("{"):
                return json.loads(line)  # type: ignore[no-any-return]
        return None

    def measure(self, name: str, n: int) -> dict[str, float] | None:
        if self.proc is None or self.proc.stdin is None:
            return None
        shape = WORKLOADS[name]["shape"]
        ask = {"name": name, "n": n, "shape": list(shape) if shape else None}
        self.proc.stdin.write(json.dumps(ask) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def bench_cpu_map(cluster_workers: int, protocol: str | None, n: int = 2000) -> float:
    import dataservice as ds

    def burn(x: Any) -> Any:
        t = time.process_time() + 0.002
        while time.process_time() < t:
            pass
        return x

    with ds.LocalCluster(num_workers=cluster_workers) as cluster:
        dataset = (
            ds.Dataset.range(n)
            .map(burn)
            .apply(
                ds.distribute(
                    ds.ShardingPolicy.DYNAMIC, cluster.target, data_transfer_protocol=protocol
                )
            )
        )
        count, dt = _steady_state(iter(dataset), n)[:2]
    return count / dt


def bench_torch_cpu_map(num_workers: int, n: int = 2000) -> float | None:
    """The cpu_map workload through PyTorch's DataLoader (elements/s)."""
    try:
        from torch.utils.data import DataLoader, IterableDataset, get_worker_info
    except ImportError:
        return None

    class Burn(IterableDataset):  # type: ignore[type-arg,misc]
        def __iter__(self) -> Any:
            info = get_worker_info()
            wid, nw = (info.id, info.num_workers) if info else (0, 1)
            for i in range(wid, n, nw):
                t = time.process_time() + 0.002
                while time.process_time() < t:
                    pass
                yield np.int64(i)

    loader = DataLoader(Burn(), batch_size=None, num_workers=num_workers)
    count, dt = _steady_state(iter(loader), n)[:2]
    return count / dt


def bench_torch(name: str, n: int, num_workers: int) -> dict[str, float] | None:
    try:
        import torch  # noqa: F401
        from torch.utils.data import DataLoader, IterableDataset, get_worker_info
    except ImportError:
        return None
    spec = WORKLOADS[name]

    class Source(IterableDataset):  # type: ignore[type-arg,misc]
        def __iter__(self) -> Any:
            info = get_worker_info()
            wid, nw = (info.id, info.num_workers) if info else (0, 1)
            for i in range(wid, n, nw):
                if spec["shape"] is None:
                    yield np.int64(i)
                else:
                    yield np.full(spec["shape"], i % 256, np.uint8)

    loader = DataLoader(Source(), batch_size=None, num_workers=num_workers)
    count, dt = _steady_state(iter(loader), n)
    return {"elements_per_s": count / dt, "mb_per_s": count * spec["nbytes"] / dt / 1e6}


def bench_memcpy(name: str) -> dict[str, float]:
    spec = WORKLOADS[name]
    nbytes = spec["nbytes"]
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    reps = max(3, int(2e9 // max(nbytes, 1)) if nbytes > 64 else 100_000)
    reps = min(reps, 2000)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    dt = time.perf_counter() - t0
    return {"elements_per_s": reps / dt, "mb_per_s": reps * nbytes / dt / 1e6}


def _targets(results: dict[str, Any]) -> list[str]:
    """Issues 3's and 13's targets, as ratios of figures measured in this run."""
    lines = []

    def rate(name: str, col: str) -> float | None:
        r = results.get(name, {}).get(col)
        return None if r is None else r["elements_per_s"]

    def check(label: str, got: float | None, base: float | None, want: float) -> None:
        if got is None or base is None:
            lines.append(f"target {label}: not measured")
            return
        ratio = got / base
        verdict = "met" if ratio >= want else "MISSED"
        lines.append(f"target {label}: {ratio:.2f}x (want >= {want}x) {verdict}")

    for name, want in (("scalars", 50), ("images", 15), ("batches", 3)):
        check(f"{name} shm vs DataLoader(2)", rate(name, "shm"), rate(name, "torch2"), want)
    for name in ("images", "batches"):
        check(f"{name} shm vs our gRPC", rate(name, "shm"), rate(name, "grpc"), 5)
    check("images ring vs raw shm hand-off", rate("images", "ring"), rate("images", "raw_shm"), 1)
    scalars_ring = rate("scalars", "ring")
    if scalars_ring is not None:
        check("scalars ring >= 1M/s", scalars_ring, 1e6, 1)
    cpu = results.get("cpu_map")
    if cpu:
        # Issue 13 keeps issue 3's wins and asks 1.8x from 1 to 2 workers.
        check("cpu_map 2 workers vs 1", cpu["2_workers"], cpu["1_worker"], 1.8)
        check("cpu_map 1 worker vs DataLoader(1)", cpu["1_worker"], cpu.get("torch1"), 1.0)
        check("cpu_map 2 workers vs DataLoader(2)", cpu["2_workers"], cpu.get("torch2"), 1.0)
    # Issue 13: the gRPC data path.
    check("images gRPC vs tf.data service", rate("images", "grpc"), rate("images", "tf"), 4)
    for name in ("mb1", "batches"):
        check(f"{name} gRPC vs tf.data service", rate(name, "grpc"), rate(name, "tf"), 2)
        check(f"{name} gRPC vs raw TCP", rate(name, "grpc"), rate(name, "tcp"), 0.4)
    # Not targets: how far grpcio alone gets, and how much of that the service keeps.
    for name in ("images", "mb1", "batches"):
        bare, tcp, ours = rate(name, "bare_grpc"), rate(name, "tcp"), rate(name, "grpc")
        if bare and tcp and ours:
            lines.append(
                f"context {name}: bare grpcio {bare / tcp:.2f}x raw TCP; "
                f"our gRPC path {ours / bare:.2f}x bare grpcio"
            )
    return lines


def _best_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest of `runs`, with every run's elements/s under "runs"."""
    if not runs:
        return None
    best = dict(max(runs, key=lambda r: r["elements_per_s"]))
    best["runs"] = [round(r["elements_per_s"], 1) for r in runs]
    return best


def _best_of(repeat: int, measure: Callable[..., Any], *args: Any) -> dict[str, Any] | None:
    """The fastest of `repeat` runs of `measure(*args)` (each run's elements/s kept under
    "runs"): every path of a workload gets the same number of tries, so a burst
    of load on this shared machine does not decide a ratio."""
    return _best_run([r for r in (measure(*args) for _ in range(repeat)) if r is not None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of each workload")
    parser.add_argument("--json", default="bench/results/transport.json")
    parser.add_argument(
        "--only", default="ring,raw_shm,shm,grpc,bare_grpc,tf,tcp,torch,memcpy,cpu_map"
    )
    parser.add_argument(
        "--tf-python",
        default=DEFAULT_TF_PYTHON,
        help="the interpreter with TensorFlow that runs the tf.data service column",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="runs per path on the array workloads, the fastest kept (scalars: 1); "
        "default 3, 2 with --quick",
    )
    args = parser.parse_args()
    if args.repeat is None:
        args.repeat = 2 if args.quick else 3
    only = set(args.only.split(","))
    scale = 0.1 if args.quick else 1.0
    results: dict[str, dict[str, Any]] = {}
    tf = TfService(args.tf_python) if "tf" in only else None
    if tf is not None:
        results["tf_service"] = {"tensorflow": tf.version, "skipped": tf.skipped}
        if tf.skipped:
            print(f"tf.data service column skipped: {tf.skipped}", file=sys.stderr)
    cluster = None
    if only & {"shm", "grpc"}:
        import dataservice as ds

        cluster = ds.LocalCluster(num_workers=1)
    try:
        for name, spec in WORKLOADS.items():
            n = max(10, int(spec["n"] * scale))
            repeat = 1 if spec["shape"] is None else max(1, args.repeat)
            row: dict[str, Any] = {"n": n, "repeat": repeat}
            if "ring" in only:
                row["ring"] = _best_of(repeat, bench_ring, name, n)
            if "raw_shm" in only:
                raw = _best_of(repeat, bench_raw_shm, name, n)
                if raw is not None:
                    row["raw_shm"] = raw
            if "shm" in only and cluster is not None:
                row["shm"] = _best_of(repeat, bench_service, name, n, "shm", cluster)
            # gRPC, tf.data service and raw TCP take turns, run by run, so that their
            # ratios compare runs of the same minute on a machine whose load changes.
            turns: dict[str, list[dict[str, Any]]] = {
                "grpc": [],
                "bare_grpc": [],
                "tf": [],
                "tcp": [],
            }
            # tf.data service's job start-up would fall in a tenth of a workload's
            # timed part: it gets a quarter of it with --quick, else all of it; it
            # moves ~4k scalars/s, so 20k (5k) of them say as much as 200k.
            tf_n = min(int(spec["n"] * (0.25 if args.quick else 1.0)), 20_000)
            if spec["shape"] is None and args.quick:
                tf_n = 5_000
            for _ in range(repeat):
                if "grpc" in only and cluster is not None:
                    turns["grpc"].append(bench_service(name, n, "grpc", cluster))
                if tf is not None and not tf.skipped:
                    turns["tf"].append(tf.measure(name, tf_n))  # type: ignore[arg-type]
                if "tcp" in only:
                    turns["tcp"].append(bench_tcp(name, n))  # type: ignore[arg-type]
                if "bare_grpc" in only:
                    turns["bare_grpc"].append(bench_bare_grpc(name, n))  # type: ignore[arg-type]
            for col, runs in turns.items():
                best = _best_run([r for r in runs if r is not None])
                if best is not None:
                    row[col] = best
            if "memcpy" in only:
                row["memcpy"] = bench_memcpy(name)
            results[name] = row
            print(f"{name}: done", file=sys.stderr, flush=True)
    finally:
        if cluster is not None:
            cluster.__exit__(None, None, None)
        if tf is not None:
            tf.close()
    # PyTorch last: importing it (and its worker processes) must not weigh on the
    # figures of the other paths measured in this process.
    if "torch" in only:
        for name, spec in WORKLOADS.items():
            n = max(10, int(spec["n"] * scale))
            if spec["shape"] is None:  # DataLoader moves ~2k scalars/s: minutes for 200k
                n = min(n, 20_000)
            repeat = 1 if spec["shape"] is None else max(1, args.repeat)
            for nw in (1, 2):
                r = _best_of(repeat, bench_torch, name, n, nw)
                if r is not None:
                    results[name][f"torch{nw}"] = r
    if "cpu_map" in only:
        n = max(100, int(2000 * scale))
        one = bench_cpu_map(1, None, n)
        two = bench_cpu_map(2, None, n)
        results["cpu_map"] = {"n": n, "1_worker": one, "2_workers": two, "speedup": two / one}
        if "torch" in only:
            t1, t2 = bench_torch_cpu_map(1, n), bench_torch_cpu_map(2, n)
            if t1 and t2:
                results["cpu_map"].update(torch1=t1, torch2=t2, torch_speedup=t2 / t1)

    cols = [
        "ring",
        "raw_shm",
        "shm",
        "grpc",
        "bare_grpc",
        "tf",
        "tcp",
        "torch1",
        "torch2",
        "memcpy",
    ]
    print(f"{'workload':<9} " + " ".join(f"{c:>14}" for c in cols))
    for name in WORKLOADS:
        row = results.get(name, {})
        cells = []
        for c in cols:
            r = row.get(c)
            if r is None:
                cells.append(f"{'-':>14}")
            elif name == "scalars":
                cells.append(f"{r['elements_per_s'] / 1e3:>10.1f}k/s")
            else:
                cells.append(f"{r['mb_per_s']:>9.0f} MB/s")
        print(f"{name:<9} " + " ".join(cells))
    print("CPU seconds per GB moved (both ends' processes; load-independent):")
    for name in WORKLOADS:
        row = results.get(name, {})
        cells = [
            f"{c} {row[c]['cpu_s_per_gb']:.2f}"
            for c in ("shm", "grpc", "bare_grpc", "tf", "tcp")
            if row.get(c) and "cpu_s_per_gb" in row[c]
        ]
        if cells and name != "scalars":
            print(f"  {name:<9} " + ", ".join(cells))
    if "cpu_map" in results:
        r = results["cpu_map"]
        print(
            f"cpu_map   1 worker {r['1_worker']:.0f}/s, 2 workers {r['2_workers']:.0f}/s "
            f"({r['speedup']:.2f}x)"
        )
    if "cpu_map" in results and "torch_speedup" in results["cpu_map"]:
        r = results["cpu_map"]
        print(
            f"cpu_map   DataLoader 1 worker {r['torch1']:.0f}/s, 2 workers {r['torch2']:.0f}/s "
            f"({r['torch_speedup']:.2f}x)"
        )
    results["targets"] = _targets(results)
    for line in results["targets"]:
        print(line)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": os.uname().nodename, "cpus": os.cpu_count(), **results}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
