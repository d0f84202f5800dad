"""Mistral: Llama with sliding-window attention (each query sees its last ``sliding_window``
keys), in prefill, decode over the KV cache and training alike; no window when the config
sets none (Mistral 7B v0.2 and later)."""

from .family import Family


def _features(hf) -> dict:
    return {"qkv_bias": False, "o_bias": False, "mlp_bias": False,
            "sliding_window": hf.get("sliding_window")}


FAMILY = Family("mistral", "MistralForCausalLM", "sliding-window attention: each query sees "
                "its last sliding_window keys (the KV cache keeps them all)",
                features=_features)
