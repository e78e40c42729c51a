"""Dataset graphs <-> bytes (cloudpickle), and fingerprints for dataset_id dedup.

Serialisation is deterministic: a node stores only its constructor arguments
(normalised to plain ints/str/arrays) and never per-process state (epoch counters,
cached specs live in `_t_*` attributes that `Dataset.__getstate__` drops), so two
separately built equal pipelines give identical bytes and the same fingerprint.
Functions are pickled by value when they are not importable (lambdas, closures) and by
reference otherwise, so workers need the same importable modules as the client.

The bytes are a `DatasetDef` (rpc/dataset.proto): the pickle (protocol 5) and, out of
band, every buffer of `MIN_SHARED_BUFFER_BYTES` or more that it holds (contiguous numpy
arrays: a `from_tensor_slices` source, an array a function captured). The dispatcher
keeps those buffers in files (dispatcher/buffer_store.py) and a worker on its host maps
them (`load`), so the arrays of a pipeline are backed by page-cache pages that every
worker process shares instead of one private copy per worker (CASES C-19).
"""

from __future__ import annotations

import functools
import hashlib
import io
import mmap
import os
import pickle
import stat
import sys
import types
from typing import Any

import cloudpickle
import numpy as np
from google.protobuf.message import DecodeError

from dataservice.data.dataset import Dataset
from dataservice.errors import InvalidArgumentError
from dataservice.rpc import dataset_pb2

__all__ = [
    "MIN_SHARED_BUFFER_BYTES",
    "deserialize",
    "fingerprint",
    "load",
    "map_buffer_file",
    "parse",
    "serialize",
]

PICKLE_PROTOCOL = 5

# Open files of the OS (not in-memory io.BytesIO/StringIO). cloudpickle would ship a
# read-mode one as a StringIO of what is left of it, read here at serialisation: not the
# file on the worker's host, nor a position that moves with the worker's reads, and all
# of a big file copied into the definition. Refused, as write-mode ones are.
_OPEN_FILE_TYPES = (
    io.FileIO,
    io.BufferedReader,
    io.BufferedWriter,
    io.BufferedRandom,
    io.TextIOWrapper,
)


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle's pickler that refuses open files (`_OPEN_FILE_TYPES`), naming
    the file and the fix; the standard streams keep cloudpickle's by-name pickling."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _OPEN_FILE_TYPES) and obj not in (sys.stdin, sys.stdout, sys.stderr):
            name = getattr(obj, "name", "?")
            mode = getattr(obj, "mode", "?")
            raise pickle.PicklingError(
                f"an open file ({name!r}, mode {mode!r}) cannot be shipped to the workers: "
                "they run in other processes, maybe on other hosts, where this file object "
                "means nothing (a copy would hold what is left of it as read here, at its "
                "position now); capture the path and open the file inside the function"
            )
        return super().reducer_override(obj)


def _dumps(obj: Any, buffer_callback: Any = None) -> bytes:
    """`cloudpickle.dumps(obj, PICKLE_PROTOCOL, buffer_callback=...)` with `_Pickler`."""
    with io.BytesIO() as out:
        _Pickler(out, protocol=PICKLE_PROTOCOL, buffer_callback=buffer_callback).dump(obj)
        return out.getvalue()


MIN_SHARED_BUFFER_BYTES = 1 << 20
"""Buffers this big (bytes) or bigger travel out of band and are shared on a host."""

# Op classes are pickled by reference (module path). These were defined in
# dataset.py before they moved to ops.py; a pipeline pickled then (the journal of
# a dispatcher's `work_dir`, written before an upgrade) still names them there.
_MOVED_CLASSES = {
    ("dataservice.data.dataset", name): ("dataservice.data.ops", name)
    for name in (
        "AllowPickledElementsDataset",
        "BatchDataset",
        "ConcatenateDataset",
        "EnumerateDataset",
        "FilterDataset",
        "FlatMapDataset",
        "InterleaveDataset",
        "MapDataset",
        "PrefetchDataset",
        "RepeatDataset",
        "ShardDataset",
        "ShuffleDataset",
        "SkipDataset",
        "TakeDataset",
        "ZipDataset",
        "_UnaryDataset",
    )
}


class _Unpickler(pickle.Unpickler):
    """`pickle.Unpickler` that finds a moved class (`_MOVED_CLASSES`) where it is now."""

    def find_class(self, module: str, name: str) -> Any:
        module, name = _MOVED_CLASSES.get((module, name), (module, name))
        return super().find_class(module, name)


def serialize(dataset: Dataset) -> bytes:
    """The pipeline `dataset` as bytes: a `DatasetDef` with every buffer inline.

    Raises:
        TypeError: `dataset` is not a Dataset.
        ValueError: Part of it cannot be pickled; the message names the op and the
            function (and where it is defined) or the argument at fault, e.g. "Cannot
            serialize the function `parse` given to `map` (defined in foo.py:12):
            TypeError: cannot pickle '_thread.lock' object".
    """
    if not isinstance(dataset, Dataset):
        raise TypeError(f"serialize expects a Dataset, got {type(dataset).__name__}")
    buffers: list[pickle.PickleBuffer] = []

    def in_band(buffer: pickle.PickleBuffer) -> bool:
        if memoryview(buffer).nbytes < MIN_SHARED_BUFFER_BYTES:
            return True
        buffers.append(buffer)
        return False

    try:
        data: bytes = _dumps(dataset, buffer_callback=in_band)
    except Exception as e:
        raise _explain(dataset, e) from e
    definition = dataset_pb2.DatasetDef(pickle=data)
    for buffer in buffers:
        raw = buffer.raw()  # the bytes in memory order (numpy pickles C or F order)
        definition.buffers.add(data=raw.tobytes(), size_bytes=raw.nbytes)
    return definition.SerializeToString()


def parse(data: bytes) -> Any:
    """The `DatasetDef` that `serialize` wrote to `data` (bytes that a version before
    `DatasetDef` wrote, a bare pickle, come back as a `DatasetDef` without buffers).

    Raises:
        InvalidArgumentError: `data` is not a `DatasetDef`.
    """
    if data[:1] == b"\x80":  # the PROTO opcode that starts a pickle; never a DatasetDef
        return dataset_pb2.DatasetDef(pickle=data)
    try:
        definition = dataset_pb2.DatasetDef.FromString(data)
    except DecodeError as e:
        raise InvalidArgumentError(f"Cannot deserialize a dataset: {e}") from e
    if not definition.pickle:
        raise InvalidArgumentError("Cannot deserialize a dataset: the bytes hold no pickle")
    return definition


def deserialize(data: bytes) -> Dataset:
    """The Dataset that `serialize` turned into `data`.

    Raises:
        InvalidArgumentError: `data` is not a serialised Dataset, or unpickling failed
            (e.g. a module a function refers to is not importable here).
    """
    return load(parse(data))


def load(definition: Any) -> Dataset:
    """The Dataset of the `DatasetDef` `definition`, whose buffers are inline or
    files on this host (`DatasetBuffer.path`).

    A file (only ever the dispatcher's, named by the buffer's `sha256`) is
    mapped, not read (`map_buffer_file`): the arrays made from it are
    views of page-cache pages shared with every process that maps the same file.
    An inline buffer is copied into memory of its own. Either way an array is as
    writable as the one that was serialised.

    Raises:
        OSError: A buffer's file cannot be mapped here (gone, another size,
            unreadable); its bytes must be fetched inline.
        InvalidArgumentError: Unpickling failed (e.g. a module a function refers
            to is not importable here), or the bytes are not a Dataset.
    """
    buffers: list[bytearray | mmap.mmap] = []
    for b in definition.buffers:
        if not b.path:
            buffers.append(bytearray(b.data))
            continue
        # The dispatcher names its files by their digest (dispatcher/buffer_store.py).
        if b.sha256 and os.path.basename(b.path) != b.sha256:
            raise OSError(f"{b.path} is not the dispatcher's file of the buffer {b.sha256}")
        buffers.append(map_buffer_file(b.path, b.size_bytes))
    try:
        obj = _Unpickler(io.BytesIO(definition.pickle), buffers=buffers).load()
    except Exception as e:
        raise InvalidArgumentError(f"Cannot deserialize a dataset: {type(e).__name__}: {e}") from e
    if not isinstance(obj, Dataset):
        raise InvalidArgumentError(
            f"Cannot deserialize a dataset: the bytes hold a {type(obj).__name__}"
        )
    return obj


def map_buffer_file(path: str, size_bytes: int) -> mmap.mmap:
    """The file at `path` mapped copy-on-write: its pages are the page cache's,
    shared by every process that maps the file, until this process writes to one.

    It is opened without following a symlink and without blocking, and must
    be a regular file: a FIFO or device in its place is an error, not a hang.

    Raises:
        OSError: It cannot be opened or mapped, is not a regular file, or does
            not hold `size_bytes`.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file (mode {info.st_mode:o})")
        size = info.st_size
        if size != size_bytes or size == 0:
            raise OSError(f"{path} holds {size} bytes, not the {size_bytes} of its buffer")
        return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


def fingerprint(dataset: Dataset) -> str:
    """The hex SHA-256 of `serialize(dataset)` (64 characters); raises as `serialize`."""
    return hashlib.sha256(serialize(dataset)).hexdigest()


def _op(node: Dataset) -> str:
    return getattr(node, "_split_op_name", None) or node._op_name


def _describe_function(fn: Any) -> tuple[str, str]:
    """(name, "file.py:line") of a user function, best effort."""
    target = getattr(fn, "func", fn)  # functools.partial
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    code = getattr(target, "__code__", None)
    if code is None:  # a callable object
        call = type(target).__call__ if callable(target) else None
        code = getattr(call, "__code__", None)
        name = name or type(target).__qualname__
    where = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code else "unknown"
    return name or repr(fn), where


def _pickle_error(obj: Any) -> Exception | None:
    """Why cloudpickle cannot pickle `obj`, or None if it can. Buffers stay out
    of band (not copied), so a big array costs nothing here."""
    try:
        _dumps(obj, buffer_callback=lambda _: False)
    except Exception as e:
        return e
    return None


# A step from an object to one of the things it holds: (kind, name). Kinds that
# start a new named thing: "closure variable", "global", "default argument",
# "attribute" (of the function itself or of `self`); "." and "[]" extend it.
_Step = tuple[str, str]
_MAX_DEPTH = 8
_MAX_ITEMS = 10_000


def _global_names(code: types.CodeType) -> list[str]:
    """The global names `code` and the functions nested in it refer to, as
    cloudpickle collects them for a function pickled by value."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_global_names(const))
    return names


def _parts(obj: Any, root: bool) -> list[tuple[_Step, Any]]:
    """What pickling `obj` pickles with it, each named by the step that reaches it."""
    out: list[tuple[_Step, Any]] = []
    if isinstance(obj, functools.partial):
        out.extend((("partial argument", str(i)), a) for i, a in enumerate(obj.args))
        out.extend((("partial keyword argument", k), v) for k, v in obj.keywords.items())
        return out + _parts(obj.func, root)  # named as the function it wraps
    if isinstance(obj, types.MethodType):
        out.append((("self", "self"), obj.__self__))
        obj = obj.__func__
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        for name, cell in zip(code.co_freevars, obj.__closure__ or (), strict=False):
            try:
                out.append((("closure variable", name), cell.cell_contents))
            except ValueError:  # an empty cell: nothing to pickle
                pass
        seen: set[str] = set()
        for name in _global_names(code):
            if name in obj.__globals__ and name not in seen:
                seen.add(name)
                out.append((("global", name), obj.__globals__[name]))
        positional = code.co_varnames[: code.co_argcount]
        defaults = obj.__defaults__ or ()
        for name, value in zip(
            positional[len(positional) - len(defaults) :], defaults, strict=False
        ):
            out.append((("default argument", name), value))
        for name, value in (obj.__kwdefaults__ or {}).items():
            out.append((("default argument", name), value))
        for name, value in getattr(obj, "__dict__", {}).items():
            out.append((("attribute", f"{obj.__name__}.{name}"), value))
        return out
    if isinstance(obj, (types.ModuleType, type)):
        return out
    if isinstance(obj, dict):
        items = list(obj.items())[:_MAX_ITEMS]
        return [(("[]", f"[{k!r}]"), v) for k, v in items]
    if isinstance(obj, np.ndarray) and obj.dtype == object:  # flat index of the item
        return [(("[]", f"[{i}]"), v) for i, v in enumerate(obj.flat[:_MAX_ITEMS])]
    if isinstance(obj, (list, tuple, set, frozenset)):
        values = list(obj)[:_MAX_ITEMS]
        if isinstance(obj, (set, frozenset)):
            return [(("[]", "{...}"), v) for v in values]
        return [(("[]", f"[{i}]"), v) for i, v in enumerate(values)]
    self_of = getattr(obj, "__self__", None)  # a builtin method: `lock.acquire`
    if self_of is not None and not isinstance(self_of, types.ModuleType):
        return [(("self", "self"), self_of)]
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        if root:  # a callable object given as the function: its `self.attr`
            return [(("attribute", f"self.{k}"), v) for k, v in state.items()]
        return [((".", k), v) for k, v in state.items()]
    return out


def _culprit(obj: Any) -> tuple[list[_Step], Any, Exception] | None:
    """The innermost part of `obj` that cannot be pickled: (steps to it, it,
    its error), or None if `obj` pickles. Runs only once pickling has failed."""
    error = _pickle_error(obj)
    if error is None:
        return None
    steps: list[_Step] = []
    seen = {id(obj)}
    root = True
    while len(steps) < _MAX_DEPTH:
        for step, part in _parts(obj, root):
            if id(part) in seen:
                continue
            part_error = _pickle_error(part)
            if part_error is not None:
                seen.add(id(part))
                steps.append(step)
                obj, error = part, part_error
                break
        else:
            break  # nothing it holds fails alone: `obj` is the one at fault
        root = False
    return steps, obj, error


def _type_name(obj: Any) -> str:
    cls = type(obj)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def _describe_path(steps: list[_Step]) -> str:
    """Steps as words: "closure variable `cfg['lock']`", or, through a nested
    function, "global `helper`, whose closure variable `lock`"."""
    phrases: list[list[str]] = []
    for kind, name in steps:
        if kind in (".", "[]"):
            if not phrases:
                phrases.append(["", ""])
            phrases[-1][1] += f".{name}" if kind == "." else name
        elif kind == "self":  # a bound method's object: its attributes are `self.x`
            phrases.append(["attribute ", "self"])
        else:
            phrases.append([kind + " ", name])
    return ", whose ".join(f"{kind}`{expr}`" for kind, expr in phrases)


def _what_fails(obj: Any) -> str:
    """ ", its closure variable `lock` is a _thread.lock, which cannot be pickled
    (TypeError: ...)" for the part of `obj` at fault, or the error alone."""
    found = _culprit(obj)
    if found is None:
        return ""
    steps, part, error = found
    if not steps:
        return f"{type(error).__name__}: {error}"
    return (
        f"its {_describe_path(steps)} is a {_type_name(part)}, which cannot be pickled "
        f"({type(error).__name__}: {error})"
    )


def _explain(dataset: Dataset, error: Exception) -> ValueError:
    """Finds which function or argument of which node cannot be pickled."""
    nodes = list(dataset._walk())
    for node in nodes:
        for _, fn in node._user_functions():
            try:
                _dumps(fn)
            except Exception as e:
                name, where = _describe_function(fn)
                return ValueError(
                    f"Cannot serialize the function `{name}` given to `{_op(node)}` "
                    f"(defined in {where}): {_what_fails(fn) or f'{type(e).__name__}: {e}'}"
                )
    for node in nodes:
        skip = set(getattr(node, "_input_attrs", ())) | set(getattr(node, "_fn_attrs", ()))
        for attr, value in node.__getstate__().items():
            if attr in skip or isinstance(value, Dataset):
                continue
            try:
                _dumps(value)
            except Exception as e:
                found = _culprit(value)
                inner = ""
                if found is not None and found[0]:
                    inner = (
                        f"; the part at fault is `{attr.lstrip('_')}"
                        f"{_describe_path(found[0]).strip('`')}`, a {_type_name(found[1])}"
                    )
                return ValueError(
                    f"Cannot serialize the `{_op(node)}` dataset: its argument "
                    f"`{attr.lstrip('_')}` ({type(value).__name__}) cannot be pickled: "
                    f"{type(e).__name__}: {e}{inner}"
                )
    return ValueError(f"Cannot serialize the dataset: {type(error).__name__}: {error}")
