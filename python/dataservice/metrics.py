"""Prometheus metrics of the dispatcher and the workers, and the counters behind them.

A server given `metrics_port` (`DispatcherConfig` / `WorkerConfig`; 0 picks a free
port, None, the default, serves none) serves, on its own host (`host`, 127.0.0.1
unless told otherwise):

    /metrics   the Prometheus text format (prometheus-client's `generate_latest`)
    /healthz   200 "ok" while the server runs (a liveness probe)
    /readyz    200 "ready" once it serves (a worker: once the dispatcher
               registered it), else 503 and why (a readiness probe)

A server with an auth token serves /metrics only to a request that carries it
(`Authorization: Bearer <token>`, Prometheus's `authorization` scrape setting;
401 otherwise, refusals logged and counted as the RPCs'), and tells why it is
not ready only to such a request: the metrics name jobs, consumer hosts and
worker addresses. /healthz and /readyz's status codes stay open to probes
without it (Kubernetes's httpGet probes send no token), and say nothing else.
A server with a TLS certificate serves HTTPS from the same files, so the token
does not cross the network in clear; with a client CA (mutual TLS), /metrics
also needs a client certificate that CA signed (403 without one), while
/healthz and /readyz answer a probe that presents none (Kubernetes's
`scheme: HTTPS` probes do not).

Each server has its own `CollectorRegistry` (several servers share one process in
tests and in `LocalCluster`-less deployments), never prometheus-client's global
one. Names start with `dataservice_` and follow Prometheus's conventions
(`_total` counters, seconds, bytes); see README "Watching it run" for the list.

The counters a worker and a consumer keep are also sent in their heartbeats
(`WorkerCounters`, `ConsumerCounters` in service.proto): the dispatcher keeps a
short history of them (`CounterHistory`) for `dataservice status`'s rates, and
exports the consumers' as `dataservice_consumer_*`.

Source: the metric names follow the Prometheus naming guide
(https://prometheus.io/docs/practices/naming/).
"""

from __future__ import annotations

import collections
import http.server
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from dataservice import auth

log = logging.getLogger(__name__)

PREFIX = "dataservice_"
_REQUEST_TIMEOUT_S = 10.0  # an HTTPS scrape's socket: a stalled peer lets go of its thread

HISTORY_S = 600.0
"""How far back a `CounterHistory` keeps samples: the longest status window."""

_MIN_SAMPLE_SPACING_S = 0.2
"""Samples closer than this to the previous one replace it (fast heartbeats)."""


# ---------------------------------------------------------------- history and rates
class CounterHistory:
    """Timed samples of a few cumulative counters, for rates over a recent window.
    Thread-compatible (the dispatcher holds its lock)."""

    def __init__(self, max_age_s: float = HISTORY_S) -> None:
        self._max_age_s = max_age_s
        self._samples: collections.deque[tuple[float, tuple[float, ...]]] = collections.deque()

    def add(self, now: float, values: tuple[float, ...]) -> None:
        """Records `values` (cumulative counters) at `now` (time.monotonic())."""
        samples = self._samples
        if len(samples) >= 2 and now - samples[-2][0] < _MIN_SAMPLE_SPACING_S:
            samples[-1] = (now, values)
        else:
            samples.append((now, values))
        while samples and now - samples[0][0] > self._max_age_s:
            samples.popleft()

    def latest(self) -> tuple[float, tuple[float, ...]] | None:
        return self._samples[-1] if self._samples else None

    def deltas(self, window_s: float) -> tuple[float, tuple[float, ...]] | None:
        """(seconds covered, per-counter increase) from the oldest sample within
        `window_s` seconds of the newest to the newest; None with fewer than two
        such samples. A counter that went down (its process restarted) counts
        from 0."""
        samples = self._samples
        if len(samples) < 2:
            return None
        t1, v1 = samples[-1]
        first = None
        for t, v in samples:
            if t1 - t <= window_s:
                first = (t, v)
                break
        if first is None or first[0] >= t1:
            return None
        t0, v0 = first
        return t1 - t0, tuple(b - a if b >= a else b for a, b in zip(v0, v1, strict=True))


class ActivityClock:
    """Wall time during which no producer was busy: a worker's idle seconds.
    Producers call `busy()` when they start computing and `idle()` when they stop
    (blocked on a full buffer, or done). Thread-safe."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._busy = 0
        self._idle_s = 0.0
        self._idle_since: float | None = time.monotonic()

    def busy(self) -> None:
        with self._mu:
            if self._busy == 0 and self._idle_since is not None:
                self._idle_s += time.monotonic() - self._idle_since
                self._idle_since = None
            self._busy += 1

    def idle(self) -> None:
        with self._mu:
            if self._busy == 0:
                return  # unbalanced: already idle
            self._busy -= 1
            if self._busy == 0:
                self._idle_since = time.monotonic()

    def idle_s(self) -> float:
        """Idle seconds so far, the current stretch included."""
        with self._mu:
            extra = 0.0 if self._idle_since is None else time.monotonic() - self._idle_since
            return self._idle_s + extra


class PipelineCpu:
    """CPU seconds spent in pipelines: the task producer threads report their own
    (`add`, exact), and the pipelines' background threads (parallel `map`,
    prefetch, interleave: the only threads named "dataservice-*", data/runtime.py)
    are read from each thread's own CPU clock when sampled; a thread that ended
    between two samples keeps its last sampled time. Thread-safe.

    A sample costs one clock read per helper thread, not a read of /proc for every
    thread of the process: a worker holding many idle tasks (named jobs wait
    `job_gc_timeout_ms` for their consumers) has a thread per task, and psutil's
    per-thread /proc read took ~4 ms at 118 threads, with the GIL held, on every
    heartbeat."""

    _THREAD_PREFIX = "dataservice-"

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._producers_s = 0.0
        self._helpers_seen: dict[int, float] = {}  # native thread id -> CPU s last sampled
        self._helpers_ended_s = 0.0

    def add(self, cpu_s: float) -> None:
        with self._mu:
            self._producers_s += cpu_s

    def total_s(self) -> float:
        now_s: dict[int, float] = {}
        for t in threading.enumerate():
            tid = t.native_id
            if tid is None or not t.name.startswith(self._THREAD_PREFIX):
                continue
            cpu_s = thread_cpu_s(tid)
            if cpu_s is not None:
                now_s[tid] = cpu_s
        with self._mu:
            for tid, seen in self._helpers_seen.items():
                if tid not in now_s:
                    self._helpers_ended_s += seen
            self._helpers_seen = now_s
            return self._producers_s + self._helpers_ended_s + sum(now_s.values())


def thread_cpu_s(native_id: int) -> float | None:
    """CPU seconds (user + system) of this process's thread `native_id` (its Linux
    thread id, `threading.Thread.native_id`), or None when it has ended, belongs
    to another process, or the platform has no per-thread clock by thread id.

    Reads the kernel's per-thread CPU clock, whose id Linux derives from the
    thread id (`MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)` in the kernel's
    posix-timers.h: `(~tid << 3) | 4 | 2`); the kernel checks that the thread is
    in this process and answers EINVAL otherwise, so an ended thread's reused id
    cannot name another process's thread. (`time.pthread_getcpuclockid` takes a
    pthread handle instead, which is not safe to use once its thread ended.)"""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return time.clock_gettime((~native_id << 3) | 6)
    except OSError:
        return None


class WorkerCounters:
    """A worker process's counters (`dataservice_*` of the worker, and the
    `WorkerCounters` of its heartbeats). Thread-safe."""

    TRANSPORTS = ("grpc", "shm")

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self.elements_produced = 0
        self.elements_sent: dict[str, int] = dict.fromkeys(self.TRANSPORTS, 0)
        self.bytes_sent: dict[str, int] = dict.fromkeys(self.TRANSPORTS, 0)
        self.auth_refusals = 0
        self.activity = ActivityClock()
        self.pipeline_cpu = PipelineCpu()

    def refused(self) -> None:
        """An RPC refused for its auth token."""
        with self._mu:
            self.auth_refusals += 1

    def to_proto(self, buffered_elements: int) -> Any:
        """The `WorkerCounters` message of a heartbeat."""
        from dataservice.rpc import service_pb2 as pb

        snap = self.snapshot()
        return pb.WorkerCounters(
            elements_produced=snap["elements_produced"],
            bytes_sent=sum(snap["bytes_sent"].values()),
            pipeline_s=self.pipeline_cpu.total_s(),
            idle_s=self.activity.idle_s(),
            buffered_elements=buffered_elements,
        )

    def produced(self, n: int) -> None:
        with self._mu:
            self.elements_produced += n

    def sent(self, transport: str, elements: int, nbytes: int) -> None:
        """`elements` encoded elements of `nbytes` bytes left over `transport`."""
        with self._mu:
            self.elements_sent[transport] = self.elements_sent.get(transport, 0) + elements
            self.bytes_sent[transport] = self.bytes_sent.get(transport, 0) + nbytes

    def snapshot(self) -> dict[str, Any]:
        with self._mu:
            return {
                "elements_produced": self.elements_produced,
                "elements_sent": dict(self.elements_sent),
                "bytes_sent": dict(self.bytes_sent),
                "auth_refusals": self.auth_refusals,
            }


# ---------------------------------------------------------------- the HTTP endpoint
class _Handler(http.server.BaseHTTPRequestHandler):
    server: _HttpServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

                if not self._has_client_certificate():
                    self._refuse_no_certificate()
                    return
                if not self._authorized():
                    self._refuse()
                    return
                self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._send(200, b"ok\n")
            elif path == "/readyz":
                why = self.server.not_ready()
                if why is None:
                    self._send(200, b"ready\n")
                elif self._authorized():
                    self._send(503, f"not ready: {why}\n".encode())
                else:
                    self._send(503, b"not ready\n")
            else:
                self._send(404, b"not found: try /metrics, /healthz or /readyz\n")
        except Exception as err:  # a failing collector must not kill the endpoint
            log.exception("metrics endpoint: %s failed", path)
            self._send(500, f"{type(err).__name__}: {err}\n".encode())

    def _authorized(self) -> bool:
        token = self.server.token
        return token is None or auth.bearer_ok(self.headers.get("Authorization"), token)

    def _has_client_certificate(self) -> bool:
        context = self.server.ssl_context
        if context is None or context.verify_mode == ssl.CERT_NONE:
            return True
        # The handshake verified any certificate presented against the client CA.
        return bool(getattr(self.connection, "getpeercert", lambda: None)())

    def _refuse_no_certificate(self) -> None:
        peer = self.client_address[0] if self.client_address else "unknown"
        self.server.refusals.refused(str(peer), "/metrics without a client certificate")
        if self.server.on_refused is not None:
            self.server.on_refused()
        self._send(
            403,
            b"forbidden: this server uses mutual TLS; present a client certificate its "
            b"client CA signed (Prometheus: tls_config.cert_file and key_file)\n",
        )

    def _refuse(self) -> None:
        peer = self.client_address[0] if self.client_address else "unknown"
        self.server.refusals.refused(str(peer), "/metrics without the auth token")
        if self.server.on_refused is not None:
            self.server.on_refused()
        self._send(
            401,
            b"unauthorized: send the servers' auth token as 'Authorization: Bearer TOKEN' "
            b"(Prometheus: authorization.credentials_file)\n",
            headers={"WWW-Authenticate": 'Bearer realm="dataservice"'},
        )

    def _send(
        self,
        code: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("metrics endpoint: " + format, *args)


class _HttpServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    registry: Any
    not_ready: Callable[[], str | None]
    token: str | None
    refusals: auth.RefusalLog
    on_refused: Callable[[], None] | None
    ssl_context: ssl.SSLContext | None

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, peer = super().get_request()
        if self.ssl_context is not None:
            # The handshake runs on the request's own thread (its first read), so
            # a client that never completes it holds up nobody else.
            conn = self.ssl_context.wrap_socket(
                conn, server_side=True, do_handshake_on_connect=False
            )
            conn.settimeout(_REQUEST_TIMEOUT_S)
        return conn, peer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A failed TLS handshake or a peer gone mid-request: not worth a traceback.
        log.debug("metrics endpoint: request from %s failed", client_address, exc_info=True)


class MetricsEndpoint:
    """Serves `registry` at http://host:port/metrics (plus /healthz, /readyz) on a
    daemon thread. Thread-safe.

    Args:
        registry: A prometheus_client `CollectorRegistry` (the server's own).
        host: Interface to bind (the server's `host`).
        port: TCP port; 0 picks a free one (read it back from `.port`).
        kind: "dispatcher" or "worker", for errors and logs.
        not_ready: Returns why the server is not ready (None: ready), for /readyz.
        token: The server's auth token (None: none); /metrics then requires it
            (see the module docstring).
        ssl_context: Serve HTTPS with it (`tls.metrics_ssl_context`); None: HTTP.
        on_refused: Called once per request refused for its token (the
            server's `auth_refusals` counter).

    Raises:
        UnavailableError: The port cannot be bound; names host and port.
    """

    def __init__(
        self,
        registry: Any,
        host: str,
        port: int,
        kind: str,
        not_ready: Callable[[], str | None] = lambda: None,
        *,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        from dataservice import errors

        bind_host = "" if host in ("0.0.0.0", "") else host.strip("[]")
        cls = type(
            "_Bound",
            (_HttpServer,),
            {"address_family": socket.AF_INET6 if ":" in bind_host else socket.AF_INET},
        )
        try:
            self._httpd = cls((bind_host, port), _Handler)
        except OSError as err:
            raise errors.UnavailableError(
                f"{kind} cannot bind its metrics port {host}:{port}: {err}"
            ) from err
        self._httpd.registry = registry
        self._httpd.not_ready = not_ready
        self._httpd.token = token
        self._httpd.refusals = auth.RefusalLog(f"{kind} metrics endpoint")
        self._httpd.on_refused = on_refused
        self._httpd.ssl_context = ssl_context
        self.port: int = self._httpd.server_address[1]
        self.host = host
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=f"ds-{kind}-metrics",
            daemon=True,
        )
        self._thread.start()
        scheme = "https" if ssl_context is not None else "http"
        log.info(
            "%s serves metrics on %s://%s:%d/metrics%s",
            kind,
            scheme,
            host,
            self.port,
            " (auth token required)" if token is not None else "",
        )

    def stop(self) -> None:
        """Stops serving and closes the socket (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=2)
        self._httpd.server_close()


def new_registry() -> Any:
    """A `CollectorRegistry` of one server's own (never the global one)."""
    from prometheus_client import CollectorRegistry

    return CollectorRegistry(auto_describe=False)


class FunctionCollector:
    """A prometheus_client collector whose families come from a function, called
    at each scrape (values read from the server's state then)."""

    def __init__(self, collect: Callable[[], Iterable[Any]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Any]:
        return self._collect()


# ---------------------------------------------------------------- per-server metrics
class WorkerMetrics:
    """The worker's registry: its counters (`WorkerCounters`) and task buffers,
    read at each scrape.

    Args:
        counters: The worker's counters.
        buffered_elements: Returns the elements in its tasks' buffers now.
        num_tasks: Returns the number of tasks it runs now.
    """

    def __init__(
        self,
        counters: WorkerCounters,
        buffered_elements: Callable[[], int],
        num_tasks: Callable[[], int],
    ) -> None:
        self.registry = new_registry()
        self._counters = counters
        self._buffered = buffered_elements
        self._num_tasks = num_tasks
        self.registry.register(FunctionCollector(self._families))

    def _families(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self._counters.snapshot()
        c = CounterMetricFamily(
            PREFIX + "elements_produced",
            "Elements the worker's task pipelines produced.",
        )
        c.add_metric([], snap["elements_produced"])
        yield c
        c = CounterMetricFamily(
            PREFIX + "elements_sent",
            "Elements sent to consumers, by transport (shm: shared memory on this host).",
            labels=["transport"],
        )
        for transport, n in snap["elements_sent"].items():
            c.add_metric([transport], n)
        yield c
        c = CounterMetricFamily(
            PREFIX + "bytes_sent",
            "Encoded element bytes sent to consumers, by transport.",
            labels=["transport"],
        )
        for transport, n in snap["bytes_sent"].items():
            c.add_metric([transport], n)
        yield c
        g = GaugeMetricFamily(
            PREFIX + "task_buffer_elements",
            "Elements produced and waiting in the worker's task buffers.",
        )
        g.add_metric([], self._buffered())
        yield g
        g = GaugeMetricFamily(PREFIX + "worker_tasks", "Tasks the worker runs.")
        g.add_metric([], self._num_tasks())
        yield g
        c = CounterMetricFamily(
            PREFIX + "pipeline_seconds",
            "CPU seconds spent in the user's pipelines (task threads and their "
            "parallel map / prefetch threads).",
        )
        c.add_metric([], self._counters.pipeline_cpu.total_s())
        yield c
        c = CounterMetricFamily(
            PREFIX + "worker_idle_seconds",
            "Wall seconds during which no task pipeline of the worker was producing "
            "(no task, or every buffer full).",
        )
        c.add_metric([], self._counters.activity.idle_s())
        yield c
        c = CounterMetricFamily(
            PREFIX + "auth_refusals",
            "RPCs refused for a missing or wrong auth token.",
        )
        c.add_metric([], snap["auth_refusals"])
        yield c


class DispatcherMetrics:
    """The dispatcher's own metrics: RPC latency, auth refusals and splits handed
    out (updated as they happen), and gauges of its state read at each scrape
    (`collect_state`, the dispatcher's, which takes its lock).

    Args:
        collect_state: Yields the metric families of the dispatcher's state.
    """

    def __init__(self, collect_state: Callable[[], Iterable[Any]]) -> None:
        from prometheus_client import Counter, Histogram

        self.registry = new_registry()
        self.rpc_seconds = Histogram(
            PREFIX + "rpc_seconds",
            "Seconds the dispatcher took to answer an RPC, by method.",
            ["method"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )
        self.auth_refusals = Counter(
            PREFIX + "auth_refusals",
            "RPCs refused for a missing or wrong auth token.",
            registry=self.registry,
        )
        self.splits_handed_out = Counter(
            PREFIX + "splits_handed_out",
            "DYNAMIC splits handed out to workers.",
            registry=self.registry,
        )
        self.registry.register(FunctionCollector(collect_state))
