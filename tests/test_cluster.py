"""gf_tf.cluster: the one reader of the cluster spec, checked against TensorFlow's own answers."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf
from tensorflow.python.distribute import multi_worker_util

from gf_tf import cluster
from gf_tf.strategy import WorkerInfo

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SPECS = [
    {"worker": ["h0:1", "h1:1", "h2:1"]},
    {"chief": ["c:1"], "worker": ["h0:1", "h1:1"]},
    {"worker": ["h0:1"]},
    {"chief": ["c:1"]},
    {"ps": ["p:1"], "worker": ["h0:1", "h1:1"]},
]


def _tasks(spec):
    return [(job, i) for job in spec for i in range(len(spec[job]))]


def _config(spec, job, index):
    return json.dumps({"cluster": spec, "task": {"type": job, "index": index}})


@pytest.mark.parametrize("spec", SPECS)
def test_leader_and_chief_are_tensorflows(spec):
    for job, index in _tasks(spec):
        this = cluster.from_tf_config(_config(spec, job, index))
        assert this.leader_task_name == multi_worker_util.coordination_leader(spec)
        if job in ("chief", "worker"):
            assert this.is_chief == multi_worker_util.is_chief(spec, job, index), (job, index)


@pytest.mark.parametrize("spec", SPECS)
def test_rank_and_names_follow_the_collective_group_chief_first(spec):
    group = [(job, i) for job in ("chief", "worker") for i in range(len(spec.get(job, [])))]
    for job, index in _tasks(spec):
        this = cluster.from_tf_config(_config(spec, job, index))
        info = this.worker_info()
        assert this.is_multi_worker == (len(group) > 1)
        if (job, index) in group:
            assert info == WorkerInfo(rank=group.index((job, index)),
                                      names=tuple(f"{j} {i}" for j, i in group))
            assert [label for label, _ in this.peers] == [f"{j} {i}" for j, i in group if (j, i) != (job, index)]
        else:   # a ps task is no member of the group
            assert info == WorkerInfo(rank=0, names=("worker 0",))


def test_peers_carry_their_addresses():
    this = cluster.from_tf_config(_config({"chief": ["c:7"], "worker": ["h0:8", "h1:9"]}, "worker", 0))
    assert this.peers == [("chief 0", "c:7"), ("worker 1", "h1:9")]
    assert this.members == [("chief", 0), ("worker", 0), ("worker", 1)]


def test_a_tensorflow_resolver_reads_the_same_as_tf_config(monkeypatch):
    spec = {"chief": ["c:1"], "worker": ["h0:1", "h1:1"]}
    monkeypatch.setenv("TF_CONFIG", _config(spec, "worker", 1))
    from_resolver = cluster.from_resolver(tf.distribute.cluster_resolver.TFConfigClusterResolver())
    from_env = cluster.from_tf_config()
    assert from_resolver == from_env
    assert (from_env.task_type, from_env.task_index, from_env.is_chief) == ("worker", 1, False)
    assert from_env.leader == ("chief", 0)


def test_no_cluster_is_one_worker_its_own_chief(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for this in (cluster.from_tf_config(), cluster.from_resolver(None),
                 cluster.of_strategy(tf.distribute.MirroredStrategy(["/cpu:0"]))):
        assert this.task_type is None and this.is_chief and not this.is_multi_worker
        assert this.leader is None and this.leader_task_name == ""
        assert this.worker_info() == WorkerInfo(rank=0, names=("worker 0",))


@pytest.mark.parametrize("text, message", [
    ("{not json", "TF_CONFIG is not valid JSON"),
    (_config({"worker": ["h0:1", "h1:99999"]}, "worker", 0),
     "TF_CONFIG cluster.worker[1]: port '99999' of 'h1:99999' is not in 1-65535"),
    (_config({"worker": ["h0:1", "h1:1"]}, "worker", 2),
     "TF_CONFIG task.index: 2 is out of range for cluster.worker with 2 tasks (valid: 0-1)"),
    (_config({"worker": ["h0:1"]}, "chief", 0), "TF_CONFIG task.type: 'chief' is not a task type"),
])
def test_a_bad_tf_config_fails_naming_the_field(text, message, monkeypatch):
    with pytest.raises(ValueError) as error:
        cluster.from_tf_config(text)
    assert message in str(error.value)
    monkeypatch.setenv("TF_CONFIG", text)   # the environment's is read the same way
    with pytest.raises(ValueError, match="TF_CONFIG"):
        cluster.from_tf_config()


def test_the_cluster_reader_launcher_and_worker_helpers_import_no_tensorflow():
    code = ("import sys, gf_tf.cluster, gf_tf.worker, gf_tf.launch, gf_tf.watchdog; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'tf_keras')))")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
