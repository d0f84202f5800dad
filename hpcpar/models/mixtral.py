"""Mixtral: Mistral's attention (a sliding window when the config sets one) with a mixture of
experts in every layer: softmax over all experts in float32, top-k, the k weights
renormalised (``block_sparse_moe``, experts ``w1`` / ``w3`` / ``w2``)."""

from .family import Family, activation
from .moe import MIXTRAL_NAMES, moe_features


def _features(hf) -> dict:
    layers = hf["num_hidden_layers"]
    routed = list(range(layers)) if isinstance(layers, int) else []
    return {"qkv_bias": False, "o_bias": False, "mlp_bias": False,
            "activation": activation(hf), "sliding_window": hf.get("sliding_window"),
            **moe_features(hf, hf.get("num_local_experts"), hf["intermediate_size"], routed,
                           normalize=True)}


FAMILY = Family("mixtral", "MixtralForCausalLM", "Mistral's attention; every MLP a mixture of "
                                                 "experts (`block_sparse_moe`: router `gate`, "
                                                 "experts `w1`/`w3`/`w2`): softmax over all "
                                                 "experts in float32, top-k, the k weights "
                                                 "renormalised", features=_features,
                names=MIXTRAL_NAMES,
                defaults={"hidden_act": "silu", "rms_norm_eps": 1e-5,
                          "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False,
                          "num_key_value_heads": 8, "head_dim": None, "sliding_window": None,
                          "num_local_experts": 8, "num_experts_per_tok": 2,
                          "rope_theta": 1e6})
