"""The device kernels' bodies on the strict backend (``HPCPAR_OPS=device``): the table of
``ops/cuda`` with each of its kernels replaced by the NumPy reference it is checked against,
counted by the device budget (``parallel.device.budget``) as the one operation the kernel is, its
outputs as its allocations and nothing of what the reference does inside. The rest of the
table (the loss, top-k) is the references', as ``cuda_ops`` has it, and
``device`` is set, so the jobs take the GPU's control flow. A kernel is also what a CUDA
graph's capture accepts (``parallel.device.capture``): the planned GEMM of ``ops/cuda/linear``,
cuDNN's attention, the compiled kernels.

What a GPU run launches is then counted on the CPU: the GPU path's operations per layer,
its reads and its allocations (``benchmarks/device_budget.py``).
"""

from __future__ import annotations

from ..device import budget, capture
from ..device.strict_arrays import arrays_of
from .cross_entropy import CrossEntropy
from .geglu import GeGLU
from .kv_write import KVWrite
from .linear import Linear
from .optimizer_update import OptimizerUpdate
from .rms_norm import RMSNorm
from .rotary import Rotary
from .swiglu import SwiGLU
from .table import Ops
from .tiled_attention import TiledAttention
from .top_k import TopK

# each kernel of ops/cuda: the reference class and the methods its kernel replaces
KERNELS = {"linear": (Linear, ("forward", "input_grad")),
           "rms_norm": (RMSNorm, ("forward", "add_forward", "forward_train", "backward")),
           "rotary": (Rotary, ("apply", "backward_one")),
           "swiglu": (SwiGLU, ("forward", "backward")),
           "attention": (TiledAttention, ("forward", "forward_train", "backward")),
           "kv_write": (KVWrite, ("forward",))}


def _counted(method):
    def one_kernel(self, *args, **kwargs):
        with budget.fused(args, arrays_of) as outputs, \
                capture.kernel(f"{type(self).__name__}.{method.__name__}", (args, kwargs)):
            outputs.append(method(self, *args, **kwargs))
        return outputs[0]
    one_kernel.__name__, one_kernel.__doc__ = method.__name__, method.__doc__
    return one_kernel


def counted_class(base: type, methods: tuple[str, ...]) -> type:
    """``base`` with each of ``methods`` counted as one device operation."""
    return type(f"Counted{base.__name__}", (base,),
                {m: _counted(getattr(base, m)) for m in methods})


def counted_ops(xp) -> Ops:
    """``cuda_ops``' table on the strict backend: each kernel its counted reference."""
    made = {name: counted_class(base, methods)(xp)
            for name, (base, methods) in KERNELS.items()}
    return Ops(xp, made["linear"], made["rms_norm"], made["rotary"], made["swiglu"],
               made["attention"], made["kv_write"], CrossEntropy(xp), TopK(xp), GeGLU(xp),
               device=True)


def counted_update(xp) -> OptimizerUpdate:
    """``--fused-optimizer``'s kernel on the strict backend: the reference's update of a
    span, one operation (``ops/cuda/optimizer_update``)."""
    return counted_class(OptimizerUpdate, ("adamw", "sgd"))(xp)
