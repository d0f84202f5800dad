"""DeepSeek-V2 (and V2-Lite): multi-head latent attention (``latent_attention``) and a
mixture of experts after the first ``first_k_dense_replace`` dense layers, each token's
softmax scores over the routed experts, top-k over all of them (``topk_method`` greedy) or
over the best ``topk_group`` of ``n_group`` groups (group_limited_greedy, a group scored by
its best expert), the weights times ``routed_scaling_factor``, plus ``n_shared_experts``
shared experts every token runs (one dense MLP of n_shared x moe_intermediate_size).

What DeepSeek-V3 shares with it (the attention's fields and tensors, the shared experts, the
dense first layers) is read here once (``mla_features``, ``deepseek_moe``)."""

from __future__ import annotations

from typing import Any, Mapping

from .family import LLAMA_NAMES, Family, FieldError, MalformedField, activation, flag
from .yarn import yarn_mscale

# the attention's tensors inside "model.layers.{i}." (q_proj where q_lora_rank is null)
MLA_NAMES = {
    "q": "self_attn.q_proj.weight", "q_a": "self_attn.q_a_proj.weight",
    "q_a_norm": "self_attn.q_a_layernorm.weight", "q_b": "self_attn.q_b_proj.weight",
    "kv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight", "kv_b": "self_attn.kv_b_proj.weight",
}
DEEPSEEK_NAMES = dict(
    {r: n for r, n in LLAMA_NAMES.items() if not r.startswith(("q", "k", "v"))},
    **MLA_NAMES, router="mlp.gate.weight", router_bias="mlp.gate.e_score_correction_bias",
    expert_gate="mlp.experts.{e}.gate_proj.weight", expert_up="mlp.experts.{e}.up_proj.weight",
    expert_down="mlp.experts.{e}.down_proj.weight",
    shared_gate="mlp.shared_experts.gate_proj.weight",
    shared_up="mlp.shared_experts.up_proj.weight",
    shared_down="mlp.shared_experts.down_proj.weight")


def _count(hf: Mapping[str, Any], key: str, low: int = 1) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedField(f"{key} must be an integer, got {value!r}")
    if value < low:
        raise FieldError(f"{key} {value} must be at least {low}")
    return value


def _scale(hf: Mapping[str, Any], qk_head_dim: int) -> float:
    """transformers' softmax scale: qk_head_dim^-1/2, times the square of YaRN's scale with
    ``mscale_all_dim`` where a scaled rope sets it."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    scale = qk_head_dim ** -0.5
    if not isinstance(rope, Mapping):          # refused in one line by the rope's parsing
        return scale
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get(
            "mscale_all_dim"):
        scale *= yarn_mscale(rope.get("factor", 1.0), rope["mscale_all_dim"]) ** 2
    return scale


def mla_features(hf: Mapping[str, Any], interleave: bool) -> dict:
    """The latent attention's fields (head_dim is the rope part's, as transformers sets it)."""
    for key in ("attention_bias", "mlp_bias"):
        if flag(hf, key):
            raise FieldError(f"{key} true: hpcpar runs DeepSeek's projections without biases "
                             "(as the released models have them)")
    q_rank = hf.get("q_lora_rank")
    nope, rope = _count(hf, "qk_nope_head_dim"), _count(hf, "qk_rope_head_dim")
    return {"kv_lora_rank": _count(hf, "kv_lora_rank"),
            "q_lora_rank": 0 if q_rank is None else _count(hf, "q_lora_rank"),
            "qk_nope_head_dim": nope, "v_head_dim": _count(hf, "v_head_dim"),
            "head_dim": rope, "rope_interleave": interleave,
            "attn_scale": _scale(hf, nope + rope), "activation": activation(hf)}


def deepseek_moe(hf: Mapping[str, Any], scoring: str) -> dict:
    """The routed layers (every one from ``first_k_dense_replace``), their experts and the
    shared experts, the fields transformers' classes ignore refused where DeepSeek's own
    code would compute other numbers with them."""
    if hf.get("scoring_func", scoring) != scoring:
        raise FieldError(f"scoring_func {hf.get('scoring_func')!r}: transformers' "
                         f"{hf.get('model_type')} scores the experts by {scoring} only")
    if hf.get("moe_layer_freq", 1) != 1:
        raise FieldError(f"moe_layer_freq {hf.get('moe_layer_freq')!r}: transformers routes "
                         "every layer from first_k_dense_replace on; hpcpar runs 1 only")
    layers, first = _count(hf, "num_hidden_layers"), _count(hf, "first_k_dense_replace", 0)
    experts = _count(hf, "n_routed_experts")
    scaling = hf.get("routed_scaling_factor")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise MalformedField(f"routed_scaling_factor must be a number, got {scaling!r}")
    return {"num_experts": experts, "experts_per_token": _count(hf, "num_experts_per_tok"),
            "moe_intermediate_size": _count(hf, "moe_intermediate_size"),
            "moe_layers": tuple(range(first, layers)), "router_scoring": scoring,
            "routed_scaling": float(scaling), "shared_expert_gated": False,
            "shared_expert_size": _count(hf, "n_shared_experts") * hf["moe_intermediate_size"]}


def _features(hf) -> dict:
    method = hf.get("topk_method")
    if method not in ("greedy", "group_limited_greedy"):
        raise FieldError(f"topk_method {method!r}: transformers' DeepseekV2 runs greedy and "
                         "group_limited_greedy")
    if flag(hf, "norm_topk_prob"):
        raise FieldError("norm_topk_prob true: transformers' DeepseekV2 ignores it and "
                         "DeepSeek's own code renormalises; hpcpar runs false only")
    groups = {}
    if method == "group_limited_greedy":
        groups = {"expert_groups": _count(hf, "n_group"), "topk_groups": _count(hf, "topk_group"),
                  "group_score": "max"}
    return mla_features(hf, interleave=True) | deepseek_moe(hf, "softmax") | groups


DEEPSEEK_V2_DEFAULTS = {
    "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "num_key_value_heads": None, "first_k_dense_replace": 0, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "n_group": None, "topk_group": None, "n_routed_experts": 64,
    "n_shared_experts": 2, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "routed_scaling_factor": 1.0, "topk_method": "greedy",
    "norm_topk_prob": False, "moe_intermediate_size": 1407, "num_experts_per_tok": None}

FAMILY = Family("deepseek_v2", "DeepseekV2ForCausalLM",
                "multi-head latent attention: q through a low-rank latent (`q_a_proj`, "
                "`q_a_layernorm`, `q_b_proj`; `q_proj` where `q_lora_rank` is null), keys and "
                "values from one latent of `kv_lora_rank` per token (`kv_a_proj_with_mqa`, "
                "`kv_a_layernorm`, `kv_b_proj`), which the KV cache holds with the rope key, "
                "the rope on a `qk_rope_head_dim` part in interleaved pairs, `v_head_dim` apart "
                "(under tp the heads split, the latents' projections and norms replicated); "
                "routed experts from layer `first_k_dense_replace`, softmax scores, top-k over "
                "all or the best `topk_group` of `n_group` groups, times "
                "`routed_scaling_factor`, plus `n_shared_experts` shared experts",
                features=_features, names=DEEPSEEK_NAMES, defaults=DEEPSEEK_V2_DEFAULTS)
