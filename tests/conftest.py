"""Session setup: 4 logical CPU devices, configured before TensorFlow initialises.

MirroredStrategy tests need several local devices; the logical device layout can
only be set before the TF runtime starts, so it is done here, when pytest imports
this file before any test module.

Tests that start worker processes or train for more than a few seconds mark themselves
`slow` (module-level `pytestmark = pytest.mark.slow`, or `@pytest.mark.slow` on the test);
`-m "not slow"` is the fast set, which README's test command and the matrix's cells (noxfile.py)
run two at a time (`-n 2`, pytest-xdist: each xdist worker imports this file, so each has the
layout); the slow set runs one at a time, its worker processes using both cores.
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
