"""Saying what a long wait waits for, and logging a repeated warning once.

Every wait that can be long (a consumer waiting for elements, a worker or a
client retrying an unreachable dispatcher, a dispatcher holding iterations
that have consumers but no worker) keeps a `SlowWait`: nothing is logged for
`FIRST_WARNING_S` seconds, then one WARNING naming what is waited for and for
how long, then one every `REPEAT_WARNING_S` seconds while the wait goes on.
The two intervals come from $DATASERVICE_WAIT_WARNING_MS and
$DATASERVICE_WAIT_REPEAT_MS (read at import, so child processes inherit them;
tests set them small), default 10 s and 30 s.

`warn_once` logs a warning the first time its key is seen in this process
and at DEBUG after that (e.g. one "falling back to gRPC" line per worker, not
one per reconnect).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

WAIT_WARNING_ENV = "DATASERVICE_WAIT_WARNING_MS"
WAIT_REPEAT_ENV = "DATASERVICE_WAIT_REPEAT_MS"


def env_ms(name: str, default_ms: int) -> int:
    """$`name` as a positive int of milliseconds, else `default_ms` when unset.

    Raises:
        ValueError: Set but not a positive int (the message names the variable).
    """
    raw = os.environ.get(name)
    if not raw:
        return default_ms
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"${name} must be an int (milliseconds), got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"${name} must be positive (milliseconds), got {raw!r}")
    return value


FIRST_WARNING_S = env_ms(WAIT_WARNING_ENV, 10_000) / 1000
REPEAT_WARNING_S = env_ms(WAIT_REPEAT_ENV, 30_000) / 1000


class SlowWait:
    """One wait that warns when it gets long. Thread-compatible (one waiter).

    Call `check()` from the waiting loop (any rate: it logs at most once per
    interval). The message is `describe()`'s text followed by
    "(waiting N s so far)"; `describe` is called only when a warning is due,
    so it may be costly. `done()` logs, at INFO, how long the wait lasted if
    it warned.

    Args:
        logger: Where the warnings go.
        describe: The text naming what is waited for (which address, job,
            iteration), or a callable returning it.
        start: `time.monotonic()` at which the wait began (default now).
    """

    def __init__(
        self,
        logger: logging.Logger,
        describe: str | Callable[[], str],
        start: float | None = None,
    ) -> None:
        self._logger = logger
        self.describe = describe  # may be replaced while waiting (the latest reason)
        self.start = time.monotonic() if start is None else start
        self._next_warning = self.start + FIRST_WARNING_S
        self.warnings = 0

    def _text(self) -> str:
        return self.describe() if callable(self.describe) else self.describe

    def check(self, now: float | None = None) -> bool:
        """Logs the warning if it is due; returns whether it logged."""
        now = time.monotonic() if now is None else now
        if now < self._next_warning:
            return False
        self._next_warning = now + REPEAT_WARNING_S
        self.warnings += 1
        self._logger.warning("%s (waiting %.0f s so far)", self._text(), now - self.start)
        return True

    def done(self, what: str = "") -> None:
        """The wait is over: says so at INFO if a warning was logged."""
        if self.warnings:
            self._logger.info(
                "%s after %.1f s", what or "no longer waiting", time.monotonic() - self.start
            )
            self.warnings = 0


_ONCE_MU = threading.Lock()
_ONCE_KEYS: OrderedDict[Any, None] = OrderedDict()  # guarded by _ONCE_MU


def _renew_once_mu_after_fork() -> None:
    """A forked child gets a fresh `_ONCE_MU`: a thread of the parent may have held
    it at fork, and no thread here would ever release it."""
    global _ONCE_MU
    _ONCE_MU = threading.Lock()


os.register_at_fork(after_in_child=_renew_once_mu_after_fork)
_ONCE_MAX_KEYS = 4096


def warn_once(logger: logging.Logger, key: Any, msg: str, *args: Any) -> None:
    """`logger.warning(msg, *args)` the first time `key` is seen in this
    process (the last 4096 keys are remembered), `logger.debug` after that."""
    with _ONCE_MU:
        seen = key in _ONCE_KEYS
        if not seen:
            _ONCE_KEYS[key] = None
            while len(_ONCE_KEYS) > _ONCE_MAX_KEYS:
                _ONCE_KEYS.popitem(last=False)
    if seen:
        logger.debug(msg, *args)
    else:
        logger.warning(msg, *args)
