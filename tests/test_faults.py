"""Faults a real job meets: lost and missing workers, Ctrl-C and SIGTERM, TF's start-up noise.

Real `python -m models.train` workers on 127.0.0.1 with TF_CONFIG, without gf-tf-run where the
survivors' own behaviour is tested. Exit codes and messages are asserted, never times: waits are
bounded generously only so that a regression fails instead of hanging.
"""

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from gf_tf import launch, watchdog, worker
import cluster

# slow: real `python -m models.train` workers, killed, missing or interrupted.
pytestmark = pytest.mark.slow

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAIT = 240   # seconds: generous bound on any one wait, only to avoid hanging


def _env(tf_config=None):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update({"PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    return env


def _train(tf_config, log_path, *flags):
    """One models.train worker (small, long job) with its output in `log_path`."""
    log = open(log_path, "w+b")
    return subprocess.Popen([sys.executable, "-m", "models.train", "--epochs", "200", "--warmup_steps", "2",
                             *flags], cwd=REPO_ROOT, env=_env(tf_config), stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _read(path):
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


def _wait_until(predicate, what):
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def _finish(proc):
    try:
        return proc.wait(timeout=WAIT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _listening(address):
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, int(port))) == 0


# --- lost workers (no gf-tf-run) ------------------------------------------------------------

@pytest.mark.parametrize("victim", [1, 0])
def test_a_worker_killed_mid_fit_makes_the_survivor_exit_1_naming_it(tmp_path, victim):
    cluster = launch.local_cluster(2)
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    procs = [_train(launch.tf_config(cluster, i), logs[i]) for i in range(2)]
    survivor = 1 - victim
    try:
        _wait_until(lambda: "Epoch 2/" in _read(logs[0]), "worker 0 to reach epoch 2")
        os.killpg(procs[victim].pid, signal.SIGKILL)
        code = _finish(procs[survivor])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = _read(logs[survivor])
    assert code == 1, text[-3000:]
    assert f"models.train: error: lost worker {victim}: it stopped or became unreachable" in text, text[-3000:]
    assert "Traceback" not in text


@pytest.mark.parametrize("absent", [1, 0])
def test_a_worker_that_never_starts_makes_the_other_stop_naming_it(tmp_path, absent):
    # TensorFlow's wait cannot be interrupted from inside the process: gf_tf's watchdog process
    # prints the line and kills it.
    cluster = launch.local_cluster(2)
    present = 1 - absent
    log = tmp_path / f"worker{present}.log"
    proc = _train(launch.tf_config(cluster, present), log, "--startup_timeout", "15")
    code = _finish(proc)
    text = _read(log)
    assert code == -signal.SIGKILL, text[-3000:]
    assert (f"gf_tf: error: worker {present}: the cluster did not form within 15 s (peer_startup_timeout); "
            f"not started: worker {absent} ({cluster['worker'][absent]})") in text, text[-3000:]
    assert "Traceback" not in text
    # Before that (after 10 s) it said whom it waits for, and until when (TF's own line is hidden INFO).
    assert re.search(rf"^gf_tf: worker {present}: waiting for peers to start: worker {absent} "
                     rf"\({re.escape(cluster['worker'][absent])}\); \d+ s so far, gives up at \d\d:\d\d:\d\d "
                     rf"\(peer_startup_timeout 15 s\)$", text, re.M), text[-3000:]


def _watched_sleeper(seconds, peers):
    """A process that sleeps under a deadline watchdog with quick notices; its stderr is piped."""
    code = ("import time; from gf_tf import watchdog; "
            f"watchdog.start('deadline', 'worker 0', {seconds!r}, {peers!r}, notices=(0.5, 1.0)); time.sleep(600)")
    return subprocess.Popen([sys.executable, "-c", code], env=_env(), stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def test_the_startup_watchdog_says_whom_it_waits_for_then_stops_the_worker_at_the_deadline():
    address = f"127.0.0.1:{launch.free_ports(1)[0]}"
    proc = _watched_sleeper(3.0, [("worker 1", address)])
    _, err = proc.communicate(timeout=WAIT)
    lines = err.decode().splitlines()
    assert proc.returncode == -signal.SIGKILL, lines
    assert lines[-1].startswith(f"gf_tf: error: worker 0: the cluster did not form within 3 s "
                                f"(peer_startup_timeout); not started: worker 1 ({address})"), lines
    waiting = lines[:-1]
    assert waiting and all(re.fullmatch(rf"gf_tf: worker 0: waiting for peers to start: worker 1 "
                                        rf"\({re.escape(address)}\); \d+ s so far, gives up at "
                                        rf"\d\d:\d\d:\d\d \(peer_startup_timeout 3 s\)", l)
                           for l in waiting), lines


def test_without_a_startup_deadline_the_watchdog_still_says_whom_it_waits_for_again_and_again():
    address = f"127.0.0.1:{launch.free_ports(1)[0]}"
    proc = _watched_sleeper(None, [("worker 1", address)])
    bound = threading.Timer(WAIT, os.killpg, (proc.pid, signal.SIGKILL))   # a missing line fails, not hangs
    bound.start()
    try:
        lines = [proc.stderr.readline().decode().rstrip("\n") for _ in range(2)]
    finally:
        bound.cancel()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for line in lines:
        assert re.fullmatch(rf"gf_tf: worker 0: waiting for peers to start: worker 1 \({re.escape(address)}\); "
                            rf"\d+ s so far, no time limit \(peer_startup_timeout None\)", line), lines


# --- interrupts -----------------------------------------------------------------------------

def test_a_worker_waiting_for_a_missing_peer_stops_on_sigterm_with_one_line(tmp_path):
    cluster = launch.local_cluster(2)
    log = tmp_path / "worker0.log"
    proc = _train(launch.tf_config(cluster, 0), log)   # worker 1 never comes
    try:
        _wait_until(lambda: _listening(cluster["worker"][0]), "worker 0's server to listen")
        time.sleep(1.0)   # it is now inside TensorFlow, waiting for worker 1
        os.killpg(proc.pid, signal.SIGTERM)
        code = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = _read(log)
    assert code in (128 + signal.SIGTERM, -signal.SIGKILL), text[-3000:]   # by itself, or by its watchdog
    assert text.count("models.train: interrupted by SIGTERM: stopping") == 1, text[-3000:]
    assert "Traceback" not in text


def test_ctrl_c_under_gf_tf_run_gives_one_line_per_worker_exit_130_and_no_tf_startup_lines():
    launcher = subprocess.Popen([sys.executable, "-m", "gf_tf.launch", "-n", "2", "--", sys.executable, "-m",
                                 "models.train", "--epochs", "200"], cwd=REPO_ROOT, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    try:
        for line in iter(launcher.stdout.readline, b""):
            lines.append(line.decode(errors="replace").rstrip("\n"))
            if lines[-1].startswith("[worker 0] Epoch 2/"):
                break
        launcher.send_signal(signal.SIGINT)
        rest, _ = launcher.communicate(timeout=WAIT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    lines += rest.decode(errors="replace").splitlines()
    text = "\n".join(lines)
    assert launcher.returncode == 130, text[-3000:]
    assert "[gf-tf-run] got SIGINT: stopping all tasks" in lines
    for i in range(2):   # one line per worker
        assert lines.count(f"[worker {i}] models.train: interrupted by SIGINT: stopping") == 1, text[-3000:]
    assert "Traceback" not in text
    assert not [l for l in lines if re.match(r"\[worker \d\] (I0000|WARNING: All log messages before absl)", l)]
    assert not [l for l in lines if "oneDNN" in l or "cpu_feature_guard" in l]


# --- messages --------------------------------------------------------------------------------

def test_tf_startup_lines_are_recognised_and_real_errors_kept():
    hidden = [
        b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
        b"I0000 00:00:1796094223.021771    9264 port.cc:153] oneDNN custom operations are on. You may see\n",
        b"I0000 00:00:1796094247.649569   12554 coordination_service.cc:221] Initializing CoordinationService\n",
        b"To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow "
        b"with the appropriate compiler flags.\n",
        b"E0000 00:00:1764556800.123456    4242 mkl_util.h:123] oneDNN supports DT_HALF only on platforms "
        b"with AVX-512. Falling back to the default Eigen-based implementation if present.\n",
    ]
    kept = [
        b"E0000 00:00:1796094385.676810   23341 base_collective_executor.cc:252] BaseCollectiveExecutor::"
        b"StartAbort UNAVAILABLE: recvmsg:Connection reset by peer\n",
        b"W0000 00:00:1796094258.655193   12988 preemption_notifier.cc:90] SIGTERM caught\n",
        b"Epoch 1/10\n", b"test accuracy: 0.9583 (360 test images)\n",
    ]
    assert all(launch.is_tf_startup_line(l) for l in hidden)
    assert not any(launch.is_tf_startup_line(l) for l in kept)


def test_the_launcher_drops_startup_lines_unless_asked_for_them():
    script = ("import sys; print('WARNING: All log messages before absl::InitializeLog() is called are "
              "written to STDERR', file=sys.stderr); print('I0000 00:00:1.5    9 port.cc:153] oneDNN on'); "
              "print('result 42')")
    for tf_log, expect_noise in ((False, False), (True, True)):
        out = io.BytesIO()
        assert launch.run_workers(2, [sys.executable, "-c", script], env=_env(), out=out, tf_log=tf_log) == 0
        text = out.getvalue().decode()
        assert "[worker 0] result 42" in text and "[worker 1] result 42" in text
        assert ("port.cc" in text) == expect_noise and ("absl::InitializeLog" in text) == expect_noise


def test_outside_the_checkout_the_launcher_says_to_run_from_the_repository_root(tmp_path):
    run = subprocess.run([sys.executable, "-m", "gf_tf.launch", "-n", "2", "--", "python", "-m", "models.train"],
                         cwd=tmp_path, env=_env(), capture_output=True, timeout=WAIT)
    assert run.returncode == 2
    err = run.stderr.decode()
    assert "runs from the root of the gf_tf repository" in err and f"cd {REPO_ROOT}" in err, err
    assert launch.missing_module_error(["python", "-m", "models.train"], cwd=REPO_ROOT) is None
    assert launch.missing_module_error(["python", "train.py"], cwd=str(tmp_path)) is None


def test_a_batch_size_the_replicas_do_not_divide_fails_with_the_nearest_valid_values():
    run = subprocess.run([sys.executable, "-m", "models.train", "--strategy", "mirrored", "--num_devices", "3",
                          "--batch_size", "64"], cwd=REPO_ROOT, env=_env(), capture_output=True, timeout=WAIT)
    err = run.stderr.decode()
    assert run.returncode == 2, err[-3000:]
    assert "--batch_size 64 (global) must be divisible by the 3 replicas; nearest valid values: 63, 66" in err
    assert "Traceback" not in err


def test_lost_worker_message_names_peers_other_than_this_task():
    import tensorflow as tf
    error = tf.errors.UnavailableError(None, None, (
        "Graph execution error:\n\nDetected at node x defined at (most recent call last):\n  File \"a.py\"\n"
        "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are "
        "unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:2\n"))
    config = json.dumps({"cluster": {"worker": ["a:1", "b:1", "c:1"]}, "task": {"type": "worker", "index": 1}})
    line = worker.lost_worker_message(error, config)
    assert line.startswith("lost worker 2: it stopped or became unreachable (UnavailableError: Collective ops "
                           "is aborted by"), line
    assert worker.lost_worker_message(ValueError("/job:worker/task:2"), config) is None
    assert "heartbeat_timeout" not in line


@pytest.mark.parametrize("setups", [("plain", "gradient_flow"), ("gradient_flow", "plain")],
                         ids=["gradient_flow_on_worker_1", "gradient_flow_on_worker_0"])
def test_a_peer_without_gradient_flow_is_named_at_the_first_collective(setups):
    """GradientFlow's first collective (the planner's cost probe, while the strategy is created)
    meets the plain worker's initial broadcast: both end within the collective timeout, and the
    GradientFlow worker's error says what differs, whichever side TensorFlow reports it on."""
    results = cluster.run_workers("mixed_setup_worker.py", 2, args=setups, timeout=WAIT,
                                  comm_timeout=30)
    assert all(r.returncode is not None for r in results), cluster.describe(results)
    ours = results[setups.index("gradient_flow")].result
    assert ours is not None, cluster.describe(results)
    assert str(ours["kind"]) == "PeerMismatchError", cluster.describe(results)
    assert str(ours["line"]).startswith("the planner's cost probe (at strategy creation) failed: "), ours
    assert "a worker on plain tf.distribute, with gradient_flow=None, or on another gf_tf version " \
           "cannot join workers that use GradientFlow" in str(ours["line"])
    if setups[1] == "gradient_flow":   # TensorFlow tells the non-leader what differs
        assert "the workers issued different collectives (InternalError: " in str(ours["line"])
        assert "Collective instance 100 expected type 1 and data_type 1 but got type 0" in str(ours["line"])
    plain = results[setups.index("plain")].result
    assert plain is not None and str(plain["kind"]).endswith("Error"), cluster.describe(results)
    if setups[0] == "gradient_flow":
        assert str(plain["line"]).startswith("the workers issued different collectives (InternalError: "
                                             "Collective instance 100 expected type 0 "), plain


def test_a_strategy_created_after_a_tensorflow_op_says_to_create_it_first():
    config = launch.tf_config(launch.local_cluster(2), 1)
    code = ("import tensorflow as tf, gf_tf; tf.constant(1.0) + 1; "
            "gf_tf.MultiWorkerMirroredStrategy(peer_startup_timeout=30)")
    run = subprocess.run([sys.executable, "-c", code], env=_env(config), capture_output=True,
                         text=True, timeout=WAIT)
    assert run.returncode == 1, run.stderr[-3000:]
    assert ("RuntimeError: gf_tf.MultiWorkerMirroredStrategy must be created before this process "
            "runs any TensorFlow op") in run.stderr, run.stderr[-3000:]
    assert "Create the strategy first, before any tensor, dataset or model" in run.stderr


def test_a_late_heartbeat_names_the_setting_that_waits_longer():
    # As seen on AlexNet's initial broadcast at 100 Mbit/s: a live leader's heartbeat RPC timed out.
    import tensorflow as tf
    error = tf.errors.DeadlineExceededError(None, None, (
        "{{function_node __wrapped__CollectiveBcastRecv_device_/job:worker/replica:0/task:1/device:CPU:0}} "
        "Collective ops is aborted by: Deadline Exceeded\n\nRPC: /tensorflow.CoordinationService/Heartbeat"))
    config = json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}})
    line = worker.lost_worker_message(error, config)
    assert line.startswith("lost worker 0: "), line
    assert "heartbeat_timeout=" in line and "--heartbeat_timeout" in line, line


def test_heartbeat_timeout_reaches_the_coordination_service():
    import subprocess
    import sys
    code = ("from gf_tf import cluster, tf_internal; from tensorflow.python.eager import context; "
            "c = cluster.from_tf_config('{\"cluster\": {\"worker\": [\"127.0.0.1:1\", \"127.0.0.1:2\"]}, "
            "\"task\": {\"type\": \"worker\", \"index\": 0}}'); "
            "assert tf_internal.configure_coordination_service(c, 5, 42.5); "
            "config = context.context()._coordination_service_config; "
            "print(config.heartbeat_timeout_in_ms, config.cluster_register_timeout_in_ms)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["42500", "5000"]
    import gf_tf
    with pytest.raises(ValueError, match="heartbeat_timeout must be > 0"):
        gf_tf.MultiWorkerMirroredStrategy(heartbeat_timeout=0)


# --- jit_compile under a multi-device MirroredStrategy ------------------------------------------

def test_jit_compile_with_several_local_replicas_stops_at_once_naming_jit_compile():
    import keras
    import numpy as np
    import tensorflow as tf
    import gf_tf
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=gf_tf.GradientFlowAllReduce(compression="fp16"))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    before = [w.numpy() for w in model.trainable_weights]
    x, y = np.random.rand(16, 4).astype("float32"), np.random.rand(16, 3).astype("float32")
    with pytest.raises(ValueError, match=r"jit_compile=True does not work with 2 local replicas.*"
                                         r"jit_compile=False"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for b, w in zip(before, model.trainable_weights):   # stopped before any step ran
        np.testing.assert_array_equal(b, w.numpy())


# --- private network for local workers ----------------------------------------------------------

IS_ROOT = os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "unshare"))

# A worker as TensorFlow runs it: its gRPC server on the TF_CONFIG port, listening on all interfaces.
_SERVER = """
import json, os, time
import tensorflow as tf
config = json.loads(os.environ["TF_CONFIG"])
server = tf.distribute.Server(tf.train.ClusterSpec(config["cluster"]), job_name="worker", task_index=0)
print("port", config["cluster"]["worker"][0].rsplit(":", 1)[1], flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not IS_ROOT, reason="needs root to build a second network namespace (ip netns, veth); "
                                        "CI runs it as root")
@pytest.mark.parametrize("isolated", [False, True])
def test_a_worker_port_is_reachable_from_another_namespace_only_without_isolation(isolated):
    tag = os.getpid() % 10000
    ns, host_dev, subnet = f"gfpeer{tag}", f"gfh{tag}", f"10.213.{tag % 250}"
    launcher = None
    try:
        for cmd in (["ip", "netns", "add", ns],
                    ["ip", "link", "add", host_dev, "type", "veth", "peer", "name", "vpeer", "netns", ns],
                    ["ip", "addr", "add", f"{subnet}.1/30", "dev", host_dev], ["ip", "link", "set", host_dev, "up"],
                    ["ip", "-n", ns, "addr", "add", f"{subnet}.2/30", "dev", "vpeer"],
                    ["ip", "-n", ns, "link", "set", "vpeer", "up"], ["ip", "-n", ns, "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
        flags = [] if isolated else ["--host_network"]
        launcher = subprocess.Popen([sys.executable, "-m", "gf_tf.launch", "-n", "1", *flags, "--",
                                     sys.executable, "-c", _SERVER], cwd=REPO_ROOT, env=_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = launcher.stdout.readline().decode()
        assert line.startswith("[worker 0] port "), line + launcher.stderr.read1().decode()
        port = int(line.split()[-1])
        probe = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                                f"import socket; s = socket.socket(); s.settimeout(5); "
                                f"raise SystemExit(s.connect_ex(('{subnet}.1', {port})))"],
                               capture_output=True, timeout=WAIT)
        assert (probe.returncode == 0) == (not isolated), (isolated, probe.returncode)
    finally:
        if launcher is not None:
            launcher.send_signal(signal.SIGTERM)
            try:
                _, err = launcher.communicate(timeout=WAIT)
            finally:
                launcher.kill()
            said = "run in a private network namespace (loopback only" in err.decode()
            assert said == isolated, err.decode()
            warned = ("gf-tf-run: warning: --host_network: the workers' TensorFlow ports are reachable from "
                      "this machine's networks") in err.decode()
            assert warned == (not isolated), err.decode()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", host_dev], capture_output=True)


@pytest.mark.skipif(launch.private_network_command() is None,
                    reason="needs a private network namespace (root or unprivileged user namespaces)")
def test_a_dataset_download_under_gf_tf_run_fails_in_one_line_that_names_host_network(tmp_path):
    env = {**_env(), "KERAS_HOME": str(tmp_path)}   # nothing cached: keras.datasets must download
    run = subprocess.run([sys.executable, "-m", "gf_tf.launch", "-n", "1", "--", sys.executable, "-m",
                          "models.train", "--dataset", "mnist", "--epochs", "1"], cwd=REPO_ROOT, env=env,
                         capture_output=True, timeout=WAIT)
    out = run.stdout.decode(errors="replace")
    assert run.returncode == 1, out[-3000:] + run.stderr.decode()
    assert ("[worker 0] models.train: error: could not load mnist through keras.datasets (Exception: URL fetch "
            "failure on ") in out, out[-3000:]
    assert ("[Errno -3] Temporary failure in name resolution). gf-tf-run -n runs the workers in a private "
            "network namespace with only loopback") in out, out[-3000:]
    assert "gf-tf-run -n 2 --host_network -- python -m models.train --dataset mnist ..." in out, out[-3000:]
    assert "[gf-tf-run] worker 0 could not reach the network" not in out   # the worker said it already
    assert "Traceback" not in out


# --- non-finite steps skipped together ------------------------------------------------------------

def test_an_inf_on_replica_1_only_is_skipped_by_every_replica_and_halves_the_loss_scale_once():
    import keras
    import numpy as np
    import tensorflow as tf
    import gf_tf
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=gf_tf.GradientFlowAllReduce(compression="fp16"))
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0 ** 10)
        model.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 4), dtype=np.float32), rng.random((32, 3), dtype=np.float32)
    x[8 + 5, 2] = np.inf   # step 2 (batch 8..15): its second half goes to replica 1
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert all(np.all(np.isfinite(w.numpy())) for w in model.trainable_weights)
    assert float(optimizer.dynamic_scale.numpy()) == 2.0 ** 9   # halved once
    assert int(optimizer.iterations.numpy()) == 3               # 4 steps, one skipped


# --- leaving together ----------------------------------------------------

_HEARTBEAT_LOST = "stopped sending heartbeats"


@pytest.mark.parametrize("barrier", ["no-barrier", "barrier"])
def test_a_worker_that_finishes_late_is_not_told_its_peer_crashed_when_they_exit_together(barrier):
    """Worker 1 is done at once, worker 0 works 16 s longer (past TF's 10 s heartbeat timeout).

    Without the barrier worker 1 exits first and worker 0's coordination service reports it
    crashed (the README ResNet-50 example's `StartAbort UNAVAILABLE` line); with
    `gf_tf.worker.exit_together` both leave at the same moment and nothing is reported.
    """
    results = cluster.run_workers("exit_worker.py", 2, per_worker_args=[[barrier, "16"], [barrier, "0"]],
                                  timeout=120.0)
    assert all(r.returncode == 0 for r in results), cluster.describe(results)
    assert all("all-reduced 2.0" in r.output for r in results), cluster.describe(results)
    left = [float(r.output.split("leaving at ")[1].split()[0]) for r in results]
    if barrier == "barrier":
        assert _HEARTBEAT_LOST not in results[0].output, cluster.describe(results)
        assert "(barrier: True)" in results[1].output and abs(left[0] - left[1]) < 3.0
    else:
        assert left[0] - left[1] > 10.0
        assert _HEARTBEAT_LOST in results[0].output, cluster.describe(results)
