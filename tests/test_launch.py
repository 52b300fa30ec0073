"""gf_tf.launch: TF_CONFIG validation and the gf-tf-run local multi-worker launcher."""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gf_tf import launch, worker

# slow: most tests start worker processes through gf-tf-run's launcher.
pytestmark = pytest.mark.slow

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(workers=("127.0.0.1:2222", "127.0.0.1:2223"), task_type="worker", index=0, **extra):
    return json.dumps({"cluster": {"worker": list(workers)}, "task": {"type": task_type, "index": index},
                       **extra})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it no longer runs.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _python(code: str):
    return [sys.executable, "-c", textwrap.dedent(code)]


# --- validate_tf_config ------------------------------------------------------------------

def test_valid_config_is_returned_parsed():
    config = launch.validate_tf_config(_config(index=1))
    assert config["task"] == {"type": "worker", "index": 1}
    assert config["cluster"]["worker"] == ["127.0.0.1:2222", "127.0.0.1:2223"]


def test_ipv6_and_hostnames_parse():
    launch.validate_tf_config(_config(workers=("[::1]:2222", "worker-1.example.com:65535"), index=1))


@pytest.mark.parametrize("text, field", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "cluster"),
    (json.dumps({"cluster": {"worker": "127.0.0.1:2222"}, "task": {"type": "worker", "index": 0}}),
     "cluster.worker"),
    (_config(workers=("127.0.0.1:2222", "localhost")), "cluster.worker[1]"),
    (_config(workers=("127.0.0.1:0",)), "cluster.worker[0]"),
    (_config(workers=("127.0.0.1:65536",)), "cluster.worker[0]"),
    (_config(workers=("127.0.0.1:http",)), "cluster.worker[0]"),
    (_config(workers=(":2222",)), "cluster.worker[0]"),
    (_config(workers=("127.0.0.1:2222", "127.0.0.1:2222")), "cluster.worker[1]"),
    (_config(workers=(2222,)), "cluster.worker[0]"),
    (json.dumps({"cluster": {"worker": ["127.0.0.1:2222"]}}), "task"),
    (_config(task_type="ps"), "task.type"),
    (_config(index=2), "task.index"),
    (_config(index=-1), "task.index"),
    (_config(index="0"), "task.index"),
    (_config(index=True), "task.index"),
])
def test_malformed_config_error_names_the_field(text, field):
    with pytest.raises(ValueError) as error:
        launch.validate_tf_config(text)
    assert field in str(error.value)


def test_configs_of_one_job_must_share_the_cluster():
    with pytest.raises(ValueError, match=r"cluster: task 1 has"):
        launch.validate_tf_configs([_config(index=0), _config(workers=("127.0.0.1:2222", "127.0.0.1:9999"),
                                                               index=1)])


def test_configs_of_one_job_need_unique_indices():
    with pytest.raises(ValueError, match=r"task.index: tasks 0 and 1 are both worker 1"):
        launch.validate_tf_configs([_config(index=1), _config(index=1)])


def test_local_cluster_configs_are_a_valid_job():
    cluster = launch.local_cluster(3)
    ports = [int(a.rsplit(":", 1)[1]) for a in cluster["worker"]]
    assert len(set(ports)) == 3
    configs = launch.validate_tf_configs([launch.tf_config(cluster, i) for i in range(3)])
    assert [c["task"]["index"] for c in configs] == [0, 1, 2]


# --- run_workers -------------------------------------------------------------------------

def test_each_worker_gets_its_tf_config_and_a_prefixed_output():
    out = io.BytesIO()
    code = launch.run_workers(2, _python("""
        import os, sys
        print(os.environ["TF_CONFIG"])
        print("to stderr", file=sys.stderr)
    """), out=out)
    assert code == 0
    lines = out.getvalue().decode().splitlines()
    configs = {}
    for line in lines:
        prefix, _, rest = line.partition("] ")
        if rest.startswith("{"):
            configs[prefix + "]"] = json.loads(rest)
    assert sorted(configs) == ["[worker 0]", "[worker 1]"]
    assert [configs[f"[worker {i}]"]["task"]["index"] for i in range(2)] == [0, 1]
    assert configs["[worker 0]"]["cluster"] == configs["[worker 1]"]["cluster"]
    assert launch.validate_tf_configs([json.dumps(c) for c in configs.values()])
    assert sorted(l for l in lines if "to stderr" in l) == ["[worker 0] to stderr", "[worker 1] to stderr"]


def test_a_failing_worker_stops_the_others_and_sets_the_exit_code(tmp_path):
    # Worker 0 starts a grandchild and waits; worker 1 exits 3 once both are up. That the launcher
    # returned while worker 0 and its grandchild would still sleep for 10 minutes shows it stopped them
    # (no time is asserted: load only slows the stop).
    out = io.BytesIO()
    code = launch.run_workers(2, _python(f"""
        import json, os, subprocess, sys, time
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        if index == 0:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            open(r"{tmp_path}/pids.tmp", "w").write(f"{{os.getpid()}} {{child.pid}}")
            os.rename(r"{tmp_path}/pids.tmp", r"{tmp_path}/pids")
            time.sleep(600)
        while not os.path.exists(r"{tmp_path}/pids"):
            time.sleep(0.05)
        sys.exit(3)
    """), out=out)
    assert code == 3
    assert b"worker 1 exited with code 3" in out.getvalue()
    worker0, grandchild = map(int, (tmp_path / "pids").read_text().split())
    assert _wait_for(lambda: not _alive(worker0) and not _alive(grandchild), timeout=30)


def test_a_worker_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "GRACE_SECONDS", 1.0)
    code = launch.run_workers(2, _python(f"""
        import json, os, signal, sys, time
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        if index == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            open(r"{tmp_path}/pid.tmp", "w").write(str(os.getpid()))
            os.rename(r"{tmp_path}/pid.tmp", r"{tmp_path}/pid")
            time.sleep(120)
        while not os.path.exists(r"{tmp_path}/pid"):   # worker 0 ignores SIGTERM by now
            time.sleep(0.05)
        sys.exit(1)
    """), out=io.BytesIO())
    assert code == 1
    assert _wait_for(lambda: not _alive(int((tmp_path / "pid").read_text())), timeout=30)
    assert "worker 0 still running 1 s after the signal: killing it" in capsys.readouterr().err


def test_no_command_is_an_error():
    with pytest.raises(ValueError, match="no command"):
        launch.run_workers(2, [])


# --- the command line --------------------------------------------------------------------

def _cli(args, env=None, **kwargs):
    full_env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    full_env.update({"PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})
    return subprocess.Popen([sys.executable, "-m", "gf_tf.launch", *args], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def test_ctrl_c_is_forwarded_to_every_worker_and_the_launcher_exits(tmp_path):
    launcher = _cli(["-n", "2", "--", *_python(f"""
        import json, os, signal, sys, time
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        def on_sigint(*_):
            print(f"worker {{index}} got SIGINT", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGINT, on_sigint)
        open(r"{tmp_path}/pid%d" % index, "w").write(str(os.getpid()))
        time.sleep(120)
    """)])
    try:
        assert _wait_for(lambda: all((tmp_path / f"pid{i}").exists() for i in range(2)), timeout=30)
        time.sleep(0.2)  # let the pid files be written completely
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGINT, err.decode()
    text = out.decode()
    assert "[worker 0] worker 0 got SIGINT" in text and "[worker 1] worker 1 got SIGINT" in text
    for i in range(2):
        assert not _alive(int((tmp_path / f"pid{i}").read_text()))


def test_malformed_tf_config_in_the_environment_fails_naming_the_field():
    bad = json.dumps({"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:99999"]},
                      "task": {"type": "worker", "index": 0}})
    launcher = _cli(["--", sys.executable, "-c", "print('must not run')"], env={"TF_CONFIG": bad})
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 2
    assert b"must not run" not in out
    assert b"cluster.worker[1]" in err and b"99999" in err


def test_workers_and_index_run_one_task_of_a_multi_host_job(capfd):
    ports = launch.free_ports(2)
    workers = [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"]
    code = launch.main(["--workers", ",".join(workers), "--index", "1", "--",
                        *_python("import os; print(os.environ['TF_CONFIG'])")])
    assert code == 0
    prefix, _, text = capfd.readouterr().out.strip().partition("] ")
    assert prefix == "[worker 1"
    assert json.loads(text) == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": 1}}


def test_workers_with_a_bad_address_fail_naming_it(capsys):
    code = launch.main(["--workers", "10.0.0.1:2222,10.0.0.2", "--index", "0", "--", "true"])
    assert code == 2
    assert "cluster.worker[1]" in capsys.readouterr().err


def test_a_command_that_cannot_start_is_reported(capsys):
    code = launch.main(["-n", "2", "--", "/nonexistent/gf-tf-train"])
    assert code == 127
    assert "cannot run '/nonexistent/gf-tf-train': No such file or directory" in capsys.readouterr().err


# --- the private network and --host_network ----------------------------------------------

def test_host_network_warns_that_the_worker_ports_are_reachable(capsys):
    code = launch.main(["-n", "2", "--host_network", "--", *_python("pass")])
    assert code == 0
    err = capsys.readouterr().err
    assert ("gf-tf-run: warning: --host_network: the workers' TensorFlow ports are reachable from this "
            "machine's networks (they listen on all interfaces, with no authentication)") in err, err
    assert launch.main(["-n", "2", "--", *_python("pass")]) == 0   # from Python: no namespace, no flag, no warning
    assert "warning" not in capsys.readouterr().err


_NO_DNS = "import socket; socket.getaddrinfo('storage.googleapis.com', 443)"


@pytest.mark.skipif(launch.private_network_command() is None,
                    reason="needs a private network namespace (root or unprivileged user namespaces)")
def test_a_worker_that_cannot_reach_the_network_in_the_private_namespace_is_told_host_network():
    launcher = _cli(["-n", "1", "--", *_python(_NO_DNS)])
    out, err = launcher.communicate(timeout=120)
    text = out.decode()
    assert launcher.returncode == 1, text + err.decode()
    assert "socket.gaierror: [Errno -3] Temporary failure in name resolution" in text, text
    assert text.rstrip().splitlines()[-1] == (
        "[gf-tf-run] worker 0 could not reach the network ([Errno -3] Temporary failure in name resolution): "
        "gf-tf-run -n runs the workers in a private network namespace with only loopback, so they cannot "
        "reach the network: run jobs that need it (downloads) with gf-tf-run -n N --host_network -- ..."), text


def test_the_host_network_hint_needs_the_private_network_and_is_given_once():
    fails = _python("""
        import sys
        print("socket.gaierror: [Errno -3] Temporary failure in name resolution")
        print(sys.argv[1:] and "... add --host_network ..." or "", flush=True)
        sys.exit(1)
    """)
    for env, argv, hint in (({}, fails, False), ({worker.PRIVATE_NETWORK_ENV: "1"}, fails, True),
                            ({worker.PRIVATE_NETWORK_ENV: "1"}, fails + ["hinted"], False)):
        out = io.BytesIO()
        full_env = {k: v for k, v in os.environ.items() if k != worker.PRIVATE_NETWORK_ENV}
        assert launch.run_workers(1, argv, env={**full_env, **env}, out=out) == 1
        assert ("[gf-tf-run] worker 0 could not reach the network" in out.getvalue().decode()) == hint, env
