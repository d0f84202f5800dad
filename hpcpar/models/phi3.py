"""Phi-3: Llama with q, k, v fused into one ``qkv_proj`` and gate, up into one
``gate_up_proj``. The fused tensors stay fused in the checkpoint; each part is a tensor of
its own in the computation, and each tp rank reads (and a training run writes) only its
slices of each part. Its rope is the default one or longrope (its short factors: a row holds at
most original_max_position_embeddings positions), as transformers' ``Phi3Config`` accepts, over
the first ``partial_rotary_factor`` of each head (Phi-4-mini's 0.75)."""

from .family import Family, activation


def _features(hf) -> dict:
    return {"qkv_bias": False, "o_bias": False, "mlp_bias": False,
            "activation": activation(hf), "sliding_window": hf.get("sliding_window")}


FAMILY = Family("phi3", "Phi3ForCausalLM", "q, k, v fused in `qkv_proj` and gate, up in "
                                           "`gate_up_proj`: they stay fused in the checkpoint, "
                                           "each part a tensor of its own in the computation, and "
                                           "each tp rank reads (and training writes) only its "
                                           "slices of each part; rope default or longrope (its "
                                           "short factors: a row holds at most "
                                           "`original_max_position_embeddings` positions), over "
                                           "the first `partial_rotary_factor` of each head",
                features=_features,
                fused={"self_attn.qkv_proj.weight": ("q", "k", "v"),
                       "mlp.gate_up_proj.weight": ("gate", "up")},
                defaults={"hidden_act": "silu", "rms_norm_eps": 1e-5,
                          "max_position_embeddings": 4096, "tie_word_embeddings": False,
                          "num_key_value_heads": None, "head_dim": None,
                          "sliding_window": None},
                rope_types=("default", "longrope"), partial_rotary=True)
