"""Emulated cluster: N hosts as Linux network namespaces on a rate-limited bridge.

Host namespace <prefix>-h<i> holds `lo` and a veth `eth0` (SUBNET.<i+1>), bridged in <prefix>-br and
shaped both ways by a `tc` token bucket; the root namespace is never touched. Needs root
(`require_root`); `EmulatedCluster` tears itself down on exit, exceptions and SIGINT/SIGTERM. The
layout: docs/benchmarks.md, "The tools in detail".

    python -m benchmarks.netem up --hosts 2 --rate-mbit 100
    python -m benchmarks.netem goodput --hosts 2 --rate-mbit 100
    python -m benchmarks.netem down
"""

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PREFIX = os.environ.get("GF_BENCH_NETNS_PREFIX", "gfbench")  # namespaces: <prefix>-br, <prefix>-h<i>
SUBNET = "10.213.7"          # /24, host i gets SUBNET.(i+1); never configured outside our namespaces
MAX_HOSTS = 8
PYTHON = sys.executable


class NotRootError(RuntimeError):
    pass


def require_root() -> None:
    """Exits with status 2 and a message unless running as root with ip and tc available."""
    if os.geteuid() != 0:
        sys.stderr.write(
            "benchmarks: the emulated network needs root (network namespaces and tc).\n"
            "Nothing was changed. Re-run as root, e.g. `sudo /work/venv/bin/python -m benchmarks.allreduce`.\n")
        sys.exit(2)
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            sys.stderr.write(f"benchmarks: `{tool}` (iproute2) is not installed; nothing was changed.\n")
            sys.exit(2)


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"command failed ({result.returncode}): {' '.join(argv)}\n{result.stderr.strip()}")
    return result


# A shaped link's largest segment (its veths' gso_max_size), so that a shallow bucket still holds
# whole packets: tbf drops a packet larger than its bucket.
SHAPED_GSO_MAX_BYTES = 4096
UNSHAPED_GSO_MAX_BYTES = 65536   # the veth's own
# The bucket refills while the workers compute, so a step's first bucketful leaves at the veth's
# speed: 1 ms of the rate is a small error at any rate. A bucket of two default 64 KiB segments
# (128 KiB) lets 10.5 ms of a 100 Mbit/s link through free every step and fools the planner's
# trial, which times one set's all-reduces on an idle link (docs/benchmarks.md, "How a cell is
# measured").
BURST_SECONDS = 0.001


def tbf_burst_bytes(rate_mbit: float) -> int:
    """Token-bucket depth in bytes: BURST_SECONDS of the rate, and at least 4 segments of
    SHAPED_GSO_MAX_BYTES (16 KiB)."""
    return int(max(rate_mbit * 1e6 / 8 * BURST_SECONDS, 4 * SHAPED_GSO_MAX_BYTES))


class EmulatedCluster:
    """`num_hosts` namespaces on one bridge, each link limited to `rate_mbit` (None = unshaped).

    Use as a context manager, or call `up()` / `down()`; `down()` is always safe to call.
    """

    def __init__(self, num_hosts: int, rate_mbit: Optional[float] = None, prefix: str = DEFAULT_PREFIX):
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be in 1..{MAX_HOSTS}, got {num_hosts}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0 or None (unshaped), got {rate_mbit}")
        self.num_hosts = num_hosts
        self.rate_mbit = rate_mbit
        self.prefix = prefix
        self.bridge_ns = f"{prefix}-br"
        self.hosts = [f"{prefix}-h{i}" for i in range(num_hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(num_hosts)]
        self._procs: List[subprocess.Popen] = []
        self._is_up = False
        self._old_handlers: Dict[int, object] = {}

    def __enter__(self) -> "EmulatedCluster":
        try:
            self.up()
        except BaseException:
            self.down()   # __exit__ does not run when __enter__ raises
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        require_root()
        self._install_cleanup_hooks()
        remove_cluster(self.prefix)   # idempotent: a leftover from a killed run goes first
        self._is_up = True            # from here on, down() has something to remove
        _run(["ip", "netns", "add", self.bridge_ns])
        br = ["ip", "-n", self.bridge_ns]
        _run(br + ["link", "set", "lo", "up"])
        _run(br + ["link", "add", "br0", "type", "bridge"])
        _run(br + ["link", "set", "br0", "up"])
        for i, (ns, addr) in enumerate(zip(self.hosts, self.addresses)):
            _run(["ip", "netns", "add", ns])
            # The veth pair is created inside the bridge namespace and one end moved straight
            # into the host namespace: it never exists in the root namespace.
            _run(br + ["link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(br + ["link", "set", f"v{i}", "master", "br0"])
            _run(br + ["link", "set", f"v{i}", "up"])
            host = ["ip", "-n", ns]
            _run(host + ["link", "set", "lo", "up"])
            _run(host + ["addr", "add", f"{addr}/24", "dev", "eth0"])
            _run(host + ["link", "set", "eth0", "up"])
        self.set_rate(self.rate_mbit)

    def down(self) -> None:
        """Kills every process inside the namespaces and deletes them. Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        if self._is_up:
            remove_cluster(self.prefix)
            self._is_up = False

    def _install_cleanup_hooks(self) -> None:
        atexit.register(self.down)
        for sig in (signal.SIGINT, signal.SIGTERM):
            if sig in self._old_handlers:
                continue
            self._old_handlers[sig] = signal.getsignal(sig)

            def handler(signum, frame, _self=self):
                _self.down()
                sys.stderr.write(f"benchmarks: interrupted by signal {signum}; emulated network removed.\n")
                sys.exit(128 + signum)

            signal.signal(sig, handler)

    def set_rate(self, rate_mbit: Optional[float]) -> None:
        """Limits every link, both directions, to `rate_mbit` Mbit/s; None removes the limit."""
        self.rate_mbit = rate_mbit
        for i, ns in enumerate(self.hosts):
            for netns, dev in ((ns, "eth0"), (self.bridge_ns, f"v{i}")):
                tc = ["tc", "-n", netns, "qdisc"]
                gso = UNSHAPED_GSO_MAX_BYTES if rate_mbit is None else SHAPED_GSO_MAX_BYTES
                _run(["ip", "-n", netns, "link", "set", "dev", dev, "gso_max_size", str(gso)])
                if rate_mbit is None:
                    _run(tc + ["del", "dev", dev, "root"], check=False)   # absent qdisc is fine
                    continue
                burst = tbf_burst_bytes(rate_mbit)
                # Queue of ~50 ms at the rate: enough to keep the link busy, no tail drops under a ring.
                limit = burst + int(rate_mbit * 1e6 / 8 * 0.05)
                _run(tc + ["replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                           "burst", str(burst), "limit", str(limit)])

    def popen(self, host: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
              **kwargs) -> subprocess.Popen:
        """Starts `argv` inside host namespace `host` (cwd = repository root, PYTHONPATH includes it)."""
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = REPO_ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        full_env.update(env or {})
        proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[host], *argv], env=full_env,
                                cwd=REPO_ROOT, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def interface_bytes(self, host: int) -> Dict[str, int]:
        """tx/rx byte counters of host `host`'s eth0 (from inside its namespace)."""
        stats = json.loads(_run(["ip", "-n", self.hosts[host], "-j", "-s", "link", "show", "dev", "eth0"]).stdout)
        s = stats[0]["stats64"]
        return {"tx_bytes": int(s["tx"]["bytes"]), "rx_bytes": int(s["rx"]["bytes"])}

    def measure_goodput(self, seconds: float = 2.0, port: int = 5201) -> Dict[str, object]:
        """TCP bulk transfer around the ring (host i -> host i+1, all at once; N=2: both directions).

        Returns {"goodput_bps": median payload bits/s over receivers, "per_link_bps": [...],
        "seconds": ..., "method": ...}. The payload rate is what the ring lower bound needs.
        """
        n = self.num_hosts
        if n < 2:
            raise ValueError("goodput needs at least 2 hosts")
        receivers = [self.popen(i, [PYTHON, "-m", "benchmarks.workers.tcp_bulk", "recv",
                                    "--bind", self.addresses[i], "--port", str(port)],
                                stdout=subprocess.PIPE, text=True) for i in range(n)]
        time.sleep(0.5)  # let the listeners bind
        senders = [self.popen(i, [PYTHON, "-m", "benchmarks.workers.tcp_bulk", "send",
                                  "--to", self.addresses[(i + 1) % n], "--port", str(port),
                                  "--seconds", str(seconds)], stdout=subprocess.DEVNULL)
                   for i in range(n)]
        rates = []
        for proc in senders:
            proc.wait(timeout=seconds + 30)
        for proc in receivers:
            out, _ = proc.communicate(timeout=30)
            rates.append(json.loads(out.strip().splitlines()[-1])["bps"])
        return {"goodput_bps": statistics.median(rates), "per_link_bps": rates, "seconds": seconds,
                "method": f"TCP bulk transfer host i -> host i+1 around the ring, all {n} links at once, "
                          f"{seconds:g} s, payload bytes counted by the receiver"}


def remove_cluster(prefix: str = DEFAULT_PREFIX) -> List[str]:
    """Kills processes in, and deletes, every namespace named `<prefix>-*`. Returns what was removed."""
    removed = []
    for ns in [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]:
        if not ns.startswith(prefix + "-"):
            continue
        for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    return removed


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["up", "down", "goodput"])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=None, help="per-link rate; omit for unshaped")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    args = parser.parse_args(argv)
    require_root()
    if args.action == "down":
        print("removed:", remove_cluster(args.prefix) or "nothing")
        return 0
    cluster = EmulatedCluster(args.hosts, args.rate_mbit, args.prefix)
    if args.action == "up":
        cluster.up()
        cluster._is_up = False  # leave it up for manual inspection; `down` removes it
        print(f"up: {cluster.hosts} via {cluster.bridge_ns}, addresses {cluster.addresses}, "
              f"rate {args.rate_mbit or 'unshaped'}\n{_run(['tc', '-n', cluster.hosts[0], 'qdisc', 'show', 'dev', 'eth0']).stdout.strip()}")
        return 0
    with cluster:
        print(json.dumps(cluster.measure_goodput(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
