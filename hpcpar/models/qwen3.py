"""Qwen3: Llama with a per-head RMSNorm of q and k before rotary, and a ``head_dim`` that
need not be hidden / heads (128 when config.json leaves it out, as transformers takes it)."""

from .family import Family, activation, flag
from .qwen2 import QWEN_DEFAULTS, windows


def _features(hf) -> dict:
    bias = flag(hf, "attention_bias")
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True,
            "activation": activation(hf), **windows(hf)}


FAMILY = Family("qwen3", "Qwen3ForCausalLM", "a per-head RMSNorm of q and k before rotary "
                                             "(weights shared by the heads; their gradients "
                                             "summed over tp); `head_dim` apart from hidden / "
                                             "heads",
                features=_features,
                defaults=dict(QWEN_DEFAULTS, head_dim=128))
