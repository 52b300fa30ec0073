"""Accuracy of GradientFlow's 16-bit wire: relative L2 error of a gradient SUM against float64.

    python -m benchmarks.fp16_accuracy                       # N = 2, 8, 32, 64
    python -m benchmarks.fp16_accuracy --replicas 2,8 --model_replicas 512

N replicas of one process sum float32 gradients of 4096 elements through a GradientFlowAllReduce with
FP16 and BF16 on the wire; each N runs in a fresh process. The columns: docs/benchmarks.md, "The tools in detail".
"""

import argparse
import os
import subprocess
import sys

import numpy as np

from benchmarks import harness

ELEMENTS = 4096
DEFAULT_SCALES = (1e-8, 1e-6, 1e-5, 1e-4, 1e-2, 1.0, 1e2)


def gradients(num_replicas: int, scale: float, seed: int = 0) -> np.ndarray:
    """float32 [N, 4096]: replica r's gradient, normal times `scale`."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(num_replicas, ELEMENTS)) * scale).astype(np.float32)


def relative_error(got, want) -> float:
    """||got - want||_2 / ||want||_2 in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def ring_model(grads: np.ndarray, scheme: str) -> np.ndarray:
    """The SUM over replicas as a float16 ring computes it: each hop rounds its partial sum.

    scheme "pow2": every value times gf_tf's power-of-two scale from sum_r max|g_r| (B);
    "ahead": the dense reducer's scale a step ahead (`gf_tf.wire.ahead_scale`) from a previous
    bound B' = B; "ahead_drop": from B' = 2**AHEAD_SHRINK_BITS * B, the largest drop it still
    sends in FP16 (docs/fp16.md, "A step ahead"); "1/N": every value times 1/N, the sum times N
    (the former design).
    """
    from gf_tf import wire  # pylint: disable=import-outside-toplevel
    g = np.asarray(grads, np.float64)
    bound = np.abs(g).max(axis=1).sum()
    if scheme == "1/N":
        pre, post = 1.0 / len(g), float(len(g))
    else:
        drop = 2.0 ** wire.AHEAD_SHRINK_BITS if scheme == "ahead_drop" else 1.0
        previous = bound * drop
        pre = wire.power_of_two_scale_np(previous)
        if scheme != "pow2":
            pre = pre * 2.0 ** -wire.AHEAD_HEADROOM_BITS
        post = 1.0 / pre
    partial = np.float16(g[0] * pre)
    for row in g[1:]:
        partial = np.float16(partial.astype(np.float64) + np.float16(row * pre))
    return partial.astype(np.float64) * post


def exact_rounding_error(grads: np.ndarray) -> float:
    """Error of rounding the exact sum to FP16 once, with the power-of-two scale."""
    from gf_tf.wire import power_of_two_scale_np  # pylint: disable=import-outside-toplevel
    g = np.asarray(grads, np.float64)
    scale = power_of_two_scale_np(np.abs(g).max(axis=1).sum())
    exact = g.sum(axis=0)
    return relative_error(np.float16(exact * scale).astype(np.float64) / scale, exact)


def measure(num_replicas: int, scales, compressions=("fp16",)) -> dict:
    """In this process (which must have num_replicas logical CPUs): {name: [error per scale]}, for
    each compression c its steady step (c: the step before had the same gradients) and its step
    after a drop (c + "_after_drop": the step before had them times 2**AHEAD_SHRINK_BITS).

    The FP16 wire scales a step ahead: the measured step is the second of two, and a float32 retry
    on it raises RuntimeError (the figure would be float32's, not the wire's)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import gf_tf  # pylint: disable=import-outside-toplevel
    from gf_tf import wire  # pylint: disable=import-outside-toplevel
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:num_replicas]
    errors = {}
    for compression in compressions:
        gfar = gf_tf.GradientFlowAllReduce(compression=compression)
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=gfar)
        variable = tf.Variable(tf.zeros([ELEMENTS]))

        @tf.function
        def step(per_replica):
            def fn(g):
                return gf_tf.all_reduce_gradients([tf.identity(g)], [variable])[0]
            return strategy.run(fn, args=(per_replica,))

        def run(g):
            values = strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.constant(g[ctx.replica_id_in_sync_group]))
            return strategy.experimental_local_results(step(values))[0].numpy()

        def retries():
            return gfar.stats.totals().get("figure_float32_retries", 0.0)

        drop = 2.0 ** wire.AHEAD_SHRINK_BITS
        for name, before in ((compression, 1.0), (compression + "_after_drop", drop)):
            errors[name] = []
            for s in scales:
                g = gradients(num_replicas, s)
                run(g * np.float32(before))
                retried = retries()
                got = run(g)
                if retries() != retried:
                    raise RuntimeError(f"N={num_replicas}, s={s:g}, {name}: the measured step "
                                       "went in float32")
                errors[name].append(relative_error(got, g.astype(np.float64).sum(axis=0)))
    return errors


def _worker(num_replicas: int, scales, compression: str) -> None:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_replicas)])
    harness.write_result(measure(num_replicas, scales, [compression]))


def run_worker(num_replicas: int, scales, compressions=("fp16", "bf16"),
               timeout: float = 600) -> dict:
    """Runs `measure` for N replicas, one fresh process per compression (TF 2.21 numbers the
    collectives of every MirroredStrategy object alike, so one process hosts one);
    raises RuntimeError with the worker's output on failure."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    errors = {}
    for compression in compressions:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.fp16_accuracy", "--worker", str(num_replicas),
             "--compression", compression, "--scales", ",".join(map(repr, scales))],
            cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        result = harness.read_result(proc.stdout)
        if proc.returncode or result is None:
            raise RuntimeError(f"fp16_accuracy worker for N={num_replicas}, {compression} failed "
                               f"(exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        errors.update(result)
    return errors


def table(replicas, scales, model_replicas=()) -> str:
    rows = ["| N | s | fp16 | fp16 after drop | bf16 | fp16 exact | 1/N model | pow2 model | ahead model | "
            "after drop model |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n, measure_it in [(n, True) for n in replicas] + [(n, False) for n in model_replicas]:
        measured = run_worker(n, scales) if measure_it else None
        for j, s in enumerate(scales):
            g = gradients(n, s)
            exact = g.astype(np.float64).sum(axis=0)
            wire = (f"{measured['fp16'][j]:.4%} | {measured['fp16_after_drop'][j]:.4%} | "
                    f"{measured['bf16'][j]:.3%}" if measured else "- | - | -")
            models = " | ".join(f"{relative_error(ring_model(g, scheme), exact):.4%}"
                                for scheme in ("pow2", "ahead", "ahead_drop"))
            rows.append(f"| {n} | {s:g} | {wire} | {exact_rounding_error(g):.4%} | "
                        f"{relative_error(ring_model(g, '1/N'), exact):.3%} | {models} |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", default="2,8,32,64", help="N to measure, comma-separated")
    parser.add_argument("--model_replicas", default="512", help="N for the NumPy model only")
    parser.add_argument("--scales", default=",".join(map(repr, DEFAULT_SCALES)))
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--compression", default="fp16", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    scales = [float(s) for s in args.scales.split(",")]
    if args.worker:
        _worker(args.worker, scales, args.compression)
        return
    replicas = [int(n) for n in args.replicas.split(",") if n]
    model_replicas = [int(n) for n in args.model_replicas.split(",") if n]
    print(table(replicas, scales, model_replicas))


if __name__ == "__main__":
    main()
