"""What the mixture-of-experts families share: how their ``config.json`` names the experts
and which layers route, and the router variants hpcpar refuses. The routed layer itself is
the core's (``hpcpar.parallel.expert_parallel.moe``); the decoder builds it (``mlp.MoeMlp``)."""

from __future__ import annotations

from typing import Any, Mapping

from .family import LLAMA_NAMES, FieldError, MalformedField, flag

# transformers' per-expert tensor names inside "model.layers.{i}." ({e}: the expert)
QWEN_MOE_NAMES = dict(
    LLAMA_NAMES, router="mlp.gate.weight",
    expert_gate="mlp.experts.{e}.gate_proj.weight", expert_up="mlp.experts.{e}.up_proj.weight",
    expert_down="mlp.experts.{e}.down_proj.weight",
    shared_gate="mlp.shared_expert.gate_proj.weight",
    shared_up="mlp.shared_expert.up_proj.weight",
    shared_down="mlp.shared_expert.down_proj.weight",
    shared_expert_gate="mlp.shared_expert_gate.weight")
MIXTRAL_NAMES = dict(
    LLAMA_NAMES, router="block_sparse_moe.gate.weight",
    expert_gate="block_sparse_moe.experts.{e}.w1.weight",
    expert_up="block_sparse_moe.experts.{e}.w3.weight",
    expert_down="block_sparse_moe.experts.{e}.w2.weight")

# fields of routers the softmax top-k families do not compute (DeepSeek's grouped and biased
# top-k, sigmoid scores, scaled weights: ``deepseek_v2``) and the value at which each would
# be the plain softmax top-k
OTHER_ROUTERS = {"n_group": (None, 1), "topk_group": (None, 1), "topk_method": (None, "greedy"),
                 "scoring_func": (None, "softmax"), "routed_scaling_factor": (None, 1, 1.0),
                 "e_score_correction_bias": (None,), "moe_router_enable_expert_bias": (None,
                                                                                      False)}


def _count(hf: Mapping[str, Any], key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedField(f"{key} must be an integer, got {value!r}")
    return value


def _number(hf: Mapping[str, Any], key: str) -> float:
    value = hf.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedField(f"{key} must be a number, got {value!r}")
    return float(value)


def moe_features(hf: Mapping[str, Any], experts: int, intermediate: int, routed: list[int],
                 normalize: bool) -> dict:
    """The config's MoE features: ``experts`` routed experts of ``intermediate`` features on
    the layers ``routed``, their top-k weights renormalised when ``normalize``."""
    for key, plain in OTHER_ROUTERS.items():
        if hf.get(key) not in plain:
            raise FieldError(f"{key} {hf.get(key)!r}: a router with grouped, biased or scaled "
                             f"top-k is not {hf.get('model_type')}'s, whose transformers class "
                             "routes by softmax top-k over all experts (DeepSeek's families "
                             "run such routers: deepseek_v2, deepseek_v3)")
    coef = _number(hf, "router_aux_loss_coef")
    return {"num_experts": experts, "experts_per_token": _count(hf, "num_experts_per_tok"),
            "moe_intermediate_size": intermediate, "moe_layers": tuple(routed),
            "norm_topk_prob": normalize,
            "router_aux_loss_coef": coef if flag(hf, "output_router_logits") else 0.0,
            "router_jitter_noise": _number(hf, "router_jitter_noise")}


def qwen_moe_layers(hf: Mapping[str, Any], experts_key: str = "num_experts",
                    default: int = 60) -> tuple[int, list[int]]:
    """(experts, the routed layers) as Qwen-MoE's decoder picks them: layer i routes unless
    it is in ``mlp_only_layers``, when there are experts and (i + 1) is a multiple of
    ``decoder_sparse_step``. The experts are ``experts_key``, else the other name
    transformers' config maps to it (``num_experts`` / ``num_local_experts``)."""
    other = "num_local_experts" if experts_key == "num_experts" else "num_experts"
    experts = hf.get(experts_key, hf.get(other, default))
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise MalformedField(f"num_experts must be an integer >= 0, got {experts!r}")
    step = _count(hf, "decoder_sparse_step")
    if step < 1:
        raise FieldError(f"decoder_sparse_step must be at least 1, got {step}")
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise MalformedField(f"mlp_only_layers must be a list of layer indices, got {dense!r}")
    layers = _count(hf, "num_hidden_layers")
    return experts, [i for i in range(layers)
                     if i not in dense and experts > 0 and (i + 1) % step == 0]
