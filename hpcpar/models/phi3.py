"""Phi-3: Llama with q, k, v fused into one ``qkv_proj`` and gate, up into one
``gate_up_proj``. The fused tensors stay fused in the checkpoint; each part is a tensor of
its own in the computation, and each tp rank reads (and a training run writes) only its
slices of each part."""

from .family import Family


def _features(hf) -> dict:
    rope = hf.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return {"qkv_bias": False, "o_bias": False, "mlp_bias": False,
            "sliding_window": hf.get("sliding_window"), "partial_rotary": float(partial)}


FAMILY = Family("phi3", "Phi3ForCausalLM", "q, k, v fused in qkv_proj and gate, up in "
                "gate_up_proj (each tp rank reads only its slices of each part)",
                features=_features,
                fused={"self_attn.qkv_proj.weight": ("q", "k", "v"),
                       "mlp.gate_up_proj.weight": ("gate", "up")})
