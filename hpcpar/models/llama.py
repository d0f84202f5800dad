"""Llama (1, 2, 3.x): the reference family; the others are told by how they differ."""

from .family import Family


def _features(hf) -> dict:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(hf.get("mlp_bias", False))}


FAMILY = Family("llama", "LlamaForCausalLM", "the reference: RMSNorm, rotary (default, "
                "linear, llama3), GQA, SwiGLU; optional attention and MLP biases",
                features=_features)
