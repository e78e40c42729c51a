"""The thread runtime of pipeline iterators: background threads, a thread pool and
tf.data's interleave order.

Owns every thread a pipeline starts in-process: `BackgroundIterator` (prefetch and
parallel interleave), `ThreadPool`/`parallel_map` (parallel `map`) and `interleave`.
Threads are daemons that hold no reference to the iterator that started them, and
stop within `POLL_S` seconds of that iterator being closed or dropped. It knows
nothing of `Dataset`: the op classes (`ops.py`, `sources.py`) call it with plain
iterators.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

__all__ = [
    "POLL_S",
    "SKIPPED",
    "BackgroundIterator",
    "IterStats",
    "ThreadPool",
    "close_iterator",
    "guard",
    "interleave",
    "parallel_map",
]

POLL_S = 0.05
"""How often a blocked background thread checks whether it was stopped, in seconds."""

Element = Any


def close_iterator(it: object) -> None:
    """Closes an iterator if it can be closed (generators, background iterators)."""
    close = getattr(it, "close", None)
    if close is not None:
        close()


_END = object()

SKIPPED = object()
"""What a `guard`ed function returns for an element whose computation raised."""


class IterStats:
    """Counters of one iterator tree (`IterContext.stats`), which `iter(ds)`'s
    iterator reports in `stats()`. Thread-safe.

    Attributes:
        errors_ignored: Elements skipped by `ignore_errors` because computing them
            raised.
    """

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self.errors_ignored = 0  # guarded by self._mu
        # stats() of data service reads in the tree, oldest first; guarded by self._mu
        self._sources: list[Callable[[], dict[str, Any]]] = []
        # the latest data service read's state_dict; guarded by self._mu
        self._state: Callable[[], dict[str, Any]] | None = None

    def add_error_ignored(self) -> None:
        with self._mu:
            self.errors_ignored += 1

    def add_source(
        self,
        stats: Callable[[], dict[str, Any]],
        state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """Adds the `stats()` of an iterator in the tree that reads from elsewhere (a
        data service read: one per epoch under a `repeat`), and its `state_dict()`."""
        with self._mu:
            self._sources.append(stats)
            if state is not None:
                self._state = state

    def latest_state(self) -> dict[str, Any] | None:
        """The latest data service read's `state_dict()`, or None before it started."""
        with self._mu:
            state = self._state
        return None if state is None else state()

    def as_dict(self) -> dict[str, Any]:
        """`errors_ignored` here plus every source's; the other keys are the latest
        source's (a data service read's `elements`, `workers`, ...)."""
        with self._mu:
            sources = list(self._sources)
            out: dict[str, Any] = {}
            total = self.errors_ignored
        for stats in sources:
            d = dict(stats())
            total += int(d.pop("errors_ignored", 0))
            out.update(d)
        out["errors_ignored"] = total
        return out


def guard(
    fn: Callable[[Any], Any], sink: Callable[[str, BaseException], None] | None, op: str
) -> Callable[[Any], Any]:
    """`fn` as it is when `sink` is None; otherwise `fn` whose `Exception` is reported
    to `sink(op, error)` and turned into `SKIPPED` (`ignore_errors`, error_ops.py)."""
    if sink is None:
        return fn

    def guarded(element: Any) -> Any:
        try:
            return fn(element)
        except Exception as err:
            sink(op, err)
            return SKIPPED

    return guarded


class _Raised:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _put(q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Puts `item`, waiting for room until `stop` is set; False if stopped."""
    while not stop.is_set():
        try:
            q.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            pass
    return False


def _pump(source: Iterator[Any], q: queue.Queue[Any], stop: threading.Event) -> None:
    """Thread body: moves `source`'s elements into `q` until the end or `stop`."""
    try:
        while not stop.is_set():
            try:
                item = next(source)
            except StopIteration:
                _put(q, _END, stop)
                return
            except BaseException as e:  # forwarded to the consumer, raised there
                _put(q, _Raised(e), stop)
                return
            if not _put(q, item, stop):
                return
            del item
    finally:
        close_iterator(source)  # in this thread: the generator may only run in one thread


class BackgroundIterator:
    """Runs an iterator in a daemon thread, up to `buffer_size` elements ahead.

    The thread starts on the first `next()` (or `start()`), holds no reference to this
    object, and stops within `POLL_S` seconds of `close()` or of this object being
    garbage-collected (unless it is blocked inside the source's `next()`). Errors of
    the source are raised by `next()` at their position. One consumer thread.
    """

    def __init__(self, source: Iterator[Any], buffer_size: int, name: str) -> None:
        self._source: Iterator[Any] | None = source
        self._queue: queue.Queue[Any] = queue.Queue(max(1, buffer_size))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._name = name
        self._done = False

    def start(self) -> None:
        if self._thread is None and not self._done:
            self._thread = threading.Thread(
                target=_pump,
                args=(self._source, self._queue, self._stop),
                name=f"dataservice-{self._name}",
                daemon=True,
            )
            self._source = None  # owned by the thread from now on
            self._thread.start()

    def __iter__(self) -> BackgroundIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._thread is None:
            self.start()
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if type(item) is _Raised:
            self.close()
            raise item.exc
        return item

    def close(self) -> None:
        """Stops the thread (it exits within `POLL_S` s) and drops buffered elements."""
        self._done = True
        self._stop.set()
        if self._source is not None:
            source, self._source = self._source, None
            close_iterator(source)
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _pool_worker(tasks: queue.SimpleQueue[Any], stop: threading.Event) -> None:
    while True:
        task = tasks.get()
        if task is None or stop.is_set():
            return
        fn, arg, fut, done = task
        del task
        try:
            fut.set_result(fn(arg))
        except BaseException as e:
            fut.set_exception(e)
        if done is not None:
            done.put(fut)
        del fn, arg, fut, done


class ThreadPool:
    """`n` daemon threads running `fn(arg)` tasks into Futures; thread-compatible."""

    def __init__(self, n: int, name: str) -> None:
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._n = n
        for i in range(n):
            threading.Thread(
                target=_pool_worker,
                args=(self._tasks, self._stop),
                name=f"dataservice-{name}-{i}",
                daemon=True,
            ).start()

    def submit(
        self, fn: Callable[[Any], Any], arg: Any, done: queue.SimpleQueue[Any] | None
    ) -> Future[Any]:
        fut: Future[Any] = Future()
        self._tasks.put((fn, arg, fut, done))
        return fut

    def shutdown(self) -> None:
        """Threads exit after their current task; queued tasks are dropped."""
        if not self._stop.is_set():
            self._stop.set()
            for _ in range(self._n):
                self._tasks.put(None)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def parallel_map(
    source: Iterator[Element], fn: Callable[[Element], Any], n: int, deterministic: bool
) -> Iterator[Element]:
    """`fn` over `source` on `n` threads, at most `n` calls in flight."""
    pool = ThreadPool(n, "map")
    done: queue.SimpleQueue[Any] | None = None if deterministic else queue.SimpleQueue()
    pending: collections.deque[Future[Any]] = collections.deque()
    in_flight = 0
    exhausted = False
    try:
        while True:
            while not exhausted and in_flight < n:
                try:
                    element = next(source)
                except StopIteration:
                    exhausted = True
                    break
                fut = pool.submit(fn, element, done)
                del element
                in_flight += 1
                if deterministic:
                    pending.append(fut)
            if in_flight == 0:
                return
            fut = pending.popleft() if done is None else done.get()
            in_flight -= 1
            yield fut.result()
            del fut
    finally:
        pool.shutdown()
        close_iterator(source)


def interleave(
    source: Iterator[Element],
    open_fn: Callable[[Element], Iterator[Element]],
    cycle_length: int,
    block_length: int,
    parallel: bool,
    on_error: Callable[[BaseException], None] | None = None,
) -> Iterator[Element]:
    """tf.data's interleave order: `block_length` elements from each of `cycle_length`
    open iterators in turn; an exhausted one is replaced by the next input's in its slot.

    With `parallel`, each open slot's iterator runs ahead in its own daemon thread; the
    output order is the same. With `on_error` (`ignore_errors`), an open iterator that
    raises an `Exception` is reported to it and ends there, as if exhausted.

    Source: tensorflow/core/kernels/data/interleave_dataset_op.cc (GetNextInternal).
    """
    slots: list[Iterator[Element] | None] = [None] * cycle_length
    num_open = 0
    cycle_index = 0
    block_index = 0
    end_of_input = False
    try:
        while not end_of_input or num_open > 0:
            current = slots[cycle_index]
            if current is not None:
                try:
                    element = next(current)
                    ended = False
                except StopIteration:
                    ended = True
                except Exception as err:
                    if on_error is None:
                        raise
                    on_error(err)
                    ended = True
                if ended:
                    close_iterator(current)
                    slots[cycle_index] = None
                    num_open -= 1
                    cycle_index = (cycle_index + 1) % cycle_length
                    block_index = 0
                    continue
                block_index += 1
                if block_index == block_length:
                    block_index = 0
                    cycle_index = (cycle_index + 1) % cycle_length
                yield element
            elif not end_of_input:
                try:
                    input_element = next(source)
                except StopIteration:
                    end_of_input = True
                    continue
                inner = open_fn(input_element)
                if parallel:
                    background = BackgroundIterator(inner, max(2, block_length), "interleave")
                    background.start()
                    inner = background
                slots[cycle_index] = inner
                num_open += 1
            else:
                cycle_index = (cycle_index + 1) % cycle_length
                block_index = 0
    finally:
        for slot in slots:
            if slot is not None:
                close_iterator(slot)
        close_iterator(source)


# ---------------------------------------------------------------------------- Dataset
