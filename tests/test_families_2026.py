"""Gemma 2 and 3 and OLMo 2 (``hpcpar.models.gemma2``, ``gemma3``, ``olmo2``) beyond what
the suites over ``helpers.HF_CONFIGS`` check on one rank (logits, greedy and continuous generation,
scoring, training against torch, export): their attention op against torch's autograd,
their configs refused where they are not run exactly, and a multi-rank layout of every job
against transformers (generation, scoring) and the single rank (training): Gemma 2 under
tp 2 x pp 2 and cp 2 x pp 2 (soft-capped scores in the ring), Gemma 3 under tp 2 x pp 2,
OLMo 2 under tp 2 x pp 2 and tp 4 (its q/k norms over the whole projection summed over the
tp group, over KV heads held by two ranks each at tp 4), DeepSeek-V2 under tp 2 x pp 2 and
V3 under tp 2 x pp 2, dp 2 x tp 2 x ep 2 and cp 2 x pp 2 (generation too: the latent cache
split over cp); DeepSeek's own checks are ``test_deepseek``'s."""

import importlib.util

import numpy as np
import pytest
from mpi4py import MPI

from helpers import PROMPTS, build_hf_model
from hpcpar.jobs.generate import Prompts, run_generation
from hpcpar.jobs.job import load_job
from hpcpar.jobs.score import run_scoring
from hpcpar.jobs.train.engine import run_training
from hpcpar.models.config import ConfigError, ModelConfig, tp_problems

# torch and transformers are imported where a test needs them: under mpiexec by rank 0 only
HAVE_REFERENCES = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


# ---- the attention op ------------------------------------------------------------------

def _torch_attention(q, k, v, lengths, scale, cap, window):
    """transformers' eager attention (Gemma 2's): scores times ``scale``, cap tanh(s / cap),
    the causal (and window) mask, softmax, over GQA heads, float64, with autograd."""
    import torch
    B, T, nh, d = q.shape
    g = nh // k.shape[1]
    s = torch.einsum("bthd,bhsd->bhts", q, k.repeat_interleave(g, dim=1)) * scale
    s = s if cap is None else cap * torch.tanh(s / cap)
    t, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    n = torch.tensor(lengths)[:, None, None]
    seen = (j <= t) & (j > t - window) & (j[None] < n)
    seen = torch.where(t[None] >= n, j[None] == 0, seen)     # a padding query: key 0 alone
    s = s.masked_fill(~seen[:, None], -torch.inf)
    return torch.einsum("bhts,bhsd->bthd", torch.softmax(s, -1), v.repeat_interleave(g, dim=1))


@pytest.mark.parametrize("block, cap", [(4, 1.5), (128, 1.5), (4, None)],
                         ids=["tiles-online", "one-tile", "tiles-known-shift"])
def test_soft_capped_rescaled_windowed_attention_is_torchs_forward_and_backward(block, cap):
    """Tiles with an online softmax, one tile, and (no cap: Gemma 3) tiles whose softmax
    shift is known up front, each with the scale apart from 1/sqrt(d)."""
    torch = pytest.importorskip("torch")
    from hpcpar.parallel.ops import AttentionRows
    from hpcpar.parallel.ops.attention import Attention
    from hpcpar.parallel.ops.tiled_attention import TiledAttention
    rng = np.random.default_rng(5)
    B, T, nh, nkv, d = 3, 11, 4, 2, 8
    lengths = [11, 7, 2]
    q = rng.standard_normal((B, T, nh, d)) * 2
    k, v = (rng.standard_normal((B, nkv, T, d)) * 2 for _ in range(2))
    real = np.arange(T)[None, :] < np.array(lengths)[:, None]          # (B, T) real queries
    dout = np.where(real[..., None, None], rng.standard_normal((B, T, nh, d)), 0)
    rows = AttentionRows.build(np, lengths, lengths, from_start=True)
    rows = AttentionRows(rows.q_lengths, rows.kv_lengths, rows.max_kv, True, window=5,
                         scale=0.3, softcap=cap)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    want = _torch_attention(tq, tk, tv, lengths, 0.3, cap, 5)
    want.backward(torch.tensor(dout))
    for op in (Attention(np), TiledAttention(np, block=block)):
        out, ctx = op.forward_train(q, k, v, rows)
        np.testing.assert_allclose(out[real], want.detach().numpy()[real], atol=1e-12)
        dq, dk, dv = op.backward(dout, ctx)
        np.testing.assert_allclose(dq, tq.grad.numpy(), atol=1e-12)
        np.testing.assert_allclose(dk, tk.grad.numpy(), atol=1e-12)
        np.testing.assert_allclose(dv, tv.grad.numpy(), atol=1e-12)


# ---- what is refused -------------------------------------------------------------------

GEMMA2 = dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], vocab_size=64,
              hidden_size=32, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8)
OLMO2 = dict(GEMMA2, model_type="olmo2", architectures=["Olmo2ForCausalLM"])
GEMMA3 = dict(GEMMA2, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
              num_hidden_layers=7)


def test_gemma2_declares_its_layers_as_transformers_lays_them_out():
    cfg = ModelConfig.from_hf(GEMMA2)
    assert [cfg.window_of(i) for i in range(4)] == [4096, None, 4096, None]
    assert (cfg.attn_scale, cfg.attn_softcap, cfg.final_softcap) == (256 ** -0.5, 50.0, 30.0)
    assert (cfg.block_norms, cfg.norm_offset, cfg.tie_word_embeddings) == ("sandwich", 1, True)
    cfg = ModelConfig.from_hf(dict(GEMMA2, attn_logit_softcapping=None, sliding_window=3,
                                   final_logit_softcapping=None, layer_types=[
                                       "full_attention"] * 3 + ["sliding_attention"]))
    assert cfg.attn_softcap is cfg.final_softcap is None and cfg.window_layers == (3,)
    assert ModelConfig.from_hf(dict(GEMMA2, layer_types=["full_attention"] * 4)
                               ).sliding_window is None


@pytest.mark.parametrize("changes, message", [
    (dict(GEMMA2, use_bidirectional_attention=True), "use_bidirectional_attention true"),
    (dict(GEMMA2, sliding_window=None), "'sliding_attention' but sliding_window is null"),
    (dict(GEMMA2, query_pre_attn_scalar="256"), "query_pre_attn_scalar must be a number"),
    (dict(GEMMA2, attn_logit_softcapping=0), "attn_logit_softcapping must be positive"),
    (dict(GEMMA2, layer_types=["full_attention"] * 3), "layer_types lists 3 layers"),
    (dict(GEMMA2, hidden_activation="relu"), "hidden_activation 'relu' is not supported"),
    (dict(OLMO2, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(GEMMA3, rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2}}),
     "the local layers' default rope only"),
    (dict(GEMMA3, rope_parameters={"rope_type": "default"}), "given per layer type"),
    (dict(GEMMA3, sliding_window_pattern=0), "sliding_window_pattern must be a positive"),
    (dict(GEMMA3, use_bidirectional_attention=True), "use_bidirectional_attention true"),
], ids=["bidirectional", "no-window", "scalar-a-string", "cap-0", "layer_types-length",
        "gemma2-relu", "olmo2-gelu", "gemma3-local-linear", "gemma3-one-rope",
        "gemma3-pattern-0", "gemma3-bidirectional"])
def test_a_config_not_run_exactly_is_one_line_naming_the_field(changes, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(changes)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_gemma3_reads_its_layers_and_ropes_as_transformers_does():
    """The layer types of sliding_window_pattern (transformers' own config's), and the
    ropes per layer type of 5.x's rope_parameters the same as 4.x's top-level fields."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoConfig.for_model("gemma3_text", **{
        k: v for k, v in GEMMA3.items() if k not in ("model_type", "architectures")})
    cfg = ModelConfig.from_hf(GEMMA3)
    assert [cfg.window_of(i) is not None for i in range(7)] == [
        t == "sliding_attention" for t in theirs.layer_types]
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.attn_softcap, cfg.qk_norm) == (
        1e6, 1e4, None, True)
    v4 = ModelConfig.from_hf(dict(GEMMA3, rope_theta=500.0, rope_local_base_freq=20.0,
                                  rope_scaling={"rope_type": "linear", "factor": 8.0}))
    v5 = ModelConfig.from_hf(dict(GEMMA3, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 500.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}}))
    assert v4 == v5 and v5.rope_scaling.factor == 8.0 and v5.local_rope_theta == 20.0


def test_olmo2s_norms_over_the_whole_projection_split_as_q_and_k():
    """Cut by heads as q and k are (KV heads replicated where tp outnumbers them), so every
    tp of the heads runs: each rank's norm sums its squares with the others' (SpanNorms)."""
    from hpcpar.models.sharding import piece_of
    from hpcpar.models.tensors import layer_tensors
    cfg = ModelConfig.from_hf(OLMO2)
    assert cfg.valid_tp_sizes(8) == [1, 2, 4] and tp_problems(cfg, 2) == []
    specs = {s.role: s for s in layer_tensors(cfg, 0)}
    assert specs["q_norm"].shape == (32,) and specs["k_norm"].shape == (16,)
    assert [piece_of(specs["k_norm"], cfg, r, 4).source for r in range(4)] == [
        (slice(0, 8),), (slice(0, 8),), (slice(8, 16),), (slice(8, 16),)]
    assert piece_of(specs["q_norm"], cfg, 1, 2).source == (slice(16, 32),)


# ---- every job under a multi-rank layout -------------------------------------------------

# (dp, pp, cp, tp, micro_batches[, ep]) of each family's multi-rank runs, at 4 ranks
LAYOUTS = {"gemma2": [(1, 2, 1, 2, 2), (1, 2, 2, 1, 2)], "gemma3_text": [(1, 2, 1, 2, 2)],
           "olmo2": [(1, 2, 1, 2, 2), (1, 1, 1, 4, 1)],
           # latent attention's heads over tp (its latents on every rank), in the ring under
           # cp, and DeepSeek's routed experts over ep
           "deepseek_v2": [(1, 2, 1, 2, 2)],
           "deepseek_v3": [(1, 2, 1, 2, 2), (2, 1, 1, 2, 1, 2), (1, 2, 2, 1, 2)]}


def _sets(folder, layout):
    dp, pp, cp, tp, m, *ep = layout
    return [f"model.checkpoint='{folder}/model.h5'", f"parallel.dp={dp}", f"parallel.pp={pp}",
            f"parallel.cp={cp}", f"parallel.tp={tp}", f"parallel.micro_batches={m}"] + [
                f"parallel.ep={e}" for e in ep]


def _train(comm, folder, out, layout):
    """Two SGD steps (momentum: the second step's update holds the first's gradient too):
    an update is linear in the gradient, so a wrong gradient shows in the weights (AdamW's
    would hide a gradient wrong by a factor)."""
    return run_training(comm, load_job(None, _sets(folder, layout) + [
        f"data.dataset='{folder}/data.npy'", f"output.path='{folder}/{out}'",
        "train.steps=2", "train.global_batch=8", "train.optimizer='sgd'", "train.lr=0.05",
        "train.momentum=0.9", "train.clip_grad=0.5", "train.peak_tflops=1.0"]),
        progress=False)


def _metric(folder, name):
    import json
    return [json.loads(line)[name] for line in open(f"{folder}/metrics.jsonl")]


def _references(family, folder):
    """Rank 0's: transformers' prompt logits, greedy tokens and log-probabilities of
    ``PROMPTS``, and hpcpar's single-rank training run (checked against torch in
    test_train_torch), in ``folder``."""
    import torch
    model, _ = build_hf_model(family, folder)
    logits, tokens, logprobs = [], [], []
    with torch.no_grad():
        for p in PROMPTS:
            z = model(torch.tensor(p[None])).logits[0]
            logits.append(z.numpy())
            logp = torch.log_softmax(z.double(), -1)[:-1]
            logprobs.append(logp[torch.arange(len(p) - 1), torch.tensor(p[1:])].numpy())
            tokens.append(model.generate(torch.tensor(p[None]), max_new_tokens=6,
                                         do_sample=False,
                                         attention_mask=torch.ones(1, len(p), dtype=torch.long)
                                         )[0, len(p):].tolist())
    width = max(len(p) for p in PROMPTS)
    rows = np.full((len(PROMPTS), width), -1, dtype=np.int64)
    for r, p in enumerate(PROMPTS):
        rows[r, width - len(p):] = p
    np.save(folder / "rows.npy", rows)
    data = np.random.default_rng(1).integers(0, 250, (16, 9))
    data[3, :4] = -1                                                # left padding
    np.save(folder / "data.npy", data)
    _train(MPI.COMM_SELF, folder, "single", (1, 1, 1, 1, 1))
    return logits, tokens, logprobs


@pytest.mark.skipif(not HAVE_REFERENCES, reason="needs torch and transformers")
@pytest.mark.device
@pytest.mark.mpi(ranks=(4,), min_size=4)     # the layouts of 4 ranks
@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_every_job_under_a_multi_rank_layout_is_transformers_and_the_single_rank(
        tmp_path_factory, family):
    import h5py
    comm = MPI.COMM_WORLD
    folder, refs = None, None
    if comm.Get_rank() == 0:
        folder = tmp_path_factory.mktemp(family)
        refs = _references(family, folder)
    folder = comm.bcast(str(folder) if folder else None, root=0)
    for layout in LAYOUTS[family]:
        what = f"{family} {layout}"
        dp, pp, cp, tp, m, *_ = layout
        # a window's cache is not split over cp: generated alone; a latent's is
        generates = cp == 1 or family.startswith("deepseek")
        if generates:
            gen = run_generation(comm, load_job(None, _sets(folder, layout) + [
                "generate.max_new_tokens=6", f"generate.save_logits={str(cp == 1).lower()}",
                "generate.stop_at_eos=false"]), prompts=Prompts(PROMPTS), progress=False)
        scores = run_scoring(comm, load_job(None, _sets(folder, layout) + [
            f"score.data='{folder}/rows.npy'", f"output.path='{folder}/scores-{cp}.h5'"]))
        out = f"run-{''.join(map(str, layout))}"
        _train(comm, folder, out, layout)
        if comm.Get_rank() != 0:
            continue
        logits, tokens, logprobs = refs
        width = max(len(p) for p in PROMPTS)
        for b, p in enumerate(PROMPTS):
            if cp == 1:        # prompt logits split over cp are not gathered
                np.testing.assert_allclose(gen.prompt_logits[b, :len(p)], logits[b], atol=1e-4,
                                           rtol=0, err_msg=what)
            if generates:
                assert gen.tokens[b].tolist() == tokens[b], what
            row = scores.token_logprobs[b, width - len(p) + 1:]
            np.testing.assert_allclose(row, logprobs[b], atol=1e-4, rtol=0, err_msg=what)
        for metric in ("loss", "grad_norm"):
            np.testing.assert_allclose(_metric(f"{folder}/{out}", metric),
                                       _metric(f"{folder}/single", metric), rtol=1e-5,
                                       err_msg=f"{what} {metric}")
        with h5py.File(f"{folder}/{out}/step-2.h5") as f, \
                h5py.File(f"{folder}/single/step-2.h5") as ref, \
                h5py.File(f"{folder}/model.h5") as before:
            for name, dset in ref.items():
                if isinstance(dset, h5py.Dataset):
                    w, w_ref, w0 = f[name][()], dset[()], before[name][()]
                    assert (np.linalg.norm(w - w_ref)
                            <= 1e-5 * np.linalg.norm(w_ref - w0) + 1e-7), (what, name)
    comm.Barrier()
