"""A user function's exception as the consumer sees it, end to end: its type
(builtin, dataservice or the user's own class), its args, its message once and
the worker's traceback (file and line of the user's raise) as `__cause__`, over
gRPC and shared memory, for plain, coordinated and cross-trainer-cache reads,
with in-process workers and with worker processes (`LocalCluster`). Also the
tf.data conformance of `compression` and `cardinality()` and the naming of an
unshippable capture at `distribute` / `register_dataset` time."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import traceback

import pytest

import dataservice as ds
from dataservice import errors

pytestmark = pytest.mark.timeout(120)

OFF = ds.ShardingPolicy.OFF
DYNAMIC = ds.ShardingPolicy.DYNAMIC
DOUBLED = re.compile(r"\b(\w+): \1:")
FAIL_AT = 3
RAISE_LINE: dict[str, int] = {}  # function name -> line of its raise


class BadRecord(Exception):
    """A user exception whose constructor takes other arguments than its args."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"record {index}: {reason}")
        self.index = index


def fail_value(x):
    if x == FAIL_AT:
        raise ValueError(f"bad record {x}")
    return x


RAISE_LINE["fail_value"] = fail_value.__code__.co_firstlineno + 2


def fail_key(x):
    if x == FAIL_AT:
        raise KeyError("label")
    return x


RAISE_LINE["fail_key"] = fail_key.__code__.co_firstlineno + 2


def fail_user(x):
    if x == FAIL_AT:
        raise BadRecord(int(x), "truncated")
    return x


RAISE_LINE["fail_user"] = fail_user.__code__.co_firstlineno + 2


def fail_local_class(x):
    class LocalOnly(Exception):  # not importable anywhere by its name
        pass

    if x == FAIL_AT:
        raise LocalOnly("local")
    return x


RAISE_LINE["fail_local_class"] = fail_local_class.__code__.co_firstlineno + 5

CASES = {  # function -> (class the consumer catches, message, args)
    "fail_value": (ValueError, f"bad record {FAIL_AT}", (f"bad record {FAIL_AT}",)),
    "fail_key": (KeyError, "'label'", ("label",)),
    "fail_user": (BadRecord, f"record {FAIL_AT}: truncated", (f"record {FAIL_AT}: truncated",)),
    "fail_local_class": (errors.WorkerError, "local", ("local",)),
}


def check(err: BaseException, fn_name: str, worker_addresses: list[str]) -> None:
    cls, message, args = CASES[fn_name]
    assert isinstance(err, cls) and isinstance(err, errors.WorkerError), type(err).__mro__
    assert err.args == args
    assert err.worker_address in worker_addresses
    text = str(err)
    assert text == f"{message} (raised on worker {err.worker_address})"
    printed = "".join(traceback.format_exception(err))
    assert not DOUBLED.search(printed), printed
    cause = err.__cause__
    assert isinstance(cause, errors.RemoteTraceback)
    where = f'test_remote_errors.py", line {RAISE_LINE[fn_name]}, in {fn_name}'
    assert where in str(cause), str(cause)
    if cls is errors.WorkerError:
        assert type(err) is errors.WorkerError and err.type_name.endswith("LocalOnly")
    if cls is BadRecord:  # not rebuilt from its args: its attribute still came
        assert err.index == FAIL_AT


def read_until_error(dataset) -> tuple[list[int], BaseException]:
    got: list[int] = []
    try:
        for x in dataset:
            got.append(int(x))
    except Exception as err:
        return got, err
    raise AssertionError(f"no error after {got}")


def distribute(fn, target: str, **kw):
    dataset = ds.Dataset.range(10).map(fn)
    if kw.get("num_consumers") or kw.get("cross_trainer_cache"):
        dataset = dataset.repeat()
    return dataset.apply(ds.distribute(OFF, target, **kw))


@pytest.mark.parametrize("protocol", ["grpc", "shm"])
@pytest.mark.parametrize("fn", [fail_value, fail_key, fail_user, fail_local_class])
def test_in_process_workers(cluster, protocol, fn):
    got, err = read_until_error(distribute(fn, cluster.target, data_transfer_protocol=protocol))
    assert got == list(range(FAIL_AT))  # the elements before the error come first
    check(err, fn.__name__, [w.address for w in cluster.workers])


@pytest.mark.parametrize("protocol", ["grpc", "shm"])
@pytest.mark.parametrize("read", ["coordinated", "cross_trainer_cache"])
def test_coordinated_and_cached_reads(cluster, protocol, read):
    kw: dict = {"job_name": f"{read}-{protocol}", "data_transfer_protocol": protocol}
    if read == "coordinated":
        kw.update(consumer_index=0, num_consumers=1)
    else:
        kw.update(cross_trainer_cache=ds.CrossTrainerCache("trainer-a"))
    got, err = read_until_error(distribute(fail_key, cluster.target, **kw))
    assert got == list(range(FAIL_AT))
    check(err, "fail_key", [w.address for w in cluster.workers])


def raising(error: BaseException):
    def fn(x):
        if x == FAIL_AT:
            raise error
        return x

    return fn


# Types a consumer retries when the transfer raises them (a worker restarting, a
# task it does not know yet): raised by the pipeline (a missing shard is
# NotFoundError), they are the pipeline's error, raised at once.
RETRIED_TYPES = [
    errors.NotFoundError("/data/shard-00007.tar: no such file or directory"),
    errors.UnavailableError("the feature store at db:5432 refused"),
    errors.DeadlineExceededError("the feature store did not answer in 5 s"),
    errors.CancelledError("cancelled upstream"),
    ConnectionResetError("peer reset the download"),
]


@pytest.mark.parametrize("protocol", ["grpc", "shm"])
@pytest.mark.parametrize("read", ["plain", "coordinated"])
@pytest.mark.parametrize("error", RETRIED_TYPES, ids=lambda e: type(e).__name__)
def test_a_pipeline_error_of_a_type_the_transfer_retries_is_raised_at_once(
    cluster, protocol, read, error
):
    kw: dict = {"data_transfer_protocol": protocol}
    if read == "coordinated":
        kw.update(job_name=f"retried-{protocol}", consumer_index=0, num_consumers=1)
    started = time.monotonic()
    got, err = read_until_error(distribute(raising(error), cluster.target, **kw))
    assert time.monotonic() - started < 10, "the consumer retried the pipeline's error"
    assert got == list(range(FAIL_AT))
    assert isinstance(err, type(error)) and isinstance(err, errors.WorkerError), type(err)
    assert str(err) == f"{error} (raised on worker {err.worker_address})"


class Box:
    """An element leaf that refuses to be encoded (pickled) when it holds 2."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self):
        if self.value == FAIL_AT:
            raise TypeError(f"Box {self.value} refuses to pickle")
        return (Box, (self.value,))


def boxed(x):
    return {"x": x, "box": Box(int(x))}


@pytest.mark.parametrize("protocol", ["grpc", "shm"])
@pytest.mark.parametrize("read", ["plain", "coordinated", "cross_trainer_cache"])
def test_an_element_that_cannot_be_sent_is_the_pipelines_error(cluster, protocol, read):
    # A Box is no numpy value: only a pipeline that allows pickled elements may hold one.
    kw: dict = {"data_transfer_protocol": protocol, "allow_pickled_elements": True}
    dataset = ds.Dataset.range(10).map(boxed)
    if read != "plain":
        dataset = dataset.repeat()
        kw["job_name"] = f"{read}-{protocol}"
    if read == "coordinated":
        kw.update(consumer_index=0, num_consumers=1)
    if read == "cross_trainer_cache":
        kw["cross_trainer_cache"] = ds.CrossTrainerCache("trainer-a")
    got: list[int] = []
    with pytest.raises(TypeError) as info:
        for element in dataset.apply(ds.distribute(OFF, cluster.target, **kw)):
            got.append(int(element["x"]))
    assert got == list(range(FAIL_AT))
    err = info.value
    assert isinstance(err, errors.WorkerError)
    assert str(err) == f"Box {FAIL_AT} refuses to pickle (raised on worker {err.worker_address})"
    assert "in __reduce__" in str(err.__cause__)


@pytest.fixture(scope="module")
def local_cluster():
    with ds.LocalCluster(num_workers=1) as c:
        yield c


@pytest.mark.parametrize("protocol", ["grpc", "shm"])
@pytest.mark.parametrize("fn", [fail_value, fail_user, fail_local_class])
def test_worker_processes(local_cluster, protocol, fn):
    dataset = distribute(fn, local_cluster.target, data_transfer_protocol=protocol)
    got, err = read_until_error(dataset)
    assert got == list(range(FAIL_AT))
    check(err, fn.__name__, [err.worker_address])
    assert ":" in err.worker_address


@pytest.mark.parametrize("protocol", ["grpc", "shm"])
def test_elements_fetched_before_an_error_arrive_first_with_two_workers(protocol):
    """Each of 2 workers (OFF) produces 0..FAIL_AT-1, then raises: the failing
    worker's elements come before the error, also while the reader still waits
    for the other worker's first connection (over shared memory it handed out
    none of them in 6 of 7 runs: the error overtook the start barrier)."""
    with ds.LocalCluster(num_workers=2) as two:
        dataset = distribute(fail_value, two.target, data_transfer_protocol=protocol)
        for _ in range(3):
            got, err = read_until_error(dataset)
            assert isinstance(err, ValueError), err
            assert sorted(set(got)) == list(range(FAIL_AT)), got
            assert len(got) >= FAIL_AT, got


def test_corrupt_tfrecord_reads_as_data_loss_once(cluster, tmp_path):
    path = tmp_path / "bad.tfrecord"
    with ds.io.TFRecordWriter(str(path)) as w:
        for i in range(3):
            w.write(b"record %d" % i)
    data = bytearray(path.read_bytes())
    data[-6] ^= 0xFF
    path.write_bytes(bytes(data))
    for protocol in ("grpc", "shm"):
        dataset = ds.TFRecordDataset(str(path)).apply(
            ds.distribute(OFF, cluster.target, data_transfer_protocol=protocol)
        )
        with pytest.raises(errors.DataLossError) as info:
            list(dataset)
        text = "".join(traceback.format_exception(info.value))
        assert "bad.tfrecord" in str(info.value) and not DOUBLED.search(text), text


@pytest.mark.parametrize(
    "exc",
    [OSError("disk gone"), errors.DataLossError("corrupted record"), ValueError("bad split")],
    ids=["oserror", "dataloss", "valueerror"],
)
def test_error_while_the_dispatcher_builds_splits_is_named_once(cluster, monkeypatch, exc):
    source = ds.Dataset.range(10)

    def broken(self, seed):
        raise exc

    monkeypatch.setattr(type(source), "_split_providers", broken)
    with pytest.raises(errors.DataServiceError) as info:
        list(source.apply(ds.distribute(DYNAMIC, cluster.target)))
    text = str(info.value)
    assert str(exc) in text and text.count(str(exc)) == 1
    assert not DOUBLED.search(f"{type(info.value).__name__}: {text}"), text


# ---------------------------------------------------------------- shipping
def test_unshippable_capture_is_named_at_distribute_and_register(cluster):
    lock = threading.Lock()

    def parse(x):
        with lock:
            return x

    dataset = ds.Dataset.range(3).map(parse)
    expected = (
        r"`map`.*test_remote_errors\.py:\d+.*closure variable `lock` is a _thread\.lock, "
        r"which cannot be pickled"
    )
    with pytest.raises(ValueError, match=expected):
        dataset.apply(ds.distribute(OFF, cluster.target))
    with pytest.raises(ValueError, match=expected):
        ds.register_dataset(cluster.target, dataset)
    assert cluster.dispatcher._state.datasets == {}  # nothing was registered


# ---------------------------------------------------------------- tf.data conformance
@pytest.mark.parametrize("compression", ["bogus", "", "gzip", 3])
def test_invalid_compression_is_a_value_error(cluster, compression):
    with pytest.raises(ValueError, match="Invalid `compression` argument"):
        ds.register_dataset(cluster.target, ds.Dataset.range(3), compression=compression)
    with pytest.raises(ValueError, match="Invalid `compression` argument"):
        ds.Dataset.range(3).apply(ds.distribute(OFF, cluster.target, compression=compression))


INF, UNKNOWN = ds.INFINITE_CARDINALITY, ds.UNKNOWN_CARDINALITY
# tensorflow/core/data/service/common.cc, EstimateCardinality.
EXPECTED_CARDINALITY = {
    "OFF": (INF, 0, UNKNOWN),
    "DYNAMIC": (INF, 0, UNKNOWN),
    "DATA": (INF, 0, UNKNOWN),
    "FILE": (UNKNOWN, 0, UNKNOWN),
    "FILE_OR_DATA": (UNKNOWN, 0, UNKNOWN),
    "HINT": (UNKNOWN, 0, UNKNOWN),
}


def test_cardinality_of_distributed_and_by_id_datasets(cluster):
    sources = [ds.Dataset.range(3).repeat(), ds.Dataset.range(0), ds.Dataset.range(3)]
    ids = [ds.register_dataset(cluster.target, s) for s in sources]
    for policy, expected in EXPECTED_CARDINALITY.items():
        mode = ds.ShardingPolicy[policy]
        by_distribute = tuple(
            s.apply(ds.distribute(mode, cluster.target)).cardinality() for s in sources
        )
        by_id = tuple(ds.from_dataset_id(mode, cluster.target, i).cardinality() for i in ids)
        assert by_distribute == expected, policy
        assert by_id == expected, policy
    coordinated = ds.from_dataset_id(
        OFF, cluster.target, ids[2], job_name="j", consumer_index=0, num_consumers=1
    )
    assert coordinated.cardinality() == INF
    with pytest.raises(errors.NotFoundError):
        ds.from_dataset_id(OFF, cluster.target, "no-such-id").cardinality()


SCRIPT = """
import numpy as np
import dataservice as ds


def parse(x):
    if x == 3:
        raise ValueError(f"bad record {x}")  # the line the traceback must show
    return np.int64(x)


dispatcher = ds.DispatchServer()
worker = ds.WorkerServer(ds.WorkerConfig(dispatcher.target))
dataset = ds.Dataset.range(10).map(parse).apply(ds.distribute("off", dispatcher.target))
try:
    list(dataset)
except ValueError as err:
    print("CAUSE-BEGIN")
    print(err.__cause__)
    print("CAUSE-END")
worker.stop()
dispatcher.stop()
"""


def test_traceback_of_a_training_script_function_names_the_script(tmp_path):
    """cloudpickle ships a function of `__main__` by value with its file name
    replaced by "<dynamic-code>"; the consumer names the script's file and
    shows the source line again."""
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    cause = out.stdout.split("CAUSE-BEGIN", 1)[1].split("CAUSE-END", 1)[0]
    assert f'File "{script}", line 8, in parse' in cause, cause
    assert "the line the traceback must show" in cause, cause
    assert "<dynamic-code>" not in cause, cause


SCRIPT_CLASS = """
import numpy as np
import dataservice as ds


class LocalErr(Exception):
    pass


class CodeError(Exception):
    def __init__(self, code, message):  # not rebuilt from its args, ("message",)
        super().__init__(message)
        self.code = code


def parse(x):
    if x == 3:
        raise LocalErr("local class", np.int64(x))
    return np.int64(x)


def parse_code(x):
    if x == 3:
        raise CodeError(42, "code forty-two")
    return np.int64(x)


with ds.LocalCluster(num_workers=1) as cluster:  # a worker process: another __main__
    dataset = ds.Dataset.range(10).map(parse).apply(ds.distribute("off", cluster.target))
    try:
        list(dataset)
    except LocalErr as err:
        print("ARGS", repr(err.args))
    dataset = ds.Dataset.range(10).map(parse_code).apply(ds.distribute("off", cluster.target))
    try:
        list(dataset)
    except CodeError as err:
        print("CODE", repr(err.args), err.code)
"""


def test_an_exception_class_of_the_training_script_keeps_its_args(tmp_path):
    """The class travels by value with the pipeline and cannot be pickled by
    reference on the worker: its args (and attributes) travel alone and the
    consumer builds its own class of that name with them (they arrived as one
    string; a class whose constructor takes other arguments lost its `code`)."""
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT_CLASS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ARGS ('local class', np.int64(3))" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "CODE ('code forty-two',) 42" in out.stdout, out.stdout + out.stderr[-2000:]
