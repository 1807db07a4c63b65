"""What TensorFlow's op registry says of an op type, asked once per type (TensorFlow is imported
on the first question)."""

from __future__ import annotations


class StatefulOps:
    """``stateful(op)``: TensorFlow's registry says ``op`` is stateful (unknown ops count as such)."""

    def __init__(self):
        self._known: dict[str, bool] = {}

    def __call__(self, op: str) -> bool:
        if op not in self._known:
            from lmscli.tfimport import tensorflow

            tensorflow()
            from tensorflow.python.framework import op_def_registry

            op_def = op_def_registry.get(op)
            self._known[op] = op_def is None or op_def.is_stateful
        return self._known[op]


class CpuKernels:
    """``has(op)``: this TensorFlow build has a CPU kernel for ``op`` (what the runtime's constant
    folding needs: it evaluates on the CPU)."""

    def __init__(self):
        self._known: dict[str, bool] = {}

    def __call__(self, op: str) -> bool:
        if op not in self._known:
            from lmscli.tfimport import tensorflow

            tensorflow()
            from tensorflow.python.framework import kernels

            devices = {k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}
            self._known[op] = bool(devices & {"CPU", "DEFAULT"})
        return self._known[op]
