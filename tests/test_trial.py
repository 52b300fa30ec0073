"""gf_tf.trial: TensorFlow's own all-reduce against GradientFlow's wire, measured in a set's first
steps; every worker keeps the same one."""

import numpy as np
import pytest
import tensorflow as tf

from gf_tf import trial
from cluster import describe, run_process, run_workers
from test_multistep import GRADIENT_SCALE


def test_median_of_each_row():
    samples = tf.constant([[4.0, 1.0, 3.0, 2.0], [9.0, 9.0, 1.0, 100.0]], tf.float64)
    np.testing.assert_array_equal(trial.median(samples).numpy(), [2.5, 9.0])


@pytest.mark.parametrize("tf_s,gf_s,kept", [
    (1.0, 0.5, trial.GRADIENT_FLOW),
    (1.0, 0.96, trial.TF_OWN),        # not 5% faster: TF's own stays
    (1.0, 1.5, trial.TF_OWN),
    (1.0, 0.0, trial.TF_OWN),         # nothing measured
    (np.nan, 0.5, trial.TF_OWN),
    (1.0, np.nan, trial.TF_OWN),
    (np.inf, 0.5, trial.TF_OWN),
])
def test_gradient_flow_is_kept_only_when_measured_faster(tf_s, gf_s, kept):
    assert int(trial.keep(tf.constant(tf_s, tf.float32), tf.constant(gf_s, tf.float32))) == kept


def _fake_trial(tf_cost, gf_cost, steps):
    """A trial on one process whose candidates advance a fake clock by their cost; the
    'all-reduce' sums 2 identical workers. Returns (candidate per step, outputs, state)."""
    now = tf.Variable(0.0, dtype=tf.float64)
    state = trial.TrialState("fake")

    def candidate(cost, value):
        def run():
            now.assign_add(cost)
            return [tf.constant([value])]
        return run

    @tf.function
    def step(x):
        return trial.run(state, [candidate(tf_cost, 10.0), candidate(gf_cost, 20.0)], [x],
                         lambda tensors: [2.0 * t for t in tensors], ["/cpu:0"], 2, "fake",
                         now.read_value)

    ran, outputs = [], []
    for _ in range(steps):
        out, which = step(tf.constant(1.0))
        ran.append(int(which))
        outputs.append(float(out[0][0]))
    return ran, outputs, state


@pytest.mark.parametrize("tf_cost,gf_cost,kept", [(3.0, 1.0, trial.GRADIENT_FLOW),
                                                   (1.0, 3.0, trial.TF_OWN),
                                                   (1.0, 1.0, trial.TF_OWN)])
def test_schedule_alternates_then_keeps_the_faster(tf_cost, gf_cost, kept):
    ran, outputs, state = _fake_trial(tf_cost, gf_cost, trial.STEPS + 4)
    assert ran[:trial.STEPS] == [0, 1] * (trial.STEPS // 2)
    assert ran[trial.STEPS:] == [kept] * 4
    assert outputs == [10.0 if w == trial.TF_OWN else 20.0 for w in ran]   # the candidate's own result
    choice, measured = state.decision()
    assert choice == kept and measured == pytest.approx((tf_cost, gf_cost))
    np.testing.assert_array_equal(state.seconds.numpy(), [[tf_cost] * trial.SAMPLES,
                                                          [gf_cost] * trial.SAMPLES])
    assert int(state.step.numpy()) == trial.STEPS   # the counter stops at the decision


def test_undecided_before_the_last_trial_step():
    _, _, state = _fake_trial(3.0, 1.0, trial.STEPS - 1)
    assert state.decision() == (None, None)


def _bytes(wire, elements, tensors):
    """What one all-reduce of a set sends with the GradientFlow wire (packs plus FP16 bounds)."""
    return {"fp16": 2 * elements + 4 * tensors, "bf16": 2 * elements, "none": 4 * elements}[str(wire)]


@pytest.mark.parametrize("num_workers", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_workers_with_different_clocks_keep_the_same_candidate_and_sum_right(num_workers):
    results = run_workers("trial_worker.py", num_workers=num_workers, args=["--mode", "values"],
                          timeout=90 + 30 * num_workers, comm_timeout=30)
    assert all(r.ok and r.result is not None for r in results), describe(results)
    first = results[0].result
    for r in results:
        assert "gf_tf: variable set [" in r.output and "it travels as" in r.output, r.output[-2000:]
    sets = ("small", "large")
    for key in sets:
        for r in results[1:]:   # the same figures, bitwise, whatever each worker's clock said
            np.testing.assert_array_equal(r.result[f"{key}_measured"], first[f"{key}_measured"])
            assert r.result[f"{key}_choice"] == first[f"{key}_choice"]
            assert str(r.result[f"{key}_plan"]) == str(first[f"{key}_plan"])
        tf_s, gf_s = first[f"{key}_measured"]
        assert int(first[f"{key}_choice"]) == int(trial.keep(tf.constant(tf_s, tf.float32),
                                                             tf.constant(gf_s, tf.float32)))
        np.testing.assert_array_equal(first[f"{key}_plan_measured"], first[f"{key}_measured"])
        assert str(first[f"{key}_plan"]).startswith("tf ") == (first[f"{key}_choice"] == trial.TF_OWN)
    steps = sorted({int(k.split("_")[0][4:]) for k in first if k.startswith("step")})
    assert len(steps) > trial.STEPS
    for s in steps:
        # Both candidates during the trial (TF's own on even steps), the kept one after,
        # in the last step's new trace too (the decision lives in the set's state).
        bytes_ = 0
        for key in sets:
            use = (s % 2 if s < trial.STEPS else int(first[f"{key}_choice"]))
            elements, tensors = int(first[f"{key}_elements"]), int(first[f"{key}_tensors"])
            bytes_ += 4 * elements if use == trial.TF_OWN else _bytes(first[f"{key}_wire"],
                                                                      elements, tensors)
        for r in results:
            assert r.result[f"step{s}_sent_bytes"] == bytes_, s
        for name in [k for k in first if k.startswith(f"step{s}_") and "_sum" in k]:
            sent = name.replace("_sum", "_sent")
            reference = np.sum([r.result[sent].astype(np.float64) for r in results], axis=0)
            # FP16 scaled to the tensor's bound, the SUM over workers of max |g|
            # (tests/test_overlap.py); float32 candidates are well inside it.
            bound = np.sum([np.max(np.abs(r.result[sent].astype(np.float64))) for r in results])
            for r in results:
                np.testing.assert_allclose(r.result[name], reference, rtol=0,
                                           atol=2.0 ** -10 * bound * num_workers, err_msg=name)
                np.testing.assert_array_equal(r.result[name], first[name])


def test_fit_through_a_trial_is_identical_across_workers_close_to_float32_and_saves(tmp_path):
    results = run_workers("trial_worker.py", num_workers=2, args=["--mode", "fit"], timeout=180,
                          comm_timeout=30,
                          per_worker_args=[["--saved_model", str(tmp_path / f"w{i}")] for i in range(2)])
    assert all(r.ok and r.result is not None for r in results), describe(results)
    # Keras 3.6 and 3.7 train 2 workers on GRADIENT_SCALE x the global batch's gradient: for
    # plain SGD, the baseline's learning rate times that (tests/test_overlap.py).
    baseline = run_process("trial_worker.py", ["--mode", "fit", "--baseline",
                                               f"--learning_rate={0.05 * GRADIENT_SCALE}"], timeout=180)
    assert baseline.ok, describe([baseline])
    first = results[0].result
    steps = int(first["iterations"])
    assert steps > trial.STEPS and int(first["stats_steps"]) == steps
    for r in results:
        assert int(r.result["trial_step"]) == trial.STEPS   # decided, then the counter stops
        assert int(r.result["choice"]) == int(first["choice"])
        np.testing.assert_array_equal(r.result["measured"], first["measured"])
        # GradientFlowStats prints the plan after the first epoch and again once decided.
        lines = [l for l in r.output.splitlines() if l.startswith("gf_tf: [")]
        assert len(lines) == 2, r.output[-3000:]
        assert "whichever measures faster in the first steps" in lines[0]
        kept = "TensorFlow's own float32" if int(first["choice"]) == trial.TF_OWN else "packs"
        assert kept in lines[1] and "; measured" in lines[1] and "whichever" not in lines[1]
        assert (tmp_path / f"w{r.index}" / "saved_model.pb").exists()
    keys = sorted((k for k in baseline.result if k[0] == "w"), key=lambda k: int(k[1:]))
    assert len(keys) == 8
    for k in keys:
        assert results[0].result[k].tobytes() == results[1].result[k].tobytes(), k
        # FP16 (or float32) on the wire for the steps GradientFlow carried: close to float32.
        np.testing.assert_allclose(first[k], baseline.result[k], atol=2e-3, rtol=0, err_msg=k)
