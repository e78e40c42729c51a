"""The `dataservice` command: `dispatcher`, `worker` and `demo`.

```
dataservice dispatcher --port 5050 [--work-dir DIR --fault-tolerant] [--auth-token-file PATH]
dataservice worker --dispatcher HOST:5050 [--port 0] [--worker-address HOST:PORT]
    [--auth-token-file PATH] [--host HOST [--insecure]] [--shm-allowed-uids UID,...]
dataservice demo [--workers 2 --epochs 2 --json]
dataservice status --dispatcher HOST:5050 [--watch] [--json] [--window-s 60]
dataservice --version
```

`python -m dataservice ...` is the same program. Every `DispatcherConfig` /
`WorkerConfig` field has a flag of the same name in kebab-case, built from
`config_fields()`, so a new config field gets its flag without touching this
file. Only flags given on the command line reach the config; the others keep
the config's defaults.

The server subcommands print one line when they serve, e.g.
`dataservice dispatcher listening on 127.0.0.1:5050` (flushed; `LocalCluster`
reads the address from it; with `--host 0.0.0.0` the dispatcher names this
host's name or primary IP and adds `(on all interfaces, 0.0.0.0)`), then
block. A worker also prints `dataservice worker handed out its first element`
once, before that element leaves it
(`LocalCluster`'s sign that a restarted worker made progress). Both lines, and
the patterns that read them, are `dataservice._serverproc`'s. SIGTERM or
SIGINT stops the server (in-flight RPCs finish) and exits 0; a second signal
exits at once. With the hidden `--parent-pid PID` the server also stops when
that process dies.

Auth (SECURITY.md): a server's token comes from `--auth-token-file PATH`,
`--auth-token TOKEN` (shows in `ps`: warned of) or DATASERVICE_AUTH_TOKEN.
Without one the server warns at start-up that anyone who can reach its port
can run code, and refuses a `--host` beyond loopback unless `--insecure`.

Exit codes: 0 stopped by a signal, 1 a server error (e.g. the dispatcher was
unreachable for `--dispatcher-timeout-ms`, or refused the worker's token: no
ready line then), 2 bad flags (argparse's message; also a bind beyond
loopback without a token or `--insecure`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from dataservice import _proc, _serverproc
from dataservice.config import DispatcherConfig, WorkerConfig, config_fields

logger = logging.getLogger("dataservice.cli")

PROG = "dataservice"

STOP_TIMEOUT_S = 10.0
"""After SIGTERM/SIGINT, how long `server.stop()` plus interpreter exit may take
before the process exits anyway (code 1)."""

ORPHAN_STOP_TIMEOUT_S = 3.0
"""The same bound when the parent died (CASES C-23: orphans gone within 5 s)."""


# Flags besides the field's own kebab-case name.
_FLAG_ALIASES: dict[str, list[str]] = {
    "fault_tolerant_mode": ["--fault-tolerant"],
    "dispatcher_address": ["--dispatcher"],
    "tls_cert_file": ["--tls-cert"],
    "tls_key_file": ["--tls-key"],
    "tls_client_ca_file": ["--tls-client-ca"],
    "tls_ca_file": ["--tls-ca"],
}

_METAVARS = {
    "port": "PORT",
    "work_dir": "DIR",
    "host": "HOST",
    "auth_token": "TOKEN",
    "auth_token_file": "PATH",
    "tls_cert_file": "PEM",
    "tls_key_file": "PEM",
    "tls_client_ca_file": "PEM",
    "tls_ca_file": "PEM",
}


class _Server(Protocol):
    def stop(self) -> None: ...
    def join(self) -> None: ...


def _field_docs(cls: type) -> dict[str, str]:
    """The "Attributes:" section of a Google-style class docstring, by name."""
    docs: dict[str, str] = {}
    lines = (cls.__doc__ or "").splitlines()
    in_attrs, current, indent = False, None, None
    for line in lines:
        stripped = line.strip()
        if stripped == "Attributes:":
            in_attrs = True
            continue
        if not in_attrs:
            continue
        if not stripped:
            current = None
            continue
        this_indent = len(line) - len(line.lstrip())
        if stripped.endswith(":") and " " not in stripped:  # next section ("Raises:")
            if indent is None or this_indent < indent:
                break
        m = re.match(r"^(\w+): (.*)$", stripped)
        if m and (indent is None or this_indent == indent):
            indent = this_indent
            current = m.group(1)
            docs[current] = m.group(2)
        elif current is not None:
            docs[current] += " " + stripped
    return {k: v.replace("%", "%%") for k, v in docs.items()}


def _comma_list(value: str) -> list[str]:
    """A comma-separated list; an explicitly empty value ('') is the empty list,
    which is not the same as leaving the flag out (the config's default, e.g.
    `worker_addresses=None`: no fixed worker list at all)."""
    if not value.strip():
        return []
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError(
            "expected a comma-separated list, e.g. host1:5051,host2:5051 ('' for an empty list)"
        )
    return items


def _int_list(value: str) -> list[int]:
    """A comma-separated list of ints ('' for the empty list)."""
    try:
        return [int(v) for v in _comma_list(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of integers, got {value!r}"
        ) from None


def _add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds a flag per field of config class `cls`; the dest is the field name,
    absent unless given (default SUPPRESS), so the config's default applies."""
    docs = _field_docs(cls)
    for field in config_fields(cls):
        name = field.name
        flags = ["--" + name.replace("_", "-"), *_FLAG_ALIASES.get(name, [])]
        annotation = str(field.type).replace(" ", "")
        kwargs: dict[str, Any] = {"dest": name, "help": docs.get(name)}
        required = field.default is dataclasses.MISSING and (
            field.default_factory is dataclasses.MISSING
        )
        if required:
            kwargs["required"] = True
        else:
            kwargs["default"] = argparse.SUPPRESS
        base = annotation.removesuffix("|None").removeprefix("None|")
        if base == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif base == "int":
            kwargs["type"] = int
            kwargs["metavar"] = _METAVARS.get(
                name,
                "MS" if name.endswith("_ms") else "BYTES" if name.endswith("_bytes") else "N",
            )
        elif base == "list[int]":
            kwargs["type"] = _int_list
            kwargs["metavar"] = "N,M,..."
        elif base in ("list[str]", "Sequence[str]", "tuple[str,...]"):
            kwargs["type"] = _comma_list
            kwargs["metavar"] = "A,B,..."
            kwargs["help"] = (kwargs["help"] or "") + " An empty value ('') is an empty list."
        else:  # str and anything else: passed through as a string
            kwargs["metavar"] = _METAVARS.get(
                name, "HOST:PORT" if name.endswith("_address") else "STR"
            )
        parser.add_argument(*flags, **kwargs)


def _add_process_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level on stderr (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the `dataservice` command and its subcommands."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="A data service for ML training: dispatcher and worker processes "
        "run input pipelines and stream numpy elements to trainers.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(
        dest="command", metavar="{dispatcher,worker,demo,status}", required=True
    )

    p = sub.add_parser(
        "dispatcher",
        help="run a dispatcher (tracks workers, jobs and splits)",
        description="Run a dispatcher. Prints 'dataservice dispatcher listening on HOST:PORT' "
        "when it serves; SIGTERM/SIGINT stop it.",
    )
    _add_config_flags(p, DispatcherConfig)
    _add_process_flags(p)
    p.set_defaults(subparser=p)

    p = sub.add_parser(
        "worker",
        help="run a worker (runs pipelines, serves elements)",
        description="Run a worker registered with a dispatcher. Prints "
        "'dataservice worker listening on HOST:PORT' when it serves; SIGTERM/SIGINT stop it.",
    )
    _add_config_flags(p, WorkerConfig)
    _add_process_flags(p)
    # LocalCluster restarts a worker that exited without handing out an element
    # with this: task pipelines start at a consumer's first request.
    p.add_argument("--lazy-tasks", action="store_true", help=argparse.SUPPRESS)
    # LocalCluster's autoscaler starts the workers it adds with this (WorkerServer).
    p.add_argument("--join-running-dynamic-only", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(subparser=p)

    from dataservice import demo  # light: heavy imports happen in demo.run

    p = sub.add_parser(
        "demo",
        help="the main job: an ImageNet-style pipeline feeding a training loop on a local cluster",
        description=demo.__doc__.split("\n\n")[0] if demo.__doc__ else None,
    )
    demo.add_arguments(p)
    p.set_defaults(subparser=p)

    p = sub.add_parser(
        "status",
        help="workers, jobs, consumers and what limits each job (input-bound, ...)",
        description="Show the dispatcher's workers and jobs with their rates over the last "
        "--window-s seconds, and one verdict per job: input-bound (its trainers wait for "
        "elements), trainer-bound, or straggler (one consumer waits far more than the "
        "others). Sends the auth token of --auth-token-file or DATASERVICE_AUTH_TOKEN.",
    )
    p.add_argument("--dispatcher", required=True, metavar="HOST:PORT", help="the dispatcher")
    p.add_argument(
        "--window-s",
        type=float,
        default=60.0,
        metavar="S",
        help="rates and verdicts cover the last S seconds (default %(default)s; at most 600 "
        "are kept)",
    )
    p.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C")
    p.add_argument(
        "--interval-s", type=float, default=2.0, metavar="S", help="--watch: refresh every S s"
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object: workers, jobs, verdicts"
    )
    p.add_argument("--auth-token-file", metavar="PATH", help="a file holding the auth token")
    p.add_argument(
        "--timeout-s", type=float, default=10.0, metavar="S", help="RPC timeout (default 10)"
    )
    p.set_defaults(subparser=p)
    return parser


def _version() -> str:
    """The installed distribution's version (importlib.metadata)."""
    from importlib import metadata

    try:
        return metadata.version("dataservice")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _run_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`dataservice status`: exit 0, or 1 with one line on stderr (refused,
    unreachable); 2 for bad flags."""
    import json
    import time

    from dataservice import auth, errors, status

    if not 0 < args.window_s <= 24 * 3600:
        parser.error(f"--window-s must be in (0, 86400], got {args.window_s}")
    if args.watch and not args.interval_s > 0:
        parser.error(f"--interval-s must be positive, got {args.interval_s}")
    if not 0 < args.timeout_s <= 24 * 3600:
        # 0 would fail every RPC at once, reported as an unreachable dispatcher.
        parser.error(f"--timeout-s must be in (0, 86400], got {args.timeout_s}")
    try:
        token = auth.resolve_token(None, args.auth_token_file) if args.auth_token_file else None
    except ValueError as e:
        parser.error(str(e))

    def fetch() -> dict[str, Any]:
        return status.fetch_status(args.dispatcher, args.window_s, token, args.timeout_s)

    try:
        if not args.watch:
            result = fetch()
            if args.json:
                print(json.dumps(result), flush=True)
            else:
                print(status.render_text(result), flush=True)
            return 0
        try:
            from rich.live import Live
        except ImportError:
            while True:  # plain ANSI: home the cursor, clear the screen, draw
                text = json.dumps(fetch()) if args.json else status.render_text(fetch())
                sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
                sys.stdout.flush()
                time.sleep(args.interval_s)
        with Live(status.render_rich(fetch()), auto_refresh=False) as live:
            while True:
                time.sleep(args.interval_s)
                live.update(status.render_rich(fetch()), refresh=True)
    except KeyboardInterrupt:
        return 0
    except (errors.DataServiceError, ValueError) as e:
        print(f"{PROG} status: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


def _config_kwargs(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in config_fields(cls) if hasattr(args, f.name)}


class _Stop(BaseException):
    """Raised by the signal handler while the server is still starting."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# A server process runs several Python threads at once (a task's pipeline, the threads
# answering requests, heartbeats): one waiting for the GIL behind a busy pipeline thread
# waits up to the switch interval. CPython's 5 ms put ~3-6 ms on a new iterator's first
# element over gRPC (bench/first_element.py); 1 ms changed no throughput figure of
# bench/transport.py or bench/many_leaves.py. Not set in a user's own process.
SERVER_SWITCH_INTERVAL_S = 0.001


def _serve(
    kind: str,
    make_server: Callable[[], tuple[_Server, str]],
    parent_pid: int | None,
    bound_host: str | None = None,
) -> int:
    """Starts a server, prints the ready line, blocks until a signal, the
    parent's death or the server's end, then stops it in bounded time."""
    stop = threading.Event()
    started = False
    watchdog = _proc.ExitWatchdog()
    orphaned = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if not started:
            raise _Stop(signum)
        if stop.is_set():  # a second signal: no more waiting
            os._exit(1)
        stop.set()

    def on_parent_death() -> None:
        orphaned.set()
        watchdog.arm(ORPHAN_STOP_TIMEOUT_S, code=1)
        try:  # nobody reads our pipes any more: don't die of EPIPE on the way out
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            os.close(devnull)
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if parent_pid is not None:
        _proc.ParentWatch(parent_pid, on_parent_death).start()
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL_S)

    try:
        server, address = make_server()
        started = True
    except _Stop as e:
        logger.info("%s: interrupted by signal %d while starting", kind, e.signum)
        watchdog.arm(STOP_TIMEOUT_S, code=128 + e.signum)
        return 128 + e.signum
    _serverproc.announce_ready(kind, address, bound_host, getattr(server, "metrics_port", None))

    ended_by_itself = threading.Event()
    join_error: list[BaseException] = []

    def join_server() -> None:
        try:
            server.join()
        except BaseException as e:  # e.g. a worker that could not register
            join_error.append(e)
        finally:
            ended_by_itself.set()
            stop.set()

    threading.Thread(target=join_server, name=f"{kind}-join", daemon=True).start()
    while not stop.wait(1.0):
        pass

    if ended_by_itself.is_set():
        if join_error:
            err = join_error[0]
            print(f"{PROG} {kind}: error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        else:
            logger.error("%s at %s stopped by itself", kind, address)
        watchdog.arm(STOP_TIMEOUT_S, code=1)
        return 1
    timeout_s = ORPHAN_STOP_TIMEOUT_S if orphaned.is_set() else STOP_TIMEOUT_S
    watchdog.arm(timeout_s, code=1)
    reason = "parent process died" if orphaned.is_set() else "signal"
    logger.info("%s at %s stopping (%s)", kind, address, reason)
    stopper = threading.Thread(target=server.stop, name=f"{kind}-stop", daemon=True)
    stopper.start()
    stopper.join(timeout_s)
    if stopper.is_alive():
        logger.error("%s at %s did not stop within %.0f s; exiting", kind, address, timeout_s)
        return 1
    logger.info("%s at %s stopped", kind, address)
    # Stopped: what remains is interpreter exit. Bound it too, now with success.
    watchdog.arm(2.0, code=0)
    return 0


def _wait_for_dispatcher(address: str, timeout_ms: int, client_tls: Any = None) -> None:
    """Blocks until a TCP/HTTP2 (TLS with `client_tls`) connection to the
    dispatcher is up.

    Raises:
        UnavailableError: Not reachable within `timeout_ms` milliseconds, or
            the TLS handshake failed (at once); the message names the address.
    """
    with _serverproc.DispatcherStub(address, client_tls=client_tls) as dispatcher:
        dispatcher.wait_connected(
            timeout_ms,
            "worker: connecting to the dispatcher (--dispatcher, bounded by "
            "--dispatcher-unreachable-timeout-ms)",
        )


def _check_auth_at_start(kind: str, args: argparse.Namespace, config: Any) -> None:
    """Start-up checks of the token: a bind beyond loopback without one is
    refused (unless --insecure); no token at all, or one given on the command
    line (visible in `ps`), is warned of.

    Raises:
        ValueError: The token file cannot be read, the token is unusable, or
            the bind is refused (argparse then exits 2 with the message).
    """
    from dataservice import auth

    token = auth.resolve_token(config.auth_token, config.auth_token_file)
    refusal = auth.bind_refusal(kind, config.host, token, config.insecure)
    if refusal is not None:  # before a worker waits for its dispatcher
        raise ValueError(refusal)
    _check_tls_at_start(kind, config)
    if token is None:
        auth.warn_no_token(kind, config.host)
    elif getattr(args, "auth_token", None):
        logger.warning(
            "--auth-token puts the token on the command line, where every local user can read "
            "it (ps, /proc/PID/cmdline); use --auth-token-file PATH or %s instead",
            auth.AUTH_ENV,
        )


def _check_tls_at_start(kind: str, config: Any) -> Any:
    """Reads the TLS files of a server's config (errors name the file and
    flag); returns the worker's client settings towards its dispatcher (None:
    plaintext, and for the dispatcher).

    Raises:
        ValueError: As `tls.server_credentials` / `tls.worker_tls`.
    """
    from dataservice import tls

    if kind == "worker":
        return tls.worker_tls(
            config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file, config.tls_ca_file
        )[1]
    tls.server_credentials(
        config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file, kind
    )
    return None


def _run_dispatcher(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = DispatcherConfig(**_config_kwargs(args, DispatcherConfig))
        _check_auth_at_start("dispatcher", args, config)
    except (ValueError, TypeError) as e:
        parser.error(str(e))

    def make() -> tuple[_Server, str]:
        from dataservice.dispatcher.server import DispatchServer

        server = DispatchServer(config, start=True)
        # `target` names "localhost" for a wildcard bind: useless to other hosts.
        address = _serverproc.advertised_address(
            _serverproc.strip_scheme(server.target), config.host
        )
        return server, address

    return _serve("dispatcher", make, args.parent_pid, config.host)


def _run_worker(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = WorkerConfig(**_config_kwargs(args, WorkerConfig))
        _check_auth_at_start("worker", args, config)
    except (ValueError, TypeError) as e:
        parser.error(str(e))

    def make() -> tuple[_Server, str]:
        from dataservice.rpc import util as rpc_util
        from dataservice.worker.server import WorkerServer

        # A dispatcher that never answered is likely a wrong address: fail in
        # seconds (the server's own registration bound), not dispatcher_timeout_ms.
        _wait_for_dispatcher(
            config.dispatcher_address,
            min(
                config.dispatcher_timeout_ms_or_default,
                rpc_util.unreachable_timeout_ms(config.dispatcher_unreachable_timeout_ms),
            ),
            _check_tls_at_start("worker", config),
        )
        server = WorkerServer(
            config,
            start=True,
            lazy_tasks=args.lazy_tasks,
            join_running_dynamic_only=args.join_running_dynamic_only,
            on_first_element=_serverproc.announce_first_element,
        )
        # Ready means registered, where the server can tell us (else the first
        # heartbeat registers it right after start).
        # A worker the dispatcher refused (e.g. a wrong auth token) is not ready:
        # no ready line, exit 1 with the reason.
        wait_registered = getattr(server, "wait_registered", None)
        if callable(wait_registered):
            if not wait_registered(config.dispatcher_timeout_ms_or_default / 1000):
                refused = getattr(server, "registration_error", None)
                if refused is not None:
                    server.stop()
                    raise refused
        return server, server.address

    return _serve("worker", make, args.parent_pid, config.host)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `dataservice` and `python -m dataservice`.

    Returns:
        The exit code (bad flags exit 2 through argparse).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    sub: argparse.ArgumentParser = args.subparser
    if args.command == "demo":
        from dataservice import demo

        return demo.run(args)
    if args.command == "status":
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        return _run_status(args, sub)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s {args.command}[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "dispatcher":
            return _run_dispatcher(args, sub)
        return _run_worker(args, sub)
    except Exception as e:  # a server that failed to start: one clear line
        logger.debug("failed", exc_info=True)
        print(f"{PROG} {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
