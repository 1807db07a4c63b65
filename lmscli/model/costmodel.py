"""A roofline cost model: per-operation GPU time from FLOPs and bytes moved.

``time = max(flops / (flops_peak * efficiency), bytes / mem_bandwidth)``, in whole microseconds
(as Grappler's analytical model reports it). FLOPs are counted for the ops that dominate training
(convolutions and their gradients, matrix products); everything else is treated as memory-bound.
Ops that only forward or describe a buffer (identities, reshapes, shapes, variable reads,
constants, control flow) cost nothing, as in Grappler.
"""

from __future__ import annotations

from lmscli.graph.graphview import CONTROL_FLOW_OPS, VARIABLE_OPS, GraphView

COMPUTE_EFFICIENCY = 0.6  # achieved share of peak FLOP/s for dense kernels

FREE_OPS = frozenset(
    {"Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient", "Reshape", "Squeeze",
     "ExpandDims", "Shape", "ShapeN", "Size", "Rank", "NoOp", "Const", "HostConst", "Placeholder",
     "PlaceholderWithDefault", "ReadVariableOp", "BroadcastGradientArgs", "ZerosLike", "OnesLike"}
) | VARIABLE_OPS | CONTROL_FLOW_OPS

_CONV_FORWARD = {"Conv2D", "Conv3D", "DepthwiseConv2dNative", "FusedConv2DBiasActivation", "_FusedConv2D"}
_CONV_GRADS = {"Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3DBackpropInputV2",
               "Conv3DBackpropFilterV2", "Conv3DBackpropInput", "Conv3DBackpropFilter",
               "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"}
_MATMUL = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "_FusedMatMul", "Einsum"}


def _elements(info) -> int:
    if info is None or info.shape is None or any(d is None for d in info.shape):
        return 0
    total = 1
    for d in info.shape:
        total *= d
    return total


def op_flops(view: GraphView, i: int) -> float:
    """Floating-point operations of node ``i`` (0 when not modelled or unknown)."""
    op = view.ops[i]
    inputs = [view.tensor(src, out) for src, out in view.data_inputs[i]]
    outputs = view.outputs(i)
    if op in _CONV_FORWARD and len(inputs) >= 2 and outputs:
        kernel = inputs[1]
        if kernel is None or kernel.shape is None or any(d is None for d in kernel.shape):
            return 0.0
        per_output = 1
        for d in kernel.shape[:-1]:
            per_output *= d
        if op == "DepthwiseConv2dNative":
            per_output = kernel.shape[0] * kernel.shape[1]
        return 2.0 * _elements(outputs[0]) * per_output
    if op in _CONV_GRADS and len(inputs) >= 3:
        # Both gradients cost about as much as the forward conv: 2 x |dy| x (kernel volume x Cin).
        dy = inputs[2]
        kernel = inputs[1] if "Input" in op else outputs[0] if outputs else None
        if kernel is None or kernel.shape is None or any(d is None for d in kernel.shape):
            return 2.0 * _elements(dy) * 9
        per = 1
        for d in kernel.shape[:-1]:
            per *= d
        return 2.0 * _elements(dy) * per
    if op in _MATMUL and len(inputs) >= 2 and outputs:
        a = inputs[0]
        if a is None or a.shape is None or len(a.shape) < 2 or a.shape[-1] is None:
            return 0.0
        transpose = view.attr_bool(i, "transpose_a") or view.attr_bool(i, "adj_x")
        inner = a.shape[-2] if transpose else a.shape[-1]
        return 2.0 * _elements(outputs[0]) * (inner or 0)
    return 0.0


def op_bytes(view: GraphView, i: int) -> int:
    total = sum(view.tensor_bytes(src, out) for src, out in view.data_inputs[i])
    return total + sum(info.num_bytes or 0 for info in view.outputs(i))


def op_time(view: GraphView, i: int, flops_peak: float, mem_bandwidth: float) -> int:
    """Microseconds op ``i`` keeps the GPU busy."""
    if view.ops[i] in FREE_OPS:
        return 0
    compute = op_flops(view, i) / (flops_peak * COMPUTE_EFFICIENCY)
    memory = op_bytes(view, i) / mem_bandwidth
    return int(round(max(compute, memory) * 1e6))
