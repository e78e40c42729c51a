"""`dataservice demo`: an ImageNet-style input pipeline feeding a training loop, run three
ways: in-process, through a local data service (one dispatcher and `--workers` worker
processes) and, when torch imports, through PyTorch's DataLoader.

What it does:

1. Writes a real image dataset once into `--data-dir` (default
   `~/.cache/dataservice/demo-images`, about 100 MB for the default 2,048 records):
   `--num-records` `tf.train.Example` records in 16 TFRecord shards named
   `train-00000-of-00016.tfrecord` ..., with the ImageNet feature layout
   (`image/encoded` JPEG, `image/class/label`, `image/class/text`, `image/height`,
   `image/width`, `image/format`) plus `index`, a unique int64 per record. Each record is
   a full-size photo as ImageNet's are: a random region (half to all of the largest region
   of its aspect ratio, aspect ratio 2/3 to 3/2) of one of the photographs shipped inside
   scikit-image and scikit-learn, scaled to a long side of 500 px (e.g. 500x375) and
   encoded as JPEG (quality 90) with Pillow. The label is the index of the source photo.
   Seeded and deterministic. `DATASET.json`, written last, records the format version and
   parameters: a half-written or different directory is rebuilt.
2. The pipeline, as torchvision's ImageNet training transform: `list_files(shuffle=True)`
   -> `interleave(TFRecordDataset, cycle_length=4)` -> `map(parse: decode the JPEG with
   Pillow, RandomResizedCrop(224, scale=(0.08, 1), ratio=(3/4, 4/3)), random horizontal
   flip; uint8)` -> `batch(--batch-size)`.
3. The training step: a one-hidden-layer MLP in numpy (normalise with ImageNet's mean and
   std, 4x4 average pooling, 9,408 -> 128 -> classes, SGD with momentum), BLAS held to one
   thread. It is cheaper than the pipeline, so that run in turn in one process (the
   in-process row) the trainer mostly waits for data, as a GPU trainer fed by its host's
   CPU does.
4. Trains a fresh model for `--epochs` epochs per row: in-process; through
   `torch.utils.data.DataLoader(num_workers=--workers)` running the same decode code
   (when torch imports); and through `LocalCluster(num_workers=--workers)` with
   `distribute(DYNAMIC)`. Each row reports images/s and the share of its time the trainer
   spent waiting for data (in `iter()` and `next()`), and checks that every record of each
   epoch was read exactly once (by its `index`; for the service, what DYNAMIC sharding
   promises without failures). A violation prints a FAILED line and exits 1.
5. Prints the summary (`--json`: also one JSON line, last on stdout).

Needs the `image` extra: `pip install 'dataservice[image]'`; the DataLoader row needs torch.

Modules (each owns one concern):

- `data`: the dataset writer and `DemoData` (step 1), `DemoError`.
- `pipeline`: the record parser, RandomResizedCrop and `make_pipeline` (what the workers run).
- `training`: the model, one epoch of training that times the trainer's waits, the
  exactly-once check, the progress bar and the stall watch.
- `torch_loader`: the same records through a DataLoader (imports torch).
- `report`: the summary table and JSON line.
- `command`: the flags (`add_arguments`) and `run`, which ties the steps together.

Importing this package is light (numpy only): `dataservice --help` imports it to build the
`demo` subcommand; Pillow, scikit-image, torch and the service are imported when they are
used.
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
    STORED_LONG_SIDE,
    DemoData,
    DemoError,
    ensure_dataset,
    load_photos,
    write_dataset,
)
from dataservice.demo.pipeline import (
    CROP_SIZE,
    decode_and_augment,
    make_pipeline,
    parse_record,
    random_resized_crop_box,
    read_tfrecords,
)
from dataservice.demo.training import POOL, MLPClassifier, features

__all__ = [
    "CROP_SIZE",
    "DEFAULT_DATA_DIR",
    "DEFAULT_NUM_RECORDS",
    "FORMAT_VERSION",
    "MARKER",
    "MAX_SOURCE_SIDE",
    "NUM_SHARDS",
    "POOL",
    "STORED_LONG_SIDE",
    "DemoData",
    "DemoError",
    "MLPClassifier",
    "add_arguments",
    "ensure_dataset",
    "features",
    "decode_and_augment",
    "load_photos",
    "make_pipeline",
    "parse_record",
    "random_resized_crop_box",
    "read_tfrecords",
    "run",
    "write_dataset",
]
