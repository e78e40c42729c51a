"""Exception hierarchy of dataservice, named after TensorFlow's status codes.

`except` clauses written for `tf.errors.*` carry over: `DataLossError` for a
damaged TFRecord, `UnavailableError` for an unreachable server, and so on.
Bad arguments caught at call time raise the builtin `ValueError`, as tf.data's
Python layer does.
"""

from __future__ import annotations


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


class OutOfRangeError(DataServiceError):
    """Iteration past the end of a sequence."""


class UnavailableError(DataServiceError):
    """A server could not be reached within the configured timeout."""


class DeadlineExceededError(DataServiceError):
    """An operation did not finish within its deadline."""


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
    processes that ran it kept exiting (a pipeline that calls `os._exit`,
    segfaults or is killed for memory) and whoever restarts them gave up, as
    `LocalCluster(restart_workers=True)` does after `max_worker_restarts`
    restarts in a row of a worker that handed out no element. The message
    names each worker, its address, pid and how it exited (the counterpart of
    PyTorch's "DataLoader worker (pid X) exited unexpectedly").
    """


class WorkerError(DataServiceError):
    """A user function raised on a worker.

    Attributes:
        type_name: The original exception's qualified type name, e.g. "ZeroDivisionError".
        worker_address: The "host:port" of the worker that ran the function.
    """

    def __init__(self, message: str, type_name: str = "", worker_address: str = "") -> None:
        super().__init__(message)
        self.type_name = type_name
        self.worker_address = worker_address


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
        OutOfRangeError,
        UnavailableError,
        DeadlineExceededError,
        ResourceExhaustedError,
        ElementTooLargeError,
        DataLossError,
        InternalError,
        UnimplementedError,
        WorkerCrashedError,
        WorkerError,
    )
}


_REMOTE_CLASSES: dict[str, type[WorkerError]] = {}


def remote_error(type_name: str, message: str, worker_address: str) -> WorkerError:
    """The consumer-side form of an exception raised by a pipeline on a worker.

    The result is a `WorkerError` and, when the original class is one of
    ours or a builtin (`DataLossError`, `ZeroDivisionError`, ...), also an
    instance of that class, so `except ZeroDivisionError:` still catches it.
    """
    cls = _REMOTE_CLASSES.get(type_name)
    if cls is None:
        import builtins

        original = _BY_NAME.get(type_name) or getattr(builtins, type_name, None)
        cls = WorkerError
        if (
            isinstance(original, type)
            and issubclass(original, Exception)
            and not issubclass(original, WorkerError)
        ):
            try:
                cls = type(type_name, (WorkerError, original), {"__module__": __name__})
            except TypeError:  # incompatible C layouts (e.g. OSError): keep WorkerError
                cls = WorkerError
        _REMOTE_CLASSES[type_name] = cls
    return cls(
        f"{type_name}: {message} (raised on worker {worker_address})",
        type_name=type_name,
        worker_address=worker_address,
    )


def error_class(name: str) -> type[DataServiceError]:
    """Returns the error class called `name`, or `DataServiceError` if unknown."""
    return _BY_NAME.get(name, DataServiceError)


__all__ = [name for name in _BY_NAME] + ["error_class"]
