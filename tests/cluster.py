"""Runs a Python worker script on N local worker processes forming one TF cluster.

Each worker gets:
  TF_CONFIG            from gf_tf.launch.local_cluster / tf_config (127.0.0.1, free ports)
  GF_TF_RESULT         a path where it may write its result (np.savez: a dict of arrays)
  GF_TF_COMM_TIMEOUT   seconds for CommunicationOptions(timeout_seconds=...)
  PYTHONPATH           the repository root (so `import gf_tf` works from a checkout)
The whole run has a hard timeout: when it expires every worker's process group is
killed and the result says so. Outputs (stdout+stderr) are collected per worker.

Worker scripts live in tests/workers/ and can `import worker_util` for the
worker-side half (strategy options, writing the result).
"""

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from gf_tf import launch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS_DIR = os.path.join(REPO_ROOT, "tests", "workers")


@dataclasses.dataclass
class WorkerResult:
    index: int
    returncode: Optional[int]   # None if it was killed at the hard timeout
    output: str                 # stdout and stderr, interleaved
    result: Optional[Dict[str, np.ndarray]]  # what it wrote to GF_TF_RESULT, if anything
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_workers(script: str, num_workers: int = 2, args: Sequence[str] = (),
                timeout: float = 120.0, comm_timeout: float = 30.0,
                env: Optional[Dict[str, str]] = None,
                per_worker_args: Optional[Sequence[Sequence[str]]] = None,
                with_tf_config: bool = True) -> List[WorkerResult]:
    """Starts `script` (a path, or a file name in tests/workers/) on `num_workers` workers.

    Args:
      args: command-line arguments for every worker.
      per_worker_args: optional extra arguments per worker (e.g. a mismatched setting).
      timeout: hard wall-clock limit in seconds for the whole run.
      comm_timeout: passed as GF_TF_COMM_TIMEOUT (CommunicationOptions timeout_seconds).
      env: extra environment variables.
      with_tf_config: False starts plain processes without TF_CONFIG (see run_process).

    Returns:
      One WorkerResult per worker, by index.
    """
    path = script if os.path.isabs(script) else os.path.join(WORKERS_DIR, script)
    cluster = launch.local_cluster(num_workers)
    workdir = tempfile.mkdtemp(prefix="gf_tf_cluster_")
    procs, logs, results = [], [], []
    start = time.monotonic()
    try:
        for i in range(num_workers):
            worker_env = dict(os.environ)
            worker_env.update({
                "GF_TF_RESULT": os.path.join(workdir, f"worker{i}.npz"),
                "GF_TF_COMM_TIMEOUT": str(comm_timeout),
                "PYTHONPATH": REPO_ROOT + os.pathsep + worker_env.get("PYTHONPATH", ""),
                "TF_CPP_MIN_LOG_LEVEL": worker_env.get("TF_CPP_MIN_LOG_LEVEL", "2"),
                "CUDA_VISIBLE_DEVICES": "",
            })
            if with_tf_config:
                worker_env["TF_CONFIG"] = launch.tf_config(cluster, i)
            else:
                worker_env.pop("TF_CONFIG", None)
            worker_env.update(env or {})
            extra = list(per_worker_args[i]) if per_worker_args else []
            log = open(os.path.join(workdir, f"worker{i}.log"), "w+b")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, path, *args, *extra], env=worker_env,
                                          stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = start + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
    seconds = time.monotonic() - start
    for i, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        output = log.read().decode(errors="replace")
        log.close()
        result_path = os.path.join(workdir, f"worker{i}.npz")
        result = None
        if os.path.exists(result_path):
            with np.load(result_path, allow_pickle=False) as data:
                result = {k: data[k] for k in data.files}
        killed = p.returncode is not None and p.returncode < 0 and seconds >= timeout
        results.append(WorkerResult(index=i, returncode=None if killed else p.returncode,
                                    output=output, result=result, seconds=seconds))
    return results


def run_process(script: str, args: Sequence[str] = (), timeout: float = 120.0,
                env: Optional[Dict[str, str]] = None) -> WorkerResult:
    """Runs `script` in one fresh process without TF_CONFIG (e.g. a MirroredStrategy
    test that needs its own logical device layout), with the same hard timeout,
    output capture and GF_TF_RESULT file as run_workers."""
    return run_workers(script, 1, args, timeout=timeout, env=env, with_tf_config=False)[0]


def describe(results: Sequence[WorkerResult], tail: int = 3000) -> str:
    """Exit codes and the tail of each worker's output, for assertion messages."""
    return "\n".join(f"--- worker {r.index}: exit {r.returncode}\n{r.output[-tail:]}"
                     for r in results)
