"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q, k, v biases) with routed experts, the top-k
weights as they are unless ``norm_topk_prob``, and a shared expert every token runs, added
through a sigmoid gate (``shared_expert_gate``)."""

from .family import Family, MalformedField, activation, flag
from .moe import QWEN_MOE_NAMES, moe_features, qwen_moe_layers
from .qwen2 import QWEN_DEFAULTS, windows


def _features(hf) -> dict:
    experts, routed = qwen_moe_layers(hf)
    shared = hf.get("shared_expert_intermediate_size")
    if not isinstance(shared, int) or isinstance(shared, bool):
        raise MalformedField(f"shared_expert_intermediate_size must be an integer, got "
                             f"{shared!r}")
    return {"qkv_bias": flag(hf, "qkv_bias", True), "o_bias": False, "mlp_bias": False,
            "activation": activation(hf), **windows(hf, _windowed), "shared_expert_size": shared,
            **moe_features(hf, experts, hf.get("moe_intermediate_size"), routed,
                           flag(hf, "norm_topk_prob"))}


def _windowed(i: int, first: int) -> bool:
    """transformers' Qwen2-MoE's default layer types: a window on every other layer from the
    first, below max_window_layers (not Qwen2's rule)."""
    return (i + 1) % 2 == 1 and i < first


def _inert(cfg) -> dict[str, tuple[int, ...]]:
    """A shared expert of width 0: transformers still builds it and its gate, and it adds
    sigmoid(gate . x) times an empty sum, zero, to every token."""
    if cfg.shared_expert_size:
        return {}
    h = cfg.hidden_size
    return {"shared_gate": (0, h), "shared_up": (0, h), "shared_down": (h, 0),
            "shared_expert_gate": (1, h)}


FAMILY = Family("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2's attention (q/k/v biases); routed "
                                                    "experts, top-k weights as they are unless "
                                                    "`norm_topk_prob`, plus a shared expert every "
                                                    "token runs, added through a sigmoid "
                                                    "`shared_expert_gate`",
                features=_features, names=QWEN_MOE_NAMES,
                defaults=dict(QWEN_DEFAULTS, num_key_value_heads=16, decoder_sparse_step=1,
                              moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                              num_experts_per_tok=4, norm_topk_prob=False,
                              qkv_bias=True),
                inert=_inert)
