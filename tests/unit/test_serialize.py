"""Serialisation of Dataset graphs: determinism, round trips, clear errors."""

from __future__ import annotations

import functools
import mmap
import re
import threading

import numpy as np
import pytest

from dataservice.data.dataset import Dataset
from dataservice.data.serialize import (
    MIN_SHARED_BUFFER_BYTES,
    definition_fingerprint,
    deserialize,
    fingerprint,
    load,
    parse,
    serialize,
)
from dataservice.errors import InvalidArgumentError


def double(x):
    return x * 2


def is_even(x):
    return x % 2 == 0


def build():
    return (
        Dataset.range(100)
        .map(double, num_parallel_calls=2)
        .filter(is_even)
        .shuffle(10, seed=3)
        .batch(4, drop_remainder=True)
        .prefetch(2)
    )


def build_with_lambdas():
    return Dataset.from_tensor_slices({"x": np.arange(6), "y": ["a", "b", "c", "d", "e", "f"]}).map(
        lambda e: (e["x"] + 1, e["y"])
    )


def test_equal_pipelines_serialize_to_equal_bytes():
    assert serialize(Dataset.range(10)) == serialize(Dataset.range(10))
    assert serialize(Dataset.range(np.int64(10))) == serialize(Dataset.range(10))
    assert serialize(build()) == serialize(build())
    assert serialize(build_with_lambdas()) == serialize(build_with_lambdas())
    assert fingerprint(build()) == fingerprint(build())
    assert len(fingerprint(build())) == 64
    assert fingerprint(Dataset.range(10)) != fingerprint(Dataset.range(11))


def test_iterating_does_not_change_the_bytes():
    ds = build()
    before = serialize(ds)
    list(ds)
    list(ds)
    _ = Dataset.range(3).map(lambda x: x).element_spec
    assert serialize(ds) == before
    spec_ds = Dataset.range(3).map(double)
    before = serialize(spec_ds)
    _ = spec_ds.element_spec  # cached transiently
    assert serialize(spec_ds) == before


def test_round_trip_gives_the_same_elements():
    ds = build_with_lambdas()
    copy = deserialize(serialize(ds))
    assert isinstance(copy, Dataset)
    assert [(int(a), str(b)) for a, b in copy] == [(int(a), str(b)) for a, b in ds]
    seeded = build()
    assert [b.tolist() for b in deserialize(serialize(seeded))] == [b.tolist() for b in build()]


def test_round_trip_generator_and_list_files(tmp_path):
    (tmp_path / "a.txt").write_text("a")

    def gen(n):
        yield from range(n)

    ds = Dataset.from_generator(gen, args=(3,)).concatenate(
        Dataset.list_files(str(tmp_path / "*.txt")).map(lambda f: np.int64(len(f)))
    )
    assert [int(x) for x in deserialize(serialize(ds))] == [0, 1, 2, len(str(tmp_path / "a.txt"))]


def test_unpicklable_function_names_op_and_function():
    lock = threading.Lock()

    def parse(x):
        with lock:
            return x

    ds = Dataset.range(3).map(double).map(parse).batch(2)
    with pytest.raises(ValueError) as e:
        serialize(ds)
    msg = str(e.value)
    assert "Cannot serialize the function `" in msg and "parse" in msg
    assert "given to `map`" in msg
    assert "test_serialize.py:" in msg
    assert "lock" in msg


GLOBAL_LOCK = threading.Lock()


class _Parser:
    def __init__(self):
        self.lock = threading.Lock()

    def __call__(self, x):
        return x

    def parse(self, x):
        return x


class _State:
    def __init__(self):
        self.lock = threading.Lock()


def _capture_cases():
    """(function, the capture path the error must name, its type)."""
    lock = threading.Lock()

    def closure(x):
        with lock:
            return x

    def default(x, guard=threading.Lock()):
        return x

    def kwdefault(x, *, guard=threading.Lock()):
        return x

    def helper():
        return lock

    def uses_global(x):  # nested, so pickled by value with the globals it names
        with GLOBAL_LOCK:
            return x

    def nested(x):
        helper()
        return x

    items = [1, threading.Lock()]
    cfg = {"path": "/data", "lock": threading.Lock()}
    state = _State()

    def in_list(x):
        return items and x

    def in_dict(x):
        return cfg and x

    def in_object(x):
        return state and x

    def with_attr(x):
        return x

    with_attr.cache = threading.Lock()
    return {
        "closure": (closure, "its closure variable `lock`", "_thread.lock"),
        "global": (uses_global, "its global `GLOBAL_LOCK`", "_thread.lock"),
        "default": (default, "its default argument `guard`", "_thread.lock"),
        "kwdefault": (kwdefault, "its default argument `guard`", "_thread.lock"),
        "callable_object": (_Parser(), "its attribute `self.lock`", "_thread.lock"),
        "bound_method": (_Parser().parse, "its attribute `self.lock`", "_thread.lock"),
        "nested_function": (
            nested,
            "its closure variable `helper`, whose closure variable `lock`",
            "_thread.lock",
        ),
        "list_element": (in_list, "its closure variable `items[1]`", "_thread.lock"),
        "dict_element": (in_dict, "its closure variable `cfg['lock']`", "_thread.lock"),
        "object_attribute": (in_object, "its closure variable `state.lock`", "_thread.lock"),
        "function_attribute": (with_attr, "its attribute `with_attr.cache`", "_thread.lock"),
        "partial_of_closure": (
            functools.partial(closure),
            "its closure variable `lock`",
            "_thread.lock",
        ),
        "partial": (
            functools.partial(double_with, guard=threading.Lock()),
            "its partial keyword argument `guard`",
            "_thread.lock",
        ),
    }


def double_with(x, guard=None):
    return 2 * x


@pytest.mark.parametrize("kind", sorted(_capture_cases()))
def test_unpicklable_capture_is_named_with_its_type(kind):
    fn, path, type_name = _capture_cases()[kind]
    with pytest.raises(ValueError) as e:
        serialize(Dataset.range(3).map(fn))
    msg = str(e.value)
    assert f"{path} is a {type_name}, which cannot be pickled" in msg, msg
    assert re.search(r"given to `map` \(defined in test_serialize\.py:\d+\)", msg), msg
    assert "TypeError: cannot pickle '_thread.lock' object" in msg


def test_unpicklable_part_of_an_argument_is_named():
    ds = Dataset.from_tensors({"ok": 1, "bad": [2, threading.Lock()]})
    with pytest.raises(
        ValueError, match=r"the part at fault is `value\['bad'\]\[1\]`, a _thread.lock"
    ):
        serialize(ds)


def test_unpicklable_generator_in_from_generator():
    gen_obj = (i for i in range(3))
    ds = Dataset.from_generator(lambda: gen_obj)
    with pytest.raises(ValueError, match="given to `from_generator`.*generator"):
        serialize(ds)


def test_unpicklable_argument_names_the_op():
    ds = Dataset.from_tensors({"x": np.array(threading.Lock(), dtype=object)})
    with pytest.raises(ValueError, match="`from_tensors` dataset: its argument `value`"):
        serialize(ds)


def test_deserialize_rejects_garbage():
    with pytest.raises(InvalidArgumentError):
        deserialize(b"not a pickle")
    import pickle

    with pytest.raises(InvalidArgumentError, match="int"):
        deserialize(pickle.dumps(3))
    with pytest.raises(TypeError):
        serialize(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- out-of-band buffers
BIG = MIN_SHARED_BUFFER_BYTES // 8  # int64 items in one MiB


def test_big_arrays_travel_out_of_band_and_small_ones_in_the_pickle():
    big = np.arange(BIG, dtype=np.int64)
    small = np.arange(BIG - 1, dtype=np.int64)  # one item under the threshold
    pipeline = Dataset.from_tensor_slices(big).concatenate(Dataset.from_tensor_slices(small))
    definition = parse(serialize(pipeline))
    assert [b.size_bytes for b in definition.buffers] == [big.nbytes]
    assert definition.buffers[0].data == big.tobytes()
    assert small.nbytes < len(definition.pickle) < small.nbytes + 4096
    assert serialize(Dataset.from_tensor_slices(big)) == serialize(
        Dataset.from_tensor_slices(big.copy())
    )
    assert fingerprint(Dataset.from_tensor_slices(big)) != fingerprint(
        Dataset.from_tensor_slices(big + 1)
    )


def test_out_of_band_round_trip_keeps_values_order_and_writability():
    c_order = np.arange(BIG * 2, dtype=np.int64).reshape(-1, 4)
    f_order = np.asfortranarray(np.arange(BIG * 2, dtype=np.float64).reshape(-1, 4))
    read_only = np.arange(BIG * 2, dtype=np.int64).reshape(-1, 4) * 3
    read_only.flags.writeable = False
    copy = deserialize(serialize(Dataset.from_tensor_slices((c_order, f_order, read_only))))
    for got, want in zip(copy._value, (c_order, f_order, read_only), strict=True):
        np.testing.assert_array_equal(got, want)
        assert got.flags.writeable == want.flags.writeable
    assert copy._value[1].flags.f_contiguous
    rows = list(copy.take(2))
    np.testing.assert_array_equal(rows[1][2], [12, 15, 18, 21])


def test_load_maps_buffer_files(tmp_path):
    source = np.arange(BIG * 4, dtype=np.int64).reshape(-1, 2)
    definition = parse(serialize(Dataset.from_tensor_slices(source).map(lambda x: x * 2)))
    (buffer,) = definition.buffers
    path = tmp_path / "buffer"
    path.write_bytes(buffer.data)
    buffer.path, buffer.data = str(path), b""
    loaded = load(definition)
    array = loaded._input._value
    base = array
    while isinstance(base, np.ndarray | memoryview):
        base = base.obj if isinstance(base, memoryview) else base.base
    assert isinstance(base, mmap.mmap)  # a view of the file, not a copy
    assert [x.tolist() for x in loaded.take(2)] == [[0, 2], [4, 6]]
    # Copy-on-write: writing changes this process's pages only, never the file.
    array[0, 0] = 7
    assert np.frombuffer(path.read_bytes(), np.int64)[0] == 0


def test_load_raises_oserror_for_a_missing_or_changed_file(tmp_path):
    definition = parse(serialize(Dataset.from_tensor_slices(np.zeros(BIG, np.int64))))
    (buffer,) = definition.buffers
    buffer.path, buffer.data = str(tmp_path / "gone"), b""
    with pytest.raises(OSError):
        load(definition)
    (tmp_path / "short").write_bytes(b"x" * 10)
    buffer.path = str(tmp_path / "short")
    with pytest.raises(OSError, match="holds 10 bytes"):
        load(definition)


def test_bytes_of_a_bare_pickle_still_deserialize():
    # What the journal of a dispatcher before DatasetDef holds.
    import cloudpickle

    old = cloudpickle.dumps(Dataset.range(3), protocol=5)
    assert [int(x) for x in deserialize(old)] == [0, 1, 2]


def test_a_pipeline_pickled_when_ops_were_in_dataset_py_still_loads(monkeypatch):
    # What the journal of a dispatcher from before ops.py holds: the op classes named
    # as `dataservice.data.dataset.<Op>`. Pickle them under that name, then load them
    # with the classes only in ops.py.
    import pickle

    from dataservice.data import dataset as dataset_module
    from dataservice.data import ops

    moved = (ops.MapDataset, ops.BatchDataset, ops.ZipDataset, ops.RepeatDataset)
    with monkeypatch.context() as m:
        for cls in moved:
            m.setattr(cls, "__module__", "dataservice.data.dataset")
            m.setattr(dataset_module, cls.__name__, cls, raising=False)
        pipeline = Dataset.zip((Dataset.range(5).map(double), Dataset.range(5))).batch(2)
        old = serialize(pipeline.repeat(2))
    assert b"dataservice.data.dataset" in parse(old).pickle
    assert not hasattr(dataset_module, "MapDataset")
    with pytest.raises(AttributeError, match="RepeatDataset"):
        pickle.loads(parse(old).pickle)  # what a plain unpickler makes of it
    loaded = deserialize(old)
    assert type(loaded) is ops.RepeatDataset
    assert [[a.tolist(), b.tolist()] for a, b in loaded] == [
        [[0, 2], [0, 1]],
        [[4, 6], [2, 3]],
        [[8], [4]],
    ] * 2


@pytest.mark.parametrize("mode", ["r", "rb", "w", "r+"])
def test_a_captured_open_file_is_refused_in_any_mode(tmp_path, mode):
    # A read-mode file would otherwise travel as a copy of what is left of it, read on
    # this host: not the file a worker on another host sees.
    path = tmp_path / "data.txt"
    path.write_text("abc")
    with open(path, mode) as f:

        def reads(x):
            return f.read(1), x

        with pytest.raises(ValueError) as e:
            serialize(Dataset.range(3).map(reads))
    msg = str(e.value)
    assert "its closure variable `f`" in msg, msg
    assert f"an open file ({str(path)!r}, mode {mode!r}) cannot be shipped" in msg, msg
    assert "open the file inside the function" in msg


def test_the_standard_streams_and_in_memory_files_still_serialize():
    # sys.stderr goes by name (a module global), a BytesIO by value.
    import io
    import sys

    buf = io.BytesIO(b"xyz")

    def uses(x):
        print(x, file=sys.stderr)
        return buf.getvalue(), x

    serialize(Dataset.range(3).map(uses))


# A script whose pipeline holds what varied between processes and directories: a
# set constant and a captured set of strings (ordered by the hash seed), a class
# defined in the script (cloudpickle's random class id), its file's path.
_SCRIPT = """
import sys
import dataservice as ds
from dataservice.data.serialize import fingerprint, serialize

WORDS = {"alpha", "beta", "gamma", "delta", "epsilon"}


class Keep:
    def __call__(self, x):
        return str(x) in {"1", "2", "3", "4", "5", "6"} or sorted(WORDS)[0] == str(x)


dataset = ds.Dataset.range(10).filter(Keep()).map(lambda x: x * BODY)
sys.stdout.write(fingerprint(dataset))
sys.stdout.flush()
open(sys.argv[1], "wb").write(serialize(dataset))
"""


def _run_script(directory, body=2, hash_seed="0"):
    import os
    import subprocess
    import sys

    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "prep.py"
    script.write_text(_SCRIPT.replace("BODY", str(body)))
    out = directory / f"def-{body}-{hash_seed}.bin"
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, str(script), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return done.stdout, out.read_bytes(), str(script)


def test_fingerprint_is_the_same_from_any_directory_and_hash_seed(tmp_path):
    first, data, path = _run_script(tmp_path / "a", hash_seed="1")
    again, _, _ = _run_script(tmp_path / "a", hash_seed="2")
    moved, moved_data, moved_path = _run_script(tmp_path / "b" / "checkout", hash_seed="3")
    other, _, _ = _run_script(tmp_path / "c", body=3)
    assert len(first) == 64
    assert first == again == moved, "the fingerprint depends on the process or the path"
    assert other != first  # another function body
    # What ships holds each registrant's own paths; the fingerprint leaves them out.
    assert data != moved_data
    assert list(parse(data).code_paths) == [path]
    assert list(parse(moved_data).code_paths) == [moved_path]
    assert definition_fingerprint(data) == definition_fingerprint(moved_data) == first


def test_loaded_functions_get_their_file_path_and_keep_their_sets(tmp_path):
    _, data, path = _run_script(tmp_path / "a")
    loaded = deserialize(data)
    assert [int(x) for x in loaded] == [2, 4, 6, 8, 10, 12]
    fn = loaded._fn  # the lambda
    assert fn.__globals__["__file__"] == path
    keep = loaded._input._predicate
    assert keep.__call__.__globals__["WORDS"] == {"alpha", "beta", "gamma", "delta", "epsilon"}
    assert type(keep.__call__.__globals__["WORDS"]) is set
    # Without the paths (a definition from before code_paths) the base name remains.
    bare = parse(data)
    bare.ClearField("code_paths")
    assert load(bare)._fn.__globals__["__file__"] == "prep.py"


def test_a_class_by_value_is_reused_only_when_it_is_the_same(tmp_path):
    _, two, _ = _run_script(tmp_path / "a", body=2)
    _, three, _ = _run_script(tmp_path / "b", body=3)
    a, b = deserialize(two)._input._predicate, deserialize(two)._input._predicate
    assert type(a) is type(b)  # one class for one class id
    _SCRIPT_OTHER = _SCRIPT.replace("or sorted(WORDS)[0] == str(x)", "")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "prep.py").write_text(_SCRIPT_OTHER.replace("BODY", "2"))
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, str(tmp_path / "c" / "prep.py"), str(tmp_path / "c.bin")],
        capture_output=True,
        timeout=60,
        check=True,
    )
    c = deserialize((tmp_path / "c.bin").read_bytes())._input._predicate
    assert type(c).__name__ == type(a).__name__ == "Keep"
    assert type(c) is not type(a)  # another class of the same name is not taken for it
    assert type(deserialize(three)._input._predicate) is type(a)  # same class, other lambda


def test_sets_that_cannot_be_ordered_keep_their_items():
    class Token:
        pass

    token = Token()
    mixed = {1, "a", b"b", (2, "c"), None}
    ds = Dataset.range(3).map(lambda x, m=mixed, t=frozenset([token]): (x, len(m), len(t)))
    copy = deserialize(serialize(ds))
    defaults = copy._fn.__defaults__
    assert defaults[0] == mixed and type(defaults[0]) is set
    assert len(defaults[1]) == 1 and type(defaults[1]) is frozenset
