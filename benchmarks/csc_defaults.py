r"""The measurements behind ChunkSparsity's default chunk_size and density.

  PYTHONPATH=. python benchmarks/csc_defaults.py [--steps 40] [--density 0.01]

Three tables, one row per chunk size: bytes, selection quality on the digits CNN's real gradients,
and the time of one replica's CSC arithmetic. What each measures: docs/benchmarks.md, "The tools in detail".
"""

import argparse
import math
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gf_tf  # noqa: E402
from gf_tf.csc import select_chunks, selected_chunk_count  # noqa: E402

CHUNK_SIZES = (16, 64, 256, 1024, 4096, 16384)


def model_sizes():
    """Parameter counts of the reference models (built, not hard-coded)."""
    import keras
    from models import networks
    mlp = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"),
                            keras.layers.Dense(3)])
    return {
        "test MLP": mlp.count_params(),
        "resnet20": networks.resnet_cifar(20).count_params(),
        "digits_cnn": networks.digits_cnn().count_params(),
        "resnet50": networks.resnet50().count_params(),
    }


def bytes_table(sizes, density):
    print(f"\n1. Bytes per step and replica, FP16 wire, density {density:g} "
          "(chunks | norm share of dense fp32 bytes | norm share of sent bytes | ratio vs fp32 dense)")
    header = f"{'chunk_size':>10} {'norms/dense':>11}"
    for name in sizes:
        header += f" | {name + ' chunks':>17} {'norms/sent':>10} {'ratio':>7}"
    print(header)
    for cs in CHUNK_SIZES:
        row = f"{cs:>10} {100 / cs:>10.3f}%"
        for n in sizes.values():
            c = math.ceil(n / cs)
            k = selected_chunk_count(c, density)
            if k >= c:
                row += f" | {c:>17,} {'dense':>10} {2.0:>7.1f}"
                continue
            norms, selected = 4 * c, 2 * k * cs
            row += f" | {c:>17,} {100 * norms / (norms + selected):>9.1f}% " \
                   f"{4 * n / (norms + selected):>7.1f}"
        print(row)


def digits_gradients(steps, seed=0):
    """Flattened gradients (backprop order, float32) of the digits CNN along `steps` SGD steps."""
    import keras
    from sklearn.datasets import load_digits
    from models import networks
    keras.utils.set_random_seed(seed)
    data = load_digits()
    x = (data.images[..., None] / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    model = networks.digits_cnn()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    rng = np.random.default_rng(seed)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return tf.concat([tf.reshape(g, [-1]) for g in reversed(grads)], 0)

    out = []
    for _ in range(steps):
        idx = rng.choice(len(x), 64, replace=False)
        out.append(step(x[idx], y[idx]).numpy())
    return np.stack(out)


def captured_mass(grads, cs, density):
    """Mean share of |acc|'s L1 mass in the selected chunks, replaying error feedback."""
    n = grads.shape[1]
    c = math.ceil(n / cs)
    k = selected_chunk_count(c, density)
    pad = c * cs - n
    residual = np.zeros(n, np.float32)
    shares = []
    for g in grads:
        acc = residual + g
        norms = np.abs(np.pad(acc, (0, pad))).reshape(c, cs).sum(1)
        idx = select_chunks(tf.constant(norms), k).numpy()
        mask = np.zeros(c, bool)
        mask[idx] = True
        element_mask = np.repeat(mask, cs)[:n]
        shares.append(np.abs(acc[element_mask]).sum() / np.abs(acc).sum())
        residual = np.where(element_mask, 0.0, acc).astype(np.float32)
    return float(np.mean(shares)), k * cs / n


def quality_table(steps, density):
    print(f"\n2. Selection quality on digits_cnn gradients ({steps} SGD steps, density {density:g}): "
          "share of the accumulator's L1 mass sent per step (with error feedback)")
    grads = digits_gradients(steps)
    print(f"   {grads.shape[1]:,} gradient elements; random chunks would carry ~{density:.1%}")
    print(f"{'chunk_size':>10} {'elements sent':>14} {'L1 mass sent':>13}")
    for cs in (1,) + CHUNK_SIZES:
        share, sent = captured_mass(grads, cs, density)
        print(f"{cs:>10} {sent:>13.2%} {share:>12.1%}")


def time_table(all_sizes, density, reps=5):
    print(f"\n3. One replica's CSC arithmetic per step, ms (median of {reps}; "
          f"ops: {gf_tf.ops.library_status()})")
    sizes = {name: all_sizes[name] for name in ("digits_cnn", "resnet50")}
    print(f"{'chunk_size':>10}" + "".join(f" {name + ' ms':>15}" for name in sizes))
    rng = np.random.default_rng(0)
    data = {name: tf.constant(rng.normal(size=n).astype(np.float32)) for name, n in sizes.items()}
    for cs in CHUNK_SIZES:
        row = f"{cs:>10}"
        for name, n in sizes.items():
            c = math.ceil(n / cs)
            k = selected_chunk_count(c, density)

            @tf.function
            def csc_step(residual, g, cs=cs, k=k, n=n):
                acc, norms, _ = gf_tf.ops.accumulate(residual, [g], cs)
                idx = select_chunks(norms, k)
                selected, new_residual, _ = gf_tf.ops.gather_chunks(acc, idx, cs, tf.float16,
                                                                    0.5)
                out = gf_tf.ops.scatter_chunks(selected, idx, cs, [tf.TensorShape([n])],
                                               [tf.float32], 2.0)
                return out[0], new_residual

            residual = tf.zeros([n])
            csc_step(residual, data[name])  # trace
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                out, residual = csc_step(residual, data[name])
                out.numpy()
                times.append(1e3 * (time.perf_counter() - start))
            row += f" {statistics.median(times):>15.1f}"
        print(row)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="SGD steps of real gradients")
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()
    sizes = model_sizes()
    print("parameters: " + ", ".join(f"{k} {v:,}" for k, v in sizes.items()))
    bytes_table(sizes, args.density)
    quality_table(args.steps, args.density)
    time_table(sizes, args.density)


if __name__ == "__main__":
    main()
