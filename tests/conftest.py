"""Session setup: 4 logical CPU devices, configured before TensorFlow initialises.

MirroredStrategy tests need several local devices; the logical device layout can
only be set before the TF runtime starts, so it is done here, when pytest imports
this file before any test module.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=wrong-import-position

NUM_LOGICAL_CPUS = 4

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(NUM_LOGICAL_CPUS)])
# Start the runtime now, so this layout is final: a later
# set_logical_device_configuration (in a test module) raises RuntimeError
# instead of silently replacing it.
assert len(tf.config.list_logical_devices("CPU")) == NUM_LOGICAL_CPUS

# Modules whose tests start worker clusters, train reference models, run benchmarks or install
# the project: the "slow" tests. `-m "not slow"` is the fast set the matrix runs per cell
# (noxfile.py); tests elsewhere mark themselves with @pytest.mark.slow.
SLOW_MODULES = frozenset({"test_multiworker", "test_sparsity_multiworker", "test_train", "test_launch",
                          "test_benchmarks", "test_bazel_library", "test_install", "test_matrix_fit",
                          "test_multistep", "test_faults", "test_checkpoint_multiworker"})
# Single slow tests in otherwise fast modules (by function name).
SLOW_TESTS = frozenset({"test_measured_fp16_error_of_the_sum_meets_the_targets"})  # up to 64 replicas


def pytest_collection_modifyitems(items):
    import pytest  # pylint: disable=import-outside-toplevel
    for item in items:
        if (item.module.__name__.rpartition(".")[2] in SLOW_MODULES
                or getattr(item, "originalname", item.name) in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
