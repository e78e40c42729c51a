"""The demo's trainer side: the model (a small MLP on normalised, pooled pixels, in numpy),
one epoch of training over an iterable that times the trainer's waits for data, with the
exactly-once check of each epoch, the progress bar and the stall watch that turns a hung
read into a failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataservice.demo.data import DemoError

POOL = 4  # average pooling: 224x224x3 -> 56x56x3 features
HIDDEN = 128  # units of the MLP's hidden layer
# ImageNet's per-channel mean and standard deviation (torchvision's Normalize), in 0-255 units.
MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], np.float32) * 255


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Holds numpy's BLAS to one thread (with threadpoolctl, a dependency of scikit-learn;
    without it, does nothing), so that the trainer uses one core in every row, as a GPU
    trainer's host thread would, and does not spin on the cores the workers use."""
    try:
        from threadpoolctl import threadpool_limits  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


FEATURE_CHUNK = 8  # images normalised at a time: 4.8 MB of float32, not 38 MB per batch


def features(images: np.ndarray) -> np.ndarray:
    """uint8[b, h, w, 3] -> float32[b, (h/4) * (w/4) * 3]: normalised with ImageNet's mean
    and std (as torchvision's Normalize), then 4x4 average-pooled.

    Works through the batch `FEATURE_CHUNK` images at a time, so that its float32
    temporaries stay in cache instead of evicting the workers' (on 2 cores they share it).

    Raises:
        ValueError: `h` or `w` is not a multiple of 4.
    """
    b, h, w, c = images.shape
    if h % POOL or w % POOL:
        raise ValueError(f"image height and width must be multiples of {POOL}, got {h}x{w}")
    out = np.empty((b, (h // POOL) * (w // POOL) * c), np.float32)
    inverse_std = np.float32(1) / STD
    for start in range(0, b, FEATURE_CHUNK):
        x = images[start : start + FEATURE_CHUNK].astype(np.float32)
        n = len(x)
        x -= MEAN
        x *= inverse_std
        # Two passes over contiguous runs (rows, then columns) instead of one 6-d mean: ~3x
        # faster.
        rows = x.reshape(n * (h // POOL), POOL, w * c).sum(axis=1)
        pooled = rows.reshape(n * (h // POOL) * (w // POOL), POOL, c).sum(axis=1)
        out[start : start + n] = pooled.reshape(n, -1) * np.float32(1 / (POOL * POOL))
    return out


class MLPClassifier:
    """A one-hidden-layer perceptron (ReLU, softmax output) trained by SGD with momentum
    on `features` of uint8 images, in numpy.

    Thread-compatible (caller locks).
    """

    def __init__(
        self,
        num_features: int,
        num_classes: int,
        learning_rate: float = 0.01,
        *,
        hidden: int = HIDDEN,
        momentum: float = 0.9,
        seed: int = 0,
    ) -> None:
        rng = np.random.default_rng(seed)
        # He initialisation for the ReLU layer; the output layer starts at zero, so the first
        # loss is ln(num_classes) and the hidden layer learns from the second step on.
        self.w1 = (rng.standard_normal((num_features, hidden)) * np.sqrt(2 / num_features)).astype(
            np.float32
        )
        self.b1 = np.zeros(hidden, np.float32)
        self.w2 = np.zeros((hidden, num_classes), np.float32)
        self.b2 = np.zeros(num_classes, np.float32)
        self.learning_rate = np.float32(learning_rate)
        self.momentum = np.float32(momentum)
        self._velocity = [np.zeros_like(p) for p in (self.w1, self.b1, self.w2, self.b2)]

    def step(self, images: np.ndarray, labels: np.ndarray) -> float:
        """One SGD step on a batch of uint8[b, h, w, 3] images and int64[b] labels; returns
        the batch's mean cross-entropy loss before the step (nats)."""
        x = features(images)
        hidden = x @ self.w1 + self.b1
        active = np.maximum(hidden, 0)
        logits = active @ self.w2 + self.b2
        logits -= logits.max(axis=1, keepdims=True)
        exp = np.exp(logits)
        probs = exp / exp.sum(axis=1, keepdims=True)
        n = len(labels)
        loss = float(-np.log(probs[np.arange(n), labels] + 1e-12).mean())
        grad = probs
        grad[np.arange(n), labels] -= 1
        grad /= n
        grad_active = grad @ self.w2.T
        grad_active[hidden <= 0] = 0
        grads = (x.T @ grad_active, grad_active.sum(axis=0), active.T @ grad, grad.sum(axis=0))
        for param, velocity, g in zip(
            (self.w1, self.b1, self.w2, self.b2), self._velocity, grads, strict=True
        ):
            velocity *= self.momentum
            velocity += g
            param -= self.learning_rate * velocity
        return loss


class Progress:
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


class StallWatch:
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
class EpochResult:
    """One epoch of training.

    `wait_s` is the time the trainer spent waiting for data: in `iter()` (starting the
    epoch's readers) and in each `next()`; `wall_s` is the epoch's time from `iter()` to the
    end of the data, training included.
    """

    images: int
    batches: int
    losses: list[float]
    index_counts: np.ndarray
    stats: dict[str, Any] | None
    wall_s: float
    wait_s: float


def run_epoch(
    iterable: Iterable[Any],
    model: MLPClassifier,
    num_records: int,
    progress: Progress,
    stall: StallWatch | None,
) -> EpochResult:
    """Trains `model` on one epoch of `iterable`'s (images, labels, indices) batches.

    Raises:
        DemoError: a record index outside [0, `num_records`).
    """
    counts = np.zeros(num_records, np.int64)
    images_seen = batches = 0
    losses = []
    t0 = time.perf_counter()
    iterator = iter(iterable)
    wait_s = time.perf_counter() - t0
    try:
        while True:
            t = time.perf_counter()
            try:
                images, labels, indices = next(iterator)
            except StopIteration:
                wait_s += time.perf_counter() - t
                break
            wait_s += time.perf_counter() - t
            if stall is not None:
                stall.poke()
            labels = np.asarray(labels, np.int64)
            indices = np.asarray(indices, np.int64)
            if indices.size and (indices.min() < 0 or indices.max() >= num_records):
                raise DemoError(f"a record index is out of range [0, {num_records}): {indices}")
            np.add.at(counts, indices, 1)
            loss = model.step(np.asarray(images), labels)
            losses.append(loss)
            images_seen += len(labels)
            batches += 1
            progress.update(len(labels), loss)
        wall_s = time.perf_counter() - t0
        stats_fn = getattr(iterator, "stats", None)
        stats = stats_fn() if callable(stats_fn) else None
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):
            close()
    return EpochResult(images_seen, batches, losses, counts, stats, wall_s, wait_s)


def check_epoch(epoch: int, counts: np.ndarray) -> str | None:
    missing = int((counts == 0).sum())
    duplicated = int((counts > 1).sum())
    if missing or duplicated:
        examples = np.flatnonzero(counts != 1)[:5].tolist()
        return (
            f"epoch {epoch}: {missing} records never seen, {duplicated} seen more than once "
            f"(e.g. indices {examples}); DYNAMIC sharding must deliver each record exactly once"
        )
    return None
