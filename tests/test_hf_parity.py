"""Parity with Hugging Face itself: a tiny random ``LlamaForCausalLM`` built with transformers,
saved, converted with ``hpcpar convert``, and compared on prompt logits and greedy tokens.

Skips without transformers; ``.ci/run`` installs it (CPU torch) so that CI never skips.
"""

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import HF_CONFIGS, PROMPTS, build_hf_model  # noqa: E402
from hpcpar.jobs.generate import Prompts, run_generation  # noqa: E402
from hpcpar.jobs.job import load_job  # noqa: E402

pytestmark = pytest.mark.device


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_model(request, tmp_path_factory):
    return build_hf_model(request.param, tmp_path_factory.mktemp(request.param))


def _hpcpar(path, prompts, n, *sets):
    job = load_job(None, [f"model.checkpoint='{path}'", "generate.save_logits=true",
                          f"generate.max_new_tokens={n}", "generate.stop_at_eos=false", *sets])
    return run_generation(MPI.COMM_SELF, job, prompts=Prompts(prompts), progress=False)


def _transformers_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor(prompt[None]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def _assert_prompt_logits_are_transformers(model, path):
    ours = _hpcpar(path, PROMPTS, 1)
    for b, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            theirs = model(torch.tensor(prompt[None])).logits[0].numpy()
        np.testing.assert_allclose(ours.prompt_logits[b, :len(prompt)], theirs, atol=1e-4,
                                   rtol=0)


def test_prompt_logits_match_transformers(hf_model):
    _assert_prompt_logits_are_transformers(*hf_model)


def test_greedy_tokens_match_transformers_generate(hf_model):
    model, path = hf_model
    n = 10
    ours = _hpcpar(path, PROMPTS, n)
    for b, prompt in enumerate(PROMPTS):
        assert ours.tokens[b].tolist() == _transformers_greedy(model, prompt, n)


def test_two_rows_in_flight_refilled_many_times_give_transformers_greedy_tokens(hf_model):
    """Continuous batching with 2 slots for 11 prompts of lengths 1 to 14, each with its own
    limit: slots are refilled 9 times at different steps; every row's tokens are those of
    transformers generating it alone."""
    model, path = hf_model
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 250, n) for n in (5, 1, 14, 3, 9, 2, 12, 7, 4, 11, 6)]
    limits = [9, 3, 12, 1, 7, 12, 5, 10, 2, 8, 12]
    ours = run_generation(MPI.COMM_SELF, load_job(None, [
        f"model.checkpoint='{path}'", "generate.max_new_tokens=12",
        "generate.stop_at_eos=false", "generate.batch_size=2"]),
        prompts=Prompts(prompts, max_new_tokens=limits), progress=False)
    for b, (prompt, k) in enumerate(zip(prompts, limits)):
        assert ours.lengths[b] == k
        assert ours.tokens[b, :k].tolist() == _transformers_greedy(model, prompt, k), b


def test_left_padded_batch_matches_transformers_with_an_attention_mask(hf_model):
    model, path = hf_model
    ours = _hpcpar(path, PROMPTS, 1)
    width = max(len(p) for p in PROMPTS)
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(PROMPTS):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    with torch.no_grad():
        theirs = model(ids, attention_mask=mask).logits.numpy()
    for b, p in enumerate(PROMPTS):
        np.testing.assert_allclose(ours.prompt_logits[b, :len(p)], theirs[b, width - len(p):],
                                   atol=1e-4, rtol=0)


def test_every_eos_id_of_generation_config_ends_a_row_as_transformers_does(hf_model, tmp_path):
    """generation_config.json lists stop ids config.json does not (as Llama 3 instruct
    does): each ends a row, as transformers' generate with that list, and the row records
    why it ended."""
    import json
    import shutil
    from hpcpar.checkpoint import convert
    model, path = hf_model
    free = _hpcpar(path, PROMPTS, 8)                     # past any EOS
    stops = [int(free.tokens[0, 2]), int(free.tokens[1, 4])]
    hf = tmp_path / "hf"
    shutil.copytree(path.parent / "hf", hf)
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    convert(hf, tmp_path / "stops.h5")
    ours = run_generation(MPI.COMM_SELF, load_job(None, [
        f"model.checkpoint='{tmp_path / 'stops.h5'}'", "generate.max_new_tokens=8",
        f"output.path='{tmp_path / 'out.h5'}'"]), prompts=Prompts(PROMPTS), progress=False)
    reasons = []
    for b, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = model.generate(torch.tensor(prompt[None]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=stops, pad_token_id=stops[0],
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        theirs = out[0, len(prompt):].tolist()
        ended = next((k + 1 for k, t in enumerate(theirs) if t in stops), None)
        theirs = theirs[:ended]
        assert ours.tokens[b, :ours.lengths[b]].tolist() == theirs, b
        reasons.append("eos" if ended else "length")
    assert ours.finish_reasons == reasons and reasons[:2] == ["eos", "eos"]
    import h5py
    with h5py.File(tmp_path / "out.h5") as f:
        assert [r.decode() for r in f["finish_reason"][()]] == reasons


def test_a_qwen2_moe_without_a_shared_expert_converts_computes_and_exports_exactly(tmp_path):
    """shared_expert_intermediate_size 0 (a valid config): transformers still builds the
    empty shared expert and its gate, which add zero. convert takes them, the logits are
    transformers', and export gives every tensor back, so transformers loads it whole."""
    from safetensors.numpy import load_file
    from hpcpar.checkpoint.export import export
    model, path = build_hf_model("qwen2_moe", tmp_path, shared_expert_intermediate_size=0)
    _assert_prompt_logits_are_transformers(model, path)
    export(path, tmp_path / "out")
    mine = load_file(str(tmp_path / "out" / "model.safetensors"))
    source = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(mine) == sorted(source)
    for name, value in source.items():
        np.testing.assert_array_equal(mine[name], value, err_msg=name)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                                output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
