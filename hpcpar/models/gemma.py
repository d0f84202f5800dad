"""Gemma (1): RMSNorm scaling by (1 + w), the embedding scaled by sqrt(hidden), GeGLU with
the tanh GELU, and the head tied to the embedding."""

import math

from .family import Family

ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu_tanh"}   # Gemma runs tanh


def _features(hf) -> dict:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    return {"qkv_bias": bool(hf.get("attention_bias", False)),
            "o_bias": bool(hf.get("attention_bias", False)), "mlp_bias": False,
            "norm_offset": 1.0, "embed_scale": math.sqrt(hf["hidden_size"]),
            "activation": ACTIVATIONS.get(act, act),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True))}


FAMILY = Family("gemma", "GemmaForCausalLM", "RMSNorm by (1 + w), embedding scaled by "
                "sqrt(hidden), GeGLU (tanh GELU), tied head", features=_features)
