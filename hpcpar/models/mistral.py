"""Mistral: Llama with sliding-window attention (each query sees its last ``sliding_window``
keys), in prefill, decode over the KV cache and training alike; no window when the config
sets none (Mistral 7B v0.2 and later). A config.json without the field has transformers'
default window, 4096."""

from .family import Family, activation


def _features(hf) -> dict:
    return {"qkv_bias": False, "o_bias": False, "mlp_bias": False,
            "activation": activation(hf), "sliding_window": hf.get("sliding_window")}


FAMILY = Family("mistral", "MistralForCausalLM", "sliding-window attention: each query sees its "
                                                 "last `sliding_window` keys, in prefill, decode "
                                                 "over the KV cache (which keeps them all), "
                                                 "continuous batching and training",
                features=_features,
                defaults={"hidden_act": "silu", "rms_norm_eps": 1e-6,
                          "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False,
                          "num_key_value_heads": 8, "head_dim": None, "sliding_window": 4096})
