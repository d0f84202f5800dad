"""The models, the layer between the parallel core and the jobs: the config (``config``), the
tensor inventory (``tensors``), the split plan (``sharding``), the one decoder every family
runs (``decoder``, ``attention``, ``kv_cache``, ``rope``), a model's text side
(``tokenizer``, ``chat``), and the families, found by ``model_type`` in one registry (here).

Each family module declares only how it differs from Llama (``family.Family``): the fields
of its ``config.json`` it reads into the config's features, and its tensor names. The
decoder, the split plan and the programs follow the features and never name a family.

    llama    the reference
    mistral  sliding-window attention
    qwen2    q/k/v biases
    qwen3    per-head q/k RMSNorm, free head_dim
    phi3     fused qkv_proj and gate_up_proj
    gemma    (1 + w) RMSNorm, embedding scale, GeGLU (tanh), tied head
    mixtral, qwen2_moe, qwen3_moe   a mixture of experts (``moe``)
"""

from __future__ import annotations

from ..parallel.errors import HpcparError
from . import gemma, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe
from .family import Family

FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY
                               for m in (llama, mistral, qwen2, qwen3, phi3, gemma, mixtral,
                                         qwen2_moe, qwen3_moe)}


def family_of(model_type: str, source: str = "config") -> Family:
    """The family of ``model_type``, or one error naming the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise HpcparError(f"{source}: model_type {model_type!r} is not supported; hpcpar runs "
                          f"{', '.join(sorted(FAMILIES))}") from None


__all__ = ["FAMILIES", "Family", "family_of"]
