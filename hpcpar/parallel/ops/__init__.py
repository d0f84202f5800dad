"""The per-device math of the layers and models, one operation per module, each written once.

Every op is a class whose methods are the NumPy reference (they run on any array module:
NumPy, the strict test backend, CuPy); a device subclass in ``ops/cuda/`` overrides the
methods it has a kernel for. ``ops_for(backend)`` picks the classes once, when the backend is
chosen, as vLLM's ``CustomOp`` picks ``forward_native`` or ``forward_cuda``: the model code
calls ``ops.rms_norm.forward(...)`` and never asks where it runs.

    linear       Y = X W^T, one 2-D GEMM over the flattened rows (weights stored [in, out])
    rms_norm     y = w * x / rms(x), with the residual add fused in front, and its backward
    rotary       rope on q and k together, and its backward
    swiglu       silu(gate) * up, and its backward
    geglu        gelu_tanh(gate) * up, and its backward (Gemma)
    attention    causal GQA softmax attention over per-row lengths (prefill, decode over a
                 KV cache, training with backward): in tiles with an online softmax, or
                 a whole sequence's with its shift known up front (``tiled_attention``);
                 the full-matrix version stays as the reference
    embedding    the vocab-parallel lookup and its scatter backward
    kv_write     a step's keys and values into the KV cache, each row at its own slots
    cross_entropy  the vocab-parallel cross-entropy's local pieces, and its backward
    top_k        the vocab-parallel sampling reductions: local candidates, and their merge
    optimizer_update  AdamW / SGD over a span of flat buffers (``parallel.optim.optimizers``)
"""

from __future__ import annotations

from ..errors import HpcparError
from .attention import Attention, AttentionRows, Documents
from .cross_entropy import CrossEntropy
from .embedding import embedding_lookup
from .geglu import GeGLU
from .kv_write import KVWrite
from .linear import Linear, linear, linear_input_grad
from .optimizer_update import OptimizerUpdate, UpdateStep
from .rms_norm import RMSNorm
from .rotary import Rotary
from .swiglu import SwiGLU
from .table import Ops, native_ops
from .top_k import TopK


def ops_for(backend, cp=None) -> Ops:
    """NumPy references everywhere, except on a CUDA backend, where each op that has a kernel
    in ``ops/cuda`` runs it (``HPCPAR_OPS=native`` keeps the references there, for checks;
    ``HPCPAR_OPS=device`` on the strict backend takes that table with each kernel's reference
    counted as one operation, ``ops.counted``: the device budget of the GPU's path).
    With a context-parallel group ``cp`` (a ``Communicator`` of more than one rank) attention
    is ring attention over it (``parallel.context_parallel.ring_attention``), its tiles the
    NumPy reference's."""
    from dataclasses import replace

    from ..environment import environment_value
    xp = backend.xp
    if cp is not None and cp.size > 1:
        from ..context_parallel.ring_attention import RingAttention
        from .tiled_attention import TiledAttention
        return replace(ops_for(backend), attention=RingAttention(TiledAttention(xp), cp))
    choice = environment_value("HPCPAR_OPS")
    if backend.is_gpu and choice != "native":
        from .cuda import cuda_ops
        return cuda_ops(xp)
    if choice == "device":
        check_ops(backend.name)
        from .counted import counted_ops
        return counted_ops(xp)
    return native_ops(xp)


def check_ops(backend: str) -> None:
    """Refuse ``HPCPAR_OPS=device`` where the arrays are the host's (no device table):
    ``backend`` is a job's backend name (auto: ``HPCPAR_BACKEND``, and without CuPy NumPy's)."""
    import importlib.util

    from ..environment import environment_value
    if environment_value("HPCPAR_OPS") != "device":
        return
    name = environment_value("HPCPAR_BACKEND") if backend == "auto" else backend
    if name == "auto" and importlib.util.find_spec("cupy") is None:
        name = "numpy"
    if name == "numpy":
        raise HpcparError("HPCPAR_OPS=device takes the device kernels' table, and this job's "
                          "arrays are NumPy's: use it with the strict backend (--backend "
                          "strict, or HPCPAR_BACKEND=strict with no --backend) or a GPU")


def optimizer_update(xp, fused: bool) -> OptimizerUpdate:
    """The optimizer's update of a span: the reference's passes; with ``fused``
    (``--fused-optimizer``) on a GPU one kernel a span (``ops/cuda/optimizer_update``), and on
    the strict backend under ``HPCPAR_OPS=device`` the reference counted as that kernel (the
    device budget). On the host the reference runs cache-sized blocks, which read memory
    about once already: ``fused`` changes nothing there."""
    from ..environment import environment_value
    module = getattr(xp, "__name__", "")
    choice = environment_value("HPCPAR_OPS")
    if fused and module == "cupy" and choice != "native":
        from .cuda.optimizer_update import OptimizerUpdateCuda
        return OptimizerUpdateCuda(xp)
    if fused and module.startswith("hpcpar.parallel.device.strict_arrays") and choice == "device":
        from .counted import counted_update
        return counted_update(xp)
    return OptimizerUpdate(xp)


__all__ = ["Attention", "AttentionRows", "CrossEntropy", "Documents", "GeGLU", "KVWrite", "Linear", "Ops",
           "OptimizerUpdate", "RMSNorm", "Rotary", "SwiGLU", "TopK", "UpdateStep",
           "embedding_lookup", "linear", "linear_input_grad", "native_ops", "ops_for",
           "check_ops", "optimizer_update"]
