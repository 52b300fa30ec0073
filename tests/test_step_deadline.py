"""A step's deadline (gf_tf.collectives.deadline): the rule that no collective of a gradient step
carries a timeout, the stall rule the watchdog applies, and on real workers a thread count that
stays bounded under a timeout (tensorflow#62466) while a stuck peer still ends the step.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf.collectives import deadline
from cluster import describe, run_workers

DEVICES = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
TIMED = tf.distribute.experimental.CommunicationOptions(timeout_seconds=300)


# --- the rule -----------------------------------------------------------------------------

@pytest.mark.parametrize("options", [None, TIMED, tf.distribute.experimental.CommunicationOptions(
    bytes_per_pack=1024, timeout_seconds=7.5, implementation="ring")])
def test_in_step_options_carry_no_timeout_over_any_strategy_timeout_and_keep_the_rest(options):
    step = deadline.in_step_options(options)
    strategy_own = tf.distribute.experimental.CommunicationOptions(timeout_seconds=300)
    assert step.timeout_seconds == 0
    assert strategy_own.merge(step).timeout_seconds == 0   # as TF merges them: 0 is "none"
    if options is not None:
        assert (step.bytes_per_pack, step.implementation) == (options.bytes_per_pack,
                                                               options.implementation)
        assert options.timeout_seconds in (300, 7.5)   # the caller's object is not changed


def test_a_step_keeps_the_timeout_of_its_options_over_the_strategy_s_in_its_watch():
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    options, watch = deadline.for_step(strategy, TIMED)
    assert options.timeout_seconds == 0 and watch.timeout == 300
    assert deadline.for_step(strategy, TIMED)[1] is watch   # one per process and timeout
    assert deadline.for_step(strategy, None)[1] is None   # no timeout, no watch


@pytest.mark.parametrize("timeout, poll", [(300, 1.0), (4, 1.0), (2, 0.5), (0.4, 0.1)])
def test_the_watchdog_reads_the_counts_every_second_or_a_quarter_of_a_short_timeout(timeout, poll):
    assert deadline.poll_seconds(timeout) == pytest.approx(poll)


def test_a_stall_is_the_same_counts_with_a_step_in_for_the_whole_timeout():
    stall = deadline.Stall(timeout=10.0)
    assert not stall.observe(0.0, 0, 0)
    assert not stall.observe(20.0, 0, 0)        # nothing in: idle, never a stall
    assert not stall.observe(21.0, 1, 0)        # a step went in: the wait starts now
    assert not stall.observe(30.9, 1, 0)
    assert stall.observe(31.0, 1, 0)            # 10 s in with no progress
    stall = deadline.Stall(timeout=10.0)
    for t in range(0, 100, 3):                  # steps keep going in and out: never a stall
        assert not stall.observe(float(t), t // 3 + 1, t // 3)
    assert not stall.observe(200.0, 50, 50)


def test_the_timeout_message_names_the_setting_and_says_what_tensorflow_says():
    text = deadline.timeout_message(30)
    assert "CommunicationOptions(timeout_seconds=30)" in text
    assert "Collective has timed out during execution" in text   # what worker.lost_worker_message reads


class RecordingOps(tf.distribute.ReductionToOneDevice):
    """TensorFlow's ReductionToOneDevice (no collectives, so any number of strategies share a
    process), recording the timeout of every options object it is handed."""

    def __init__(self):
        super().__init__()
        self.timeouts = []

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self.timeouts.append(options.timeout_seconds)
        return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        self.timeouts.append(options.timeout_seconds)
        return super().reduce_implementation(reduce_op, per_replica_value, destinations, options)


def test_a_traced_gradient_step_hands_every_all_reduce_options_without_timeout_and_is_counted():
    """Packs (FP16: scale bounds and packs) and an IndexedSlices gradient (its float16 rows
    through TF's gather, `gather_sum`) alike, against the float64 sum; the step counted in and
    out once."""
    wrapped = RecordingOps()
    gradient_flow = gf_tf.GradientFlowAllReduce(compression="fp16", bytes_per_pack=0,
                                                cross_device_ops=wrapped)
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=gradient_flow)
    rng = np.random.default_rng(3)
    values = [rng.normal(size=(7, 3)).astype(np.float32), rng.normal(size=(1009,)).astype(np.float32),
              rng.normal(size=(5, 2)).astype(np.float32)]
    with tf.device("/cpu:0"):
        variables = [tf.Variable(v) for v in values]

    @tf.function
    def step():
        def replica_fn():
            scale = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1,
                            tf.float32)
            grads = [tf.identity(v) * scale for v in variables[:2]]
            grads.append(tf.IndexedSlices(tf.identity(variables[2][1:3]) * scale, tf.constant([1, 2]),
                                          tf.constant([5, 2])))
            return gf_tf.all_reduce_gradients(grads, variables, options=TIMED)
        return strategy.experimental_local_results(strategy.run(replica_fn))[0]

    watch = deadline.for_step(strategy, TIMED)[1]
    before = watch.counts.numpy()
    reduced = [tf.convert_to_tensor(r).numpy() for r in step()]
    assert len(wrapped.timeouts) >= 3 and set(wrapped.timeouts) == {0}, wrapped.timeouts
    assert list(watch.counts.numpy() - before) == [1, 1]
    sliced = np.zeros((5, 2))
    sliced[1:3] = values[2][1:3]
    for got, value, rtol in zip(reduced, [values[0], values[1], sliced], [2e-3, 2e-3, 2.0 ** -11]):
        np.testing.assert_allclose(got, 3.0 * value.astype(np.float64), rtol=rtol, atol=1e-6)


# --- real workers -------------------------------------------------------------------------

COMM_TIMEOUT = 300   # seconds: the trainer's default (models.train --collective_timeout)
# Threads of one worker: TF's pools and gRPC (222-251 in the step-deadline report, docs/reports),
# one watchdog, and the eager collectives of start-up (probe, handshake) and of the metrics' reads,
# which keep their timeout. Per-collective timeouts add (collectives a second) x 300 s: thousands here.
THREAD_BOUND = 400


@pytest.mark.slow
@pytest.mark.parametrize("density", ["1", "0.25"])
def test_thousands_of_steps_under_a_300_s_timeout_keep_every_worker_under_400_threads(density):
    results = run_workers("deadline_worker.py", 2, ["threads", "2000", density], timeout=300,
                          comm_timeout=COMM_TIMEOUT)
    assert all(r.ok for r in results), describe(results)
    for r in results:
        samples = r.result["threads"]
        assert len(samples) == 40, describe(results)
        assert samples.max() < THREAD_BOUND, (samples, describe(results))
    np.testing.assert_array_equal(results[0].result["weights"], results[1].result["weights"])


@pytest.mark.slow
def test_a_peer_that_stops_stepping_while_alive_ends_the_survivor_s_step_at_the_deadline():
    """Worker 1 stops between steps for 3x the timeout, alive (heartbeats go on): worker 0's
    next step waits in its all-reduce until the watchdog aborts it with DeadlineExceededError."""
    results = run_workers("deadline_worker.py", 2, ["stuck", "30"], timeout=200, comm_timeout=5)
    survivor = results[0].output
    match = re.search(r"fit raised DeadlineExceededError ([\d.]+) s after the last finished step: "
                      r"(.*)", survivor)
    assert results[0].returncode == 3 and match, describe(results)
    assert deadline.timeout_message(5) in match.group(2), describe(results)
    assert "worker 1 stops stepping at batch 30" in results[1].output, describe(results)
