"""The demo's input pipeline: shards -> records -> augmented float32 images -> batches.

`parse_record` and `read_tfrecords` run on the workers: they are module-level functions, so
cloudpickle sends them by reference (`dataservice.demo.pipeline.parse_record`) and each
worker imports this module.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import numpy as np

from dataservice.demo.data import DemoData

CROP_SIZE = 160  # px, square, what the pipeline feeds the model

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


def parse_record(record: bytes) -> tuple[np.ndarray, np.int64, np.int64]:
    """Parses and augments one record (runs on the workers).

    Returns:
        (image float32[160, 160, 3] in [0, 1], label int64[], index int64[]):
        a random 160x160 crop of the decoded 192x192 JPEG, flipped left-right
        with probability 1/2.
    """
    from PIL import Image

    from dataservice import io as dsio

    example = dsio.parse_single_example(record, _features())
    with Image.open(io.BytesIO(_scalar_bytes(example["image/encoded"]))) as img:
        pixels = np.asarray(img.convert("RGB"))
    rng = getattr(_local, "rng", None)
    if rng is None:
        rng = _local.rng = np.random.default_rng()
    h, w = pixels.shape[:2]
    y = int(rng.integers(0, h - CROP_SIZE + 1))
    x = int(rng.integers(0, w - CROP_SIZE + 1))
    crop = pixels[y : y + CROP_SIZE, x : x + CROP_SIZE]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    image = crop.astype(np.float32) * np.float32(1 / 255)
    label = np.int64(np.asarray(example["image/class/label"]).reshape(()))
    index = np.int64(np.asarray(example["index"]).reshape(()))
    return image, label, index


def read_tfrecords(filename: str) -> Any:
    """The interleave function: the records of one shard."""
    import dataservice as ds

    return ds.TFRecordDataset(filename)


def make_pipeline(data: DemoData, batch_size: int) -> Any:
    """The input pipeline, without the service: a `Dataset` of
    (float32[b, 160, 160, 3], int64[b], int64[b]) batches."""
    import dataservice as ds

    return (
        ds.Dataset.list_files(data.pattern, shuffle=True)
        .interleave(read_tfrecords, cycle_length=4, block_length=1)
        .map(parse_record)
        .batch(batch_size)
    )
