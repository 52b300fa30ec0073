"""Local multi-worker launcher (`gf-tf-run`): starts the workers, each with its TF_CONFIG.

TF_CONFIG's format and checks are `gf_tf.cluster`'s (re-exported here:
`tf_config`, `validate_tf_config`, `validate_tf_configs`); what runs inside a
worker (signals, lost-peer messages) is `gf_tf.worker`'s.

Usage:
  gf-tf-run -n 2 -- python -m models.train           # 2 workers on this machine
  gf-tf-run --workers h1:2222,h2:2222 --index 0 -- python -m models.train
                                                     # task 0 of a 2-host cluster
  TF_CONFIG='{...}' gf-tf-run -- python -m models.train
                                                     # the task TF_CONFIG names

Security: TensorFlow's worker gRPC servers listen on all interfaces and have
no authentication, even when TF_CONFIG names 127.0.0.1. `-n N` therefore runs
the workers in a private network namespace with only loopback where the OS
allows it (--host_network turns that off); otherwise keep the ports on a
trusted network (firewalled from everything else) while a job runs.
"""

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from gf_tf.cluster import tf_config, validate_tf_config, validate_tf_configs  # noqa: F401 (re-exported)
from gf_tf.worker import HOST_NETWORK_HINT, PRIVATE_NETWORK_ENV, in_private_network

# Seconds a worker gets to exit after SIGINT/SIGTERM before it is killed.
GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.05


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """Returns `n` distinct TCP ports that were free on `host` a moment ago."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def local_cluster(num_workers: int, host: str = "127.0.0.1") -> Dict[str, List[str]]:
    """A cluster spec of `num_workers` workers on free ports of `host`."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    return {"worker": [f"{host}:{port}" for port in free_ports(num_workers, host)]}


# TensorFlow's C++ start-up lines, printed by absl before absl::InitializeLog() and so
# regardless of TF_CPP_MIN_LOG_LEVEL (TF 2.21 prints them): its banner, INFO lines, the CPU
# feature note and its continuation, and the oneDNN DT_HALF note, which is not an error.
_STARTUP_LINES = (
    re.compile(rb"^WARNING: All log messages before absl::InitializeLog\(\) is called"),
    re.compile(rb"^I\d{4} [\d:.]+ +\d+ [\w./-]+:\d+\] "),                 # every INFO line
    re.compile(rb"^To enable the following instructions: .* rebuild TensorFlow"),
    re.compile(rb"^[WE]\d{4} .*\] oneDNN supports DT_\w+ only on platforms with"),
)


def is_tf_startup_line(line: bytes) -> bool:
    """True for TensorFlow's C++ start-up and INFO lines that `gf-tf-run` hides by default.

    They are printed by absl before TensorFlow initialises its logging, so
    TF_CPP_MIN_LOG_LEVEL does not silence them (TF 2.21). Real C++ warnings
    and errors (`W`/`E` lines other than the oneDNN DT_HALF note) are kept.
    """
    return any(p.match(line) for p in _STARTUP_LINES)


def missing_module_error(command: Sequence[str], cwd: Optional[str] = None) -> Optional[str]:
    """An error line if `command` is `python -m models...` and `models` cannot be imported from `cwd`.

    `models` (the reference models) runs from a checkout of gf_tf and is not
    installed; from any other directory Python would only say
    "No module named 'models'". The line names the checkout when gf_tf is an
    editable install of one. None when the command is anything else.
    """
    command = list(command)
    if "-m" not in command[:-1] or not os.path.basename(command[0]).startswith("python"):
        return None
    module = command[command.index("-m") + 1]
    if module.split(".")[0] != "models":
        return None
    cwd = cwd or os.getcwd()
    if os.path.isfile(os.path.join(cwd, "models", "train.py")):
        return None
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    where = (f"cd {checkout}" if os.path.isfile(os.path.join(checkout, "models", "train.py"))
             else "cd to your gf_tf checkout")
    return (f"`python -m {module}` runs from the root of the gf_tf repository (its models/ package is "
            f"not installed), and {cwd} is not one: {where} and run the command again")


# What a program prints when it cannot reach the network (DNS lookup, connect), e.g. in gf-tf-run's
# private network namespace: "[Errno -3] Temporary failure in name resolution".
_NO_NETWORK = re.compile(rb"\[Errno -?\d+\] (Temporary failure in name resolution|Name or service not known"
                         rb"|Network is unreachable)")


def _say(out, lock, line: str) -> None:
    """Writes one `[gf-tf-run]` line into the workers' output stream."""
    with lock:
        out.write(f"[gf-tf-run] {line}\n".encode())
        out.flush()


def _network_hint(workers, failed) -> Optional[str]:
    """The --host_network hint for a failed worker of gf-tf-run's private network that could not reach
    the network (unless a worker's output already gave it)."""
    if failed.network_error is None or any(w.hinted for w in workers):
        return None
    return f"{failed.label} could not reach the network ({failed.network_error}): {HOST_NETWORK_HINT}"


class _Worker:
    """One child process in its own process group, its output prefixed line by line."""

    def __init__(self, label: str, argv: Sequence[str], env: Dict[str, str], out, lock,
                 hide_tf_startup: bool = False):
        # start_new_session (setsid) keeps terminal Ctrl-C away from the child (the launcher
        # forwards it) and lets the launcher signal the worker with anything it started.
        self.label = label
        self.hide_tf_startup = hide_tf_startup
        self.network_error = None   # the first "no network" error in its output, e.g. a failed DNS lookup
        self.hinted = False         # its output already says --host_network
        self.proc = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        self._thread = threading.Thread(target=self._copy_output, args=(out, lock), daemon=True)
        self._thread.start()

    def _copy_output(self, out, lock):
        prefix = f"[{self.label}] ".encode()
        for line in iter(self.proc.stdout.readline, b""):
            if self.hide_tf_startup and is_tf_startup_line(line):
                continue
            found = _NO_NETWORK.search(line)
            self.network_error = self.network_error or (found and found.group().decode())
            self.hinted = self.hinted or b"--host_network" in line
            with lock:
                out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                out.flush()

    def signal_group(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def finish_output(self) -> None:
        self._thread.join(timeout=2.0)


def _stop(workers: List[_Worker], first_signal) -> None:
    """Sends `first_signal` to every live worker group, then SIGKILL after GRACE_SECONDS."""
    for w in workers:
        if w.proc.poll() is None:
            w.signal_group(first_signal)
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline and any(w.proc.poll() is None for w in workers):
        time.sleep(_POLL_SECONDS)
    for w in workers:
        if w.proc.poll() is None:
            # e.g. TensorFlow waiting for a missing peer ignores SIGTERM and SIGINT.
            print(f"[gf-tf-run] {w.label} still running {GRACE_SECONDS:g} s after the signal: "
                  f"killing it", file=sys.stderr, flush=True)
        # Also reaps grandchildren left in the group by a worker that exited.
        w.signal_group(signal.SIGKILL)
        w.proc.wait()


def run_tasks(tf_configs: Sequence[str], argv: Sequence[str], env: Optional[Dict[str, str]] = None,
              out=None, tf_log: bool = False) -> int:
    """Runs `argv` once per TF_CONFIG string, in parallel, until all exit.

    If one task fails, the others are stopped (SIGTERM, then SIGKILL after
    GRACE_SECONDS). SIGINT/SIGTERM to this process are forwarded to every task.
    Must run in the main thread (it installs signal handlers).

    Args:
      tf_configs: one TF_CONFIG JSON string per task (checked with
        `validate_tf_configs`).
      argv: the command each task runs.
      env: the tasks' environment (default: this process's), plus TF_CONFIG.
      out (BinaryIO | None): binary stream the tasks' output lines go to, each prefixed with its
        task (default: this process's stdout).
      tf_log: keep TensorFlow's start-up lines (`is_tf_startup_line`); by default
        they are dropped and TF_CPP_MIN_LOG_LEVEL is 2 unless `env` sets it.

    Returns:
      0 if every task exits 0; else the exit code of the first task that failed
      (1 if it was killed by a signal), or 130 (SIGINT) / 143 (SIGTERM) when this
      process got that signal.

    Raises:
      ValueError: no command, or TF_CONFIGs that are malformed or disagree.
    """
    if not argv:
        raise ValueError("no command given: use gf-tf-run -n N -- python -m models.train ...")
    configs = validate_tf_configs(tf_configs)
    out = out if out is not None else sys.stdout.buffer
    base_env = dict(os.environ if env is None else env)
    # TensorFlow's C++ INFO/WARNING lines (oneDNN banners, coordination service) bury the
    # workers' output; a TF_CPP_MIN_LOG_LEVEL the user set is kept. The lines absl prints
    # before its logging is initialised ignore that level, so they are filtered here.
    hide_tf_startup = not tf_log
    if hide_tf_startup:
        base_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    lock = threading.Lock()
    received = []
    handlers = {sig: signal.signal(sig, lambda s, _frame: received.append(s))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    workers: List[_Worker] = []
    try:
        for text, config in zip(tf_configs, configs):
            task = config["task"]
            workers.append(_Worker(f"{task['type']} {task['index']}", argv,
                                   {**base_env, "TF_CONFIG": text}, out, lock, hide_tf_startup))
        while True:
            if received:
                _say(out, lock, f"got {signal.Signals(received[0]).name}: stopping all tasks")
                _stop(workers, received[0])
                return 128 + received[0]
            codes = [w.proc.poll() for w in workers]
            failed = [(w, c) for w, c in zip(workers, codes) if c not in (None, 0)]
            if failed:
                w, code = failed[0]
                _say(out, lock, f"{w.label} exited with code {code}: stopping the other tasks")
                _stop(workers, signal.SIGTERM)
                w.finish_output()   # its last lines say why it failed
                hint = _network_hint(workers, w) if in_private_network(base_env) else None
                if hint:
                    _say(out, lock, hint)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                _stop(workers, signal.SIGTERM)  # reaps leftover grandchildren only
                return 0
            time.sleep(_POLL_SECONDS)
    finally:
        if workers and any(w.proc.poll() is None for w in workers):
            _stop(workers, signal.SIGTERM)
        for w in workers:
            w.finish_output()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def run_workers(num_workers: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
                host: str = "127.0.0.1", out=None, tf_log: bool = False) -> int:
    """Runs `argv` as `num_workers` local workers of one TF cluster; returns the exit code.

    Each worker gets TF_CONFIG for task worker:i of a cluster on free ports of
    `host`. Exit code and signal handling as in `run_tasks`.
    """
    cluster = local_cluster(num_workers, host)
    return run_tasks([tf_config(cluster, i) for i in range(num_workers)], argv, env, out, tf_log)


def private_network_command() -> Optional[List[str]]:
    """The `unshare` prefix that gives a new network namespace here, or None if the OS refuses.

    Root: `unshare --net`; others: `unshare --user --map-root-user --net`
    (unprivileged user namespaces). Probed once by running `true` under it
    and bringing up loopback with `ip`.
    """
    if not (shutil.which("unshare") and shutil.which("ip")):
        return None
    prefix = ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--net"]
    probe = subprocess.run([*prefix, "ip", "link", "set", "lo", "up"], capture_output=True)
    return prefix if probe.returncode == 0 else None


def _enter_private_network(argv: Sequence[str]) -> None:
    """Re-executes this launcher in a new network namespace with only loopback, or says why not.

    The namespace has no route to anything outside it: the workers' ports
    (TF's gRPC servers listen on all interfaces) cannot be reached from other
    hosts or other namespaces. It disappears with the last of its processes,
    on every exit path. Returns only when isolation is not possible.
    """
    prefix = private_network_command()
    if prefix is None:
        print("gf-tf-run: cannot create a private network namespace here (needs root or unprivileged user "
              "namespaces, and `unshare`/`ip`): the workers' ports are open on this host's networks",
              file=sys.stderr, flush=True)
        return
    os.environ[PRIVATE_NETWORK_ENV] = "1"   # tells the re-started launcher, and its workers
    script = "ip link set lo up && exec \"$0\" \"$@\""
    os.execvp(prefix[0], [*prefix, "sh", "-c", script, sys.executable, "-m", "gf_tf.launch", *argv])


def _parser() -> argparse.ArgumentParser:
    """The command line of `gf-tf-run`."""
    parser = argparse.ArgumentParser(
        prog="gf-tf-run",
        description="Run a command as the workers of a TensorFlow multi-worker job, with TF_CONFIG set.",
        epilog="Examples:\n"
               "  gf-tf-run -n 2 -- python -m models.train\n"
               "  gf-tf-run -n 2 --host_network -- python -m models.train --dataset mnist   # downloads\n"
               "  gf-tf-run --workers 10.0.0.1:2222,10.0.0.2:2222 --index 0 -- python -m models.train\n"
               "  TF_CONFIG='{...}' gf-tf-run -- python -m models.train\n\n"
               "TensorFlow's worker servers listen on ALL interfaces without authentication,\n"
               "even for 127.0.0.1 clusters: -n runs the workers in a private loopback-only\n"
               "network namespace where possible; otherwise (or with --host_network) run only\n"
               "where those ports are firewalled from untrusted networks.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num_workers", type=int, default=None,
                        help="start this many local workers on free 127.0.0.1 ports (default 2)")
    parser.add_argument("--workers", default=None,
                        help="comma-separated host:port of every worker of a multi-host job; with --index")
    parser.add_argument("--index", type=int, default=None,
                        help="which worker of --workers this host runs (0 is the chief)")
    parser.add_argument("--host_network", action="store_true",
                        help="with -n: run the workers on this host's network instead of a private "
                             "network namespace with only loopback (e.g. to download datasets)")
    parser.add_argument("--tf_log", action="store_true",
                        help="show TensorFlow's C++ start-up and INFO lines (hidden by default; "
                             "TF_CPP_MIN_LOG_LEVEL alone does not hide them)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command each worker runs, after --")
    return parser


def _run_local(parser, args, command: Sequence[str], from_command_line: bool) -> int:
    """-n N: the local workers, in a private network namespace when run from the command line."""
    num_workers = 2 if args.num_workers is None else args.num_workers
    if num_workers < 1:
        parser.error(f"-n must be >= 1, got {num_workers}")
    if in_private_network():
        print(f"gf-tf-run: the {num_workers} workers run in a private network namespace (loopback only; "
              f"--host_network to turn this off)", file=sys.stderr, flush=True)
    elif args.host_network:
        print("gf-tf-run: warning: --host_network: the workers' TensorFlow ports are reachable from this "
              "machine's networks (they listen on all interfaces, with no authentication): run it only "
              "behind a firewall that blocks untrusted networks", file=sys.stderr, flush=True)
    elif from_command_line:
        _enter_private_network(sys.argv[1:])
    return run_workers(num_workers, command, tf_log=args.tf_log)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `gf-tf-run` and `python -m gf_tf.launch`.

    Only the command line (`argv` None) re-executes itself in a private network
    namespace for -n: a call from Python with `argv` runs on the host's network
    (it must not replace the calling process).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: gf-tf-run -n 2 -- python -m models.train")
    missing = missing_module_error(command)
    if missing:
        print(f"gf-tf-run: error: {missing}", file=sys.stderr)
        return 2
    try:
        if args.workers is not None:
            if args.num_workers is not None:
                parser.error("give either -n (local workers) or --workers/--index (one task), not both")
            if args.index is None:
                parser.error("--workers needs --index (which of the workers this host runs)")
            cluster = {"worker": [a.strip() for a in args.workers.split(",")]}
            return run_tasks([tf_config(cluster, args.index)], command, tf_log=args.tf_log)
        if args.index is not None:
            parser.error("--index needs --workers")
        if "TF_CONFIG" in os.environ:
            if args.num_workers is not None:
                parser.error("TF_CONFIG is set, so this host runs the one task it names; "
                             "unset TF_CONFIG to use -n")
            return run_tasks([os.environ["TF_CONFIG"]], command, tf_log=args.tf_log)
        return _run_local(parser, args, command, from_command_line=argv is None)
    except ValueError as e:
        print(f"gf-tf-run: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the command cannot be started (not found, not executable)
        print(f"gf-tf-run: error: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
