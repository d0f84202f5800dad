"""Qwen2 / Qwen2.5: Llama with biases on q, k and v (none on o), split with their heads, and
a sliding window on the layers ``layer_types`` names (``use_sliding_window`` from
``max_window_layers`` without it), each layer's own in every job."""

from .family import Family, FieldError, MalformedField, activation, flag

# the layer types transformers' config classes accept (configuration_utils), its legacy
# names, and those Qwen2's and Qwen3's classes run
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "window_attention",
               "indexed_attention", "compressed_sparse_attention",
               "heavily_compressed_attention", "minimax_m3_sparse", "conv", "moe", "hybrid",
               "hybrid_sliding", "reference_sliding_attention", "linear_attention")
LEGACY_LAYER_TYPES = {"attention": "full_attention", "mamba": "linear_attention",
                      "deepseek_sparse_attention": "indexed_attention",
                      "qwen_sparse_attention": "indexed_attention"}
QWEN_LAYER_TYPES = ("full_attention", "sliding_attention")


def _features(hf) -> dict:
    return {"qkv_bias": True, "o_bias": False, "mlp_bias": False,
            "activation": activation(hf), **windows(hf)}


def windows(hf, windowed=lambda i, first: i >= first) -> dict:
    """Qwen's sliding windows, as transformers 5 reads them: the window is
    ``sliding_window`` when ``use_sliding_window`` is true, else none; the layers that use it
    are ``layer_types``' sliding_attention ones, or without that list those ``windowed(i,
    max_window_layers)`` picks (Qwen2's and Qwen3's: every layer from max_window_layers on).
    None, one window on every layer, or some layers only (``window_layers``). A list
    transformers refuses (an unknown type, the wrong length) or cannot run (another
    attention, a sliding layer with no window) is refused here."""
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if flag(hf, "use_sliding_window") else None
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers")
        if not isinstance(first, int) or isinstance(first, bool):
            raise MalformedField(f"max_window_layers must be an integer, got {first!r}")
        types = ["sliding_attention" if window is not None and windowed(i, first)
                 else "full_attention" for i in range(layers)]
    else:
        types = layer_types(types, layers)
        if window is None and "sliding_attention" in types:
            i = types.index("sliding_attention")
            raise FieldError(f"layer_types[{i}] is 'sliding_attention' but the model has no "
                             "window (use_sliding_window false or sliding_window null): "
                             "transformers cannot run it; set both, or make the layer "
                             "full_attention")
    return layer_windows(types, window)


def layer_windows(types: list[str], window) -> dict:
    """The config's features of a list of layer types: no window, one window on every layer,
    or a window on the sliding_attention layers only."""
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not sliding:
        return {}
    if len(sliding) == len(types):
        return {"sliding_window": window}
    return {"sliding_window": window, "window_layers": sliding}


def layer_types(types, layers) -> list[str]:
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise MalformedField(f"layer_types must be a list of layer type names, got {types!r:.80}")
    types = [LEGACY_LAYER_TYPES.get(t, t) for t in types]
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise FieldError(f"layer_types[{i}] {t!r} is not a layer type transformers "
                             f"accepts; these layers are {' or '.join(QWEN_LAYER_TYPES)}")
        if t not in QWEN_LAYER_TYPES:
            raise FieldError(f"layer_types[{i}] {t!r} is not an attention this family runs "
                             f"(transformers cannot run it either); they are "
                             f"{' or '.join(QWEN_LAYER_TYPES)}")
    if isinstance(layers, int) and len(types) != layers:
        raise FieldError(f"layer_types lists {len(types)} layers, num_hidden_layers is "
                         f"{layers}; transformers requires one type per layer")
    return types


QWEN_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                 "tie_word_embeddings": False, "num_key_value_heads": 32, "head_dim": None,
                 "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}

FAMILY = Family("qwen2", "Qwen2ForCausalLM", "biases on q, k, v (split with their heads), none on "
                                             "o; a window on the layers `layer_types` (or "
                                             "`use_sliding_window` from `max_window_layers`) "
                                             "names",
                features=_features,
                defaults=QWEN_DEFAULTS)
