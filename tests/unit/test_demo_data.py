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
from dataservice.demo import (
    pipeline,  # noqa: E402
    training,  # noqa: E402
)

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
def test_records_are_full_size_photos_in_the_imagenet_layout(data: demo.DemoData) -> None:
    labels = []
    sizes = set()
    for record in _records(data.files):
        example = dsio.decode_example(record)
        assert example["image/format"] == [b"jpeg"]
        height, width = example["image/height"][0], example["image/width"][0]
        # Full-size as ImageNet's photos: long side 500 px, aspect ratio within 2/3..3/2.
        assert max(height, width) == demo.STORED_LONG_SIDE
        assert min(height, width) >= demo.STORED_LONG_SIDE * 2 / 3 - 1
        label = example["image/class/label"][0]
        assert 0 <= label < data.num_classes
        assert example["image/class/text"] == [data.class_names[label].encode()]
        with Image.open(io.BytesIO(example["image/encoded"][0])) as img:
            assert img.format == "JPEG"
            assert img.size == (width, height)
            assert img.mode == "RGB"
            assert np.asarray(img).std() > 5  # a photo, not a blank
        labels.append(label)
        sizes.add((width, height))
    counts = np.bincount(labels, minlength=data.num_classes)
    assert counts.max() - counts.min() <= 1  # balanced
    assert len(sizes) > NUM_RECORDS // 2  # regions of the photos vary in size and shape


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
def test_parse_record_gives_augmented_uint8_images(data: demo.DemoData) -> None:
    record = _records(data.files[:1])[0]
    image, label, index = demo.parse_record(record)
    assert image.dtype == np.uint8 and image.shape == (224, 224, 3)
    assert image.flags.writeable  # torch.as_tensor (DataLoader's collate) warns otherwise
    assert image.std() > 1
    assert label.dtype == np.int64 and 0 <= label < data.num_classes
    assert index.dtype == np.int64 and index % 16 == 0


@pytest.mark.timeout(60)
def test_random_resized_crop_box_follows_torchvision() -> None:
    rng = np.random.default_rng(0)
    areas, ratios = [], []
    for _ in range(2000):
        left, top, right, bottom = demo.random_resized_crop_box(500, 375, rng)
        assert 0 <= left < right <= 500 and 0 <= top < bottom <= 375
        w, h = right - left, bottom - top
        areas.append(w * h / (500 * 375))
        ratios.append(w / h)
    # Rounding to whole pixels moves the bounds by at most a pixel's worth.
    assert 0.08 * 0.97 <= min(areas) and max(areas) <= 1.0
    assert 3 / 4 * 0.97 <= min(ratios) and max(ratios) <= 4 / 3 * 1.03
    # Where every draw fits (no rejection): area uniform in `scale`, ratio log-uniform.
    areas, log_ratios = [], []
    for _ in range(2000):
        left, top, right, bottom = demo.random_resized_crop_box(1000, 1000, rng, scale=(0.1, 0.5))
        areas.append((right - left) * (bottom - top) / 1e6)
        log_ratios.append(np.log((right - left) / (bottom - top)))
    assert np.quantile(areas, [0.25, 0.5, 0.75]) == pytest.approx([0.2, 0.3, 0.4], abs=0.03)
    assert np.quantile(log_ratios, [0.25, 0.5, 0.75]) == pytest.approx(
        [np.log(4 / 3) * -0.5, 0.0, np.log(4 / 3) * 0.5], abs=0.03
    )
    # Nothing of that ratio fits in a 1000x10 strip: the centre crop of the nearest ratio.
    assert demo.random_resized_crop_box(1000, 10, rng) == (493, 0, 506, 10)  # w = round(10 * 4/3)
    assert demo.random_resized_crop_box(10, 1000, rng) == (0, 493, 10, 506)  # h = round(10 / (3/4))


@pytest.mark.timeout(60)
def test_decode_and_augment_crops_and_flips_the_full_image() -> None:
    # Left half black, right half white: a crop keeps the order unless it is flipped.
    pixels = np.zeros((375, 500, 3), np.uint8)
    pixels[:, 250:] = 255
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
    rng = np.random.default_rng(1)
    orders = set()
    for _ in range(40):
        out = demo.decode_and_augment(buf.getvalue(), rng)
        assert out.shape == (224, 224, 3) and out.dtype == np.uint8
        left, right = out[:, 0].mean(), out[:, -1].mean()
        if abs(left - right) > 200:  # the crop spans the edge
            orders.add(left < right)
    assert orders == {True, False}


@pytest.mark.timeout(60)
def test_forked_processes_augment_differently() -> None:
    import multiprocessing

    pipeline._rng()  # made before the fork, as the demo's in-process run does
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        draws = pool.map(_draw_in_child, range(2), chunksize=1)
    assert draws[0] != draws[1]
    assert pipeline._rng().random() not in draws


def _draw_in_child(_: int) -> float:
    import time

    time.sleep(0.2)  # so that each of the two pool processes takes one item
    return float(pipeline._rng().random())


@pytest.mark.timeout(120)
def test_pipeline_in_process_yields_every_record(data: demo.DemoData) -> None:
    seen = []
    for images, labels, indices in demo.make_pipeline(data, batch_size=16):
        assert images.shape[1:] == (224, 224, 3) and images.dtype == np.uint8
        assert len(images) == len(labels) == len(indices) <= 16
        seen.extend(int(i) for i in indices)
    assert sorted(seen) == list(range(NUM_RECORDS))


@pytest.mark.timeout(60)
def test_classifier_loss_goes_down() -> None:
    rng = np.random.default_rng(0)
    colours = rng.integers(0, 256, size=(4, 3))
    labels = rng.integers(0, 4, size=64)
    noise = rng.integers(-40, 41, size=(64, 32, 32, 3))
    images = np.clip(colours[labels][:, None, None, :] + noise, 0, 255).astype(np.uint8)
    model = demo.MLPClassifier(8 * 8 * 3, 4, learning_rate=0.01)
    losses = [model.step(images, labels) for _ in range(30)]
    assert losses[0] == pytest.approx(np.log(4), rel=1e-5)  # the output layer starts at 0
    assert losses[-1] < 0.2 * losses[0]


@pytest.mark.timeout(60)
def test_features_normalise_then_pool_4x4() -> None:
    mean = np.array([0.485, 0.456, 0.406]) * 255
    std = np.array([0.229, 0.224, 0.225]) * 255
    images = np.zeros((2, 224, 224, 3), np.uint8)
    images[0, :4, :4, 0] = 255
    f = demo.features(images)
    assert f.shape == (2, 56 * 56 * 3) and f.dtype == np.float32
    assert f[0, 0] == pytest.approx((255 - mean[0]) / std[0], rel=1e-5)
    assert f[0, 3] == pytest.approx(-mean[0] / std[0], rel=1e-5)  # the next 4x4 block
    assert f[1, :3] == pytest.approx(-mean / std, rel=1e-5)
    with pytest.raises(ValueError, match="multiples of 4"):
        demo.features(np.zeros((1, 30, 32, 3), np.uint8))
    # A batch of several chunks (training.FEATURE_CHUNK images each) and a partial one.
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 256, size=(2 * training.FEATURE_CHUNK + 3, 16, 24, 3), dtype=np.uint8)
    reference = ((batch - mean) / std).reshape(len(batch), 4, 4, 6, 4, 3).mean(axis=(2, 4))
    np.testing.assert_allclose(
        demo.features(batch), reference.reshape(len(batch), -1), rtol=1e-4, atol=1e-5
    )


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


class _FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _TimedBatches:
    """Batches of 2 images; `iter()` takes 0.05 s and each `next()` 0.03 s of `clock`."""

    def __init__(self, clock: _FakeClock, num_batches: int) -> None:
        self.clock, self.num_batches = clock, num_batches

    def __iter__(self):
        self.clock.now += 0.05
        for b in range(self.num_batches):
            self.clock.now += 0.03
            yield (
                np.zeros((2, 8, 8, 3), np.uint8),
                np.array([0, 1]),
                np.array([2 * b, 2 * b + 1]),
            )
        self.clock.now += 0.03  # the last next(), which ends the epoch


class _TimedModel:
    def __init__(self, clock: _FakeClock) -> None:
        self.clock = clock

    def step(self, images: np.ndarray, labels: np.ndarray) -> float:
        self.clock.now += 0.01
        return 1.0


def test_run_epoch_counts_the_time_in_iter_and_next_as_waiting(monkeypatch) -> None:
    clock = _FakeClock()
    monkeypatch.setattr(training.time, "perf_counter", clock)
    progress = training.Progress(8, "epoch", enabled=False)
    result = training.run_epoch(_TimedBatches(clock, 4), _TimedModel(clock), 8, progress, None)
    assert (result.images, result.batches) == (8, 4)
    assert result.wait_s == pytest.approx(0.05 + 5 * 0.03)
    assert result.wall_s == pytest.approx(0.05 + 5 * 0.03 + 4 * 0.01)
    assert result.index_counts.tolist() == [1] * 8


def test_summary_reports_rows_and_fails_a_row_that_missed_records(capsys) -> None:
    import argparse

    from dataservice.demo import report

    def epoch(counts: list[int], wall_s: float, wait_s: float) -> training.EpochResult:
        c = np.array(counts)
        return training.EpochResult(int(c.sum()), 1, [2.0], c, None, wall_s, wait_s)

    args = argparse.Namespace(workers=2, epochs=1, batch_size=4)
    data = demo.DemoData("/data", 4, 16, ("a", "b"), 0)
    runs = {
        "in_process": report.RowRun([epoch([1, 1, 1, 1], 2.0, 1.5)]),
        "service": report.RowRun([epoch([1, 1, 0, 1], 1.0, 0.25)], cluster_start_s=1.0),
    }
    s = report.summarize(args, data, runs, "torch does not import", 9.5)
    assert s["rows"]["in_process"]["images_per_second"] == pytest.approx(2.0)
    assert s["rows"]["in_process"]["wait_fraction"] == pytest.approx(0.75)
    assert s["rows"]["service"]["wait_fraction"] == pytest.approx(0.25)
    assert s["speedup"]["service"] == pytest.approx(1.5)
    assert s["exactly_once"] is False
    failures = report.print_summary(s)
    out = capsys.readouterr().out
    assert failures == [
        "service: records read per epoch [3], expected each of the 4 records once per epoch"
    ]
    assert "FAILED: service" in out and "PASSED" not in out
    assert "75% (1.5 of 2.0 s)" in out and "1.50x" in out
    assert "left out: torch does not import" in out
    assert s["load_average_before"] == 9.5
    if s["cpus"] < 19:
        assert "other work was running (load average 9.5" in out


def test_dataloader_row_is_left_out_without_torch(monkeypatch) -> None:
    import argparse

    from dataservice.demo import command

    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # import fails
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.data", None)
    assert "torch does not import" in command._dataloader_unavailable(
        argparse.Namespace(dataloader=None)
    )
    assert command._dataloader_unavailable(argparse.Namespace(dataloader=False)) == (
        "--no-dataloader"
    )
    with pytest.raises(demo.DemoError, match="--dataloader needs torch"):
        command._dataloader_unavailable(argparse.Namespace(dataloader=True))


def test_one_blas_thread_holds_numpy_blas_to_one_thread() -> None:
    threadpoolctl = pytest.importorskip("threadpoolctl")
    with training.one_blas_thread():
        blas = threadpoolctl.threadpool_info()
        assert blas and all(p["num_threads"] == 1 for p in blas if p["user_api"] == "blas")


def test_an_unwritable_data_dir_is_named():
    from dataservice.demo import DemoError, ensure_dataset

    with pytest.raises(DemoError, match=r"--data-dir /proc/nope: cannot write"):
        ensure_dataset("/proc/nope", 4)
