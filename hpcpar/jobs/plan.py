"""``hpcpar plan``: what a layout costs, computed from the config alone (no MPI, no weights).

For each pipeline stage: its layers, the bytes of parameters a rank of that stage holds, its
KV cache for the job's batch and length, its activations at their peak and the device bytes
that makes at the rank's peak (``generate.memory``), and the bytes it all-reduces over tp and
sends to the next stage per token; then the pipeline bubble and the prefill schedule, drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..models.config import ModelConfig, ep_problems
from ..models.decoder import PREFILL_CHUNK
from ..models.kv_blocks import block_bytes, blocks_for
from ..models.kv_cache import kv_cache_bytes, kv_entry
from ..models.sharding import padded_vocab_size, piece_of
from ..models.tensors import StageSpan, stage_tensors
from ..parallel.context_parallel.ring_attention import ContextShard
from ..parallel.pipeline.partition import stage_layers
from ..parallel.pipeline.schedule import bubble_fraction, draw, gpipe_forward
from ..parallel.tensor.splits import expert_block
from .generate.memory import (StageMemory, paged_cache_bytes, rows_at_once,
                              stage_memory)
from .generate.paged_rows import paging_refusal
from .job import GenerateSection, TrainSection
from .layout import ParallelConfig


@dataclass(frozen=True)
class StageEstimate:
    """What ``hpcpar plan`` estimates for one pipeline stage, per rank of that stage."""
    stage: int
    layers: range
    weight_bytes: int          # per rank of this stage
    kv_cache_bytes: int        # per rank, for the largest replica's batch
    all_reduce_bytes_per_token: int
    send_bytes_per_token: int
    expert_bytes: int = 0              # per rank: its ep block of every MoE layer's experts
    all_to_all_bytes_per_token: int = 0
    activation_bytes: int = 0          # per rank, at their peak (``generate.memory``)
    loading_bytes: int = 0             # per rank, beside the weights while loading

    @property
    def peak_bytes(self) -> int:
        """The predicted peak of device bytes on a rank of this stage (loading ends before
        the KV cache and the activations exist)."""
        return StageMemory(self.kv_cache_bytes, self.activation_bytes,
                           self.loading_bytes).peak(self.weight_bytes)


def rank0_experts(cfg: ModelConfig, ep: int) -> range | None:
    """The experts ep rank 0 holds (every ep rank as many); None: all, or no experts."""
    if not cfg.moe_layers or ep_problems(cfg, ep):
        return None
    return expert_block(cfg.num_experts, ep, 0)


def all_to_all_bytes(cfg: ModelConfig, layers: range, ep: int, itemsize: int) -> int:
    """Bytes of a token that leave their rank over ep in these layers, uniform routing
    assumed: each MoE layer sends k copies of it, (ep - 1) / ep of them to other ranks, and
    they come back (the generation report counts the same: rows sent to other ranks)."""
    moe = sum(cfg.is_moe(i) for i in layers)
    return int(moe * 2 * cfg.experts_per_token * cfg.hidden_size * itemsize * (ep - 1) / ep)


def plan_stages(cfg: ModelConfig, layout: ParallelConfig, batch: int, prompt_length: int,
                max_new_tokens: int, itemsize: int,
                gen: GenerateSection | None = None) -> list[StageEstimate]:
    """Per stage, a rank's bytes and traffic for ``batch`` prompts of up to
    ``prompt_length`` tokens (``gen``: the job's batching and sampling; default: a job's
    defaults), on the device path: its KV cache paged where ``HPCPAR_PAGED_DEVICE=1`` and
    paging serves the job (``paged_cache_bytes``: every row at ``prompt_length``, an upper
    bound where prompts are shorter), else contiguous."""
    gen = gen or GenerateSection()
    rows = rows_at_once(layout, batch, prompt_length, gen)
    # the device path's KV cache: paged behind its switch, where paging serves the job
    paged = (gen.prefix_cache is not False
             and paging_refusal(gen, gen.prompt_logprobs is not None, layout.cp, True) is None)
    out = []
    for s in range(layout.pp):
        layers = stage_layers(cfg.num_hidden_layers, layout.pp, s, layout.stage_layers)
        first, last = s == 0, s == layout.pp - 1
        specs = stage_tensors(cfg, layers, first, last, rank0_experts(cfg, layout.ep))
        sizes = {spec.name: int(np.prod(piece_of(spec, cfg, 0, layout.tp).shape))
                 for spec in specs}
        weights = sum(sizes.values())
        experts = sum(sizes[spec.name] for spec in specs if spec.expert is not None)
        reduces = (2 * len(layers) + (1 if first else 0)) if layout.tp > 1 else 0
        kv_heads, k_dim, v_dim = kv_entry(cfg, layout.tp)
        kv = (paged_cache_bytes(len(layers), kv_heads, k_dim, rows.cached,
                                prompt_length + max_new_tokens, itemsize, gen, v_dim) if paged
              else kv_cache_bytes(len(layers), rows.cached, kv_heads,
                                  prompt_length + max_new_tokens, k_dim, itemsize, v_dim))
        memory = stage_memory(cfg, layout.tp, rows, prompt_length,
                              StageSpan(layers, first, last), specs, sizes, kv, itemsize, gen)
        out.append(StageEstimate(
            s, layers, weights * itemsize, kv,
            reduces * cfg.hidden_size * itemsize,
            0 if last else cfg.hidden_size * itemsize, experts * itemsize,
            all_to_all_bytes(cfg, layers, layout.ep, itemsize),
            memory.activations, memory.loading))
    return out


def format_plan(cfg: ModelConfig, layout: ParallelConfig, batch: int, prompt_length: int,
                max_new_tokens: int, itemsize: int, model_name: str,
                gen: GenerateSection | None = None) -> str:
    gen = gen or GenerateSection()
    stages = plan_stages(cfg, layout, batch, prompt_length, max_new_tokens, itemsize, gen)
    rows = rows_at_once(layout, batch, prompt_length, gen)
    total_params = sum(int(np.prod(s.shape)) for s in stage_tensors(
        cfg, range(cfg.num_hidden_layers), True, True))
    M = layout.micro_batches
    lines = [
        f"model: {model_name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, vocab "
        f"{cfg.vocab_size}, {total_params / 1e6:.1f} M parameters",
        f"layout: {layout.describe()} = {layout.world_size} ranks; "
        f"batch {batch} ({-(-batch // layout.dp)} per replica), prompt length {prompt_length}, "
        f"{max_new_tokens} new tokens, {itemsize}-byte values",
        "",
        f"{'stage':>5} {'layers':>8} {'weights/rank':>13} {'KV cache/rank':>14} "
        f"{'activations':>12} {'peak/rank':>10} "
        f"{'tp all-reduce/token':>20} {'pp send/token':>14}",
    ]
    moe = bool(cfg.moe_layers)
    if moe:
        lines[-1] += f" {'experts/rank':>13} {'ep all-to-all/token':>20}"
    for s in stages:
        span = f"{s.layers.start}-{s.layers.stop - 1}"
        lines.append(f"{s.stage:>5} {span:>8} {_size(s.weight_bytes):>13} "
                     f"{_size(s.kv_cache_bytes):>14} {_size(s.activation_bytes):>12} "
                     f"{_size(s.peak_bytes):>10} {_size(s.all_reduce_bytes_per_token):>20} "
                     f"{_size(s.send_bytes_per_token):>14}"
                     + (f" {_size(s.expert_bytes):>13} "
                        f"{_size(s.all_to_all_bytes_per_token):>20}" if moe else ""))
    top = max(stages, key=lambda s: s.peak_bytes)
    lines += [
        "",
        f"largest rank: {_size(top.peak_bytes)} at its peak: weights "
        f"{_size(top.weight_bytes)} + KV cache {_size(top.kv_cache_bytes)} + activations "
        f"{_size(top.activation_bytes)} (loading: the weights + {_size(top.loading_bytes)}, "
        "its NaN / inf check)",
        f"activations: {gen.batching} batching's peak on a GPU (or HPCPAR_OPS=device), of a "
        f"prefill of {rows.prefill} row(s) x {prompt_length} tokens at once and a decode step "
        f"of {rows.decode}; on the CPU (NumPy) a prefill runs {PREFILL_CHUNK} positions at "
        "a time",
        paged_cache_line(cfg, layout, top, batch, prompt_length + max_new_tokens, itemsize, gen),
    ] + ([mla_cache_line(cfg, layout.tp, itemsize)] if cfg.mla else []) + [
        f"pipeline bubble with {M} micro-batch(es): (S-1)/(S+M-1) = "
        f"{bubble_fraction(layout.pp, M):.1%}",
        "prefill schedule (GPipe forward; F<m> = micro-batch m computing, . = idle):",
        draw(gpipe_forward(layout.pp, M)),
    ]
    return "\n".join(lines)


def paged_cache_line(cfg: ModelConfig, layout: ParallelConfig, top: StageEstimate, batch: int,
                     row_length: int, itemsize: int, gen: GenerateSection) -> str:
    """What the paged KV cache of continuous batching on host arrays holds on the largest
    rank: its blocks, a row's, and with ``--kv-memory`` in bytes the rows at once; or why
    the job's rows are in a contiguous cache instead."""
    if gen.prefix_cache is False:
        return ("KV cache: contiguous, every prompt computed from its first token "
                "(--no-prefix-cache)")
    reason = paging_refusal(gen, gen.prompt_logprobs is not None, layout.cp, False)
    if reason:
        return f"KV cache: contiguous, no prefix cache: {reason}"
    kv_heads, k_dim, v_dim = kv_entry(cfg, layout.tp)
    per_block = block_bytes(len(top.layers), kv_heads, gen.kv_block_size, k_dim, itemsize,
                            v_dim)
    per_row = blocks_for(row_length, gen.kv_block_size)
    rows = -(-batch // layout.dp)
    text = (f"paged KV cache (continuous batching on host arrays): blocks of "
            f"{gen.kv_block_size} positions, {_size(per_block)} each on the largest rank; a "
            f"row of {row_length} tokens takes {per_row}, the replica's {rows} rows "
            f"{rows * per_row} ({_size(rows * per_row * per_block)}) less the blocks their "
            "prompts share")
    if gen.kv_memory > 1:
        blocks = int(gen.kv_memory // per_block)
        text += f"; --kv-memory {gen.kv_memory:.4g} B holds {blocks}: {blocks // per_row} rows"
    return text


def mla_cache_line(cfg: ModelConfig, tp: int, itemsize: int) -> str:
    """What latent attention's cache holds per token, against the same model's with
    ordinary attention (every head's keys and values, split over tp)."""
    layers, nh = cfg.num_hidden_layers, cfg.num_attention_heads
    latent = (cfg.kv_lora_rank + cfg.head_dim) * itemsize
    ordinary = nh * (cfg.qk_head_dim + cfg.v_head_dim) * itemsize
    return (f"KV cache per token: latent attention holds the latent ({cfg.kv_lora_rank}) and "
            f"the rope key ({cfg.head_dim}) once for every head, {latent} B a layer, "
            f"{_size(latent * layers)} over {layers} layers, on every tp rank (replicated); "
            f"the same model with ordinary attention would hold {nh} heads' keys "
            f"({cfg.qk_head_dim}) and values ({cfg.v_head_dim}), {_size(ordinary * layers)} "
            f"({_size(ordinary * layers // tp)} per rank at tp {tp}): "
            f"{ordinary / latent:.1f}x the latent's")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


PLAN_SEQ_LEN = 64          # the tokens per sample a training plan assumes when none is given


def format_train_plan(cfg: ModelConfig, layout: ParallelConfig, virtual_stages: int,
                      train: TrainSection, model_name: str,
                      sequence_parallel: bool = False, itemsize: int = 4) -> str:
    """Training: per stage, parameters, weights + gradients + optimizer state (split over dp
    x cp by ZeRO's stage), activations of one micro-batch and at the schedule's peak (the
    norms' and residuals' split over tp with ``sequence_parallel``); the bubble and the
    drawn schedule. ``itemsize``: the compute dtype's (float32 masters either way)."""
    from ..parallel.pipeline.training_schedules import (bubble_formula, micro_batch_problems,
                                                        training_schedule)
    p, M, V = layout.pp, layout.micro_batches, virtual_stages
    kind, seq_len = layout.schedule, train.seq_len or PLAN_SEQ_LEN
    rows, here = _rows_and_positions(layout, train)
    holders = layout.dp * layout.cp
    lines = [
        f"model: {model_name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}",
        f"layout: {layout.describe()} = {layout.world_size} ranks; "
        f"{kind} with {M} micro-batch(es) of {rows} x {seq_len} tokens per replica"
        + (f" ({here} positions per rank of cp {layout.cp})" if layout.cp > 1 else "")
        + (f", {V} chunks per stage" if V > 1 else "")
        + f"; {train.optimizer}; recompute {'full' if train.recompute == 'full' else 'none'}"
        + (f"; ZeRO-{train.zero} over dp x cp {holders}" if train.zero and holders > 1 else "")
        + (f"; sequence parallel over tp {layout.tp}" if sequence_parallel and layout.tp > 1
           else ""),
        "",
        f"{'stage':>5} {'layers':>10} {'params/rank':>12} {'weights+grads':>14} "
        f"{'optimizer':>10} {'act./micro-batch':>17} {'peak act.':>10} {'total':>10}",
    ]
    lora = lora_settings(train)
    if lora is not None:
        lines.insert(2, f"LoRA: rank {lora.rank}, alpha {lora.alpha:g}, on "
                     f"{','.join(lora.targets)}: the base frozen (its weights alone), the "
                     "adapters trained (weights, gradients, optimizer state); params/rank "
                     "counts both")
    if cfg.moe_layers:
        lines.insert(2, f"experts: {cfg.num_experts} per MoE layer, top-{cfg.experts_per_token}"
                     f", {cfg.num_experts // max(1, layout.ep)} per rank (ep {layout.ep}); "
                     "expert gradients summed over the dp / ep replicas holding them")
    if train.zero >= 2 and holders > 1:
        lines.insert(2, _zero_units_line(cfg, layout, train.zero, itemsize))
    stages = train_plan_bytes(cfg, layout, V, train, sequence_parallel, itemsize)
    lines += [_train_stage_row(s, b) for s, b in enumerate(stages)]
    last = stages[-1]
    scratch = ("none: --fused-optimizer" if train.fused else
               f"{_size(last['scratch'])} there; none with --fused-optimizer")
    lines.append(f"total: the state (and ZeRO's transient), and the larger of the peak "
                 f"activations with the largest weight gradient made whole in the backward "
                 f"({_size(last['gradient_product'])} on the last stage) and the optimizer "
                 f"step's float32 scratch ({scratch})")
    problems = micro_batch_problems(kind, p, M, V)
    if problems:
        return "\n".join(lines + ["", "cannot run: " + "; ".join(problems)])
    lines += [
        "",
        f"pipeline bubble: {bubble_formula(kind, p, M, V):.1%} by the {kind} formula "
        "(F = 1, B = 2, I = W = 1 units)",
        "schedule (F<m> forward, B<m> backward, I<m>/W<m> its input/weight halves, "
        ".<c> chunk c, . idle):",
        draw(training_schedule(kind, p, M, V)),
    ]
    return "\n".join(lines)


def _largest_layer(cfg: ModelConfig, layout: ParallelConfig) -> int:
    """The parameters of the largest decoder layer on one rank."""
    experts = rank0_experts(cfg, layout.ep)
    return max(sum(int(np.prod(piece_of(spec, cfg, 0, layout.tp).shape))
                   for spec in stage_tensors(cfg, range(i, i + 1), False, False, experts))
               for i in range(cfg.num_hidden_layers))


def zero_transient_bytes(cfg: ModelConfig, layout: ParallelConfig, zero: int,
                         itemsize: int) -> int:
    """What ZeRO 2 and 3 hold whole at once, at most: float32 gradients of a layer and of
    the head and final norm (a tied embedding's through the whole backward), and with stage 3
    the weights of two layers (one gathered ahead) and of the head and final norm."""
    if zero < 2 or layout.dp * layout.cp == 1:
        return 0
    layer = _largest_layer(cfg, layout)
    vocab = (padded_vocab_size(cfg.vocab_size, layout.tp) // layout.tp + 1) * cfg.hidden_size
    return (layer + vocab) * 4 + ((2 * layer + vocab) * itemsize if zero == 3 else 0)


def _zero_units_line(cfg: ModelConfig, layout: ParallelConfig, zero: int,
                     itemsize: int) -> str:
    layer = _largest_layer(cfg, layout)
    text = (f"ZeRO-{zero}: each layer's gradients whole while its backward runs (the largest "
            f"layer: {_size(layer * 4)} per rank), summed into each rank's piece every "
            "micro-batch")
    if zero == 3:
        text += (f"; its weights gathered before its forward and its backward, the next "
                 f"layer's ahead ({_size(2 * layer * itemsize)} for two layers)")
    return (text + f"; with the head's and the embedding's: at most "
            f"{_size(zero_transient_bytes(cfg, layout, zero, itemsize))} at once, counted in "
            "each stage's total")


def lora_settings(train: TrainSection):
    """The run's LoRA settings (``models.lora.LoraSettings``), or None without LoRA."""
    from ..models.lora import DEFAULT_TARGETS, LoraSettings
    if not train.lora_rank:
        return None
    return LoraSettings(train.lora_rank, train.lora_alpha or train.lora_rank,
                        tuple(train.lora_targets or DEFAULT_TARGETS))


def adapter_count(cfg: ModelConfig, chunks, train: TrainSection, tp: int,
                  experts: range | None = None) -> tuple[int, int]:
    """The adapter parameters a rank of tp ``tp`` holds for the layers of ``chunks`` (of the
    experts ``experts`` only: its ep block), and how many of them are the experts'."""
    from ..models.lora import adapter_specs
    settings = lora_settings(train)
    sizes = [(int(np.prod(piece_of(spec, cfg, 0, tp).shape)), spec.expert is not None)
             for layers in chunks for spec in adapter_specs(cfg, layers, settings, experts)]
    return sum(n for n, _ in sizes), sum(n for n, expert in sizes if expert)


def train_plan_bytes(cfg: ModelConfig, layout: ParallelConfig, virtual_stages: int,
                     train: TrainSection, sequence_parallel: bool = False,
                     itemsize: int = 4) -> list[dict]:
    """The numbers of ``format_train_plan``'s rows: per stage, a rank's bytes
    (``train_stage_bytes``); ``total`` is the row's total, the plan's peak of the rank."""
    rows, here = _rows_and_positions(layout, train)
    return [train_stage_bytes(cfg, layout, virtual_stages, s, train, rows, here,
                              sequence_parallel, itemsize) for s in range(layout.pp)]


def _rows_and_positions(layout: ParallelConfig, train: TrainSection) -> tuple[int, int]:
    """A micro-batch's rows, and the positions of each a rank keeps activations of: under
    context parallelism its own (the optimizer state is split over dp x cp, the ranks that
    hold the same weights)."""
    seq_len = train.seq_len or PLAN_SEQ_LEN
    rows = train.global_batch // (layout.dp * layout.micro_batches)
    return rows, ContextShard(seq_len, layout.cp, 0).max_local if layout.cp > 1 else seq_len


def _train_stage_row(s: int, b: dict) -> str:
    """Stage ``s``'s line of the training plan, from its bytes ``b``."""
    span = ",".join(f"{r.start}-{r.stop - 1}" for r in b["chunks"])
    return (f"{s:>5} {span:>10} {b['params'] / 1e6:>11.2f}M "
            f"{_size(b['weights'] + b['gradients']):>14} {_size(b['optimizer']):>10} "
            f"{_size(b['activations_per_micro_batch']):>17} {_size(b['activations']):>10} "
            f"{_size(b['total']):>10}")


def train_stage_bytes(cfg: ModelConfig, layout: ParallelConfig, V: int, s: int,
                      train: TrainSection, rows: int, here: int,
                      sequence_parallel: bool = False, itemsize: int = 4) -> dict:
    """Stage ``s``'s bytes per rank in training: ``weights``, ``gradients``, ``optimizer``
    state, ``activations`` at the schedule's peak (``activations_per_micro_batch`` each),
    ZeRO's ``transient``, the largest ``gradient_product`` (a weight's gradient made whole in
    the backward before it is added to its buffer, while the activations are held), the
    optimizer step's ``scratch``, and their ``total`` (the rank's peak: the state, ZeRO's
    transient and the larger of the backward's and the step's own); ``params`` per rank
    and the layer ``chunks``."""
    from ..parallel.pipeline.training_schedules import peak_activations_formula
    from .train.memory import activation_bytes, optimizer_scratch_bytes, parameter_state_bytes
    from .train.setup import chunk_layers
    p, M, kind = layout.pp, layout.micro_batches, layout.schedule
    chunks = chunk_layers(cfg.num_hidden_layers, layout, s, V)
    count, experts, act, product = 0, 0, 0, 0
    for c, layers in enumerate(chunks):
        v = c * p + s
        first, last = v == 0, v == p * V - 1
        for spec in stage_tensors(cfg, layers, first, last, rank0_experts(cfg, layout.ep)):
            n = int(np.prod(piece_of(spec, cfg, 0, layout.tp).shape))
            count += n
            experts += n if spec.expert is not None else 0
            # dW = dY^T X of a matrix (the embedding's rows are added in place, unless it
            # is the tied head too)
            if len(spec.shape) == 2 and (spec.role != "embed" or last):
                product = max(product, n)
        act += activation_bytes(cfg, layout.tp, len(layers), rows, here, first, last,
                                train.recompute == "full",
                                sequence_parallel=sequence_parallel and layout.tp > 1)
    per_mb = act // len(chunks)
    peak = peak_activations_formula(kind, p, M, s, V) * per_mb
    base = 0
    if train.lora_rank:          # the base frozen (its weights alone), the adapters trained
        base = count
        count, experts = adapter_count(cfg, chunks, train, layout.tp,
                                       rank0_experts(cfg, layout.ep))
        product = 0              # the adapters' products: rank x width, too small to count
    # dense weights held by dp x cp, an expert's by the dp / ep replicas holding it (x cp)
    st = parameter_state_bytes(count, experts, layout.dp * layout.cp,
                               layout.dp // layout.ep * layout.cp, train.zero, train.optimizer,
                               itemsize)
    st["weights"] += base * itemsize
    transient = zero_transient_bytes(cfg, layout, train.zero, itemsize)
    scratch = optimizer_scratch_bytes(count, experts, layout.dp * layout.cp,
                                      layout.dp // layout.ep * layout.cp, train.zero,
                                      bool(train.fused))
    return {"params": base + count, **st, "activations_per_micro_batch": per_mb,
            "activations": peak, "transient": transient,
            "gradient_product": product * itemsize, "scratch": scratch,
            "total": sum(st.values()) + transient + max(peak + product * itemsize, scratch),
            "chunks": chunks}


