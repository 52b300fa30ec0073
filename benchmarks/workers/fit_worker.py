"""One worker of the end-to-end `model.fit` benchmark; runs inside an emulated host.

    python -m benchmarks.workers.fit_worker --model alexnet --method csc_1 \
        --batch 32 --warmup-steps 2 --steps 5 --timeout 300 [--reference] [--cpu 0]

TF_CONFIG set (or --reference: one process, no communication). With --overlap, `allreduce_s` and
`compute_s` after the timed fit; with --profile DIR, a tf.profiler trace of worker 0's step. How
each figure is measured: docs/benchmarks.md, "The tools in detail". Prints one line `RESULT <json>`.
"""

import argparse
import json
import os
import statistics
import time


HEARTBEAT_TIMEOUT = 120.0   # seconds (gf_tf.MultiWorkerMirroredStrategy(heartbeat_timeout=))

def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, choices=["digits_cnn", "resnet20", "alexnet", "resnet50"])
    parser.add_argument("--method", default="tf_fp32")
    parser.add_argument("--reference", action="store_true", help="one process, no strategy")
    parser.add_argument("--batch", type=int, required=True, help="images per worker per step")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--cpu", type=int, default=None, help="pin this process to one logical CPU")
    parser.add_argument("--overlap", action="store_true", help="also measure allreduce_s and compute_s")
    parser.add_argument("--profile", default=None, help="directory: worker 0 traces one step there")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (throughput is measured between the first and the last step)")
    return args


args = parse_args()
if args.cpu is not None:
    # Before TensorFlow starts: its thread pools size themselves to the affinity mask.
    os.sched_setaffinity(0, {args.cpu})

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.workers import methods  # noqa: E402
from models import datasets, factory  # noqa: E402


class StepClock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch_start = {}
        self.batch_end = {}
        self.losses = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_start[epoch] = time.perf_counter()
        self.batch_end[epoch] = []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_end[max(self.batch_end)].append(time.perf_counter())
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def main():
    t_start = time.perf_counter()
    if args.reference:
        strategy, gradient_flow, num_workers = None, None, 1
    else:
        # Heartbeats share the shaped link: AlexNet's initial broadcast (244 MB at 100 Mbit/s)
        # held them back past TensorFlow's 10 s, and a live worker was given up.
        strategy, gradient_flow = methods.make_strategy(args.method, args.timeout, keras_fit=True,
                                                        heartbeat_timeout=HEARTBEAT_TIMEOUT)
        num_workers = strategy.num_replicas_in_sync
    global_batch = args.batch * num_workers
    if args.model == "digits_cnn":
        source = datasets.load_digits(seed=0)
    else:
        shape = factory.default_input_shape(args.model)
        source = datasets.load_synthetic(shape, 1000 if shape[0] >= 128 else 10,
                                         num_train=max(2560, global_batch * (args.steps + args.warmup_steps)))

    def build():
        model = factory.build_model(args.model, source.input_shape, source.num_classes)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    if strategy is None:
        data = datasets.input_pipeline(source, datasets.TRAIN, global_batch, training=True)
        model = build()
    else:
        data = datasets.distributed_dataset(strategy, source, datasets.TRAIN, global_batch, training=True)
        with strategy.scope():
            model = build()
    clock = StepClock()
    setup_s = time.perf_counter() - t_start
    # Epoch 0 (warm-up, traced) and epoch 1 (timed) have different lengths: run them as two fits.
    model.fit(data, epochs=1, steps_per_epoch=args.warmup_steps, verbose=0, callbacks=[clock])
    from benchmarks.workers import allreduce_worker
    stats_before = allreduce_worker.stats_totals(gradient_flow)
    wire_before = allreduce_worker.read_counters()
    model.fit(data, initial_epoch=1, epochs=2, steps_per_epoch=args.steps, verbose=0, callbacks=[clock])
    stats_after = allreduce_worker.stats_totals(gradient_flow)
    wire_after = allreduce_worker.read_counters()
    extra = {} if strategy is None else _after_the_fit(strategy, gradient_flow, model, build, data)
    # Steady state: from the end of the first step of the timed fit (which also creates the
    # input iterator) to the end of its last step.
    ends = clock.batch_end[1]
    step_times = np.diff(ends).tolist()
    elapsed = ends[-1] - ends[0]
    result = {
        "model": args.model, "method": "reference" if args.reference else args.method,
        "num_workers": num_workers, "global_batch": global_batch, "steps": args.steps,
        "params": int(model.count_params()), "images_per_s": global_batch * (args.steps - 1) / elapsed,
        "median_step_s": statistics.median(step_times), "step_times_s": step_times,
        "warmup_epoch_s": clock.batch_end[0][-1] - clock.epoch_start[0], "setup_s": setup_s,
        "loss_first": clock.losses[0] if clock.losses else None,
        "loss_last": clock.losses[-1] if clock.losses else None,
        "losses_finite": bool(np.all(np.isfinite(clock.losses))),
        "cpu": args.cpu, **extra,
    }
    if wire_before and wire_after:   # all steps of the timed fit, measured on this namespace's eth0
        result["wire_tx_bytes_per_step"] = (wire_after["tx"] - wire_before["tx"]) / args.steps
        result["wire_rx_bytes_per_step"] = (wire_after["rx"] - wire_before["rx"]) / args.steps
    if gradient_flow is not None:
        import gf_tf
        result["gradient_flow"] = repr(gradient_flow)
        result["ops_library"] = gf_tf.ops.library_status()
    if stats_before and stats_after and stats_after["steps"] > stats_before["steps"]:
        stats = allreduce_worker.stats_per(stats_before, stats_after, "step",
                                           stats_after["steps"] - stats_before["steps"])
        result.update({k: v for k, v in stats.items() if not k.startswith("stats_steps")})
    harness.write_result(result)
    from gf_tf import worker
    worker.exit_together(args.timeout)   # a worker left alone after its peer exits logs a crash


def _after_the_fit(strategy, gradient_flow, model, build, data):
    """--profile's trace, then --overlap's allreduce_s and compute_s (docs/benchmarks.md, "The tools in detail")."""
    extra = {}
    if args.profile:
        extra["profile_dir"] = _profile(model, data)
    if args.overlap:
        from benchmarks.workers import local_only
        extra["allreduce_times_s"] = _allreduce_times(strategy, model.trainable_variables)
        extra["allreduce_s"] = statistics.median(extra["allreduce_times_s"])
        with local_only.swapped(strategy, local_only.compute_only_ops(
                args.method, gradient_flow, model.trainable_variables)):
            extra["compute_step_times_s"] = _fit_step_times(strategy, build, data)
        extra["compute_s"] = statistics.median(extra["compute_step_times_s"])
    return extra


def _allreduce_times(strategy, variables):
    """Seconds of each of `steps` all-reduces of gradients shaped like `variables`, alone (after
    one untimed call, which traces it and runs any trial: gf_tf.plan.trial)."""
    from benchmarks.workers import allreduce_worker
    values = allreduce_worker.make_values([tuple(v.shape) for v in variables], seed=len(variables))
    step = allreduce_worker.build_step(strategy, values, args.method)
    allreduce_worker.timed_calls(step, 1, 0)
    return allreduce_worker.timed_calls(step, 0, args.steps)[0]


def _fit_step_times(strategy, build, data):
    """Step times of a fresh model's timed fit (after its traced warm-up fit), as main measures them."""
    with strategy.scope():
        model = build()
    clock = StepClock()
    model.fit(data, epochs=1, steps_per_epoch=args.warmup_steps, verbose=0, callbacks=[clock])
    model.fit(data, initial_epoch=1, epochs=2, steps_per_epoch=args.steps, verbose=0, callbacks=[clock])
    return np.diff(clock.batch_end[1]).tolist()


def _profile(model, data):
    """3 more steps; worker 0 traces the second into args.profile (returned), the others none."""
    from gf_tf.keras.callbacks import StepProfile
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    callbacks = [StepProfile(args.profile, batch=1)] if task == 0 else []
    model.fit(data, initial_epoch=2, epochs=3, steps_per_epoch=3, verbose=0, callbacks=callbacks)
    return args.profile if task == 0 else None


if __name__ == "__main__":
    main()
