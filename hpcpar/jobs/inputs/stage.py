"""What a generation or a scoring job sets up on every rank before its first forward: the
checkpoint's tokenizer and end-of-sequence ids, the runtime, and this rank's stage of the
model built from its slices of the checkpoint. Training finds its tokenizer here too."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ...checkpoint import Checkpoint, load_shard
from ...models.decoder import DecoderStage, matrix_stacks
from ...models.tensors import StageSpan, stage_tensors
from ...models.tokenizer import StoredTokenizer
from ...parallel.device import budget
from ...parallel.comm import CommStats
from ...parallel.errors import HpcparError
from ...parallel.mesh import Mesh
from ...parallel.ops import ops_for
from ...parallel.pipeline.partition import stage_layers
from ..faults import fault_point
from ..job import Job
from ..launch import everyone, phase
from ..layout import ParallelConfig
from ..runtime import experts_held, open_runtime
from ..watchdog import ActionBoard


def generation_config(ckpt: Checkpoint) -> dict:
    """The checkpoint's generation_config.json (kept at conversion), {} where it has none."""
    raw = ckpt.tokenizer_files().get("generation_config.json")
    if not raw:
        return {}
    try:
        config = json.loads(raw)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise HpcparError(f"{ckpt.path}: its generation_config.json is not a JSON object; "
                          "convert the model again from a folder with a valid one")
    return config


def eos_ids(ckpt: Checkpoint) -> tuple[int, ...]:
    """Every id that ends a row, as transformers' ``generate`` takes them: config.json's
    ``eos_token_id`` and generation_config.json's (Llama 3 instruct lists three), in order,
    each once."""
    ids = list(ckpt.config.eos_token_id)
    extra = generation_config(ckpt).get("eos_token_id")
    if extra is not None:
        extra = extra if isinstance(extra, list) else [extra]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in extra):
            raise HpcparError(f"{ckpt.path}: generation_config.json's eos_token_id {extra} is "
                              "not a list of token ids")
        ids += [t for t in extra if t not in ids]
    return tuple(ids)


# generation_config.json's sampling keys -> the generate flag that sets the same
SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                  "min_p": "--min-p", "repetition_penalty": "--repetition-penalty"}


def model_sampling(ckpt: Checkpoint) -> dict[str, float]:
    """The sampling transformers' ``generate`` takes from the checkpoint's
    generation_config.json unless told otherwise: with ``do_sample``, its temperature, top_k
    (50 where it names none, as transformers' default), top_p and min_p; its
    repetition_penalty either way. Only what differs from greedy decoding; {} for none."""
    config = generation_config(ckpt)
    asked = {}
    if config.get("do_sample"):
        asked = {"temperature": config.get("temperature", 1.0),
                 "top_k": config.get("top_k", 50), "top_p": config.get("top_p", 1.0),
                 "min_p": config.get("min_p")}
    asked["repetition_penalty"] = config.get("repetition_penalty")
    neutral = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
    return {k: v for k, v in asked.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            and v != neutral.get(k) and not (k == "temperature" and v == 0)}


def model_sampling_note(ckpt: Checkpoint, settings) -> str | None:
    """A note where the checkpoint's generation_config.json asks for sampling that
    transformers' ``generate`` applies by default (``model_sampling``) and the job's
    ``settings`` (a ``GenerateSection``) ask for none: hpcpar applies what the job says."""
    asked = model_sampling(ckpt)
    defaults = type(settings)()
    if not asked or any(getattr(settings, k) != getattr(defaults, k) for k in SAMPLING_FLAGS):
        return None
    said = ", ".join(f"{k} {v:g}" for k, v in asked.items())
    flags = " ".join(f"{SAMPLING_FLAGS[k]} {v:g}" for k, v in asked.items())
    return (f"hpcpar: note: the model's generation_config.json asks for {said}, which "
            f"transformers' generate() applies by default; hpcpar applies only the job's "
            f"settings (none here): pass {flags} for the model's")


def load_tokenizer(ckpt: Checkpoint) -> StoredTokenizer | None:
    """The checkpoint's tokenizer, read when a job first needs it (token ids do not: a damaged
    one fails only the jobs that need it), or None when it has none."""
    data = ckpt.tokenizer_files().get("tokenizer.json")
    return None if data is None else StoredTokenizer(data, ckpt.path)


@dataclass
class InferenceRank:
    mesh: Mesh
    backend: object
    stats: CommStats
    tp: object                  # the tensor-parallel group (MPI or NCCL)
    pp: object                  # the pipeline group (MPI)
    world: object               # every rank, host arrays (MPI)
    board: ActionBoard
    stage: DecoderStage
    shard: object               # the loaded slices' figures (seconds, bytes read)
    cp: object = None           # the context-parallel ring group, where cp > 1
    runtime: object = None      # the runtime the groups above come from

    @property
    def ep(self):
        """The ep group whose replicas' tokens this rank's experts serve, where ep > 1."""
        return self.runtime.ep

    def close(self) -> None:
        """Free the job's communicators and board (collective; at the job's end)."""
        self.runtime.close()


def sequence_parallel_problem(job: Job, layout: ParallelConfig, cfg) -> str | None:
    """Why this inference job cannot split its prefill along the sequence over tp, or None
    (``--sequence-parallel``: see ``DecoderStage._forward``)."""
    if not job.parallel.sequence_parallel:
        return None
    if layout.tp < 2:
        return (f"--sequence-parallel splits each prefill's positions over the tp ranks, and "
                f"tp is {layout.tp}: give --tp 2 or more, or drop --sequence-parallel")
    if getattr(cfg, "mla", False):
        return (f"--sequence-parallel does not split {cfg.model_type}'s latent attention yet: "
                "drop --sequence-parallel")
    return None


def open_stage(comm, job: Job, layout: ParallelConfig, ckpt: Checkpoint,
               dtype: np.dtype, check_backend=None) -> InferenceRank:
    """Collective over ``comm``: this rank's place, device, communicators and stage;
    ``check_backend(backend)`` refuses what the chosen backend cannot run, before loading."""
    cfg = ckpt.config
    rt = open_runtime(comm, job, layout, dtype)
    mesh, backend, tp = rt.mesh, rt.backend, rt.tp
    if check_backend is not None:
        everyone(comm, check_backend, backend)
    layers = stage_layers(cfg.num_hidden_layers, layout.pp, mesh.coord("pp"), layout.stage_layers)
    specs = stage_tensors(cfg, layers, mesh.is_first("pp"), mesh.is_last("pp"),
                          experts_held(cfg, rt.ep))
    with phase("loading the checkpoint"), budget.phase("load"):
        fault_point("load")
        span = StageSpan(layers, mesh.is_first("pp"), mesh.is_last("pp"))
        # the matrices read straight into their place in the products' layout: each weight
        # is on the device once, and merging q/k/v and gate/up copies nothing
        shard = everyone(comm, load_shard, ckpt, specs, mesh.coord("tp"), layout.tp, dtype=dtype,
                         backend=backend, stacks=matrix_stacks(specs, span))
        if job.model.lora:        # --lora: the adapter merged into the weights, as loaded
            from ...checkpoint.peft import apply_adapter
            everyone(comm, apply_adapter, job.model.lora, cfg, shard.tensors, mesh.coord("tp"),
                     layout.tp, backend)
        stage = DecoderStage.from_tensors(cfg, specs, shard.tensors, span, tp,
                                          ops_for(backend, rt.cp), dtype, rt.ep, shard.placed)
        stage.prefill_sequence_parallel = bool(job.parallel.sequence_parallel)
    backend.release_unused_device_memory()
    return InferenceRank(mesh, backend, rt.stats, tp, rt.pp, rt.world, rt.board, stage, shard,
                         rt.cp, rt)
