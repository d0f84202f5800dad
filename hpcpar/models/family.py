"""What a model family declares: how its ``config.json`` differs from Llama's, and its
tensors' Hugging Face names. Everything else (the decoder, the split plan, the ops) is
shared and follows the config's features (``ModelConfig``), as Megatron-Core's layer specs
follow a ``TransformerConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# a decoder layer's tensors by role -> the name inside "model.layers.{i}." (Llama's names)
LLAMA_NAMES = {
    "input_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    "gate_bias": "mlp.gate_proj.bias", "up_bias": "mlp.up_proj.bias",
    "down_bias": "mlp.down_proj.bias",
}


@dataclass(frozen=True)
class Family:
    """One model family. ``features(hf)`` reads the fields where it differs from Llama into
    ``ModelConfig`` keyword arguments; ``differs`` says so in words (the README's table)."""

    model_type: str
    architecture: str                              # the transformers class it matches
    differs: str
    features: Callable[[Mapping[str, Any]], dict] = lambda hf: {}
    names: dict[str, str] = field(default_factory=lambda: dict(LLAMA_NAMES))
    # a stored tensor holding several roles' rows, in order (Phi-3's qkv_proj): its name
    # inside "model.layers.{i}." -> the roles
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def layer_name(self, role: str, layer: int) -> str:
        return f"model.layers.{layer}.{self.names[role]}"

    def fused_name(self, roles: tuple[str, ...], layer: int) -> str:
        name = next(n for n, group in self.fused.items() if group == roles)
        return f"model.layers.{layer}.{name}"
