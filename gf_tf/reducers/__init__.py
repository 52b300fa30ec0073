"""Reducers: how the packs of one step are all-reduced.

`base` holds the seam (the `Reducer` interface, its `StepInput` and `Communicator`,
what a step `Sent`, the `CostTerms` the planner reads, the group loop), `dense`
the dense reducer, `lowrank` the low-rank one (PowerSGD); CSC's lives in `gf_tf.csc`. A new reducer is one module that
subclasses `Reducer`, passed as `GradientFlowAllReduce(reducer=...)`.
"""

from gf_tf.reducers.base import (MAX_REDUCER_SETTINGS, Communicator, CostTerms, PackStep, Reduced,
                                 Reducer, Sent, StepInput, for_each_group, fuse_controls,
                                 group_ranges, local_variable, no_control, VariablesState,
                                 wire_scales)
from gf_tf.reducers.dense import DenseReducer
from gf_tf.reducers.lowrank import LowRank

__all__ = ["MAX_REDUCER_SETTINGS", "Communicator", "CostTerms", "DenseReducer", "LowRank", "PackStep",
           "Reduced", "Reducer", "Sent", "StepInput", "for_each_group", "fuse_controls",
           "group_ranges", "local_variable", "no_control", "VariablesState", "wire_scales"]
