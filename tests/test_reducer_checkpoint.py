"""Any reducer's state through the checkpoint: a reducer defined here, outside gf_tf/, is saved
and restored by gf_tf.keras.backup.BackupAndRestore from its own state objects' declaration.

In-process, 2 replicas of a MirroredStrategy over logical CPUs (tests/test_checkpoint.py's model and data).
"""

import logging
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import gf_tf
from gf_tf import reducers
from gf_tf.keras import checkpoint_format
from gf_tf.keras.backup import BackupAndRestore
from gf_tf.keras.checkpoint import of
from gf_tf.keras.checkpoint_checks import CheckpointMismatchError
from gf_tf.stats import CommStats
from test_checkpoint import _Interrupt, _data, _refused_at_load, _setup, _trained

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "gf_tf"


class FeedbackState(reducers.VariablesState):
    """One pack's state: per local replica its rounding residual (float32 [n]) and steps (int64),
    built from gf_tf's public reducer API only."""

    def __init__(self, num_elements, devices):
        super().__init__(name=None)
        self.residuals = [reducers.local_variable(tf.zeros([num_elements]), d, f"residual_r{r}")
                          for r, d in enumerate(devices)]
        self.steps = [reducers.local_variable(tf.constant(0, tf.int64), d, f"steps_r{r}")
                      for r, d in enumerate(devices)]

    def named_variables(self):
        return {**{f"residual_r{r}": v for r, v in enumerate(self.residuals)},
                **{f"steps_r{r}": v for r, v in enumerate(self.steps)}}


class RoundingWithFeedback(reducers.Reducer):
    """Each replica sends its gradient plus its residual rounded to multiples of 2**-bits, keeps
    what rounding dropped as its residual (error feedback), and counts its steps. Its own
    figures: the elements it rounded, and the L1 norm of the first served replica's residuals."""

    def __init__(self, bits=6):
        self.bits = bits

    def create_states(self, packs, devices):
        return None, [FeedbackState(pack.num_elements, devices) for pack in packs]

    def settings(self):
        return [("rounding bits", self.bits, str)]

    def cost(self, elements, wire_format):
        return reducers.CostTerms((4 * elements,))

    def reduce(self, step):
        comm, outputs, sent = step.comm, [], reducers.Sent()
        scale = float(2 ** self.bits)
        for pack in step.packs:
            def rounded(r, grads, state=pack.state):
                wanted = tf.concat([tf.reshape(g, [-1]) for g in grads], 0) + state.residuals[r]
                sent_values = tf.round(wanted * scale) / scale
                state.residuals[r].assign(wanted - sent_values)
                state.steps[r].assign_add(1)
                return sent_values
            summed = comm.all_reduce_sum(comm.map(rounded, pack.grads))
            sizes = [int(np.prod(shape)) for shape in pack.spec.shapes]
            outputs.append(comm.map(lambda r, s, spec=pack.spec: [
                tf.reshape(part, shape) * comm.postscale
                for part, shape in zip(tf.split(s, sizes), spec.shapes)], summed))
            residual_l1 = tf.reduce_sum(tf.abs(pack.state.residuals[comm.replicas[0]]))
            sent = sent + reducers.Sent(4 * pack.spec.num_elements, 4 * pack.spec.num_elements,
                                        figures={"rounded_elements": pack.spec.num_elements,
                                                 "residual_l1": residual_l1})
        return outputs, sent


def _arrays(gfar):
    (variable_set,) = gfar.states().values()
    return variable_set.to_arrays()


class _Recorder:
    """A state listener registered after the checkpoint's: sees the state as restored."""

    def __init__(self):
        self.arrays = None

    def record(self, state):
        self.arrays = state.to_arrays()


def preempted_and_resumed(make_reducer, tmp_path):
    """fit for 3 epochs with make_reducer(), once uninterrupted and once preempted after epoch 1
    under BackupAndRestore, then restarted: asserts that the restarted job gets the state back
    array for array and ends with the uninterrupted run's weights and state, bitwise.

    Returns:
      (the state's arrays when the backup was written, the uninterrupted run's
      GradientFlowAllReduce, the restarted run's).
    """
    x, y = _data()
    gfar_a, model_a = _setup(reducer=make_reducer())
    model_a.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)

    backup = str(tmp_path / "backup")
    gfar_b, model_b = _setup(reducer=make_reducer())
    with pytest.raises(RuntimeError, match="simulated preemption"):
        model_b.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                    callbacks=[BackupAndRestore(backup), _Interrupt(epoch=1)])
    saved = _arrays(gfar_b)   # the backup was written at the end of epoch 1

    gfar_c, model_c = _setup(reducer=make_reducer(), seed=5)
    model_c.optimizer.build(model_c.trainable_variables)   # attaches the checkpoint's listener
    recorder = _Recorder()
    gfar_c.state_registry.add_listener(recorder.record)
    history = model_c.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                          callbacks=[BackupAndRestore(backup)])
    assert history.epoch == [2]
    assert sorted(recorder.arrays) == sorted(saved)
    for key, value in saved.items():
        np.testing.assert_array_equal(recorder.arrays[key], value, err_msg=key)
    for a, c in zip(model_a.get_weights(), model_c.get_weights()):
        np.testing.assert_array_equal(a, c)
    for key, value in _arrays(gfar_a).items():
        np.testing.assert_array_equal(_arrays(gfar_c)[key], value, err_msg=key)
    return saved, gfar_a, gfar_c


def test_backup_and_restore_restores_a_reducer_of_our_own(tmp_path):
    """fit with our reducer, preempted after epoch 1 under BackupAndRestore; the restarted job
    gets the residuals and step counters back array for array, and ends with the weights of an
    uninterrupted run, bitwise (the residuals change every later step's rounding)."""
    saved, gfar_a, gfar_c = preempted_and_resumed(RoundingWithFeedback, tmp_path)
    assert saved["p0_steps_r0"] == saved["p0_steps_r1"] == 8
    assert np.any(saved["p0_residual_r1"]) and np.any(saved["p0_residual_r1"] != saved["p0_residual_r0"])
    # The CommStats totals, the reducer's own figures among them, came back with the backup.
    assert gfar_c.stats.totals() == gfar_a.stats.totals()
    assert gfar_a.stats.totals()["figure_rounded_elements"] == 12 * 195


def test_gradient_flow_stats_logs_the_reducers_own_figures():
    """195 = the model's parameters, rounded every step; the residual's L1 norm per step is
    the mean of the values the reducer gave (read back from its state after each step)."""
    gfar, model = _setup(reducer=RoundingWithFeedback())
    x, y = _data()
    norms = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: norms.append(
        sum(float(np.abs(v).sum(dtype=np.float32)) for k, v in _arrays(gfar).items()
            if k.endswith("residual_r0"))))
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[record, gf_tf.GradientFlowStats(gfar)])
    assert history.history["gf_rounded_elements_per_step"] == [195.0, 195.0]
    np.testing.assert_allclose(history.history["gf_residual_l1_per_step"],
                               [np.mean(norms[:4]), np.mean(norms[4:])], rtol=1e-5)
    assert gfar.stats.totals()["figure_rounded_elements"] == 8 * 195
    assert gfar.stats.result()["rounded_elements_per_step"] == 195.0


@pytest.mark.parametrize("name", ["Rounded", "sent_bytes", "a-b"])
def test_a_figure_name_that_cannot_be_a_log_key_is_refused(name):
    with pytest.raises(ValueError, match=f"figure name must be .* got '{name}'"):
        CommStats().update(4, 4, figures={name: 1})


def test_the_meta_records_the_reducer_class_and_settings(tmp_path):
    gfar, model, _ = _trained(tmp_path, reducer=RoundingWithFeedback(bits=5))
    meta, _ = of(model.optimizer).state_arrays()
    assert meta["format"] == 2 and "momentum" not in meta
    assert meta["reducer"] == {"class": f"{__name__}.RoundingWithFeedback",
                               "settings": [["rounding bits", 5]]}


def test_other_reducer_settings_are_refused_naming_both(tmp_path):
    _, _, path = _trained(tmp_path, reducer=RoundingWithFeedback(bits=6))
    message = _refused_at_load(path, reducer=RoundingWithFeedback(bits=4))
    assert message.startswith(
        f"gf_tf: cannot restore the checkpoint's reducer state: it was saved by the reducer "
        f"{__name__}.RoundingWithFeedback(rounding bits 6) and this run's is "
        f"{__name__}.RoundingWithFeedback(rounding bits 4). Resume with the same reducer and "
        f"settings."), message


def test_another_reducer_class_is_refused_naming_both(tmp_path):
    _, _, path = _trained(tmp_path, reducer=RoundingWithFeedback())
    message = _refused_at_load(path)   # CSC (test_checkpoint._setup's)
    assert (f"it was saved by the reducer {__name__}.RoundingWithFeedback(rounding bits 6) and "
            f"this run's is gf_tf.csc.reducer.CSCReducer(sparsity chunk_size 8, sparsity momentum 0.5, "
            f"sparsity selection (CRC32) 'per_pack')") in message


def test_state_into_a_reducer_without_state_is_ignored_with_a_warning(tmp_path, caplog):
    _, _, path = _trained(tmp_path, reducer=RoundingWithFeedback())
    gfar, model = _setup(sparsity=False)
    model.optimizer.build(model.trainable_variables)
    with caplog.at_level(logging.WARNING, logger="gf_tf.keras"):
        model.load_weights(path)
    assert (f"holds the state of the reducer {__name__}.RoundingWithFeedback but this "
            f"GradientFlowAllReduce's reducer gf_tf.reducers.dense.DenseReducer keeps none: the "
            f"state is ignored.") in caplog.text


def _as_format_1(meta, momentum):
    """The meta gf_tf wrote before it recorded the reducer: format 1, CSC's momentum flag."""
    old = {key: value for key, value in meta.items() if key != "reducer"}
    return dict(old, format=1, momentum=momentum)


@pytest.mark.parametrize("momentum", [0.5, 0.0])
def test_a_format_1_checkpoint_restores_csc_state(momentum, tmp_path):
    gfar, model, _ = _trained(tmp_path, momentum=momentum)
    meta, arrays = of(model.optimizer).state_arrays()
    data = checkpoint_format.to_npz(_as_format_1(meta, momentum > 0), arrays)

    gfar_c, model_c = _setup(momentum=momentum)
    model_c.optimizer.build(model_c.trainable_variables)
    x, y = _data()
    model_c.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)   # the state exists
    of(model_c.optimizer).restore_bytes(data)
    restored = _arrays(gfar_c)
    assert sorted(restored) == sorted(_arrays(gfar))
    for key, value in _arrays(gfar).items():
        np.testing.assert_array_equal(restored[key], value, err_msg=key)


def test_a_format_1_checkpoint_with_momentum_into_a_run_without_is_refused_at_load(tmp_path):
    _, model, _ = _trained(tmp_path, momentum=0.5)
    meta, arrays = of(model.optimizer).state_arrays()
    data = checkpoint_format.to_npz(_as_format_1(meta, True), arrays)
    _, model_c = _setup(momentum=0.0)
    model_c.optimizer.build(model_c.trainable_variables)
    x, y = _data()
    model_c.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)
    with pytest.raises(CheckpointMismatchError, match=r"extra \['p0_velocity_r0', 'p0_velocity_r1'\]"):
        of(model_c.optimizer).restore_bytes(data)


def test_no_file_in_gf_tf_keras_reads_sparsity():
    for path in (PACKAGE / "keras").rglob("*.py"):
        assert "sparsity" not in path.read_text(), path


def test_no_file_in_gf_tf_names_the_reducer_of_this_test():
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert "RoundingWithFeedback" not in text and "FeedbackState" not in text, path


def test_local_variable_is_plain_and_on_its_device_inside_a_strategy_scope():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        v = reducers.local_variable(tf.constant([1.5, -2.0]), "/cpu:0", "probe")
        mirrored = tf.Variable(0.0)
    assert not isinstance(v, type(mirrored)) and not v.trainable
    assert v.device.endswith("CPU:0") and v.dtype == tf.float32
    np.testing.assert_array_equal(v.numpy(), [1.5, -2.0])
