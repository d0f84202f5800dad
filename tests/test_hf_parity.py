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
from hpcpar.generate import Prompts, run_generation  # noqa: E402
from hpcpar.jobs import load_job  # noqa: E402

@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_model(request, tmp_path_factory):
    return build_hf_model(request.param, tmp_path_factory.mktemp(request.param))


def _hpcpar(path, prompts, n):
    job = load_job(None, [f"model.checkpoint='{path}'", "generate.save_logits=true",
                          f"generate.max_new_tokens={n}", "generate.stop_at_eos=false"])
    return run_generation(MPI.COMM_SELF, job, prompts=Prompts(prompts), progress=False)


def test_prompt_logits_match_transformers(hf_model):
    model, path = hf_model
    ours = _hpcpar(path, PROMPTS, 1)
    for b, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            theirs = model(torch.tensor(prompt[None])).logits[0].numpy()
        np.testing.assert_allclose(ours.prompt_logits[b, :len(prompt)], theirs, atol=1e-4,
                                   rtol=0)


def test_greedy_tokens_match_transformers_generate(hf_model):
    model, path = hf_model
    n = 10
    ours = _hpcpar(path, PROMPTS, n)
    for b, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = model.generate(torch.tensor(prompt[None]), max_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert ours.tokens[b].tolist() == out[0, len(prompt):].tolist()


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
