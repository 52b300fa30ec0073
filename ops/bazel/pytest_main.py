"""Main of the py_test targets in the top-level BUILD: runs pytest on the files given as arguments.

With GF_TF_OPS_LIBRARY set (to the Bazel-built library), it first checks that gf_tf.ops really
loads that library, so a library that fails to load cannot hide behind skipped compiled-op tests.
"""

import os
import sys

import pytest

if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    library = os.environ.get("GF_TF_OPS_LIBRARY")
    if library:
        from gf_tf import ops

        status = ops.library_status()
        if not status.startswith(f"compiled ({library}"):
            sys.exit(f"gf_tf.ops did not load GF_TF_OPS_LIBRARY={library}: {status}")
        print(f"gf_tf.ops: {status}", flush=True)
    # The runfiles tree is read-only: no .pytest_cache.
    sys.exit(pytest.main(["-p", "no:cacheprovider", *sys.argv[1:]]))
