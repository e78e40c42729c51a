"""The demo's image dataset: ImageNet-layout `tf.train.Example` records in TFRecord shards,
written once from photographs bundled with scikit-image and scikit-learn (no network).

`ensure_dataset` is what `dataservice demo` calls: it reuses a complete dataset with the same
parameters (recorded in `DATASET.json`, written last) and rewrites anything else.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMAT_VERSION = 2  # 2: full-size photos (long side STORED_LONG_SIDE), not 192 px crops
NUM_SHARDS = 16
DEFAULT_NUM_RECORDS = 2048
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "dataservice", "demo-images")
# Stored images are full-size photos as ImageNet's are (most of its JPEGs are 500x375 or
# 500x333): a random region of a source photo covering MIN_REGION_AREA..1 of the largest
# region of its aspect ratio, aspect ratio (w/h) log-uniform in REGION_RATIO, scaled so that
# its long side is STORED_LONG_SIDE px.
STORED_LONG_SIDE = 500  # px
MIN_REGION_AREA = 0.5
REGION_RATIO = (2 / 3, 3 / 2)
MAX_SOURCE_SIDE = 512  # px: photos with a larger short side are scaled down first
JPEG_QUALITY = 90
MARKER = "DATASET.json"
IMAGE_EXTRA_HINT = "pip install 'dataservice[image]'"

# Photographs bundled inside scikit-image (no network needed; checked with
# skimage 0.21-0.26) and scikit-learn. The label of a record is the index here.
SKIMAGE_PHOTOS = (
    "astronaut",
    "camera",
    "chelsea",
    "coffee",
    "rocket",
    "hubble_deep_field",
    "retina",
    "immunohistochemistry",
    "stereo_motorcycle",
    "coins",
    "moon",
    "clock",
    "brick",
    "grass",
    "gravel",
)
SKLEARN_PHOTOS = ("china", "flower")


class DemoError(Exception):
    """A clear, expected failure of the demo (missing extra, bad flag value)."""


def require_image_extras() -> None:
    missing = []
    for module, package in (
        ("PIL", "pillow"),
        ("skimage", "scikit-image"),
        ("sklearn", "scikit-learn"),
    ):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise DemoError(
            f"the demo needs {', '.join(missing)} (the `image` extra): {IMAGE_EXTRA_HINT}"
        )


def _as_rgb(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.bool_:
        array = array.astype(np.uint8) * 255
    if array.dtype != np.uint8:
        array = np.clip(array, 0, 255).astype(np.uint8)
    if array.ndim == 2:
        array = np.stack([array] * 3, axis=-1)
    return np.ascontiguousarray(array[..., :3])


def load_photos() -> list[tuple[str, np.ndarray]]:
    """The source photographs as (name, uint8[h, w, 3]), in label order.

    Large photos are scaled down so that their short side is at most 512 px.
    A photo that a future scikit-image no longer bundles is skipped (the list of
    names is part of `DATASET.json`, so a changed list rebuilds the data).
    """
    import warnings

    import skimage.data
    from PIL import Image
    from sklearn.datasets import load_sample_images  # type: ignore[import-untyped,unused-ignore]

    photos = []
    for name in SKIMAGE_PHOTOS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                array = getattr(skimage.data, name)()
        except Exception:  # not bundled in this version (would need a download)
            continue
        if isinstance(array, tuple):  # stereo_motorcycle: (left, right, disparity)
            array = array[0]
        photos.append((name, _as_rgb(np.asarray(array))))
    sample = load_sample_images()
    for name, array in zip(SKLEARN_PHOTOS, sample.images, strict=True):
        photos.append((name, _as_rgb(np.asarray(array))))
    resized = []
    for name, array in photos:
        h, w = array.shape[:2]
        if min(h, w) > MAX_SOURCE_SIDE:
            scale = MAX_SOURCE_SIDE / min(h, w)
            size = (max(1, round(w * scale)), max(1, round(h * scale)))
            array = np.asarray(Image.fromarray(array).resize(size, Image.Resampling.BILINEAR))
        resized.append((name, array))
    return resized


def shard_path(data_dir: str, shard: int, num_shards: int = NUM_SHARDS) -> str:
    return os.path.join(data_dir, f"train-{shard:05d}-of-{num_shards:05d}.tfrecord")


def file_pattern(data_dir: str, num_shards: int = NUM_SHARDS) -> str:
    return os.path.join(data_dir, f"train-*-of-{num_shards:05d}.tfrecord")


@dataclass(frozen=True)
class DemoData:
    """A written demo dataset: where it is and what is in it."""

    data_dir: str
    num_records: int
    num_shards: int
    class_names: tuple[str, ...]
    seed: int

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def pattern(self) -> str:
        return file_pattern(self.data_dir, self.num_shards)

    @property
    def files(self) -> list[str]:
        return [shard_path(self.data_dir, s, self.num_shards) for s in range(self.num_shards)]


def _marker_contents(
    num_records: int, num_shards: int, seed: int, names: list[str]
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "num_records": num_records,
        "num_shards": num_shards,
        "seed": seed,
        "stored_long_side": STORED_LONG_SIDE,
        "class_names": names,
    }


def _region(
    index: int, photo_hw: tuple[int, int], seed: int
) -> tuple[tuple[int, int, int, int], tuple[int, int]]:
    """Record `index`'s region of its photo, (x, y, w, h) px, and its stored (width, height)."""
    rng = np.random.default_rng([seed, index])  # per record: independent of write order
    h, w = photo_hw
    ratio = float(np.exp(rng.uniform(np.log(REGION_RATIO[0]), np.log(REGION_RATIO[1]))))
    # The largest region of aspect `ratio` inside the photo, then a random share of its area.
    full_w = min(w, h * ratio)
    full_h = full_w / ratio
    scale = float(np.sqrt(rng.uniform(MIN_REGION_AREA, 1.0)))
    rw, rh = max(1, round(full_w * scale)), max(1, round(full_h * scale))
    x = int(rng.integers(0, w - rw + 1))
    y = int(rng.integers(0, h - rh + 1))
    resize = STORED_LONG_SIDE / max(rw, rh)
    size = (max(1, round(rw * resize)), max(1, round(rh * resize)))
    return (x, y, rw, rh), size


def _encode_record(index: int, label: int, photo: np.ndarray, class_name: str, seed: int) -> bytes:
    from PIL import Image

    from dataservice import io as dsio

    (x, y, rw, rh), (width, height) = _region(index, photo.shape[:2], seed)
    image = Image.fromarray(photo).resize(
        (width, height), Image.Resampling.BICUBIC, box=(x, y, x + rw, y + rh)
    )
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return dsio.serialize_example(
        {
            "image/encoded": buf.getvalue(),
            "image/format": b"jpeg",
            "image/height": height,
            "image/width": width,
            "image/class/label": label,
            "image/class/text": class_name.encode(),
            "index": index,
        }
    )


def write_dataset(
    data_dir: str,
    num_records: int = DEFAULT_NUM_RECORDS,
    *,
    num_shards: int = NUM_SHARDS,
    seed: int = 0,
    log: Any = None,
) -> DemoData:
    """Writes the demo dataset into `data_dir` (replacing our files there).

    Record `i` goes to shard `i % num_shards`; labels are balanced over the
    photos and shuffled. Each record is a full-size JPEG (quality 90, long side
    `STORED_LONG_SIDE` px, about 55 KB; see `_region`). `DATASET.json` is written
    last, atomically.

    Returns:
        What was written.
    """
    from dataservice import io as dsio

    if num_records < 1:
        raise DemoError(f"--num-records must be >= 1, got {num_records}")
    os.makedirs(data_dir, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(data_dir, MARKER))
    for name in os.listdir(data_dir):
        if name.startswith("train-") and name.endswith(".tfrecord"):
            os.remove(os.path.join(data_dir, name))
    photos = load_photos()
    names = [name for name, _ in photos]
    rng = np.random.default_rng(seed)
    labels = rng.permutation(num_records) % len(photos)
    t0 = time.monotonic()
    writers = [dsio.TFRecordWriter(shard_path(data_dir, s, num_shards)) for s in range(num_shards)]
    try:
        for i in range(num_records):
            label = int(labels[i])
            record = _encode_record(i, label, photos[label][1], names[label], seed)
            writers[i % num_shards].write(record)
            if log is not None and (i + 1) % 512 == 0:
                log(f"  {i + 1}/{num_records} records")
    finally:
        for w in writers:
            w.close()
    marker = _marker_contents(num_records, num_shards, seed, names)
    tmp = os.path.join(data_dir, f".{MARKER}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(data_dir, MARKER))
    if log is not None:
        total_bytes = sum(
            os.path.getsize(shard_path(data_dir, s, num_shards)) for s in range(num_shards)
        )
        log(
            f"  wrote {num_records} records ({total_bytes / 1e6:.0f} MB) in {num_shards} shards "
            f"in {time.monotonic() - t0:.1f} s"
        )
    return DemoData(data_dir, num_records, num_shards, tuple(names), seed)


def ensure_dataset(
    data_dir: str, num_records: int = DEFAULT_NUM_RECORDS, *, seed: int = 0, log: Any = None
) -> DemoData:
    """Returns the dataset in `data_dir`, writing it first unless a complete one
    with the same parameters is there. Safe against concurrent demos (flock).

    Raises:
        DemoError: `data_dir` cannot be made or written (the message names it and why).
    """
    data_dir = os.path.abspath(os.path.expanduser(data_dir))
    try:
        os.makedirs(data_dir, exist_ok=True)
        lock = open(os.path.join(data_dir, ".lock"), "w")  # noqa: SIM115  (closed below)
    except OSError as e:
        raise DemoError(
            f"--data-dir {data_dir}: cannot write the demo's images there "
            f"({e.strerror or e}); pass a writable directory"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(os.path.join(data_dir, MARKER)) as f:
                marker = json.load(f)
        except (OSError, ValueError):
            marker = None
        if (
            marker is not None
            and marker.get("format_version") == FORMAT_VERSION
            and marker.get("num_records") == num_records
            and marker.get("num_shards") == NUM_SHARDS
            and marker.get("seed") == seed
            and all(os.path.exists(shard_path(data_dir, s)) for s in range(NUM_SHARDS))
        ):
            return DemoData(data_dir, num_records, NUM_SHARDS, tuple(marker["class_names"]), seed)
        if log is not None:
            log(f"writing {num_records} image records to {data_dir} (once)")
        return write_dataset(data_dir, num_records, seed=seed, log=log)
