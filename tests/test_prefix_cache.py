"""Continuous batching in the paged KV cache with automatic prefix caching gives the tokens and
log-probabilities of the contiguous cache (``--no-prefix-cache``), which the other generation
tests hold to transformers: prompts sharing a prefix of several blocks, each family (the
mixtures of experts too), samples, per-row limits, seeded sampling with penalties, stop ids and
min_tokens, refills of few rows, several micro-batches, waves, rows preempted when the blocks
run out, the device path behind its switch, a Batch API file of chat requests with one system
message, and layouts of 2 and 4 ranks; the run report says how many prompt tokens came from
the cache; bad block sizes and pools are refused before any work. Scoring's rows that begin
alike compute their beginning once, with every row's log-probabilities those of the whole
row."""

import json
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from helpers import (GEMMA, GQA, HF_CONFIGS, MISTRAL, PHI3, QWEN3, TIED, make_checkpoint,
                     refused, world_checkpoint)
from hpcpar.jobs.generate import Prompts, run_generation
from hpcpar.jobs.job import load_job

FAMILIES = {"gqa": GQA, "tied": TIED, "qwen3": QWEN3, "gemma": GEMMA, "mistral": MISTRAL,
            "phi3": PHI3}
SAMPLED = {"temperature": 0.9, "top_k": 30, "seed": 4, "repetition_penalty": 1.3,
           "presence_penalty": 0.4, "logprobs": 2}


def _prompts(vocab: int, seed: int = 0) -> Prompts:
    """Two system prompts of 3 and 5 blocks of 8, each before several questions, a prompt
    that is a system prompt alone, and two unrelated ones; limits of their own."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, vocab, 24), rng.integers(3, vocab, 40)]
    ids = [np.concatenate([systems[i % 2], rng.integers(3, vocab, int(rng.integers(1, 12)))])
           for i in range(7)]
    ids += [systems[1], rng.integers(3, vocab, 19), rng.integers(3, vocab, 5)]
    return Prompts(ids, max_new_tokens=[int(k) for k in rng.integers(3, 9, len(ids))])


def _generate(comm, path, prompts, layout=(1, 1, 1, 1), cache=True, extra=(), **gen):
    dp, pp, tp, mbs = layout
    sets = [f"model.checkpoint='{path}'", f"parallel.dp={dp}", f"parallel.pp={pp}",
            f"parallel.tp={tp}", f"parallel.micro_batches={mbs}", "generate.max_new_tokens=8",
            "generate.stop_at_eos=false", "generate.kv_block_size=8",
            *([] if cache is None else [f"generate.prefix_cache={str(cache).lower()}"])]
    sets += [f"generate.{k}={json.dumps(v)}" for k, v in gen.items()]    # TOML values
    sets += list(extra)
    return run_generation(comm, load_job(None, sets), prompts=prompts, progress=False)


def _same(cached, contiguous, what) -> None:
    np.testing.assert_array_equal(cached.tokens, contiguous.tokens, err_msg=what)
    np.testing.assert_array_equal(cached.lengths, contiguous.lengths, err_msg=what)
    if contiguous.logprobs is not None:
        np.testing.assert_allclose(cached.logprobs.values, contiguous.logprobs.values,
                                   atol=1e-5, err_msg=what)
        np.testing.assert_array_equal(cached.logprobs.top_ids, contiguous.logprobs.top_ids)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    cfg = FAMILIES[request.param]
    return cfg, world_checkpoint(tmp_path_factory, f"prefix-{request.param}", cfg) / "model.h5"


def test_shared_prefixes_give_the_contiguous_caches_tokens_and_logprobs(family):
    """Greedy and sampled (with penalties), one sample and three, few rows in flight (refills
    that defer a prompt whose prefix another is writing) and two micro-batches."""
    cfg, path = family
    prompts = _prompts(cfg["vocab_size"])
    for gen in ({"batch_size": 3}, dict(SAMPLED, n=3, batch_size=4),
                dict(SAMPLED, stop_token_ids=list(range(3, 40)), min_tokens=2)):
        for layout in ((1, 1, 1, 1), (1, 1, 1, 2)):
            cached = _generate(MPI.COMM_SELF, path, prompts, layout, **gen)
            contiguous = _generate(MPI.COMM_SELF, path, prompts, layout, cache=False, **gen)
            _same(cached, contiguous, f"{gen} {layout}")


def test_the_report_gives_the_prompt_tokens_served_from_the_cache(tmp_path):
    path, _ = make_checkpoint(tmp_path, GQA)
    prompts = _prompts(GQA["vocab_size"])
    result = _generate(MPI.COMM_SELF, path, prompts, batch_size=2)
    # after the first question on each system prompt, the other questions share its full
    # blocks of 8 (3 on 3 blocks, 2 on 5), and the system prompt alone its first 4 (its
    # last token is computed)
    lengths = [len(p) for p in prompts.ids]
    shared = 3 * (3 * 8) + 2 * (5 * 8) + 4 * 8
    assert result.report.prefix_hit_rate == pytest.approx(shared / sum(lengths))
    assert "prefix cache: " in result.report.format()
    contiguous = _generate(MPI.COMM_SELF, path, prompts, cache=False, batch_size=2)
    assert contiguous.report.prefix_hit_rate == 0
    assert "prefix cache" not in contiguous.report.format()


def test_a_later_wave_shares_the_prompts_an_earlier_one_cached(tmp_path):
    """Waves of 3 prompts: the pool and its cached prompts outlive a wave, so a question on a
    system prompt an earlier wave computed prefills only its question."""
    path, _ = make_checkpoint(tmp_path, GQA)
    prompts = _prompts(GQA["vocab_size"])
    waves = _generate(MPI.COMM_SELF, path, prompts, wave_size=3, batch_size=3)
    one = _generate(MPI.COMM_SELF, path, prompts, batch_size=3)
    _same(waves, one, "waves of 3")
    _same(waves, _generate(MPI.COMM_SELF, path, prompts, cache=False, wave_size=3), "no cache")
    assert waves.report.prefix_hit_rate == pytest.approx(one.report.prefix_hit_rate)


@pytest.mark.device
def test_the_device_path_pages_rows_behind_its_switch(tmp_path, monkeypatch):
    """``HPCPAR_PAGED_DEVICE=1``: on the strict backend (the phase that repeats this test
    there) the paged cache's uploads, gathers and scatters run as a GPU's would, with the
    same tokens as the contiguous cache; so do scoring's shared beginnings, with the whole
    rows' log-probs."""
    monkeypatch.setenv("HPCPAR_PAGED_DEVICE", "1")
    path, _ = make_checkpoint(tmp_path, GQA)
    prompts = _prompts(GQA["vocab_size"], seed=3)
    gen = dict(SAMPLED, n=2, batch_size=4)
    cached = _generate(MPI.COMM_SELF, path, prompts, **gen)
    _same(cached, _generate(MPI.COMM_SELF, path, prompts, cache=False, **gen), "device path")
    assert cached.report.prefix_hit_rate > 0.3
    rows = _choices(GQA["vocab_size"])
    scores = _scored(MPI.COMM_SELF, path, rows, tmp_path)
    np.testing.assert_allclose(scores.token_logprobs, _scored(
        MPI.COMM_SELF, path, rows, tmp_path, cache=False).token_logprobs, atol=2e-5)
    assert scores.shared_positions > 0


@pytest.mark.gpu
def test_the_paged_cache_on_the_gpu_gives_the_contiguous_caches_tokens(tmp_path, monkeypatch):
    """The switch on a GPU: float32 tokens equal the contiguous cache's; bfloat16 runs (its
    GEMMs over other rows round apart, so only the cache's use is checked); scoring's shared
    beginnings give the whole rows' log-probs."""
    pytest.importorskip("cupy")
    monkeypatch.setenv("HPCPAR_PAGED_DEVICE", "1")
    path, _ = make_checkpoint(tmp_path, GQA)
    prompts = _prompts(GQA["vocab_size"], seed=3)
    gen = dict(SAMPLED, n=2, batch_size=4)
    for dtype in ("float32", "bfloat16"):
        extra = ("parallel.backend='cupy'", f"model.dtype='{dtype}'")
        cached = _generate(MPI.COMM_SELF, path, prompts, extra=extra, **gen)
        assert cached.report.kv_blocks > 0 and cached.report.prefix_hit_rate > 0.3, dtype
        if dtype == "float32":
            _same(cached, _generate(MPI.COMM_SELF, path, prompts, cache=False, extra=extra,
                                    **gen), "cupy")
    # scoring's shared beginnings on the GPU: the whole rows' log-probs
    monkeypatch.setenv("HPCPAR_BACKEND", "cupy")
    rows = _choices(GQA["vocab_size"])
    cached_scores = _scored(MPI.COMM_SELF, path, rows, tmp_path)
    assert cached_scores.shared_positions > 0
    np.testing.assert_allclose(cached_scores.token_logprobs,
                               _scored(MPI.COMM_SELF, path, rows, tmp_path,
                                       cache=False).token_logprobs, atol=2e-5)


def _block_bytes(cfg: dict, block: int = 8) -> int:
    """A block's keys and values over every layer, float32."""
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * block * 8 * 4


@pytest.mark.parametrize("gen, blocks", [({"batch_size": 6}, 10),
                                         (dict(SAMPLED, n=2, batch_size=6), 12)],
                         ids=["greedy", "sampled"])
def test_rows_preempted_when_the_blocks_run_out_give_the_same_tokens(tmp_path, gen, blocks):
    """A pool of a few blocks of 8 (the longest row needs 8): rows are preempted while
    others decode, wait, and compute their prompt and tokens again; every token is the
    contiguous cache's."""
    path, _ = make_checkpoint(tmp_path, GQA)
    prompts = _prompts(GQA["vocab_size"], seed=2)
    small = _generate(MPI.COMM_SELF, path, prompts, kv_memory=blocks * _block_bytes(GQA) + 1,
                      **gen)
    contiguous = _generate(MPI.COMM_SELF, path, prompts, cache=False, **gen)
    _same(small, contiguous, f"{blocks} blocks")
    assert small.report.kv_blocks == blocks and small.report.preemptions > 0
    assert "rows preempted" in small.report.format()


def test_rows_preempted_after_generating_return_together_with_their_own_tokens(tmp_path):
    """Four rows that each outgrow a pool of 10 blocks of 8: the newest are preempted after
    generating, and come back several in one refill (in reverse, by their keys), each
    computing its prompt and tokens again: every row's tokens and log-probs are its own,
    the contiguous cache's (a refill once handed its rows each other's logits)."""
    path, _ = make_checkpoint(tmp_path, GQA)
    rng = np.random.default_rng(5)
    prompts = Prompts([rng.integers(3, GQA["vocab_size"], 10) for _ in range(4)])
    small = _generate(MPI.COMM_SELF, path, prompts, kv_memory=10 * _block_bytes(GQA) + 1,
                      extra=["generate.max_new_tokens=40"], logprobs=1)
    contiguous = _generate(MPI.COMM_SELF, path, prompts, cache=False,
                           extra=["generate.max_new_tokens=40"], logprobs=1)
    _same(small, contiguous, "preempted rows")
    assert small.report.preemptions >= 3


def test_one_kv_memory_holds_more_rows_in_flight_paged_than_contiguous(tmp_path):
    """``--kv-memory`` bounds both caches: the contiguous one to the rows that fit at the
    longest row's length (here 3), the paged one to the blocks rows hold as they are (its
    shared prefixes once, each row's own length), which the run report gives as rows in
    flight."""
    path, _ = make_checkpoint(tmp_path, GQA)
    prompts = _prompts(GQA["vocab_size"], seed=2)
    longest = max(len(p) + k for p, k in zip(prompts.ids, prompts.max_new_tokens))
    memory = 3 * longest * _block_bytes(GQA, block=1) + 1
    contiguous = _generate(MPI.COMM_SELF, path, prompts, cache=False, kv_memory=memory)
    paged = _generate(MPI.COMM_SELF, path, prompts, kv_memory=memory)
    _same(paged, contiguous, "one kv memory")
    assert contiguous.report.rows_in_flight == 3
    assert paged.report.rows_in_flight >= 5, paged.report.rows_in_flight
    assert "rows in flight at most" in paged.report.format()


def test_a_pool_smaller_than_the_longest_row_is_refused(capfd, tmp_path):
    path, _ = make_checkpoint(tmp_path, GQA)
    prompts = _prompts(GQA["vocab_size"], seed=2)
    longest = max(-(-(len(p) + k) // 8) for p, k in zip(prompts.ids, prompts.max_new_tokens))
    message = refused(capfd, lambda: _generate(MPI.COMM_SELF, path, prompts,
                                               kv_memory=3 * _block_bytes(GQA) + 1))
    assert (f"the KV cache holds 3 blocks of 8 positions on the fullest rank, and the longest "
            f"row needs {longest} (its prompt and its new tokens): give --kv-memory more"
            in message)


def test_kv_memory_beyond_the_free_memory_is_refused(capfd, tmp_path):
    path, _ = make_checkpoint(tmp_path, GQA)
    message = refused(capfd, lambda: _generate(MPI.COMM_SELF, path, _prompts(250),
                                               kv_memory=1e18))
    assert "--kv-memory 1e+18 bytes is more than this rank's free memory" in message
    assert "give less, or a fraction of it (0.5: half)" in message


@pytest.mark.parametrize("name", ["gqa", "deepseek_v3"])
def test_decode_reads_a_shared_system_prompts_keys_once_per_group(tmp_path, monkeypatch, name):
    """Requests of one 64-token system prompt (8 blocks of 8, ``MIN_SHARED`` positions):
    their decode steps attend the shared blocks as one group (cascade attention), with the
    contiguous cache's tokens and log-probs; DeepSeek's shared blocks hold latents, one key
    head its queries' absorbed heads all read."""
    from hpcpar.checkpoint import init_checkpoint
    from hpcpar.parallel.ops import cascade_attention
    calls = []
    forward = cascade_attention.CascadeAttention.forward
    monkeypatch.setattr(cascade_attention.CascadeAttention, "forward",
                        lambda self, *a: calls.append(len(a[-1].members)) or forward(self, *a))
    if name == "gqa":
        cfg = GQA
        path, _ = make_checkpoint(tmp_path, GQA)
    else:
        cfg = dict(HF_CONFIGS[name], architectures=["DeepseekV3ForCausalLM"])
        path = tmp_path / "model.h5"
        init_checkpoint(path, cfg)
    rng = np.random.default_rng(5)
    vocab = cfg["vocab_size"]
    system = rng.integers(3, vocab, cascade_attention.MIN_SHARED)
    prompts = Prompts([np.concatenate([system, rng.integers(3, vocab, k)])
                       for k in (3, 9, 1, 12, 6)] + [rng.integers(3, vocab, 20)])
    cached = _generate(MPI.COMM_SELF, path, prompts, logprobs=2)
    assert calls and max(calls) == 1            # one group: the system prompt's requests
    _same(cached, _generate(MPI.COMM_SELF, path, prompts, cache=False, logprobs=2), "cascade")


@pytest.mark.parametrize("option, why", [
    ({"batching": "static"}, "static batching runs each micro-batch in a KV cache of its own"),
    ({"prompt_logprobs": 1}, "prompt logits and prompt log-probabilities are computed at every "
                             "prompt position"),
    ({"backend": "strict"}, "the paged cache on a device has not run on a GPU yet: set "
                            "HPCPAR_PAGED_DEVICE=1"),
])
def test_the_prefix_cache_asked_for_where_it_cannot_serve_is_refused(capfd, tmp_path, option,
                                                                     why):
    """By default such a job runs in the contiguous cache; ``--prefix-cache`` asks for the
    paged one, and gets one line saying why not (the device's after choosing the backend,
    before loading)."""
    path, _ = make_checkpoint(tmp_path, GQA)
    extra = [f"parallel.backend='{option.pop('backend')}'"] if "backend" in option else []
    default = _generate(MPI.COMM_SELF, path, _prompts(250), cache=None, extra=extra, **option)
    assert default.report.kv_blocks == 0
    message = refused(capfd, lambda: _generate(MPI.COMM_SELF, path, _prompts(250),
                                               extra=extra, **option))
    assert message.startswith("2 hpcpar: error: --prefix-cache: " + why), message


@pytest.mark.mpi(ranks=(2, 4))
def test_every_layout_with_the_prefix_cache_gives_the_single_ranks_tokens(tmp_path_factory):
    """tp 2 x pp 2 and dp 2 x pp 2 (4 ranks), dp 2 and pp 2 (2 ranks): every stage keeps the
    same books, so every rank's cache serves the same prompt tokens."""
    comm = MPI.COMM_WORLD
    path = world_checkpoint(tmp_path_factory, "prefix-layouts", GQA) / "model.h5"
    prompts = _prompts(GQA["vocab_size"], seed=1)
    gen = dict(SAMPLED, n=2, batch_size=3)
    single = (_generate(MPI.COMM_SELF, path, prompts, cache=False, **gen)
              if comm.Get_rank() == 0 else None)
    layouts = {2: [(2, 1, 1, 1), (1, 2, 1, 2)], 4: [(1, 2, 2, 2), (2, 2, 1, 1)]}
    for layout in layouts[comm.Get_size()]:
        result = _generate(comm, path, prompts, layout, **gen)
        if comm.Get_rank() == 0:
            _same(result, single, str(layout))
            assert result.report.prefix_hit_rate > 0.4, layout


@pytest.mark.mpi(ranks=(2, 4))
def test_rows_preempted_under_pp_give_the_single_ranks_tokens(tmp_path_factory):
    """pp 2 with 4 micro-batches (2 ranks), pp 4 (4 ranks), a pool that preempts rows after
    they generated, seeded samples (n = 2): every stage readmits a row from the tokens it
    generated, which only the last stage samples (the first stage embedded stale ones, the
    middle stages hashed them for their prefix caches and their books parted), and a
    sample's blocks promised at one micro-batch's refill are kept from the next's (they
    were not: OutOfBlocks at its fork). A user trial found all three."""
    comm = MPI.COMM_WORLD
    path = world_checkpoint(tmp_path_factory, "prefix-preempt-pp", GQA) / "model.h5"
    rng = np.random.default_rng(7)
    prompts = Prompts([rng.integers(3, GQA["vocab_size"], int(n))
                       for n in rng.integers(20, 60, 10)])
    gen = dict(SAMPLED, n=2)
    extra = ["generate.max_new_tokens=24"]
    single = (_generate(MPI.COMM_SELF, path, prompts, cache=False, extra=extra, **gen)
              if comm.Get_rank() == 0 else None)
    layout = {2: (1, 2, 1, 4), 4: (1, 4, 1, 1)}[comm.Get_size()]
    memory = 12 * _block_bytes(GQA) + 1       # per stage: 12 blocks of its layers' share
    result = _generate(comm, path, prompts, layout, kv_memory=memory, extra=extra, **gen)
    if comm.Get_rank() == 0:
        _same(result, single, str(layout))
        assert result.report.preemptions > 0 and result.report.prefix_hit_rate > 0


def test_a_block_size_that_is_not_a_power_of_two_is_refused(capfd, tmp_path):
    path, _ = make_checkpoint(tmp_path, GQA)
    message = refused(capfd, lambda: _generate(MPI.COMM_SELF, path, _prompts(250),
                                               kv_block_size=24))
    assert message.strip() == ("2 hpcpar: error: generate.kv_block_size 24 is not a power of "
                               "two: pass --kv-block-size 16 (the default), 8, 32, 64, ...")


# ---- scoring: rows that begin alike compute their beginning once ----------------------------

def _scored(comm, path, rows: list, folder, layout=(1, 1, 1, 1), cache=True):
    """Score ``rows`` (token id lists) written as .jsonl into ``folder``."""
    from hpcpar.jobs.score import run_scoring
    dp, pp, tp, mbs = layout
    data = folder / "rows.jsonl"
    if comm.Get_rank() == 0:
        data.write_text("".join(json.dumps({"ids": [int(t) for t in r]}) + "\n" for r in rows))
    comm.Barrier()
    sets = [f"model.checkpoint='{path}'", f"score.data='{data}'",
            f"output.path='{folder}/{cache}-{dp}{pp}{tp}{mbs}.h5'",
            f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.tp={tp}",
            f"parallel.micro_batches={mbs}",
            *([] if cache is None else [f"score.prefix_cache={str(cache).lower()}"])]
    return run_scoring(comm, load_job(None, sets), progress=False)


def _choices(vocab: int, seed: int = 0) -> list:
    """A multiple-choice set: contexts of 40 and 23 tokens, each before 4 continuations (one
    the context alone, one that shares a token more with another), and two unrelated rows."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in (40, 23):
        context = rng.integers(3, vocab, n)
        tails = [rng.integers(3, vocab, int(rng.integers(2, 9))) for _ in range(3)]
        tails[1][0] = tails[0][0]
        rows += [np.concatenate([context, t]) for t in tails] + [context]
    return rows + [rng.integers(3, vocab, 30), rng.integers(3, vocab, 6)]


def test_scored_rows_that_begin_alike_are_the_rows_scored_alone(family, tmp_path):
    """Every row's log-probabilities, and so its NLL and the perplexity, equal the whole
    rows' (``--no-prefix-cache``); one micro-batch and three, which never cut the rows of a
    context apart."""
    cfg, path = family
    rows = _choices(cfg["vocab_size"])
    for mbs in (1, 3):
        cached = _scored(MPI.COMM_SELF, path, rows, tmp_path, (1, 1, 1, mbs))
        whole = _scored(MPI.COMM_SELF, path, rows, tmp_path, (1, 1, 1, mbs), cache=False)
        np.testing.assert_allclose(cached.token_logprobs, whole.token_logprobs, atol=2e-5,
                                   err_msg=f"{mbs} micro-batches")
        assert np.isnan(cached.token_logprobs).sum() == np.isnan(whole.token_logprobs).sum()
        assert cached.perplexity == pytest.approx(whole.perplexity, rel=1e-5)
        # 4 rows a context of P: each computes from P - 1, P once more; a context's rows are
        # never cut over micro-batches
        assert cached.shared_positions == (4 * 39 - 40) + (4 * 22 - 23), mbs
        assert "computed once" in cached.format()
    assert whole.shared_positions == 0


def test_scoring_asked_to_share_beginnings_where_it_cannot_is_refused(capfd, tmp_path,
                                                                     monkeypatch):
    """On a device before it has run on one (the strict backend), by default every row is
    scored whole; ``--prefix-cache`` is one line, after choosing the backend and before
    loading."""
    monkeypatch.setenv("HPCPAR_BACKEND", "strict")
    path, _ = make_checkpoint(tmp_path, GQA)
    rows = _choices(GQA["vocab_size"])
    assert _scored(MPI.COMM_SELF, path, rows, tmp_path, cache=None).shared_positions == 0
    message = refused(capfd, lambda: _scored(MPI.COMM_SELF, path, rows, tmp_path))
    assert message.startswith("2 hpcpar: error: --prefix-cache: rows sharing their "
                              "beginnings have not run on a GPU yet"), message


@pytest.mark.mpi(ranks=(2,))
def test_scoring_with_shared_beginnings_under_tp_pp_and_dp(tmp_path_factory):
    """Under pp a micro-batch whose rows share beginnings takes two passes through the
    pipeline (its prefixes, then the rest), the others one: 4 micro-batches of both kinds."""
    comm = MPI.COMM_WORLD
    folder = world_checkpoint(tmp_path_factory, "shared-score", GQA)
    rows = _choices(GQA["vocab_size"], seed=1)
    whole = (_scored(MPI.COMM_SELF, folder / "model.h5", rows, folder, cache=False)
             if comm.Get_rank() == 0 else None)
    for layout in ((1, 1, 2, 1), (2, 1, 1, 1), (1, 2, 1, 4)):
        cached = _scored(comm, folder / "model.h5", rows, folder, layout)
        if comm.Get_rank() == 0:
            np.testing.assert_allclose(cached.token_logprobs, whole.token_logprobs, atol=2e-5,
                                       err_msg=str(layout))
            assert cached.shared_positions > 0
            if layout[0] == 1:              # one replica: every context's rows together
                assert cached.shared_positions == (4 * 39 - 40) + (4 * 22 - 23), layout


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_mixtures_of_experts_share_prefixes_exactly(name, tmp_path):
    """The families whose MLP routes each token: generation in the paged cache and scoring
    with shared beginnings give the contiguous cache's tokens and the whole rows' scores."""
    pytest.importorskip("transformers")
    from helpers import build_hf_model
    _, path = build_hf_model(name, tmp_path)
    prompts = _prompts(250, seed=4)
    gen = dict(SAMPLED, n=2, batch_size=3)
    _same(_generate(MPI.COMM_SELF, path, prompts, **gen),
          _generate(MPI.COMM_SELF, path, prompts, cache=False, **gen), name)
    rows = _choices(250, seed=4)
    np.testing.assert_allclose(_scored(MPI.COMM_SELF, path, rows, tmp_path).token_logprobs,
                               _scored(MPI.COMM_SELF, path, rows, tmp_path,
                                       cache=False).token_logprobs, atol=2e-5)


@pytest.mark.mpi(ranks=(2,))
def test_a_mixture_of_experts_under_ep_shares_prefixes_exactly(tmp_path_factory):
    """dp 2 x ep 2: each replica's pool on its own rank, the experts split over the two,
    which meet in every MoE layer whatever their refills: the single rank's tokens."""
    pytest.importorskip("transformers")
    from helpers import build_hf_model
    comm = MPI.COMM_WORLD
    folder = None
    if comm.Get_rank() == 0:
        folder = tmp_path_factory.mktemp("prefix-ep")
        build_hf_model("mixtral", folder)
    path = Path(comm.bcast(str(folder) if folder else None, root=0)) / "model.h5"
    prompts = _prompts(250, seed=4)
    gen = dict(SAMPLED, n=2, batch_size=3)
    single = (_generate(MPI.COMM_SELF, path, prompts, cache=False, **gen)
              if comm.Get_rank() == 0 else None)
    result = _generate(comm, path, prompts, (2, 1, 1, 1), extra=["parallel.ep=2"], **gen)
    if comm.Get_rank() == 0:
        _same(result, single, "dp 2 x ep 2")
        assert result.report.prefix_hit_rate > 0.3


def test_a_batch_api_file_of_one_system_message_shares_its_keys(tmp_path):
    """Chat requests of an OpenAI Batch API file, rendered by the checkpoint's chat template,
    that open with one system message: every request after the first prefills only what
    follows it, with the tokens of the run without."""
    pytest.importorskip("transformers")
    from helpers import build_hf_model, save_word_tokenizer
    from hpcpar.checkpoint import convert
    template = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n"
                "{{ m['content'] | trim }}<|end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")
    build_hf_model("gqa-llama3", tmp_path)
    save_word_tokenizer(tmp_path / "hf", template)
    convert(tmp_path / "hf", tmp_path / "chat.h5")
    system = " ".join(f"w{i}" for i in range(40))
    with open(tmp_path / "batch.jsonl", "w") as f:
        for i in range(6):
            body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "logprobs": True,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"w{100 + i} w{120 + i}"}]}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")
    runs = {}
    for cache in (True, False):
        sets = [f"model.checkpoint='{tmp_path}/chat.h5'",
                f"data.prompts='{tmp_path}/batch.jsonl'", "generate.max_new_tokens=5",
                f"output.path='{tmp_path}/out-{cache}.jsonl'", "generate.kv_block_size=8",
                "generate.batch_size=3", f"generate.prefix_cache={str(cache).lower()}"]
        runs[cache] = run_generation(MPI.COMM_SELF, load_job(None, sets), progress=False)
    _same(runs[True], runs[False], "batch file")
    assert runs[True].report.prefix_hit_rate > 0.5


def test_runs_of_rows_that_begin_alike_and_what_their_passes_compute():
    from hpcpar.jobs.score.shared_prefix import run_cost, shared_runs
    context = list(range(3, 23))                                   # 20 tokens
    rows = [np.array(context + [50, 51]), np.array(context + [60]), np.array([7] * 30),
            np.array(context[:10] + [90] * 12), np.array(context + [70, 71, 72])]
    assert shared_runs(rows) == [(0, 2), (2, 3), (3, 4), (4, 5)]   # 10 shared: too few
    assert run_cost(rows[0:2]) == 20 + 2 * (22 - 20 + 1)           # the prefix once
    assert run_cost(rows[2:3]) == 30 and shared_runs([]) == []
