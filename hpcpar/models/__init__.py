"""The models, the layer between the parallel core and the jobs: the config (``config``), the
tensor inventory (``tensors``), the split plan (``sharding``), the one decoder every family
runs (``decoder``, ``attention``, ``latent_attention``, ``norms``, ``mlp``, ``kv_cache``,
``rope``), a model's text side (``tokenizer``, ``chat``), and the families, found by
``model_type`` in one registry (here).

Each family module declares only how it differs from Llama (``family.Family``): the fields
of its ``config.json`` it reads into the config's features, and its tensor names. The
decoder, the split plan and the programs follow the features and never name a family.

    llama    the reference
    mistral  sliding-window attention
    qwen2    q/k/v biases
    qwen3    per-head q/k RMSNorm, free head_dim
    phi3     fused qkv_proj and gate_up_proj
    gemma    (1 + w) RMSNorm, embedding scale, GeGLU (tanh), tied head
    gemma2   Gemma's, with norms of each block's output, soft-capped scores and logits,
             a window on every other layer
    gemma3_text  Gemma 2's block with per-head q/k norms; local layers' own rope base
    olmo2    norms of each block's output only, q/k norms over the whole projection
    mixtral, qwen2_moe, qwen3_moe   a mixture of experts (``moe``)
    deepseek_v2, deepseek_v3   latent attention (``latent_attention``), DeepSeek's routers
"""

from __future__ import annotations

from ..parallel.errors import HpcparError
from . import (deepseek_v2, deepseek_v3, gemma, gemma2, gemma3, llama, mistral, mixtral, olmo2,
               phi3, qwen2, qwen2_moe, qwen3, qwen3_moe)
from .family import Family

FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY
                               for m in (llama, mistral, qwen2, qwen3, phi3, gemma, gemma2,
                                         gemma3, olmo2, mixtral, qwen2_moe, qwen3_moe,
                                         deepseek_v2, deepseek_v3)}


def family_of(model_type: str, source: str = "config") -> Family:
    """The family of ``model_type``, or one error naming the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise HpcparError(f"{source}: model_type {model_type!r} is not supported; hpcpar runs "
                          f"{', '.join(sorted(FAMILIES))}") from None


__all__ = ["FAMILIES", "Family", "family_of"]
