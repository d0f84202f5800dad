"""Qwen2 / Qwen2.5: Llama with biases on q, k and v (none on o), split with their heads."""

from .family import Family


def _features(hf) -> dict:
    return {"qkv_bias": True, "o_bias": False, "mlp_bias": False,
            "sliding_window": _window(hf)}


def _window(hf) -> int | None:
    """Qwen2 configs carry a sliding window that only applies when ``use_sliding_window``."""
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        return int(hf["sliding_window"])
    return None


FAMILY = Family("qwen2", "Qwen2ForCausalLM", "q, k, v biases (column-parallel with their "
                "heads), no o bias", features=_features)
