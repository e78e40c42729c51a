"""A worker-side exception turned into its transport form (`errors.capture`,
`RemoteErrorInfo.to_frame`) and back into the consumer's exception
(`errors.remote_error`): type, args, message once, traceback as the cause,
whatever the exception's constructor, `__str__` or pickling does."""

from __future__ import annotations

import pickle
import re
import sys
import threading
import traceback

import pytest

from dataservice import errors

pytestmark = pytest.mark.timeout(30)

ADDRESS = "10.0.0.7:5051"
DOUBLED = re.compile(r"\b(\w+): \1:")  # "ValueError: ValueError: ..."


class BadRecord(Exception):
    """A user exception whose constructor takes other arguments than its args."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"record {index}: {reason}")
        self.index = index
        self.reason = reason


class WithFields(Exception):
    """Pickles and unpickles: its attributes come back on the consumer."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self):  # type: ignore[override]
        return (WithFields, (self.args[0], self.code))


class HoldsLock(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()  # cannot be pickled


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


def raise_and_capture(exc: BaseException) -> tuple[errors.RemoteErrorInfo, int]:
    """Raises `exc` here and captures it as a worker does; returns it and the
    line of the raise."""
    line = sys._getframe().f_lineno + 2
    try:
        raise exc
    except BaseException as err:
        return errors.capture(err), line


def over_the_wire(info: errors.RemoteErrorInfo) -> errors.WorkerError:
    """Both transports: gRPC's fields and the shared-memory frame give the same."""
    via_frame = errors.RemoteErrorInfo.from_frame(*info.to_frame())
    if len(info.message) + len(info.traceback) < 10_000:  # else the frame cuts them more
        assert via_frame == info
    return via_frame.to_exception(ADDRESS)


def assert_reads_well(err: BaseException, message: str) -> None:
    text = str(err)
    assert text == f"{message} (raised on worker {ADDRESS})"
    assert text.count(message) == 1 if message else True
    assert not DOUBLED.search(text), text
    assert not DOUBLED.search("".join(traceback.format_exception(err))), text


def test_builtin_keeps_type_message_once_and_traceback_as_cause():
    info, line = raise_and_capture(ValueError("bad record 7"))
    err = over_the_wire(info)
    assert isinstance(err, ValueError) and isinstance(err, errors.WorkerError)
    assert type(err).__name__ == "ValueError" and type(err).__module__ == "builtins"
    assert err.args == ("bad record 7",)
    assert err.type_name == "ValueError" and err.worker_address == ADDRESS
    assert_reads_well(err, "bad record 7")
    cause = err.__cause__
    assert isinstance(cause, errors.RemoteTraceback)
    assert f'test_remote_errors.py", line {line}, in raise_and_capture' in str(cause)
    assert "ValueError: bad record 7" in str(cause)
    assert ADDRESS in str(cause)
    printed = "".join(traceback.format_exception(err))
    assert printed.index(f"line {line}") < printed.index("direct cause")
    assert printed.rstrip().endswith(f"ValueError: bad record 7 (raised on worker {ADDRESS})")


def test_key_error_is_quoted_once_and_keeps_its_key():
    info, _ = raise_and_capture(KeyError("label"))
    err = over_the_wire(info)
    with pytest.raises(KeyError) as caught:
        raise err
    assert caught.value.args == ("label",)
    assert_reads_well(err, "'label'")


def test_several_args_are_kept():
    err = over_the_wire(raise_and_capture(ValueError("shape", 3, None))[0])
    assert isinstance(err, ValueError) and err.args == ("shape", 3, None)
    assert_reads_well(err, "('shape', 3, None)")


def test_dataservice_error_is_not_named_twice():
    err = over_the_wire(raise_and_capture(errors.DataLossError("corrupted record"))[0])
    assert isinstance(err, errors.DataLossError) and err.type_name == "DataLossError"
    assert_reads_well(err, "corrupted record")
    assert "DataLossError" not in str(err)


def test_importable_user_class_with_other_constructor_arguments():
    err = over_the_wire(raise_and_capture(BadRecord(7, "truncated"))[0])
    assert isinstance(err, BadRecord) and isinstance(err, errors.WorkerError)
    assert err.type_name == f"{__name__}.BadRecord"
    assert type(err).__qualname__ == "BadRecord" and type(err).__module__ == __name__
    # Not rebuilt from its args (its constructor takes others): its attributes still come.
    assert (err.index, err.reason, err.args) == (7, "truncated", ("record 7: truncated",))
    assert_reads_well(err, "record 7: truncated")


def test_user_class_that_pickles_keeps_its_attributes():
    info, _ = raise_and_capture(WithFields("bad header", code=42))
    assert info.pickled
    err = over_the_wire(info)
    assert isinstance(err, WithFields) and err.code == 42 and err.args == ("bad header",)
    assert_reads_well(err, "bad header")


def test_exception_that_cannot_be_pickled_still_arrives_by_name():
    exc = HoldsLock("held")
    exc.path = "/data/shard-3"  # set on the worker, not by the constructor
    info, _ = raise_and_capture(exc)
    # The exception (and its lock) could not travel; its args and path do.
    assert not isinstance(pickle.loads(info.pickled), BaseException)
    err = over_the_wire(info)
    assert isinstance(err, HoldsLock) and err.args == ("held",)
    # The worker's lock stayed behind (the consumer's constructor made one of its own).
    assert err.path == "/data/shard-3" and err.lock is not exc.lock
    assert_reads_well(err, "held")


def test_class_unknown_to_the_consumer_is_a_worker_error_naming_it():
    info = errors.RemoteErrorInfo("no_such_module.sub.Err", "lost", "Traceback ...\n", b"\x80junk")
    err = over_the_wire(info)
    assert type(err) is errors.WorkerError
    assert err.type_name == "no_such_module.sub.Err" and err.args == ("lost",)
    assert_reads_well(err, "lost")
    local = type("Local", (Exception,), {"__qualname__": "f.<locals>.Local"})
    err = over_the_wire(raise_and_capture(local("gone"))[0])
    assert type(err) is errors.WorkerError and err.type_name.endswith("f.<locals>.Local")


def test_str_that_raises_gives_a_message_not_a_crash():
    info, _ = raise_and_capture(BadStr("x"))
    assert info.message  # repr() of it
    err = over_the_wire(info)
    assert isinstance(err, BadStr)


def test_stop_iteration_never_ends_the_consumer_loop_silently():
    err = over_the_wire(raise_and_capture(StopIteration("early"))[0])
    assert not isinstance(err, StopIteration)
    assert type(err) is errors.WorkerError and err.type_name == "StopIteration"


def test_os_error_keeps_errno():
    err = over_the_wire(raise_and_capture(FileNotFoundError(2, "No such file"))[0])
    assert isinstance(err, FileNotFoundError) and err.errno == 2
    assert_reads_well(err, "[Errno 2] No such file")


def test_consumer_side_error_pickles():
    err = over_the_wire(raise_and_capture(KeyError("label"))[0])
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, KeyError) and str(again) == str(err)
    assert again.args == ("label",) and again.worker_address == ADDRESS
    assert isinstance(again.__cause__, errors.RemoteTraceback)


def test_a_remote_error_raised_again_on_a_worker_is_not_wrapped_twice():
    first = over_the_wire(raise_and_capture(ValueError("inner"))[0])
    info, _ = raise_and_capture(first)
    assert (info.type_name, info.message) == ("ValueError", "inner")
    assert_reads_well(info.to_exception(ADDRESS), "inner")


def test_huge_message_and_traceback_are_cut_in_the_middle():
    text = "head " + "x" * 500_000 + " tail"
    info, _ = raise_and_capture(ValueError(text))
    limit = errors._MAX_TRACEBACK_CHARS
    assert len(info.traceback) <= limit + 100 and len(info.message) <= limit + 100
    assert info.message.startswith("head ") and info.message.endswith(" tail")
    assert "characters cut" in info.message
    assert info.traceback.startswith("Traceback (most recent call last):")
    assert info.pickled == b""  # too big to travel pickled
    err = over_the_wire(info)
    assert isinstance(err, ValueError) and str(err).endswith(f" tail (raised on worker {ADDRESS})")


def test_a_frame_from_an_older_peer_is_a_plain_message():
    info = errors.RemoteErrorInfo.from_frame("ValueError", "bad")
    assert info == errors.RemoteErrorInfo("ValueError", "bad")
    err = info.to_exception(ADDRESS)
    assert isinstance(err, ValueError) and err.__cause__ is None
    assert_reads_well(err, "bad")


def test_worker_error_made_directly_reads_as_before():
    err = errors.WorkerError("boom", type_name="X", worker_address="")
    assert str(err) == "boom" and err.type_name == "X"


class _Aborted(Exception):
    pass


class _FakeContext:
    """The part of grpc.ServicerContext that `abort_with` uses."""

    def __init__(self) -> None:
        self.metadata: tuple = ()
        self.code = None
        self.details = ""

    def set_trailing_metadata(self, metadata: tuple) -> None:
        self.metadata = metadata

    def abort(self, code, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted


def _rpc_error(context: _FakeContext):
    import grpc

    class _Error(grpc.RpcError):
        def code(self):
            return context.code

        def details(self):
            return context.details

        def trailing_metadata(self):
            return context.metadata

    return _Error()


@pytest.mark.parametrize(
    "err",
    [
        errors.DataLossError("corrupted record"),
        errors.InvalidArgumentError("bad split"),
        errors.InternalError("KeyError: 'x'"),
        errors.NotFoundError("Dataset id 7 not found"),
        errors.UnavailableError("worker gone"),
        ValueError("bad argument"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_status_round_trip_names_the_type_once(err):
    from dataservice.rpc import util as rpc_util

    context = _FakeContext()
    with pytest.raises(_Aborted):
        rpc_util.abort_with(context, err)  # type: ignore[arg-type]
    got = rpc_util.to_error(_rpc_error(context), "127.0.0.1:1", "GetElements")
    text = f"{type(got).__name__}: {got}"
    assert str(err) in str(got) and str(got).count(str(err)) == 1
    assert not DOUBLED.search(text), text
    if isinstance(err, errors.DataServiceError):
        assert type(got) is type(err)
    else:
        assert isinstance(got, ValueError)


@pytest.mark.parametrize("char", ["x", '"', "\u00e9", "\U0001f600"])
def test_a_frame_stays_small_whatever_the_text(char):
    info = errors.RemoteErrorInfo(
        "ValueError", char * 60_000, "Traceback\n" + char * 60_000, b"p" * 60_000
    )
    type_name, text = info.to_frame()
    assert len(text) <= errors._MAX_FRAME_CHARS + 200
    import json

    assert len(json.dumps([type_name, text])) <= 256 << 10  # a shm window reply
    back = errors.RemoteErrorInfo.from_frame(type_name, text)
    assert back.message.startswith(char) and back.message.endswith(char)
    assert back.pickled == b"" and "characters cut" in back.message
    small = errors.RemoteErrorInfo("ValueError", "bad", "Traceback\n", b"p")
    assert errors.RemoteErrorInfo.from_frame(*small.to_frame()) == small


class HasMessageProperty(Exception):
    @property
    def message(self) -> str:
        return "from the property"


class NeedsNew(Exception):
    def __new__(cls, code: int, text: str):  # type: ignore[misc]
        self = super().__new__(cls, code, text)
        self.code = code
        return self

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{code}: {text}")

    def __reduce__(self):  # type: ignore[override]
        raise TypeError("refuses to pickle")


def test_user_classes_that_resist_rebuilding_still_read_well():
    err = over_the_wire(raise_and_capture(HasMessageProperty("bad"))[0])
    assert isinstance(err, HasMessageProperty) and err.message == "from the property"
    assert_reads_well(err, "bad")
    err = over_the_wire(raise_and_capture(NeedsNew(5, "odd"))[0])
    assert isinstance(err, errors.WorkerError) and err.type_name.endswith("NeedsNew")
    assert_reads_well(err, "5: odd")


def test_an_error_not_from_a_dataservice_server_names_the_call_and_address():
    import grpc

    from dataservice.rpc import util as rpc_util

    context = _FakeContext()
    context.code = grpc.StatusCode.UNIMPLEMENTED
    context.details = "Received http2 header with status: 404"
    context.metadata = ()
    got = rpc_util.to_error(_rpc_error(context), "10.0.0.1:5050", "RegisterDataset")
    assert isinstance(got, errors.UnimplementedError)
    assert "RegisterDataset at 10.0.0.1:5050 failed" in str(got)
    assert "status: 404" in str(got) and "not a dataservice server" in str(got)


def test_an_error_without_a_message_is_named_by_its_type():
    err = errors.remote_error("KeyboardInterrupt", "", "10.0.0.7:5051")
    assert str(err) == "KeyboardInterrupt (raised on worker 10.0.0.7:5051)"
    assert err.type_name == "KeyboardInterrupt"


def test_an_exit_or_stop_raised_on_a_worker_is_named_by_its_type():
    # They come as a plain WorkerError (as themselves they would end the consumer's loop).
    for type_name in ("SystemExit", "StopIteration"):
        err = errors.remote_error(type_name, "3", "10.0.0.7:5051")
        assert type(err) is errors.WorkerError
        assert str(err) == f"{type_name}: 3 (raised on worker 10.0.0.7:5051)"
    err = errors.remote_error("ValueError", "3", "10.0.0.7:5051")
    assert isinstance(err, ValueError) and str(err) == "3 (raised on worker 10.0.0.7:5051)"
