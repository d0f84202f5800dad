"""What a model family declares: how its ``config.json`` differs from Llama's, and its
tensors' Hugging Face names. Everything else (the decoder, the split plan, the ops) is
shared and follows the config's features (``ModelConfig``), as Megatron-Core's layer specs
follow a ``TransformerConfig``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


class FieldError(ValueError):
    """A ``config.json`` field transformers' class refuses, or one hpcpar cannot run exactly
    as that class does: the message is one line naming the field, its value and what runs."""


class MalformedField(FieldError):
    """A field of the wrong JSON type (a string where a number goes, a list for an object)."""


# transformers' activation names (``ACT2FN``) by the function they compute, among the gated
# MLP's hpcpar has (act(gate) * up, forward and backward): silu (SwiGLU) and the tanh GELU
# (GeGLU). gelu_fast writes sqrt(2/pi) as 0.7978845608, 4e-12 from it relatively.
GATED_ACTIVATIONS = {
    "silu": "silu", "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
    "gelu_accurate": "gelu_tanh", "gelu_fast": "gelu_tanh",
}


def activation(hf: Mapping[str, Any], key: str = "hidden_act") -> str:
    """hpcpar's name of the gated MLP's activation ``hf[key]`` names, or a ``FieldError``
    saying which names run (any other, e.g. relu or the exact erf GELU, would compute a
    different model)."""
    value = hf.get(key)
    if isinstance(value, str) and value in GATED_ACTIVATIONS:
        return GATED_ACTIVATIONS[value]
    silu = [n for n, a in GATED_ACTIVATIONS.items() if a == "silu"]
    tanh = [n for n, a in GATED_ACTIVATIONS.items() if a == "gelu_tanh"]
    raise FieldError(f"{key} {value!r} is not supported: hpcpar's MLP computes act(gate) * up "
                     f"with act {' or '.join(silu)} (SwiGLU) or {', '.join(tanh)} (the tanh "
                     "GELU); a model with another activation would compute other numbers")


def flag(hf: Mapping[str, Any], key: str, default: bool = False) -> bool:
    """A true/false field (a string or a number there is refused, as transformers does:
    ``bool("false")`` is True)."""
    value = hf.get(key, default)
    if not isinstance(value, bool):
        raise MalformedField(f"{key} must be true or false, got {value!r}")
    return value


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
    ``ModelConfig`` keyword arguments; ``differs`` says so in words (the table of
    README.md and docs/models.md)."""

    model_type: str
    architecture: str                              # the transformers class it matches
    differs: str
    features: Callable[[Mapping[str, Any]], dict] = lambda hf: {}
    names: dict[str, str] = field(default_factory=lambda: dict(LLAMA_NAMES))
    # a stored tensor holding several roles' rows, in order (Phi-3's qkv_proj): its name
    # inside "model.layers.{i}." -> the roles
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # what transformers' config class of the family takes for a field config.json leaves out
    # (Mistral's sliding_window 4096, Qwen2's num_key_value_heads 32, Phi-3's rms_norm_eps
    # 1e-5, ...): the same model as transformers builds from that config.json
    defaults: dict[str, Any] = field(default_factory=dict)
    # the rope types transformers' class accepts (None: every type transformers has)
    rope_types: tuple[str, ...] | None = None
    # whether transformers' class turns only the first partial_rotary_factor of each head
    # (Phi-3's); the others turn the whole head and refuse a factor below 1
    partial_rotary: bool = False
    # tensors of each routed layer that transformers' model has and that compute nothing for
    # a config (Qwen2-MoE's shared expert of width 0), role -> shape: a converted checkpoint
    # keeps them aside, so that export gives them back
    inert: Callable[[Any], dict[str, tuple[int, ...]]] = lambda cfg: {}
    # the config.json (its defaults filled in) as the shared parsing reads it: Gemma 3's rope
    # per layer type becomes the full-attention layers' rope and the local layers' base
    prepare: Callable[[Mapping[str, Any]], Mapping[str, Any]] = lambda hf: hf

    # tensors of a checkpoint transformers' class skips on load (its
    # ``_keys_to_ignore_on_load_unexpected``: DeepSeek-V3's multi-token-prediction layer),
    # as regular expressions that convert skips too
    ignored: tuple[str, ...] = ()

    def ignores(self, name: str) -> bool:
        """Whether transformers' class skips the checkpoint's tensor ``name`` on load."""
        return any(re.match(pattern, name) for pattern in self.ignored)

    def layer_name(self, role: str, layer: int, expert: int | None = None) -> str:
        """A layer's tensor of ``role`` (an expert's: of expert ``expert``)."""
        return f"model.layers.{layer}.{self.names[role].format(e=expert)}"

    def fused_name(self, roles: tuple[str, ...], layer: int) -> str:
        name = next(n for n, group in self.fused.items() if group == roles)
        return f"model.layers.{layer}.{name}"
