"""The compute-only step of benchmarks.fit: the same strategy, every collective replaced by a local reduce.

`compute_only_ops(method, gradient_flow, variables)` gives the cross-device ops to swap into the fit's
own strategy (`swapped`): TF's methods reduce with `local_ops()`, GradientFlow methods keep their local
work (packing, scaling, CSC) around `local_ops()`, settings left "auto" pinned to the real run's plan.
Why it needs no handshake, why the algorithm is pinned to "ring", one replica per worker:
docs/benchmarks.md, "The tools in detail".
"""

import contextlib
from typing import Optional

import tensorflow as tf

from benchmarks.workers import methods
from gf_tf import tf_internal

AUTO = "auto"


def local_ops() -> tf.distribute.CrossDeviceOps:
    """TF's ReductionToOneDevice: a reduce over this worker's replicas only (SUM: their sum,
    MEAN: their mean; with one replica, the value itself), broadcast back to them. It never
    leaves the process."""
    return tf.distribute.ReductionToOneDevice()


def _plan_of(gradient_flow, variables):
    """The gf_tf.plan.Plan of the real run's variable set holding `variables` (Keras
    Variables: the optimizer all-reduces for their tf.Variables, `.value`), or None."""
    import keras
    variables = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    states = gradient_flow.states()
    for name, report in gradient_flow.plans().items():
        if report is not None and states[name].overlaps(variables):
            return report.plan
    return None


def compute_only_ops(method: str, gradient_flow=None, variables=()) -> tf.distribute.CrossDeviceOps:
    """The cross-device ops of `method`'s compute-only step (docs/benchmarks.md, "The tools in detail").

    gradient_flow / variables: the real run's GradientFlowAllReduce and the model's
    trainable variables; needed only for settings left "auto" (their plan is pinned).

    Raises ValueError when an "auto" setting has no plan to pin (the real run did not step).
    """
    if not methods.is_gradient_flow(method):
        return local_ops()
    import gf_tf
    kwargs = methods.gradient_flow_kwargs(method)
    if AUTO in (kwargs["compression"], kwargs["bytes_per_pack"]):
        plan = _plan_of(gradient_flow, variables) if gradient_flow is not None else None
        if plan is None:
            raise ValueError(f"{method}: no plan of the model's variables to pin for the compute-only step")
        if plan.method == "tf" and kwargs["compression"] == AUTO:
            return local_ops()
        if kwargs["compression"] == AUTO:
            kwargs["compression"] = None if plan.method == "none" else plan.method
        if kwargs["bytes_per_pack"] == AUTO:
            kwargs["bytes_per_pack"] = plan.bytes_per_pack
    kwargs["algorithm"] = "ring"
    return gf_tf.GradientFlowAllReduce(cross_device_ops=local_ops(), **kwargs)


@contextlib.contextmanager
def swapped(strategy, ops: Optional[tf.distribute.CrossDeviceOps]):
    """Within the block `strategy` reduces with `ops` (a step traced inside keeps them);
    its own ops are put back after.

    Raises ValueError for a strategy with several local replicas (docs/benchmarks.md, "The tools in detail").
    """
    if len(strategy.extended.worker_devices) != 1:
        raise ValueError(f"the compute-only step needs one replica per worker, "
                         f"got {len(strategy.extended.worker_devices)}")
    own = tf_internal.cross_device_ops_of(strategy)
    tf_internal.set_cross_device_ops(strategy, ops)
    try:
        yield
    finally:
        tf_internal.set_cross_device_ops(strategy, own)
