"""Device implementations of the ops, one kernel per file, each checked against the NumPy
reference in ``tests/test_ops_gpu.py``. Imported only on a CUDA backend."""

from __future__ import annotations


def cuda_ops(xp):
    from ..cross_entropy import CrossEntropy
    from ..geglu import GeGLU
    from ..table import Ops
    from ..top_k import TopK
    from .attention import CudnnAttention
    from .kv_write import KVWriteCuda
    from .linear import LinearCuda
    from .rms_norm import RMSNormCuda
    from .rotary import RotaryCuda
    from .swiglu import SwiGLUCuda
    return Ops(xp, LinearCuda(xp), RMSNormCuda(xp), RotaryCuda(xp), SwiGLUCuda(xp),
               CudnnAttention(xp), KVWriteCuda(xp), CrossEntropy(xp), TopK(xp), GeGLU(xp),
               device=True)
