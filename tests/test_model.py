"""hpcpar's single-rank model against the independent float64 reference (tests/reference.py):
prompt logits, KV-cache greedy decoding, left padding, EOS handling."""

import numpy as np
import pytest
from mpi4py import MPI

from helpers import GQA, PROMPTS, TIED, make_checkpoint, prompt_batch
from hpcpar.jobs.generate import Prompts, run_generation
from hpcpar.jobs.job import load_job
from reference import greedy, llama_logits


def _run(path, prompts, **generate):
    sets = [f"model.checkpoint='{path}'", "parallel.dp=1", "generate.save_logits=true"]
    sets += [f"generate.{k}={str(v).lower() if isinstance(v, bool) else v}"
             for k, v in generate.items()]
    job = load_job(None, sets)
    return run_generation(MPI.COMM_SELF, job, prompts=Prompts(prompts), progress=False)


@pytest.fixture(scope="module", params=["gqa", "tied"])
def model(request, tmp_path_factory):
    cfg = {"gqa": GQA, "tied": TIED}[request.param]
    path, tensors = make_checkpoint(tmp_path_factory.mktemp(request.param), cfg)
    return cfg, path, tensors


@pytest.mark.device
def test_prompt_logits_match_the_reference(model):
    cfg, path, tensors = model
    result = _run(path, PROMPTS, max_new_tokens=1)
    for b, prompt in enumerate(PROMPTS):
        expected = llama_logits(tensors, cfg, prompt[None])[0]
        got = result.prompt_logits[b, :len(prompt)]
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
        assert np.isnan(result.prompt_logits[b, len(prompt):]).all()


@pytest.mark.device
def test_padded_batch_equals_each_prompt_alone(model):
    _, path, _ = model
    together = _run(path, PROMPTS, max_new_tokens=4, stop_at_eos=False)
    for b, prompt in enumerate(PROMPTS):
        alone = _run(path, [prompt], max_new_tokens=4, stop_at_eos=False)
        np.testing.assert_allclose(together.prompt_logits[b, :len(prompt)],
                                   alone.prompt_logits[0], atol=1e-5, rtol=0)
        assert together.tokens[b].tolist() == alone.tokens[0].tolist()


@pytest.mark.device
def test_kv_cache_greedy_decoding_matches_full_recomputation(model):
    cfg, path, tensors = model
    result = _run(path, PROMPTS[:3], max_new_tokens=8, stop_at_eos=False)
    for b, prompt in enumerate(PROMPTS[:3]):
        assert result.tokens[b].tolist() == greedy(tensors, cfg, prompt, 8)
    assert result.lengths.tolist() == [8, 8, 8]


@pytest.mark.device
def test_rows_stop_at_eos_and_are_padded_after_it(model):
    cfg, path, tensors = model
    free = _run(path, PROMPTS[:1], max_new_tokens=6, stop_at_eos=False).tokens[0]
    # make the third greedy token the EOS of a config that says so
    eos = int(free[2])
    patched = dict(cfg, eos_token_id=eos, pad_token_id=0)
    from helpers import write_hf_checkpoint
    from hpcpar.checkpoint import convert
    folder = path.parent / f"eos{eos}"
    write_hf_checkpoint(folder / "hf", patched, extra=tensors)
    convert(folder / "hf", folder / "m.h5")
    result = _run(folder / "m.h5", PROMPTS[:1], max_new_tokens=6)
    first = free.tolist().index(eos)
    assert result.tokens[0, :first + 1].tolist() == free[:first + 1].tolist()
    assert (result.tokens[0, first + 1:] == 0).all()
    assert result.lengths[0] == first + 1


@pytest.mark.device
def test_continuous_batching_keeps_in_flight_what_fits_the_memory(tmp_path, monkeypatch):
    """Without --batch-size the rows in flight are what half the free memory holds of KV
    cache: with room for about two rows, slots are refilled and the tokens stay those of
    static batching."""
    from hpcpar.parallel.device.backend import ArrayBackend
    from hpcpar.jobs.generate import continuous, engine
    from hpcpar.models.kv_cache import kv_cache_bytes
    path, _ = make_checkpoint(tmp_path, GQA)
    widths = []

    class Recording(continuous.ContinuousProgram):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            widths.append(self.width)

    monkeypatch.setattr(engine, "ContinuousProgram", Recording)
    capacity = max(len(p) for p in PROMPTS) + 6
    row = kv_cache_bytes(GQA["num_hidden_layers"], 1, GQA["num_key_value_heads"], capacity,
                         GQA["head_dim"], 4)
    monkeypatch.setattr(ArrayBackend, "free_memory_bytes", lambda self: int(4.5 * row))
    fitted = _run(path, PROMPTS, max_new_tokens=6)
    assert widths == [[2]]
    static = _run(path, PROMPTS, max_new_tokens=6, batching="'static'")
    assert fitted.tokens.tolist() == static.tokens.tolist()


@pytest.mark.device
def test_a_refill_prefills_a_bounded_number_of_tokens(tmp_path, monkeypatch):
    """With room for 16 prompt tokens per refill, eight free slots fill over several
    segments (each prefill within the budget, or one prompt alone), and the tokens and prompt
    logits stay those of static batching."""
    from hpcpar.jobs.generate import continuous
    path, _ = make_checkpoint(tmp_path, GQA)
    monkeypatch.setattr(continuous, "PREFILL_TOKENS", 16)
    prefills = []
    admit = continuous.ContinuousProgram._admit

    def recording(self, waiting):
        take = admit(self, waiting)
        prefills.append([len(self.prompt_ids[p]) for p in waiting[:take]])
        return take

    monkeypatch.setattr(continuous.ContinuousProgram, "_admit", recording)
    prompts = PROMPTS * 2
    bounded = _run(path, prompts, max_new_tokens=5, batch_size=8)
    filled = [p for p in prefills if p]
    assert len(filled) > 1
    assert all(len(p) == 1 or len(p) * max(p) <= 16 for p in filled), filled
    assert sum(map(len, filled)) == len(prompts)
    static = _run(path, prompts, max_new_tokens=5, batching="'static'")
    assert bounded.tokens.tolist() == static.tokens.tolist()
    np.testing.assert_allclose(bounded.prompt_logits, static.prompt_logits, atol=1e-5, rtol=0)


@pytest.mark.device
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_the_report_splits_the_run_into_prefill_and_decode(tmp_path, batching):
    """Continuous batching's refills interleave with decoding: its prefill time is that of
    its prefill steps (not the time to the first fill), so the measured bubbles are
    fractions, as static batching's are."""
    path, _ = make_checkpoint(tmp_path, GQA)
    prompts = PROMPTS * 4
    width = 2 if batching == "continuous" else 0          # static runs every row at once
    result = _run(path, prompts, max_new_tokens=8, batch_size=width, batching=f"'{batching}'")
    report = result.report
    assert report.prefill_seconds > 0 and report.decode_seconds > 0
    for bubble in (report.bubble_prefill, report.bubble_decode):
        assert 0 <= bubble < 1, (report.bubble_prefill, report.bubble_decode)
    assert report.prefill_tokens_per_s == pytest.approx(
        sum(map(len, prompts)) / report.prefill_seconds)


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunks of 4"])
@pytest.mark.parametrize("name", ["gqa", "tied", "mistral"])
def test_a_prefill_computes_its_last_layer_at_each_rows_last_token_alone(tmp_path, name,
                                                                          chunk):
    """A prefill's head reads each row's last token: with ``keep`` the last layer's attention,
    MLP and residual adds run there alone, and give those states (next-token logits as the
    float64 reference's; a sliding window's as without ``keep``), while every position's keys
    and values are cached as without it. A prefill in chunks of 4 positions (prompts of 3 to
    12 tokens: rows that end in an earlier chunk than others) gives the same states."""
    from helpers import MISTRAL
    from hpcpar.parallel.device.backend import NUMPY
    from hpcpar.checkpoint import load_shard, open_checkpoint
    from hpcpar.parallel.comm import MpiCommunicator
    from hpcpar.models.decoder import DecoderStage
    from hpcpar.parallel.ops import AttentionRows, ops_for
    from hpcpar.models.tensors import StageSpan, stage_tensors
    cfg = {"gqa": GQA, "tied": TIED, "mistral": MISTRAL}[name]
    path, tensors = make_checkpoint(tmp_path, cfg)
    ckpt = open_checkpoint(path)
    layers = range(ckpt.config.num_hidden_layers)
    specs = stage_tensors(ckpt.config, layers, True, True)
    stage = DecoderStage.from_tensors(ckpt.config, specs, load_shard(ckpt, specs).tensors,
                                      StageSpan(layers), MpiCommunicator(MPI.COMM_SELF),
                                      ops_for(NUMPY), np.dtype(np.float32))
    whole = DecoderStage.from_tensors(ckpt.config, specs, load_shard(ckpt, specs).tensors,
                                      StageSpan(layers), MpiCommunicator(MPI.COMM_SELF),
                                      ops_for(NUMPY), np.dtype(np.float32))
    if chunk is not None:
        stage.prefill_chunk = chunk
    ids, lengths = prompt_batch()
    rows = AttentionRows.build(np, lengths, lengths, from_start=True)
    caches = [stage.new_cache(len(PROMPTS), 16) for _ in range(2)]
    every = whole.forward(stage.embed(ids), rows, caches[0])
    kept = stage.forward(stage.embed(ids), rows, caches[1], keep=lengths - 1)
    assert kept.shape == (len(PROMPTS), 1, cfg["hidden_size"])
    np.testing.assert_allclose(kept[:, 0], every[np.arange(len(PROMPTS)), lengths - 1],
                               atol=2e-5, rtol=0)
    for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        for row, n in enumerate(lengths):                      # the slots a row holds
            np.testing.assert_allclose(a[:, row, :, :n], b[:, row, :, :n], atol=2e-5, rtol=0)
    if chunk is not None:                     # and every position's states, chunk by chunk
        chunked = stage.forward(stage.embed(ids), rows, stage.new_cache(len(PROMPTS), 16))
        valid = np.arange(lengths.max())[None, :] < lengths[:, None]
        np.testing.assert_allclose(chunked[valid], every[valid], atol=2e-5, rtol=0)
    if name == "mistral":              # the reference has no sliding window (test_hf_parity)
        return
    logits = stage.logits(kept)[:, 0]
    for b, prompt in enumerate(PROMPTS):
        want = llama_logits(tensors, cfg, prompt[None])[0, -1]
        np.testing.assert_allclose(logits[b], want, atol=1e-4, rtol=0)


@pytest.mark.device
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_generation_with_prompts_prefilled_in_chunks_equals_whole_prompts(tmp_path,
                                                                           monkeypatch,
                                                                           batching):
    """Prompts longer than the prefill chunk (4 positions here) are prefilled a chunk at a
    time, in both batching modes (continuous batching's refills write the chunks into their
    rows of the cache): the same tokens and prompt logits as whole-prompt prefills, and the
    same tokens again where only each row's last token is computed (no logits saved)."""
    from hpcpar.models import decoder
    path, _ = make_checkpoint(tmp_path, GQA)
    whole = _run(path, PROMPTS, max_new_tokens=5, stop_at_eos=False, batching=f"'{batching}'")
    monkeypatch.setattr(decoder, "PREFILL_CHUNK", 4)
    chunked = _run(path, PROMPTS, max_new_tokens=5, stop_at_eos=False,
                   batching=f"'{batching}'")
    assert chunked.tokens.tolist() == whole.tokens.tolist()
    np.testing.assert_allclose(chunked.prompt_logits, whole.prompt_logits, atol=1e-5, rtol=0)
    sets = [f"model.checkpoint='{path}'", "parallel.dp=1", "generate.max_new_tokens=5",
            "generate.stop_at_eos=false", f"generate.batching='{batching}'"]
    last_only = run_generation(MPI.COMM_SELF, load_job(None, sets), prompts=Prompts(PROMPTS),
                               progress=False)
    assert last_only.tokens.tolist() == whole.tokens.tolist()
