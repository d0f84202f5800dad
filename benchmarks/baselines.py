"""The Hugging Face baseline the benchmarks time: transformers' own class of the checkpoint's
family (``LlamaForCausalLM`` for Llama, by ``model_type``) holding the weights of an hpcpar
checkpoint, in float32 (as the runs it is compared with)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def transformers_llama(checkpoint: Path, threads: int):
    """The model with ``checkpoint``'s weights and torch on ``threads`` threads, or None when
    torch or transformers is not installed (the benchmark then leaves the column out)."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from hpcpar.checkpoint import open_checkpoint, read_tensor
    torch.set_num_threads(threads)
    ckpt = open_checkpoint(checkpoint)
    settings = dict(ckpt.hf_config)
    config = transformers.AutoConfig.for_model(settings.pop("model_type", "llama"), **settings)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    state = {name: torch.from_numpy(read_tensor(ckpt, name).astype(np.float32))
             for name in ckpt.tensors}
    model.load_state_dict(state, strict=False)
    if ckpt.config.tie_word_embeddings:
        model.tie_weights()
    return model
