"""Datasets: RegisterDataset, GetDatasetDef, GetElementSpec, and the
unpickled dataset object that split providers are built from.

Owns `DatasetsMixin`: registration (dedup by fingerprint or requested id,
buffers written to files outside the lock, the definition journaled) and
`_dataset_object` (the `Dataset` of a dataset id, loaded once, outside the
lock; `_loaded_dataset_locked` is its cached form for handlers under the lock).

Fields (`base.DispatcherBase`; all guarded by `self._mu`): reads `_state`,
`_journal`, `_buffers`; writes `_datasets` (dataset_id -> DatasetDef) and
`_dataset_objects` (dataset_id -> Dataset, filled under `self._load_mu`);
`_state` changes only through `_apply_locked`.
"""

from __future__ import annotations

from typing import Any

from dataservice import errors
from dataservice.dispatcher import state as st
from dataservice.dispatcher.base import DispatcherBase, NotLoaded, log
from dataservice.dispatcher.buffer_store import check_inline
from dataservice.locality import host_id
from dataservice.rpc import service_pb2 as pb


def registered_compression(request: Any) -> str:
    """The compression a RegisterDatasetRequest asks its readers by id to use:
    "AUTO", "NONE" or "ZSTD" (its `compression`, validated at the edge; empty
    means none, as `register_dataset(compression=None)` sends it)."""
    return request.compression.upper() or "NONE"


class RegisterRequest:
    """A RegisterDatasetRequest whose `dataset` (bytes: the serialised
    pipeline with the arrays it captures, up to GiBs) is read out of the
    message once. Each read of a protobuf bytes field is a fresh copy made
    holding the GIL (0.4 s for 280 MiB on a 2-core VM): the edge checks, the
    parse and the journal's copy each read it, and the dispatcher's other
    RPCs and its liveness checks wait meanwhile. Every other attribute is the
    message's."""

    __slots__ = ("_definition", "_request", "dataset")

    def __init__(self, request: Any) -> None:
        self._request = request
        self.dataset: bytes = request.dataset
        self._definition: Any = None

    @property
    def definition(self) -> Any:
        """`serialize.parse(dataset)`, parsed once (the edge check of the
        fingerprint and the handler both need it), or None if it does not
        parse (the handler's own parse raises the error)."""
        if self._definition is None:
            from dataservice.data.serialize import parse

            try:
                self._definition = parse(self.dataset)
            except errors.InvalidArgumentError:
                return None
        return self._definition

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class DatasetsMixin(DispatcherBase):
    """The dataset RPCs of `DispatchServer` (see the module docstring)."""

    def _dataset_object(self, dataset_id: str) -> Any:
        """The `Dataset` of `dataset_id`, loaded from its definition once and
        cached in `_dataset_objects`.

        Call without `self._mu` held: loading unpickles the pipeline and maps its
        buffer files, I/O that RPCs must not wait for. `self._load_mu` makes a
        racing second caller wait for the first one's object, so that a dataset
        has one object (split providers are built from it).

        Raises:
            NotFoundError: No dataset has this id.
            DataLossError: A buffer file of the dataset is unreadable.
        """
        from dataservice.data.serialize import load

        with self._mu:
            obj = self._dataset_objects.get(dataset_id)
        if obj is not None:
            return obj
        with self._load_mu:
            with self._mu:
                obj = self._dataset_objects.get(dataset_id)
                definition = self._datasets.get(dataset_id)
            if obj is not None:
                return obj
            if definition is None:
                raise errors.NotFoundError(f"Dataset id {dataset_id} not found")
            try:
                obj = load(definition)  # maps the buffer files
            except OSError as err:
                raise errors.DataLossError(
                    f"dataset {dataset_id}: a buffer file is unreadable: {err}"
                ) from err
            with self._mu:
                # Not cached if the dispatcher recovered meanwhile (a new definition).
                if self._datasets.get(dataset_id) is definition:
                    self._dataset_objects[dataset_id] = obj
            return obj

    def _loaded_dataset_locked(self, dataset_id: str) -> Any:
        """The cached `Dataset` of `dataset_id`.

        Raises:
            NotLoaded: It is not loaded yet; its `load` loads it (outside the lock).
        """
        obj = self._dataset_objects.get(dataset_id)
        if obj is None:
            raise NotLoaded(lambda: self._dataset_object(dataset_id))
        return obj

    def _registered_locked(self, request: Any) -> str | None:
        """The id under which the dataset of `request` (a RegisterDatasetRequest)
        is registered already, or None.

        Raises:
            InvalidArgumentError: The requested id holds a dataset of another
                element_spec.
        """
        requested = request.dataset_id
        if not requested:
            return self._state.datasets_by_fingerprint.get(request.fingerprint)
        existing = self._state.datasets.get(requested)
        if existing is None:
            return None
        if (
            existing.element_spec
            and request.element_spec
            and existing.element_spec != request.element_spec
        ):
            raise errors.InvalidArgumentError(
                f"Datasets with the same ID should have the same structure: "
                f"dataset ID {requested!r} is registered with a different "
                "structure (element_spec) than the dataset given now"
            )
        return str(requested)

    def _found_locked(self, request: Any, found: str) -> Any:
        """The answer to RegisterDataset `request` whose dataset is registered as
        `found`; says so when a requested id holds another definition."""
        existing = self._state.datasets[found]
        other = bool(request.dataset_id) and existing.fingerprint != request.fingerprint
        if other:
            log.warning(
                "dataset id %r was registered again with another definition (fingerprint "
                "%s..., registered %s...): reads of it get the first one",
                found,
                request.fingerprint[:12],
                existing.fingerprint[:12],
            )
        return pb.RegisterDatasetResponse(dataset_id=found, other_definition=other)

    def _register_dataset(self, request: Any) -> Any:
        from dataservice.data.serialize import parse

        definition = getattr(request, "definition", None)  # RegisterRequest's
        if definition is None:
            definition = parse(request.dataset)
        # No file a client names; each buffer's size is checked where its bytes
        # are read (BufferStore.put: once, they are hundreds of MB).
        check_inline(definition, "RegisterDatasetRequest.dataset", sizes=False)
        with self._mu:
            found = self._registered_locked(request)
            if found is not None:
                return self._found_locked(request, found)
            buffers = self._buffers
            journal = self._journal
        # Writing big buffers and the journal's copy of the definition to their
        # files can take seconds: not under the lock, which every RPC and the
        # liveness checks take. Both are named by their digest, so a copy left by
        # a registration that loses a race below is the winner's, or is dropped
        # with the unreferenced files at the next start.
        stored = buffers.put(definition, field="RegisterDatasetRequest.dataset")
        definition_sha256 = "" if journal is None else journal.write_dataset(request.dataset)
        with self._mu:
            if buffers is not self._buffers or journal is not self._journal:
                raise errors.UnavailableError("the dispatcher restarted; register again")
            found = self._registered_locked(request)  # by another client meanwhile
            if found is not None:
                return self._found_locked(request, found)
            dataset_id = request.dataset_id
            auto = not dataset_id
            if auto:
                dataset_id = str(self._state.next_dataset_number)
                while dataset_id in self._state.datasets:
                    dataset_id = str(int(dataset_id) + 1)
            self._datasets[dataset_id] = stored
            self._apply_locked(
                st.RegisterDataset(
                    dataset_id,
                    request.fingerprint,
                    request.element_spec,
                    request.cardinality,
                    auto,
                    definition_sha256,
                    registered_compression(request),
                )
            )
            return pb.RegisterDatasetResponse(dataset_id=dataset_id)

    def _get_dataset_def(self, request: Any) -> Any:
        with self._mu:
            definition = self._datasets.get(request.dataset_id)
            if definition is None:
                raise errors.NotFoundError(f"Dataset id {request.dataset_id} not found")
        if not request.host_id or request.host_id != host_id():
            # Another host cannot map our files: read them (outside the lock).
            definition = self._buffers.inline(definition)
        return pb.GetDatasetDefResponse(dataset=definition)

    def _get_element_spec(self, request: Any) -> Any:
        with self._mu:
            dataset = self._state.datasets.get(request.dataset_id)
            if dataset is None:
                raise errors.NotFoundError(f"Dataset id {request.dataset_id} not found")
            return pb.GetElementSpecResponse(
                element_spec=dataset.element_spec, cardinality=dataset.cardinality
            )
