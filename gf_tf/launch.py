"""Local multi-worker launcher and TF_CONFIG helpers (`gf-tf-run`).

TF_CONFIG format: the one `tf.distribute.cluster_resolver.TFConfigClusterResolver`
reads: {"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}.
"""

import json
import socket
from typing import Dict, List


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


def tf_config(cluster: Dict[str, List[str]], index: int, task_type: str = "worker") -> str:
    """The TF_CONFIG JSON string for task `task_type`:`index` of `cluster`."""
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
