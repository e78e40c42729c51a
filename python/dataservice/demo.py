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
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import math
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMAT_VERSION = 1
NUM_SHARDS = 16
DEFAULT_NUM_RECORDS = 2048
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "dataservice", "demo-images")
STORED_SIZE = 192  # px, square, as stored
CROP_SIZE = 160  # px, square, what the pipeline feeds the model
MIN_SOURCE_CROP, MAX_SOURCE_CROP = 180, 256  # px, crop side taken from a photo
MAX_SOURCE_SIDE = 512  # px: photos with a larger short side are scaled down first
POOL = 8  # average pooling: 160x160x3 -> 20x20x3 features
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


# ------------------------------------------------------------------ the data


def _require_image_extras() -> None:
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
        "stored_size": STORED_SIZE,
        "class_names": names,
    }


def _encode_record(index: int, label: int, photo: np.ndarray, class_name: str, seed: int) -> bytes:
    from PIL import Image

    from dataservice import io as dsio

    rng = np.random.default_rng([seed, index])  # per record: independent of write order
    h, w = photo.shape[:2]
    max_side = min(MAX_SOURCE_CROP, h, w)
    min_side = min(MIN_SOURCE_CROP, max_side)
    side = int(rng.integers(min_side, max_side + 1))
    y = int(rng.integers(0, h - side + 1))
    x = int(rng.integers(0, w - side + 1))
    crop = Image.fromarray(photo[y : y + side, x : x + side])
    crop = crop.resize((STORED_SIZE, STORED_SIZE), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    crop.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return dsio.serialize_example(
        {
            "image/encoded": buf.getvalue(),
            "image/format": b"jpeg",
            "image/height": STORED_SIZE,
            "image/width": STORED_SIZE,
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
    photos and shuffled. `DATASET.json` is written last, atomically.

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
        log(
            f"  wrote {num_records} records in {num_shards} shards in {time.monotonic() - t0:.1f} s"
        )
    return DemoData(data_dir, num_records, num_shards, tuple(names), seed)


def ensure_dataset(
    data_dir: str, num_records: int = DEFAULT_NUM_RECORDS, *, seed: int = 0, log: Any = None
) -> DemoData:
    """Returns the dataset in `data_dir`, writing it first unless a complete one
    with the same parameters is there. Safe against concurrent demos (flock)."""
    data_dir = os.path.abspath(os.path.expanduser(data_dir))
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, ".lock"), "w") as lock:
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


# -------------------------------------------------------------- the pipeline

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


# -------------------------------------------------------------- the model


def features(images: np.ndarray) -> np.ndarray:
    """float32[b, 160, 160, 3] -> float32[b, 1200]: 8x8 average pooling, centred."""
    b, h, w, c = images.shape
    pooled: np.ndarray = images.reshape(b, h // POOL, POOL, w // POOL, POOL, c).mean(axis=(2, 4))
    flat: np.ndarray = pooled.reshape(b, -1) - np.float32(0.5)
    return flat


class SoftmaxClassifier:
    """Multinomial logistic regression trained by plain SGD, in numpy.

    Thread-compatible (caller locks).
    """

    def __init__(self, num_features: int, num_classes: int, learning_rate: float = 0.3) -> None:
        self.weights = np.zeros((num_features, num_classes), np.float32)
        self.bias = np.zeros(num_classes, np.float32)
        self.learning_rate = np.float32(learning_rate)

    def step(self, x: np.ndarray, labels: np.ndarray) -> float:
        """One SGD step on a batch; returns its mean cross-entropy loss (nats)."""
        logits = x @ self.weights + self.bias
        logits -= logits.max(axis=1, keepdims=True)
        exp = np.exp(logits)
        probs = exp / exp.sum(axis=1, keepdims=True)
        n = len(labels)
        loss = float(-np.log(probs[np.arange(n), labels] + 1e-12).mean())
        grad = probs
        grad[np.arange(n), labels] -= 1
        grad /= n
        self.weights -= self.learning_rate * (x.T @ grad)
        self.bias -= self.learning_rate * grad.sum(axis=0)
        return loss


# ----------------------------------------------------------------- progress


class _Progress:
    """tqdm on stderr when installed, else a one-line bar; nothing if disabled."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._bar: Any = None
        self._enabled = enabled
        self._total, self._desc, self._n = total, desc, 0
        self._t0 = self._last = time.monotonic()
        if not enabled:
            return
        try:
            from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

            self._bar = tqdm(total=total, desc=desc, unit="img", file=sys.stderr, leave=True)
        except ImportError:
            self._bar = None

    def update(self, n: int, loss: float) -> None:
        self._n += n
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last < 0.1 and self._n < self._total:
            return
        self._last = now
        frac = min(1.0, self._n / max(1, self._total))
        rate = self._n / max(1e-9, now - self._t0)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        sys.stderr.write(
            f"\r{self._desc} [{bar}] {self._n}/{self._total} img {rate:.0f} img/s loss {loss:.3f}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ---------------------------------------------------------------------- run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `dataservice demo`."""
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default: 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per batch (default: 64)")
    parser.add_argument("--epochs", type=int, default=2, help="training epochs (default: 2)")
    parser.add_argument(
        "--data-dir",
        default=DEFAULT_DATA_DIR,
        help="where the image dataset is cached (default: %(default)s)",
    )
    parser.add_argument(
        "--num-records",
        type=int,
        default=DEFAULT_NUM_RECORDS,
        help="records in the dataset (default: %(default)s; small for tests)",
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset seed (default: 0)")
    parser.add_argument(
        "--learning-rate", type=float, default=0.3, help="SGD learning rate (default: 0.3)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the summary as one JSON line, last on stdout"
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    parser.add_argument(
        "--stall-timeout-s",
        type=float,
        default=300.0,
        help="fail if no batch arrives for this long (default: %(default)s)",
    )
    parser.add_argument("--verbose", action="store_true", help="show the servers' logs on stderr")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _StallWatch:
    """Interrupts the main thread (SIGINT) when `poke()` is not called for
    `timeout_s` seconds, so that a hung read fails instead of hanging."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.fired = False
        self._last = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-stall-watch", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._last = time.monotonic()

    def _run(self) -> None:
        while not self._done.wait(0.5):
            if time.monotonic() - self._last > self.timeout_s:
                self.fired = True
                os.kill(os.getpid(), signal.SIGINT)
                return

    def close(self) -> None:
        self._done.set()
        self._thread.join(2.0)


@dataclass
class _EpochResult:
    images: int
    batches: int
    losses: list[float]
    index_counts: np.ndarray
    stats: dict[str, Any] | None


def _run_epoch(
    iterator: Iterator[Any],
    model: SoftmaxClassifier,
    num_records: int,
    progress: _Progress,
    stall: _StallWatch | None,
    max_batches: int | None = None,
) -> _EpochResult:
    counts = np.zeros(num_records, np.int64)
    images_seen = batches = 0
    losses = []
    for images, labels, indices in iterator:
        if stall is not None:
            stall.poke()
        labels = np.asarray(labels, np.int64)
        indices = np.asarray(indices, np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= num_records):
            raise DemoError(f"a record index is out of range [0, {num_records}): {indices}")
        np.add.at(counts, indices, 1)
        loss = model.step(features(np.asarray(images, np.float32)), labels)
        losses.append(loss)
        images_seen += len(labels)
        batches += 1
        progress.update(len(labels), loss)
        if max_batches is not None and batches >= max_batches:
            break
    stats_fn = getattr(iterator, "stats", None)
    stats = stats_fn() if callable(stats_fn) else None
    return _EpochResult(images_seen, batches, losses, counts, stats)


def _check_epoch(epoch: int, counts: np.ndarray) -> str | None:
    missing = int((counts == 0).sum())
    duplicated = int((counts > 1).sum())
    if missing or duplicated:
        examples = np.flatnonzero(counts != 1)[:5].tolist()
        return (
            f"epoch {epoch}: {missing} records never seen, {duplicated} seen more than once "
            f"(e.g. indices {examples}); DYNAMIC sharding must deliver each record exactly once"
        )
    return None


def run(args: argparse.Namespace) -> int:
    """Runs the demo; returns the exit code (0 passed, 1 failed)."""
    try:
        return _run(args)
    except DemoError as e:
        print(f"dataservice demo: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("dataservice demo: interrupted", file=sys.stderr, flush=True)
        return 130


def _run(args: argparse.Namespace) -> int:
    for name in ("workers", "batch_size", "epochs", "num_records"):
        if getattr(args, name) < 1:
            raise DemoError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    _require_image_extras()
    import dataservice as ds

    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    data = ensure_dataset(args.data_dir, args.num_records, seed=args.seed, log=_log)
    pipeline = make_pipeline(data, args.batch_size)
    num_features = (CROP_SIZE // POOL) ** 2 * 3
    model = SoftmaxClassifier(num_features, data.num_classes, args.learning_rate)
    job_name = f"dataservice-demo-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    epochs: list[_EpochResult] = []
    stall = None
    failure = None
    _log(f"starting a local cluster: 1 dispatcher, {args.workers} workers")
    try:
        with ds.LocalCluster(
            num_workers=args.workers,
            worker_options={"heartbeat_interval_ms": 100},
            forward_output=args.verbose,
            log_level="INFO" if args.verbose else "WARNING",
        ) as cluster:
            _log(f"dispatcher {cluster.dispatcher_address}, workers {cluster.worker_addresses}")
            distributed = pipeline.apply(
                ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name=job_name)
            )
            stall = _StallWatch(args.stall_timeout_s)
            t0 = time.monotonic()
            for epoch in range(args.epochs):
                progress = _Progress(
                    data.num_records, f"epoch {epoch + 1}/{args.epochs}", show_progress
                )
                iterator = iter(distributed)
                try:
                    epochs.append(_run_epoch(iterator, model, data.num_records, progress, stall))
                finally:
                    progress.close()
                    close = getattr(iterator, "close", None)
                    if callable(close):
                        close()
            wall_s = time.monotonic() - t0
            stall.close()
    except KeyboardInterrupt:
        if stall is not None and stall.fired:
            failure = f"no batch arrived for {args.stall_timeout_s:.0f} s (--stall-timeout-s)"
        else:
            raise
    finally:
        if stall is not None:
            stall.close()
    if failure is not None:
        print(f"dataservice demo: FAILED: {failure}", flush=True)
        return 1

    # The same pipeline and training step in this process, without the service.
    _log("timing the same pipeline in-process (no service), one epoch")
    in_process_model = SoftmaxClassifier(num_features, data.num_classes, args.learning_rate)
    progress = _Progress(data.num_records, "in-process", show_progress)
    t1 = time.monotonic()
    try:
        local = _run_epoch(iter(pipeline), in_process_model, data.num_records, progress, None)
    finally:
        progress.close()
    in_process_s = time.monotonic() - t1

    failures = [f for e, r in enumerate(epochs) if (f := _check_epoch(e + 1, r.index_counts))]
    summary = _summary(args, data, epochs, wall_s, local, in_process_s)
    _print_summary(summary, failures)
    if args.json:
        print(json.dumps(summary, sort_keys=True), flush=True)
    return 1 if failures else 0


def _summary(
    args: argparse.Namespace,
    data: DemoData,
    epochs: list[_EpochResult],
    wall_s: float,
    local: _EpochResult,
    in_process_s: float,
) -> dict[str, Any]:
    per_worker: dict[str, int] = {}
    transports: set[str] = set()
    wait_ms = 0.0
    bytes_read = 0
    for r in epochs:
        if not r.stats:
            continue
        wait_ms += float(r.stats.get("wait_ms", 0.0))
        bytes_read += int(r.stats.get("bytes", 0))
        for address, w in r.stats.get("workers", {}).items():
            per_worker[address] = per_worker.get(address, 0) + int(w.get("elements", 0))
            if w.get("elements", 0) and w.get("transfer_protocol"):
                transports.add(str(w["transfer_protocol"]))
    images = sum(r.images for r in epochs)
    loss_per_epoch = [float(np.mean(r.losses)) if r.losses else math.nan for r in epochs]
    return {
        "images_per_second": images / wall_s if wall_s > 0 else 0.0,
        "in_process_images_per_second": local.images / in_process_s if in_process_s > 0 else 0.0,
        "in_process_measured_on": f"1 epoch ({local.batches} batches, {local.images} images)",
        "epochs": len(epochs),
        "batches": sum(r.batches for r in epochs),
        "images": images,
        "wall_s": wall_s,
        "wait_ms": wait_ms,
        "bytes": bytes_read,
        "transport": "+".join(sorted(transports)) if transports else "unknown",
        "workers": args.workers,
        "batch_size": args.batch_size,
        "records_per_epoch": [int(r.index_counts.sum()) for r in epochs],
        "elements_per_worker": per_worker,
        "loss_per_epoch": loss_per_epoch,
        "num_records": data.num_records,
        "num_classes": data.num_classes,
        "data_dir": data.data_dir,
        "exactly_once": all(_check_epoch(0, r.index_counts) is None for r in epochs),
    }


def _print_summary(s: dict[str, Any], failures: list[str]) -> None:
    losses = " -> ".join(f"{v:.3f}" for v in s["loss_per_epoch"])
    lines = [
        "",
        "dataservice demo summary",
        f"  dataset      {s['num_records']} records, {s['num_classes']} classes, "
        f"in {s['data_dir']}",
        f"  epochs       {s['epochs']} ({s['records_per_epoch']} records), "
        f"{s['batches']} batches of up to {s['batch_size']}",
        f"  service      {s['images_per_second']:.1f} images/s over {s['wall_s']:.2f} s "
        f"with {s['workers']} workers, transport {s['transport']}, "
        f"trainer waited {s['wait_ms'] / 1000:.2f} s",
        f"  in-process   {s['in_process_images_per_second']:.1f} images/s "
        f"(no service; {s['in_process_measured_on']}; same training step)",
        "  per worker   "
        + (
            ", ".join(f"{a}: {n} batches" for a, n in sorted(s["elements_per_worker"].items()))
            or "(no stats)"
        ),
        f"  loss/epoch   {losses} (softmax regression on 20x20x3 pooled pixels)",
    ]
    for line in lines:
        print(line)
    if failures:
        for f in failures:
            print(f"dataservice demo: FAILED: {f}")
    else:
        print(
            "dataservice demo: PASSED: every record of each epoch was consumed exactly once "
            "(DYNAMIC sharding)"
        )
    sys.stdout.flush()
