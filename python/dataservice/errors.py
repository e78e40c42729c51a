"""Exception hierarchy of dataservice, named after TensorFlow's status codes.

`except` clauses written for `tf.errors.*` carry over: `DataLossError` for a
damaged TFRecord, `UnavailableError` for an unreachable server, and so on.
Bad arguments caught at call time raise the builtin `ValueError`, as tf.data's
Python layer does.

An exception a pipeline raises on a worker travels as a `RemoteErrorInfo`
(`capture`, on the worker) and is raised by the consumer as a `WorkerError`
that is also an instance of the original class where it can be found
(`remote_error`), with the worker's traceback as its `RemoteTraceback` cause.
"""

from __future__ import annotations

import base64
import builtins
import importlib
import json
import linecache
import pickle
import re
import sys
import traceback as traceback_module
import types
from typing import Any, NamedTuple


class DataServiceError(Exception):
    """Base class of every error raised by the data service at run time."""


class CancelledError(DataServiceError):
    """An operation was cancelled (for example the iterator was closed)."""


class InvalidArgumentError(DataServiceError, ValueError):
    """A request was malformed or inconsistent with existing state.

    Also a `ValueError`, so callers that catch `ValueError` see it too.
    """


class NotFoundError(DataServiceError):
    """A dataset id, job, iteration or task is unknown to the server."""


class AlreadyExistsError(DataServiceError):
    """Something with the same identity already exists."""


class FailedPreconditionError(DataServiceError):
    """The system is not in a state the operation needs (e.g. the dispatcher
    restarted without fault tolerance and lost the state the caller knew)."""


class DispatcherRestartedError(FailedPreconditionError):
    """The dispatcher restarted without `fault_tolerant_mode` and its state
    (datasets, jobs, iterations) was lost; the caller's ids no longer exist."""


class UnauthenticatedError(FailedPreconditionError):
    """A server refused the call: the auth token is missing or wrong. The
    message names the server's address and what to set (DATASERVICE_AUTH_TOKEN).
    As tf.errors.UnauthenticatedError; a FailedPreconditionError so that code
    written against earlier versions still catches it."""


class OutOfRangeError(DataServiceError):
    """Iteration past the end of a sequence."""


class UnavailableError(DataServiceError):
    """A server could not be reached within the configured timeout."""


class DeadlineExceededError(DataServiceError):
    """An operation did not finish within its deadline."""


class TransferStalledError(DeadlineExceededError):
    """A worker's reply cannot cross the link to the consumer: even its smallest
    messages (`transfer/grpc.py` `MIN_MESSAGE_BYTES`) did not arrive within the
    no-progress timeout, several times over. Raised from `next()` instead of
    retrying forever; the message names the worker, the reply's and its largest
    element's size, the throughput measured and the option to raise
    ($DATASERVICE_TRANSFER_NO_PROGRESS_MS). A `DeadlineExceededError`, so code
    that catches that catches it too."""


class ResourceExhaustedError(DataServiceError):
    """A size or memory limit was exceeded."""


class ElementTooLargeError(ResourceExhaustedError):
    """An element is larger than the transport's limit; the message names both sizes."""


class DataLossError(DataServiceError):
    """Unrecoverable data loss or corruption, e.g. a TFRecord whose length or
    data CRC32C does not match; the message names the file and byte offset."""


class InternalError(DataServiceError):
    """An invariant of the service was broken: a bug, please report it."""


class UnimplementedError(DataServiceError):
    """The operation is not supported."""


class WorkerCrashedError(DataServiceError):
    """No worker is left to produce an iteration's elements: the worker
    processes that ran it exited (a pipeline that calls `os._exit`, segfaults
    or is killed for memory) or were lost, and none came back. Raised at once
    when whoever restarts them gives up (`LocalCluster` at the first exit with
    `restart_workers=False`, else after `max_worker_restarts` restarts in a row
    of a worker whose processes each exited within `healthy_uptime_s` of
    starting: a crash loop), otherwise once a consumer waited
    `distribute(..., worker_loss_timeout_ms)` for a worker to come back. The
    message names each worker, its address, pid and how it exited or was lost
    (the counterpart of PyTorch's "DataLoader worker (pid X) exited
    unexpectedly").
    """


class MissingShardsError(WorkerCrashedError):
    """Static sharding (FILE, DATA, FILE_OR_DATA, HINT) with a fixed worker
    list: a listed worker's shard was not read and nobody reads it, because
    that worker never registered with the dispatcher, or registered, was lost
    and did not come back. Each listed worker holds one shard (its position in
    `DispatcherConfig.worker_addresses`) and an iteration is not over until
    every shard was read, so the consumer waits for the worker (warning about
    it meanwhile) and raises this once it waited `distribute(...,
    worker_loss_timeout_ms)` with nothing else to read. The message names each
    missing worker address and shard index. A subclass of WorkerCrashedError:
    a worker that was lost is what the read misses.
    """


# Raised on a worker, these come as a plain WorkerError (as themselves they would
# end or exit the consumer's loop): its str() names them.
_NOT_RAISED_AS_ITSELF = frozenset(
    {"SystemExit", "KeyboardInterrupt", "GeneratorExit", "StopIteration", "StopAsyncIteration"}
)


class WorkerError(DataServiceError):
    """A user function raised on a worker.

    The consumer raises it in place of the worker's exception, as an instance of
    that exception's class too when the class can be found here (a builtin, one
    of these errors, or a user's class importable by its module and name): its
    type is a subclass of both, named as the original, so `except ValueError`,
    `except KeyError` or `except my_module.BadRecord` catch it, and it carries
    the original `args` and those of its attributes that pickle (an exception
    whose class cannot be rebuilt from its args, as `CodeError(code, msg)` with
    `args == (msg,)`, still gets its `code`). Otherwise it is a plain
    `WorkerError` whose `type_name` names the original.

    `str()` is the original message once (its type's name when it has none: a
    bare `KeyboardInterrupt()`; prefixed by it for the types that come as a plain
    `WorkerError`: "SystemExit: 3"), then "(raised on worker ADDRESS)";
    `__cause__` is a `RemoteTraceback` holding the worker-side traceback, so a
    printed traceback shows the user's file and line first, as PyTorch's
    DataLoader shows its worker's "Original Traceback".

    Attributes:
        type_name: The original exception's type: "ZeroDivisionError" for a
            builtin or a dataservice error, "module.QualName" for others.
        message: The original exception's `str()`, e.g. "'key'" for a KeyError.
        worker_address: The "host:port" of the worker that ran the function.
        remote_traceback: The worker-side formatted traceback ("" if unknown).
    """

    def __init__(
        self,
        message: str,
        type_name: str = "",
        worker_address: str = "",
        remote_traceback: str = "",
    ) -> None:
        super().__init__(message)
        self._remote_message = self.message = message
        self.type_name = type_name
        self.worker_address = worker_address
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        # Not `self.message`: a user's class may define its own.
        message = self.__dict__.get("_remote_message")
        if message is None:
            return super().__str__()
        type_name = str(getattr(self, "type_name", "") or "")
        if not message:  # e.g. a bare KeyboardInterrupt(): say what was raised
            message = type_name
        elif type(self) is WorkerError and type_name in _NOT_RAISED_AS_ITSELF:
            message = f"{type_name}: {message}"  # "3" alone would not say sys.exit(3)
        address = getattr(self, "worker_address", "")
        if not address:
            return message
        where = f"(raised on worker {address})"
        return f"{message} {where}" if message else where

    def __reduce__(self) -> Any:
        # The class of a remote error is made at run time; rebuild it by name.
        return (
            remote_error,
            (
                self.type_name,
                self.__dict__.get("_remote_message", ""),
                self.worker_address,
                self.remote_traceback,
                self.__dict__.get("_remote_pickled", b""),
            ),
        )


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a worker, set as the `__cause__`
    of the `WorkerError` the consumer raises; `str()` is that traceback.

    Source: `concurrent.futures.process._RemoteTraceback` (Python), PyTorch's
    `ExceptionWrapper` ("Original Traceback (most recent call last)").
    """

    def __init__(self, traceback: str, worker_address: str = "") -> None:
        super().__init__(traceback)
        self.traceback = traceback
        self.worker_address = worker_address

    def __str__(self) -> str:
        where = f" on worker {self.worker_address}" if self.worker_address else ""
        return f"\nOriginal traceback{where}:\n{self.traceback.rstrip()}"

    def __reduce__(self) -> Any:
        return (RemoteTraceback, (self.traceback, self.worker_address))


_BY_NAME: dict[str, type[DataServiceError]] = {
    cls.__name__: cls
    for cls in (
        DataServiceError,
        CancelledError,
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        FailedPreconditionError,
        DispatcherRestartedError,
        UnauthenticatedError,
        OutOfRangeError,
        UnavailableError,
        DeadlineExceededError,
        TransferStalledError,
        ResourceExhaustedError,
        ElementTooLargeError,
        DataLossError,
        InternalError,
        UnimplementedError,
        WorkerCrashedError,
        WorkerError,
    )
}


_MAX_TRACEBACK_CHARS = 64 << 10  # longer messages and tracebacks are cut in the middle
_MAX_PICKLE_BYTES = 64 << 10  # a bigger exception travels by type name and message only
_MAX_FRAME_CHARS = 32 << 10  # an ERROR frame's text, all told
_FRAME_MARK = "\x00dataservice-error-v1\x00"


class RemoteErrorInfo(NamedTuple):
    """An exception raised on a worker, in the form that travels to consumers.

    Made on the worker by `capture`; turned back into an exception on the
    consumer by `RemoteErrorInfo.to_exception`. gRPC carries it in the
    `GetElementsResponse.error_*` fields, shared memory in an ERROR frame
    (`to_frame` / `from_frame`).
    """

    type_name: str  # "ValueError", "DataLossError", or "module.QualName"
    message: str  # str() of the exception, once
    traceback: str = ""  # traceback.format_exception(), possibly cut in the middle
    pickled: bytes = b""  # pickle of the exception if it round-trips there, else b""

    def to_frame(self) -> tuple[str, str]:
        """(type name, text) for a transport that carries two strings (a shared-
        memory ERROR frame, a JSON reply); `from_frame` reverses it. The text
        is at most about `_MAX_FRAME_CHARS` characters (the pickle is dropped,
        then the message and traceback cut, to fit), so that a reply that
        escapes it again stays within a socket message."""
        if not self.traceback and not self.pickled and len(self.message) <= _MAX_FRAME_CHARS:
            return self.type_name, self.message
        message, traceback, pickled = self.message, self.traceback, self.pickled
        limit = _MAX_FRAME_CHARS
        while True:
            rest = {"message": message, "traceback": traceback}
            if pickled:
                rest["pickled"] = base64.b64encode(pickled).decode("ascii")
            text = _FRAME_MARK + json.dumps(rest)
            if len(text) <= _MAX_FRAME_CHARS + len(_FRAME_MARK) + 64:
                return self.type_name, text
            if pickled:
                pickled = b""
            else:  # halving: json.dumps may write 6 characters for one (\uXXXX)
                limit //= 2
                message, traceback = _cut(message, limit), _cut(traceback, limit)

    @classmethod
    def from_frame(cls, type_name: str, text: str) -> RemoteErrorInfo:
        """The inverse of `to_frame`; a plain message (older peers) is kept as is."""
        if not text.startswith(_FRAME_MARK):
            return cls(type_name, text)
        try:
            rest = json.loads(text[len(_FRAME_MARK) :])
            pickled = base64.b64decode(rest.get("pickled", ""))
            return cls(type_name, str(rest["message"]), str(rest.get("traceback", "")), pickled)
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls(type_name, text[len(_FRAME_MARK) :])

    def to_exception(self, worker_address: str) -> WorkerError:
        """The consumer-side exception; see `remote_error`."""
        return remote_error(
            self.type_name, self.message, worker_address, self.traceback, self.pickled
        )


def _type_name(cls: type) -> str:
    if cls.__module__ == "builtins" or _BY_NAME.get(cls.__name__) is cls:
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _safe_str(err: BaseException) -> str:
    try:
        return str(err)
    except Exception:  # a user __str__ that raises
        try:
            return repr(err)
        except Exception:
            return f"<{type(err).__name__} whose str() raised>"


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = max(1, limit - head)
    skipped = len(text) - head - tail
    return f"{text[:head]}\n    ... [{skipped} characters cut] ...\n{text[-tail:]}"


def capture(err: BaseException) -> RemoteErrorInfo:
    """The worker-side form of `err`, raised by a pipeline: its type name,
    message, formatted traceback (PyTorch's "Original Traceback") and, when it
    pickles and unpickles here, its pickle (so the consumer gets its `args` and
    attributes back). Never raises, whatever the exception does.
    """
    if isinstance(err, WorkerError) and getattr(err, "type_name", None):
        # Already a remote error (a pipeline that reads another service): keep
        # the original, not "raised on worker" twice.
        message = err.__dict__.get("_remote_message", "")
        return RemoteErrorInfo(err.type_name, message, err.remote_traceback)
    try:
        tb = "".join(traceback_module.format_exception(err))
    except Exception:
        tb = ""
    pickled = b""
    try:
        data = pickle.dumps(err, protocol=pickle.HIGHEST_PROTOCOL)
        # Constructors that take other arguments than their args fail here, not
        # on the consumer; a class defined in a pipeline's __main__ fails here too.
        if len(data) <= _MAX_PICKLE_BYTES and type(pickle.loads(data)) is type(err):
            pickled = data
    except Exception:
        pickled = b""
    if not pickled:
        # The class cannot travel (defined in the training script, shipped by
        # value, or a constructor that takes other arguments than its args): its
        # args and those of its attributes that pickle alone still can, for the
        # consumer's class of that name (`e.code` of a `CodeError(code, msg)`).
        try:
            attrs = _picklable_attrs(err)
            data = pickle.dumps(
                (_ARGS_MARK, tuple(err.args), attrs), protocol=pickle.HIGHEST_PROTOCOL
            )
            if len(data) > _MAX_PICKLE_BYTES and attrs:
                data = pickle.dumps((_ARGS_MARK, tuple(err.args)), protocol=pickle.HIGHEST_PROTOCOL)
            if len(data) <= _MAX_PICKLE_BYTES:
                pickle.loads(data)
                pickled = data
        except Exception:
            pickled = b""
    return RemoteErrorInfo(
        _type_name(type(err)),
        _cut(_safe_str(err), _MAX_TRACEBACK_CHARS),
        _cut(tb, _MAX_TRACEBACK_CHARS),
        pickled,
    )


def _picklable_attrs(err: BaseException) -> dict[str, Any]:
    """The instance attributes of `err` whose values pickle and unpickle alone (a
    lock or a socket among them stays behind)."""
    out: dict[str, Any] = {}
    for name, value in getattr(err, "__dict__", {}).items():
        if not isinstance(name, str):
            continue
        try:
            pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:
            continue
        out[name] = value
    return out


_REMOTE_CLASSES: dict[type, type[WorkerError]] = {}


def _find_class(type_name: str) -> type | None:
    """The exception class called `type_name` here, or None."""
    if "." not in type_name:
        return _BY_NAME.get(type_name) or getattr(builtins, type_name, None)
    # Longest importable module prefix ("a.b.C" may be module "a.b", class "C").
    parts = type_name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module_name, qualname = ".".join(parts[:i]), parts[i:]
        module = sys.modules.get(module_name)
        if module is None:
            try:
                module = importlib.import_module(module_name)
            except Exception:
                continue
        obj: Any = module
        for part in qualname:
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, type):
            return obj
    return None


def _remote_class(original: type | None) -> type[WorkerError]:
    """A subclass of `WorkerError` and `original`, named as `original`."""
    if (
        not isinstance(original, type)
        or not issubclass(original, Exception)
        or issubclass(original, WorkerError)
        # A StopIteration out of next() would end the consumer's loop silently.
        or issubclass(original, (StopIteration, StopAsyncIteration))
    ):
        return WorkerError
    cls = _REMOTE_CLASSES.get(original)
    if cls is None:
        namespace = {
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
            "__doc__": original.__doc__,
            # Built from the original's args, so its own constructor.
            "__init__": original.__init__,
        }
        try:
            cls = type(original.__name__, (WorkerError, original), namespace)
        except TypeError:  # incompatible layouts or a final class: WorkerError alone
            cls = WorkerError
        _REMOTE_CLASSES[original] = cls
    return cls


# A pickled (mark, args) pair: the exception's args without its class.
_ARGS_MARK = "dataservice.errors:args"

_DYNAMIC_FRAME = re.compile(r'^(\s*)File "<dynamic-code>", line (\d+), in (\S+)$')


def _code_objects(root: Any, limit: int = 10_000) -> list[types.CodeType]:
    """The code objects of the functions (and class methods) defined in the
    namespace `root`, nested ones included, at most `limit`."""
    out: list[types.CodeType] = []
    seen: set[int] = set()
    stack: list[Any] = list(vars(root).values())
    while stack and len(out) < limit:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, staticmethod | classmethod):
            obj = obj.__func__
        if isinstance(obj, types.CodeType):
            out.append(obj)
            stack.extend(c for c in obj.co_consts if isinstance(c, types.CodeType))
        elif isinstance(obj, types.FunctionType):
            stack.append(obj.__code__)
        elif isinstance(obj, type) and obj.__module__ == root.__name__:
            stack.extend(vars(obj).values())
    return out


def _resolve_dynamic_code(tb: str) -> str:
    """`tb` with each `File "<dynamic-code>"` frame named by its real file.

    cloudpickle ships a function of the training script (`__main__`) by value
    and replaces its code's file name with "<dynamic-code>" (to keep its
    pickle deterministic), so the worker's traceback has the line and the
    function's name but not the file. The consumer defined that function:
    a frame whose function name and line match exactly one function of this
    process's `__main__` gets that function's file and source line. Never
    raises; an ambiguous or unknown frame is left as it was.
    """
    if "<dynamic-code>" not in tb:
        return tb
    try:
        main = sys.modules.get("__main__")
        codes = _code_objects(main) if main is not None else []
        out: list[str] = []
        for line in tb.splitlines():
            out.append(line)
            m = _DYNAMIC_FRAME.match(line)
            if m is None:
                continue
            indent, lineno, name = m.group(1), int(m.group(2)), m.group(3)
            files = set()
            for code in codes:
                if code.co_name != name or code.co_filename.startswith("<"):
                    continue
                lines = [n for _, _, n in code.co_lines() if n is not None]
                if lines and min(code.co_firstlineno, *lines) <= lineno <= max(lines):
                    files.add(code.co_filename)
            if len(files) == 1:
                (filename,) = files
                out[-1] = f'{indent}File "{filename}", line {lineno}, in {name}'
                source = linecache.getline(filename, lineno).strip()
                if source:
                    out.append(f"{indent}    {source}")
        return "\n".join(out) + ("\n" if tb.endswith("\n") else "")
    except Exception:  # a namespace that cannot be walked: keep the worker's text
        return tb


def remote_error(
    type_name: str,
    message: str,
    worker_address: str,
    traceback: str = "",
    pickled: bytes = b"",
) -> WorkerError:
    """The consumer-side form of an exception raised by a pipeline on a worker.

    The result is a `WorkerError` and, when the original class can be found
    here (see `WorkerError`), also an instance of that class, with the original
    `args` and attributes that `pickled` holds (`capture`). Its `__cause__` is a
    `RemoteTraceback` of `traceback`. Never raises: whatever goes wrong in
    rebuilding the original gives a plain `WorkerError` naming its type.
    """
    traceback = _resolve_dynamic_code(traceback)
    original: BaseException | None = None
    args_only: tuple[Any, ...] | None = None
    attrs_only: dict[str, Any] = {}
    if pickled:
        try:
            loaded = pickle.loads(pickled)
            if isinstance(loaded, BaseException):
                original = loaded
            elif isinstance(loaded, tuple) and len(loaded) in (2, 3) and loaded[0] == _ARGS_MARK:
                args_only = tuple(loaded[1])
                if len(loaded) == 3 and isinstance(loaded[2], dict):
                    attrs_only = loaded[2]
        except Exception:  # the class is not importable here, or changed
            original = None
    cls = _remote_class(type(original) if original is not None else _find_class(type_name))
    err: WorkerError | None = None
    if cls is not WorkerError:
        try:
            if original is not None:
                err = cls(*original.args)
                err.__dict__.update(original.__dict__)
            elif args_only is not None:
                try:
                    err = cls(*args_only)
                except Exception:  # a constructor that takes other arguments
                    err = cls.__new__(cls)
                    err.args = args_only
                err.__dict__.update(attrs_only)
            else:
                err = cls.__new__(cls)
                err.args = (message,)
        except Exception:  # a constructor that rejects its own args here
            err = None
    if err is None:
        err = WorkerError.__new__(WorkerError)
        err.args = (message,)
    fields = {
        "_remote_message": message,
        "message": message,
        "type_name": type_name,
        "worker_address": worker_address,
        "remote_traceback": traceback,
        "_remote_pickled": pickled if original is not None else b"",
    }
    try:
        err.__dict__.update(fields)  # not setattr: a user class's properties stay out of it
        if traceback:
            err.__cause__ = RemoteTraceback(traceback, worker_address)
    except Exception:  # a user class that refuses them: WorkerError alone
        err = WorkerError(message, type_name, worker_address, traceback)
        if traceback:
            err.__cause__ = RemoteTraceback(traceback, worker_address)
    return err


def error_class(name: str) -> type[DataServiceError]:
    """Returns the error class called `name`, or `DataServiceError` if unknown."""
    return _BY_NAME.get(name, DataServiceError)


__all__ = [name for name in _BY_NAME] + [
    "RemoteErrorInfo",
    "RemoteTraceback",
    "capture",
    "error_class",
    "remote_error",
]
