"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with routed experts on the layers
``decoder_sparse_step`` and ``mlp_only_layers`` pick (dense MLPs between them), the top-k
weights renormalised when ``norm_topk_prob``."""

from .family import Family, activation, flag
from .moe import QWEN_MOE_NAMES, moe_features, qwen_moe_layers


def _features(hf) -> dict:
    bias = flag(hf, "attention_bias")
    window = hf.get("sliding_window") if flag(hf, "use_sliding_window") else None
    experts, routed = qwen_moe_layers(hf, "num_local_experts", 128)
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True,
            "activation": activation(hf), "sliding_window": window,
            **moe_features(hf, experts, hf.get("moe_intermediate_size"), routed,
                           flag(hf, "norm_topk_prob"))}


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3's attention; routed experts "
                                                    "(`mlp.gate`, `mlp.experts.N.*_proj`) on the "
                                                    "layers `decoder_sparse_step` and "
                                                    "`mlp_only_layers` pick, dense MLPs between "
                                                    "them; `norm_topk_prob`",
                features=_features, names=QWEN_MOE_NAMES,
                defaults={"hidden_act": "silu", "rms_norm_eps": 1e-6,
                          "max_position_embeddings": 32768, "tie_word_embeddings": False,
                          "num_key_value_heads": 4, "head_dim": None, "use_sliding_window": False,
                          "sliding_window": 4096, "decoder_sparse_step": 1,
                          "moe_intermediate_size": 768, "num_experts_per_tok": 8,
                          "norm_topk_prob": False})
