"""The rope variants of long-context models (``hpcpar.models.rope``): YaRN (Qwen's, DeepSeek's
with its mscale terms), Phi-3's LongRoPE and partial rotary give transformers' own
frequencies and attention factor (``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``),
on configs as their config classes read them. The whole models (Qwen2 with YaRN, Phi-3 with
LongRoPE over 3/4 of each head) are checked against transformers by the suites over
``helpers.HF_CONFIGS``: logits, generation, scoring, training, export. A row past LongRoPE's
original_max_position_embeddings, where transformers turns to its long factors within a
sequence, is refused in one line."""

import copy

import numpy as np
import pytest

from helpers import HF_CONFIGS
from hpcpar.models.config import ConfigError, ModelConfig
from hpcpar.models.rope import attention_factor, inverse_frequencies

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
CASES = {
    "qwen2 yarn": ("qwen2", "Qwen2Config", {"rope_scaling": YARN}),
    "yarn, bounds not truncated, own betas": (
        "qwen2", "Qwen2Config", {"rope_scaling": dict(YARN, truncate=False, beta_fast=16,
                                                      beta_slow=2)}),
    "yarn with DeepSeek's mscale terms": (
        "llama", "LlamaConfig", {"rope_scaling": dict(YARN, factor=40.0, mscale=0.707,
                                                      mscale_all_dim=0.707)}),
    "yarn with its attention_factor": (
        "llama", "LlamaConfig", {"rope_scaling": dict(YARN, attention_factor=0.9)}),
    "phi3 longrope, partial rotary": ("phi3", "Phi3Config", {}),
    "phi3 longrope, its factor given": (
        "phi3", "Phi3Config", {"rope_scaling": dict(HF_CONFIGS["phi3"]["rope_scaling"],
                                                    factor=1.5)}),
}


@pytest.mark.parametrize("case", CASES)
def test_frequencies_and_attention_factor_are_transformers(case):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    name, config_class, changes = CASES[case]
    settings = dict(HF_CONFIGS.get(name, HF_CONFIGS["gqa-llama3"]), **changes)
    settings.pop("model_type", None)
    # (transformers' config fills its rope dict in place: give it a copy)
    theirs = getattr(transformers, config_class)(**copy.deepcopy(settings))
    rope_type = theirs.rope_parameters["rope_type"]
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](theirs, None)
    architecture = config_class.replace("Config", "ForCausalLM")
    ours = ModelConfig.from_hf(dict(settings, model_type=name, architectures=[architecture]))
    np.testing.assert_allclose(inverse_frequencies(ours), inv_freq.numpy(), rtol=1e-6)
    assert attention_factor(ours) == pytest.approx(factor, rel=1e-12)


def test_a_row_past_longropes_original_positions_is_refused(tmp_path, capfd):
    """Past original_max_position_embeddings (64 here, of 128) transformers turns to the
    long factors for every position of the batch at once; hpcpar holds rows to 64."""
    pytest.importorskip("transformers")
    from mpi4py import MPI

    from helpers import build_hf_model, refused
    from hpcpar.jobs.generate import Prompts, run_generation
    from hpcpar.jobs.job import load_job
    _, path = build_hf_model("phi3", tmp_path)
    job = load_job(None, [f"model.checkpoint='{path}'", "generate.max_new_tokens=8"])
    message = refused(capfd, lambda: run_generation(MPI.COMM_SELF, job, progress=False,
                                                    prompts=Prompts([np.arange(3, 63)])))
    assert ("prompt 0 has 60 tokens, which plus 8 new tokens exceeds the model's longrope's "
            "original_max_position_embeddings 64 (past it transformers turns to the long "
            "factors within a sequence, which hpcpar does not run)") in message, message


@pytest.mark.parametrize("changes, words", [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 2.0],
                       "long_factor": [1.0, 2.0, 3.0]}},
     "short_factor holds 2 numbers, and rotary turns 3 frequencies"),
    ({"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0, 2.0, 3.0]}},
     "lacks short_factor"),
    ({"partial_rotary_factor": 0.375}, "partial_rotary_factor 0.375 must be in (0, 1] and turn an "
                                       "even number"),
])
def test_a_rope_that_cannot_run_is_one_line(changes, words):
    settings = dict(HF_CONFIGS["phi3"], architectures=["Phi3ForCausalLM"], **changes)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(settings)
    assert words in str(e.value), str(e.value)
