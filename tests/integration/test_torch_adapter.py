"""dataservice.torch.ServiceDataset: tensors over the service's memory (no copy), their
lifetime across ring wraps, DataLoader use, and the rank helpers' options."""

from __future__ import annotations

import collections
import gc
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dataservice as ds  # noqa: E402
from dataservice.torch import (  # noqa: E402
    ServiceDataset,
    distribute_for_rank,
    from_dataset_id_for_rank,
    rank_and_world_size,
    to_torch,
)

RING_BYTES = 1 << 20
LEAF_SHAPE = (128, 256)  # float32: 128 KiB, leased (>= 64 KiB) rather than copied
LEAF_BYTES = 128 * 256 * 4

Pair = collections.namedtuple("Pair", ["left", "right"])


def big(i):
    return np.full(LEAF_SHAPE, i, np.float32)


def mapping_of(address: int) -> str | None:
    """The /proc/self/maps pathname of the mapping holding `address` ("" if anonymous)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if lo <= address < hi:
                return parts[5].strip() if len(parts) > 5 else ""
    return None


@pytest.fixture(scope="module")
def small_ring_cluster():
    with ds.LocalCluster(num_workers=1, worker_options={"shm_ring_bytes": RING_BYTES}) as c:
        yield c


def test_import_dataservice_does_not_import_torch():
    code = (
        "import sys, dataservice, dataservice.client.api, dataservice.cluster\n"
        "assert 'torch' not in sys.modules, 'dataservice imported torch'\n"
        "assert 'jax' not in sys.modules, 'dataservice imported jax'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_tensors_are_ring_views_and_keep_their_values_over_100_ring_wraps(small_ring_cluster):
    wraps = 100
    n = wraps * RING_BYTES // LEAF_BYTES + 16
    dataset = (
        ds.Dataset.range(n)
        .map(big)
        .apply(ds.distribute("parallel_epochs", small_ring_cluster.target))
    )
    service = ServiceDataset(dataset)
    it = iter(service)
    held = [next(it) for _ in range(3)]
    ptrs = [t.data_ptr() for t in held]
    for i, (t, ptr) in enumerate(zip(held, ptrs, strict=True)):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
        assert t.untyped_storage().data_ptr() == ptr
        # No copy: the tensor's memory is the worker's ring, mapped in this process.
        assert mapping_of(ptr) == "/memfd:dataservice-ring (deleted)", mapping_of(ptr)
        assert bool((t == i).all())
    rest = 0
    for t in it:
        assert float(t[0, 0]) == 3 + rest  # a fresh element each time: the ring moved on
        rest += 1
    stats = service.stats()
    assert stats["workers"][small_ring_cluster.worker_addresses[0]]["transfer_protocol"] == "shm"
    assert stats["bytes"] >= wraps * RING_BYTES, stats
    assert stats["copied_arrays"] == 0
    for i, (t, ptr) in enumerate(zip(held, ptrs, strict=True)):
        assert t.data_ptr() == ptr  # the same memory, never moved ...
        assert bool((t == i).all()), f"held tensor {i} was overwritten"  # ... and intact
    # The frames are this consumer's alone: a tensor is writable, in place.
    held[0].add_(1)
    assert bool((held[0] == 1).all())


def test_held_tensor_outlives_its_iterator_and_the_cluster():
    with ds.LocalCluster(num_workers=1, worker_options={"shm_ring_bytes": RING_BYTES}) as c:
        dataset = ds.Dataset.range(4).map(big).apply(ds.distribute("parallel_epochs", c.target))
        it = iter(ServiceDataset(dataset))
        t = next(it)
        first = next(it)
        assert mapping_of(t.data_ptr()) == "/memfd:dataservice-ring (deleted)"
        it.close()
        del it, dataset, first
    gc.collect()
    assert bool((t == 0).all()) and tuple(t.shape) == LEAF_SHAPE


def test_to_torch_views_the_numpy_arrays_it_is_given():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    out = to_torch({"a": a, "t": (a[:, 1],), "s": "x", "b": b"y"})
    assert out["a"].data_ptr() == a.ctypes.data
    assert out["t"][0].data_ptr() == a[:, 1].ctypes.data  # a strided view is viewed too
    assert out["s"] == "x" and out["b"] == b"y"


def test_to_torch_copies_only_what_torch_cannot_view():
    big_endian = np.arange(4, dtype=">i4")
    flipped = np.arange(4, dtype=np.float32)[::-1]
    dates = np.array(["2020-01-01"], dtype="datetime64[D]")
    out = to_torch([big_endian, flipped, dates, np.float16(1.5), np.str_("s"), np.bytes_(b"b"), 3])
    assert out[0].dtype == torch.int32 and out[0].tolist() == [0, 1, 2, 3]
    assert out[1].tolist() == [3.0, 2.0, 1.0, 0.0]
    assert out[2] is dates  # no torch dtype: unchanged
    assert out[3].dtype == torch.float16 and out[3].dim() == 0 and float(out[3]) == 1.5
    assert out[4:] == ["s", b"b", 3]


def leaf_kinds(i):
    return {
        "image": big(i),
        "pair": Pair(np.int64(i), np.arange(3, dtype=np.uint8)),
        "name": f"item-{int(i)}",
        "raw": b"\x00\x01",
        "names": np.array(["a", "bc"]),
    }


def test_elements_keep_their_structure_and_strings_pass_through(make_cluster):
    cluster = make_cluster(1)
    dataset = ds.Dataset.range(3).map(leaf_kinds)
    dataset = dataset.apply(ds.distribute("parallel_epochs", cluster.target))
    got = list(ServiceDataset(dataset))
    assert len(got) == 3
    for i, e in enumerate(got):
        assert isinstance(e["image"], torch.Tensor) and float(e["image"][5, 5]) == i
        assert isinstance(e["pair"], Pair)
        assert e["pair"].left.dim() == 0 and int(e["pair"].left) == i
        assert e["pair"].right.dtype == torch.uint8 and e["pair"].right.tolist() == [0, 1, 2]
        assert e["name"] == f"item-{i}" and e["raw"] == b"\x00\x01"
        assert isinstance(e["names"], np.ndarray) and e["names"].tolist() == ["a", "bc"]


def test_read_only_arrays_from_ops_after_distribute_are_copied_without_warning(make_cluster):
    cluster = make_cluster(1)

    def freeze(x):
        x = x.copy()
        x.flags.writeable = False
        return {"frozen": x, "flipped": x[::-1]}

    dataset = ds.Dataset.range(2).map(lambda i: np.arange(5, dtype=np.int64) + i)
    dataset = dataset.apply(ds.distribute("parallel_epochs", cluster.target)).map(freeze)
    service = ServiceDataset(dataset)
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")  # torch's non-writable warning fails
        got = list(service)
    assert [e["frozen"].tolist() for e in got] == [[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]
    assert [e["flipped"].tolist() for e in got] == [[4, 3, 2, 1, 0], [5, 4, 3, 2, 1]]
    assert service.stats()["copied_arrays"] == 4


def test_dataloader_without_workers_yields_the_pipelines_batches(make_cluster):
    cluster = make_cluster(1)
    dataset = ds.Dataset.range(10).map(lambda i: {"x": np.full(2, i, np.float32), "id": i})
    dataset = dataset.batch(4).apply(ds.distribute("parallel_epochs", cluster.target))
    loader = torch.utils.data.DataLoader(ServiceDataset(dataset), batch_size=None)
    for _epoch in range(2):  # each iter() is a new epoch
        batches = list(loader)
        assert [b["id"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        assert batches[0]["x"].shape == (4, 2)


def test_a_named_job_moves_to_its_next_repetition_each_epoch(make_cluster):
    cluster = make_cluster(2)
    dataset = ds.Dataset.range(20).apply(
        distribute_for_rank("distributed_epoch", cluster.target, job_name="epochs")
    )
    service = ServiceDataset(dataset)
    for _epoch in range(2):
        assert sorted(int(t) for t in service) == list(range(20))


def test_dataloader_workers_are_refused_with_the_reason(make_cluster):
    cluster = make_cluster(1)
    dataset = ds.Dataset.range(4).apply(ds.distribute("parallel_epochs", cluster.target))
    # "spawn", not "fork": a fork of this process (gRPC's threads and earlier tests'
    # running) crashed the forked worker in os.fork() about once in ten runs, before
    # any of our code ran in it; the refusal is the same in a spawned worker.
    loader = torch.utils.data.DataLoader(
        ServiceDataset(dataset), batch_size=None, num_workers=2, multiprocessing_context="spawn"
    )
    with pytest.raises(RuntimeError, match=r"DataLoader worker process \(num_workers=2\)"):
        list(loader)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory needs CUDA")
def test_dataloader_pin_memory(small_ring_cluster):
    dataset = ds.Dataset.range(6).map(big).batch(2)
    dataset = dataset.apply(ds.distribute("parallel_epochs", small_ring_cluster.target))
    loader = torch.utils.data.DataLoader(ServiceDataset(dataset), batch_size=None, pin_memory=True)
    batches = list(loader)
    assert [float(b[0, 0, 0]) for b in batches] == [0.0, 2.0, 4.0]
    assert all(b.is_pinned() for b in batches)
    assert float(batches[2].cuda()[1].mean()) == 5.0


def test_a_dataset_not_read_from_the_service_is_refused():
    with pytest.raises(ValueError, match="read from the data service"):
        ServiceDataset(ds.Dataset.range(3).map(lambda x: x))
    with pytest.raises(ValueError, match="dataservice.Dataset"):
        ServiceDataset([1, 2, 3])


# ------------------------------------------------------------------ rank helpers


def test_rank_and_world_size_come_from_torchruns_environment(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert rank_and_world_size() == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_and_world_size() == (3, 4)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match=r"Invalid rank 4"):
        rank_and_world_size()
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="must be integers"):
        rank_and_world_size()
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="set together"):
        rank_and_world_size()


TARGET = "grpc://127.0.0.1:5050"


def read_options(d):
    return d._job_name, d._consumer_index, d._num_consumers, d._processing_mode


def test_distribute_for_rank_fills_the_consumer_options_per_recipe(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    src = ds.Dataset.range(8)
    dyn = src.apply(distribute_for_rank("distributed_epoch", TARGET, job_name="train"))
    assert read_options(dyn) == ("train", -1, 0, ds.ShardingPolicy.DYNAMIC)
    coord = src.repeat().apply(
        distribute_for_rank(ds.ShardingPolicy.DYNAMIC, TARGET, job_name="t", coordinated=True)
    )
    assert read_options(coord) == ("t", 1, 2, ds.ShardingPolicy.DYNAMIC)
    off = src.apply(distribute_for_rank(ds.ShardingPolicy.OFF, TARGET, job_name="train"))
    assert read_options(off) == ("train/rank-1", -1, 0, ds.ShardingPolicy.OFF)
    explicit = src.apply(
        distribute_for_rank(ds.ShardingPolicy.OFF, TARGET, rank=0, num_replicas=3, job_name="j")
    )
    assert read_options(explicit)[0] == "j/rank-0"
    by_id = from_dataset_id_for_rank(
        ds.ShardingPolicy.DYNAMIC, TARGET, "7", job_name="t", coordinated=True
    )
    assert read_options(by_id) == ("dataset_id=7/t", 1, 2, ds.ShardingPolicy.DYNAMIC)


def test_distribute_for_rank_refuses_reads_that_would_go_wrong(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="needs a `job_name` that every rank shares"):
        distribute_for_rank(ds.ShardingPolicy.DYNAMIC, TARGET)
    with pytest.raises(ValueError, match="coordinated reads need a `job_name`"):
        distribute_for_rank(ds.ShardingPolicy.DYNAMIC, TARGET, coordinated=True)
    with pytest.raises(ValueError, match="`consumer_index` is set from the rank"):
        distribute_for_rank(ds.ShardingPolicy.DYNAMIC, TARGET, job_name="j", consumer_index=0)
    with pytest.raises(ValueError, match=r"Invalid rank 2"):
        distribute_for_rank(ds.ShardingPolicy.OFF, TARGET, rank=2, num_replicas=2)
    # One process: an anonymous DYNAMIC job is fine.
    distribute_for_rank(ds.ShardingPolicy.DYNAMIC, TARGET, rank=0, num_replicas=1)


def test_readme_with_pytorch_example_runs(capsys):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## With PyTorch\n", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```py\n(.*?)```", section, re.DOTALL)[0]
    exec(compile(block, "README.md (With PyTorch)", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    # DYNAMIC, one consumer: every image once per epoch, two epochs.
    assert [line.split()[:2] for line in lines] == [["0", "1000"], ["1", "1000"]]
