"""Op benchmark: gf_tf's pack/unpack/chunk ops vs stock TensorFlow and the memory-bandwidth floor.

    python -m benchmarks.ops                       # ResNet-50 (161 tensors, 25.6M) and ResNet-20 (0.27M)
    python -m benchmarks.ops --sets resnet20 --iters 20

Every row is one traced, warmed-up tf.function, timed round-robin with the others; the rows and
columns (ms, call ms, net ms, x ours, cpu ms, MB moved, floor ms, peak MB): docs/benchmarks.md, "The tools in detail".
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks.workers.gradients import GRADIENT_SETS, num_elements  # noqa: E402
from gf_tf import ops  # noqa: E402

NUM_REPLICAS = 2
MB = 1e6


def _status_kb(field):
    with open("/proc/self/status") as f:
        return int(re.search(field + r":\s+(\d+)", f.read()).group(1))


def peak_extra_mb(fn, *args):
    """Peak resident memory fn(*args) adds while it runs, outputs included (MB).

    Exact only in memory_peaks' subprocess, where every large buffer is its own
    mmap (returned on free) instead of a pooled one.
    """
    result = fn(*args)  # warm-up: tracing allocates too
    del result
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_kb("VmRSS")
    result = fn(*args)
    extra = (_status_kb("VmHWM") - before) * 1024 / MB
    del result
    return extra


# TensorFlow's default CPU allocator here (oneDNN's) pools large buffers, so
# resident memory hides what a call allocates. Without oneDNN, TensorFlow
# uses malloc, and with a fixed mmap threshold malloc maps each large buffer
# freshly and unmaps it on free: VmHWM - VmRSS is then exactly the call's peak.
MEMORY_ENV = {"TF_ENABLE_ONEDNN_OPTS": "0", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def memory_peaks(name, args):
    """{row label: peak MB} from a subprocess running each row once under MEMORY_ENV."""
    command = [sys.executable, "-m", "benchmarks.ops", "--sets", name, "--memory-json",
               "--chunk-size", str(args.chunk_size), "--density", str(args.density)]
    out = subprocess.run(command, env=dict(os.environ, **MEMORY_ENV), check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def time_interleaved(calls, iters, warmup=2):
    """({key: median wall ms}, {key: median CPU ms of this process}): round-robin over
    calls = {key: (fn, args, max_iters)}, so that background load slows every row alike.
    Each call runs min(iters, max_iters) times."""
    for fn, args, max_iters in calls.values():
        for _ in range(min(warmup, max_iters)):
            fn(*args)
    wall = {key: [] for key in calls}
    cpu = {key: [] for key in calls}
    for i in range(iters):
        for key, (fn, args, max_iters) in calls.items():
            if i < max_iters:
                start, start_cpu = time.perf_counter(), time.process_time()
                fn(*args)
                wall[key].append(time.perf_counter() - start)
                cpu[key].append(time.process_time() - start_cpu)
    return ({key: 1e3 * statistics.median(t) for key, t in wall.items()},
            {key: 1e3 * statistics.median(t) for key, t in cpu.items()})


def floor_copy(total_bytes):
    """(np.copyto, args) moving total_bytes (half read, half written) between warm arrays."""
    n = max(1, int(total_bytes // 2))
    return np.copyto, (np.zeros(n, np.uint8), np.ones(n, np.uint8))


def make_variants(shapes, chunk_size, density):
    """(group, label, fn, args, bytes moved, null fn[, max rounds]) for every row, in table order."""
    n = num_elements(shapes)
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=s).astype(np.float32)) for s in shapes]
    dtypes = [tf.float32] * len(shapes)
    residual = tf.constant(rng.normal(size=n).astype(np.float32))
    packed16 = ops.composite.pack(grads, tf.float16, 1.0 / NUM_REPLICAS)
    sizes = [int(np.prod(s)) for s in shapes]
    k = max(1, int(round(density * ops.num_chunks(n, chunk_size))))
    acc, norms, _ = ops.composite.accumulate(residual, grads, chunk_size, None, 0.0)
    indices = tf.sort(tf.math.top_k(norms, k).indices)
    selected, _, _ = ops.composite.gather_chunks(acc, indices, chunk_size, tf.float16, 0.5, None)
    m = int(selected.shape[0])
    scale = 1.0 / NUM_REPLICAS
    per_tensor_scales = tf.constant(np.full(len(shapes), scale, np.float32))

    def fn(f):
        return tf.function(f)

    def chunk_path(impl):
        def run(residual, grads):
            acc, norms, _ = impl.accumulate(residual, grads, chunk_size, None, 0.0)
            idx = tf.sort(tf.math.top_k(norms, k).indices)
            sel, new_residual, _ = impl.gather_chunks(acc, idx, chunk_size, tf.float16, scale, None)
            return impl.scatter_chunks(sel, idx, chunk_size, shapes, dtypes, NUM_REPLICAS), new_residual
        return fn(run)

    # Null functions: same inputs and number of outputs as a row, no work. Their
    # time is the fixed cost of the call itself ("call ms").
    null_grads = fn(lambda g: tf.identity(g[0]))
    null_unpack = fn(lambda b: [tf.identity(b)] * len(shapes))
    null_two = fn(lambda a, unused: (tf.identity(a), tf.identity(a)))
    null_scatter = fn(lambda s, unused: [tf.identity(s)] * len(shapes))
    null_path = fn(lambda r, unused: ([tf.identity(r)] * len(shapes), tf.identity(r)))

    pack_bytes = 4 * n + 2 * n
    return [
        ("pack", "ours: pack",
         fn(lambda g: ops.compiled.pack(g, tf.float16, scale)), (grads,), pack_bytes, null_grads),
        ("pack", "ours: pack, one scale per tensor",
         fn(lambda g: ops.compiled.pack(g, tf.float16, per_tensor_scales)), (grads,), pack_bytes,
         null_grads),
        ("pack", "composite: per-tensor cast(x1/N) -> concat",
         fn(lambda g: ops.composite.pack(g, tf.float16, scale)), (grads,), pack_bytes, null_grads),
        ("pack", "TF concat -> cast",
         fn(lambda g: tf.cast(tf.concat([tf.reshape(t, [-1]) for t in g], 0), tf.float16)),
         (grads,), pack_bytes, null_grads),
        ("pack", "TF per-tensor cast -> concat",
         fn(lambda g: tf.concat([tf.reshape(tf.cast(t, tf.float16), [-1]) for t in g], 0)),
         (grads,), pack_bytes, null_grads),
        ("unpack", "ours: unpack",
         fn(lambda b: ops.compiled.unpack(b, shapes, dtypes, NUM_REPLICAS)), (packed16,),
         pack_bytes, null_unpack),
        ("unpack", "composite: split -> cast(xN)",
         fn(lambda b: ops.composite.unpack(b, shapes, dtypes, NUM_REPLICAS)), (packed16,),
         pack_bytes, null_unpack),
        ("unpack", "TF split -> cast",
         fn(lambda b: [tf.reshape(tf.cast(p, tf.float32), s)
                       for p, s in zip(tf.split(b, sizes), shapes)]), (packed16,), pack_bytes,
         null_unpack),
        ("unpack", "TF cast -> split",
         fn(lambda b: [tf.reshape(p, s) for p, s in zip(tf.split(tf.cast(b, tf.float32), sizes), shapes)]),
         (packed16,), pack_bytes, null_unpack),
        ("abs_max", "ours: abs_max",
         fn(ops.compiled.abs_max), (grads,), 4 * n, null_grads),
        ("abs_max", "composite: abs_max (sign-cleared bits, max)",
         fn(ops.composite.abs_max), (grads,), 4 * n, null_grads),
        ("abs_max", "TF per-tensor reduce_max(abs) -> stack",
         fn(lambda g: tf.stack([tf.reduce_max(tf.abs(t)) for t in g])), (grads,), 4 * n, null_grads),
        ("chunk", "ours: accumulate (+ L1 norms)",
         fn(lambda r, g: ops.compiled.accumulate(r, g, chunk_size, None, 0.0)[:2]),
         (residual, grads), 12 * n, null_two),
        ("chunk", "ours: gather_chunks (+ residual)",
         fn(lambda a, i: ops.compiled.gather_chunks(a, i, chunk_size, tf.float16, scale, None)[:2]),
         (acc, indices), 8 * n + 6 * m, null_two),
        ("chunk", "ours: scatter_chunks",
         fn(lambda s, i: ops.compiled.scatter_chunks(s, i, chunk_size, shapes, dtypes, NUM_REPLICAS)),
         (selected, indices), 4 * n + 2 * m, null_scatter),
        ("chunk", "ours: chunk path (acc, top-k, gather, scatter)", chunk_path(ops.compiled),
         (residual, grads), 12 * n + 4 * n + 4 * n, null_path),
        ("chunk", "composite: chunk path", chunk_path(ops.composite),
         (residual, grads), 12 * n + 4 * n + 4 * n, null_path, 3),
    ]


def run_set(name, shapes, args):
    n = num_elements(shapes)
    print(f"\n== {name}: {len(shapes)} float32 tensors, {n:,} elements ({4 * n / MB:.1f} MB), "
          f"chunk_size {args.chunk_size}, density {args.density} ==", flush=True)
    rows = make_variants(shapes, args.chunk_size, args.density)
    calls = {}
    for group, label, fn, fn_args, moved, null_fn, *max_rounds in rows:
        calls[label] = (fn, fn_args, min([args.iters] + max_rounds))
        calls[("null", label)] = (null_fn, fn_args, args.iters)
        calls[("floor", moved)] = floor_copy(moved) + (args.iters,)
    ms, cpu_ms = time_interleaved(calls, args.iters)
    peaks = memory_peaks(name, args)
    net = {label: ms[label] - ms[("null", label)] for _, label, *_ in rows}
    print(f"{'op':<47} {'ms':>7} {'call ms':>7} {'net ms':>7} {'x ours':>6} {'net x':>6} "
          f"{'cpu ms':>7} {'cpu x':>6} {'MB moved':>8} {'floor ms':>8} {'x floor':>7} {'net x':>6} "
          f"{'peak MB':>7}")
    for group, label, _, _, moved, *_ in rows:
        floor = ms[("floor", moved)]
        mine = f"ours: {group}"
        if mine in ms:
            ratios = f"{ms[label] / ms[mine]:6.2f} {net[label] / net[mine]:6.2f}"
            cpu_ratio = f"{cpu_ms[label] / cpu_ms[mine]:6.2f}"
        else:
            ratios, cpu_ratio = f"{'':>6} {'':>6}", f"{'':>6}"
        print(f"{label:<47} {ms[label]:7.2f} {ms[('null', label)]:7.2f} {net[label]:7.2f} {ratios} "
              f"{cpu_ms[label]:7.2f} {cpu_ratio} {moved / MB:8.1f} {floor:8.2f} "
              f"{ms[label] / floor:7.2f} {net[label] / floor:6.2f} {peaks.get(label, float('nan')):7.1f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="resnet50,resnet20",
                        help=f"comma-separated gradient lists: {', '.join(GRADIENT_SETS)}")
    parser.add_argument("--iters", type=int, default=15, help="timed calls per row (median; >= 10)")
    parser.add_argument("--chunk-size", type=int, default=1024, help="chunk ops: elements per chunk")
    parser.add_argument("--density", type=float, default=0.01, help="chunk ops: fraction of chunks sent")
    parser.add_argument("--memory-json", action="store_true",
                        help="internal: print {row: peak MB} as JSON (run under MEMORY_ENV)")
    args = parser.parse_args(argv)
    if args.memory_json:
        (name,) = args.sets.split(",")
        rows = make_variants(GRADIENT_SETS[name], args.chunk_size, args.density)
        print(json.dumps({label: peak_extra_mb(fn, *fn_args) for _, label, fn, fn_args, *_ in rows}))
        return
    print(f"gf_tf.ops: {ops.library_status()}; TensorFlow {tf.__version__}; "
          f"intra-op threads {tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()}")
    for name in args.sets.split(","):
        if name not in GRADIENT_SETS:
            parser.error(f"unknown gradient list {name!r}; choose from {', '.join(GRADIENT_SETS)}")
        run_set(name, GRADIENT_SETS[name], args)


if __name__ == "__main__":
    main()
