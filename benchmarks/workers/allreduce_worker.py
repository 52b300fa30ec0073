"""One worker of the all-reduce benchmark; runs inside an emulated host (TF_CONFIG set).

    python -m benchmarks.workers.allreduce_worker --method gf_fp16 --sets resnet20,resnet50 \
        --iters 5 --warmup 1 --timeout 120

Per gradient set: `warmup` untimed calls of a tf.function that all-reduces variables of those shapes
with `gf_tf.all_reduce_gradients`, then `iters` timed calls, the wire bytes from eth0's counters and
the plans GradientFlow recorded (docs/benchmarks.md, "The tools in detail"). Prints one line `RESULT <json>` at the end.
"""

import argparse
import json
import os
import statistics
import time
from typing import Optional

import numpy as np
import tensorflow as tf

import gf_tf
from benchmarks import harness
from benchmarks.workers import gradients, methods


PAIRED_CALLS, PAIRED_SMALL_ELEMENTS = 50, 1_000_000   # --paired: calls of each for sets this small


def read_counters(dev: str = "eth0") -> Optional[dict]:
    """This namespace's tx and rx byte counters of `dev`; None outside an emulated host."""
    base = f"/sys/class/net/{dev}/statistics"
    try:
        with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
            return {"tx": int(tx.read()), "rx": int(rx.read())}
    except OSError:
        return None


def make_values(shapes, seed):
    rng = np.random.default_rng(seed)
    with tf.device("/cpu:0"):
        # Created outside the strategy scope: plain per-worker variables, not mirrored.
        return [tf.Variable(rng.standard_normal(s, dtype=np.float32) * 0.01, trainable=False)
                for s in shapes]


TF_OWN = "tf_own"   # build_step's method for ReplicaContext.all_reduce (GradientFlow hands it to TF's ops)


def build_step(strategy, values, method):
    """A tf.function all-reducing `values` as the method's gradients (tf_fp16: cast by hand around
    it), or with TF_OWN through TensorFlow's own all-reduce (the paired baseline, --paired)."""
    dtype = tf.float16 if method == "tf_fp16" else tf.float32

    @tf.function
    def step():
        def replica_fn():
            grads = [tf.cast(tf.identity(v), dtype) for v in values]
            if method == TF_OWN:
                return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)
            return [tf.cast(r, tf.float32) for r in gf_tf.all_reduce_gradients(grads, values)]
        return strategy.run(replica_fn)
    return step


def paired_seconds(strategy, step, shapes, iters):
    """(median seconds of `step`, of TF's own all-reduce of a copy of the set): `iters` calls of
    each, alternating, in these processes, after one untimed call of TF's own. The medians of 5
    calls moved 15% between launches of ResNet-20's set: small sets get PAIRED_CALLS."""
    tf_own = build_step(strategy, make_values(shapes, seed=len(shapes)), TF_OWN)
    timed_calls(tf_own, 1, 0)
    mine, theirs = [], []
    for _ in range(iters):
        mine += timed_calls(step, 0, 1)[0]
        theirs += timed_calls(tf_own, 0, 1)[0]
    return statistics.median(mine), statistics.median(theirs)


def check_result(method, values, reduced, num_workers):
    """Max relative error against the exact sum (dense methods) or the non-zero fraction (CSC)."""
    out = [np.asarray(r) for r in reduced]
    if methods.is_csc(method):
        nonzero = sum(int(np.count_nonzero(o)) for o in out)
        return {"nonzero_fraction": nonzero / sum(o.size for o in out)}
    worst = 0.0
    for v, o in zip(values, out):
        ref = num_workers * v.numpy().astype(np.float64)
        worst = max(worst, float(np.max(np.abs(o - ref)) / (np.max(np.abs(ref)) + 1e-30)))
    return {"max_rel_error": worst}


def timed_calls(step, warmup, iters):
    """(seconds of each of `iters` timed calls of `step`, the last call's output, seconds of
    the `warmup` untimed calls before them, the first of which traces): how every set is timed."""
    out = None
    t0 = time.perf_counter()
    for _ in range(warmup):
        out = step()
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t0)
    return times, out, warmup_s


def median_seconds(fn, iters):
    """Median wall seconds of `iters` calls of `fn`, after one untimed call (the trace)."""
    return statistics.median(timed_calls(fn, 1, iters)[0])


def pack_unpack_seconds(values, num_workers, iters):
    """Local time of gf_tf.ops.pack (fp32 -> fp16, prescale) + unpack (postscale) of the whole list."""
    from gf_tf import ops
    shapes = [v.shape for v in values]
    dtypes = [v.dtype for v in values]

    @tf.function
    def pack_unpack():
        buf = ops.pack([tf.identity(v) for v in values], tf.float16, 1.0 / num_workers)
        return ops.unpack(buf, shapes, dtypes, float(num_workers))

    return median_seconds(pack_unpack, iters)


def local_path_seconds(strategy, method, values, iters):
    """Local time of a GradientFlow method's encode and decode with no network: the same
    GradientFlowAllReduce pipeline (packing and FP16 scaling; CSC's accumulate, chunk norms,
    top-k, gather, scatter and residual update; low rank's products and orthogonalisation)
    with every collective replaced by the identity, on this worker's replica.

    This is the CPU floor of a step; for CSC, its chunk path, which with the ring bound gives
    CSC's limit.
    """
    _, gradient_flow = methods.make_strategy(method, timeout_seconds=60.0, build_strategy=False)
    variables = list(values)

    @tf.function
    def local_path():
        grads = [tf.identity(v) for v in values]
        return gradient_flow.reduce_locally(strategy, grads, variables)

    return median_seconds(local_path, iters)


def profile_step(step, logdir):
    """Runs `step` once under the TF profiler; per op type: [count, total busy s], plus interval overlap.

    "gf_busy_s": summed duration of gf_tf's own ops (GfPack, GfUnpack, GfAccumulate, GfGatherChunks,
    GfScatterChunks); "gf_exposed_s": the part of their merged intervals during which no collective
    op event was running on this worker (a proxy for time they add to the step).
    """
    import glob
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    tf.profiler.experimental.start(logdir)
    t0 = time.perf_counter()
    step()
    wall = time.perf_counter() - t0
    tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    with open(sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))[-1], "rb") as f:
        space.ParseFromString(f.read())
    by_type, gf, coll = {}, [], []
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                name = plane.event_metadata[ev.metadata_id].name
                if ":" not in name:
                    continue
                op_type = name.rsplit(":", 1)[1]
                start = (line.timestamp_ns * 1000 + ev.offset_ps) / 1e12
                end = start + ev.duration_ps / 1e12
                entry = by_type.setdefault(op_type, [0, 0.0])
                entry[0] += 1
                entry[1] += end - start
                if op_type.startswith("Gf"):
                    gf.append((start, end))
                elif "Collective" in op_type:
                    coll.append((start, end))
    gf_m, coll_m = _merge(gf), _merge(coll)
    overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in gf_m for c, d in coll_m)
    busy = sum(b - a for a, b in gf_m)
    top = dict(sorted(by_type.items(), key=lambda kv: -kv[1][1])[:12])
    return {"wall_s": wall, "op_types": top, "gf_busy_s": busy, "gf_exposed_s": busy - overlap,
            "collective_ops": sum(v[0] for k, v in by_type.items() if "Collective" in k)}


def _merge(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def stats_totals(gradient_flow):
    if gradient_flow is None or getattr(gradient_flow, "stats", None) is None:
        return None
    totals = gradient_flow.stats.totals()
    return {key: totals[key] for key in ("steps", "sent_bytes", "dense_bytes", "densities")}


def stats_per(before, after, per: str, count: float) -> dict:
    """GradientFlow's CommStats between two `stats_totals`, divided by `count` (`per`: the keys'
    suffix): payload bytes sent and dense, the steps counted and the densities; {} when none ran."""
    if not before or not after or after["steps"] <= before["steps"]:
        return {}
    delta = {key: (after[key] - before[key]) / count for key in after}
    return {f"sent_payload_bytes_per_{per}": delta["sent_bytes"], f"dense_payload_bytes_per_{per}":
            delta["dense_bytes"], f"stats_steps_per_{per}": delta["steps"], f"density_per_{per}": delta["densities"]}


def plan_records(gradient_flow, variables):
    """The gf_tf.plan.PlanReport of each variable set serving exactly `variables`, as JSON
    records."""
    states = gradient_flow.states()
    return [{"method": report.plan.method, "algorithm": report.plan.algorithm,
             "bytes_per_pack": report.plan.bytes_per_pack, "seconds": report.forecast.seconds,
             "describe": report.describe()}
            for name, report in gradient_flow.plans().items()
            if report is not None and states[name].serves(variables)]


def costs_record(gradient_flow):
    """GradientFlowAllReduce.costs as [hop_s, round_s, byte_s, copy_s, fp16_s] (a ring hop's
    and a recursive-doubling round's latency, seconds per wire byte, the local seconds per
    element of float32 packs and of FP16 packs), or None."""
    costs = getattr(gradient_flow, "costs", None)
    if costs is None:
        return None
    return [costs.latency_s["ring"], costs.latency_s["recursive_doubling"], costs.byte_s,
            costs.local_s["none"], costs.local_s["fp16"]]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", required=True, choices=methods.METHODS)
    parser.add_argument("--sets", required=True, help="comma-separated: " + ",".join(gradients.GRADIENT_SETS))
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--paired", action="store_true",
                        help="also time each set's all-reduce alternating with TF's own, same processes")
    parser.add_argument("--pack-overhead", action="store_true",
                        help="also time gf_tf.ops pack+unpack of each set locally")
    parser.add_argument("--local-path", action="store_true",
                        help="also time the method's local work on each set (encode + decode: everything "
                             "but the collectives)")
    parser.add_argument("--profile", default=None,
                        help="directory: run one more step under the TF profiler and summarise its ops")
    args = parser.parse_args()

    t_start = time.perf_counter()
    strategy, gradient_flow = methods.make_strategy(args.method, args.timeout)
    num_workers = strategy.num_replicas_in_sync
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    results = {"method": args.method, "worker": task, "num_workers": num_workers,
               "startup_s": time.perf_counter() - t_start, "sets": {}}
    if gradient_flow is not None:
        import gf_tf
        results["gradient_flow"] = repr(gradient_flow)
        results["ops_library"] = gf_tf.ops.library_status()
        results["costs"] = costs_record(gradient_flow)
    for name in args.sets.split(","):
        shapes = gradients.GRADIENT_SETS[name]
        values = make_values(shapes, seed=len(shapes))
        step = build_step(strategy, values, args.method)
        out, warmup_s = timed_calls(step, args.warmup, 0)[1:]
        before_stats = stats_totals(gradient_flow)
        before = read_counters()
        times, out, _ = timed_calls(step, 0, args.iters)
        after = read_counters()
        after_stats = stats_totals(gradient_flow)
        entry = {
            "tensors": len(shapes), "elements": gradients.num_elements(shapes),
            "times_s": times, "median_s": statistics.median(times), "warmup_s": warmup_s,
            "tx_bytes_per_iter": (after["tx"] - before["tx"]) / args.iters,
            "rx_bytes_per_iter": (after["rx"] - before["rx"]) / args.iters,
        }
        stats = stats_per(before_stats, after_stats, "iter", args.iters)
        entry.update({k: v for k, v in stats.items() if not k.startswith("density")})
        local = [strategy.experimental_local_results(r)[0] for r in out]
        entry.update(check_result(args.method, values, local, num_workers))
        if gradient_flow is not None:
            entry["plans"] = plan_records(gradient_flow, values)
        if args.profile and task == 0:
            entry["profile"] = profile_step(step, os.path.join(args.profile, f"{name}_w{task}"))
        elif args.profile:
            step()   # the same collectives as worker 0's profiled step, without a profiler of its own:
            #          TF's profiler stop() crashed worker 1 in some profiled runs
        if args.paired:
            # The same count on every worker (each call is a collective): by the set's size.
            small = gradients.num_elements(shapes) <= PAIRED_SMALL_ELEMENTS
            calls = max(args.iters, PAIRED_CALLS if small else 5)
            entry["paired_s"], entry["paired_tf_s"] = paired_seconds(strategy, step, shapes, calls)
        if args.pack_overhead:
            entry["pack_unpack_s"] = pack_unpack_seconds(values, num_workers, max(args.iters, 3))
        if args.local_path and methods.is_gradient_flow(args.method):
            entry["local_path_s"] = local_path_seconds(strategy, args.method, values, max(args.iters, 3))
        results["sets"][name] = entry
        del values, step, out
    harness.write_result(results)
    from gf_tf import worker
    worker.exit_together(args.timeout)   # a worker left alone after its peer exits logs a crash


if __name__ == "__main__":
    main()
