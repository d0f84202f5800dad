"""The Hugging Face baseline the benchmarks time: transformers' own class of the checkpoint's
family (``LlamaForCausalLM`` for Llama, by ``model_type``) holding the weights of an hpcpar
checkpoint, in float32 (as the runs it is compared with)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def transformers_llama(checkpoint: Path, threads: int, device: str = "cpu"):
    """The model with ``checkpoint``'s weights and torch on ``threads`` threads, or None when
    torch or transformers is not installed (the benchmark then leaves the column out);
    ``device``: where the model is made (a GPU's: its random first weights drawn there)."""
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
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config).float().to(device)
    state = {name: torch.from_numpy(read_tensor(ckpt, name).astype(np.float32))
             for name in ckpt.tensors}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight"
                                          and ckpt.config.tie_word_embeddings)]
    if missing or unexpected:       # a baseline on random weights would be a wrong number
        raise SystemExit(f"{checkpoint}: transformers' class does not take the checkpoint's "
                         f"tensors as they are (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}); a MoE model stacks its experts (benchmarks/moe.py "
                         "builds its baseline with transformers instead)")
    if ckpt.config.tie_word_embeddings:
        model.tie_weights()
    return model


def torch_adamw_steps(model, samples: np.ndarray, batch: int, steps: int, params=None,
                      cpu_times: list | None = None):
    """(the seconds, the loss) of each of ``steps`` training steps of ``model`` on consecutive
    batches of ``samples`` (rows of L + 1 tokens: the first L are the inputs, as hpcpar
    runs them, the last L the labels), as torch users run them: loss.backward(), then
    torch.optim.AdamW(fused=True), torch's fastest AdamW on the CPU (one fused kernel), over
    ``params`` (default: all), and the optimizer (its state's bytes); ``cpu_times`` gets each
    step's CPU seconds."""
    import torch
    model.train()
    params = list(model.parameters()) if params is None else params
    try:
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    times, losses = [], []
    for s in range(steps):
        ids = torch.from_numpy(samples[s * batch:(s + 1) * batch])
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if cpu_times is not None:
            cpu_times.append(time.process_time() - c0)
        losses.append(loss.item())
    return times, losses, opt
