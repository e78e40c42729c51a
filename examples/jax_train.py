"""A JAX training loop fed by the data service (one host).

    python examples/jax_train.py                          # a LocalCluster of 2 workers
    python examples/jax_train.py --dispatcher grpc://host:5050 --recipe coordinated

The service hands out numpy batches (same-host arrays of >= 64 KiB are views of
a worker's shared-memory ring, no copy); `jax.device_put` copies each one into
the device's memory (also on the CPU backend: jax 0.4-0.10 do not alias a numpy
buffer there), after which the numpy view can go and its ring space is reused.
Keep a view only as long as you need the numpy array itself.

Multi-process (multi-host) layout: after `jax.distributed.initialize()`, every
process is one consumer of the service, exactly as a PyTorch rank:

    dataset = pipeline.apply(ds.distribute(
        ds.ShardingPolicy.DYNAMIC, DISPATCHER, job_name="train",      # shared job
        consumer_index=jax.process_index(),                           # coordinated reads:
        num_consumers=jax.process_count()))                           # one batch per step

(leave out consumer_index / num_consumers for a shared DYNAMIC job, where each
process reads what it gets; give a per-process job and `seed + process_index` for
OFF). Each process's batch is its local part of the global batch: make the global
array with `jax.make_array_from_process_local_data(sharding, local_batch)`.
Coordinated reads give every process a batch at every step, which a jit-compiled
step over a global array needs; with a shared DYNAMIC job the processes must
agree on when to stop (e.g. a fixed step count below the epoch's batches).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import dataservice as ds

IMAGE = 32
CLASSES = 10


def make_image(i):
    """Runs on the service's workers: a synthetic labelled image, float32[32, 32, 3]."""
    rng = np.random.default_rng(int(i))
    label = int(i) % CLASSES
    image = rng.random((IMAGE, IMAGE, 3), dtype=np.float32)
    image[..., label % 3] *= 0.5  # something for the model to learn
    return {"image": image, "label": np.int32(label)}


def init_params(key):
    k1, _ = jax.random.split(key)
    return {
        "w": jax.random.normal(k1, (IMAGE * IMAGE * 3, CLASSES)) * 0.01,
        "b": jnp.zeros(CLASSES),
    }


def loss_fn(params, images, labels):
    logits = images.reshape(images.shape[0], -1) @ params["w"] + params["b"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


@jax.jit
def train_step(params, images, labels, lr=0.01):
    loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
    return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads), loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dispatcher", help="a running dispatcher; default: start a LocalCluster")
    p.add_argument("--recipe", choices=["dynamic", "coordinated"], default="dynamic")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()

    with contextlib.ExitStack() as stack:
        if args.dispatcher:
            target = args.dispatcher
        else:
            target = stack.enter_context(ds.LocalCluster(num_workers=args.workers)).target
        source = ds.Dataset.range(args.images)
        consumers = {}
        if args.recipe == "coordinated":
            source = source.repeat()  # coordinated reads need an endless dataset
            consumers = dict(consumer_index=jax.process_index(), num_consumers=jax.process_count())
        dataset = source.map(make_image).batch(args.batch_size, drop_remainder=True)
        dataset = dataset.apply(
            ds.distribute(ds.ShardingPolicy.DYNAMIC, target, job_name="jax-train", **consumers)
        )

        params = init_params(jax.random.PRNGKey(0))
        it = iter(dataset)
        steps = images = 0
        wait_s = 0.0
        loss = jnp.zeros(())
        start = time.perf_counter()
        while steps < args.steps:
            t0 = time.perf_counter()
            try:
                batch = next(it)  # numpy: image float32[B, 32, 32, 3] (a ring view), label int32[B]
            except StopIteration:
                break
            x = jax.device_put(batch["image"])  # a copy on the device: the view may go now
            y = jax.device_put(batch["label"])
            del batch
            wait_s += time.perf_counter() - t0
            params, loss = train_step(params, x, y)
            images += x.shape[0]
            steps += 1
        loss.block_until_ready()
        elapsed = time.perf_counter() - start
        stats = it.stats()
        transports = sorted({w["transfer_protocol"] for w in stats["workers"].values()})
        print(
            f"process {jax.process_index()}/{jax.process_count()} on {jax.devices()[0]} "
            f"[{args.recipe}]: {steps} steps, {images} images in {elapsed:.2f} s = "
            f"{images / max(elapsed, 1e-9):.0f} images/s; data wait (next + device_put) "
            f"{wait_s:.2f} s ({100 * wait_s / max(elapsed, 1e-9):.0f} %); transport "
            f"{','.join(transports) or '-'}; last loss {float(loss):.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
