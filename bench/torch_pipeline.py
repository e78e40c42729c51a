"""ImageNet-style input pipeline into a small PyTorch training step (not a test):
the data service (`ServiceDataset`, a `LocalCluster` of N worker processes) against
`torch.utils.data.DataLoader(num_workers=N)`, the same decode code in both, in one run.

Each element: JPEG bytes (synthetic photographs made here with Pillow and numpy) ->
Pillow decode -> random-resized-crop to 224x224 (torchvision's parameters) ->
random horizontal flip -> uint8[224, 224, 3]; batches of 64. The trainer (one
thread) converts each batch to float NCHW and runs forward/backward/SGD of a small
CNN. Both paths draw an element's randomness from its index, so they do the same work.

Reported per path: images/s over the timed epochs (after one warm-up epoch), and
the trainer's wait fraction (time blocked for the next batch / total). Written to
bench/results/torch_pipeline.json with the machine's core count and load average:
on a shared machine, compare the two columns of one run, not runs.

Usage:
    python bench/torch_pipeline.py [--images 1024] [--epochs 2] [--workers 2]
        [--batch-size 64] [--json bench/results/torch_pipeline.json]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import time
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

import dataservice as ds
from dataservice.torch import ServiceDataset

SIZE = 224
CLASSES = 100
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ------------------------------------------------------------------ data
def make_jpegs(n: int, seed: int = 0) -> list[bytes]:
    """`n` JPEGs (quality 90) of 320-500 x 320-500 pixels: smooth colour fields with
    noise and shapes, so they compress and decode like photographs, not like noise."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        h, w = (int(v) for v in rng.integers(320, 501, 2))
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        base = rng.random(3) * 255
        grad = rng.normal(0, 0.4, (2, 3))
        img = base + yy[..., None] * grad[0] + xx[..., None] * grad[1]
        for _ in range(4):
            cy, cx, r = rng.integers(0, h), rng.integers(0, w), rng.integers(20, 120)
            img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.random(3) * 255
        img += rng.normal(0, 8, img.shape)
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def random_resized_crop_box(
    width: int, height: int, rng: np.random.Generator
) -> tuple[int, int, int, int]:
    """(left, top, w, h) of a crop covering 8-100 % of the area at aspect 3/4-4/3.

    Source: torchvision/transforms/transforms.py, `RandomResizedCrop.get_params`.
    """
    area = width * height
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target_area = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    # Fallback: the central crop at the nearest allowed aspect ratio.
    ratio = width / height
    if ratio < 3 / 4:
        w, h = width, int(round(width / (3 / 4)))
    elif ratio > 4 / 3:
        h, w = height, int(round(height * (4 / 3)))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def decode_and_augment(jpeg: bytes, index: int) -> np.ndarray:
    """JPEG bytes -> uint8[224, 224, 3]: decode, random-resized-crop, random flip.
    The randomness comes from `index` (the same work on both paths)."""
    rng = np.random.default_rng(int(index))
    with Image.open(io.BytesIO(jpeg)) as im:
        im = im.convert("RGB")
        left, top, w, h = random_resized_crop_box(im.width, im.height, rng)
        im = im.resize((SIZE, SIZE), Image.BILINEAR, box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return np.array(im, dtype=np.uint8)  # writable: torch warns on read-only arrays


def service_element(e: dict[str, Any]) -> dict[str, Any]:
    """The service pipeline's map (runs on its workers)."""
    return {"image": decode_and_augment(e["jpeg"], e["index"]), "label": e["label"]}


class JpegDataset(torch.utils.data.Dataset):
    """The DataLoader path's map-style dataset over the same JPEGs and decode code."""

    def __init__(self, jpegs: list[bytes], labels: np.ndarray) -> None:
        self.jpegs, self.labels = jpegs, labels

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": decode_and_augment(self.jpegs[i], i), "label": self.labels[i]}


# ------------------------------------------------------------------ training
def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 5, stride=4, padding=2),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, CLASSES),
    )


def train(loader: Any, epochs: int) -> dict[str, Any]:
    """One warm-up epoch, then `epochs` timed ones; images/s and wait fraction."""
    torch.manual_seed(0)
    net = small_cnn()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
    images = 0
    wait_s = step_s = 0.0
    start = 0.0
    for epoch in range(epochs + 1):
        if epoch == 1:
            images, wait_s, step_s = 0, 0.0, 0.0
            start = time.perf_counter()
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            t1 = time.perf_counter()
            x = batch["image"].permute(0, 3, 1, 2).float().sub_(mean).div_(64)
            opt.zero_grad()
            loss_fn(net(x), batch["label"].long()).backward()
            opt.step()
            images += len(batch["label"])
            del batch, x
            t2 = time.perf_counter()
            wait_s += t1 - t0
            step_s += t2 - t1
    total = time.perf_counter() - start
    return {
        "images": images,
        "seconds": round(total, 3),
        "images_per_s": round(images / total, 1),
        "wait_fraction": round(wait_s / total, 3),
        "train_step_s": round(step_s, 3),
    }


def run_service(jpegs: list[bytes], labels: np.ndarray, args: argparse.Namespace) -> dict:
    source = ds.Dataset.from_tensor_slices(
        {"jpeg": jpegs, "label": labels, "index": np.arange(len(jpegs), dtype=np.int64)}
    )
    pipeline = source.map(service_element).batch(args.batch_size)
    with ds.LocalCluster(num_workers=args.workers) as cluster:
        dataset = pipeline.apply(
            ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name="bench")
        )
        service = ServiceDataset(dataset)
        loader = torch.utils.data.DataLoader(service, batch_size=None)
        result = train(loader, args.epochs)
        stats = service.stats()
    result["transport"] = sorted({w["transfer_protocol"] for w in stats["workers"].values()})
    return result


def run_dataloader(jpegs: list[bytes], labels: np.ndarray, args: argparse.Namespace) -> dict:
    loader = torch.utils.data.DataLoader(
        JpegDataset(jpegs, labels),
        batch_size=args.batch_size,
        num_workers=args.workers,
        persistent_workers=True,
    )
    return train(loader, args.epochs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs (after one warm-up)")
    p.add_argument("--workers", type=int, default=2, help="service workers / DataLoader workers")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--json", default=os.path.join(RESULTS, "torch_pipeline.json"))
    args = p.parse_args()
    torch.set_num_threads(1)  # the trainer: one thread, as the decode processes are N

    t0 = time.perf_counter()
    jpegs = make_jpegs(args.images)
    labels = np.arange(args.images, dtype=np.int64) % CLASSES
    made_s = time.perf_counter() - t0
    mean_kb = sum(map(len, jpegs)) / len(jpegs) / 1024
    print(f"{args.images} JPEGs, {mean_kb:.0f} KB on average, made in {made_s:.1f} s", flush=True)

    load_before = os.getloadavg()
    results = {
        "service": run_service(jpegs, labels, args),
        "dataloader": run_dataloader(jpegs, labels, args),
    }
    out = {
        "config": {
            "images": args.images,
            "epochs_timed": args.epochs,
            "workers": args.workers,
            "batch_size": args.batch_size,
            "mean_jpeg_kb": round(mean_kb, 1),
            "pipeline": "Pillow decode -> random-resized-crop 224 -> flip -> batch",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": [round(v, 2) for v in load_before],
            "loadavg_after": [round(v, 2) for v in os.getloadavg()],
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        **results,
        "service_over_dataloader": round(
            results["service"]["images_per_s"] / results["dataloader"]["images_per_s"], 3
        ),
    }
    for name in ("service", "dataloader"):
        r = results[name]
        print(
            f"{name:>10}: {r['images_per_s']:8.1f} images/s, trainer waits "
            f"{100 * r['wait_fraction']:4.1f} % of the time ({r['images']} images, "
            f"{r['seconds']} s)",
            flush=True,
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
