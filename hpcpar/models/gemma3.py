"""Gemma 3 (its text model, ``Gemma3ForCausalLM``): Gemma 2's block (norms of each block's
input and output, the scale ``query_pre_attn_scalar``^-1/2, soft-capping where the config
sets it: by default it does not) with Qwen3's per-head q/k RMSNorms, by (1 + w); local
layers with a sliding window and global ones, by ``layer_types`` or, without it, every
``sliding_window_pattern``-th layer global; and the local layers' own rope base
(``rope_local_base_freq``, or 5.x's ``rope_parameters.sliding_attention``), their rope the
default one, while the global layers take ``rope_theta`` and the scaling."""

from typing import Any, Mapping

from .family import Family, FieldError, MalformedField
from .gemma2 import GEMMA2_NAMES, _positive, sandwich_features, windows

LAYER_ROPES = ("full_attention", "sliding_attention")


def _prepare(hf: Mapping[str, Any]) -> dict:
    """The config with one rope, the global layers', where the shared parsing reads it, and
    the local layers' base in ``rope_local_base_freq``: 5.x writes ``rope_parameters`` per
    layer type, 4.x ``rope_theta``, ``rope_scaling`` and ``rope_local_base_freq``."""
    hf = dict(hf)
    rope = hf.get("rope_parameters")
    if rope is None:
        return hf
    if not isinstance(rope, Mapping):
        raise MalformedField(f"rope_parameters must be an object of ropes per layer type or "
                             f"null, got {rope!r:.60}")
    if not any(isinstance(v, Mapping) for v in rope.values()):
        raise FieldError("rope_parameters of gemma3_text are given per layer type "
                         f"({', '.join(LAYER_ROPES)}); got one rope for all")
    other = [k for k in rope if k not in LAYER_ROPES]
    if other:
        raise FieldError(f"rope_parameters {', '.join(map(str, other))}: Gemma 3's layer types "
                         f"are {' and '.join(LAYER_ROPES)}")
    full = dict(rope.get("full_attention") or {})
    local = dict(rope.get("sliding_attention") or {})
    for name, part in (("full_attention", full), ("sliding_attention", local)):
        if not isinstance(part, Mapping):
            raise MalformedField(f"rope_parameters {name} must be an object")
    full.setdefault("rope_theta", hf.get("rope_theta"))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise FieldError(f"rope_parameters sliding_attention rope_type "
                         f"{local.get('rope_type', local.get('type'))!r}: hpcpar runs the "
                         "local layers' default rope only")
    hf["rope_parameters"] = full
    hf["rope_local_base_freq"] = local.get("rope_theta", hf.get("rope_local_base_freq"))
    return hf


def _features(hf) -> dict:
    block = sandwich_features(hf)
    pattern = hf.get("sliding_window_pattern")
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise MalformedField(f"sliding_window_pattern must be a positive integer, got "
                             f"{pattern!r}")
    win = windows(hf, lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention")
    return block | {"qk_norm": True,
                    "local_rope_theta": (_positive(hf, "rope_local_base_freq")
                                         if win.get("sliding_window") is not None else None),
                    **win}


FAMILY = Family("gemma3_text", "Gemma3ForCausalLM", "Gemma 2's block (norms of each block's "
                                                    "output too, `query_pre_attn_scalar`, "
                                                    "soft-capping where the config sets it) with "
                                                    "per-head q/k RMSNorms by (1 + w); local "
                                                    "layers (a sliding window, their own rope "
                                                    "base `rope_local_base_freq`, or 5.x's "
                                                    "`rope_parameters.sliding_attention`) and "
                                                    "global ones (`rope_theta` and the scaling) "
                                                    "by `layer_types` or `sliding_window_pattern`",
                features=_features, names=GEMMA2_NAMES,
                prepare=_prepare,
                defaults={"hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
                          "max_position_embeddings": 131072, "tie_word_embeddings": True,
                          "num_key_value_heads": 4, "head_dim": 256,
                          "query_pre_attn_scalar": 256, "sliding_window": 4096,
                          "sliding_window_pattern": 6, "final_logit_softcapping": None,
                          "attn_logit_softcapping": None, "rope_theta": 1_000_000.0,
                          "rope_local_base_freq": 10_000.0})
