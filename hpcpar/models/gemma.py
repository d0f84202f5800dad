"""Gemma (1): RMSNorm scaling by (1 + w), the embedding scaled by sqrt(hidden), GeGLU with
the tanh GELU, and the head tied to the embedding.

The activation is ``hidden_act`` (transformers 5; its ``GemmaConfig`` reads the legacy
``gelu`` of the official releases as the tanh GELU). transformers 4.x ran
``hidden_activation`` instead: a config whose two fields name different functions is
refused rather than run as one version of transformers would."""

import math

from .family import GATED_ACTIVATIONS, Family, FieldError, activation, flag


def _features(hf) -> dict:
    act = hf.get("hidden_act")
    hf = dict(hf, hidden_act="gelu_pytorch_tanh" if act == "gelu" else act)
    legacy = hf.get("hidden_activation")
    if legacy is not None and GATED_ACTIVATIONS.get(legacy) != activation(hf):
        raise FieldError(f"hidden_activation {legacy!r} and hidden_act {act!r} name different "
                         "functions (transformers 4.x runs the first, 5.x the second); "
                         "remove the one the model was not trained with")
    return gemma_features(hf)


def gemma_features(hf, activation_key: str = "hidden_act") -> dict:
    """What every Gemma shares: causal attention only, q/k/v/o biases by
    ``attention_bias``, (1 + w) norms, the embedding scaled by sqrt(hidden), the gated MLP's
    activation from ``activation_key``."""
    if hf.get("use_bidirectional_attention") is not None and flag(
            hf, "use_bidirectional_attention"):       # (transformers writes null for none)
        raise FieldError("use_bidirectional_attention true (attention to every token) is not "
                         "supported; hpcpar runs causal attention")
    bias = flag(hf, "attention_bias")
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False,
            "norm_offset": 1.0, "embed_scale": _sqrt(hf["hidden_size"]),
            "activation": activation(hf, activation_key)}


def _sqrt(hidden) -> float:
    """sqrt(hidden_size); 1 for a size the config's checks refuse (with the value)."""
    return math.sqrt(hidden) if isinstance(hidden, int) and hidden > 0 else 1.0


FAMILY = Family("gemma", "GemmaForCausalLM", "RMSNorm by (1 + w), the embedding scaled by "
                                             "sqrt(hidden), GeGLU with the tanh GELU, tied head",
                features=_features,
                defaults={"hidden_act": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
                          "max_position_embeddings": 8192, "tie_word_embeddings": True,
                          "num_key_value_heads": 16, "head_dim": 256})
