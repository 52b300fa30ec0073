"""README's `model.fit` snippets run as written, in a fresh process of their own;
its sample output is what the first command prints (item 8)."""

import io
import os
import pathlib
import re
import subprocess
import sys

import pytest

from test_docs import with_stand_ins

# slow: every test runs README's commands in fresh processes (TensorFlow, model.fit, workers).
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parent.parent


def _usage_blocks():
    text = (REPO / "README.md").read_text()
    section = text.split("## Usage in `model.fit`", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


# What the snippet's run shows; the model and data it leaves to the reader are test_docs' stand-ins.
_REPORT = '''
print("replicas:", strategy.num_replicas_in_sync)
print("logged:", sorted(k for k in model.history.history if k.startswith("gf_")))
print("dense bytes per step:", model.history.history.get("gf_dense_bytes_per_step"))
'''


def _run(block, cpu_setup=""):
    code = cpu_setup + "\n" + with_stand_ins(block.replace("epochs=10", "epochs=1")) + _REPORT
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3"),
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_mirrored_strategy_snippet_gives_one_replica_on_a_cpu_and_two_with_the_logical_devices():
    fit, cpu = _usage_blocks()[:2]
    strategy_line = next(line for line in fit.splitlines() if "MirroredStrategy(cross_device_ops=gradient_flow)" in line)
    with_devices = next(line for line in cpu.splitlines() if 'MirroredStrategy(["/cpu:0", "/cpu:1"]' in line)
    setup = "\n".join(line for line in cpu.splitlines() if line.startswith(("cpu = ", "tf.config.")))
    assert "set_logical_device_configuration" in setup
    one = _run(fit)
    assert "replicas: 1" in one, one
    two = _run(fit.replace(strategy_line, with_devices), cpu_setup="import tensorflow as tf\n" + setup)
    assert "replicas: 2" in two, two
    # GradientFlowStats read the all-reduce's counters: 4 bytes x (8*16 + 16 + 16*3 + 3) float32 gradients.
    assert "dense bytes per step: [780.0]" in two, two


def _sample_output():
    """The lines README shows for its first command, by the worker prefix."""
    text = (REPO / "README.md").read_text()
    after = text.split("The first command ends with these lines", 1)[1]
    return re.search(r"```\n(.*?)```", after, flags=re.S).group(1).strip().splitlines()


def test_the_sample_output_is_what_the_first_command_prints():
    """README's sample lines of `gf-tf-run -n 2 -- python -m models.train`: the byte line (seed 0)
    exactly, or with fewer bytes sent (density="auto" sends dense on loopback, where compressing
    saves little, but a step slowed by the machine's load may price a sparse rung), the accuracy
    to within 0.01 (3 of 360 images: its last digits follow the CPU's oneDNN kernels), the
    throughput line's form (it depends on the machine's load)."""
    from gf_tf import launch  # pylint: disable=import-outside-toplevel
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    out = io.BytesIO()
    code = launch.run_workers(2, [sys.executable, "-m", "models.train"], env=env, out=out)
    printed = out.getvalue().decode()
    assert code == 0, printed[-3000:]
    accuracy, throughput, sent = _sample_output()
    form = r"\[worker 0\] test accuracy: ([01]\.\d{4}) \(360 test images\)"
    expected = float(re.fullmatch(form, accuracy).group(1))
    printed_accuracy = float(re.search(f"^{form}$", printed, flags=re.M).group(1))
    assert abs(printed_accuracy - expected) <= 0.01, printed
    byte_line = (r"\[worker 0\] bytes sent per step per replica: ([\d,]+) \(mean of all steps, warm-up "
                 r"included; last epoch [\d,]+\) vs 2,178,472 for float32 dense all-reduce: [\d.]+x fewer, "
                 r"[\d.]+% saved \(gf_tf CommStats\)")
    readme_sent = re.fullmatch(byte_line, sent)
    assert readme_sent, sent
    printed_sent = re.search(f"^{byte_line}$", printed, flags=re.M)
    assert printed_sent, printed[-3000:]
    assert sent in printed.splitlines() or (
        int(printed_sent.group(1).replace(",", "")) < int(readme_sent.group(1).replace(",", ""))), printed_sent
    form = re.escape(throughput).replace(re.escape(re.search(r"[\d.]+ images/s", throughput).group(0)),
                                         r"[\d.]+ images/s")
    assert re.fullmatch(form, throughput) and re.search(f"^{form}$", printed, flags=re.M), printed
