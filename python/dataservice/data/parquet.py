"""`ParquetDataset`: the rows (or record batches) of Parquet files, read with pyarrow.

pyarrow is an optional dependency (the `parquet` extra): it is imported when a
`ParquetDataset` is built or read, never by `import dataservice`.

Row groups are the splits. At construction the client reads each file's footer (row
groups and their row counts, the Arrow schema) and keeps the counts in the dataset, so
the dispatcher hands out row groups without opening any file: split k is the k-th row
group counting through the files in their given order (an `IndexSplitProvider`), and
each row is produced once per epoch across the workers under DYNAMIC sharding. FILE
sharding gives each worker every n-th file (`graph.with_source_files`).

How Arrow types become element leaves (one row, `batch_rows=None`):

* integer, floating point, bool -> numpy scalar of that dtype (`np.int64`, ...);
  timestamp / date / duration -> `np.datetime64` / `np.timedelta64` scalar (a time
  zone is dropped: the value is UTC);
* string -> `str`; binary -> `bytes`; dictionary-encoded -> its value type;
* list / large_list / fixed_size_list of the above numbers, possibly with
  fixed_size_list levels inside (`list<fixed_size_list<float, 3>>`) -> a numpy array,
  shape `(None,)` / `(n,)` / `(None, 3)` in `element_spec`;
* struct -> a dict of its fields, converted the same way.

Other types (map, union, decimal, null, time of day, a list of strings, a list nested
in a variable-length list) are refused when the dataset is built, naming the column
and its type; null values are refused when read, naming the column, file and row group.

Source of the conventions: pyarrow's `Array.to_numpy` dtypes; tf.data's element and
batch semantics for the rest (`batching.py`).
"""

from __future__ import annotations

import bisect
import copy
import importlib
import math
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataservice.data import batching
from dataservice.data.dataset import Dataset, Element, IterContext
from dataservice.data.ops import parallelism
from dataservice.data.runtime import close_iterator, interleave
from dataservice.data.splits import IndexSplitProvider, SplitProvider
from dataservice.data.structure import TensorSpec
from dataservice.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)

__all__ = ["ParquetDataset"]

_OP = "ParquetDataset"
_READ_BATCH_ROWS = 4096  # rows per Arrow record batch when yielding rows
_METADATA_THREADS = 16  # footers read at once when building a dataset of many files


def _pyarrow() -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet), imported on first use.

    Raises:
        ImportError: pyarrow is not installed; the message names the extra.
    """
    try:
        pa = importlib.import_module("pyarrow")
        pq = importlib.import_module("pyarrow.parquet")
    except ImportError as e:
        raise ImportError(
            "ParquetDataset needs pyarrow: pip install 'dataservice[parquet]' "
            "(or pip install 'pyarrow>=14')"
        ) from e
    return pa, pq


# ---------------------------------------------------------------------------- types


@dataclass(frozen=True)
class _Column:
    """How one column (or a struct's field) becomes element leaves.

    kind: "number" (numpy scalar), "str", "bytes", "list" (numpy array of `dims`,
    None for the variable outer length) or "struct" (dict of `fields`).
    """

    name: str  # dotted for a struct's field: "point.x"
    kind: str
    dtype: np.dtype | None = None
    dims: tuple[int | None, ...] = ()
    fields: tuple[_Column, ...] = ()

    def spec(self) -> Any:
        if self.kind == "struct":
            return {f.name.rsplit(".", 1)[-1]: f.spec() for f in self.fields}
        if self.kind == "str":
            return TensorSpec((), str)
        if self.kind == "bytes":
            return TensorSpec((), bytes)
        assert self.dtype is not None  # "number" and "list" columns have one
        return TensorSpec(self.dims, self.dtype)


_SUPPORTED = (
    "integer, floating point, bool, timestamp, date, duration, string, binary, "
    "dictionary of those, list/large_list/fixed_size_list of numbers, struct of these"
)


def _unsupported(name: str, typ: Any, why: str = "") -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{_OP}: column {name!r} has Arrow type {typ}, which cannot become numpy values"
        f"{why} (supported: {_SUPPORTED}); leave it out with columns=[...]"
    )


def _number_dtype(pa: Any, typ: Any) -> np.dtype | None:
    """The numpy dtype pyarrow gives `typ`, if `typ` is a number-like primitive."""
    t = pa.types
    if not (
        t.is_integer(typ)
        or t.is_floating(typ)
        or t.is_boolean(typ)
        or t.is_timestamp(typ)
        or t.is_date(typ)
        or t.is_duration(typ)
    ):
        return None
    dtype = pa.array([], type=typ).to_numpy(zero_copy_only=False).dtype
    return dtype if dtype.kind in "biufcmM" else None


def _is_string(pa: Any, typ: Any) -> bool:
    t = pa.types
    return bool(t.is_string(typ) or t.is_large_string(typ) or _is(t, "is_string_view", typ))


def _is_binary(pa: Any, typ: Any) -> bool:
    t = pa.types
    return bool(
        t.is_binary(typ)
        or t.is_large_binary(typ)
        or t.is_fixed_size_binary(typ)
        or _is(t, "is_binary_view", typ)
    )


def _is(types: Any, predicate: str, typ: Any) -> bool:
    fn = getattr(types, predicate, None)  # newer pyarrow only
    return bool(fn(typ)) if fn is not None else False


def _plan(pa: Any, name: str, typ: Any) -> _Column:
    """The conversion of a column named `name` of Arrow type `typ`.

    Raises:
        InvalidArgumentError: `typ` is not supported (see the module docstring).
    """
    t = pa.types
    if t.is_dictionary(typ):
        return _plan(pa, name, typ.value_type)
    dtype = _number_dtype(pa, typ)
    if dtype is not None:
        return _Column(name, "number", dtype)
    if _is_string(pa, typ):
        return _Column(name, "str")
    if _is_binary(pa, typ):
        return _Column(name, "bytes")
    if t.is_struct(typ):
        if typ.num_fields == 0:
            raise _unsupported(name, typ, " (a struct without fields)")
        fields = tuple(
            _plan(pa, f"{name}.{typ.field(i).name}", typ.field(i).type)
            for i in range(typ.num_fields)
        )
        return _Column(name, "struct", fields=fields)
    if t.is_list(typ) or t.is_large_list(typ) or t.is_fixed_size_list(typ):
        dims: list[int | None] = [typ.list_size if t.is_fixed_size_list(typ) else None]
        inner = typ.value_type
        while t.is_fixed_size_list(inner):
            dims.append(inner.list_size)
            inner = inner.value_type
        dtype = _number_dtype(pa, inner)
        if dtype is None:
            why = (
                " (a variable-length list inside a list: the rows would be ragged)"
                if t.is_list(inner) or t.is_large_list(inner)
                else f" (lists of {inner} are not arrays of numbers)"
            )
            raise _unsupported(name, typ, why)
        return _Column(name, "list", dtype, tuple(dims))
    raise _unsupported(name, typ)


# ---------------------------------------------------------------------------- values


def _no_nulls(col: _Column, arr: Any, where: str) -> None:
    if arr.null_count:
        raise InvalidArgumentError(
            f"{_OP}: column {col.name!r} has {arr.null_count} null value(s) in {where}; "
            "null values cannot become numpy values (fill them when writing the file, or "
            "leave the column out with columns=[...])"
        )


def _numbers(arr: Any) -> np.ndarray:
    return arr.to_numpy(zero_copy_only=False, writable=True)  # a copy the caller owns


def _list_values(pa: Any, col: _Column, arr: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64[n + 1] into `values`, values of shape [total, *inner dims])."""
    inner = col.dims[1:]
    if col.dims[0] is None:
        raw = np.asarray(arr.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
        offsets = raw - raw[0]
    else:
        offsets = np.arange(len(arr) + 1, dtype=np.int64) * col.dims[0]
    flat = arr.flatten()  # honours the array's slice offset
    for _ in inner:
        _no_nulls(col, flat, where)
        flat = flat.flatten()
    _no_nulls(col, flat, where)
    values = _numbers(flat)
    return offsets, values.reshape(-1, *inner) if inner else values


def _rows(pa: Any, col: _Column, arr: Any, where: str) -> Sequence[Any] | np.ndarray:
    """The value of each row of column `col` (Arrow array `arr`), indexable by row."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    _no_nulls(col, arr, where)
    if col.kind == "number":
        return _numbers(arr)  # indexing gives numpy scalars
    if col.kind in ("str", "bytes"):
        return arr.to_pylist()
    if col.kind == "list":
        offsets, values = _list_values(pa, col, arr, where)
        return [values[offsets[i] : offsets[i + 1]].copy() for i in range(len(arr))]
    children = arr.flatten()
    keys = [f.name.rsplit(".", 1)[-1] for f in col.fields]
    child_rows = [_rows(pa, f, c, where) for f, c in zip(col.fields, children, strict=True)]
    return [{k: rows[i] for k, rows in zip(keys, child_rows, strict=True)} for i in range(len(arr))]


def _batch(pa: Any, col: _Column, arr: Any, where: str) -> Any:
    """Column `col` of a record batch as one batched leaf (tf.data's `batch` types:
    numbers stacked, `str` as a numpy str array, `bytes` as an object array)."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    _no_nulls(col, arr, where)
    if col.kind == "number":
        return _numbers(arr)
    if col.kind == "str":
        return np.array(arr.to_pylist(), dtype=str)
    if col.kind == "bytes":
        out = np.empty(len(arr), dtype=object)
        out[:] = arr.to_pylist()
        return out
    if col.kind == "list":
        offsets, values = _list_values(pa, col, arr, where)
        lengths = np.diff(offsets)
        if lengths.size and (lengths != lengths[0]).any():
            a, b = (int(x) for x in np.unique(lengths)[:2])
            raise InvalidArgumentError(
                f"{_OP}: cannot batch column {col.name!r} ({arr.type}) in {where}: its lists "
                f"have different lengths ({a} and {b}) within batch_rows rows; read rows "
                "(batch_rows=None) and pad them before batching, or write the column as a "
                "fixed_size_list"
            )
        length = int(lengths[0]) if lengths.size else 0
        return values.reshape(len(arr), length, *col.dims[1:])
    children = arr.flatten()
    return {
        f.name.rsplit(".", 1)[-1]: _batch(pa, f, c, where)
        for f, c in zip(col.fields, children, strict=True)
    }


# ---------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class _FileInfo:
    """What the client read from one file's footer."""

    row_group_rows: tuple[int, ...]  # rows of each row group
    column_types: tuple[str, ...]  # str(Arrow type) of each selected column


def _names(filenames: Any) -> tuple[str, ...]:
    if isinstance(filenames, str | bytes | os.PathLike):
        return (os.fsdecode(filenames),)
    if isinstance(filenames, list | tuple | np.ndarray):
        names = tuple(os.fsdecode(f) for f in filenames)
        if not names:
            raise InvalidArgumentError(f"{_OP}: `filenames` is empty")
        return names
    if isinstance(filenames, Dataset):
        raise TypeError(
            f"{_OP} reads a list of file names, not a Dataset of them (it reads each file's "
            "row groups when it is built); use ParquetDataset(names), or "
            "Dataset.list_files(pattern).interleave(lambda f: ParquetDataset(f)) for names "
            "only known at run time"
        )
    raise TypeError(
        f"{_OP}: `filenames` must be a str or a list of str, got {type(filenames).__name__}"
    )


def _read_footer(pq: Any, name: str) -> Any:
    """The `FileMetaData` of `name`.

    Raises:
        NotFoundError: `name` does not exist.
        InvalidArgumentError: `name` is not a Parquet file (or a directory, or damaged).
    """
    try:
        return pq.read_metadata(name)
    except FileNotFoundError:
        raise NotFoundError(f"{_OP}: {name}: no such file") from None
    except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
        raise InvalidArgumentError(f"{_OP}: {name} is not a readable Parquet file: {e}") from None


def _schema(meta: Any, name: str) -> Any:
    try:
        return meta.schema.to_arrow_schema()
    except (OSError, ValueError, NotImplementedError) as e:
        raise InvalidArgumentError(f"{_OP}: {name}: cannot read its Arrow schema: {e}") from None


# ---------------------------------------------------------------------------- dataset


class ParquetDataset(Dataset):
    """The rows of Parquet files as dicts of column name -> numpy value, read with pyarrow.

    >>> import pyarrow as pa, pyarrow.parquet as pq, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "t.parquet")
    >>> pq.write_table(pa.table({"x": [1, 2, 3], "name": ["a", "b", "c"]}), path)
    >>> [(int(r["x"]), r["name"]) for r in ParquetDataset(path)]
    [(1, 'a'), (2, 'b'), (3, 'c')]
    >>> [b["x"].tolist() for b in ParquetDataset(path, columns=["x"], batch_rows=2)]
    [[1, 2], [3]]

    Args:
        filenames: A file name or a list of them, read in this order (file after file,
            each file's row groups in order).
        columns: The column names to read (the element's dict keys, in this order
            in-process; through the service dicts arrive with their keys sorted, as every
            nest), or None for all columns. Top-level names (a struct comes whole).
        batch_rows: None: one element per row, e.g. {"x": int64[], "name": str}. An
            int: elements are record batches of up to `batch_rows` rows as a dict of
            batched columns ({"x": int64[n], "name": str_[n]}, bytes as object[n]), as
            `.batch(batch_rows)` of the rows would give, except that a batch never
            spans two row groups: each row group's last batch may be short (so a
            worker can read a row group alone). A list column batches to
            `[n, length, ...]` when its lists in the batch have equal lengths.
        num_parallel_reads: None or 1: row groups one after another. >1 or AUTOTUNE:
            that many row groups (the CPU count) are read at once on daemon threads and
            their elements interleaved one at a time (as `TFRecordDataset` does files).

    Element spec and cardinality are known without reading rows (from the footers):
    cardinality is the number of rows (of batches with `batch_rows`).

    The footers are read here, on the client: missing files, files that are not
    Parquet, absent columns, unsupported types and files whose schemas differ fail at
    once. Reading happens where the dataset is iterated (a worker), which must see the
    same files under the same names.

    Raises:
        ImportError: pyarrow is not installed (`pip install 'dataservice[parquet]'`).
        TypeError: `filenames` or `columns` has the wrong type.
        ValueError: `num_parallel_reads` is neither None, AUTOTUNE nor positive.
        NotFoundError: A file does not exist.
        InvalidArgumentError: A file is not a Parquet file; a column is absent from a
            file, has an unsupported type, or has another type than in the first file;
            with `columns=None`, the files have different columns; `batch_rows` < 1.
    """

    _op_name = _OP
    _is_splittable_source = True

    def __init__(
        self,
        filenames: Any,
        columns: Sequence[str] | None = None,
        batch_rows: int | None = None,
        num_parallel_reads: int | None = None,
    ) -> None:
        pa, pq = _pyarrow()
        parallelism(num_parallel_reads, _OP)  # checks it; resolved where it is read
        names = _names(filenames)
        if columns is not None:
            if isinstance(columns, str | bytes) or not all(isinstance(c, str) for c in columns):
                raise TypeError(f"{_OP}: `columns` must be a list of str, got {columns!r}")
            columns = tuple(columns)
            if not columns:
                raise InvalidArgumentError(f"{_OP}: `columns` is empty")
            if len(set(columns)) != len(columns):
                raise InvalidArgumentError(f"{_OP}: `columns` names a column twice: {columns}")
        if batch_rows is not None:
            if isinstance(batch_rows, bool) or not isinstance(batch_rows, int | np.integer):
                raise TypeError(f"{_OP}: `batch_rows` must be an int, got {batch_rows!r}")
            if batch_rows < 1:
                raise InvalidArgumentError(f"{_OP}: `batch_rows` must be >= 1, got {batch_rows}")
            batch_rows = int(batch_rows)

        unique = list(dict.fromkeys(names))
        if len(unique) > 1:
            with ThreadPoolExecutor(min(_METADATA_THREADS, len(unique))) as pool:
                metas = list(pool.map(lambda n: _read_footer(pq, n), unique))
        else:
            metas = [_read_footer(pq, unique[0])]
        first_schema = _schema(metas[0], unique[0])
        all_columns = columns is None
        if columns is None:
            columns = tuple(first_schema.names)
        infos: dict[str, _FileInfo] = {}
        first_types: tuple[Any, ...] | None = None
        for name, meta in zip(unique, metas, strict=True):
            schema = _schema(meta, name)
            if all_columns and set(schema.names) != set(first_schema.names):
                raise InvalidArgumentError(
                    f"{_OP}: {name} has columns {schema.names}, {unique[0]} has "
                    f"{first_schema.names}; give columns=[...] to read the common ones"
                )
            types = []
            for c in columns:
                index = schema.get_field_index(c)  # -1 for a name used twice too
                if len(schema.get_all_field_indices(c)) > 1:
                    raise InvalidArgumentError(
                        f"{_OP}: {name} has two columns named {c!r}: cannot tell which to read"
                    )
                if index < 0:
                    raise InvalidArgumentError(
                        f"{_OP}: column {c!r} is not in {name} (its columns: {schema.names})"
                    )
                types.append(schema.field(index).type)
            if first_types is None:
                first_types = tuple(types)
            else:
                for c, t0, t in zip(columns, first_types, types, strict=True):
                    if t != t0:
                        raise InvalidArgumentError(
                            f"{_OP}: column {c!r} has type {t} in {name} but {t0} in "
                            f"{unique[0]}: all files must have the same types"
                        )
            rows = tuple(int(meta.row_group(i).num_rows) for i in range(int(meta.num_row_groups)))
            infos[name] = _FileInfo(rows, tuple(str(t) for t in types))
        assert first_types is not None
        plans = [_plan(pa, c, t) for c, t in zip(columns, first_types, strict=True)]

        self._filenames = names
        self._columns: tuple[str, ...] = columns
        self._batch_rows = batch_rows
        self._num_parallel_reads = num_parallel_reads
        self._infos = tuple(infos[n] for n in names)
        row_spec = {p.name: p.spec() for p in plans}
        self._spec = row_spec if batch_rows is None else batching.batched_spec(row_spec, None)

    @property
    def filenames(self) -> tuple[str, ...]:
        """The file names, in reading order."""
        return self._filenames

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns read, in the order of each element's keys."""
        return self._columns

    def _with_files(self, files: tuple[str, ...]) -> ParquetDataset:
        """A copy reading `files`, a subset of these files (FILE sharding)."""
        info = dict(zip(self._filenames, self._infos, strict=True))
        unknown = [f for f in files if f not in info]
        if unknown:
            raise InvalidArgumentError(f"{_OP}: {unknown[0]} is not one of this dataset's files")
        new = copy.copy(self)
        new._filenames = tuple(files)
        new._infos = tuple(info[f] for f in files)
        return new

    def _row_groups(self) -> list[tuple[int, int]]:
        """(file index, row group index) of every split, in split order."""
        return [
            (f, g) for f, info in enumerate(self._infos) for g in range(len(info.row_group_rows))
        ]

    def _compute_cardinality(self) -> int:
        rows = [n for info in self._infos for n in info.row_group_rows]
        if self._batch_rows is None:
            return sum(rows)
        return sum(math.ceil(n / self._batch_rows) for n in rows)

    def _static_element_spec(self) -> Any:
        return self._spec

    def _split_provider(self, seed: int | None) -> SplitProvider:
        return IndexSplitProvider(sum(len(i.row_group_rows) for i in self._infos))

    def _make_iterator(self, ctx: IterContext) -> Iterator[Element]:
        from dataservice.data.sources import _split_source, _splits  # see "Modules"

        source = _split_source(ctx, self._op_name)
        if source is None:
            row_groups: Iterator[tuple[int, int]] = iter(self._row_groups())
        else:
            row_groups = self._splits_to_row_groups(_splits(source))
        reads = parallelism(self._num_parallel_reads, _OP)
        if reads > 1:
            return interleave(row_groups, self._read_one, reads, 1, parallel=True)
        return self._read(row_groups)

    def _splits_to_row_groups(self, splits: Iterator[Any]) -> Iterator[tuple[int, int]]:
        """Split k -> the k-th (file index, row group index) in file order."""
        from dataservice.data.sources import _split_index  # see "Modules"

        starts = [0]
        for info in self._infos:
            starts.append(starts[-1] + len(info.row_group_rows))
        try:
            for split in splits:
                k = _split_index(split, starts[-1], self._op_name)
                f = bisect.bisect_right(starts, k) - 1
                yield f, k - starts[f]
        finally:
            close_iterator(splits)

    def _read(self, row_groups: Iterator[tuple[int, int]]) -> Iterator[Element]:
        pa, pq = _pyarrow()
        open_index = -1
        pf: Any = None
        plans: list[_Column] = []
        try:
            for f, g in row_groups:
                name = self._filenames[f]
                if f != open_index:
                    if pf is not None:
                        pf.close()
                        pf = None
                    pf, plans = self._open(pa, pq, f)
                    open_index = f
                yield from self._read_row_group(pa, pf, plans, name, g)
        finally:
            close_iterator(row_groups)
            if pf is not None:
                pf.close()

    def _read_one(self, row_group: tuple[int, int]) -> Iterator[Element]:
        """The elements of one (file index, row group index), the file opened for it."""
        pa, pq = _pyarrow()
        f, g = row_group
        pf, plans = self._open(pa, pq, f)
        try:
            yield from self._read_row_group(pa, pf, plans, self._filenames[f], g)
        finally:
            pf.close()

    def _open(self, pa: Any, pq: Any, f: int) -> tuple[Any, list[_Column]]:
        """File `f` opened, checked against its footer as read at construction.

        Raises:
            NotFoundError: The file is not there (on this host).
            DataLossError: It is not a readable Parquet file any more.
            FailedPreconditionError: Its row groups or column types changed since the
                dataset was built.
        """
        name = self._filenames[f]
        info = self._infos[f]
        try:
            pf = pq.ParquetFile(name, memory_map=False)
        except FileNotFoundError:
            raise NotFoundError(f"{_OP}: {name}: no such file") from None
        except (OSError, ValueError) as e:
            raise DataLossError(f"{_OP}: {name} is not a readable Parquet file: {e}") from None
        try:
            meta = pf.metadata
            rows = tuple(int(meta.row_group(i).num_rows) for i in range(meta.num_row_groups))
            schema = pf.schema_arrow
            types = []
            for c in self._columns:
                index = schema.get_field_index(c)
                types.append(None if index < 0 else schema.field(index).type)
            if rows != info.row_group_rows or tuple(map(str, types)) != info.column_types:
                raise FailedPreconditionError(
                    f"{_OP}: {name} changed since the dataset was built: it had row groups "
                    f"of {list(info.row_group_rows)} rows and column types "
                    f"{list(info.column_types)}, it has {list(rows)} and "
                    f"{[str(t) for t in types]}"
                )
            plans = [_plan(pa, c, t) for c, t in zip(self._columns, types, strict=True)]
        except BaseException:
            pf.close()
            raise
        return pf, plans

    def _read_row_group(
        self, pa: Any, pf: Any, plans: list[_Column], name: str, g: int
    ) -> Iterator[Element]:
        where = f"{name} row group {g}"
        size = self._batch_rows or _READ_BATCH_ROWS
        batches = pf.iter_batches(
            batch_size=size, row_groups=[g], columns=list(self._columns), use_threads=False
        )
        pending: list[Any] = []
        pending_rows = 0
        while True:
            try:
                batch = next(batches, None)
            except (OSError, ValueError) as e:  # damaged pages: ArrowInvalid, OSError
                raise DataLossError(f"{_OP}: cannot read {where}: {e}") from None
            if self._batch_rows is None:
                if batch is None:
                    return
                yield from self._batch_rows_of(pa, plans, batch, where)
                continue
            # Record batches as pyarrow cuts them may be shorter than asked; re-cut
            # them to exactly batch_rows rows (the row group's last may be short).
            if batch is not None:
                pending.append(batch)
                pending_rows += batch.num_rows
                if pending_rows < size:
                    continue
            if not pending_rows:
                return
            table = pa.Table.from_batches(pending)
            start = 0
            while pending_rows - start >= size or (batch is None and start < pending_rows):
                piece = table.slice(start, size).combine_chunks()
                start += piece.num_rows
                # combine_chunks leaves one chunk per column (the piece has rows)
                yield {
                    p.name: _batch(pa, p, piece.column(k).chunk(0), where)
                    for k, p in enumerate(plans)
                }
            rest = table.slice(start)
            pending = rest.to_batches() if rest.num_rows else []
            pending_rows = rest.num_rows
            if batch is None:
                return

    def _batch_rows_of(
        self, pa: Any, plans: list[_Column], batch: Any, where: str
    ) -> Iterator[Element]:
        columns = [(p.name, _rows(pa, p, batch.column(k), where)) for k, p in enumerate(plans)]
        for i in range(batch.num_rows):
            yield {name: rows[i] for name, rows in columns}
