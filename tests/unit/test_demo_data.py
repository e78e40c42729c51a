"""The demo's dataset writer, record parser and model (no processes, no sockets)."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

pytest.importorskip("PIL")
pytest.importorskip("skimage")
pytest.importorskip("sklearn")

from PIL import Image  # noqa: E402

import dataservice as ds  # noqa: E402
from dataservice import demo  # noqa: E402
from dataservice import io as dsio  # noqa: E402
from dataservice.demo import data as demo_data  # noqa: E402
from dataservice.demo import training  # noqa: E402

NUM_RECORDS = 40


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> demo.DemoData:
    return demo.write_dataset(str(tmp_path_factory.mktemp("demo")), NUM_RECORDS, seed=3)


def _records(files: list[str]) -> list[bytes]:
    return [bytes(r) for r in ds.TFRecordDataset(files)]


@pytest.mark.timeout(120)
def test_photos_are_real_rgb_images() -> None:
    photos = demo.load_photos()
    assert len(photos) >= 10
    names = [n for n, _ in photos]
    assert "astronaut" in names and "china" in names and "flower" in names
    for name, array in photos:
        assert array.dtype == np.uint8 and array.ndim == 3 and array.shape[2] == 3, name
        assert min(array.shape[:2]) <= demo.MAX_SOURCE_SIDE
        assert array.std() > 10, name  # not blank


@pytest.mark.timeout(120)
def test_writer_makes_16_shards_with_every_record_once(data: demo.DemoData) -> None:
    assert sorted(os.listdir(data.data_dir)) == sorted(
        [os.path.basename(f) for f in data.files] + [demo.MARKER, ".lock"]
        if os.path.exists(os.path.join(data.data_dir, ".lock"))
        else [os.path.basename(f) for f in data.files] + [demo.MARKER]
    )
    assert len(data.files) == 16
    assert os.path.basename(data.files[0]) == "train-00000-of-00016.tfrecord"
    indices = []
    for shard, path in enumerate(data.files):
        for record in _records([path]):
            example = dsio.decode_example(record)
            index = example["index"][0]
            assert index % 16 == shard
            indices.append(index)
    assert sorted(indices) == list(range(NUM_RECORDS))


@pytest.mark.timeout(120)
def test_records_have_the_imagenet_layout(data: demo.DemoData) -> None:
    labels = []
    for record in _records(data.files):
        example = dsio.decode_example(record)
        assert example["image/format"] == [b"jpeg"]
        assert example["image/height"] == [demo.STORED_SIZE]
        assert example["image/width"] == [demo.STORED_SIZE]
        label = example["image/class/label"][0]
        assert 0 <= label < data.num_classes
        assert example["image/class/text"] == [data.class_names[label].encode()]
        with Image.open(io.BytesIO(example["image/encoded"][0])) as img:
            assert img.format == "JPEG"
            assert img.size == (demo.STORED_SIZE, demo.STORED_SIZE)
            assert img.mode == "RGB"
        labels.append(label)
    counts = np.bincount(labels, minlength=data.num_classes)
    assert counts.max() - counts.min() <= 1  # balanced


@pytest.mark.timeout(120)
def test_writing_is_deterministic(data: demo.DemoData, tmp_path) -> None:
    again = demo.write_dataset(str(tmp_path), NUM_RECORDS, seed=3)
    assert _records(again.files) == _records(data.files)


@pytest.mark.timeout(120)
def test_ensure_dataset_reuses_a_complete_dir_and_rebuilds_others(tmp_path) -> None:
    first = demo.ensure_dataset(str(tmp_path), 20)
    mtime = os.path.getmtime(first.files[0])
    assert demo.ensure_dataset(str(tmp_path), 20) == first
    assert os.path.getmtime(first.files[0]) == mtime  # not rewritten

    with open(os.path.join(str(tmp_path), demo.MARKER), "w") as f:
        json.dump({"format_version": -1}, f)  # an old or half-written dir
    rebuilt = demo.ensure_dataset(str(tmp_path), 20)
    assert json.load(open(os.path.join(str(tmp_path), demo.MARKER)))["format_version"] == (
        demo.FORMAT_VERSION
    )
    assert len(_records(rebuilt.files)) == 20

    os.remove(os.path.join(str(tmp_path), demo.MARKER))  # a write that died midway
    assert len(_records(demo.ensure_dataset(str(tmp_path), 24).files)) == 24


@pytest.mark.timeout(120)
def test_parse_record_gives_augmented_float_images(data: demo.DemoData) -> None:
    record = _records(data.files[:1])[0]
    image, label, index = demo.parse_record(record)
    assert image.dtype == np.float32 and image.shape == (160, 160, 3)
    assert 0.0 <= image.min() and image.max() <= 1.0
    assert label.dtype == np.int64 and 0 <= label < data.num_classes
    assert index.dtype == np.int64 and index % 16 == 0


@pytest.mark.timeout(120)
def test_pipeline_in_process_yields_every_record(data: demo.DemoData) -> None:
    seen = []
    for images, labels, indices in demo.make_pipeline(data, batch_size=16):
        assert images.shape[1:] == (160, 160, 3) and images.dtype == np.float32
        assert len(images) == len(labels) == len(indices) <= 16
        seen.extend(int(i) for i in indices)
    assert sorted(seen) == list(range(NUM_RECORDS))


@pytest.mark.timeout(60)
def test_classifier_loss_goes_down() -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 1200)).astype(np.float32) * 0.1
    labels = rng.integers(0, 4, size=256)
    x = centres[labels] + rng.normal(size=(256, 1200)).astype(np.float32) * 0.05
    model = demo.SoftmaxClassifier(1200, 4)
    losses = [model.step(x, labels) for _ in range(30)]
    assert losses[0] == pytest.approx(np.log(4), rel=1e-3)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.timeout(60)
def test_features_pool_to_20x20x3() -> None:
    images = np.zeros((2, 160, 160, 3), np.float32)
    images[0, :8, :8, 0] = 1.0
    f = demo.features(images)
    assert f.shape == (2, 1200)
    assert f[0, 0] == pytest.approx(0.5) and f[1, 0] == pytest.approx(-0.5)


def test_check_epoch_reports_missing_and_duplicates() -> None:
    assert training.check_epoch(1, np.ones(5, np.int64)) is None
    msg = training.check_epoch(2, np.array([1, 0, 2, 1]))
    assert msg is not None and "1 records never seen" in msg and "1 seen more than once" in msg


def test_missing_image_extra_names_the_pip_command(monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "skimage", None)  # import fails
    with pytest.raises(demo.DemoError, match=r"scikit-image.*pip install 'dataservice\[image\]'"):
        demo_data.require_image_extras()


def test_progress_without_tqdm_draws_a_bar_on_stderr(monkeypatch, capsys) -> None:
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)
    progress = training.Progress(100, "epoch 1/1", enabled=True)
    progress.update(50, 2.5)
    progress.update(50, 2.0)
    progress.close()
    err = capsys.readouterr().err
    assert "epoch 1/1" in err and "100/100 img" in err and "loss 2.000" in err
