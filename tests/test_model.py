"""hpcpar's single-rank model against the independent float64 reference (tests/reference.py):
prompt logits, KV-cache greedy decoding, left padding, EOS handling."""

import numpy as np
import pytest
from mpi4py import MPI

from helpers import GQA, PROMPTS, TIED, make_checkpoint
from hpcpar.generate import Prompts, run_generation
from hpcpar.jobs import load_job
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


def test_prompt_logits_match_the_reference(model):
    cfg, path, tensors = model
    result = _run(path, PROMPTS, max_new_tokens=1)
    for b, prompt in enumerate(PROMPTS):
        expected = llama_logits(tensors, cfg, prompt[None])[0]
        got = result.prompt_logits[b, :len(prompt)]
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
        assert np.isnan(result.prompt_logits[b, len(prompt):]).all()


def test_padded_batch_equals_each_prompt_alone(model):
    _, path, _ = model
    together = _run(path, PROMPTS, max_new_tokens=4, stop_at_eos=False)
    for b, prompt in enumerate(PROMPTS):
        alone = _run(path, [prompt], max_new_tokens=4, stop_at_eos=False)
        np.testing.assert_allclose(together.prompt_logits[b, :len(prompt)],
                                   alone.prompt_logits[0], atol=1e-5, rtol=0)
        assert together.tokens[b].tolist() == alone.tokens[0].tolist()


def test_kv_cache_greedy_decoding_matches_full_recomputation(model):
    cfg, path, tensors = model
    result = _run(path, PROMPTS[:3], max_new_tokens=8, stop_at_eos=False)
    for b, prompt in enumerate(PROMPTS[:3]):
        assert result.tokens[b].tolist() == greedy(tensors, cfg, prompt, 8)
    assert result.lengths.tolist() == [8, 8, 8]


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


def test_continuous_batching_keeps_in_flight_what_fits_the_memory(tmp_path, monkeypatch):
    """Without --batch-size the rows in flight are what half the free memory holds of KV
    cache: with room for about two rows, slots are refilled and the tokens stay those of
    static batching."""
    from hpcpar.backend import ArrayBackend
    from hpcpar.generate import continuous, engine
    from hpcpar.model import kv_cache_bytes
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


def test_a_refill_prefills_a_bounded_number_of_tokens(tmp_path, monkeypatch):
    """With room for 16 prompt tokens per refill, eight free slots fill over several
    segments (each prefill within the budget, or one prompt alone), and the tokens and prompt
    logits stay those of static batching."""
    from hpcpar.generate import continuous
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
