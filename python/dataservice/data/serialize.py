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

A pipeline's identity (`fingerprint`, the dataset id a dispatcher gives it, and so which
named job it can share) is what it computes, not where or in which process it was
built: two trainers running the same script from two checkouts, on two hosts, get
the same fingerprint. cloudpickle's output holds three things that differ between
such trainers, and the pickle is written without them:
- the path of the file that defined a function pickled by value, as its module's
  `__file__` (cloudpickle writes its code's `co_filename` as "<dynamic-code>", which
  the consumer names again, errors.py): the pickle keeps the file's base name and an
  index into `DatasetDef.code_paths`, which holds the full paths, and `load` puts
  them back (those of the trainer that registered the dataset first). The
  fingerprint leaves `code_paths` out (`definition_fingerprint`);
- the order of a set's or frozenset's items (a constant such as `x in {"a", "b"}`
  too), which for strings follows the process's hash seed: written sorted;
- the random id cloudpickle gives a class pickled by value (a class defined in the
  script): replaced by a digest of the class's own pickle, so a worker that loads two
  datasets with the same class reuses it, and one with another class of the same
  name does not.
Line numbers stay: the same file in two places has the same lines.
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
import threading
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
    "definition_fingerprint",
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


class _CodePath:
    """The path of a code file in a pickle: its base name and its index in
    `DatasetDef.code_paths`; unpickled as the full path (`_code_path`)."""

    __slots__ = ("index", "name")

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.index = index


# While `load` unpickles: the `DatasetDef.code_paths` of the definition.
_loading = threading.local()

_SORTED_SET = "dataservice.sorted_set"
_PLAIN_TYPES = (str, bytes, int, float, bool, type(None))


def _plain(value: Any) -> bool:
    """Whether `value` orders the same in every process by `_plain_key`."""
    if type(value) is tuple:
        return all(_plain(v) for v in value)
    return type(value) in _PLAIN_TYPES


def _plain_key(value: Any) -> tuple[str, str]:
    return type(value).__name__, repr(value)


class _HashWriter:
    """A file that hashes what is written to it (the pickle of a class, for its id)."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return len(data)


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle's pickler that refuses open files (`_OPEN_FILE_TYPES`), naming
    the file and the fix (the standard streams keep cloudpickle's by-name pickling),
    and writes the same bytes for the same pipeline in any process and from any
    directory (the module docstring says how). `code_paths` holds the full paths
    of the code files it replaced by an index, in the order of the indices."""

    def __init__(
        self,
        file: Any,
        protocol: int = PICKLE_PROTOCOL,
        buffer_callback: Any = None,
        class_ids: dict[int, str] | None = None,
    ) -> None:
        super().__init__(file, protocol=protocol, buffer_callback=buffer_callback)
        self.code_paths: list[str] = []
        self._path_index: dict[str, int] = {}
        # id(class) -> the id it is pickled with; "" while its digest is computed
        # (a reference to the class from inside it). Shared with nested picklers.
        self._class_ids: dict[int, str] = {} if class_ids is None else class_ids

    def _code_path(self, path: str) -> _CodePath:
        index = self._path_index.get(path)
        if index is None:
            index = self._path_index[path] = len(self.code_paths)
            self.code_paths.append(path)
        return _CodePath(os.path.basename(path), index)

    def persistent_id(self, obj: Any) -> Any:
        # Called for every object (sets are pickled before reducer_override is asked).
        kind = type(obj)
        if (kind is set or kind is frozenset) and all(_plain(v) for v in obj):
            return (_SORTED_SET, kind is frozenset, tuple(sorted(obj, key=_plain_key)))
        return None

    def _relocate_file_global(self, namespace: dict[str, Any]) -> None:
        path = namespace.get("__file__")
        if isinstance(path, str) and os.sep in path:
            namespace["__file__"] = self._code_path(path)

    def _function_getnewargs(self, func: Any) -> Any:
        # The namespace the function gets (cloudpickle's dict, not the module's).
        code, base_globals, name, argdefs, closure = super()._function_getnewargs(func)
        self._relocate_file_global(base_globals)
        return code, base_globals, name, argdefs, closure

    def _dynamic_function_reduce(self, func: Any) -> Any:
        reduced = super()._dynamic_function_reduce(func)
        _, slotstate = reduced[2]  # the globals the function names (a dict of its own)
        self._relocate_file_global(slotstate.get("__globals__", {}))
        return reduced

    def _class_id(self, cls: type) -> str:
        """A digest of the pickle of `cls` written with "" as its own id: the same
        in every process for the same class (cloudpickle's is random)."""
        found = self._class_ids.get(id(cls))
        if found is not None:
            return found
        self._class_ids[id(cls)] = ""
        out = _HashWriter()

        def hash_buffer(buffer: pickle.PickleBuffer) -> bool:
            out.digest.update(buffer.raw())
            return False  # out of band: hashed, not copied

        _Pickler(out, PICKLE_PROTOCOL, hash_buffer, self._class_ids).dump(cls)
        self._class_ids[id(cls)] = found = out.digest.hexdigest()[:32]
        return found

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
        if isinstance(obj, _CodePath):
            return _code_path, (obj.name, obj.index)
        reduced = super().reducer_override(obj)
        if isinstance(reduced, tuple) and reduced[0] in _SKELETONS:
            args = list(reduced[1])
            args[_SKELETONS[reduced[0]]] = self._class_id(obj)
            reduced = (reduced[0], tuple(args), *reduced[2:])
        return reduced


# cloudpickle's constructors of a class pickled by value -> the position of its
# class_tracker_id argument.
_SKELETONS = {
    cloudpickle.cloudpickle._make_skeleton_class: 4,
    cloudpickle.cloudpickle._make_skeleton_enum: 5,
}


def _code_path(name: str, index: int) -> str:
    """The full path of code file `index` of the definition being loaded, or its
    base name `name` when the definition holds no such path."""
    paths = getattr(_loading, "code_paths", None)
    if paths is not None and 0 <= index < len(paths):
        return str(paths[index])
    return name


def _dumps(obj: Any, buffer_callback: Any = None) -> bytes:
    """`cloudpickle.dumps(obj, PICKLE_PROTOCOL, buffer_callback=...)` with `_Pickler`."""
    return _dump_with_paths(obj, buffer_callback)[0]


def _dump_with_paths(obj: Any, buffer_callback: Any = None) -> tuple[bytes, list[str]]:
    """`_dumps`, and the full paths of the code files it replaced by an index."""
    with io.BytesIO() as out:
        pickler = _Pickler(out, protocol=PICKLE_PROTOCOL, buffer_callback=buffer_callback)
        pickler.dump(obj)
        return out.getvalue(), pickler.code_paths


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
    """`pickle.Unpickler` that finds a moved class (`_MOVED_CLASSES`) where it is now
    and reads the sets `_Pickler` wrote sorted."""

    def find_class(self, module: str, name: str) -> Any:
        module, name = _MOVED_CLASSES.get((module, name), (module, name))
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 3 and pid[0] == _SORTED_SET:
            return frozenset(pid[2]) if pid[1] else set(pid[2])
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r:.80}")


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
        data, code_paths = _dump_with_paths(dataset, buffer_callback=in_band)
    except Exception as e:
        raise _explain(dataset, e) from e
    definition = dataset_pb2.DatasetDef(pickle=data, code_paths=code_paths)
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
    _loading.code_paths = definition.code_paths
    try:
        obj = _Unpickler(io.BytesIO(definition.pickle), buffers=buffers).load()
    except Exception as e:
        raise InvalidArgumentError(f"Cannot deserialize a dataset: {type(e).__name__}: {e}") from e
    finally:
        _loading.code_paths = None
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
    """`definition_fingerprint(serialize(dataset))`: 64 hex characters, the same for
    the same pipeline built in any process, from any directory; raises as `serialize`."""
    return definition_fingerprint(serialize(dataset))


def definition_fingerprint(data: bytes, definition: Any = None) -> str:
    """The hex SHA-256 (64 characters) of the serialised `DatasetDef` `data` less its
    `code_paths`: what a dispatcher dedups registrations by (`RegisterDatasetRequest.
    fingerprint`). For a definition without code paths, and for bytes that are no
    `DatasetDef` (refused when registered), it is the SHA-256 of `data`.
    `definition`, if given, is `parse(data)` (not changed), saving a parse.
    """
    given = definition is not None
    if not given:
        try:
            definition = parse(data)
        except InvalidArgumentError:
            definition = None
    if definition is None or not definition.code_paths:
        return hashlib.sha256(data).hexdigest()
    if given:  # the caller's: cleared on a copy (its buffers too)
        definition = _copy(definition)
    definition.ClearField("code_paths")
    return hashlib.sha256(definition.SerializeToString(deterministic=True)).hexdigest()


def _copy(definition: Any) -> Any:
    copy = dataset_pb2.DatasetDef()
    copy.CopyFrom(definition)
    return copy


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
