"""Named model shapes and random weights for them (``hpcpar init``), deterministic by seed.

Each tensor draws from its own generator seeded by (seed, name), so a tensor's values do not
depend on the order tensors are made in or on the layout that later loads them, and the file
is written one tensor at a time.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from ..models.config import ModelConfig
from ..models.tensors import TensorSpec, stored_tensors
from ..parallel.errors import HpcparError
from .files import OutputLock, check_output
from .writer import CheckpointWriter


def _llama(**fields) -> dict:
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
            "initializer_range": 0.02}
    base.update(fields)
    return base


PRESETS: dict[str, dict] = {
    # For tests and the demo: splits over tp 1, 2, 4, 8 (KV heads replicated at tp 4 and 8).
    "tiny": _llama(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256),
    # ~100M parameters, for benchmarks on a CPU; splits over tp 1, 2, 4, 8.
    "100m": _llama(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                   num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                   max_position_embeddings=2048, tie_word_embeddings=True),
    # The shape of Llama 3.2 1B (tied embeddings; 2.5 GB in bfloat16).
    "llama3-1b": _llama(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
                        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
                        tie_word_embeddings=True,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    # The shape of Llama 3.1 8B, for planning (random weights, 16 GB in bfloat16).
    "llama3-8b": _llama(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        max_position_embeddings=131072, rope_theta=500000.0,
                        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
}


def preset_config(name: str) -> dict:
    try:
        return dict(PRESETS[name])
    except KeyError:
        raise HpcparError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def random_tensor(spec: TensorSpec, seed: int, std: float = 0.02) -> np.ndarray:
    """Float32 weights for ``spec``: N(0, std) for matrices and biases, and norm weights near 1
    (1 + N(0, 0.1), not exactly 1, so a misplaced norm shows up in the numbers)."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    if spec.role.endswith("norm"):
        return (1.0 + 0.1 * rng.standard_normal(spec.shape)).astype(np.float32)
    return (std * rng.standard_normal(spec.shape)).astype(np.float32)


def init_checkpoint(out: str | Path, preset: str | dict, seed: int = 0,
                    dtype: np.dtype = np.float32) -> ModelConfig:
    """Write a checkpoint of random weights for ``preset`` (a name or a config.json dict)."""
    hf = preset_config(preset) if isinstance(preset, str) else dict(preset)
    label = f"hpcpar init --preset {preset} --seed {seed}" if isinstance(preset, str) else "init"
    check_output(out, kind="checkpoint")
    with OutputLock(out), CheckpointWriter(out, hf, dtype, source=label) as w:
        for spec in stored_tensors(w.config):
            w.write(spec, random_tensor(spec, seed, hf.get("initializer_range", 0.02)))
    return w.config
