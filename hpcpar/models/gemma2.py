"""Gemma 2: Gemma's (1 + w) norms, embedding scale, GeGLU and tied head, and a block of its
own: a norm of the attention's and of the MLP's output as well as of their input (four per
layer: ``block_norms`` "sandwich"), the scores scaled by ``query_pre_attn_scalar``^-1/2 and
soft-capped, cap tanh(s / cap) (``attn_logit_softcapping``), the logits soft-capped the same
way (``final_logit_softcapping``), and a sliding window on the layers ``layer_types`` names
(by default every other one from the first, as transformers' ``Gemma2Config`` lays them).

The activation is ``hidden_activation``, the field ``Gemma2MLP`` reads."""

from .family import LLAMA_NAMES, Family, FieldError, MalformedField
from .gemma import gemma_features
from .qwen2 import layer_types, layer_windows

GEMMA2_NAMES = dict(LLAMA_NAMES, post_attention_norm="pre_feedforward_layernorm.weight",
                    attn_out_norm="post_attention_layernorm.weight",
                    mlp_out_norm="post_feedforward_layernorm.weight")


def sandwich_features(hf) -> dict:
    """Gemma 2's block, which Gemma 3 keeps: Gemma's features, norms of each block's output
    too, the scores' own scale and the soft caps."""
    return gemma_features(hf, "hidden_activation") | {
        "block_norms": "sandwich",
        "attn_scale": _positive(hf, "query_pre_attn_scalar") ** -0.5,
        "attn_softcap": _cap(hf, "attn_logit_softcapping"),
        "final_softcap": _cap(hf, "final_logit_softcapping")}


def _features(hf) -> dict:
    return sandwich_features(hf) | windows(
        hf, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")


def windows(hf, default_type) -> dict:
    """The windows of ``layer_types`` (without it: ``default_type(i)`` of each layer i),
    every sliding layer's the config's ``sliding_window``."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        types = [default_type(i) for i in range(layers if isinstance(layers, int) else 0)]
    else:
        types = layer_types(types, layers)
    window = hf.get("sliding_window")
    if window is None and "sliding_attention" in types:
        raise FieldError(f"layer_types[{types.index('sliding_attention')}] is "
                         "'sliding_attention' but sliding_window is null; set the window, or "
                         "make the layer full_attention")
    return layer_windows(types, window)


def _positive(hf, key) -> float:
    value = hf.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedField(f"{key} must be a number, got {value!r}")
    if not value > 0:
        raise FieldError(f"{key} must be positive, got {value}")
    return float(value)


def _cap(hf, key) -> float | None:
    """A soft-capping field: null (no cap) or a positive number."""
    return None if hf.get(key) is None else _positive(hf, key)


GEMMA2_DEFAULTS = {"hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
                   "max_position_embeddings": 8192, "tie_word_embeddings": True,
                   "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
                   "sliding_window": 4096, "final_logit_softcapping": 30.0,
                   "attn_logit_softcapping": 50.0}

FAMILY = Family("gemma2", "Gemma2ForCausalLM", "Gemma's norms, embedding scale, GeGLU and tied "
                                               "head; norms of each block's output too (four a "
                                               "layer); scores scaled by "
                                               "`query_pre_attn_scalar`^-1/2 and soft-capped, cap "
                                               "tanh(s / cap) (`attn_logit_softcapping`), in "
                                               "prefill, decode and training; the logits "
                                               "soft-capped (`final_logit_softcapping`, under "
                                               "vocab-parallel tp too); a sliding window on the "
                                               "layers `layer_types` names (every other one)",
                features=_features, names=GEMMA2_NAMES, defaults=GEMMA2_DEFAULTS)
