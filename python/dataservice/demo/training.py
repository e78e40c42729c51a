"""The demo's trainer side: the model (a softmax classifier on pooled pixels, in numpy), one
epoch of training over an iterator with the exactly-once check of DYNAMIC sharding, the
progress bar and the stall watch that turns a hung read into a failure.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dataservice.demo.data import DemoError

POOL = 8  # average pooling: 160x160x3 -> 20x20x3 features


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
    images: int
    batches: int
    losses: list[float]
    index_counts: np.ndarray
    stats: dict[str, Any] | None


def run_epoch(
    iterator: Iterator[Any],
    model: SoftmaxClassifier,
    num_records: int,
    progress: Progress,
    stall: StallWatch | None,
    max_batches: int | None = None,
) -> EpochResult:
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
    return EpochResult(images_seen, batches, losses, counts, stats)


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
