"""Recursive-doubling all-reduce (gf_tf.collectives.recursive_doubling): the schedule, one
worker's local replicas, and real worker processes on 127.0.0.1 against float64 NumPy references."""

import math

import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf.collectives import recursive_doubling
from gf_tf.cluster import WorkerInfo
from cluster import describe, run_workers
from csc_reference import NumpyAheadCSC, NumpyCSC, chunks_zero, flatten, pack_order

# Unit roundoff per dtype, and the worker's cases (tests/workers/collectives_worker.py).
UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}
CASES = [(dtype, size) for dtype in ("float16", "bfloat16", "float32") for size in (1, 7, 1009, 0)]
VARIABLES = [(7, 3), (1009,)]
OP_OF_ACTION = {recursive_doubling.ALL_REDUCE: "CollectiveReduceV2:2",
                recursive_doubling.SEND: "CollectiveBcastSendV2:2",
                recursive_doubling.RECEIVE: "CollectiveBcastRecvV2:2",
                recursive_doubling.RECEIVE_ADD: "CollectiveBcastRecvV2:2"}


# --- the schedule ------------------------------------------------------------

@pytest.mark.parametrize("n", list(range(1, 34)) + [64, 100])
def test_schedule_gives_every_rank_the_sum_and_partners_agree(n):
    """Simulated with contribution counts: after the stages every rank holds each of the n
    values exactly once; each step's partner lists the same stage, the matching action and
    the same group key; ranks below P run log2(P) all-reduces, extras one send, one receive."""
    plans = [recursive_doubling.schedule(n, r) for r in range(n)]
    held = np.eye(n)
    match = {recursive_doubling.ALL_REDUCE: recursive_doubling.ALL_REDUCE,
             recursive_doubling.SEND: None,
             recursive_doubling.RECEIVE_ADD: recursive_doubling.SEND,
             recursive_doubling.RECEIVE: recursive_doubling.SEND}
    p = 1 << (n.bit_length() - 1)
    for stage in range(int(math.log2(p)) + 2):
        before = held.copy()
        for r, plan in enumerate(plans):
            for step in (s for s in plan if s.stage == stage):
                (theirs,) = [s for s in plans[step.partner] if s.stage == stage]
                assert theirs.partner == r and theirs.group_key(step.partner) == step.group_key(r)
                assert match[step.action] in (None, theirs.action)
                if step.action == recursive_doubling.ALL_REDUCE:
                    held[r] = before[r] + before[step.partner]
                elif step.action == recursive_doubling.RECEIVE_ADD:
                    held[r] = before[r] + before[step.partner]
                elif step.action == recursive_doubling.RECEIVE:
                    held[r] = before[step.partner]
    np.testing.assert_array_equal(held, np.ones([n, n]))
    for r, plan in enumerate(plans):
        assert [s.stage for s in plan] == sorted(s.stage for s in plan)
        rounds = [s for s in plan if s.action == recursive_doubling.ALL_REDUCE]
        assert len(rounds) == (math.log2(p) if r < p else 0)
        assert len(plan) - len(rounds) == (2 if r >= p or r + p < n else 0)


def test_group_keys_are_unique_per_pair_and_stage_and_far_above_tensorflows():
    """TF's CollectiveKeys hand out 1, 2, 3, ... (plus the strategy's key base); ours start at
    GROUP_KEY_BASE and stay int32 up to MAX_WORKERS workers."""
    for n in (3, 8, 13, 64):
        keys = {}
        for r in range(n):
            for step in recursive_doubling.schedule(n, r):
                pair = (step.stage, frozenset((r, step.partner)))
                keys.setdefault(step.group_key(r), pair)
                assert keys[step.group_key(r)] == pair
    last = recursive_doubling.MAX_WORKERS - 1
    biggest = recursive_doubling.schedule(recursive_doubling.MAX_WORKERS, last)
    assert all(recursive_doubling.GROUP_KEY_BASE <= s.group_key(last) < 2 ** 31
               for s in biggest)
    assert recursive_doubling.GROUP_KEY_BASE > 1 << 30


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="algorithm must be \"auto\" or one of"):
        gf_tf.GradientFlowAllReduce(algorithm="tree")
    assert "algorithm='recursive_doubling'" in repr(
        gf_tf.GradientFlowAllReduce(algorithm="recursive_doubling"))
    with pytest.raises(ValueError, match="rank 3 of 3"):
        recursive_doubling.schedule(3, 3)
    with pytest.raises(ValueError, match="CollectiveAllReduce"):
        recursive_doubling.recursive_doubling_sum(tf.distribute.ReductionToOneDevice(),
                                                  WorkerInfo(0, ("worker 0",)), ["/cpu:0"])


# --- one worker: the local replicas ----------------------------------------------

def test_one_worker_sums_its_local_replicas_once_and_returns_a_copy_on_each_device():
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]
    strategy = tf.distribute.MirroredStrategy(devices)
    ops = gf_tf.tf_internal.default_cross_device_ops(strategy)
    rd_sum = recursive_doubling.recursive_doubling_sum(ops, WorkerInfo(0, ("worker 0",)), devices)
    with pytest.raises(ValueError, match="3 tensors for 4 replica devices"):
        rd_sum([tf.zeros([2])] * 3)
    traced_devices = []

    @tf.function
    def function(tensors):
        out = rd_sum(tensors)
        traced_devices.append([o.device for o in out])   # (a function's outputs come back on CPU:0)
        return out
    rng = np.random.default_rng(0)
    for dtype, size in CASES:
        values = [rng.standard_normal(size) * 4 for _ in devices]
        tensors = []
        for device, v in zip(devices, values):
            with tf.device(device):
                tensors.append(tf.cast(v, dtype))
        exact = [tf.cast(t, tf.float64).numpy() for t in tensors]
        ref = np.sum(exact, axis=0)
        eager = rd_sum(tensors)
        assert [o.device for o in eager] == devices
        for out in (eager, function(tensors)):
            assert traced_devices[-1] == devices
            for o in out:
                assert o.dtype == dtype and o.shape == [size]
                got = tf.cast(o, tf.float64).numpy()
                np.testing.assert_array_equal(got, tf.cast(out[0], tf.float64).numpy())
                assert np.all(np.abs(got - ref) <= 3 * UNIT[dtype] * np.sum(np.abs(exact), 0))


# --- worker processes ---------------------------------------------------------------

def _workers(n, *args, timeout=240, comm_timeout=60, per_worker_args=None):
    results = run_workers("collectives_worker.py", n, list(args), timeout=timeout,
                          comm_timeout=comm_timeout, per_worker_args=per_worker_args)
    assert all(r.ok and r.result is not None for r in results), describe(results)
    return [r.result for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_recursive_doubling_sum_matches_float64_and_is_identical_on_every_worker(n):
    """Eagerly and in a tf.function called twice, every dtype and size: within
    (ceil(log2 n) + 1) roundings of the float64 sum; TF's ring all-reduces interleaved
    with them still work (TF's instance keys stay matched) and agree to their own bound."""
    results = _workers(n, "--mode=values", timeout=240 + 60 * n)
    levels = math.ceil(math.log2(n)) + 1
    for call in range(3):
        for c, (dtype, size) in enumerate(CASES):
            inputs = np.array([r[f"x{call}_{c}"] for r in results], np.float64)
            ref, magnitude = inputs.sum(0), np.abs(inputs).sum(0)
            rd = results[0][f"rd{call}_{c}"]
            assert rd.shape == (size,)
            assert np.all(np.abs(rd - ref) <= levels * UNIT[dtype] * magnitude), (dtype, size)
            ring = results[0][f"ring{call}_{c}"]
            assert np.all(np.abs(ring - ref) <= n * UNIT[dtype] * magnitude), (dtype, size)
            for r in results:
                np.testing.assert_array_equal(r[f"rd{call}_{c}"].view(np.uint32), rd.view(np.uint32))
            if size:
                assert np.any(ref != 0) and np.any(inputs[0] != inputs[1])


def _expected_collectives(n, rank, all_reduces_per_step):
    return sorted(OP_OF_ACTION[s.action]
                  for s in recursive_doubling.schedule(n, rank)) * all_reduces_per_step


@pytest.mark.slow
def test_gradient_flow_dense_fp16_over_recursive_doubling_at_4_workers():
    """The one FP16 pack, scaled a step ahead, and its float32 retry (a branch taken at the
    first step only) each take log2(4) = 2 rounds of 2-member all-reduces (no 4-member ring);
    sums within FP16 rounding of float64, identical bits."""
    steps, n = 3, 4
    results = _workers(n, "--mode=gradients", f"--steps={steps}", timeout=300)
    for rank, r in enumerate(results):
        assert sorted(r["collectives"].tolist()) == sorted(_expected_collectives(n, rank, 2))
        assert [float(r[f"retries{s}"]) for s in range(steps)] == [1.0, 1.0, 1.0]
    for s in range(steps):
        for i in range(len(VARIABLES)):
            ref = sum(r[f"g{s}_{i}"].astype(np.float64) for r in results)
            got = results[0][f"out{s}_{i}"]
            np.testing.assert_allclose(got, ref, rtol=4e-3, atol=4e-3 * np.abs(ref).max())
            for r in results:
                np.testing.assert_array_equal(r[f"out{s}_{i}"].view(np.uint32), got.view(np.uint32))


@pytest.mark.slow
def test_gradient_flow_csc_over_recursive_doubling_at_3_workers_matches_the_numpy_model():
    """3 workers: fold into rank 0 by broadcast, one round, unfold. CSC (density 0.01 of 65
    chunks: k = 1) over 3 steps with error feedback against NumpyCSC in float64."""
    steps, n, cs = 3, 3, 16
    results = _workers(n, "--mode=gradients", f"--steps={steps}", "--density=0.01",
                       f"--chunk_size={cs}", timeout=300)
    for rank, r in enumerate(results):   # the chunk norms and the selected chunks
        assert sorted(r["collectives"].tolist()) == sorted(_expected_collectives(n, rank, 2))
    order = pack_order(VARIABLES)
    model = NumpyCSC(1030, n, cs)
    for s in range(steps):
        grads = [flatten([r[f"g{s}_{i}"] for i in range(len(VARIABLES))], order) for r in results]
        ref, idx = model.step(grads, 0.01)
        assert len(idx) == 1
        outs = [flatten([r[f"out{s}_{i}"] for i in range(len(VARIABLES))], order) for r in results]
        for got in outs:
            np.testing.assert_array_equal(got.astype(np.float32).view(np.uint32),
                                          outs[0].astype(np.float32).view(np.uint32))
        np.testing.assert_allclose(outs[0], ref, rtol=4e-3, atol=4e-3 * np.abs(ref).max())
        np.testing.assert_array_equal(np.flatnonzero(~chunks_zero(outs[0], cs)), idx)


@pytest.mark.slow
def test_csc_ahead_over_recursive_doubling_at_3_workers_matches_the_numpy_model():
    """selection="ahead" (one collective per sparse step) over recursive doubling: a dense warm-up
    step, then 3 sparse steps whose chunks were chosen a step ahead, against NumpyAheadCSC in
    float64; every collective is a 2-member one (no 3-member ring), every worker gets the same bits."""
    steps, n, cs, density = 4, 3, 16, 0.05
    results = _workers(n, "--mode=gradients", f"--steps={steps}", f"--density={density}",
                       f"--chunk_size={cs}", "--selection=ahead", "--warmup_steps=1", timeout=300)
    for r in results:
        assert r["collectives"].size and all(c.endswith(":2") for c in r["collectives"].tolist()), \
            r["collectives"]
    order = pack_order(VARIABLES)
    model = NumpyAheadCSC(1030, n, cs)
    for s in range(steps):
        grads = [flatten([r[f"g{s}_{i}"] for i in range(len(VARIABLES))], order) for r in results]
        ref, idx = model.step(grads, density, warmup=s == 0)
        assert len(idx) == (65 if s == 0 else 4)
        outs = [flatten([r[f"out{s}_{i}"] for i in range(len(VARIABLES))], order) for r in results]
        for got in outs:
            np.testing.assert_array_equal(got.astype(np.float32).view(np.uint32),
                                          outs[0].astype(np.float32).view(np.uint32))
        np.testing.assert_allclose(outs[0], ref, rtol=4e-3, atol=4e-3 * np.abs(ref).max())
        np.testing.assert_array_equal(np.flatnonzero(~chunks_zero(outs[0], cs)), idx)


@pytest.mark.slow
def test_workers_with_different_algorithms_fail_in_the_handshake_naming_it():
    results = run_workers("collectives_worker.py", 2, ["--mode=gradients"], timeout=180,
                          comm_timeout=60, per_worker_args=[["--algorithm=ring"],
                                                            ["--algorithm=recursive_doubling"]])
    for r in results:
        assert r.returncode not in (0, None), describe(results)
        assert "settings differ across workers" in r.output, describe(results)
        assert "algorithm: worker 0 = 'ring', worker 1 = 'recursive_doubling'" in r.output
        assert "InternalError" not in r.output


@pytest.mark.slow
@pytest.mark.parametrize("stall", [False, True], ids=["exits", "stalls"])
def test_a_worker_that_exits_or_stalls_mid_run_makes_the_others_fail_with_an_error(stall):
    """3 workers, the extra rank 2 stops after 2 all-reduces: rank 0 waits for its fold
    broadcast, rank 1 for rank 0. Both must end with an error long before the run's hard
    limit: a worker that exits is seen by TF's heartbeats (or the collective timeout, 10 s);
    one that stays alive but sends nothing only by the collective timeout."""
    comm_timeout, hard = 10, 200
    results = run_workers("collectives_worker.py", 3,
                          ["--mode=fault", "--steps=2", "--victim=2"] + ["--stall"] * stall,
                          timeout=hard, comm_timeout=comm_timeout)
    assert results[2].returncode == 0, describe(results)
    for r in results[:2]:
        assert r.returncode is not None, describe(results)   # not killed at the hard limit
        if r.returncode == 0:
            assert str(r.result["error"]), describe(results)
            assert float(r.result["error_seconds"]) < 6 * comm_timeout, describe(results)
            if stall:
                assert "DeadlineExceeded" in str(r.result["error"]), describe(results)
