"""gf_tf.plan.trial: TensorFlow's own all-reduce against GradientFlow's wire, timed when a set is
first traced; every worker keeps the same one, and the step carries only that one."""

import itertools

import numpy as np
import pytest

from gf_tf.plan import trial
from cluster import describe, run_process, run_workers
from helpers import GRADIENT_SCALE, fp16_pack_bytes


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
    assert trial.keep(tf_s, gf_s) == kept


@pytest.mark.parametrize("tf_s,gf_s,decides", [
    (1.0, 0.59, True),
    (1.0, 0.6, False),           # at CLEAR: not clear enough
    (0.59, 1.0, True),
    (1.0, 0.9, False),
    (1.0, 0.0, False),           # nothing measured
    (np.nan, 0.1, False),
    (np.inf, 0.1, False),
])
def test_the_early_look_decides_only_a_clear_outcome(tf_s, gf_s, decides):
    assert trial.clear(tf_s, gf_s) == decides


@pytest.mark.parametrize("tf_costs,gf_costs,kept,runs", [
    # GradientFlow clearly faster at the early look: the trial ends there.
    ([3.0, 3.0, 9.0, 3.0, 3.0], [1.0, 1.0, 1.0, 1.0, 1.0], trial.GRADIENT_FLOW, trial.FIRST_LOOK),
    ([1.0, 2.0, 1.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0, 3.0], trial.TF_OWN, trial.FIRST_LOOK),
    # Not clear at the early look: all SAMPLES, medians of all of them.
    ([1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.1, 0.1], trial.TF_OWN, trial.SAMPLES),   # medians equal
    ([1.0, 1.0, 1.0, 1.0, 1.0], [0.625, 0.625, 0.75, 0.875, 0.875], trial.GRADIENT_FLOW, trial.SAMPLES),
    ([1.0, 1.0, 1.0, 1.0, 1.0], [0.875, 0.875, 1.0, 1.0, 1.0], trial.TF_OWN, trial.SAMPLES),   # not 5% faster
])
def test_candidates_run_untimed_then_in_turn_and_the_faster_median_is_kept(
        tf_costs, gf_costs, kept, runs, capsys):
    """The candidates advance a fake clock by their cost (binary fractions: the clock's
    differences are exact); the 'all-reduce' is the mean of identical workers."""
    now, ran, reduced = [0.0], [], []

    def candidate(index, costs):
        def run():
            timed = [c for c in ran if c == index]
            ran.append(index)
            if len(timed) >= trial.UNTIMED:
                now[0] += costs[len(timed) - trial.UNTIMED]
        return run

    def all_reduce_mean(mine):
        reduced.append(mine.copy())
        return mine

    decision = trial.measure([candidate(0, tf_costs), candidate(1, gf_costs)], all_reduce_mean,
                             "fake set", lambda: now[0])
    assert ran == [0] * trial.UNTIMED + [1] * trial.UNTIMED + [0, 1] * runs
    medians = [np.median(tf_costs[:runs]), np.median(gf_costs[:runs])]
    assert len(reduced) == (1 if runs == trial.FIRST_LOOK else 2)   # the early look, then the end
    np.testing.assert_array_equal(reduced[-1], medians)
    assert decision == trial.Decision(kept, *medians)
    kept_text = "GradientFlow" if kept == trial.GRADIENT_FLOW else "TensorFlow's own all-reduce"
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"medians of {runs} runs): it travels as {kept_text}"), err


def _bytes(wire, elements, tensors):
    """What one all-reduce of a set sends with the GradientFlow wire (one pack; FP16: with its
    `wire.ahead_slots`, a step ahead), and what a float32 retry of it adds (gf_tf.reducers.dense)."""
    if str(wire) == "fp16":
        return fp16_pack_bytes(elements, tensors), 4 * (elements + tensors)
    return {"bf16": 2 * elements, "none": 4 * elements}[str(wire)], 0


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [2, 3])
def test_workers_with_different_clocks_keep_the_same_candidate_and_sum_right(num_workers):
    results = run_workers("trial_worker.py", num_workers=num_workers, args=["--mode", "values"],
                          timeout=90 + 30 * num_workers, comm_timeout=30)
    assert all(r.ok and r.result is not None for r in results), describe(results)
    first = results[0].result
    for r in results:   # one trial per set: the retrace of the last step keeps its decision
        lines = [l for l in r.output.splitlines() if "gf_tf: variable set [" in l]
        assert len(lines) == 2 and all("it travels as" in l for l in lines), r.output[-2000:]
    sets = ("small", "large")
    steps = sorted({int(k.split("_")[0][4:]) for k in first if k.startswith("step") and k[4].isdigit()})
    assert len(steps) >= 3
    for key in sets:
        for r in results[1:]:   # the same figures, bitwise, whatever each worker's clock said
            np.testing.assert_array_equal(r.result[f"{key}_measured"], first[f"{key}_measured"])
            assert r.result[f"{key}_choice"] == first[f"{key}_choice"]
            assert str(r.result[f"{key}_plan"]) == str(first[f"{key}_plan"])
        tf_s, gf_s = first[f"{key}_measured"]
        assert int(first[f"{key}_choice"]) == trial.keep(tf_s, gf_s)
        np.testing.assert_array_equal(first[f"{key}_plan_measured"], first[f"{key}_measured"])
        assert str(first[f"{key}_plan"]).startswith("tf ") == (first[f"{key}_choice"] == trial.TF_OWN)
        # The trial's runs of the reducer are not steps: its state counts only the steps it carried.
        carried = len(steps) if first[f"{key}_choice"] == trial.GRADIENT_FLOW else 0
        for r in results:
            assert int(r.result[f"{key}_reduce_calls"]) == carried, key
    for r in results:   # the step carries the kept candidates only: nothing of the trial runs in it
        assert not {"Case", "StatelessCase", "Timestamp"} & set(r.result["step_ops"]), r.result["step_ops"]
    for s in steps:
        # The kept candidate from the first step on, in the last step's new trace too (the
        # decision lives in the set's state).
        bytes_, retry_bytes = 0, []
        for key in sets:
            use = int(first[f"{key}_choice"])
            elements, tensors = int(first[f"{key}_elements"]), int(first[f"{key}_tensors"])
            sent, retry = ((4 * elements, 0) if use == trial.TF_OWN
                           else _bytes(first[f"{key}_wire"], elements, tensors))
            bytes_ += sent
            retry_bytes += [retry] if retry else []
        retries = int(first[f"step{s}_retries"])   # the sets whose bounds did not fit (any of them)
        options = {bytes_ + sum(c) for c in itertools.combinations(retry_bytes, retries)}
        for r in results:
            assert float(r.result[f"step{s}_sent_bytes"]) in options, (s, options)
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


@pytest.mark.slow
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
    assert steps > 4 and int(first["stats_steps"]) == steps
    for r in results:
        assert int(r.result["choice"]) == int(first["choice"])
        np.testing.assert_array_equal(r.result["measured"], first["measured"])
        # Decided at the first trace: GradientFlowStats prints the kept plan once, after epoch 1.
        lines = [l for l in r.output.splitlines() if l.startswith("gf_tf: [")]
        assert len(lines) == 1, r.output[-3000:]
        kept = "TensorFlow's own float32" if int(first["choice"]) == trial.TF_OWN else "packs"
        assert kept in lines[0] and "; measured" in lines[0] and "whichever" not in lines[0]
        assert (tmp_path / f"w{r.index}" / "saved_model.pb").exists()
    keys = sorted((k for k in baseline.result if k[0] == "w"), key=lambda k: int(k[1:]))
    assert len(keys) == 8
    for k in keys:
        assert results[0].result[k].tobytes() == results[1].result[k].tobytes(), k
        # FP16 (or float32) on the wire for the steps GradientFlow carried: close to float32.
        np.testing.assert_allclose(first[k], baseline.result[k], atol=2e-3, rtol=0, err_msg=k)
