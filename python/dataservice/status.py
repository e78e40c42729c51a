"""`dataservice status`: what the cluster does now, and what limits each job.

`fetch_status` asks the dispatcher (GetClusterStatus) for its workers, jobs and
consumers with rates over the last `window_s` seconds (the dispatcher computes
them from the counters workers and consumers heartbeat, dispatcher/observe.py),
and adds one verdict per job (`verdicts`):

- **input-bound**: the job's consumers waited for elements at least
  `INPUT_BOUND_WAIT_FRACTION` of their time in the window (on average): the
  trainers are starved; add workers or make the pipeline cheaper.
- **trainer-bound**: they waited less: the input keeps up, the training step is
  what limits the job.
- **straggler**: one consumer waited far more than every other one (at least
  `STRAGGLER_MIN_WAIT_FRACTION`, and `STRAGGLER_GAP` more than the next): it is
  named, its input (its host, its link, the workers it reads) is the problem.
- **idle** (no consumer attached) or **unknown** (no consumer has heartbeated
  counters over a stretch of the window yet).

`render_text` and `render_rich` draw the tables; `cli.py` owns the command.
"""

from __future__ import annotations

import statistics
from typing import Any

from dataservice import auth, errors

INPUT_BOUND_WAIT_FRACTION = 0.2
"""A job whose consumers waited at least this share of their time is input-bound."""

STRAGGLER_MIN_WAIT_FRACTION = 0.25
STRAGGLER_GAP = 0.25
"""A consumer waiting at least STRAGGLER_MIN_WAIT_FRACTION of its time and at
least STRAGGLER_GAP more than every other consumer of its job is a straggler."""


def fetch_status(
    dispatcher_address: str,
    window_s: float = 60.0,
    auth_token: str | None = None,
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """The cluster's status as one JSON-able dict: {"workers": [...], "jobs":
    [...], "verdicts": [...], "window_s": float, "dispatcher": str}.

    Args:
        dispatcher_address: "host:port" or "grpc://host:port".
        window_s: Rates cover the last this many seconds (at most 24 h; the
            dispatcher keeps 600 s of history).
        auth_token: The token to send; None: the one `auth.client_token` finds
            ($DATASERVICE_AUTH_TOKEN, or a LocalCluster's of this process).
        timeout_s: Bound of the RPC, seconds.

    Raises:
        UnauthenticatedError: The dispatcher refused the token (or its absence);
            the message says what to set.
        UnavailableError: The dispatcher cannot be reached within `timeout_s`
            (tries are repeated until then: one still starting answers); at
            the first try, a TLS mismatch (a plaintext client at a TLS
            dispatcher, an untrusted certificate) or a server of another protocol.
        ValueError: A bad address or window.
    """
    from dataservice.rpc import service_pb2 as pb
    from dataservice.rpc import service_pb2_grpc
    from dataservice.rpc import util as rpc_util

    if not 0 < window_s <= 24 * 3600:
        raise ValueError(f"the window must be in (0, 86400] seconds, got {window_s!r}")
    address = rpc_util.parse_address(dispatcher_address)
    token = auth.client_token(address, auth_token)
    channel = rpc_util.make_channel(address)
    uses_tls = rpc_util.channel_uses_tls(address)
    auth.warn_if_sent_in_clear(address, token, uses_tls)
    request = pb.GetClusterStatusRequest(window_ms=max(1, round(window_s * 1000)))
    metadata = rpc_util.call_metadata(token)
    timeout_ms = max(1, round(timeout_s * 1000))
    try:
        stub = service_pb2_grpc.DispatcherServiceStub(channel)

        def ask(attempt_s: float) -> Any:
            return stub.GetClusterStatus(request, timeout=attempt_s, metadata=metadata)

        # Retried (a dispatcher still starting answers within the bound), and a
        # TLS mismatch or a server of another protocol is named at the first try.
        try:
            response = rpc_util.call_with_retries(
                ask,
                address=address,
                what="status",
                timeout_ms=timeout_ms,
                attempt_timeout_s=timeout_s,
                unreachable_ms=timeout_ms,
            )
        except errors.UnauthenticatedError:
            raise errors.UnauthenticatedError(
                auth.refused_message(address, "status") + ("" if token else " (no token was sent)")
            ) from None
    finally:
        channel.close()
    status = to_dict(response)
    status["dispatcher"] = address
    status["verdicts"] = verdicts(status["jobs"], response.window_s)
    return status


def to_dict(response: Any) -> dict[str, Any]:
    """A `GetClusterStatusResponse` as plain dicts (unknown values: None)."""

    def known(x: float) -> float | None:
        return None if x < 0 else x

    workers = [
        {
            "address": w.address,
            "host": w.host_id,
            "pid": w.pid or None,
            "state": w.state,
            "tasks": w.tasks,
            "elements_per_s": w.elements_per_s,
            "bytes_per_s": w.bytes_per_s,
            "idle_fraction": known(w.idle_fraction),
            "last_heartbeat_s": w.since_heartbeat_s,
            "elements_produced": w.elements_produced,
            "bytes_sent": w.bytes_sent,
            "pipeline_s": w.pipeline_s,
            "buffered_elements": w.buffered_elements,
        }
        for w in response.workers
    ]
    jobs = []
    for j in response.jobs:
        name = j.job_name or f"job-{j.job_id}"
        consumers = [
            {
                "consumer": _consumer_name(c),
                "iteration_client_id": c.iteration_client_id,
                "iteration_id": c.iteration_id,
                "repetition": c.repetition,
                "host": c.host,
                "pid": c.pid or None,
                "consumer_index": c.consumer_index if c.consumer_index >= 0 else None,
                "elements": c.elements,
                "elements_per_s": c.elements_per_s,
                "wait_fraction": known(c.wait_fraction),
                "window_s": c.window_s,
                "last_heartbeat_s": c.since_heartbeat_s,
            }
            for c in j.consumers
        ]
        names = [c["consumer"] for c in consumers]
        for c in consumers:  # two iterators of one process: tell them apart
            if names.count(c["consumer"]) > 1:
                c["consumer"] += f"#{c['iteration_client_id']}"
        jobs.append(
            {
                "job": name,
                "job_id": j.job_id,
                "job_name": j.job_name,
                "mode": j.processing_mode,
                "num_consumers": j.num_consumers or None,
                "consumers": consumers,
                "elements_per_s": j.elements_per_s,
            }
        )
    return {"window_s": response.window_s, "workers": workers, "jobs": jobs}


def _consumer_name(c: Any) -> str:
    """ "host/pid" (with "/c<index>" for a coordinated read), or the iteration
    client id of a consumer that sent no counters yet."""
    if not c.pid:
        return f"client-{c.iteration_client_id}"
    name = f"{_host(c.host)}/{c.pid}"
    return name + (f"/c{c.consumer_index}" if c.consumer_index >= 0 else "")


def verdicts(jobs: list[dict[str, Any]], window_s: float) -> list[dict[str, Any]]:
    """One verdict per job (see the module docstring): {"job", "verdict",
    "wait_fraction" (mean over its consumers, None if unknown), "consumer" (the
    straggler's name, else None), "message"}."""
    out = []
    for job in jobs:
        name = job["job"]
        fractions = [
            (c["wait_fraction"], c["consumer"])
            for c in job["consumers"]
            if c["wait_fraction"] is not None
        ]
        verdict: dict[str, Any] = {
            "job": name,
            "verdict": "unknown",
            "wait_fraction": None,
            "consumer": None,
        }
        out.append(verdict)
        if not job["consumers"]:
            verdict["verdict"] = "idle"
            verdict["message"] = f"{name}: idle: no consumer attached"
            continue
        if not fractions:
            verdict["message"] = (
                f"{name}: unknown: no consumer has read across two heartbeats yet; ask again"
            )
            continue
        mean = statistics.fmean(f for f, _ in fractions)
        verdict["wait_fraction"] = mean
        span = max((c["window_s"] for c in job["consumers"]), default=0.0) or window_s
        ranked = sorted(fractions, reverse=True)
        if len(ranked) >= 2:
            (worst, who), (second, _) = ranked[0], ranked[1]
            if worst >= STRAGGLER_MIN_WAIT_FRACTION and worst - second >= STRAGGLER_GAP:
                others = statistics.fmean(f for f, _ in ranked[1:])
                verdict.update(
                    verdict="straggler",
                    consumer=who,
                    message=(
                        f"{name}: straggler: consumer {who} waited {worst:.0%} of the last "
                        f"{span:.0f} s, the others {others:.0%} on average: look at its "
                        "host, its network link and the workers it reads"
                    ),
                )
                continue
        if mean >= INPUT_BOUND_WAIT_FRACTION:
            verdict.update(
                verdict="input-bound",
                message=(
                    f"{name}: input-bound: trainers waited {mean:.0%} of the last {span:.0f} s: "
                    "add workers or cheapen the pipeline"
                ),
            )
        else:
            verdict.update(
                verdict="trainer-bound",
                message=(
                    f"{name}: trainer-bound: trainers waited {mean:.0%} of the last "
                    f"{span:.0f} s: the input keeps up; the training step limits this job"
                ),
            )
    return out


# ---------------------------------------------------------------- rendering
def _rate(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.1f} {prefix}{unit}/s"
    return f"{x:.1f} {unit}/s" if unit else f"{x:.1f}/s"


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{x:.0%}"


def _host(host: str) -> str:
    """A host id ("boot/hostname/netns") as its host name."""
    parts = host.split("/")
    return parts[1] if len(parts) >= 3 else host


def _worker_rows(status: dict[str, Any]) -> list[list[str]]:
    return [
        [
            w["address"],
            _host(w["host"]),
            w["state"],
            str(w["tasks"]),
            _rate(w["elements_per_s"]),
            _rate(w["bytes_per_s"], "B"),
            _pct(w["idle_fraction"]),
            f"{w['last_heartbeat_s']:.1f} s ago",
        ]
        for w in status["workers"]
    ]


WORKER_COLUMNS = ["worker", "host", "state", "tasks", "produced", "sent", "idle", "heartbeat"]
JOB_COLUMNS = ["job", "mode", "consumers", "elements", "wait per consumer"]


def _job_rows(status: dict[str, Any]) -> list[list[str]]:
    rows = []
    for j in status["jobs"]:
        waits = ", ".join(f"{c['consumer']} {_pct(c['wait_fraction'])}" for c in j["consumers"])
        rows.append(
            [j["job"], j["mode"], str(len(j["consumers"])), _rate(j["elements_per_s"]), waits]
        )
    return rows


def _table(columns: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)
    ]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    for r in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def render_text(status: dict[str, Any]) -> str:
    """The status as plain text: workers, jobs, then one verdict line per job."""
    parts = [
        f"dispatcher {status['dispatcher']}: {len(status['workers'])} workers, "
        f"{len(status['jobs'])} jobs; rates over the last {status['window_s']:g} s",
        "",
        _table(WORKER_COLUMNS, _worker_rows(status)) if status["workers"] else "no workers",
        "",
        _table(JOB_COLUMNS, _job_rows(status)) if status["jobs"] else "no jobs",
    ]
    if status["verdicts"]:
        parts.append("")
        parts.extend(v["message"] for v in status["verdicts"])
    return "\n".join(parts)


def render_rich(status: dict[str, Any]) -> Any:
    """The status as a rich renderable (rich must be importable)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    header = Text(
        f"dispatcher {status['dispatcher']}: {len(status['workers'])} workers, "
        f"{len(status['jobs'])} jobs; rates over the last {status['window_s']:g} s",
        style="bold",
    )
    workers = Table(*WORKER_COLUMNS, title="workers", title_justify="left")
    for row in _worker_rows(status):
        workers.add_row(*row)
    jobs = Table(*JOB_COLUMNS, title="jobs", title_justify="left")
    for row in _job_rows(status):
        jobs.add_row(*row)
    styles = {"input-bound": "red", "straggler": "yellow", "trainer-bound": "green"}
    lines = [Text(v["message"], style=styles.get(v["verdict"], "")) for v in status["verdicts"]]
    return Group(header, workers, jobs, *lines)
