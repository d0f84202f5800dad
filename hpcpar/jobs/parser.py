"""The command line's grammar: every command's flags (``build_parser``), and which job setting
each flag sets (``JOB_FLAGS``, ``TRAIN_FLAGS``). ``cli`` parses with it and runs the
command; the command block of docs/reference/cli.md lists the same flags
(``tests/test_env_and_help.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import __version__
from ..parallel.errors import HpcparError
from .launch import world

# flag dest -> (job section, key)
JOB_FLAGS = {
    "checkpoint": ("model", "checkpoint"), "dtype": ("model", "dtype"), "lora": ("model", "lora"),
    "prompts": ("data", "prompts"),
    "dp": ("parallel", "dp"), "pp": ("parallel", "pp"), "tp": ("parallel", "tp"),
    "cp": ("parallel", "cp"), "ep": ("parallel", "ep"),
    "micro_batches": ("parallel", "micro_batches"), "stage_layers": ("parallel", "stage_layers"),
    "backend": ("parallel", "backend"), "comm": ("parallel", "comm"),
    "timeout": ("parallel", "timeout"),
    "sequence_parallel": ("parallel", "sequence_parallel"),
    "max_new_tokens": ("generate", "max_new_tokens"),
    "temperature": ("generate", "temperature"), "top_k": ("generate", "top_k"),
    "top_p": ("generate", "top_p"), "seed": ("generate", "seed"),
    "min_p": ("generate", "min_p"), "repetition_penalty": ("generate", "repetition_penalty"),
    "presence_penalty": ("generate", "presence_penalty"),
    "frequency_penalty": ("generate", "frequency_penalty"),
    "min_tokens": ("generate", "min_tokens"), "stop_token_ids": ("generate", "stop_token_ids"),
    "n": ("generate", "n"), "logprobs": ("generate", "logprobs"), "prompt_logprobs": ("generate", "prompt_logprobs"),
    "save_logits": ("generate", "save_logits"), "stop_at_eos": ("generate", "stop_at_eos"),
    "wave_size": ("generate", "wave_size"), "batching": ("generate", "batching"),
    "batch_size": ("generate", "batch_size"), "stop": ("generate", "stop"),
    "cuda_graphs": ("generate", "cuda_graphs"),
    "prefix_cache": ("generate", "prefix_cache"), "kv_block_size": ("generate", "kv_block_size"),
    "kv_memory": ("generate", "kv_memory"),
    "out": ("output", "path"), "trace": ("output", "trace"),
}
# training flags -> (job section, key); --seed goes to [train] when the job trains
TRAIN_FLAGS = {
    "data": ("data", "dataset"), "schedule": ("parallel", "schedule"),
    "virtual_stages": ("parallel", "virtual_stages"),
    "fused_optimizer": ("train", "fused"),
    **{k: ("train", k) for k in (
        "steps", "global_batch", "seq_len", "long_rows", "pack", "optimizer", "lr", "min_lr",
        "lr_schedule", "warmup_steps", "weight_decay", "momentum", "betas", "eps", "clip_grad",
        "recompute", "zero", "save_every", "async_save", "serial_save", "resume", "shuffle", "peak_tflops", "bucket_mb", "aux_loss_coef",
        "lora_rank", "lora_alpha", "lora_targets", "lora_from")},
}
# (job section, key) -> the flag that sets it, for the messages
FLAG_NAMES = {target: "--" + dest.replace("_", "-")
              for dest, target in (JOB_FLAGS | TRAIN_FLAGS).items()} | {
    ("score", "data"): "--data", ("train", "seed"): "--seed",
    ("generate", "resume"): "--resume", ("generate", "stop_token_ids"): "--stop-token-id"}


class _Parser(argparse.ArgumentParser):
    """argparse that reports through hpcpar's agreed errors and prints help on rank 0 only."""

    def error(self, message):
        where = "" if self.prog == "hpcpar" else f"{self.prog}: "    # errors say "hpcpar:"
        raise HpcparError(f"{where}{message} (see --help)")

    def _print_message(self, message, file=None):
        if world().Get_rank() == 0:
            super()._print_message(message, file)


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _slurm_time(text: str) -> str:
    from .slurm import time_limit_seconds
    try:
        time_limit_seconds(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Slurm time limit: minutes (90), hours:minutes:seconds "
            f"(01:30:00) or days-hours:minutes:seconds (2-00:00:00)") from None
    return text.strip()


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _layout_flags(p, stage_layers: bool = True) -> None:
    for axis in ("dp", "pp", "tp"):
        p.add_argument(f"--{axis}", type=int, help=f"{axis} size (default: inferred)")
    p.add_argument("--cp", type=int, help="context-parallel size: each sequence split over cp "
                                          "ranks, attention as ring attention (default 1)")
    p.add_argument("--ep", type=int, help="expert-parallel size: each MoE layer's experts split "
                                          "over ep of the dp replicas (default 1)")
    p.add_argument("--micro-batches", type=int, help="micro-batches per replica")
    if stage_layers:
        p.add_argument("--stage-layers", type=_int_list, metavar="N,N,...",
                       help="layers per pipeline stage (default: even, remainder first)")



def _sequence_parallel_flag(p) -> None:
    p.add_argument("--sequence-parallel", action="store_const", const=True,
                   help="under tp, split the norms' and residuals' activations along the "
                        "sequence over the tp ranks (Megatron's sequence parallelism; in "
                        "generation and scoring, a prefill's whose positions tp divides)")


def _lora_flag(p) -> None:
    p.add_argument("--lora", metavar="DIR",
                   help="a LoRA adapter merged into the weights at load: a peft folder, or an "
                        "hpcpar LoRA run's checkpoint or folder")


def _timeout_flag(p) -> None:
    p.add_argument("--timeout", type=float,
                   help="seconds a receive or collective may wait before the job is ended "
                        "with a report of where every rank is (default 600; 0: forever)")
    _trace_flag(p)


def _trace_flag(p) -> None:
    p.add_argument("--trace", metavar="TRACE.json",
                   help="write a timeline of every rank (compute, waits, collectives) in the "
                        "Chrome trace format, for ui.perfetto.dev or chrome://tracing")


def _job_flags(p, required: bool, out_help: str) -> None:
    from ..parallel.device.backend import BACKENDS
    from ..parallel.comm import COMM_KINDS
    need = {"required": required}
    p.add_argument("--checkpoint", **need, help="HDF5 checkpoint, or preset:NAME")
    _lora_flag(p)
    p.add_argument("--prompts", **need,
                   help=".npy of ids [batch, seq]; .jsonl of {ids}, {text} or {messages} lines "
                        "or of OpenAI Batch API requests; "
                        "or random (data.random_count prompts of random ids, "
                        "data.random_lengths long)")
    p.add_argument("--max-new-tokens", type=int, **need)
    p.add_argument("--out", **need, help=out_help)
    _layout_flags(p)
    _timeout_flag(p)
    p.add_argument("--temperature", type=float, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float,
                   help="keep candidates at least this times as likely as the top one")
    p.add_argument("--seed", type=int)
    p.add_argument("--repetition-penalty", type=float,
                   help="transformers': a seen token's logit divided by it (> 0) or "
                        "multiplied (< 0); 1: none")
    p.add_argument("--presence-penalty", type=float,
                   help="OpenAI's: subtracted once from each generated token's logit")
    p.add_argument("--frequency-penalty", type=float,
                   help="OpenAI's: subtracted per time a token was generated")
    p.add_argument("--min-tokens", type=int,
                   help="new tokens before EOS, stop ids or stop strings may end a row")
    p.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append",
                   metavar="ID", help="a token id that ends a row as EOS does (repeatable)")
    p.add_argument("--n", type=int, metavar="N",
                   help="samples per prompt, drawn from one prefill (default 1)")
    p.add_argument("--logprobs", type=int, metavar="K",
                   help="each new token's log-probability and its K most likely alternatives "
                        "(0: the token's own), before temperature and penalties")
    p.add_argument("--prompt-logprobs", type=int, metavar="K",
                   help="the same for every prompt token after the first")
    p.add_argument("--save-logits", action="store_const", const=True,
                   help="store the logits of every prompt position")
    p.add_argument("--ignore-eos", dest="stop_at_eos", action="store_const", const=False,
                   help="always generate max-new-tokens, past EOS")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="a stop string: a row ends once its text holds it, the string itself "
                        "left out (repeatable)")
    p.add_argument("--batching", choices=["continuous", "static"],
                   help="continuous (default): a finished row's slot takes the next prompt; "
                        "static: each micro-batch runs until its longest row is done")
    p.add_argument("--batch-size", type=int,
                   help="rows in flight per micro-batch (default: what fits the KV cache)")
    p.add_argument("--cuda-graphs", action="store_const", const=True,
                   help="replay each decode step as a CUDA graph (a GPU, a whole dense model "
                        "per rank, bfloat16 or float16)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--prefix-cache", dest="prefix_cache", action="store_const", const=True,
                       help="rows in a paged KV cache, a prompt that begins as an earlier one "
                            "did taking its keys (the default wherever it is exact; asked for, "
                            "refused where it is not)")
    cache.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_const",
                       const=False, help="compute every prompt from its first token, in a "
                                         "contiguous KV cache")
    p.add_argument("--kv-block-size", type=int,
                   help="positions per block of the paged KV cache (a power of two; "
                        "default 16)")
    p.add_argument("--kv-memory", type=float, metavar="X",
                   help="the KV cache's memory per rank: a fraction of the free memory (up "
                        "to 1) or bytes (default 0.5); it bounds the rows in flight")
    p.add_argument("--wave-size", type=int,
                   help="prompts per wave: the output is saved, and the job can stop, after "
                        "each (default: all at once)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"],
                   help="compute dtype (default float32)")
    p.add_argument("--backend", choices=BACKENDS)
    p.add_argument("--comm", choices=COMM_KINDS, help="tensor-parallel communicator")


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _float_pair(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B1,B2, got {text!r}")


def _train_flags(p) -> None:
    """The flags of ``train`` that ``generate`` does not have (``run`` takes both)."""
    from ..parallel.optim.settings import LR_SCHEDULES, OPTIMIZERS
    from ..parallel.pipeline.training_schedules import TRAINING_SCHEDULES
    p.add_argument("--data", help="training data: .npy rows, .bin tokens or .jsonl")
    p.add_argument("--steps", type=int, help="total optimizer steps (counted from step 0)")
    p.add_argument("--global-batch", type=int, help="samples per optimizer step")
    p.add_argument("--schedule", choices=TRAINING_SCHEDULES, help="pipeline schedule (1f1b)")
    p.add_argument("--virtual-stages", type=int, help="model chunks per stage (interleaved)")
    p.add_argument("--seq-len", type=int, help="tokens per sample for .bin / .jsonl data")
    p.add_argument("--long-rows", choices=["refuse", "cut"],
                   help="a fine-tuning row longer than --seq-len + 1 tokens: refused (the "
                        "default) or cut")
    p.add_argument("--pack", action="store_const", const=True,
                   help="pack several samples (documents) into each row of --seq-len, "
                        "attention confined to each and positions restarting at each")
    p.add_argument("--optimizer", choices=OPTIMIZERS)
    p.add_argument("--lr", type=float)
    p.add_argument("--min-lr", type=float)
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES)
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--momentum", type=float)
    p.add_argument("--betas", type=_float_pair, metavar="B1,B2")
    p.add_argument("--eps", type=float)
    p.add_argument("--clip-grad", type=float, help="max gradient norm (0: off)")
    p.add_argument("--recompute", choices=["none", "full"])
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3],
                   help="split over the dp replicas: 1 the optimizer state (ZeRO-1), 2 also "
                        "the gradients, 3 also the weights (gathered layer by layer)")
    p.add_argument("--fused-optimizer", action="store_const", const=True,
                   help="on a GPU, the optimizer step as one kernel (not run on a GPU yet)")
    p.add_argument("--save-every", type=int, help="checkpoint every K steps (and at the end)")
    p.add_argument("--async-save", action="store_const", const=True,
                   help="write checkpoints from a snapshot in host memory while training goes "
                        "on (latest names one once every rank's part is written)")
    p.add_argument("--serial-save", action="store_const", const=True,
                   help="write each checkpoint as one self-contained file, the ranks one at a "
                        "time (default: every rank its part file at once)")
    p.add_argument("--resume", help="a training checkpoint, or auto (DIR/latest)")
    p.add_argument("--shuffle", action="store_const", const=True,
                   help="permute the samples of each epoch")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per rank, for MFU")
    p.add_argument("--bucket-mb", type=float,
                   help="data-parallel gradient bucket size in MiB (default 25, as DDP)")
    p.add_argument("--aux-loss-coef", type=float,
                   help="a mixture of experts' load-balancing loss coefficient (default: the "
                        "config's router_aux_loss_coef when output_router_logits, else 0)")
    p.add_argument("--lora-rank", type=int, metavar="R",
                   help="train LoRA adapters of rank R, the base model frozen")
    p.add_argument("--lora-alpha", type=float, help="the adapters' scale is alpha / R "
                                                    "(default: R)")
    p.add_argument("--lora-targets", type=_name_list, metavar="q,k,v,o,gate,up,down",
                   help="the projections adapted (default q,v); a mixture's experts: "
                        "experts.gate_up,experts.down")
    p.add_argument("--lora-from", metavar="DIR",
                   help="start from a peft LoRA adapter folder (its rank, alpha, targets)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hpcpar", description="Run Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma "
                                            "(1, 2, 3), OLMo 2, Mixtral, Qwen-MoE and "
                                            "DeepSeek-V2/V3 models across ranks with MPI.")
    p.add_argument("--version", action="version", version=f"hpcpar {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    for command in (_demo_command, _run_command, _generate_command, _score_command,
                    _train_command, _submit_command, _plan_command, _convert_command,
                    _export_command, _show_command, _init_command):
        command(sub)
    return p


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's own parser, by name, in ``--help``'s order (for the flags reference and
    the tests that hold the docs to the flags)."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _demo_command(sub) -> None:
    from ..parallel.device.backend import BACKENDS
    from ..parallel.comm import COMM_KINDS
    demo = sub.add_parser("demo", help="the built-in demo job (the default command)")
    demo.add_argument("--checkpoint", help="checkpoint (default: a cached random tiny model)")
    for axis in ("dp", "pp", "tp"):
        demo.add_argument(f"--{axis}", type=int, help=f"{axis} size (default: chosen for N)")
    demo.add_argument("--backend", choices=BACKENDS, default="auto")
    demo.add_argument("--comm", choices=COMM_KINDS, default="auto",
                      help="tensor-parallel communicator")
    _trace_flag(demo)


def _run_command(sub) -> None:
    run = sub.add_parser("run", help="run a job file (TOML)")
    run.add_argument("job", type=Path)
    run.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override a job setting (repeatable)")
    _job_flags(run, required=False, out_help=(
        "output: OUT.h5 or OUT.jsonl (generation), OUT.h5 (scoring), a folder (training)"))
    _train_flags(run)
    _sequence_parallel_flag(run)


def _generate_command(sub) -> None:
    gen = sub.add_parser("generate", help="batch generation from prompts")
    gen.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    _job_flags(gen, required=True, out_help=(
        "OUT.h5 (or .hdf5): HDF5; OUT.jsonl: one JSON line per prompt, in input order"))
    _sequence_parallel_flag(gen)
    gen.add_argument("--resume", choices=["auto"],
                     help="keep the prompts a stopped run with the same settings finished")


def _score_command(sub) -> None:
    from ..parallel.device.backend import BACKENDS
    from ..parallel.comm import COMM_KINDS
    score = sub.add_parser("score", help="log-probabilities of given token sequences")
    score.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    score.add_argument("--checkpoint", required=True, help="HDF5 checkpoint, or preset:NAME")
    _lora_flag(score)
    score.add_argument("--data", required=True,
                       help=".npy of ids [rows, seq] (left padding: negative ids), or .jsonl "
                            "of {ids} or {text}")
    score.add_argument("--out", required=True, help="output HDF5 file")
    _layout_flags(score)
    _sequence_parallel_flag(score)
    _timeout_flag(score)
    score.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"],
                       help="compute dtype (default float32)")
    shared = score.add_mutually_exclusive_group()
    shared.add_argument("--prefix-cache", dest="prefix_cache", action="store_const", const=True,
                        help="rows that begin alike compute their beginning once (the default "
                             "wherever it is exact; asked for, refused where it is not)")
    shared.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_const",
                        const=False, help="compute every row from its first token")
    score.add_argument("--backend", choices=BACKENDS)
    score.add_argument("--comm", choices=COMM_KINDS, help="tensor-parallel communicator")


def _train_command(sub) -> None:
    from ..parallel.device.backend import BACKENDS
    from ..parallel.comm import COMM_KINDS
    train = sub.add_parser("train", help="train from a checkpoint on token data")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    train.add_argument("--checkpoint", required=True, help="HDF5 checkpoint, or preset:NAME")
    train.add_argument("--out", required=True, help="folder for checkpoints and metrics")
    _layout_flags(train)
    _sequence_parallel_flag(train)
    _timeout_flag(train)
    _train_flags(train)
    train.add_argument("--seed", type=int, help="shuffle seed")
    train.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                       help="compute dtype over float32 master weights (default float32)")
    train.add_argument("--backend", choices=BACKENDS)
    train.add_argument("--comm", choices=COMM_KINDS, help="tp and dp communicator")


def _submit_command(sub) -> None:
    sub_ = sub.add_parser("submit", help="queue a job file on Slurm (sbatch), one rank per GPU")
    sub_.add_argument("job", type=Path)
    sub_.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    sub_.add_argument("--nodes", type=int, default=1)
    sub_.add_argument("--ranks-per-node", type=int, default=8, help="ranks (tasks) per node")
    sub_.add_argument("--gpus-per-node", type=int,
                      help="default: one per rank; 0 for CPU nodes")
    sub_.add_argument("--cpus-per-task", type=int, help="cores (BLAS threads) per rank")
    sub_.add_argument("--time", type=_slurm_time, default="01:00:00",
                      help="time limit (Slurm format: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S)")
    sub_.add_argument("--partition")
    sub_.add_argument("--account")
    sub_.add_argument("--signal-seconds", type=int, default=120,
                      help="USR1 this long before the time limit: save, requeue, resume")
    sub_.add_argument("--launcher", choices=["pmi2", "pmix", "mpirun"], default="pmi2",
                      help="srun --mpi=pmi2 (mpich wheel), srun --mpi=pmix, or the site mpirun")
    sub_.add_argument("--dry-run", action="store_true", help="print the script, queue nothing")


def _plan_command(sub) -> None:
    from ..checkpoint import PRESETS
    plan = sub.add_parser("plan", help="memory, communication and bubble of a layout (no MPI)")
    plan.add_argument("job", nargs="?", type=Path, help="job file to plan (optional)")
    plan.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="read the model config from this checkpoint, or "
                        "from a Hugging Face config.json (or its folder): no weights needed")
    source.add_argument("--preset", choices=sorted(PRESETS), help="plan a preset model")
    plan.add_argument("--world", type=_at_least_one, help="number of ranks (default: dp*pp*tp)")
    _layout_flags(plan)
    _sequence_parallel_flag(plan)
    plan.add_argument("--batch", type=int, help="prompts in the batch")
    plan.add_argument("--prompt-length", type=int, help="longest prompt, in tokens")
    plan.add_argument("--max-new-tokens", type=int)
    plan.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"])
    plan.add_argument("--train", action="store_true",
                      help="plan training (implied by a job with [train] or training flags)")
    from ..parallel.pipeline.training_schedules import TRAINING_SCHEDULES
    plan.add_argument("--schedule", choices=TRAINING_SCHEDULES)
    plan.add_argument("--virtual-stages", type=int)
    plan.add_argument("--global-batch", type=int)
    plan.add_argument("--seq-len", type=int)
    plan.add_argument("--optimizer", choices=["adamw", "sgd"])
    plan.add_argument("--recompute", choices=["none", "full"])
    plan.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    plan.add_argument("--fused-optimizer", action="store_const", const=True,
                      help="the optimizer step as one kernel: no scratch in the plan")


def _convert_command(sub) -> None:
    from ..parallel.device.dtypes import FLOAT_DTYPES
    conv = sub.add_parser("convert", help="Hugging Face folder -> HDF5 checkpoint")
    conv.add_argument("hf_dir", type=Path)
    conv.add_argument("out", type=Path)
    conv.add_argument("--dtype", choices=[d for d in FLOAT_DTYPES if d != "float64"],
                      help="storage dtype (default: the weights' own)")


def _export_command(sub) -> None:
    from ..checkpoint.export import SAFETENSORS_DTYPES
    export = sub.add_parser("export", help="HDF5 checkpoint -> Hugging Face folder")
    export.add_argument("checkpoint", type=Path, help="a checkpoint (a training one too)")
    export.add_argument("out", type=Path, help="the folder to write (new, or empty)")
    export.add_argument("--dtype", choices=list(SAFETENSORS_DTYPES),
                        help="the weights' dtype (default: the checkpoint's own)")
    export.add_argument("--shard-size", default="5GB",
                        help="largest safetensors file, as transformers' max_shard_size")
    lora = export.add_mutually_exclusive_group()
    lora.add_argument("--lora", action="store_true",
                      help="a LoRA run's checkpoint: write its adapter as a peft folder")
    lora.add_argument("--merge-lora", action="store_true",
                      help="a LoRA run's checkpoint: write its base with the adapter merged")


def _show_command(sub) -> None:
    show = sub.add_parser("show", help="what an output, a training run or a checkpoint holds")
    show.add_argument("path", type=Path, help="a generation or scoring output, a training "
                                              "run's folder, or a checkpoint")
    show.add_argument("--json", action="store_true", help="print it as one JSON object")
    show.add_argument("--page", type=int, help="which page of rows (default 1)")
    show.add_argument("--per-page", type=int, help="rows per page (default 20)")
    show.add_argument("--plot", metavar="OUT.png",
                      help="draw a training run's curves or a trace's timeline (.png, .svg, "
                           ".pdf; needs matplotlib: the [plot] extra)")


def _init_command(sub) -> None:
    from ..checkpoint import PRESETS
    from ..parallel.device.dtypes import FLOAT_DTYPES
    init = sub.add_parser("init", help="random weights for a named model shape")
    init.add_argument("--preset", required=True, choices=sorted(PRESETS))
    init.add_argument("out", type=Path)
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", choices=[d for d in FLOAT_DTYPES if d != "float64"],
                      default="float32")
