"""Multi-host throughput (not a test): one trainer host reading from two
worker hosts over gRPC, next to a raw TCP stream between the same hosts, in
one run. Each host is a network namespace on this machine, joined by a bridge
(tests/multihost/harness.py): the "network" is the kernel's veth and bridge
path, so the figures compare the service's cost against the cheapest socket
copy, not against a real NIC.

Workloads (random bytes: compression gains nothing):

    images   3,000 uint8[224 * 224 * 3] (150 KB)
    batches  200 uint8[64 * 224 * 224 * 3] (9.6 MB)

Paths, each per workload:

    service            dispatcher on `disp`, workers on `w0` and `w1`, the
                       trainer (tests/multihost/trainer.py, OFF over half the
                       elements each, so the trainer gets `n`) on `t0`; the
                       default compression ("AUTO": zstd only where the
                       measured link is slower than the codec)
    service_nocompress the same with compression=None
    tcp                a Python sender on `w0` and on `w1` each `sendall`s half
                       the bytes over one TCP connection; the reader on `t0`
                       reads both at once (a thread per connection,
                       `recv_into` a buffer of one element)

The first third of each path's bytes is not timed (start-up, buffers
filling). Each path runs `--repeat` times (default 2), the fastest counts.

Usage: python bench/multihost.py [--quick] [--repeat N] [--json PATH]
(root and iproute2 needed; writes bench/results/multihost.json by default).
The machine this runs on may be shared: the figures are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "python"))

from tests.multihost import harness  # noqa: E402
from tests.multihost.cluster import (  # noqa: E402
    DISPATCHER_PORT,
    Cluster,
    write_token_file,
)

WORKLOADS = {
    "images": dict(n=3_000, nbytes=224 * 224 * 3),
    "batches": dict(n=200, nbytes=64 * 224 * 224 * 3),
}
TCP_PORT = 6000

_SENDER = textwrap.dedent(
    """
    import socket, sys
    import numpy as np
    host, port, n, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    buf = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    srv = socket.create_server((host, port))
    print("listening", flush=True)
    conn, _ = srv.accept()
    for _ in range(n):
        conn.sendall(buf)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # the reader closes when it has everything
    """
)

_READER = textwrap.dedent(
    """
    import json, socket, sys, threading, time
    peers, n, nbytes = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    port = int(sys.argv[4])
    total = n * nbytes * len(peers)
    warm = total // 3
    got = [0]
    mu = threading.Lock()
    marks = {}

    def read(addr):
        s = socket.create_connection((addr, port))
        buf = bytearray(nbytes)
        view = memoryview(buf)
        while True:
            k = s.recv_into(view)
            if not k:
                break
            with mu:
                got[0] += k
                if "t0" not in marks and got[0] >= warm:
                    marks["t0"], marks["b0"] = time.monotonic(), got[0]
        marks.setdefault("end", 0)
        marks["end"] = max(marks["end"], time.monotonic())
        s.close()

    threads = [threading.Thread(target=read, args=(a,)) for a in peers]
    for t in threads: t.start()
    for t in threads: t.join()
    assert got[0] == total, (got[0], total)
    print(json.dumps({"bytes": got[0] - marks["b0"], "seconds": marks["end"] - marks["t0"]}))
    """
)


def _service(c: Cluster, workload: dict, compression: str) -> dict[str, Any]:
    n, nbytes = workload["n"], workload["nbytes"]
    t = c.trainer(
        "t0",
        target="grpc://" + c.address("disp", DISPATCHER_PORT),
        mode="off",
        n=n // 2,  # each of the two workers produces them all (OFF)
        payload_bytes=nbytes,
        record="count",
        warmup=n // 3,
        compression=compression,
    )
    r = t.wait_result(600)
    if r["error"] is not None or r["count"] != n:
        raise RuntimeError(f"the trainer read {r['count']} of {n}: {r['error']}\n{t.stderr()}")
    return {
        "bytes": r["timed_bytes"],
        "seconds": r["timed_s"],
        "transports": sorted({w["transfer_protocol"] for w in r["stats"]["workers"].values()}),
        "wait_fraction": r["stats"].get("wait_fraction"),
    }


def _tcp(net: harness.Net, workload: dict) -> dict[str, Any]:
    per_sender = workload["n"] // 2
    senders = []
    try:
        for h in ("w0", "w1"):
            p = subprocess.Popen(
                net.exec_argv(
                    h,
                    [
                        sys.executable,
                        "-c",
                        _SENDER,
                        net.ip[h],
                        str(TCP_PORT),
                        str(per_sender),
                        str(workload["nbytes"]),
                    ],
                ),
                stdout=subprocess.PIPE,
                text=True,
            )
            senders.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "listening"
        out = net.run(
            "t0",
            [
                sys.executable,
                "-c",
                _READER,
                json.dumps([net.ip["w0"], net.ip["w1"]]),
                str(per_sender),
                str(workload["nbytes"]),
                str(TCP_PORT),
            ],
            timeout_s=600,
        )
        for p in senders:
            p.wait(30)
        return json.loads(out)
    finally:
        for p in senders:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the elements")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", default=os.path.join(REPO, "bench", "results", "multihost.json"))
    args = parser.parse_args()
    reason = harness.unavailable_reason()
    if reason is not None:
        sys.exit(f"bench/multihost.py: {reason}")
    workloads = {
        k: dict(v, n=max(12, v["n"] // 4) if args.quick else v["n"]) for k, v in WORKLOADS.items()
    }
    rows: list[dict[str, Any]] = []
    net = harness.Net(["disp", "w0", "w1", "t0"])
    tmp = tempfile.mkdtemp(prefix="ds-multihost-bench-")
    c = Cluster(net, write_token_file(os.path.join(tmp, "token")))
    try:
        c.dispatcher()
        target = c.address("disp", DISPATCHER_PORT)
        workers = [c.worker(h, target, wait=False) for h in ("w0", "w1")]
        for w in workers:
            w.wait_ready()
        for name, workload in workloads.items():
            paths = {
                "service": lambda w=workload: _service(c, w, "AUTO"),
                "service_nocompress": lambda w=workload: _service(c, w, "NONE"),
                "tcp": lambda w=workload: _tcp(net, w),
            }
            for path, run in paths.items():
                best: dict[str, Any] | None = None
                for _ in range(args.repeat):
                    r = run()
                    r["MB_per_s"] = r["bytes"] / r["seconds"] / 1e6
                    if best is None or r["MB_per_s"] > best["MB_per_s"]:
                        best = r
                assert best is not None
                row = {"workload": name, "path": path, "elements": workload["n"], **best}
                rows.append(row)
                print(f"{name:8} {path:20} {row['MB_per_s']:9.1f} MB/s", flush=True)
    finally:
        c.close()
        net.close()
        os.remove(os.path.join(tmp, "token"))
        os.rmdir(tmp)
    by = {(r["workload"], r["path"]): r["MB_per_s"] for r in rows}
    ratios = {
        f"{w}: service / tcp": round(by[(w, "service")] / by[(w, "tcp")], 3) for w in workloads
    }
    ratios.update(
        {
            f"{w}: service_nocompress / tcp": round(
                by[(w, "service_nocompress")] / by[(w, "tcp")], 3
            )
            for w in workloads
        }
    )
    for k, v in ratios.items():
        print(f"{k}: {v}")
    out = {
        "note": "noisy: a shared machine (other jobs running); hosts are network namespaces "
        "joined by a veth+bridge on one machine, not real NICs",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_avg_at_end": os.getloadavg(),
        "repeat": args.repeat,
        "quick": args.quick,
        "rows": rows,
        "ratios": ratios,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
