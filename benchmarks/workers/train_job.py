"""One worker of a benchmarks.convergence run on the emulated network.

    python -m benchmarks.workers.train_job MODEL_DIR GF_TF_RUN -- python -m models.train ...

Runs `GF_TF_RUN -- <command>` (gf-tf-run starting the task its inherited TF_CONFIG
names), then prints `RESULT {"returncode": 0, "results_json": bool}`, the line
benchmarks.harness.run_job waits for; results_json says whether the
chief's MODEL_DIR/results.json exists. Exits with the job's exit code.
"""

import os
import subprocess
import sys

from benchmarks import harness


def main(argv) -> int:
    model_dir, launcher, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: python -m benchmarks.workers.train_job MODEL_DIR GF_TF_RUN -- COMMAND...")
    code = subprocess.call([launcher, "--", *command])
    if code == 0:
        harness.write_result({"returncode": code, "results_json": os.path.exists(
            os.path.join(model_dir, "results.json"))})
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
