"""Documented attribute paths exist, and bad settings name the fix."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

import gf_tf


def test_every_gf_tf_path_readme_and_docs_name_is_reachable_from_import_gf_tf_alone():
    """README.md and docs/ (not the dated reports nor the changelog, which name past paths).
    Modules first (they are not imported as a side effect then). A module its package does
    not import counts if `import` reaches it; a logger name, if gf_tf logs under it."""
    repo = pathlib.Path(__file__).resolve().parent.parent
    pages = [repo / "README.md"] + [p for p in sorted((repo / "docs").rglob("*.md"))
                                    if "reports" not in p.parts and p.name != "changelog.md"]
    text = "\n".join(page.read_text() for page in pages)
    paths = sorted(set(re.findall(r"gf_tf(?:\.[A-Za-z_]\w*)+", text)), reverse=True)
    assert "gf_tf.worker.exit_together" in paths and "gf_tf.keras.install" in paths
    code = f"""
import functools, importlib, logging, warnings
warnings.simplefilter("ignore", DeprecationWarning)
import gf_tf
missing = []
for path in {paths!r}:
    try:
        functools.reduce(getattr, path.split(".")[1:], gf_tf)
        continue
    except AttributeError:
        pass
    parts = path.split(".")
    for cut in range(len(parts), 1, -1):   # the longest importable module, then attributes
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            functools.reduce(getattr, parts[cut:], module)
        except AttributeError:
            missing.append(path)
        break
    else:
        missing.append(path)
import gf_tf.route
print([p for p in missing if p not in logging.Logger.manager.loggerDict])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_an_unknown_compression_lists_auto_among_the_choices():
    with pytest.raises(ValueError, match=r"compression must be \"auto\" or one of \[None, 'fp16', 'bf16'"):
        gf_tf.GradientFlowAllReduce(compression="fp61")


def test_a_number_as_sparsity_names_chunk_sparsity():
    with pytest.raises(ValueError, match=r"gf_tf\.ChunkSparsity\(density=0\.01\)"):
        gf_tf.GradientFlowAllReduce(sparsity=0.01)


@pytest.mark.parametrize("kwargs, match", [
    ({"algorithm": "tree"}, r"algorithm must be \"auto\" or one of \['ring', 'recursive_doubling'"),
    ({"bytes_per_pack": -1}, r"bytes_per_pack must be \"auto\" or an integer number of bytes >= 0"),
    ({"overlap": "yes"}, r"overlap must be \"auto\", True or False"),
    ({"reducer": object()}, r"reducer must be a gf_tf\.reducers\.Reducer"),
])
def test_bad_settings_name_the_setting_and_its_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gf_tf.GradientFlowAllReduce(**kwargs)


def test_a_missing_explicit_op_library_names_its_variable_not_a_compiler():
    code = "import warnings; warnings.simplefilter('always'); from gf_tf import ops; print(ops.library_status())"
    env = dict(os.environ, GF_TF_OPS_LIBRARY="/nonexistent/lib.so")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    fix = out.stderr.split("To get the compiled ops:")[1]
    assert fix.lstrip().startswith("$GF_TF_OPS_LIBRARY names /nonexistent/lib.so: point it at a "
                                   "library built for this TensorFlow"), out.stderr[-2000:]


def test_every_tf_function_of_gf_tf_is_traced_without_autograph():
    """AutoGraph would convert every gf_tf helper a traced function calls, and warn ("could not
    transform ...") on the ones whose source it cannot read, such as the op loader's os.path calls."""
    package = pathlib.Path(gf_tf.__file__).resolve().parent
    offenders = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            decorators = getattr(node, "decorator_list", [])
            calls = [d for d in decorators if ast.unparse(d).startswith("tf.function")]
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "tf.function":
                calls.append(node)
            for call in calls:
                autograph = [k for k in getattr(call, "keywords", []) if k.arg == "autograph"]
                if not (autograph and ast.unparse(autograph[0].value) == "False"):
                    offenders.append(f"{path.relative_to(package)}:{call.lineno}")
    assert offenders == []


def test_a_users_tf_function_does_not_autograph_convert_gf_tf(monkeypatch):
    """A custom loop's tf.function converts what it calls, but gf_tf.all_reduce_gradients runs
    gf_tf's Python as written (AutoGraph's status is DISABLED inside it)."""
    import tensorflow as tf
    from tensorflow.python.autograph.core import ag_ctx
    from gf_tf import route
    seen, reduce_packs = [], route.reduce_packs

    def spy(*args, **kwargs):
        seen.append(ag_ctx.control_status_ctx().status)
        return reduce_packs(*args, **kwargs)

    monkeypatch.setattr(route, "reduce_packs", spy)
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0"], cross_device_ops=gf_tf.GradientFlowAllReduce(compression="fp16"))
    with strategy.scope():
        variable = tf.Variable([1.0, 2.0])

    @tf.function
    def step():
        def replica_fn():
            gradient = variable * 3.0
            if tf.reduce_sum(gradient) > 0:   # AutoGraph converts this function
                gradient = gradient + 1.0
            return gf_tf.all_reduce_gradients([gradient], [variable])
        return strategy.run(replica_fn)

    assert step()[0].numpy().tolist() == [4.0, 7.0]
    assert seen and all(status == ag_ctx.Status.DISABLED for status in seen), seen


def test_a_collective_mismatch_is_worded_as_workers_that_run_different_setups():
    import tensorflow as tf
    from gf_tf import agreement, worker
    tf_error = tf.errors.InternalError(None, None, (
        "Graph execution error:\n\nAdditional GRPC error information from remote target "
        "/job:worker/replica:0/task:0 while calling /tensorflow.WorkerService/CompleteInstance:\n"
        "Collective ops is aborted by: Collective instance 100 expected type 1 and data_type 1 but "
        "got type 0 and data_type 1\n"))
    try:
        raise agreement.peer_mismatch_error(tf_error, "the settings handshake") from tf_error
    except agreement.PeerMismatchError as e:
        raised = e
    assert str(raised).startswith(
        "gf_tf: the settings handshake failed: the workers issued different collectives "
        "(InternalError: Collective ops is aborted by: Collective instance 100 expected type 1 and "
        "data_type 1 but got type 0 and data_type 1). Every worker must run "), str(raised)
    assert worker.lost_worker_message(raised) == str(raised).removeprefix("gf_tf: ")
    lost = agreement.peer_mismatch_error(tf.errors.UnavailableError(None, None, "Collective ops is "
                                         "aborted by: task 1 unhealthy"), "the probe")
    assert "failed: a peer worker stopped, or it issued a different collective (Unavailable" in str(lost)


def test_the_startup_wait_says_why_it_is_five_minutes_beside_its_flag():
    code = ("import models.train as t, sys; print(t.FLAGS['startup_timeout'].default, "
            "t.FLAGS['startup_timeout'].help); print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=pathlib.Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("300.0 seconds a worker waits for peers that have not started. 5 "
                                 "minutes because a cluster's workers"), out.stdout
    assert "lower it where workers start together" in out.stdout
    assert out.stdout.splitlines()[-1] == "False"   # the flags are read before TensorFlow loads
