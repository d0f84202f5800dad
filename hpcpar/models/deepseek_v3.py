"""DeepSeek-V3 (and Kimi K2's layout): DeepSeek-V2's latent attention, shared experts and
dense first layers (``deepseek_v2``), with V3's router: sigmoid scores, a bias
(``e_score_correction_bias``) added for the choice only, the choice limited to the best
``topk_group`` of ``n_group`` groups (a group scored by its best two experts' sum), the
chosen experts' scores as weights, renormalised when ``norm_topk_prob``, times
``routed_scaling_factor``; the rope part's pairs interleaved unless ``rope_interleave`` is
false."""

from .deepseek_v2 import DEEPSEEK_NAMES, _count, deepseek_moe, mla_features
from .family import Family, FieldError, flag


def _features(hf) -> dict:
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise FieldError(f"topk_method {hf.get('topk_method')!r}: transformers' DeepseekV3 "
                         "chooses by noaux_tc only (biased, grouped top-k)")
    return (mla_features(hf, interleave=flag(hf, "rope_interleave", True))
            | deepseek_moe(hf, "sigmoid")
            | {"router_bias": True, "expert_groups": _count(hf, "n_group"),
               "topk_groups": _count(hf, "topk_group"), "group_score": "top2",
               "norm_topk_prob": flag(hf, "norm_topk_prob")})


FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM",
                "DeepSeek-V2's latent attention, shared experts and dense first layers; "
                "sigmoid scores, `e_score_correction_bias` added for the choice only, the best "
                "`topk_group` of `n_group` groups by their best two experts, the chosen scores "
                "renormalised (`norm_topk_prob`) and times `routed_scaling_factor`; "
                "`rope_interleave`",
                features=_features, names=DEEPSEEK_NAMES,
                ignored=(r"model\.layers\.61\.",),     # the multi-token prediction layer
                defaults={"hidden_act": "silu", "max_position_embeddings": 4096,
                          "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                          "attention_bias": False, "num_key_value_heads": 128,
                          "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
                          "n_group": 8, "topk_group": 4, "n_routed_experts": 256,
                          "n_shared_experts": 1, "qk_nope_head_dim": 128,
                          "qk_rope_head_dim": 64, "v_head_dim": 128,
                          "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                          "moe_intermediate_size": 2048, "num_experts_per_tok": 8,
                          "rope_interleave": True})
