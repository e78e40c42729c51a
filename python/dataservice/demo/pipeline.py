"""The demo's input pipeline, as an ImageNet trainer's: shards -> records -> full-size JPEG
decoded with Pillow -> RandomResizedCrop to 224x224 -> random horizontal flip -> uint8
batches.

The images stay uint8 (`uint8[b, 224, 224, 3]`), as in timm's and DALI's ImageNet loaders:
the trainer converts them to float and normalises them (on a GPU trainer, on the GPU), which
moves a quarter of the bytes of float32 images.

`parse_record` and `read_tfrecords` run on the workers (and in PyTorch's DataLoader workers):
they are module-level functions, so cloudpickle sends them by reference
(`dataservice.demo.pipeline.parse_record`) and each worker imports this module.
"""

from __future__ import annotations

import io
import math
import os
import threading
from typing import Any

import numpy as np

from dataservice.demo.data import DemoData

CROP_SIZE = 224  # px, square, what the pipeline feeds the model
# torchvision's RandomResizedCrop defaults: the crop covers SCALE of the image's area and
# its aspect ratio (w/h) is log-uniform in RATIO.
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)

_FEATURES: dict[str, Any] | None = None
_local = threading.local()


def _features() -> dict[str, Any]:
    global _FEATURES
    if _FEATURES is None:
        from dataservice import io as dsio

        _FEATURES = {
            "image/encoded": dsio.FixedLenFeature([], bytes),
            "image/class/label": dsio.FixedLenFeature([], np.int64),
            "index": dsio.FixedLenFeature([], np.int64),
        }
    return _FEATURES


def _scalar_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    return bytes(np.asarray(value, dtype=object).reshape(-1)[0])


def _rng() -> np.random.Generator:
    """This thread's generator, seeded from the OS. A process forked after it was made (a
    PyTorch DataLoader worker) makes its own: forked copies would crop alike."""
    rng: np.random.Generator | None = getattr(_local, "rng", None)
    if rng is None or getattr(_local, "pid", None) != os.getpid():
        rng = _local.rng = np.random.default_rng()
        _local.pid = os.getpid()
    return rng


def random_resized_crop_box(
    width: int,
    height: int,
    rng: np.random.Generator,
    scale: tuple[float, float] = SCALE,
    ratio: tuple[float, float] = RATIO,
) -> tuple[int, int, int, int]:
    """A random crop of a `width` x `height` px image, as (left, top, right, bottom) px.

    The crop covers a share of the image's area uniform in `scale` and has an aspect ratio
    (w/h) log-uniform in `ratio`; after 10 draws that do not fit, a centre crop of the
    nearest allowed ratio.

    Source: torchvision/transforms/transforms.py, `RandomResizedCrop.get_params`.
    """
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


def decode_and_augment(jpeg: bytes, rng: np.random.Generator | None = None) -> np.ndarray:
    """Decodes a JPEG and augments it as torchvision's ImageNet training transform does.

    Returns:
        uint8[224, 224, 3]: `RandomResizedCrop(224)` (bilinear, of the full-size decoded
        image) then `RandomHorizontalFlip()`.
    """
    from PIL import Image

    if rng is None:
        rng = _rng()
    with Image.open(io.BytesIO(jpeg)) as img:
        rgb = img.convert("RGB")  # torchvision's default_loader does the same
    box = random_resized_crop_box(rgb.width, rgb.height, rng)
    # resize(box=...) is crop-then-resize in one pass, as F.resized_crop does.
    crop = rgb.resize((CROP_SIZE, CROP_SIZE), Image.Resampling.BILINEAR, box=box)
    if rng.random() < 0.5:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.array(crop)  # writable: torch.as_tensor warns about read-only arrays


def parse_record(record: bytes) -> tuple[np.ndarray, np.int64, np.int64]:
    """Parses and augments one record (runs on the workers).

    Returns:
        (image uint8[224, 224, 3], label int64[], index int64[]): see `decode_and_augment`.
    """
    from dataservice import io as dsio

    example = dsio.parse_single_example(record, _features())
    image = decode_and_augment(_scalar_bytes(example["image/encoded"]))
    label = np.int64(np.asarray(example["image/class/label"]).reshape(()))
    index = np.int64(np.asarray(example["index"]).reshape(()))
    return image, label, index


def read_tfrecords(filename: str) -> Any:
    """The interleave function: the records of one shard."""
    import dataservice as ds

    return ds.TFRecordDataset(filename)


def make_pipeline(data: DemoData, batch_size: int) -> Any:
    """The input pipeline, without the service: a `Dataset` of
    (uint8[b, 224, 224, 3], int64[b], int64[b]) batches."""
    import dataservice as ds

    return (
        ds.Dataset.list_files(data.pattern, shuffle=True)
        .interleave(read_tfrecords, cycle_length=4, block_length=1)
        .map(parse_record)
        .batch(batch_size)
    )
