"""`dataservice.data.graph`, the service's interface to a pipeline graph: walks, file
sources, split providers and iterating with splits, as the dispatcher and worker use
them (no servers)."""

from __future__ import annotations

import pytest

import dataservice as ds
from dataservice import errors
from dataservice.data import graph
from dataservice.data.ops import AllowPickledElementsDataset


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    """f0.tfrecord .. f3.tfrecord, 2 records each: b"f r"."""
    d = tmp_path_factory.mktemp("graph")
    names = []
    for f in range(4):
        path = str(d / f"f{f}.tfrecord")
        with ds.io.TFRecordWriter(path) as w:
            for r in range(2):
                w.write(b"%d %d" % (f, r))
        names.append(path)
    return names


class _Splits:
    """A split source handing out `splits` once, as a worker's split fetcher does."""

    def __init__(self, splits: list) -> None:
        self._splits = list(splits)

    def get_next(self):
        return self._splits.pop(0) if self._splits else None


def test_walk_is_pre_order_over_inputs_in_order():
    a, b = ds.Dataset.range(3), ds.Dataset.range(4)
    pipeline = a.map(lambda x: x).concatenate(b.batch(2))
    assert [graph.op_name(n) for n in graph.walk(pipeline)] == [
        "concatenate",
        "map",
        "range",
        "batch",
        "range",
    ]


def test_map_graph_reuses_unchanged_nodes_and_rebuilds_above_a_change():
    pipeline = ds.Dataset.range(6).map(lambda x: x * 10).batch(4)
    assert graph.map_graph(pipeline, lambda n: n) is pipeline

    def shorter(node):
        return ds.Dataset.range(3) if graph.op_name(node) == "range" else node

    rebuilt = graph.map_graph(pipeline, shorter)
    assert [b.tolist() for b in rebuilt] == [[0, 10, 20]]
    assert [b.tolist() for b in pipeline] == [[0, 10, 20, 30], [40, 50]]  # unchanged


def test_file_sources_and_their_files(files):
    listed = ds.Dataset.list_files(files, shuffle=False)
    records = ds.TFRecordDataset(files[:2])
    of_dataset = ds.TFRecordDataset(listed)  # names from a Dataset: not a file source
    pipeline = of_dataset.concatenate(records)
    assert graph.file_sources(pipeline) == [listed, records]
    assert graph.source_files(listed) == tuple(files)
    assert graph.source_files(records) == tuple(files[:2])
    assert graph.source_files(of_dataset) is None
    assert graph.source_files(ds.Dataset.range(3)) is None


def test_with_source_files_copies_the_source(files):
    listed = ds.Dataset.list_files(files, shuffle=False)
    fewer = graph.with_source_files(listed, (files[3], files[1]))
    assert list(fewer) == [files[3], files[1]]
    assert list(listed) == files  # the original still reads every file
    records = graph.with_source_files(ds.TFRecordDataset(files), (files[2],))
    assert list(records) == [b"2 0", b"2 1"]
    with pytest.raises(TypeError, match="`range` is not a file source"):
        graph.with_source_files(ds.Dataset.range(3), (files[0],))


def test_split_providers_and_iterating_with_their_splits():
    pipeline = ds.Dataset.zip((ds.Dataset.range(4), ds.Dataset.range(10, 13))).repeat(1)
    assert graph.num_split_sources(pipeline) == 2
    providers = graph.split_providers(pipeline, seed=7)
    assert len(providers) == 2
    splits = [[], []]
    for k, provider in enumerate(providers):
        while (split := provider.get_next()) is not None:
            splits[k].append(split)
    # A worker reads source k's elements from the splits of provider k only.
    it = graph.make_iterator(pipeline, split_sources=(_Splits(splits[0]), _Splits(splits[1])))
    assert [(int(a), int(b)) for a, b in it] == [(0, 10), (1, 11), (2, 12)]


def test_make_iterator_without_split_sources_is_one_epoch():
    it = graph.make_iterator(ds.Dataset.range(3).map(lambda x: x + 1))
    assert [int(x) for x in it] == [1, 2, 3]
    it.close()


def test_make_iterator_with_the_wrong_number_of_split_sources_names_the_op():
    pipeline = ds.Dataset.range(3).concatenate(ds.Dataset.range(2))
    it = graph.make_iterator(pipeline, split_sources=(_Splits([]),))
    with pytest.raises(errors.InvalidArgumentError, match="`concatenate` reads 2 splittable"):
        next(it)


def test_unsplittable_pipeline_names_its_op():
    pipeline = ds.Dataset.from_generator(lambda: iter(range(3))).map(lambda x: x)
    for check in (graph.num_split_sources, graph.check_splittable):
        with pytest.raises(ValueError, match="`from_generator`"):
            check(pipeline)
    with pytest.raises(ValueError, match="`from_generator`"):
        graph.split_providers(pipeline, seed=None)


def test_static_element_spec_is_none_when_it_needs_running():
    assert graph.static_element_spec(ds.Dataset.range(3).batch(2, drop_remainder=True)) == (
        ds.TensorSpec((2,), "int64")
    )
    assert graph.static_element_spec(ds.Dataset.range(3).map(lambda x: (x, x))) is None


def test_allows_pickled_elements_anywhere_in_the_graph():
    plain = ds.Dataset.range(3)
    assert not graph.allows_pickled_elements(plain)
    opted = AllowPickledElementsDataset(plain).map(lambda x: {x})
    assert graph.allows_pickled_elements(opted)
    assert graph.allows_pickled_elements(plain.concatenate(AllowPickledElementsDataset(plain)))
