import pytest

from hpcpar.models.config import ConfigError, ModelConfig

from hpcpar.jobs.layout import ParallelConfig
from helpers import TINY

LLAMA31_V4 = dict(TINY, rope_theta=500000.0, rope_scaling={
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}, eos_token_id=[128001, 128009])
LLAMA31_V5 = {k: v for k, v in LLAMA31_V4.items() if k not in ("rope_theta", "rope_scaling")}
LLAMA31_V5["rope_parameters"] = dict(LLAMA31_V4["rope_scaling"], rope_theta=500000.0)


def test_transformers_4_and_5_configs_parse_the_same():
    v4, v5 = ModelConfig.from_hf(LLAMA31_V4), ModelConfig.from_hf(LLAMA31_V5)
    assert v4 == v5
    assert v4.rope_theta == 500000.0
    assert v4.rope_scaling.rope_type == "llama3" and v4.rope_scaling.factor == 8.0
    assert v4.eos_token_id == (128001, 128009)


def test_defaults_follow_transformers():
    cfg = {k: v for k, v in TINY.items() if k not in ("head_dim", "num_key_value_heads")}
    c = ModelConfig.from_hf(cfg)
    assert c.head_dim == 64 // 8 and c.num_key_value_heads == 8
    assert c.rope_scaling.rope_type == "default"
    legacy = ModelConfig.from_hf(dict(TINY, rope_scaling={"type": "linear", "factor": 2.0}))
    assert legacy.rope_scaling.rope_type == "linear"


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gpt_neox"}, "not supported; hpcpar runs deepseek_v2, deepseek_v3, gemma, gemma2, gemma3_text, llama, mistral, mixtral, olmo2, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe"),
    ({"architectures": ["GPT2LMHeadModel"]}, "LlamaForCausalLM"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 0.0}},
     "rope_scaling factor must be a positive finite number, got 0.0"),
    ({"partial_rotary_factor": 0.5}, "LlamaForCausalLM turns every dimension of a head"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
])
def test_bad_model_configs_are_refused_with_the_numbers(change, words):
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_hf(dict(TINY, **change))


def test_missing_fields_are_named():
    cfg = {k: v for k, v in TINY.items() if k not in ("vocab_size", "hidden_size")}
    with pytest.raises(ConfigError, match="vocab_size, hidden_size"):
        ModelConfig.from_hf(cfg)


def test_layout_reports_every_problem_at_once():
    model = ModelConfig.from_hf(dict(TINY, num_attention_heads=12, num_key_value_heads=3,
                                     head_dim=8, intermediate_size=100, num_hidden_layers=3))
    problems = ParallelConfig(dp=2, pp=4, tp=8).problems(model, world_size=8)
    text = " | ".join(problems)
    assert "dp(2) * pp(4) * tp(8) = 64 != world size 8" in text
    assert "num_attention_heads 12 is not divisible by tp 8" in text
    assert "num_key_value_heads 3 is neither a multiple nor a divisor of tp 8" in text
    assert "intermediate_size 100 is not divisible by tp 8" in text
    assert "pp 4 stages > num_hidden_layers 3" in text
    with pytest.raises(ConfigError) as err:
        ParallelConfig(dp=2, pp=4, tp=8).check(model, 8)
    assert "\n" not in str(err.value)


def test_fewer_kv_heads_than_tp_is_replication_not_an_error():
    model = ModelConfig.from_hf(TINY)  # 2 KV heads
    assert ParallelConfig(tp=8).problems(model, 8) == []
    assert model.valid_tp_sizes(8) == [1, 2, 4, 8]


def test_stage_layers_must_cover_the_model():
    model = ModelConfig.from_hf(TINY)  # 3 layers
    assert ParallelConfig(pp=2, stage_layers=(1, 2)).problems(model, 2) == []
    text = " ".join(ParallelConfig(pp=2, stage_layers=(3, 1)).problems(model, 2))
    assert "sum to 4" in text
    assert "at least one layer" in " ".join(ParallelConfig(pp=2, stage_layers=(3, 0)).problems(model, 2))


@pytest.mark.parametrize("given, world, expected", [
    ({}, 8, (8, 1, 1)),
    ({"tp": 2}, 8, (4, 1, 2)),
    ({"tp": 2, "pp": 2}, 8, (2, 2, 2)),
    ({"dp": 2}, 8, (2, 1, 4)),
    ({"dp": 2, "tp": 2}, 8, (2, 2, 2)),
    ({"dp": 1, "pp": 4}, 8, (1, 4, 2)),
])
def test_absent_layout_factors_are_inferred(given, world, expected):
    layout = ParallelConfig.infer(world, **given)
    assert (layout.dp, layout.pp, layout.tp) == expected
    assert layout.problems(world_size=world) == []


def test_inference_that_cannot_fit_is_reported_with_numbers():
    layout = ParallelConfig.infer(8, tp=3)
    assert "!= world size 8" in " ".join(layout.problems(world_size=8))
