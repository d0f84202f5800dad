"""Qwen2 / Qwen2.5: Llama with biases on q, k and v (none on o), split with their heads."""

from .family import Family


def _features(hf) -> dict:
    return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, **windows(hf)}


def windows(hf) -> dict:
    """Qwen's sliding windows, by ``layer_types`` (transformers 5) or ``use_sliding_window``
    from ``max_window_layers`` on (4.x): none, one on every layer, or some layers only
    (refused by the config's checks)."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", layers) if hf.get("use_sliding_window") else layers
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return {}
    if all(sliding):
        return {"sliding_window": hf.get("sliding_window")}
    return {"mixed_windows": True}


FAMILY = Family("qwen2", "Qwen2ForCausalLM", "q, k, v biases (column-parallel with their "
                "heads), no o bias", features=_features)
