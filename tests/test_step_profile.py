"""GradientFlowStats(profile_dir=...) traces one training step with tf.profiler."""

import glob
import os

import pytest

import cluster
import gf_tf
from gf_tf.keras.callbacks import StepProfile


def _ops_by_thread(path):
    """{thread pool (a trace line's name up to "/"): set of op types} of one .xplane.pb trace
    (an op's event is named "<op name>:<op type>")."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    ops = {}
    for plane in space.planes:
        for line in plane.lines:
            found = ops.setdefault(line.name.split("/")[0], set())
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if ":" in name:
                    found.add((name.rsplit(":", 1)[1], "gradient_tape/" in name))
    return ops


@pytest.mark.slow
def test_gradient_flow_stats_traces_one_step_with_its_collectives(tmp_path):
    result = cluster.run_process("step_profile_worker.py", [str(tmp_path)], timeout=180)
    assert result.returncode == 0 and result.result is not None, cluster.describe([result])
    traces = glob.glob(os.path.join(str(tmp_path), "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1, traces            # one batch of the first epoch, not one per epoch
    ops = _ops_by_thread(traces[0])
    # What README's "Reading a step's trace" says to look for: the collectives on their own
    # threads, GradientFlow's packing and the backprop ops on TF's inter-op pool (tf_Compute).
    assert ("CollectiveReduceV2", False) in ops.get("collective_ops", set()), ops
    compute = ops.get("tf_Compute", set())
    assert ("GfPack", False) in compute and any(backprop for _, backprop in compute), ops
    assert bool(result.result["done"]) and int(result.result["steps"]) == 8   # 2 epochs x 4 batches


def test_step_profile_rejects_a_negative_batch_and_gradient_flow_stats_defaults_to_no_trace():
    with pytest.raises(ValueError, match="batch must be an integer >= 0"):
        StepProfile("/tmp/unused", batch=-1)
    stats = gf_tf.GradientFlowStats(gf_tf.GradientFlowAllReduce(compression="fp16"))
    assert stats.profile is None
