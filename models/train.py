r"""Train a reference model with Keras `model.fit` and GradientFlow all-reduce.

  gf-tf-run -n 2 -- python -m models.train      # the default job: 2 workers, digits CNN,
                                                # FP16 + CSC after warm-up, ~1 minute on 2 cores
  python -m models.train                        # the same job as 2 replicas in one process
  python -m models.train --model resnet50 --dataset synthetic --batch_size 16 --steps_per_epoch 5
  python -m models.train --compression auto --algorithm auto --overlap auto --density 1
                                                # the library's planner chooses the wire, the
                                                # algorithm and the overlap (no CSC)

Without TF_CONFIG (not under gf-tf-run) and without an explicit --strategy, it
trains with --strategy mirrored over 2 logical CPU devices of this process
(or --num_devices): the gradients still go through GradientFlow's all-reduce,
which a one-worker cluster with one replica would skip. It says so at start.

At the end every worker prints the test accuracy (the whole test set,
evaluated locally: the trainable weights are identical on every worker, but
BatchNormalization's moving statistics are each worker's own, as under TF's
MultiWorkerMirroredStrategy, so the workers' figures can differ slightly), the training throughput in images/s (all workers together, first
step excluded) and the bytes one replica sent per step against float32
dense all-reduce. Only the chief writes to --model_dir; other workers write
to model_dir/workertemp_<i>, as TF's multi-worker guide prescribes.
"""

import json
import os
import shutil
import sys
import time

from absl import app, flags, logging

from models import local_sgd_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "", "digits_cnn, mnist1d_cnn, wide_mlp, topic_attention, resnet20, resnet32, "
                    "resnet56, resnet50, alexnet; '' = the dataset's (mnist1d: mnist1d_cnn, "
                    "mnist1d_wide: wide_mlp, topics: topic_attention, others: digits_cnn)")
flags.DEFINE_string("dataset", "digits", "digits, mnist1d, mnist1d_wide (mnist1d's data for the wide MLP), "
                    "topics (generated token sequences), mnist, cifar10, imagenet, tfrecord, synthetic")
flags.DEFINE_string("data_dir", "", "directory of TFRecord files (--dataset imagenet or tfrecord)")
flags.DEFINE_string("strategy", "multi_worker_mirrored", "multi_worker_mirrored, mirrored, one_device")
flags.DEFINE_integer("num_devices", 1, "replicas (logical CPU devices) per worker")
# The enum flags are checked when the flags are parsed, before TensorFlow is imported; their values
# are GradientFlowAllReduce's arguments of the same name (models/factory.py maps them).
flags.DEFINE_enum("compression", "fp16", ["fp16", "bf16", "none", "auto"],
                  "wire format of gradients: fp16, bf16, none (float32), auto (the planner's choice, "
                  "TF's own all-reduce included)")
class _BytesPerPackParser(flags.ArgumentParser):
    """--bytes_per_pack: a whole number of bytes, or "auto" (the planner's pack size)."""

    def parse(self, argument):
        if str(argument).strip().lower() == "auto":
            return "auto"
        try:
            return int(argument)
        except ValueError:
            raise ValueError(f"expected a whole number of bytes or 'auto', got {argument!r}") from None

    def flag_type(self):
        return "int or 'auto'"


flags.DEFINE(_BytesPerPackParser(), "bytes_per_pack", 4 << 20,
             "lazy all-reduce threshold: wire bytes per pack; 0 = one pack per dtype; auto = the planner's")
flags.DEFINE_enum("algorithm", "auto", ["auto", "ring", "recursive_doubling"],
                  "collective algorithm across workers: auto (the planner's choice), ring (the wrapped "
                  "TF ops' own collective), recursive_doubling")
flags.DEFINE_enum("overlap", "false", ["auto", "true", "false"],
                  "all-reduce packs in groups during backprop: auto (the planner decides), true, "
                  "false (one barrier)")
flags.DEFINE_string("density", "auto", "CSC after warm-up: auto = dense or sparse each step, as the measured "
                    "link and the gradient's regime say (ChunkSparsity's default); a fraction of chunks "
                    "sent per step; 1 = dense (with --reducer lowrank 1 unless given)")
flags.DEFINE_integer("chunk_size", 1024, "CSC chunk size in elements")
flags.DEFINE_integer("warmup_steps", 50, "dense steps before CSC or low rank starts")
flags.DEFINE_enum("selection", "per_pack", ["per_pack", "global", "ahead"],
                  "CSC top-k: per_pack (k chunks of each pack), global (K chunks over the whole "
                  "model) or ahead (each pack's k chosen at the step before: one collective a step)")
flags.DEFINE_enum("scoring", "error_feedback", ["error_feedback", "paper"],
                  "--selection ahead: what scores a chunk for the next step")
flags.DEFINE_enum("tf_all_reduce_dtype", "float32", ["float32", "float16"],
                  "without GradientFlow (--compression none --density 1): the dtype TensorFlow's own "
                  "all-reduce carries the gradients in (float16: cast and back, the 16-bit baseline)")
flags.DEFINE_bool("curve", False, "evaluate the test accuracy after every epoch; with --model_dir, "
                  "results.json gets the curve (training seconds, bytes sent, accuracy)")
flags.DEFINE_enum("reducer", "default", ["default", "lowrank"],
                  "default: dense, or CSC by --density; lowrank: gf_tf.reducers.LowRank (PowerSGD)")
flags.DEFINE_integer("rank", 2, "--reducer lowrank: the rank of the gradient matrices' factors")
flags.DEFINE_bool("lowrank_alternate", False, "--reducer lowrank: one factor all-reduce a step, "
                  "the P's and the Q's in turn (ACP-SGD), instead of two")
flags.DEFINE_integer("epochs", 10, "training epochs")
flags.DEFINE_integer("steps_per_epoch", 0, "steps per epoch; 0 = one pass over the training set")
flags.DEFINE_integer("batch_size", 64, "global batch size (all replicas of all workers)")
flags.DEFINE_float("learning_rate", 0.05, "peak learning rate (SGD with --momentum, cosine decay)")
flags.DEFINE_float("momentum", 0.9, "SGD momentum, in the optimizer (with CSC too, which then runs plain error "
                   "feedback), or in CSC with --momentum_correction")
flags.DEFINE_bool("momentum_correction", False, "with CSC (--density < 1 or auto): apply --momentum as DGC's "
                  "momentum correction inside ChunkSparsity (the paper's setting), the optimizer then "
                  "being plain SGD")
flags.DEFINE_string("mixed_precision", "none", "Keras dtype policy: none, mixed_float16, mixed_bfloat16")
flags.DEFINE_string("model_dir", "", "TensorBoard logs, checkpoints, BackupAndRestore state; '' = none. "
                    "Must be visible to every worker (same host or shared storage) for resuming")
flags.DEFINE_integer("seed", 0, "random seed (weights, data order, dropout)")
flags.DEFINE_float("collective_timeout", 300.0, "seconds a training step waits for a stuck peer before it fails "
                   "(one watchdog thread per worker keeps it for gf_tf's steps; TensorFlow's own collectives "
                   "carry it each, with a sleeping thread per collective: tensorflow#62466)")
flags.DEFINE_float("startup_timeout", 300.0, "seconds a worker waits for peers that have not started. "
                   "5 minutes because a cluster's workers (pods, hosts started by hand) can start "
                   "minutes apart; TensorFlow alone waits forever. Meanwhile it prints the peers it "
                   "waits for after 10 s, then every 30 s; lower it where workers start together")
flags.DEFINE_float("heartbeat_timeout", None, "seconds without a peer's heartbeats before it is given up "
                   "(default: TensorFlow's, 10 s; raise it on slow links, where collectives delay them)")


def _throughput_callback(global_batch_size):
    """A Keras callback measuring training images/s over all replicas, first step excluded."""
    import keras

    class Throughput(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps, self.start, self.end = 0, None, None

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            self.end = time.perf_counter()
            if self.steps == 1:
                self.start = self.end  # the first step includes tracing

        def images_per_second(self):
            if self.steps < 2 or self.end <= self.start:
                return float("nan")
            return (self.steps - 1) * global_batch_size / (self.end - self.start)

    return Throughput()


def _curve_callback(test_accuracy, bytes_sent):
    """A Keras callback recording, after every epoch, the test accuracy (`test_accuracy()`, or
    None when `test_accuracy` is None), the training seconds since the first step began
    (evaluation time excluded) and `bytes_sent()`, the bytes this worker has put into
    gradient all-reduces so far."""
    import keras

    class Curve(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.points, self.start, self.paused = [], None, 0.0

        def on_train_batch_begin(self, batch, logs=None):
            if self.start is None:
                self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.perf_counter() - self.start - self.paused
            began = time.perf_counter()
            accuracy = None if test_accuracy is None else test_accuracy()
            self.paused += time.perf_counter() - began
            self.points.append({"epoch": epoch + 1, "seconds": seconds, "bytes_sent": bytes_sent(),
                                "test_accuracy": accuracy})

    return Curve()


def _test_accuracy(model, source, batch_size):
    """A function returning the model's top-1 accuracy on the whole test split, computed locally
    (no collectives). Its prediction is one tf.function, traced at the first call (and once more
    for a smaller last batch), not at every evaluation."""
    import numpy as np
    import tensorflow as tf
    from models import datasets

    predict = tf.function(lambda x: tf.argmax(model(x, training=False), axis=-1, output_type=tf.int32))

    def accuracy() -> float:
        correct = total = 0
        for x, y in datasets.input_pipeline(source, datasets.TEST, batch_size):
            correct += int(np.sum(predict(x).numpy() == y.numpy()))
            total += int(y.shape[0])
        return correct / total

    return accuracy


_AT_LEAST = {"epochs": 1, "batch_size": 1, "num_devices": 1, "steps_per_epoch": 0, "seed": 0,
             **local_sgd_flags.AT_LEAST}


def _check_flag_ranges():
    """Raises ValueError("--flag ...") for out-of-range numbers, before the cluster starts."""
    for name, low in _AT_LEAST.items():
        if FLAGS[name].value < low:
            raise ValueError(f"--{name} must be >= {low}, got {FLAGS[name].value}")
    for name in ("collective_timeout", "startup_timeout", "heartbeat_timeout"):
        if FLAGS[name].value is not None and FLAGS[name].value <= 0:
            raise ValueError(f"--{name} must be > 0 seconds, got {FLAGS[name].value}")
    if not 0.0 <= FLAGS.momentum < 1.0:
        raise ValueError(f"--momentum must be in [0, 1), got {FLAGS.momentum}")


def main(argv):
    del argv
    _check_flag_ranges()
    logging.set_verbosity(logging.WARNING)  # TF's per-collective INFO lines drown the results
    import keras
    import gf_tf
    from gf_tf import worker
    from gf_tf.keras import backup
    from models import datasets, factory, traffic

    say = lambda *a: print(*a, flush=True)
    strategy_name, num_devices = FLAGS.strategy, FLAGS.num_devices
    if "TF_CONFIG" not in os.environ and not FLAGS["strategy"].present:
        # One process, no cluster: 2 replicas in this process still exercise the all-reduce
        # (a one-worker cluster with one replica would skip it).
        strategy_name = "mirrored"
        num_devices = num_devices if FLAGS["num_devices"].present else 2
        say(f"TF_CONFIG is not set: training {num_devices} replicas in this process "
            f"(--strategy mirrored --num_devices {num_devices}). "
            f"For 2 worker processes: gf-tf-run -n 2 -- python -m models.train")
    # Order matters: devices before TF initialises them; GradientFlow outside the strategy scope.
    factory.configure_local_devices(num_devices)
    factory.set_precision(FLAGS.mixed_precision)
    keras.utils.set_random_seed(FLAGS.seed)
    # The low-rank reducer replaces CSC: its run is dense (--density 1) unless --density is given.
    density = FLAGS.density if FLAGS["density"].present or FLAGS.reducer == "default" else "1"
    csc_momentum, optimizer_momentum = factory.split_momentum(
        FLAGS.momentum, FLAGS.momentum_correction, factory.parse_density(density))
    gradient_flow = factory.build_gradient_flow(
        FLAGS.compression, FLAGS.bytes_per_pack, density, FLAGS.chunk_size, FLAGS.warmup_steps,
        csc_momentum, FLAGS.selection, algorithm=FLAGS.algorithm, overlap=FLAGS.overlap,
        scoring=FLAGS.scoring, reducer=FLAGS.reducer, rank=FLAGS.rank,
        lowrank_alternate=FLAGS.lowrank_alternate)
    if FLAGS.tf_all_reduce_dtype != "float32" and gradient_flow is not None:
        raise ValueError(f"--tf_all_reduce_dtype {FLAGS.tf_all_reduce_dtype} is TensorFlow's own all-reduce: "
                         f"give it with --compression none --density 1 (no GradientFlow)")
    strategy = factory.build_strategy(strategy_name, num_devices, gradient_flow,
                                      FLAGS.collective_timeout, FLAGS.startup_timeout,
                                      FLAGS.heartbeat_timeout)
    task_type, task_id, is_chief = factory.task_info(strategy)
    say(f"{factory.tf_config_summary()}; {strategy.num_replicas_in_sync} replicas; "
        f"chief: {is_chief}; gradient all-reduce: "
        f"{'TF ' + FLAGS.tf_all_reduce_dtype if gradient_flow is None else type(gradient_flow).__name__} "
        f"(compression {FLAGS.compression}, algorithm {FLAGS.algorithm}, overlap {FLAGS.overlap}, "
        f"density {density}, warm-up {FLAGS.warmup_steps} steps)")

    model_name = factory.model_for(FLAGS.model, FLAGS.dataset)
    source = factory.load_dataset(FLAGS.dataset, FLAGS.data_dir, model_name, FLAGS.seed)
    steps = FLAGS.steps_per_epoch or datasets.steps_per_epoch(
        source.num_examples[datasets.TRAIN], FLAGS.batch_size)
    train_data = datasets.distributed_dataset(strategy, source, datasets.TRAIN, FLAGS.batch_size,
                                              training=True, seed=FLAGS.seed)
    with strategy.scope():
        model = factory.build_model(model_name, source.input_shape, source.num_classes)
        schedule = keras.optimizers.schedules.CosineDecay(FLAGS.learning_rate, steps * FLAGS.epochs)
        model.compile(optimizer=factory.build_optimizer(schedule, optimizer_momentum,
                                                        FLAGS.tf_all_reduce_dtype),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    say(f"{model_name}: {model.count_params():,} parameters; {FLAGS.dataset}: "
        f"{source.num_examples}, {FLAGS.epochs} epochs x {steps} steps of {FLAGS.batch_size} images")

    throughput = _throughput_callback(FLAGS.batch_size)
    callbacks = local_sgd_flags.callbacks() + [throughput]   # LocalSGD before BackupAndRestore
    test_accuracy = _test_accuracy(model, source, FLAGS.batch_size)
    tf_bytes = None if gradient_flow else traffic.tf_bytes_per_step(
        model, FLAGS.batch_size // strategy.num_replicas_in_sync, FLAGS.tf_all_reduce_dtype)
    if FLAGS.curve:
        curve = _curve_callback(
            test_accuracy if is_chief else None,   # the others wait for the chief in the next step's all-reduce
            lambda: traffic.bytes_sent(gradient_flow, int(model.optimizer.iterations.numpy()), tf_bytes))
        callbacks.append(curve)
    if gradient_flow is not None:
        callbacks.append(gf_tf.GradientFlowStats(gradient_flow))  # before TensorBoard, which logs it
    write_dir = None
    if FLAGS.model_dir:
        write_dir = FLAGS.model_dir if is_chief else os.path.join(FLAGS.model_dir, f"workertemp_{task_id}")
        backup_dir = os.path.join(FLAGS.model_dir, "backup")
        callbacks += [
            # Every worker restores the chief's weights and epoch and its own CSC state
            # (gf_tf.keras.backup): the chief writes the backup, the others their CSC state.
            backup.BackupAndRestore(backup_dir),
            keras.callbacks.ModelCheckpoint(os.path.join(write_dir, "checkpoint.weights.h5"),
                                            save_weights_only=True),
        ]
        try:
            import tensorboard  # noqa: F401  (tf.summary needs it; pip install gf_tf[models])
            callbacks.append(keras.callbacks.TensorBoard(os.path.join(write_dir, "logs")))
        except ImportError:
            say("tensorboard is not installed: no TensorBoard logs (pip install tensorboard)")
    history = model.fit(train_data, epochs=FLAGS.epochs, steps_per_epoch=steps, callbacks=callbacks,
                        shuffle=False, verbose=2 if is_chief else 0)

    accuracy = test_accuracy()
    comm = tf_bytes or traffic.bytes_per_step(gradient_flow, history)
    images_per_second = throughput.images_per_second()
    sent, dense, last = (comm["sent_bytes_per_step"], comm["dense_bytes_per_step"],
                         comm["last_epoch_sent_bytes_per_step"])
    say(f"test accuracy: {accuracy:.4f} ({source.num_examples[datasets.TEST]} test images)")
    say(f"throughput: {images_per_second:.1f} images/s (all {strategy.num_replicas_in_sync} replicas, "
        f"first step excluded)")
    if dense:
        say(f"bytes sent per step per replica: {sent:,.0f} (mean of all steps, warm-up included; "
            f"last epoch {last:,.0f}) vs {dense:,.0f} for float32 dense all-reduce: "
            f"{dense / sent if sent else float('inf'):.1f}x fewer, {100 * (1 - sent / dense):.1f}% "
            f"saved ({comm['source']})")
    else:
        say("bytes sent per step: none (one replica: Keras skips the gradient all-reduce)")
    if write_dir:
        model.save_weights(os.path.join(write_dir, "final.weights.h5"))
        results = {"test_accuracy": accuracy, "images_per_second": images_per_second,
                   "flags": {f: FLAGS[f].value for f in FLAGS if f in _TRAIN_FLAGS}, "model": model_name,
                   **comm}
        if FLAGS.curve:
            results["curve"] = curve.points
        with open(os.path.join(write_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        if not is_chief:
            shutil.rmtree(write_dir, ignore_errors=True)
    worker.exit_together(FLAGS.collective_timeout)   # no worker leaves while another still evaluates
    return 0


_TRAIN_FLAGS = ("model", "dataset", "data_dir", "strategy", "num_devices", "compression",
                "bytes_per_pack", "algorithm", "overlap", "density", "chunk_size", "warmup_steps",
                "selection", "scoring", "tf_all_reduce_dtype", "curve", "epochs", "steps_per_epoch",
                "batch_size", "learning_rate", "momentum", "momentum_correction",
                "mixed_precision", "model_dir", "seed", "collective_timeout", "startup_timeout",
                "heartbeat_timeout") + local_sgd_flags.NAMES


def parse_flags(argv):
    """absl's flag parsing, with a bad flag (an enum flag's unknown value, a malformed number, an
    unknown flag) printed as one line and exit code 2, like the other flag errors. It runs before
    TensorFlow is imported, so a typo fails at once."""
    try:
        return FLAGS(argv)
    except flags.Error as e:
        print(f"models.train: error: {e}", file=sys.stderr)
        sys.exit(2)


def run():
    """Entry point: errors in flag values or TF_CONFIG, and unavailable datasets, print one line.

    SIGINT (Ctrl-C) and SIGTERM end it at once with one line and exit code 130 / 143, even while
    TensorFlow waits for a peer (gf_tf.worker.exit_on_signals). A lost peer worker ends it with
    one line naming that worker and exit code 1 (gf_tf.worker.lost_worker_message).
    """
    from gf_tf import worker
    worker.exit_on_signals("models.train")   # before TensorFlow starts any thread
    try:
        app.run(main, flags_parser=parse_flags)   # main imports TensorFlow, after the flags
    except ValueError as e:
        if "unknown --" in str(e) or str(e).startswith(("--", "TF_CONFIG")):
            print(f"models.train: error: {e}", file=sys.stderr)
            sys.exit(2)
        raise
    except Exception as e:  # pylint: disable=broad-except
        from models.datasets import DatasetUnavailable   # TensorFlow is imported by now
        if isinstance(e, DatasetUnavailable):
            print(f"models.train: error: {e}", file=sys.stderr)
            sys.exit(1)
        lost = worker.lost_worker_message(e)
        if lost is None:
            raise
        sys.stdout.flush()
        print(f"models.train: error: {lost}", file=sys.stderr, flush=True)
        os._exit(1)   # TF's coordination service would otherwise wait for the lost worker at exit


if __name__ == "__main__":
    run()
