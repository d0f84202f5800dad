"""Llama (1, 2, 3.x): the reference family; the others are told by how they differ."""

from .family import Family, activation, flag


def _features(hf) -> dict:
    bias = flag(hf, "attention_bias")
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": flag(hf, "mlp_bias"),
            "activation": activation(hf)}


FAMILY = Family("llama", "LlamaForCausalLM", "the reference: RMSNorm, rotary (default, "
                "linear, llama3), GQA, SwiGLU; optional attention and MLP biases",
                features=_features,
                defaults={"hidden_act": "silu", "rms_norm_eps": 1e-6,
                          "max_position_embeddings": 2048, "tie_word_embeddings": False,
                          "num_key_value_heads": None, "head_dim": None})
