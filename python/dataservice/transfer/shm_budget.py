"""The memory budget of a worker's shared-memory rings.

`ring_budget_bytes` is what one worker's "shm" endpoint may hold in rings at once:
25 % of min(MemAvailable from /proc/meminfo, this process's cgroup memory limit
minus its usage, cgroup v2 or v1). `ShmTransferServer.create_ring` halves a new
ring (down to 8 MiB) past it, then refuses, so "auto" clients fall back to gRPC;
the cross-trainer cache sizes its shared window from it too.
"""

from __future__ import annotations


def _cgroup_free_bytes() -> int | None:
    """memory limit minus usage of this process's cgroup (v2 or v1), if limited."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2]
        candidates = []
        if controllers == "":
            candidates.append(
                (f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current")
            )
        elif "memory" in controllers.split(","):
            base_dir = f"/sys/fs/cgroup/memory{path}"
            candidates.append(
                (f"{base_dir}/memory.limit_in_bytes", f"{base_dir}/memory.usage_in_bytes")
            )
        for limit_path, usage_path in candidates:
            try:
                with open(limit_path) as f:
                    limit_text = f.read().strip()
                with open(usage_path) as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if limit_text == "max":
                continue
            limit = int(limit_text)
            if limit >= 1 << 60:  # v1 "unlimited"
                continue
            return max(0, limit - usage)
    return None


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 1 << 34


def ring_budget_bytes() -> int:
    """Total ring bytes one worker may hold: 25 % of available memory."""
    free = _mem_available_bytes()
    cgroup = _cgroup_free_bytes()
    if cgroup is not None:
        free = min(free, cgroup)
    return free // 4
