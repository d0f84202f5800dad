import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hpcpar.models.config import ModelConfig
from hpcpar.parallel.pipeline.partition import stage_layer_counts, stage_layers
from hpcpar.models.sharding import (ShardingError, merge, padded_vocab_size, piece_of, split,
                                    vocab_range)
from hpcpar.models.tensors import model_tensors, stage_tensors
from helpers import TINY, expected_slice, hf_tensor_shapes


@st.composite
def model_and_tp(draw):
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([2, 4]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8, 16) if k % tp == 0 or tp % k == 0]))
    group = draw(st.integers(1, 3))
    heads = kv * group
    if heads % tp:
        heads = kv * tp  # keep q heads divisible by tp
    cfg = dict(TINY, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
               hidden_size=draw(st.sampled_from([8, 12, 16])),
               intermediate_size=tp * draw(st.integers(1, 5)),
               vocab_size=draw(st.integers(1, 40)), num_hidden_layers=2,
               tie_word_embeddings=draw(st.booleans()), attention_bias=draw(st.booleans()),
               mlp_bias=draw(st.booleans()))
    return cfg, tp


@settings(max_examples=60, deadline=None)
@given(model_and_tp())
def test_split_matches_megatron_and_merge_inverts_it(case):
    hf, tp = case
    cfg = ModelConfig.from_hf(hf)
    rng = np.random.default_rng(0)
    specs = model_tensors(cfg)
    assert {s.name: s.shape for s in specs} == hf_tensor_shapes(hf)
    for spec in specs:
        full = rng.standard_normal(spec.shape).astype(np.float32)
        pieces = split(full, spec, cfg, tp)
        for r, piece in enumerate(pieces):
            np.testing.assert_array_equal(piece, expected_slice(spec.name, full, hf, r, tp))
            assert piece.shape == piece_of(spec, cfg, r, tp).shape
        np.testing.assert_array_equal(merge(pieces, spec, cfg), full)


def test_kv_heads_replicated_so_each_rank_has_its_query_heads_kv_head():
    hf = dict(TINY, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    cfg = ModelConfig.from_hf(hf)
    q, k = (s for s in model_tensors(cfg) if s.name.endswith(("0.self_attn.q_proj.weight",
                                                               "0.self_attn.k_proj.weight")))
    tp, group = 8, 8 // 2
    for r in range(tp):
        q_heads = range(piece_of(q, cfg, r, tp).source[0].start // 8,
                        piece_of(q, cfg, r, tp).source[0].stop // 8)
        kv_head = piece_of(k, cfg, r, tp).source[0].start // 8
        assert {h // group for h in q_heads} == {kv_head}


def test_vocab_is_padded_to_a_multiple_of_tp():
    assert padded_vocab_size(250, 8) == 256
    assert [vocab_range(250, r, 8) for r in (0, 7)] == [(0, 32), (224, 250)]
    assert vocab_range(5, 7, 8) == (5, 5)  # more ranks than tokens: an empty piece


def test_uneven_split_is_a_clear_error():
    cfg = ModelConfig.from_hf(dict(TINY, intermediate_size=100))
    gate = next(s for s in model_tensors(cfg) if s.role == "gate")
    with pytest.raises(ShardingError, match="100 rows cannot be split evenly over tp 8"):
        piece_of(gate, cfg, 0, 8)
    q = next(s for s in model_tensors(cfg) if s.role == "q")
    with pytest.raises(ShardingError, match="8 heads cannot be split evenly over tp 3"):
        piece_of(q, cfg, 0, 3)


def test_stage_partition_is_contiguous_with_remainder_first():
    assert stage_layer_counts(10, 4) == [3, 3, 2, 2]
    assert [list(stage_layers(10, 4, s)) for s in range(4)] == [
        [0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert stage_layer_counts(10, 3, [2, 5, 3]) == [2, 5, 3]


def test_stage_tensors_give_embedding_and_head_to_the_end_stages():
    for tied in (False, True):
        cfg = ModelConfig.from_hf(dict(TINY, tie_word_embeddings=tied))
        first = {s.name for s in stage_tensors(cfg, range(0, 1), True, False)}
        last = {s.name for s in stage_tensors(cfg, range(2, 3), False, True)}
        assert "model.embed_tokens.weight" in first and "model.norm.weight" in last
        assert ("lm_head.weight" in last) != tied
        assert ("model.embed_tokens.weight" in last) == tied  # the tied head reads it
        assert not any(".layers.2." in n for n in first)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_each_rank_reads_its_slices_of_each_part_of_a_fused_tensor(tp):
    """Phi-3's qkv_proj and gate_up_proj stay fused in the file: each part's slice for a tp
    rank is rows of the fused tensor, the rows Megatron's split of the part alone gives
    (written out here from the fused layout, apart from hpcpar's plan)."""
    from helpers import PHI3
    cfg = ModelConfig.from_hf(PHI3)
    h, hd = PHI3["hidden_size"], PHI3["head_dim"]
    q, kv, inter = PHI3["num_attention_heads"] * hd, PHI3["num_key_value_heads"] * hd, \
        PHI3["intermediate_size"]
    rng = np.random.default_rng(0)
    fused = {"self_attn.qkv_proj.weight": rng.standard_normal((q + 2 * kv, h)),
             "mlp.gate_up_proj.weight": rng.standard_normal((2 * inter, h))}
    parts = {"q": ("self_attn.qkv_proj.weight", 0, q), "k": ("self_attn.qkv_proj.weight", q, kv),
             "v": ("self_attn.qkv_proj.weight", q + kv, kv),
             "gate": ("mlp.gate_up_proj.weight", 0, inter),
             "up": ("mlp.gate_up_proj.weight", inter, inter)}
    layer = [s for s in model_tensors(cfg) if s.layer == 1 and s.stored is not None]
    assert sorted(s.role for s in layer) == sorted(parts)
    for spec in layer:
        name, start, rows = parts[spec.role]
        assert spec.file_name == f"model.layers.1.{name}" and spec.offset == start
        hf_name = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj",
                   "up": "up_proj"}[spec.role]
        alone = fused[name][start:start + rows]
        for r in range(tp):
            piece = piece_of(spec, cfg, r, tp)
            got = fused[name][spec.file_region(piece.source)]
            want = expected_slice(f"model.layers.1.x.{hf_name}.weight", alone, PHI3, r, tp)
            np.testing.assert_array_equal(got, want, err_msg=f"{spec.role} tp {r}/{tp}")
