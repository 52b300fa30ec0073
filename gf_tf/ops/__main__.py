"""`python -m gf_tf.ops [--force]`: builds the op library for the running TensorFlow into the cache.

The command lives here rather than in `_build` because the package imports `_build` first, and
runpy warns when a module it is asked to run was imported already.
"""

import sys

from gf_tf.ops import _build

sys.exit(_build.main())
