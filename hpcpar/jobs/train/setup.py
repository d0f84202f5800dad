"""A training job's settings checked and resolved before any rank communicates: the layout
and schedule, the optimizer, the data, the output folder, the checkpoint to resume from,
which layers each model chunk of a stage holds, and this rank's chunks loaded from the
checkpoint (with the optimizer state when resuming)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...checkpoint import Checkpoint, load_shard
from ...checkpoint.files import check_output, check_space
from ...models.chat import ChatTemplate
from ...models.sharding import piece_of
from ...models.tensors import StageSpan, stage_tensors
from ...parallel.comm import create_communicator
from ...parallel.context_parallel.ring_attention import ContextShard
from ...parallel.device.dtypes import float_dtype
from ...parallel.errors import HpcparError
from ...parallel.mesh import Mesh
from ...parallel.ops import ops_for
from ...parallel.optim.optimizers import STATE_NAMES
from ...parallel.optim.settings import OptimizerSettings
from ...parallel.pipeline.partition import stage_layers
from ...parallel.tensor_parallel.layers import LoraAdapter
from ...parallel.pipeline.training_schedules import micro_batch_problems
from ..faults import fault_point
from ..inputs.stage import load_tokenizer
from ..job import Job
from ..launch import everyone
from ..layout import ParallelConfig
from ..runtime import experts_held
from . import checkpoint as tc
from .model_chunk import AuxLoss, ModelChunk
from .chat_data import LONG_ROWS
from .data import Dataset, load_dataset
from ...models.lora import adapter_pairs
from .lora import LoraRun, adapter_bytes, adapter_pieces, lora_run
from .lora import open_resume as lora_open_resume
from .params import FrozenParam, NotHeld, kv_replicas, make_adapter_param, make_params

RECOMPUTE = ("none", "full")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class CheckedTraining:
    """A training job as ``validate`` checked it on every rank: what its run works from."""
    layout: ParallelConfig
    dtype: np.dtype                    # compute dtype (master weights are float32)
    virtual_stages: int
    optimizer: OptimizerSettings
    dataset: Dataset
    out_dir: Path
    resume: tuple[Checkpoint, dict] | None
    start_step: int
    samples_start: int
    aux_coef: float = 0.0              # the router's load-balancing loss (MoE)
    lora: LoraRun | None = None        # a LoRA run: the base frozen, its adapters trained
    sequence_parallel: bool = False    # activations between the tp pairs split over tp


def validate(job: Job, ckpt: Checkpoint, world_size: int) -> CheckedTraining:
    """The training job checked against the checkpoint and the world, every rank alike:
    what is wrong in one line (all of it), before any weight is read."""
    cfg, tr = ckpt.config, job.train
    layout = job.parallel.layout(world_size, default_schedule="1f1b")
    V = job.parallel.virtual_stages
    aux = cfg.router_aux_loss_coef if tr.aux_loss_coef is None else tr.aux_loss_coef
    settings = OptimizerSettings.of(tr)
    problems = plan_problems(job, cfg, layout, world_size)
    if not job.data.dataset:
        problems.append("no training data: give --data (a .npy, .bin or .jsonl file)")
    if not job.output.path:
        problems.append("no output folder: give --out DIR")
    if problems:
        raise HpcparError("invalid training job: " + "; ".join(problems))
    dataset = load_dataset(job.data.dataset, cfg, tr.seq_len, load_tokenizer(ckpt),
                           ChatTemplate.from_files(ckpt.tokenizer_files(), ckpt.path),
                           tr.long_rows, tr.pack)
    if dataset.seq_len < layout.cp:
        raise HpcparError(f"cp {layout.cp} splits each sequence over {layout.cp} ranks, but the "
                          f"sequences have {dataset.seq_len} positions: every rank needs at "
                          f"least one; use a cp of at most {dataset.seq_len} or longer "
                          "sequences (--seq-len)")
    if job.parallel.sequence_parallel:
        _check_sequence_split(dataset.seq_len, layout)
    out_dir = Path(job.output.path)
    check_output(out_dir, {"checkpoint": ckpt.path, "data": dataset.source}, folder=True)
    resume_path = tc.resolve_resume(tr.resume, out_dir)
    resume = None if resume_path is None else (lora_open_resume(resume_path, ckpt)
                                                or tc.open_resume(resume_path, ckpt))
    lora = lora_run(tr, cfg, resume[1] if resume else None)
    if lora is not None and tr.zero >= 2:          # a LoRA run resumed without its flags
        raise HpcparError(_LORA_ZERO.format(zero=tr.zero))
    # room for a checkpoint now, not after every step has run (each save checks again)
    states = STATE_NAMES[settings.optimizer]
    check_space(out_dir / "step-1.h5", tc.checkpoint_bytes(ckpt, states) if lora is None
                else adapter_bytes(cfg, lora, len(states)))
    start_step = samples_start = 0
    if resume is not None:
        attrs = resume[1]
        if attrs.get("optimizer") != settings.optimizer:
            raise HpcparError(f"{resume_path}: trained with optimizer {attrs.get('optimizer')!r}"
                              f", this job uses {settings.optimizer!r}; keep the optimizer to "
                              "resume")
        start_step, samples_start = int(attrs["step"]), int(attrs["samples"])
    return CheckedTraining(layout, float_dtype(job.model.dtype), V, settings, dataset, out_dir,
                           resume, start_step, samples_start, float(aux or 0.0), lora,
                           bool(job.parallel.sequence_parallel))


def plan_problems(job: Job, cfg, layout: ParallelConfig, world_size: int) -> list[str]:
    """What a training job cannot run, from its settings and the model alone (``hpcpar plan
    --train`` refuses the same, before any data or output is looked at)."""
    tr = job.train
    aux = cfg.router_aux_loss_coef if tr.aux_loss_coef is None else tr.aux_loss_coef
    return (_layout_problems(cfg, layout, job.parallel.virtual_stages, tr.global_batch,
                             world_size)
            + _setting_problems(job, cfg, layout, aux) + OptimizerSettings.of(tr).problems())


def _layout_problems(cfg, layout: ParallelConfig, V: int, global_batch: int,
                     world_size: int) -> list[str]:
    """What the layout, the schedule and the batch cannot run."""
    problems = layout.problems(cfg, world_size)
    if not problems:
        problems += micro_batch_problems(layout.schedule, layout.pp, layout.micro_batches, V)
    if layout.schedule == "interleaved" and V > 1:
        if cfg.num_hidden_layers % (layout.pp * V):
            problems.append(f"the interleaved schedule cuts the {cfg.num_hidden_layers} layers "
                            f"into pp * virtual_stages = {layout.pp * V} equal chunks; choose "
                            "pp and virtual_stages whose product divides the layers")
        if layout.stage_layers is not None:
            problems.append("stage_layers cannot be combined with the interleaved schedule")
    replicas_x_mbs = layout.dp * layout.micro_batches
    if global_batch < 1 or global_batch % replicas_x_mbs:
        problems.append(f"global batch {global_batch} is not divisible by dp * micro_batches"
                        f" = {layout.dp} * {layout.micro_batches} = {replicas_x_mbs}")
    return problems


def _setting_problems(job: Job, cfg, layout: ParallelConfig, aux) -> list[str]:
    """What the training settings cannot run."""
    tr, problems = job.train, []
    if tr.recompute not in RECOMPUTE:
        problems.append(f"recompute {tr.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if tr.long_rows not in LONG_ROWS:
        problems.append(f"long_rows {tr.long_rows!r} is not one of {', '.join(LONG_ROWS)}")
    if job.model.dtype not in COMPUTE_DTYPES:
        problems.append(f"training computes in {', '.join(COMPUTE_DTYPES)} (float32 master "
                        f"weights), not {job.model.dtype}")
    problems += _router_problems(cfg, aux, layout.pp)
    if job.parallel.sequence_parallel and layout.tp < 2:
        problems.append(f"--sequence-parallel splits each sequence over the tp ranks, and tp "
                        f"is {layout.tp}: give --tp 2 or more, or drop --sequence-parallel")
    elif job.parallel.sequence_parallel and getattr(cfg, "mla", False):
        problems.append(f"--sequence-parallel does not split {cfg.model_type}'s latent "
                        "attention yet: drop --sequence-parallel")
    if job.model.lora:
        problems.append(f"model.lora {job.model.lora!r} applies an adapter in generate and "
                        "score; to train one give --lora-rank, or --lora-from a peft folder")
    if (tr.lora_rank or tr.lora_from) and tr.zero >= 2:
        problems.append(_LORA_ZERO.format(zero=tr.zero))
    return problems


_LORA_ZERO = ("--zero {zero} splits what the optimizer trains over dp, and a LoRA run trains "
              "only its small adapters (the base is frozen, not split): use --zero 1 or 0 "
              "with --lora-rank")


def _check_sequence_split(seq_len: int, layout: ParallelConfig) -> None:
    """Sequence parallelism cuts each rank's positions (its cp shard's) into tp equal parts."""
    lengths = sorted({ContextShard(seq_len, layout.cp, r).local_length()
                      for r in range(layout.cp)})
    odd = [n for n in lengths if n % layout.tp]
    if odd:
        where = (f"{seq_len} positions per row" if layout.cp == 1 else
                 f"{'/'.join(map(str, lengths))} positions per cp rank (of {seq_len})")
        raise HpcparError(f"--sequence-parallel splits the {where} into tp {layout.tp} equal "
                          f"parts, and tp does not divide {odd[0]}: use sequences whose "
                          f"positions per cp rank are a multiple of {layout.tp} (--seq-len, "
                          f"or rows of that many tokens plus one), or drop --sequence-parallel")


def _router_problems(cfg, aux: float, pp: int) -> list[str]:
    """Why a mixture of experts' router cannot train as asked (``aux``: the load-balancing
    loss's coefficient)."""
    out = []
    if aux and not cfg.moe_layers:
        out.append(f"aux_loss_coef {aux}: the router's load-balancing loss belongs to a mixture "
                   f"of experts; {cfg.model_type} has none (drop --aux-loss-coef)")
    elif aux and (cfg.router_scoring != "softmax" or cfg.expert_groups > 1
                  or cfg.routed_scaling != 1.0):
        out.append(f"aux_loss_coef {aux}: the load-balancing loss is the softmax routers' "
                   f"(Mixtral's, Qwen's); transformers' {cfg.model_type} has none for its "
                   "router (drop --aux-loss-coef)")
    elif aux and pp > 1:
        out.append(f"aux_loss_coef {aux} with pp {pp}: the load-balancing loss pools every "
                   "layer's routing of a micro-batch, which no stage holds alone; run it with "
                   "pp 1 (tp, cp, dp and ep split the rest), or --aux-loss-coef 0")
    if cfg.router_jitter_noise:
        out.append(f"router_jitter_noise {cfg.router_jitter_noise}: Mixtral's random jitter of "
                   "the router's input in training is not supported; set it to 0 in "
                   "config.json and convert again")
    return out


def chunk_layers(num_layers: int, layout: ParallelConfig, stage: int,
                 virtual_stages: int) -> list[range]:
    """The layers of each chunk of ``stage``: one contiguous range, or with V chunks the
    ranges of virtual stages stage, stage + p, ... (equal pieces of num_layers / pV)."""
    if virtual_stages == 1:
        return [stage_layers(num_layers, layout.pp, stage, layout.stage_layers)]
    per = num_layers // (layout.pp * virtual_stages)
    return [range(v * per, (v + 1) * per)
            for v in range(stage, layout.pp * virtual_stages, layout.pp)]


def load_chunks(comm, mesh: Mesh, checked: CheckedTraining, ckpt: Checkpoint, tp, backend,
                recompute: bool, cp=None, ep=None, zero: int = 0):
    """This rank's model chunks, their parameters (from --checkpoint, or from the checkpoint
    being resumed; of a MoE layer, this rank's ep block of experts only) and, when resuming,
    the optimizer state of those parameters. Under ZeRO-3 the params split over their
    holders are not read here (``NotHeld``): each rank reads its pieces alone
    (``sharded_units``), so no rank holds its whole slice, even while loading."""
    cfg, layout, V, xp = ckpt.config, checked.layout, checked.virtual_stages, backend.xp
    source = checked.resume[0] if checked.resume else ckpt
    ops = ops_for(backend, cp)
    chunks, params, all_specs = [], [], []
    aux = (AuxLoss(checked.aux_coef, layout.dp * layout.micro_batches, cp, mesh.coord("cp") == 0)
           if checked.aux_coef else None)
    for c, layers in enumerate(chunk_layers(cfg.num_hidden_layers, layout, mesh.coord("pp"), V)):
        v = c * layout.pp + mesh.coord("pp")
        first, last = v == 0, v == layout.pp * V - 1
        specs = stage_tensors(cfg, layers, first, last, experts_held(cfg, ep))
        fault_point("load")
        if checked.lora is not None:
            base, adapters, aspecs = _lora_chunk(comm, mesh, checked, ckpt, specs, layers,
                                                 backend)
            chunks.append(ModelChunk(cfg, base, StageSpan(layers, first, last), tp, ops,
                                     recompute, ep, aux, trainable=list(adapters.values()),
                                     sequence_parallel=checked.sequence_parallel))
            params += adapters.values()
            all_specs += aspecs
            continue
        lazy = [s for s in specs if zero == 3 and _split_over_holders(s, layout)]
        shard = everyone(comm, load_shard, source, [s for s in specs if s not in lazy],
                         mesh.coord("tp"), layout.tp, np.float32, backend)
        tensors = shard.tensors | {s.name: NotHeld("weights", s.name, piece_of(
            s, cfg, mesh.coord("tp"), layout.tp).shape, np.float32) for s in lazy}
        chunk_params = make_params(cfg, specs, tensors, xp, mesh.coord("tp"), layout.tp,
                                   last_stage_tied_copy=last and not first, dtype=checked.dtype,
                                   sequence_parallel=checked.sequence_parallel)
        chunks.append(ModelChunk(cfg, chunk_params, StageSpan(layers, first, last), tp, ops,
                                 recompute, ep, aux,
                                 sequence_parallel=checked.sequence_parallel))
        params += chunk_params.values()
        all_specs += [s for s in specs if s not in lazy]
    states = None
    if checked.resume:
        states = everyone(comm, tc.load_optimizer_state, checked.resume[0], all_specs,
                          STATE_NAMES[checked.optimizer.optimizer], mesh.coord("tp"), layout.tp,
                          backend)
    backend.release_unused_device_memory()
    return chunks, params, states


def _split_over_holders(spec, layout: ParallelConfig) -> bool:
    """Whether ZeRO splits ``spec`` over more than one rank: dense weights over dp x cp, a
    MoE layer's experts over the dp / ep replicas holding them (x cp)."""
    holders = layout.dp // layout.ep if spec.expert is not None else layout.dp
    return holders * layout.cp > 1


def _lora_chunk(comm, mesh: Mesh, checked: CheckedTraining, ckpt: Checkpoint, specs,
                layers: range, backend):
    """A LoRA run's chunk: the base's tensors ``specs`` frozen, read from --checkpoint in the
    compute dtype, and their adapters (from the checkpoint resumed, --lora-from, or new),
    each attached to its base. Returns (base by name, adapters by name, adapter specs)."""
    cfg, tp_rank, tp_size = ckpt.config, mesh.coord("tp"), mesh.size("tp")
    run = checked.lora
    shard = everyone(comm, load_shard, ckpt, specs, tp_rank, tp_size, checked.dtype, backend)
    base = {s.name: FrozenParam(shard.tensors.pop(s.name), spec=s) for s in specs}
    held = sorted({s.expert for s in specs if s.expert is not None})   # this rank's ep block
    aspecs = run.specs(cfg, layers, held)
    if checked.resume:
        values = everyone(comm, load_shard, checked.resume[0], aspecs, tp_rank, tp_size,
                          np.float32, backend).tensors
    else:
        values = everyone(comm, adapter_pieces, run, aspecs, cfg, tp_rank, tp_size, backend)
    adapters = {s.name: make_adapter_param(s, values[s.name], backend.xp, cfg, tp_rank, tp_size,
                                           checked.dtype) for s in aspecs}
    for a, b in adapter_pairs(aspecs):       # an expert's gate and up share their A
        base[b.base].lora = LoraAdapter(adapters[a.name], adapters[b.name], run.settings.scale)
    return base, adapters, aspecs


def kv_group(mesh: Mesh, cfg, backend, stats, timeout: float):
    """The tp ranks that hold the same KV head, when kv_heads < tp (else None)."""
    replicas = kv_replicas(cfg, mesh.size("tp"))
    if replicas == 1:
        return None
    sub = mesh.group("tp").mpi_comm.Split(mesh.coord("tp") // replicas, mesh.coord("tp"))
    return create_communicator(sub, "mpi", backend, stats, "kv", timeout, check=False)
