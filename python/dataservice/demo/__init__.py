"""`dataservice demo`: an ImageNet-style input pipeline feeding a training loop
through a local data service (one dispatcher and `--workers` worker processes).

What it does:

1. Writes a real image dataset once into `--data-dir` (default
   `~/.cache/dataservice/demo-images`): `--num-records` (default 2,048)
   `tf.train.Example` records in 16 TFRecord shards named
   `train-00000-of-00016.tfrecord` ..., with the ImageNet feature layout
   (`image/encoded` JPEG, `image/class/label`, `image/class/text`,
   `image/height`, `image/width`, `image/format`) plus `index`, a unique
   int64 per record. Each record is a random square crop, 180-256 px on a side
   (smaller for a photo smaller than that), of one of the photographs shipped
   inside scikit-image and scikit-learn (photos larger than 512 px on their
   short side are first scaled down to 512), resized to 192x192 and encoded
   as JPEG (quality 90) with Pillow. The label is the index of the source
   photo. Seeded and deterministic. `DATASET.json`, written last, records the
   format version and parameters: a half-written or different directory is
   rebuilt.
2. Runs the classic pipeline on `LocalCluster(num_workers=--workers)`:
   `list_files(shuffle=True)` -> `interleave(TFRecordDataset, cycle_length=4)`
   -> `map(parse: decode JPEG, random 160x160 crop, random horizontal flip,
   float32 in [0, 1])` -> `batch(--batch-size)` -> `distribute(DYNAMIC)`, and
   trains a linear softmax classifier in numpy (SGD on 8x8-average-pooled
   pixels, 20x20x3 features) for `--epochs` epochs, a fresh iterator per epoch.
3. Checks what DYNAMIC sharding promises without failures: every record of
   each epoch is consumed exactly once (by its `index`). A violation prints a
   FAILED line and exits 1.
4. Runs the same pipeline and training step in-process (no service) for one
   epoch, for comparison, and prints a summary (`--json`: one JSON line, last
   on stdout).

Needs the `image` extra: `pip install 'dataservice[image]'`.

Modules (each owns one concern):

- `data`: the dataset writer and `DemoData` (step 1), `DemoError`.
- `pipeline`: the record parser and `make_pipeline` (what the workers run).
- `training`: the model, one epoch of training with the exactly-once check (step 3), the
  progress bar and the stall watch.
- `report`: the summary table and JSON line.
- `command`: the flags (`add_arguments`) and `run`, which ties the steps together.

Importing this package is light (numpy only): `dataservice --help` imports it to build the
`demo` subcommand; Pillow, scikit-image and the service are imported when they are used.
"""

from __future__ import annotations

from dataservice.demo.command import add_arguments, run
from dataservice.demo.data import (
    DEFAULT_DATA_DIR,
    DEFAULT_NUM_RECORDS,
    FORMAT_VERSION,
    MARKER,
    MAX_SOURCE_SIDE,
    NUM_SHARDS,
    STORED_SIZE,
    DemoData,
    DemoError,
    ensure_dataset,
    load_photos,
    write_dataset,
)
from dataservice.demo.pipeline import CROP_SIZE, make_pipeline, parse_record, read_tfrecords
from dataservice.demo.training import POOL, SoftmaxClassifier, features

__all__ = [
    "CROP_SIZE",
    "DEFAULT_DATA_DIR",
    "DEFAULT_NUM_RECORDS",
    "FORMAT_VERSION",
    "MARKER",
    "MAX_SOURCE_SIDE",
    "NUM_SHARDS",
    "POOL",
    "STORED_SIZE",
    "DemoData",
    "DemoError",
    "SoftmaxClassifier",
    "add_arguments",
    "ensure_dataset",
    "features",
    "load_photos",
    "make_pipeline",
    "parse_record",
    "read_tfrecords",
    "run",
    "write_dataset",
]
