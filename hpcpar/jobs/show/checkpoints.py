"""A checkpoint for ``show``: family, shape, parameters, dtype, size; a training
checkpoint's step, samples, optimizer and layout (and ZeRO's stage); a LoRA run's
checkpoint's adapters (rank, alpha, targets) and the base model they belong to."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .reading import plain


def checkpoint(path: Path) -> dict:
    from ...checkpoint import open_checkpoint
    from ...checkpoint.parts import stored_bytes
    from ...checkpoint.peft import open_run_checkpoint, run_settings
    lora = run_settings(path)               # a LoRA run's: its adapters, no base
    ckpt = open_run_checkpoint(path) if lora else open_checkpoint(path)
    cfg = ckpt.config
    params = sum(int(np.prod(s.shape)) for s in ckpt.tensors.values())
    out = {"kind": "checkpoint", "path": str(path), "model_type": cfg.model_type,
           "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
           "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
           "vocab_size": cfg.vocab_size, "parameters": params, "dtype": str(ckpt.dtype),
           "bytes": stored_bytes(path),           # with the part files of a parallel save
           "tokenizer": "tokenizer.json" in ckpt.tokenizer_files(), "notes": []}
    if cfg.moe_layers:
        out["experts"] = {"experts": cfg.num_experts, "top_k": cfg.experts_per_token,
                          "moe_layers": len(cfg.moe_layers)}
    if lora:
        settings, base = lora
        out["lora"] = {"rank": settings.rank, "alpha": settings.alpha,
                       "targets": list(settings.targets), "base": base}
    import h5py
    with h5py.File(path, "r") as f:
        if "train" in f:
            train = {k: plain(v) for k, v in f["train"].attrs.items()}
            out["training"] = {k: train[k] for k in ("step", "samples", "optimizer", "layout",
                                                     "zero") if k in train}
    return out
