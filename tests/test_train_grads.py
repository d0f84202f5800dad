"""Backward passes against finite differences, in float64.

Every layer alone (RMSNorm, RoPE, attention with causal and padding masks, SwiGLU MLP,
vocab-parallel embedding, cross-entropy) at tp 1, and the whole stage against the
independent reference (tests/reference.py): its loss, and the derivative of its loss along a
random direction of every tensor. The tp 2 checks (MPI) are in test_train_grads_mpi.py.
"""

import numpy as np
import pytest
from mpi4py import MPI

from helpers import GQA, TIED, realistic_tensors
from hpcpar.parallel.device.backend import NUMPY
from hpcpar.parallel.comm import create_communicator
from hpcpar.models.config import ModelConfig
from hpcpar.models.rope import RotaryEmbedding
from hpcpar.parallel.ops import AttentionRows, ops_for
from hpcpar.models.sharding import split
from hpcpar.models.tensors import StageSpan, TensorSpec, stage_tensors
from hpcpar.jobs.train.model_chunk import Batch, ModelChunk
from hpcpar.jobs.train.data import label_count, make_batches
from hpcpar.models.attention import Attention
from hpcpar.models.mlp import Mlp
from hpcpar.models.norms import norm_backward
from hpcpar.parallel.tensor_parallel.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding
from hpcpar.jobs.train.params import GradSink, make_params
from reference import llama_logits

EPS = 1e-6
OPS = ops_for(NUMPY)
CONFIGS = {"gqa": dict(GQA, num_hidden_layers=2), "tied": dict(TIED, num_hidden_layers=2)}


def _tp1():
    return create_communicator(MPI.COMM_SELF, "mpi")


def directional(f, x, d, eps=EPS):
    """Central difference of f along d at x (x is restored)."""
    x0 = x.copy()
    x[...] = x0 + eps * d
    up = f()
    x[...] = x0 - eps * d
    down = f()
    x[...] = x0
    return (up - down) / (2 * eps)


def assert_gradients(loss, x, dx, params: dict, rng, rel):
    """dx and every param's .grad agree with central differences of ``loss`` along random
    directions."""
    d = rng.standard_normal(x.shape)
    assert directional(loss, x, d) == pytest.approx(float((dx * d).sum()), rel=rel)
    for name, w in params.items():
        dw = rng.standard_normal(w.data.shape)
        assert directional(loss, w.data, dw) == pytest.approx(float((w.grad * dw).sum()),
                                                              rel=rel), name


def _param(rng, shape, role="q"):
    spec = TensorSpec("w", shape, role, 0)
    from hpcpar.jobs.train.params import Param
    data = rng.standard_normal(shape)
    return Param(spec, data, np.zeros(shape), True, len(shape) == 2, False)


# ---- layers alone, tp 1 -------------------------------------------------------------------

def test_rms_norm_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    x, r = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 3, 8))
    w = _param(rng, (8,), "input_norm")

    def loss():
        return float((OPS.rms_norm.forward_train(x, w.data, 1e-5)[0] * r).sum())

    y, ctx = OPS.rms_norm.forward_train(x, w.data, 1e-5)
    dx = norm_backward(OPS, r, ctx, w, GradSink(np))
    assert_gradients(loss, x, dx, {"norm": w}, rng, rel=1e-7)


def test_rope_backward_is_the_transpose_of_rope():
    rng = np.random.default_rng(1)
    cfg = ModelConfig.from_hf(CONFIGS["gqa"])
    cos, sin = RotaryEmbedding(cfg, np, np.float64).tables(rng.integers(0, 50, (2, 5)))
    x, r = rng.standard_normal((2, 5, 3, 8)), rng.standard_normal((2, 5, 3, 8))
    dx = OPS.rotary.backward_one(r, cos, sin)
    d = rng.standard_normal(x.shape)
    fd = directional(lambda: float((OPS.rotary.apply(x, cos, sin) * r).sum()), x, d)
    assert fd == pytest.approx(float((dx * d).sum()), rel=1e-7)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (2, 2)])
def test_attention_backward_with_causal_and_padding_masks(heads, kv_heads):
    rng = np.random.default_rng(2)
    hd, hidden, B, T = 8, 16, 3, 6
    cfg = ModelConfig.from_hf(dict(GQA, head_dim=hd))
    p = {"q": _param(rng, (heads * hd, hidden)), "k": _param(rng, (kv_heads * hd, hidden)),
         "v": _param(rng, (kv_heads * hd, hidden)), "o": _param(rng, (hidden, heads * hd)),
         "q_bias": _param(rng, (heads * hd,)), "o_bias": _param(rng, (hidden,))}
    for w in p.values():
        w.data *= 0.3
    attention = Attention.of(OPS, p, hd, _tp1())
    lengths = np.array([6, 4, 1])                 # the last row: one real token
    positions = np.broadcast_to(np.arange(T)[None], (B, T))
    cos, sin = RotaryEmbedding(cfg, np, np.float64).tables(positions)
    rows = AttentionRows(lengths, lengths, T, from_start=True)
    x, r = rng.standard_normal((B, T, hidden)), rng.standard_normal((B, T, hidden))
    r[np.arange(T)[None] >= lengths[:, None]] = 0  # padding outputs are never used

    def loss():
        return float((attention.forward(x, cos, sin, rows, train=True)[0] * r).sum())

    y, ctx = attention.forward(x, cos, sin, rows, train=True)
    dx = attention.backward(r, ctx, GradSink(np))
    assert_gradients(loss, x, dx, p, rng, rel=1e-6)


def test_swiglu_mlp_backward_matches_finite_differences():
    rng = np.random.default_rng(3)
    p = {"gate": _param(rng, (12, 8)), "up": _param(rng, (12, 8)), "down": _param(rng, (8, 12)),
         "gate_bias": _param(rng, (12,)), "down_bias": _param(rng, (8,))}
    mlp = Mlp.of(OPS, p, _tp1())
    x, r = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 3, 8))

    def loss():
        return float((mlp.forward(x, train=True)[0] * r).sum())

    y, ctx = mlp.forward(x, train=True)
    dx = mlp.backward(r, ctx, GradSink(np))
    assert_gradients(loss, x, dx, p, rng, rel=1e-7)


def test_embedding_backward_sums_repeated_ids():
    rng = np.random.default_rng(4)
    w = _param(rng, (10, 4), "embed")
    emb = VocabParallelEmbedding(np, w, 10, _tp1())
    ids = np.array([[1, 3, 1], [9, 3, 3]])
    r = rng.standard_normal((2, 3, 4))
    _, ctx = emb.forward(ids)
    emb.backward(r, ctx, GradSink(np))
    dw = rng.standard_normal(w.data.shape)
    fd = directional(lambda: float((emb.forward(ids)[0] * r).sum()), w.data, dw)
    assert fd == pytest.approx(float((w.grad * dw).sum()), rel=1e-7)
    np.testing.assert_allclose(w.grad[3], r[0, 1] + r[1, 1] + r[1, 2])


def test_cross_entropy_is_the_weighted_mean_and_its_backward_is_local():
    rng = np.random.default_rng(5)
    ce = VocabParallelCrossEntropy(OPS, 7, _tp1())
    logits = rng.standard_normal((5, 7))
    labels = np.array([0, 6, -1, 3, 3])
    weights = np.where(labels >= 0, 1 / 4, 0.0)
    loss, ctx = ce.forward(logits.copy(), labels, weights)
    lse = np.log(np.exp(logits).sum(-1))
    real = labels >= 0
    expected = (lse[real] - logits[real, labels[real]]).mean()
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    dz = ce.backward(ctx)
    d = rng.standard_normal(logits.shape)
    fd = directional(lambda: float(ce.forward(logits.copy(), labels, weights)[0]), logits, d)
    assert fd == pytest.approx(float((dz * d).sum()), rel=1e-7)
    assert not dz[2].any()                                    # an ignored label: no gradient


# ---- the whole stage against the independent reference, tp 1 ------------------------------

def build_chunk(cfg_dict, tensors, tp, recompute=False):
    cfg = ModelConfig.from_hf(cfg_dict)
    layers = range(cfg.num_hidden_layers)
    specs = stage_tensors(cfg, layers, True, True)
    shards = {s.name: split(tensors[s.name], s, cfg, tp.size)[tp.rank] for s in specs}
    params = make_params(cfg, specs, shards, np, tp.rank, tp.size)
    return ModelChunk(cfg, params, StageSpan(layers), tp, OPS, recompute), params


def batch_of(rows, pad=None):
    """A Batch from (B, L + 1) rows, each label weighted 1 / (labels in the batch)."""
    rows = np.array(rows)
    for j, p in enumerate([] if pad is None else pad):
        rows[j, :p] = -1                                   # left padding, as data files hold it
    b = make_batches(rows, 1, label_count(rows), np.float64)[0]
    return Batch(b.ids, b.lengths, b.labels, b.weights)


def reference_loss(tensors, cfg, rows):
    logits = llama_logits(tensors, cfg, rows[:, :-1]).reshape(-1, cfg["vocab_size"])
    top = logits.max(-1)
    lse = np.log(np.exp(logits - top[:, None]).sum(-1)) + top
    labels = rows[:, 1:].reshape(-1)
    return float((lse - logits[np.arange(len(labels)), labels]).mean())


def f64(cfg, seed=0):
    return {k: v.astype(np.float64) for k, v in realistic_tensors(cfg, seed).items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_whole_stage_loss_and_gradients_match_the_reference(name):
    cfg = CONFIGS[name]
    tensors = f64(cfg)
    rows = np.random.default_rng(6).integers(0, cfg["vocab_size"], (2, 7))
    chunk, params = build_chunk(cfg, {k: v.copy() for k, v in tensors.items()}, _tp1())
    loss, ctx = chunk.forward(None, batch_of(rows))
    chunk.backward(ctx, None, GradSink(np))
    assert float(loss) == pytest.approx(reference_loss(tensors, cfg, rows), rel=1e-12)
    rng = np.random.default_rng(7)
    for tname, p in params.items():
        d = rng.standard_normal(p.data.shape)
        fd = directional(lambda: reference_loss(tensors, cfg, rows), tensors[tname], d)
        assert fd == pytest.approx(float((p.grad * d).sum()), rel=1e-6, abs=1e-9), tname


def _grads(chunk, params, batch, sink):
    for p in params.values():
        p.grad[...] = 0
    loss, ctx = chunk.forward(None, batch)
    chunk.backward(ctx, None, sink)
    sink.flush()
    return float(loss), {k: p.grad.copy() for k, p in params.items()}


def test_recompute_and_the_split_backward_give_the_same_gradients():
    cfg = CONFIGS["gqa"]
    tensors = f64(cfg)
    batch = batch_of(np.random.default_rng(8).integers(0, cfg["vocab_size"], (3, 6)))
    plain = build_chunk(cfg, tensors, _tp1())
    loss, grads = _grads(*plain, batch, GradSink(np))
    again = build_chunk(cfg, tensors, _tp1(), recompute=True)
    loss_r, grads_r = _grads(*again, batch, GradSink(np))
    loss_w, grads_w = _grads(*plain, batch, GradSink(np, defer=True))   # I now, W later
    assert loss_r == loss_w == loss
    for k in grads:
        np.testing.assert_array_equal(grads_r[k], grads[k])
        np.testing.assert_array_equal(grads_w[k], grads[k])


def test_left_padding_changes_nothing_but_the_ignored_labels():
    cfg = CONFIGS["tied"]
    tensors = f64(cfg)
    rng = np.random.default_rng(9)
    long, short = rng.integers(0, cfg["vocab_size"], (1, 8)), rng.integers(0, 200, (1, 5))
    padded = np.concatenate([np.zeros((1, 3), np.int64), short], axis=1)
    together = batch_of(np.concatenate([long, padded]), pad=[0, 3])
    chunk, params = build_chunk(cfg, tensors, _tp1())
    loss, grads = _grads(chunk, params, together, GradSink(np))
    n = (together.labels >= 0).sum()
    parts = [(long, 7), (short, 4)]
    expect_loss, expect = 0.0, {k: 0 for k in grads}
    for rows, count in parts:          # each row alone, weighted by its share of the labels
        b = batch_of(rows)
        b.weights *= count / n
        part_loss, part = _grads(chunk, params, b, GradSink(np))
        expect_loss += part_loss
        expect = {k: expect[k] + part[k] for k in grads}
    assert loss == pytest.approx(expect_loss, rel=1e-12)
    for k in grads:
        np.testing.assert_allclose(grads[k], expect[k], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("recompute", [False, True])
def test_plan_activation_memory_is_what_a_forward_keeps(name, recompute):
    from hpcpar.jobs.train.model_chunk import held_bytes
    from hpcpar.jobs.train.memory import activation_bytes
    cfg = CONFIGS[name]
    chunk, _ = build_chunk(cfg, realistic_tensors(cfg, 0), _tp1(), recompute=recompute)
    batch = batch_of(np.random.default_rng(10).integers(0, 200, (3, 11)))
    batch.weights = batch.weights.astype(np.float32)
    _, ctx = chunk.forward(None, batch)
    planned = activation_bytes(ModelConfig.from_hf(cfg), 1, cfg["num_hidden_layers"], 3, 10,
                               True, True, recompute)
    assert held_bytes(ctx) == planned


def test_data_files_and_their_order(tmp_path):
    """.npy rows, a .bin token file cut into windows, .jsonl ids packed with EOS between
    documents; bad padding refused; the sample order wraps and shuffles by (seed, epoch)."""
    from hpcpar.jobs.train.data import DataError, load_dataset, sample_indices, token_dtype
    cfg = ModelConfig.from_hf(dict(GQA, eos_token_id=2))
    tokens = np.arange(1, 42) % 250
    tokens.astype(token_dtype(cfg.vocab_size)).tofile(tmp_path / "t.bin")
    ds = load_dataset(tmp_path / "t.bin", cfg, seq_len=8)
    assert len(ds) == 5 and ds.seq_len == 8
    np.testing.assert_array_equal(ds.samples[1], tokens[8:17])
    tokens.astype(np.uint32).tofile(tmp_path / "t32.bin")      # read as uint16: 0 between
    with pytest.raises(DataError, match="every other uint16 token is 0"):
        load_dataset(tmp_path / "t32.bin", cfg, seq_len=8)
    (tmp_path / "d.jsonl").write_text('{"ids": [5, 6, 7]}\n{"ids": [8, 9]}\n')
    packed = load_dataset(tmp_path / "d.jsonl", cfg, seq_len=3)
    np.testing.assert_array_equal(packed.samples[0], [5, 6, 7, 2])
    np.save(tmp_path / "bad.npy", np.array([[4, -1, 5, 6]]))
    with pytest.raises(DataError, match="padding .* after a real token"):
        load_dataset(tmp_path / "bad.npy", cfg)
    assert sample_indices(8, 4, 10, False, 0).tolist() == [8, 9, 0, 1]
    epoch0, epoch1 = sample_indices(0, 10, 10, True, 3), sample_indices(10, 10, 10, True, 3)
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0.tolist() != epoch1.tolist()
    assert sample_indices(5, 10, 10, True, 3).tolist() == epoch0[5:].tolist() + epoch1[:5].tolist()
