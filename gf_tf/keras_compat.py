"""Deprecated: gf_tf.keras_compat moved to gf_tf.keras (gf_tf.keras.install()); this name keeps working with a DeprecationWarning."""

import warnings

from gf_tf.keras.flavour import (  # noqa: F401
    LEGACY_KERAS_ENV, TESTED_KERAS_VERSIONS, TESTED_TF_KERAS_VERSIONS, callback_base,
    check_keras_version, flavour, keras_module, uses_tf_keras)
from gf_tf.keras.patches import OVERRIDES, PATCHES, in_multi_worker_mode, install  # noqa: F401

# Names of installers of parts of the table; one install() serves them all.
install_gradient_hook = install_checkpoint_hook = install_loss_scale_agreement = install

warnings.warn("gf_tf.keras_compat is deprecated: import from gf_tf.keras (gf_tf.keras.install())", DeprecationWarning, stacklevel=2)
