"""Dataset graphs <-> bytes (cloudpickle), and fingerprints for dataset_id dedup.

Serialisation is deterministic: a node stores only its constructor arguments
(normalised to plain ints/str/arrays) and never per-process state (epoch counters,
cached specs live in `_t_*` attributes that `Dataset.__getstate__` drops), so two
separately built equal pipelines give identical bytes and the same fingerprint.
Functions are pickled by value when they are not importable (lambdas, closures) and by
reference otherwise, so workers need the same importable modules as the client.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any

import cloudpickle

from dataservice.data.dataset import Dataset
from dataservice.errors import InvalidArgumentError

__all__ = ["deserialize", "fingerprint", "serialize"]

PICKLE_PROTOCOL = 5


def serialize(dataset: Dataset) -> bytes:
    """The pipeline `dataset` as bytes (cloudpickle, protocol 5).

    Raises:
        TypeError: `dataset` is not a Dataset.
        ValueError: Part of it cannot be pickled; the message names the op and the
            function (and where it is defined) or the argument at fault, e.g. "Cannot
            serialize the function `parse` given to `map` (defined in foo.py:12):
            TypeError: cannot pickle '_thread.lock' object".
    """
    if not isinstance(dataset, Dataset):
        raise TypeError(f"serialize expects a Dataset, got {type(dataset).__name__}")
    try:
        data: bytes = cloudpickle.dumps(dataset, protocol=PICKLE_PROTOCOL)
    except Exception as e:
        raise _explain(dataset, e) from e
    return data


def deserialize(data: bytes) -> Dataset:
    """The Dataset that `serialize` turned into `data`.

    Raises:
        InvalidArgumentError: `data` is not a serialised Dataset, or unpickling failed
            (e.g. a module a function refers to is not importable here).
    """
    try:
        obj = pickle.loads(data)
    except Exception as e:
        raise InvalidArgumentError(f"Cannot deserialize a dataset: {type(e).__name__}: {e}") from e
    if not isinstance(obj, Dataset):
        raise InvalidArgumentError(
            f"Cannot deserialize a dataset: the bytes hold a {type(obj).__name__}"
        )
    return obj


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


def _explain(dataset: Dataset, error: Exception) -> ValueError:
    """Finds which function or argument of which node cannot be pickled."""
    nodes = list(dataset._walk())
    for node in nodes:
        for _, fn in node._user_functions():
            try:
                cloudpickle.dumps(fn, protocol=PICKLE_PROTOCOL)
            except Exception as e:
                name, where = _describe_function(fn)
                return ValueError(
                    f"Cannot serialize the function `{name}` given to `{_op(node)}` "
                    f"(defined in {where}): {type(e).__name__}: {e}"
                )
    for node in nodes:
        skip = set(getattr(node, "_input_attrs", ())) | set(getattr(node, "_fn_attrs", ()))
        for attr, value in node.__getstate__().items():
            if attr in skip or isinstance(value, Dataset):
                continue
            try:
                cloudpickle.dumps(value, protocol=PICKLE_PROTOCOL)
            except Exception as e:
                return ValueError(
                    f"Cannot serialize the `{_op(node)}` dataset: its argument "
                    f"`{attr.lstrip('_')}` ({type(value).__name__}) cannot be pickled: "
                    f"{type(e).__name__}: {e}"
                )
    return ValueError(f"Cannot serialize the dataset: {type(error).__name__}: {error}")
