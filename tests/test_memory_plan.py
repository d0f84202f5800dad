"""Device memory: the plan's prediction (``jobs.generate.memory``, ``jobs.plan``'s training
rows, what ``hpcpar plan`` prints) against the device budget's measure on the strict backend
with the GPU's ops (``HPCPAR_OPS=device``), whose whole-run peak (``Budget.peak``, from
loading on) is the reference, for generation and training; and loading's matrices, read
straight into the layout the products take."""

import re

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar.checkpoint import init_checkpoint, load_shard, open_checkpoint, preset_config
from hpcpar.jobs.generate import Prompts, run_generation
from hpcpar.jobs.job import GenerateSection, load_job
from hpcpar.jobs.layout import ParallelConfig
from hpcpar.jobs.plan import format_plan, plan_stages
from hpcpar.models.config import ModelConfig
from hpcpar.models.decoder import DecoderStage, matrix_stacks
from hpcpar.models.tensors import StageSpan, stage_tensors
from hpcpar.parallel.device.backend import select_backend
from hpcpar.parallel.device.budget import Budget
from hpcpar.parallel.comm import create_communicator
from hpcpar.parallel.ops import ops_for


def shape(name: str) -> dict:
    """The Llama-3.2-1B and Llama-3.1-8B shapes cut to 2 layers, their widths / 8 and their
    vocabulary / 32, so that a CPU runs them in seconds; the terms stay those of the shapes:
    a tied head (1B) and its own (8B), four query heads a KV head, head_dim 64 and 128."""
    cfg = preset_config({"1b": "llama3-1b", "8b": "llama3-8b"}[name])
    return dict(cfg, num_hidden_layers=2, hidden_size=cfg["hidden_size"] // 8,
                intermediate_size=cfg["intermediate_size"] // 8,
                num_attention_heads=cfg["num_attention_heads"] // 8,
                num_key_value_heads=cfg["num_key_value_heads"] // 8,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                vocab_size=cfg["vocab_size"] // 32)


def measure_and_plan(comm, folder, cfg: dict, lengths, sets=(), tp: int = 1, pp: int = 1,
                     itemsize: int = 4):
    """A generation of prompts of ``lengths`` tokens and 3 new ones on the strict backend
    with the device ops (``HPCPAR_OPS=device``, set by the caller), its budget and this
    rank's ``StageEstimate``, and the measured peaks of each phase's runs (reference
    figures)."""
    if comm.Get_rank() == 0:
        folder.mkdir(exist_ok=True)
        init_checkpoint(folder / "model.h5", cfg)
    comm.Barrier()
    job = load_job(None, [f"model.checkpoint='{folder / 'model.h5'}'",
                          "parallel.backend='strict'", "generate.max_new_tokens=3",
                          "generate.stop_at_eos=false", f"parallel.tp={tp}",
                          f"parallel.pp={pp}", *sets])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, min(1000, cfg["vocab_size"]), n) for n in lengths]
    b = Budget()
    with b.counting():
        result = run_generation(comm, job, prompts=Prompts(prompts), progress=False)
    layout = ParallelConfig(tp=tp, pp=pp, micro_batches=job.parallel.micro_batches or 1)
    plan = plan_stages(ModelConfig.from_hf(cfg), layout, len(prompts), max(lengths), 3,
                       itemsize, job.generate)[comm.Get_rank() // tp]
    if comm.Get_size() == 1:                     # (the report is rank 0's, of every rank)
        assert round(max(result.report.weight_mb) * 1e6) == plan.weight_bytes
    peaks = {p: max(c.peak_bytes for c in b.per_run(p)) for p in ("load", "prefill", "decode")}
    return b, plan, peaks


def check_each_term(b: Budget, plan, peaks: dict) -> int:
    """The measured whole-run peak (the reference) at most 1.05x the plan's and the plan
    within 5% of it; so each term too (the activations at the prefill's or a decode step's
    peak, loading's bytes beside the weights), that the weights' share hide no error in
    them. Returns the measured activations."""
    assert b.peak <= 1.05 * plan.peak_bytes, (b.peak, plan)
    assert abs(plan.peak_bytes - b.peak) <= 0.05 * b.peak, (b.peak, plan)
    activations = max(peaks["prefill"], peaks["decode"]) - plan.weight_bytes - plan.kv_cache_bytes
    assert abs(plan.activation_bytes - activations) <= 0.05 * activations, (activations, plan)
    loading = peaks["load"] - plan.weight_bytes
    assert abs(plan.loading_bytes - loading) <= 0.05 * plan.loading_bytes, (loading, plan)
    return activations


@pytest.mark.parametrize("batching", ["static", "continuous"])
@pytest.mark.parametrize("name", ["1b", "8b"])
def test_the_plan_predicts_a_generation_runs_peak_within_5_percent(tmp_path, monkeypatch,
                                                                   name, batching):
    """4 prompts of up to 96 tokens and 3 new ones through the 1B and 8B shapes (cut)."""
    monkeypatch.setenv("HPCPAR_OPS", "device")
    cfg = shape(name)
    b, plan, peaks = measure_and_plan(MPI.COMM_SELF, tmp_path, cfg, (96, 65, 96, 80),
                                      [f"generate.batching='{batching}'"])
    activations = check_each_term(b, plan, peaks)
    # the activations are a good part of the peak here: the check above is not the weights'
    assert activations > 0.3 * plan.weight_bytes


TRAINING = {           # shape, compute dtype, the fused optimizer, recompute (2 micro-batches)
    "1b float32": ("1b", "float32", False, "none"),
    "1b bfloat16 fused": ("1b", "bfloat16", True, "none"),
    "8b float32 recompute": ("8b", "float32", False, "full"),
    "8b bfloat16 fused recompute": ("8b", "bfloat16", True, "full"),
}


@pytest.mark.parametrize("case", TRAINING)
def test_the_training_plan_predicts_a_runs_peak_within_3_percent(tmp_path, monkeypatch, case):
    """Two AdamW steps of 4 x 64 tokens: the plan's total (the state, and the larger of the
    activations with the largest weight's gradient product and the optimizer step's
    scratch) against the whole run's measured peak; with the fused kernel's no scratch, the
    backward is the peak, without it the step's scratch is. Within 1% without
    recompute; with it a layer's backward also holds its intermediates' gradients, which the
    plan leaves out (2.2% of this cut shape's peak in bfloat16, 1.3% of the whole 8B's)."""
    from hpcpar.jobs.plan import train_plan_bytes
    from hpcpar.jobs.train.engine import run_training
    name, dtype, fused, recompute = TRAINING[case]
    monkeypatch.setenv("HPCPAR_OPS", "device")
    cfg = shape(name)
    init_checkpoint(tmp_path / "model.h5", cfg)
    job = load_job(None, [f"model.checkpoint='{tmp_path / 'model.h5'}'",
                          "parallel.backend='strict'", "data.dataset='synthetic'",
                          "train.steps=2", "train.global_batch=4", "train.seq_len=64",
                          "parallel.micro_batches=2", f"model.dtype='{dtype}'",
                          f"train.fused={str(fused).lower()}", f"train.recompute='{recompute}'",
                          f"output.path='{tmp_path / 'run'}'"])
    b = Budget()
    with b.counting():
        run_training(MPI.COMM_SELF, job, progress=False)
    (plan,) = train_plan_bytes(ModelConfig.from_hf(cfg), job.parallel.layout(1, "1f1b"), 1,
                               job.train, itemsize=2 if dtype == "bfloat16" else 4)
    assert abs(b.peak - plan["total"]) <= (0.03 if recompute == "full" else 0.01) * b.peak, (
        b.peak, plan)
    assert (plan["scratch"] == 0) == fused
    state = plan["weights"] + plan["gradients"] + plan["optimizer"]
    assert plan["total"] - state == max(plan["activations"] + plan["gradient_product"],
                                        plan["scratch"]) > 0


VARIANTS = {
    "bfloat16": ({}, ["model.dtype='bfloat16'"], 2),
    "top-k sampling, penalties": ({}, ["generate.temperature=0.7", "generate.top_k=20",
                                       "generate.repetition_penalty=1.2"], 4),
    "rows in flight, micro-batches": ({}, ["generate.batch_size=2", "parallel.micro_batches=2"],
                                      4),
    "qwen3 q/k norms": ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                         "tie_word_embeddings": False}, [], 4),
    "gemma geglu": ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"],
                     "hidden_act": "gelu_pytorch_tanh"}, [], 4),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_plan_follows_dtype_sampling_batching_and_family(tmp_path, monkeypatch, variant):
    """The terms that differ: logits cast from bfloat16, sampling's temporaries, fewer rows
    in flight than a micro-batch's, per-head norms before rotary, GeGLU's reference."""
    monkeypatch.setenv("HPCPAR_OPS", "device")
    changes, sets, itemsize = VARIANTS[variant]
    cfg = dict(shape("1b"), **changes)
    check_each_term(*measure_and_plan(MPI.COMM_SELF, tmp_path, cfg, (32, 20, 32, 9, 27),
                                      sets, itemsize=itemsize))


def test_the_plan_predicts_the_paged_caches_peak_behind_its_switch(tmp_path, monkeypatch):
    """``HPCPAR_PAGED_DEVICE=1``: the pool of every row's blocks and each micro-batch's rows
    in position order beside it (``paged_cache_bytes``), 5 prompts over 2 micro-batches."""
    monkeypatch.setenv("HPCPAR_OPS", "device")
    monkeypatch.setenv("HPCPAR_PAGED_DEVICE", "1")
    b, plan, peaks = measure_and_plan(MPI.COMM_SELF, tmp_path, shape("1b"), (32, 20, 32, 9, 27),
                                      ["parallel.micro_batches=2"])
    check_each_term(b, plan, peaks)
    contiguous = plan_stages(ModelConfig.from_hf(shape("1b")), ParallelConfig(micro_batches=2),
                             5, 32, 3, 4, GenerateSection(prefix_cache=False))[0]
    assert plan.kv_cache_bytes > 2 * contiguous.kv_cache_bytes     # the pool and its views


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("split", ["tp", "pp"])
def test_the_plan_predicts_each_ranks_peak_under_tp_and_pp(comm, mpi_tmp_path, monkeypatch,
                                                           split):
    """Every rank's own peak: its tp slices (KV heads split), or its pipeline stage (the
    embedding's, or the head's)."""
    monkeypatch.setenv("HPCPAR_OPS", "device")
    cfg = dict(shape("8b"), num_hidden_layers=4, num_key_value_heads=2)
    check_each_term(*measure_and_plan(comm, mpi_tmp_path / split, cfg, (32, 20, 32, 27),
                                      tp=2 if split == "tp" else 1,
                                      pp=2 if split == "pp" else 1))


def test_plan_prints_the_activation_bound_and_the_peak():
    cfg = ModelConfig.from_hf(preset_config("llama3-1b"))
    text = format_plan(cfg, ParallelConfig(tp=2), 8, 512, 64, 2, "llama3-1b")
    (stage,) = plan_stages(cfg, ParallelConfig(tp=2), 8, 512, 64, 2)
    assert stage.activation_bytes > 0 and stage.peak_bytes == (
        stage.weight_bytes + stage.kv_cache_bytes + stage.activation_bytes)
    assert "activations" in text and "extra" not in text
    assert f"{stage.peak_bytes / 1e9:.2f} GB at its peak" in text


@pytest.mark.parametrize("backend", ["numpy", "strict"])
def test_loaded_matrices_lie_where_the_products_read_them_and_merge_as_they_lie(tmp_path,
                                                                               backend):
    """q/k/v and gate/up are read into one matrix each, o and down alone: on the host
    transposed ([in, out] contiguous, NumPy's fast operand), on a device as they are ([out,
    in], each part one upload into its rows); the stage's merged projections are those
    matrices themselves, and its logits those of a stage built from separate tensors."""
    cfg = dict(preset_config("tiny"), num_hidden_layers=2)
    init_checkpoint(tmp_path / "model.h5", cfg)
    ckpt = open_checkpoint(tmp_path / "model.h5")
    be = select_backend(backend)
    span = StageSpan(range(2))
    specs = stage_tensors(ckpt.config, span.layers, True, True)
    stacks = matrix_stacks(specs, span)
    assert ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight") in stacks
    shard = load_shard(ckpt, specs, backend=be, stacks=stacks)
    qkv, first = shard.placed["model.layers.0.self_attn.k_proj.weight"]
    assert first == cfg["hidden_size"] and qkv.shape[0] == cfg["hidden_size"] + 2 * 16
    assert (qkv.T if backend == "numpy" else qkv).flags.c_contiguous
    tp, ops = create_communicator(MPI.COMM_SELF, "mpi"), ops_for(be)
    stage = DecoderStage.from_tensors(ckpt.config, specs, shard.tensors, span, tp, ops,
                                      np.dtype(np.float32), placed=shard.placed)
    merged = stage.decoder[0].attention.qkv.weights[0].data
    if backend == "numpy":        # the host's products read it in blocks (block_weights)
        assert np.array_equal(merged[np.arange(qkv.shape[0])], qkv)
    else:
        assert merged is qkv
    apart = DecoderStage.from_tensors(ckpt.config, specs, load_shard(ckpt, specs,
                                                                     backend=be).tensors,
                                      span, tp, ops, np.dtype(np.float32))
    ids = be.xp.asarray(np.arange(1, 7)[None])
    from hpcpar.parallel.ops import AttentionRows
    rows = AttentionRows.build(be.xp, np.array([6]), np.array([6]), from_start=True)
    got, want = (be.to_host(s.logits(s.forward(s.embed(ids), rows, None)))
                 for s in (stage, apart))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_plan_gives_the_paged_caches_blocks_and_the_rows_kv_memory_holds():
    cfg = ModelConfig.from_hf(preset_config("llama3-1b"))
    text = format_plan(cfg, ParallelConfig(), 64, 1000, 64, 4, "llama3-1b",
                       GenerateSection(kv_memory=4e9))
    per_block = 2 * 16 * 8 * 16 * 64 * 4     # k and v, 16 layers, 8 KV heads, 16 x 64 floats
    row = -(-(1000 + 64) // 16)
    assert f"blocks of 16 positions, {per_block / 1e6:.2f} MB each" in text
    assert f"a row of 1064 tokens takes {row}, the replica's 64 rows {64 * row}" in text
    assert f"holds {int(4e9 // per_block)}: {int(4e9 // per_block) // row} rows" in text


@pytest.mark.parametrize("tp", [1, 2])
def test_a_lora_plan_counts_the_frozen_base_and_the_adapters_state(tp):
    """Rank r on q and v: per layer and tp rank, A [r, hidden] whole and B [its rank's rows,
    r] of each (column-parallel bases: q's heads split over tp, the one KV head held whole
    by both ranks at tp 2), AdamW's two moments for them; the base's weights alone."""
    from hpcpar.jobs.job import TrainSection
    from hpcpar.jobs.plan import _size, format_train_plan
    from hpcpar.models.sharding import piece_of as piece
    cfg = ModelConfig.from_hf(shape("8b"))
    r = 8
    kv_rows = max(cfg.num_key_value_heads // tp, 1) * cfg.head_dim
    adapters = cfg.num_hidden_layers * sum(r * cfg.hidden_size + rows * r
                                           for rows in (cfg.q_size // tp, kv_rows))
    base = sum(int(np.prod(piece(spec, cfg, 0, tp).shape)) for spec in stage_tensors(
        cfg, range(cfg.num_hidden_layers), True, True))
    plan = format_train_plan(cfg, ParallelConfig(tp=tp), 1, TrainSection(lora_rank=r), "8b")
    assert "LoRA: rank 8, alpha 8, on q,v" in plan
    row = next(line.split() for line in plan.splitlines() if line.split()[:1] == ["0"])
    assert " ".join(row[3:5]) == _size(4 * base + 2 * 4 * adapters), (row, base, adapters)
    assert " ".join(row[5:7]) == _size(2 * 4 * adapters), (row, adapters)


def _plan_row_bytes(text: str) -> tuple[float, float]:
    """(weights + gradients, optimizer) in bytes from a one-stage training plan's row."""
    row = next(line for line in text.splitlines() if line.split()[:1] == ["0"])
    sizes = re.findall(r"([\d.]+) (GB|MB|kB|B)\b", row)
    scale = {"GB": 1e9, "MB": 1e6, "kB": 1e3, "B": 1}
    return tuple(float(n) * scale[u] for n, u in sizes[:2])


@pytest.mark.device            # (the strict phase too: a strict array's views counted once)
@pytest.mark.mpi(ranks=(2,))
@pytest.mark.parametrize("name, dtype", [("1b", "bfloat16"), ("8b", "float32")])
def test_the_plan_predicts_each_zero_stages_bytes_per_rank(comm, mpi_tmp_path, name, dtype):
    """ZeRO 1, 2 and 3 over dp 2: each rank's weights, gradients and optimizer state as the
    run holds them (``TrainReport.state_mb``, every distinct buffer once) are the plan's, and
    the layers' gathered weights and micro-batch gradients stay within its bound; on the
    1B shape (tied head) in bfloat16 and the 8B shape (its own head) in float32."""
    from hpcpar.jobs.plan import format_train_plan, zero_transient_bytes
    from hpcpar.jobs.train.engine import run_training
    folder = mpi_tmp_path
    if comm.Get_rank() == 0:
        init_checkpoint(folder / "model.h5", shape(name))
    comm.Barrier()
    cfg = open_checkpoint(folder / "model.h5").config
    for zero in (1, 2, 3):
        job = load_job(None, [f"model.checkpoint='{folder}/model.h5'", f"model.dtype='{dtype}'",
                              "data.dataset='synthetic'", f"output.path='{folder}/z{zero}'",
                              "parallel.dp=2", "train.steps=1", "train.global_batch=4",
                              "train.seq_len=16", f"train.zero={zero}", "train.peak_tflops=1"])
        report = run_training(comm, job, progress=False)
        if comm.Get_rank() == 0:
            layout = ParallelConfig(dp=2)
            itemsize = np.dtype(dtype).itemsize if dtype == "float32" else 2
            planned = _plan_row_bytes(format_train_plan(cfg, layout, 1, job.train, name,
                                                        itemsize=itemsize))
            for weights, grads, optimizer, transient in report.state_mb:
                measured = ((weights + grads) * 1e6, optimizer * 1e6)
                np.testing.assert_allclose(measured, planned, rtol=0.01, err_msg=f"zero {zero}")
                assert transient * 1e6 <= zero_transient_bytes(cfg, layout, zero, itemsize)
                assert (transient > 0) == (zero >= 2)
        comm.Barrier()
