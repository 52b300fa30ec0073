"""The one reader of the cluster spec: TF_CONFIG's format, its checks, and where this task sits.

TF_CONFIG format: the one `tf.distribute.cluster_resolver.TFConfigClusterResolver`
reads: {"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}.

`Cluster` answers every question gf_tf asks of a cluster spec: the workers of
the collective group (chief first), this task's rank, whether it is the chief,
which task leads TensorFlow's coordination service, and whether the job spans
several workers. Build it from TF_CONFIG (`from_tf_config`, checked with
`validate_tf_config`) or from a TensorFlow cluster resolver (`from_resolver`,
duck-typed). This module imports nothing of TensorFlow, so the launcher and
the watchdog can use it too.
"""

import dataclasses
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

# The jobs whose tasks form MultiWorkerMirroredStrategy's collective group, in rank order.
GROUP_JOBS = ("chief", "worker")


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """Where this process sits among the workers of a collective group."""
    rank: int                  # 0 .. num_workers - 1, chief first
    names: Tuple[str, ...]     # e.g. ("worker 0", "worker 1"), by rank

    @property
    def num_workers(self) -> int:
        return len(self.names)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster spec and this task's place in it (task_type None: a process outside any cluster).

    spec: job name -> tuple of "host:port" addresses, e.g. {"worker": ("h1:2222", "h2:2222")}.
    """
    spec: Dict[str, Tuple[str, ...]]
    task_type: Optional[str] = None
    task_index: int = 0

    @property
    def members(self) -> List[Tuple[str, int]]:
        """(job, index) of every task of the collective group, chief first (its rank order)."""
        return [(job, i) for job in GROUP_JOBS for i in range(len(self.spec.get(job, ())))]

    @property
    def me(self) -> Tuple[Optional[str], int]:
        return (self.task_type, self.task_index)

    @property
    def is_multi_worker(self) -> bool:
        """True when the collective group has more than one worker."""
        return len(self.members) > 1

    @property
    def is_chief(self) -> bool:
        """True for task "chief", worker 0 of a cluster without one, and a process outside any cluster.

        As TF's multi-worker guide defines it (the one writer of checkpoints and logs).
        """
        if self.task_type in (None, "chief"):
            return True
        return self.task_type == "worker" and self.task_index == 0 and "chief" not in self.spec

    @property
    def leader(self) -> Optional[Tuple[str, int]]:
        """(job, 0) of the task hosting TensorFlow's coordination service: ps, else chief, else worker.

        Mirrors `tensorflow.python.distribute.multi_worker_util.coordination_leader`
        (TF 2.18-2.21); None for an empty cluster.
        """
        for job in ("ps", "chief", "worker"):
            if self.spec.get(job):
                return (job, 0)
        return None

    @property
    def leader_task_name(self) -> str:
        """The leader as a TF device name ("/job:worker/replica:0/task:0"); "" for an empty cluster."""
        return "" if self.leader is None else f"/job:{self.leader[0]}/replica:0/task:0"

    @property
    def peers(self) -> List[Tuple[str, str]]:
        """("worker 1", "host:port") of every member of the collective group other than this task."""
        return [(f"{job} {i}", self.spec[job][i]) for job, i in self.members if (job, i) != self.me]

    def worker_info(self) -> WorkerInfo:
        """Rank and names of the collective group; a task outside it is rank 0 of ("worker 0",)."""
        members = self.members
        if not members or self.me not in members:
            return WorkerInfo(rank=0, names=("worker 0",))
        return WorkerInfo(rank=members.index(self.me), names=tuple(f"{job} {i}" for job, i in members))


def from_tf_config(text: Optional[str] = None) -> Cluster:
    """The cluster of TF_CONFIG `text` (default: the environment's), checked by `validate_tf_config`.

    Without TF_CONFIG: an empty cluster (task_type None). Raises ValueError
    naming the bad field of a malformed TF_CONFIG.
    """
    text = os.environ.get("TF_CONFIG") if text is None else text
    if not text:
        return Cluster(spec={})
    config = validate_tf_config(text)
    return Cluster(spec={job: tuple(a) for job, a in config["cluster"].items()},
                   task_type=config["task"]["type"], task_index=config["task"]["index"])


def from_resolver(resolver) -> Cluster:
    """The cluster a `tf.distribute.cluster_resolver.ClusterResolver` describes (None: empty)."""
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    if not isinstance(spec, dict):
        spec = {}
    # A job may be a {index: address} dict (sparse ClusterSpec); list it by index.
    spec = {job: tuple(a[i] for i in sorted(a)) if isinstance(a, dict) else tuple(a)
            for job, a in spec.items()}
    task_type = getattr(resolver, "task_type", None) or None
    return Cluster(spec=spec, task_type=task_type,
                   task_index=int(getattr(resolver, "task_id", None) or 0) if task_type else 0)


def of_strategy(strategy) -> Cluster:
    """The cluster of a `tf.distribute.Strategy` (empty for strategies without a cluster resolver)."""
    return from_resolver(getattr(strategy, "cluster_resolver", None))


# --- TF_CONFIG: writing and checking ---------------------------------------------------

def tf_config(cluster: Dict[str, List[str]], index: int, task_type: str = "worker") -> str:
    """The TF_CONFIG JSON string for task `task_type`:`index` of `cluster`."""
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def _check_address(field: str, address) -> None:
    """Raises ValueError naming `field` unless `address` is "host:port", port 1-65535."""
    if not isinstance(address, str):
        raise ValueError(f"TF_CONFIG {field}: expected a \"host:port\" string, got {address!r}")
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"TF_CONFIG {field}: {address!r} is not \"host:port\"")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError(f"TF_CONFIG {field}: {address!r} has an unbalanced IPv6 bracket")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"TF_CONFIG {field}: port {port!r} of {address!r} is not in 1-65535")


def _check_cluster(cluster) -> None:
    """Raises ValueError unless `cluster` maps task types to non-empty lists of distinct addresses."""
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError("TF_CONFIG cluster: expected a non-empty object such as "
                         "{\"worker\": [\"host:port\", ...]}, got " + repr(cluster))
    seen = {}
    for task_type, addresses in cluster.items():
        if not isinstance(addresses, list) or not addresses:
            raise ValueError(f"TF_CONFIG cluster.{task_type}: expected a non-empty list of "
                             f"\"host:port\" strings, got {addresses!r}")
        for i, address in enumerate(addresses):
            field = f"cluster.{task_type}[{i}]"
            _check_address(field, address)
            if address in seen:
                raise ValueError(f"TF_CONFIG {field}: address {address!r} is also {seen[address]}; "
                                 "every task needs its own host:port")
            seen[address] = field


def _check_task(task, cluster: dict) -> None:
    """Raises ValueError unless `task` names a task type of `cluster` and an index in range."""
    if not isinstance(task, dict):
        raise ValueError("TF_CONFIG task: expected an object such as "
                         "{\"type\": \"worker\", \"index\": 0}, got " + repr(task))
    task_type = task.get("type")
    if task_type not in cluster:
        raise ValueError(f"TF_CONFIG task.type: {task_type!r} is not a task type of the cluster "
                         f"(valid: {sorted(cluster)})")
    index = task.get("index")
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f"TF_CONFIG task.index: expected an integer, got {index!r}")
    if not 0 <= index < len(cluster[task_type]):
        raise ValueError(f"TF_CONFIG task.index: {index} is out of range for "
                         f"cluster.{task_type} with {len(cluster[task_type])} tasks "
                         f"(valid: 0-{len(cluster[task_type]) - 1})")


def validate_tf_config(text: str) -> dict:
    """Parses and checks one TF_CONFIG string the way a worker will read it.

    Returns:
      The parsed dict.

    Raises:
      ValueError: naming the bad field (e.g. `cluster.worker[1]`, `task.index`) and
        what was expected: invalid JSON, a missing/empty cluster, a task list that is
        not host:port strings with port 1-65535, the same address twice, a task type
        not in the cluster, or an index out of range.
    """
    try:
        config = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e}); text: {text!r}") from None
    if not isinstance(config, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object with \"cluster\" and \"task\", got {text!r}")
    _check_cluster(config.get("cluster"))
    _check_task(config.get("task"), config["cluster"])
    return config


def validate_tf_configs(texts: Sequence[str]) -> List[dict]:
    """Checks the TF_CONFIGs of all tasks of one job against each other.

    Each must pass `validate_tf_config`; all must name the identical cluster;
    no two may name the same (task.type, task.index).

    Returns:
      The parsed dicts, in the order of `texts`.

    Raises:
      ValueError: naming the field and the tasks (by position in `texts`) that
        disagree.
    """
    configs = [validate_tf_config(t) for t in texts]
    owner = {}
    for i, config in enumerate(configs):
        if config["cluster"] != configs[0]["cluster"]:
            raise ValueError(f"TF_CONFIG cluster: task {i} has {config['cluster']!r} but task 0 has "
                             f"{configs[0]['cluster']!r}; every task needs the identical cluster")
        key = (config["task"]["type"], config["task"]["index"])
        if key in owner:
            raise ValueError(f"TF_CONFIG task.index: tasks {owner[key]} and {i} are both "
                             f"{key[0]} {key[1]}; every task needs a unique index")
        owner[key] = i
    return configs
