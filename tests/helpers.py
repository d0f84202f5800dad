"""Test helpers that do not use hpcpar's own model inventory: a tiny Hugging Face-layout
checkpoint written from an explicit list of names, and the expected tensor-parallel slices
written out independently from the Megatron rules."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 250,
    "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "torch_dtype": "float32",
}


def hf_tensor_shapes(cfg: dict) -> dict[str, tuple]:
    """Names and shapes as transformers' state_dict has them: LlamaForCausalLM's, with
    Qwen2's q/k/v biases and Qwen3's q/k norms by ``model_type`` (written out here, apart
    from hpcpar's own inventory)."""
    family = cfg.get("model_type", "llama")
    h, inter, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)})
        if cfg.get("attention_bias") or family == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.get("attention_bias") and family != "qwen2":
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if family == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (hd,),
                           p + "self_attn.k_norm.weight": (hd,)})
        if family == "phi3":                          # fused, as Phi3ForCausalLM stores them
            for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                del shapes[p + ("self_attn." if part[0] in "qkv" else "mlp.") + part + ".weight"]
            shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, h)
        if cfg.get("mlp_bias"):
            shapes.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                           p + "mlp.down_proj.bias": (h,)})
    if not cfg.get("tie_word_embeddings", family == "gemma"):
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def write_hf_checkpoint(folder: Path, cfg: dict, seed: int = 0, files: int = 1,
                        dtype=np.float32, extra: dict | None = None) -> dict[str, np.ndarray]:
    """Write config.json and safetensors (one file, or ``files`` shards with an index) and
    return the tensors written (name -> array)."""
    from safetensors.numpy import save_file

    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(seed)
    tensors = {n: rng.standard_normal(s).astype(np.float32).astype(dtype)
               for n, s in hf_tensor_shapes(cfg).items()}
    tensors.update(extra or {})
    names = sorted(tensors)
    if files == 1:
        save_file({n: tensors[n] for n in names}, str(folder / "model.safetensors"))
    else:
        weight_map = {}
        for k, part in enumerate(np.array_split(np.array(names), files)):
            fname = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
            save_file({n: tensors[n] for n in part}, str(folder / fname))
            weight_map.update({n: fname for n in part})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def expected_slice(name: str, full: np.ndarray, cfg: dict, tp_rank: int, tp: int) -> np.ndarray:
    """Megatron's split of one Hugging Face tensor, written out independently of hpcpar."""
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"]
    if tp == 1 or "norm" in name or name.endswith(("o_proj.bias", "down_proj.bias")):
        return full
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        per = -(-full.shape[0] // tp)
        out = np.zeros((per,) + full.shape[1:], dtype=full.dtype)
        rows = full[tp_rank * per: (tp_rank + 1) * per]
        out[: len(rows)] = rows
        return out
    if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")) and kv < tp:
        head = tp_rank * kv // tp
        return full[head * hd: (head + 1) * hd]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return np.split(full, tp, axis=1)[tp_rank]
    return np.split(full, tp, axis=0)[tp_rank]


# Model configs for numerical tests: vocabularies that tp does not divide (padding), an
# uneven layer split, KV heads fewer than tp, llama3 RoPE; and MQA with tied embeddings and
# biases.
GQA = dict(TINY, vocab_size=250, num_hidden_layers=9, max_position_embeddings=96,
           eos_token_id=2, bos_token_id=1,
           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
# Qwen3 (per-head q/k norms, head_dim apart from hidden / heads) and Gemma ((1 + w) norms,
# embedding scale, GeGLU, tied head; one KV head, replicated at every tp)
QWEN3 = dict(TINY, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=12,
             num_hidden_layers=4, max_position_embeddings=96, eos_token_id=2)
GEMMA = dict(TINY, model_type="gemma", architectures=["GemmaForCausalLM"], vocab_size=251,
             num_attention_heads=4, num_key_value_heads=1, head_dim=16, intermediate_size=128,
             num_hidden_layers=4, tie_word_embeddings=True, eos_token_id=1,
             hidden_activation="gelu_pytorch_tanh")
# Mistral: a window of 5 keys, shorter than the tests' prompts and generations
MISTRAL = dict(GQA, model_type="mistral", architectures=["MistralForCausalLM"],
               sliding_window=5, rope_scaling=None, num_hidden_layers=4)
# Phi-3: q/k/v and gate/up fused in the checkpoint; tp splits each part of them
PHI3 = dict(GQA, model_type="phi3", architectures=["Phi3ForCausalLM"], rope_scaling=None,
            num_hidden_layers=4)
TIED = dict(TINY, vocab_size=251, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, intermediate_size=128, num_hidden_layers=4, tie_word_embeddings=True,
            attention_bias=True, mlp_bias=True, rope_theta=500.0, eos_token_id=[3, 4])


def realistic_tensors(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Weights at the scale of a trained model (std 0.05, norms near 1), float32."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_tensor_shapes(cfg).items():
        if "norm" in name:
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (0.05 * rng.standard_normal(shape)).astype(np.float32)
    return out


def world_checkpoint(tmp_path_factory, name: str, cfg: dict) -> Path:
    """A checkpoint of ``cfg`` made once, by rank 0 of the world, in a new temp folder
    ``name``; its folder on every rank (the ranks share the machine's temp folders)."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    folder = None
    if comm.Get_rank() == 0:
        folder = tmp_path_factory.mktemp(name)
        make_checkpoint(folder, cfg)
    return Path(comm.bcast(str(folder) if folder else None, root=0))


def make_checkpoint(folder: Path, cfg: dict, seed: int = 0) -> tuple[Path, dict]:
    """A converted hpcpar checkpoint of ``cfg`` with realistic random weights; returns its
    path and the float32 tensors by Hugging Face name."""
    from hpcpar.checkpoint import convert
    tensors = realistic_tensors(cfg, seed)
    write_hf_checkpoint(folder / "hf", cfg, extra=tensors)
    out = folder / "model.h5"
    convert(folder / "hf", out)
    return out, tensors


PROMPTS = [np.array(p, dtype=np.int64) for p in
           ([5, 17, 99, 3, 240], [7] * 9, [11, 12, 13], list(range(20, 32)), [200, 1, 8, 9, 150, 6, 77])]


def prompt_batch(prompts=None):
    """``prompts`` (default: PROMPTS) as a stage takes them: (ids (B, longest), each row's
    tokens first and zeros after; lengths (B,))."""
    prompts = PROMPTS if prompts is None else prompts
    lengths = np.array([len(p) for p in prompts])
    ids = np.zeros((len(prompts), lengths.max()), dtype=np.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    return ids, lengths


# the world sizes of tests/run's MPI phases; an MPI test that needs several of them names
# them (``@pytest.mark.mpi(ranks=WORLD_SIZES)``) and says why, the others run at one
WORLD_SIZES = (2, 4, 8)


def _mpiexec() -> str:
    """mpiexec as tests/run finds it: PATH (a cluster's MPI), else the mpich wheel's beside
    python; a pyenv shim resolved to the program it runs (0.3 s a launch)."""
    found = shutil.which("mpiexec")
    if found and "/shims/" in found:
        found = subprocess.run(["pyenv", "which", "mpiexec"], capture_output=True,
                               text=True).stdout.strip() or found
    return found or os.path.join(sysconfig.get_path("scripts"), "mpiexec")


MPIEXEC = os.environ.get("MPIEXEC") or _mpiexec()
REPO = Path(__file__).resolve().parents[1]


def mpirun(n: int, args: list[str], cwd: Path, timeout: float = 60):
    """Run ``python ARGS`` under ``mpiexec -n n`` with the checkout's hpcpar and these
    helpers importable; returns (CompletedProcess, seconds)."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, HPCPAR_CACHE=str(cwd / "cache"), OMP_NUM_THREADS="1",
               PYTHONPATH=path)
    start = time.monotonic()
    proc = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)
    return proc, time.monotonic() - start


_PROCESS_CACHE: list[str] = []


def made_once(key: str, build) -> Path:
    """The folder that ``build(folder)`` fills, made once for ``key`` (what made it: the test
    module, fixture and parameter) in a run of the suite, and read by every test, phase and
    world size after. The cache is PYTEST_HPCPAR_CACHE (tests/run makes one for all its phases),
    else a folder of this process. A folder is built aside and renamed into place, so no
    reader sees half of one. Its files are inputs: read them, never change them."""
    import hashlib
    import tempfile
    root = os.environ.get("PYTEST_HPCPAR_CACHE")
    if not root:
        if not _PROCESS_CACHE:
            import atexit
            _PROCESS_CACHE.append(tempfile.mkdtemp(prefix="hpcpar-tests-"))
            atexit.register(shutil.rmtree, _PROCESS_CACHE[0], ignore_errors=True)
        root = _PROCESS_CACHE[0]
    # the backend computes the references too: the strict phases make their own
    key = f"{key} on {os.environ.get('HPCPAR_BACKEND', 'numpy')}"
    folder = Path(root) / hashlib.sha256(key.encode()).hexdigest()[:24]
    if not folder.is_dir():
        building = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
        build(building)
        try:
            building.rename(folder)
        except OSError:                           # another process made it meanwhile
            shutil.rmtree(building, ignore_errors=True)
    return folder


def link_into(folder: Path, made: Path) -> None:
    """Every file and folder of ``made`` (a made_once folder) as a link in ``folder``."""
    for entry in made.iterdir():
        (Path(folder) / entry.name).symlink_to(entry)


def hpcpar_here(args, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m hpcpar ARGS`` run in this process, in ``cwd``, on a world of 1 (as a process
    started alone is): its exit status and what it printed. For the commands and inputs that
    are refused before any work: a process of their own would add only its start-up, about a
    second, to each of many cases. (Processes of their own, one rank or several, are checked
    by the tests of the launch: test_launch, test_env_and_help, test_faults.)"""
    import contextlib
    import io

    from hpcpar.jobs.cli import main
    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in args])
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def losses(folder: Path) -> list[float]:
    """The per-step losses a training run wrote to ``folder/metrics.jsonl``."""
    return [json.loads(line)["loss"] for line in open(Path(folder) / "metrics.jsonl")]


def wait_for_steps(folder: Path, steps: int, timeout: float = 120) -> None:
    """Until a training run writing to ``folder`` has logged ``steps`` steps; a run that
    does not get there within ``timeout`` seconds fails the test."""
    metrics = Path(folder) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
        if time.monotonic() > deadline:
            raise AssertionError(f"{folder}: fewer than {steps} steps logged after {timeout} s")
        time.sleep(0.02)


# ---- tiny transformers models (the tests that use them need torch and transformers) ----

HF_CONFIGS = {
    "gqa-llama3": dict(vocab_size=250, hidden_size=64, intermediate_size=176,
                       num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                       max_position_embeddings=128, rope_theta=10000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 16}),
    "mqa-tied-bias": dict(vocab_size=251, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                          max_position_embeddings=128, tie_word_embeddings=True,
                          attention_bias=True, mlp_bias=True),
    # the other families, each where it differs from Llama (hpcpar.models): Mistral's window
    # is shorter than the longer prompts, and than prompt plus new tokens
    "mistral": dict(model_type="mistral", vocab_size=250, hidden_size=64,
                    intermediate_size=176, num_hidden_layers=3, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                    sliding_window=6),
    # Qwen2 with YaRN (Qwen2.5's long-context rope): the ramp between the interpolated and
    # the original frequencies within the head's 4 frequencies, and its attention factor
    "qwen2": dict(model_type="qwen2", vocab_size=250, hidden_size=64, intermediate_size=176,
                  num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=128, rope_theta=1000000.0,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32}),
    "qwen3": dict(model_type="qwen3", vocab_size=250, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=24, max_position_embeddings=128, tie_word_embeddings=True),
    # Phi-3 with LongRoPE's short factors over the first 3/4 of each head (Phi-4-mini's
    # partial rotary), the attention factor of 128 positions over an original 64
    "phi3": dict(model_type="phi3", vocab_size=250, hidden_size=64, intermediate_size=176,
                 num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                 max_position_embeddings=128, rope_theta=10000.0, partial_rotary_factor=0.75,
                 original_max_position_embeddings=64,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 3.0],
                               "long_factor": [2.0, 4.0, 8.0]}),
    "gemma": dict(model_type="gemma", vocab_size=251, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                  head_dim=16, max_position_embeddings=128,
                  hidden_activation="gelu_pytorch_tanh"),
    # Gemma 2: a window shorter than the prompts on layers 0 and 2, scores and logits
    # soft-capped where the caps bite, a scale apart from head_dim
    "gemma2": dict(model_type="gemma2", vocab_size=251, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, max_position_embeddings=128, sliding_window=4,
                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0),
    # Gemma 3: Gemma 2's block with q/k norms, every second layer global (with its linear
    # rope), the local ones with their own rope base
    "gemma3_text": dict(model_type="gemma3_text", vocab_size=251, hidden_size=64,
                        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                        sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=24,
                        rope_theta=10000.0, rope_local_base_freq=100.0,
                        rope_scaling={"rope_type": "linear", "factor": 2.0},
                        tie_word_embeddings=False),
    # OLMo 2: norms after each block, q/k norms over the whole projection
    "olmo2": dict(model_type="olmo2", vocab_size=250, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128),
    # mixtures of experts: every layer routed (Mixtral), a dense layer between routed ones
    # and renormalised weights (Qwen3-MoE), a shared expert and raw weights (Qwen2-MoE)
    "mixtral": dict(model_type="mixtral", vocab_size=250, hidden_size=64,
                    intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, num_local_experts=4,
                    num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=250, hidden_size=64,
                      intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=128, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=250, hidden_size=64,
                      intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, num_experts=4, num_experts_per_tok=2),
    # DeepSeek: latent attention (V2-Lite's plain q_proj; V3's q latent, YaRN with its
    # mscale in the softmax scale), v's head apart from q's, a dense first layer, shared
    # experts, grouped top-k (V2 by softmax and a group's best, V3 by sigmoid plus a bias
    # and a group's best two), scaled weights
    "deepseek_v2": dict(model_type="deepseek_v2", vocab_size=250, hidden_size=64,
                        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128, kv_lora_rank=16,
                        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=12,
                        v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1,
                        topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=1.5),
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=250, hidden_size=64,
                        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4,
                        max_position_embeddings=128, kv_lora_rank=16, q_lora_rank=24,
                        qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
                        first_k_dense_replace=1, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, rope_theta=10000.0,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                      "original_max_position_embeddings": 32}),
}


def build_hf_model(name: str, folder, **changes):
    """A random transformers causal LM of ``HF_CONFIGS[name]`` (its own family's class, by
    ``model_type``; norms away from their neutral value and non-zero biases, so each one is
    tested), with ``changes`` to the config, saved under folder/hf and converted to
    folder/model.h5."""
    import torch
    import transformers
    from hpcpar.checkpoint import convert
    torch.manual_seed(0)
    # a copy all the way down: transformers' config fills its rope dict in place
    settings = copy.deepcopy(dict(HF_CONFIGS[name], **changes))
    cfg = transformers.AutoConfig.for_model(settings.pop("model_type", "llama"), **settings,
                                            eos_token_id=None, bos_token_id=None,
                                            pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):
                # routers far from a tie: summation order never changes an expert chosen
                p.copy_(torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.02 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):     # DeepSeek-V3's: the choice's
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(folder / "hf", safe_serialization=True)
    convert(folder / "hf", folder / "model.h5")
    return model, folder / "model.h5"


def save_word_tokenizer(folder, template: str | None = None):
    """A word-level tokenizer of 248 words (<unk>, <s>, </s>, <|start|>, <|end|>, w0..w239,
    user, assistant, system) saved by transformers into ``folder``, with ``template`` as its
    chat template; returns transformers' tokenizer object."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<unk>", "<s>", "</s>", "<|start|>", "<|end|>"] + [f"w{i}" for i in range(240)]
    words += ["user", "assistant", "system"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=["<|start|>", "<|end|>"])
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return fast


def generate_here(path, max_new_tokens: int, *sets, prompts=None):
    """A single-rank generation of ``prompts`` (default ``PROMPTS``) with the checkpoint at
    ``path``, EOS ignored, and job settings ``sets`` ("section.key=value")."""
    from mpi4py import MPI

    from hpcpar.jobs.generate import Prompts, run_generation
    from hpcpar.jobs.job import load_job
    job = load_job(None, [f"model.checkpoint='{path}'", f"generate.max_new_tokens={max_new_tokens}",
                          "generate.stop_at_eos=false", *sets])
    return run_generation(MPI.COMM_SELF, job, prompts=Prompts(PROMPTS if prompts is None
                                                             else prompts), progress=False)


def refused(capfd, run) -> str:
    """The one-line error of a job that ``run`` starts in this process, whether raised here
    or printed by rank 0 (``JobFailed``): the exception's text and the captured stderr."""
    import pytest

    from hpcpar.jobs.launch import JobFailed
    from hpcpar.parallel.errors import HpcparError
    with pytest.raises((HpcparError, JobFailed)) as failed:
        run()
    return f"{failed.value} {capfd.readouterr().err}"


def optimizer_arrays(rng, rule: str, n: int) -> dict:
    """An optimizer update's float32 arrays of ``n`` elements (``ops.optimizer_update``):
    master weights, gradients and the states of ``rule`` ("adamw" or "sgd"), at the scales
    a step meets."""
    f32 = np.float32
    out = {"master": rng.standard_normal(n).astype(f32),
           "grad": (rng.standard_normal(n) * 1e-2).astype(f32)}
    if rule == "adamw":
        out["exp_avg"] = (rng.standard_normal(n) * 1e-3).astype(f32)
        out["exp_avg_sq"] = (np.abs(rng.standard_normal(n)) * 1e-5).astype(f32)
    else:
        out["momentum_buffer"] = (rng.standard_normal(n) * 1e-2).astype(f32)
    return out
