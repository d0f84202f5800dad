"""``Ops``: the ops one backend runs, one field per operation, chosen once; and the NumPy
references' table (``native_ops``). The device table is ``ops/cuda``'s."""

from __future__ import annotations

from dataclasses import dataclass

from .attention import Attention
from .cross_entropy import CrossEntropy
from .geglu import GeGLU
from .kv_write import KVWrite
from .linear import Linear
from .rms_norm import RMSNorm
from .rotary import Rotary
from .swiglu import SwiGLU
from .top_k import TopK


@dataclass(frozen=True)
class Ops:
    """The ops one backend runs, chosen once (see ``ops_for``)."""

    xp: object
    linear: Linear
    rms_norm: RMSNorm
    rotary: Rotary
    swiglu: SwiGLU
    attention: Attention
    kv_write: KVWrite
    cross_entropy: CrossEntropy
    top_k: TopK
    geglu: GeGLU
    device: bool = False        # the device kernels are in use

    def gated(self, activation: str):
        """The gated MLP's activation op: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU); the
        config refuses every other, so another here is a bug, not a silent SwiGLU."""
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"no gated MLP op for activation {activation!r}")
        return self.geglu if activation == "gelu_tanh" else self.swiglu


def native_ops(xp) -> Ops:
    """The NumPy references, on any array module (attention in tiles: the full-matrix
    ``Attention`` is its test oracle)."""
    from .tiled_attention import TiledAttention
    return Ops(xp, Linear(xp), RMSNorm(xp), Rotary(xp), SwiGLU(xp), TiledAttention(xp),
               KVWrite(xp), CrossEntropy(xp), TopK(xp), GeGLU(xp))
