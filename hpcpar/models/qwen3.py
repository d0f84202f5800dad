"""Qwen3: Llama with a per-head RMSNorm of q and k before rotary, and a ``head_dim`` that
need not be hidden / heads."""

from .family import Family
from .qwen2 import windows


def _features(hf) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True,
            **windows(hf)}


FAMILY = Family("qwen3", "Qwen3ForCausalLM", "per-head RMSNorm of q and k before rotary "
                "(weights shared by the heads, gradients summed over tp); head_dim set "
                "apart from hidden / heads", features=_features)
