"""DeepSeek-V2 and V3 (``hpcpar.models.deepseek_v2``, ``deepseek_v3``,
``latent_attention``) beyond what the suites over ``helpers.HF_CONFIGS`` check on one rank
(logits, greedy and continuous generation over the paged and contiguous caches, scoring,
training against torch, export) and ``test_families_2026`` under tp 2 x pp 2, dp 2 x tp 2
x ep 2 and cp 2 x pp 2: the routers against transformers' own router modules, forward and
backward; the fields a config.json leaves out read as transformers' config classes take
them, with the softmax scale of a YaRN rope; what the KV cache holds per token; and the
configs refused in one line naming the field."""

import json

import numpy as np
import pytest

from helpers import HF_CONFIGS, hpcpar_here
from hpcpar.models.config import ConfigError, ModelConfig
from hpcpar.models.kv_cache import kv_dims, kv_entry

V2 = dict(HF_CONFIGS["deepseek_v2"], architectures=["DeepseekV2ForCausalLM"])
V3 = dict(HF_CONFIGS["deepseek_v3"], architectures=["DeepseekV3ForCausalLM"])


# ---- the routers ------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_the_router_chooses_and_weighs_as_transformers_forward_and_backward(family):
    """transformers' router module on random logits with groups, bias and scaling: the same
    experts (as sets), the same weights, and d logits of a random weights' gradient equal
    to torch's autograd."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hpcpar.models.mlp import router_choice
    from hpcpar.parallel.expert_parallel.routing import route, route_backward
    settings = dict(HF_CONFIGS[family])
    settings.pop("model_type")
    hf = transformers.AutoConfig.for_model(family, **settings)
    module = transformers.models.__getattribute__(family)
    modeling = getattr(module, f"modeling_{family}")
    cls = getattr(modeling, "DeepseekV2TopkRouter" if family == "deepseek_v2"
                  else "DeepseekV3TopkRouter")
    router = cls(hf).double()
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(0.1 * torch.randn(hf.n_routed_experts))
    x = torch.randn(40, hf.hidden_size, dtype=torch.float64, requires_grad=True)
    _, weights, experts = router(x)
    cfg = ModelConfig.from_hf(dict(HF_CONFIGS[family]))
    logits = (x @ router.weight.T).detach().numpy()
    bias = (router.e_score_correction_bias.numpy()
            if hasattr(router, "e_score_correction_bias") else None)
    ours = route(np, logits, cfg.experts_per_token, cfg.norm_topk_prob, router_choice(cfg),
                 bias)
    order = np.argsort(experts.numpy(), axis=1)
    theirs_e = np.take_along_axis(experts.numpy(), order, 1)
    theirs_w = np.take_along_axis(weights.detach().numpy(), order, 1)
    mine = np.argsort(ours.experts, axis=1)
    assert (np.take_along_axis(ours.experts, mine, 1) == theirs_e).all()
    np.testing.assert_allclose(np.take_along_axis(ours.weights, mine, 1), theirs_w, rtol=2e-5,
                               atol=1e-7)          # both in float32
    dw = np.random.default_rng(2).standard_normal(theirs_w.shape)
    z = torch.tensor(logits, requires_grad=True)
    # transformers' router from its logits: the same module with the product taken out
    _, w2, _ = _from_logits(router, z)
    w2.backward(torch.tensor(np.take_along_axis(dw, np.argsort(order, 1), 1)))
    dz = route_backward(np, ours, np.take_along_axis(dw, np.argsort(mine, 1), 1),
                        cfg.norm_topk_prob, choice=router_choice(cfg))
    np.testing.assert_allclose(dz, z.grad.numpy(), rtol=1e-4, atol=1e-6)


def _from_logits(router, z):
    """The router's forward on logits ``z`` (its weight the identity)."""
    import torch
    saved = router.weight, router.hidden_dim
    router.weight = torch.nn.Parameter(torch.eye(z.shape[1], dtype=z.dtype))
    router.hidden_dim = z.shape[1]
    try:
        return router(z)
    finally:
        router.weight, router.hidden_dim = saved


# ---- the config ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_fields_left_out_mean_what_transformers_takes(family):
    """A config.json with only the sizes: heads, the latent and head dimensions, the
    experts, the dense first layers, the groups and the scaling are transformers' defaults;
    the softmax scale of a YaRN rope with mscale_all_dim is its attention's."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2,
                 rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                               "mscale_all_dim": 0.707, "original_max_position_embeddings": 64})
    ours = ModelConfig.from_hf(dict(sizes, model_type=family))
    theirs = transformers.AutoConfig.for_model(family, **sizes)
    assert (ours.kv_lora_rank, ours.q_lora_rank, ours.qk_nope_head_dim, ours.head_dim,
            ours.v_head_dim, ours.num_experts, ours.moe_intermediate_size,
            ours.routed_scaling, ours.moe_layers, ours.shared_expert_size) == (
        theirs.kv_lora_rank, theirs.q_lora_rank, theirs.qk_nope_head_dim,
        theirs.qk_rope_head_dim, theirs.v_head_dim, theirs.n_routed_experts,
        theirs.moe_intermediate_size, theirs.routed_scaling_factor,
        tuple(range(theirs.first_k_dense_replace, 4)),
        theirs.n_shared_experts * theirs.moe_intermediate_size)
    modeling = getattr(getattr(transformers.models, family), f"modeling_{family}")
    attention = getattr(modeling, f"DeepseekV{family[-1]}Attention")(theirs, 0)
    assert ours.attn_scale == pytest.approx(attention.scaling, rel=1e-12)


def test_the_cache_holds_the_latent_and_the_rope_key_once_for_every_head():
    """Per token and layer: the latent and the rope key as one key head, no values, on
    every tp rank; the ordinary model's KV heads split over tp."""
    cfg = ModelConfig.from_hf(V3)
    assert kv_dims(cfg) == (16 + 8, 0)
    assert kv_entry(cfg, 1) == kv_entry(cfg, 4) == (1, 24, 0)
    llama = ModelConfig.from_hf(dict(HF_CONFIGS["gqa-llama3"]))
    assert kv_entry(llama, 4) == (1, 8, 8) and kv_entry(llama, 1) == (2, 8, 8)


def test_plan_states_the_latents_bytes_per_token_against_ordinary_attention(tmp_path):
    from hpcpar.jobs.layout import ParallelConfig
    from hpcpar.jobs.plan import format_plan
    cfg = ModelConfig.from_hf(V3)
    text = format_plan(cfg, ParallelConfig(pp=2, tp=2, micro_batches=2), 4, 16, 8, 4, "v3")
    line = next(t for t in text.splitlines() if t.startswith("KV cache per token"))
    # (16 + 8) x 4 B a layer; 4 heads x (20 + 10) x 4 B = 480 B a layer with ordinary heads
    assert "96 B a layer, 192 B over 2 layers, on every tp rank" in line
    assert "960 B (480 B per rank at tp 2): 5.0x" in line


# ---- what is refused ----------------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    (dict(V2, topk_method="noaux_tc"), "topk_method 'noaux_tc'"),
    (dict(V2, norm_topk_prob=True), "norm_topk_prob true: transformers' DeepseekV2 ignores"),
    (dict(V2, scoring_func="sigmoid"), "scoring_func 'sigmoid'"),
    (dict(V3, scoring_func="softmax"), "scoring_func 'softmax'"),
    (dict(V3, topk_method="greedy"), "topk_method 'greedy'"),
    (dict(V3, moe_layer_freq=2), "moe_layer_freq 2"),
    (dict(V3, attention_bias=True), "attention_bias true"),
    (dict(V3, num_key_value_heads=2), "num_key_value_heads 2 is not num_attention_heads 4"),
    (dict(V3, n_group=3), "n_group 3 and topk_group 2"),
    (dict(V3, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok 3 is more than"),
    (dict(V3, n_shared_experts=0), "n_shared_experts 0 must be at least 1"),
    (dict(V3, kv_lora_rank=None), "kv_lora_rank must be an integer"),
], ids=["v2-noaux", "v2-norm", "v2-sigmoid", "v3-softmax", "v3-greedy", "layer-freq",
        "bias", "kv-heads", "groups", "too-few-in-groups", "no-shared", "no-latent"])
def test_a_config_not_run_exactly_is_one_line_naming_the_field(changes, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(changes)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_refused_config_stops_convert_with_status_2_before_any_weight(tmp_path):
    """config.json alone (no weights at all): the field is named, status 2, nothing made."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(V3, scoring_func="softmax")))
    proc = hpcpar_here(["convert", "hf", "out.h5"], tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "scoring_func 'softmax'" in lines[0]
    assert not (tmp_path / "out.h5").exists()


def test_convert_skips_v3s_multi_token_prediction_layer_as_transformers_does(tmp_path):
    """DeepSeek-V3's checkpoints hold a multi-token prediction layer (model.layers.61.*)
    that transformers' class skips on load: convert skips it too, and refuses any other
    tensor the model has no place for."""
    pytest.importorskip("torch")
    from safetensors.numpy import load_file, save_file
    from helpers import build_hf_model
    from hpcpar.checkpoint import convert
    from hpcpar.parallel.errors import HpcparError
    _, _ = build_hf_model("deepseek_v3", tmp_path)
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.61.eh_proj.weight"] = np.ones((4, 4), np.float32)
    save_file(tensors, weights, metadata={"format": "pt"})
    convert(tmp_path / "hf", tmp_path / "mtp.h5")
    import h5py
    with h5py.File(tmp_path / "mtp.h5") as f:
        assert not any(name.startswith("model.layers.61") for name in f)
    tensors["model.layers.5.eh_proj.weight"] = tensors.pop("model.layers.61.eh_proj.weight")
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(HpcparError, match="model.layers.5.eh_proj.weight"):
        convert(tmp_path / "hf", tmp_path / "other.h5")


def test_lora_targets_latent_attention_has_not_are_refused_in_one_line():
    from hpcpar.models.lora import target_problems
    problems = target_problems(ModelConfig.from_hf(V2), ("q", "v"), 4)
    assert len(problems) == 1 and "latent attention projects through q_a/q_b" in problems[0]
    assert target_problems(ModelConfig.from_hf(V2), ("o",), 4) == []


def test_a_prefill_in_chunks_reads_the_latents_before_it_from_the_cache(tmp_path):
    """Chunks of 4 positions (prompts of 3 to 12 tokens): each chunk expands the latents
    cached before it with its own; the states are the whole prefill's, and so is the cache,
    which holds each position's latent and rope key once (no values)."""
    from helpers import PROMPTS, prompt_batch
    from hpcpar.checkpoint import init_checkpoint, load_shard, open_checkpoint
    from hpcpar.models.decoder import DecoderStage
    from hpcpar.models.tensors import StageSpan, stage_tensors
    from hpcpar.parallel.comm import MpiCommunicator
    from hpcpar.parallel.device.backend import NUMPY
    from hpcpar.parallel.ops import AttentionRows, ops_for
    from mpi4py import MPI
    init_checkpoint(tmp_path / "v3.h5", V3)
    ckpt = open_checkpoint(tmp_path / "v3.h5")
    layers = range(ckpt.config.num_hidden_layers)
    specs = stage_tensors(ckpt.config, layers, True, True)
    stage = DecoderStage.from_tensors(ckpt.config, specs, load_shard(ckpt, specs).tensors,
                                      StageSpan(layers), MpiCommunicator(MPI.COMM_SELF),
                                      ops_for(NUMPY), np.dtype(np.float32))
    ids, lengths = prompt_batch()
    rows = AttentionRows.build(np, lengths, lengths, from_start=True)
    caches = [stage.new_cache(len(PROMPTS), 16) for _ in range(2)]
    assert caches[0].k.shape[2:] == (1, 16, 16 + 8) and caches[0].v.shape[-1] == 0
    whole = stage.forward(stage.embed(ids), rows, caches[0])
    stage.prefill_chunk = 4
    chunked = stage.forward(stage.embed(ids), rows, caches[1])
    valid = np.arange(lengths.max())[None, :] < lengths[:, None]
    np.testing.assert_allclose(chunked[valid], whole[valid], atol=2e-5, rtol=0)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(caches[1].k[:, row, :, :n], caches[0].k[:, row, :, :n],
                                   atol=2e-5, rtol=0)


def test_quantized_weights_are_refused_in_one_line_naming_the_field():
    """DeepSeek-V3's released checkpoint is fp8 with block scales: refused before any
    weight, with what to do."""
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(dict(V3, quantization_config={"quant_method": "fp8",
                                                          "weight_block_size": [128, 128]}))
    assert "quantization_config (fp8)" in str(e.value) and "\n" not in str(e.value)
