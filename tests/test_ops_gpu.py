"""Every device kernel of the ops layer against the NumPy reference, on fresh random inputs,
with the memory the kernel's outputs come from poisoned (NaN) first; then generation and a
training step on CuPy against the NumPy backend and transformers. Skipped without a GPU.

    python -m pytest -m gpu tests/test_ops_gpu.py

Tolerances: float32 kernels compute in float32 as the reference does (1e-5 relative). In 16
bits, a kernel that rounds once (float32 inside) and the reference that rounds after every
array operation differ by a few units of the last place: compared normwise,
||got - ref|| <= tol ||ref||, with tol 1e-2 for bfloat16 (8 bits of mantissa: one rounding is
~4e-3 relative) and 2e-3 for float16. A whole model rounds in every layer: its logits are
held to 3e-2 (bfloat16; measured 1.3e-2 on the 2-layer test model) and 5e-3 (float16).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

NORMWISE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
MODEL_NORMWISE = {"float16": 5e-3, "bfloat16": 3e-2}
DTYPES = ["float32", "float16", "bfloat16"]


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.fixture(scope="module")
def device_ops(cp):
    from hpcpar.parallel.ops.cuda import cuda_ops
    return cuda_ops(cp)


@pytest.fixture(scope="module")
def native(cp):
    from hpcpar.parallel.device.backend import NUMPY
    from hpcpar.parallel.ops import ops_for
    return ops_for(NUMPY)


def poison(cp, nbytes: int) -> None:
    """Leave NaN-filled blocks in CuPy's pool, so outputs a kernel forgets to write show."""
    blocks = [cp.full(max(nbytes // 4, 1), np.nan, dtype=cp.float32) for _ in range(4)]
    del blocks


def rand(cp, rng, shape, dtype, scale=1.0):
    host = (rng.standard_normal(shape) * scale).astype(np.float32)
    return cp.asarray(host).astype(dtype), host


def close(got, ref, dtype, tolerances=NORMWISE):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= tolerances[dtype], f"normwise error {err:.2e} > {tolerances[dtype]}"


def host(cp, a):
    return cp.asnumpy(a.astype(cp.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 2048, 3000])
def test_rms_norm_and_its_fused_add(cp, device_ops, native, dtype, width):
    rng = np.random.default_rng(width)
    x, xh = rand(cp, rng, (3, 5, width), dtype)
    res, resh = rand(cp, rng, (3, 5, width), dtype)
    w, wh = rand(cp, rng, (width,), dtype)
    poison(cp, x.nbytes)
    y = device_ops.rms_norm.forward(x, w, 1e-5)
    close(host(cp, y), native.rms_norm.forward(xh.astype(np.float64), wh, 1e-5), dtype)
    poison(cp, x.nbytes)
    y, total = device_ops.rms_norm.add_forward(x, res, w, 1e-5)
    s = host(cp, x).astype(np.float64) + host(cp, res)
    close(host(cp, total), s, dtype)
    close(host(cp, y), native.rms_norm.forward(s, wh, 1e-5), dtype)
    dy, dyh = rand(cp, rng, x.shape, dtype)
    poison(cp, x.nbytes)
    _, ctx = device_ops.rms_norm.forward_train(x, w, 1e-5)
    dx, dw = device_ops.rms_norm.backward(dy, ctx, w)
    _, rctx = native.rms_norm.forward_train(host(cp, x).astype(np.float64), wh, 1e-5)
    rdx, rdw = native.rms_norm.backward(dyh.astype(np.float64), rctx, wh.astype(np.float64))
    close(host(cp, dx), rdx, dtype)
    close(cp.asnumpy(dw), rdw, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_strided_q_and_k_and_its_backward(cp, device_ops, native, dtype):
    from hpcpar.models.config import ModelConfig
    from hpcpar.models.rope import RotaryEmbedding
    from helpers import GQA
    rng = np.random.default_rng(1)
    B, T, nh, nkv, hd = 2, 7, 4, 2, 16
    cfg = ModelConfig.from_hf(dict(GQA, head_dim=hd))
    positions = rng.integers(0, 100, (B, T))
    cos, sin = RotaryEmbedding(cfg, cp, cp.dtype(dtype)).tables(cp.asarray(positions))
    rcos, rsin = RotaryEmbedding(cfg, np, np.float64).tables(positions)
    qkv, qkvh = rand(cp, rng, (B, T, (nh + 2 * nkv) * hd), dtype)   # as the merged GEMM
    q = qkv[..., :nh * hd].reshape(B, T, nh, hd)
    k = qkv[..., nh * hd:(nh + nkv) * hd].reshape(B, T, nkv, hd)
    poison(cp, qkv.nbytes)
    rq, rk = device_ops.rotary.forward(q, k, cos, sin)
    eq, ek = native.rotary.forward(host(cp, q).astype(np.float64),
                                   host(cp, k).astype(np.float64), rcos, rsin)
    close(host(cp, rq), eq, dtype)
    close(host(cp, rk), ek, dtype)
    dq, dk = device_ops.rotary.backward(rq, rk, cos, sin)
    edq, edk = native.rotary.backward(eq, ek, rcos, rsin)
    close(host(cp, dq), edq, dtype)
    close(host(cp, dk), edk, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_and_its_backward(cp, device_ops, native, dtype):
    rng = np.random.default_rng(2)
    gu, _ = rand(cp, rng, (3, 9, 2 * 40), dtype, scale=3.0)
    gate, up = gu[..., :40], gu[..., 40:]                      # views, as the merged GEMM
    da, _ = rand(cp, rng, (3, 9, 40), dtype)
    g64, u64, d64 = (host(cp, a).astype(np.float64) for a in (gate, up, da))
    poison(cp, gu.nbytes)
    close(host(cp, device_ops.swiglu.forward(gate, up)), native.swiglu.forward(g64, u64), dtype)
    dg, du = device_ops.swiglu.backward(da, gate, up)
    edg, edu = native.swiglu.backward(d64, g64, u64)
    close(host(cp, dg), edg, dtype)
    close(host(cp, du), edu, dtype)


def _attention_case(cp, rng, dtype, B, T, S, nh, nkv, hd):
    q, _ = rand(cp, rng, (B, T, nh, hd), dtype)
    cache_k, _ = rand(cp, rng, (B, nkv, S + 5, hd), dtype)      # a cache longer than needed
    cache_v, _ = rand(cp, rng, (B, nkv, S + 5, hd), dtype)
    return q, cache_k[:, :, :S], cache_v[:, :, :S]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (6, 1)])
def test_fused_attention_prefill_and_decode_with_per_row_lengths(cp, device_ops, native, dtype,
                                                                 heads):
    from hpcpar.parallel.ops import AttentionRows
    rng = np.random.default_rng(3)
    nh, nkv = heads
    B, T, hd = 4, 37, 64
    lengths = np.array([37, 20, 1, 0])                    # full, padded, one token, empty
    q, k, v = _attention_case(cp, rng, dtype, B, T, T, nh, nkv, hd)
    rows = AttentionRows.build(cp, lengths, lengths, from_start=True)
    ref_rows = AttentionRows(lengths, lengths, T, True)
    poison(cp, q.nbytes)
    out = device_ops.attention.forward(q, k, v, rows)
    ref = native.attention.forward(*(host(cp, a).astype(np.float64) for a in (q, k, v)),
                                   ref_rows)
    got = host(cp, out)
    for b, n in enumerate(lengths):
        if n:
            close(got[b, :n], ref[b, :n], dtype)
    assert np.isfinite(got).all()
    # decode: one query per row over caches of different lengths
    cached = np.array([300, 17, 1, 64])
    q, k, v = _attention_case(cp, rng, dtype, B, 1, int(cached.max()), nh, nkv, hd)
    rows = AttentionRows.build(cp, np.ones(B, np.int64), cached, from_start=False)
    ref_rows = AttentionRows(np.ones(B, np.int64), cached, int(cached.max()), False)
    out = device_ops.attention.forward(q, k, v, rows)
    ref = native.attention.forward(*(host(cp, a).astype(np.float64) for a in (q, k, v)),
                                   ref_rows)
    close(host(cp, out), ref, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_attention_training_forward_and_backward(cp, device_ops, native, dtype):
    from hpcpar.parallel.ops import AttentionRows
    rng = np.random.default_rng(4)
    B, T, nh, nkv, hd = 3, 64, 8, 2, 64
    lengths = np.array([64, 40, 5])
    q, _ = rand(cp, rng, (B, T, nh, hd), dtype)
    kv, _ = rand(cp, rng, (B, T, 2, nkv, hd), dtype)
    k, v = kv[:, :, 0].transpose(0, 2, 1, 3), kv[:, :, 1].transpose(0, 2, 1, 3)  # strided
    dout, _ = rand(cp, rng, (B, T, nh, hd), dtype)
    for b, n in enumerate(lengths):
        dout[b, n:] = 0                                   # padding outputs are never used
    rows = AttentionRows.build(cp, lengths, lengths, from_start=True)
    out, ctx = device_ops.attention.forward_train(q, k, v, rows)
    dq, dk, dv = device_ops.attention.backward(dout, ctx)
    r = [host(cp, a).astype(np.float64) for a in (q, k, v, dout)]
    ref_rows = AttentionRows(lengths, lengths, T, True)
    rout, rctx = native.attention.forward_train(r[0], r[1], r[2], ref_rows)
    rdq, rdk, rdv = native.attention.backward(r[3], rctx)
    for b, n in enumerate(lengths):
        close(host(cp, out)[b, :n], rout[b, :n], dtype)
        close(host(cp, dq)[b, :n], rdq[b, :n], dtype)
        close(host(cp, dk)[b, :, :n], rdk[b, :, :n], dtype)
        close(host(cp, dv)[b, :, :n], rdv[b, :, :n], dtype)


# ---- whole jobs ------------------------------------------------------------------------

def _generate(path, prompts, backend, dtype, tokens=6, *extra):
    from mpi4py import MPI
    from hpcpar.jobs.generate import Prompts, run_generation
    from hpcpar.jobs.job import load_job
    sets = [f"model.checkpoint='{path}'", "parallel.dp=1", "generate.save_logits=true",
            f"parallel.backend='{backend}'", f"model.dtype='{dtype}'",
            f"generate.max_new_tokens={tokens}", "generate.stop_at_eos=false", *extra]
    return run_generation(MPI.COMM_SELF, load_job(None, sets), prompts=Prompts(prompts),
                          progress=False)


def _gpu_matches_cpu(path, prompts, dtype) -> None:
    """The prompts' logits on CuPy in ``dtype`` against NumPy's in float32 (and in float32 the
    same greedy tokens)."""
    cpu = _generate(path, prompts, "numpy", "float32")
    gpu = _generate(path, prompts, "cupy", dtype)
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        ref, got = cpu.prompt_logits[b, :n], gpu.prompt_logits[b, :n]
        if dtype == "float32":
            np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
        else:
            close(got, ref, dtype, MODEL_NORMWISE)
    if dtype == "float32":
        assert gpu.tokens.tolist() == cpu.tokens.tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_generation_on_the_gpu_matches_the_cpu(tmp_path, dtype):
    from helpers import GQA, PROMPTS, make_checkpoint
    path, _ = make_checkpoint(tmp_path, dict(GQA, head_dim=16))
    _gpu_matches_cpu(path, PROMPTS, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_attention_on_the_gpu_matches_the_cpu(tmp_path, monkeypatch, dtype):
    """DeepSeek-V3's tiny model (latent attention: one key head of latent and rope key, 24
    wide, its values the keys, the scores rescaled) generates on CuPy as on NumPy, its
    half-precision attention through cuDNN's rescaled graphs (``SCALED``, off in jobs until
    this passes) and its cache written without the fused write (no values)."""
    pytest.importorskip("transformers")
    from helpers import PROMPTS, build_hf_model
    from hpcpar.parallel.ops.cuda import attention
    monkeypatch.setattr(attention, "SCALED", True)
    _, path = build_hf_model("deepseek_v3", tmp_path)
    _gpu_matches_cpu(path, PROMPTS, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_load_time_finite_check_runs_on_the_device(cp, dtype):
    from hpcpar.parallel.device.dtypes import float_dtype, nonfinite
    values = np.array([0.0, -1.5, 3.0e4, 1e-30, np.inf, -np.inf, np.nan] * 100, np.float32)
    np.random.default_rng(0).shuffle(values)
    on_device = cp.asarray(values.astype(float_dtype(dtype)))
    got = nonfinite(cp, on_device)
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(cp.asnumpy(got), ~np.isfinite(values))


def test_free_device_memory_counts_the_pools_free_blocks(cp):
    """What continuous batching's default rows in flight are sized from: an array in use
    takes its bytes out of the free memory; freed into CuPy's pool, they count again."""
    from hpcpar.parallel.device.backend import ArrayBackend
    backend = ArrayBackend("cupy", cp)
    cp.get_default_memory_pool().free_all_blocks()
    before = backend.free_memory_bytes()
    assert 0 < before <= cp.cuda.runtime.memGetInfo()[1]
    block = cp.empty(256 << 20, dtype=cp.uint8)
    held = backend.free_memory_bytes()
    assert before - held >= 256 << 20
    del block                                             # back in the pool, not the driver
    assert backend.free_memory_bytes() >= before - (8 << 20)


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_graphed_decode_on_the_gpu_gives_the_eager_steps(tmp_path, monkeypatch, batching):
    """--cuda-graphs: each decode step after the first two is a replay, and its tokens and
    their log-probabilities are the eager steps' (float16: the graph's products are
    cuBLASLt's planned matmuls, the eager ones cuBLAS's; they may round apart)."""
    from helpers import GQA, PROMPTS, make_checkpoint
    from hpcpar.parallel.device.graphs import StepGraph
    path, _ = make_checkpoint(tmp_path, dict(GQA, head_dim=16))
    replays = []
    call = StepGraph.__call__
    monkeypatch.setattr(StepGraph, "__call__",
                        lambda self: replays.append(self._impl.captured) or call(self))
    sets = ["generate.logprobs=0", f"generate.batching='{batching}'"]
    eager = _generate(path, PROMPTS, "cupy", "float16", 8, *sets)
    graphed = _generate(path, PROMPTS, "cupy", "float16", 8, *sets,
                        "generate.cuda_graphs=true")
    assert replays.count(True) >= 5
    assert graphed.tokens.tolist() == eager.tokens.tolist()
    np.testing.assert_allclose(graphed.logprobs.values, eager.logprobs.values, atol=2e-2)


@pytest.mark.parametrize("rule", ["adamw", "sgd"])
@pytest.mark.parametrize("compute", [None, "float16", "bfloat16"])
def test_the_fused_optimizer_kernel_makes_the_references_roundings(cp, rule, compute):
    """--fused-optimizer's one kernel against the reference's passes on the host: float32
    master weights, gradients and states equal to the bit (the kernel is compiled without
    fused multiply-adds, so it rounds where the passes do), a 16-bit compute copy too; over
    weight decay on all, some (a mask) and none of the elements, a first step and a later one
    with a gradient scale (clipping)."""
    from hpcpar.parallel.ops import OptimizerUpdate, UpdateStep
    from hpcpar.parallel.ops.cuda.optimizer_update import OptimizerUpdateCuda
    from hpcpar.parallel.optim.flat_layout import Block
    from hpcpar.parallel.optim.settings import OptimizerSettings
    from hpcpar.parallel.device.dtypes import float_dtype
    from helpers import optimizer_arrays
    rng = np.random.default_rng(7)
    n = 100_003
    s = OptimizerSettings(rule, lr=3e-3, weight_decay=0.1, momentum=0.9, betas=(0.9, 0.95),
                          eps=1e-8)
    f32 = np.float32
    ref = optimizer_arrays(rng, rule, n)
    dev = {k: cp.asarray(v) for k, v in ref.items()}
    if compute:
        ref["data"] = ref["master"].astype(float_dtype(compute))
        dev["data"] = dev["master"].astype(compute)
    mask = rng.random(n) < 0.4
    update = getattr(OptimizerUpdate(np), rule)
    fused = getattr(OptimizerUpdateCuda(cp), rule)
    for decay in ("all", "some", "none"):
        for count, scale in ((1, 1.0), (2, 0.37)):
            step = UpdateStep(s.lr, count, scale)
            update(ref, s, step, Block(0, n, decay, mask if decay == "some" else None),
                   np.empty(n, f32))
            fused(dev, s, step, Block(0, n, decay, cp.asarray(mask) if decay == "some" else None))
            for k, want in ref.items():
                np.testing.assert_array_equal(host(cp, dev[k]), want.astype(f32),
                                              err_msg=f"{k} after {decay}, step {count}")


def test_training_with_the_fused_optimizer_gives_the_passes_weights(tmp_path):
    """A bfloat16 training job on CuPy, AdamW with weight decay and clipping, with and without
    --fused-optimizer: the same losses and the same saved weights, to the bit."""
    import h5py
    from mpi4py import MPI
    from hpcpar.checkpoint import init_checkpoint
    from hpcpar.jobs.job import load_job
    from hpcpar.jobs.train.engine import run_training
    init_checkpoint(tmp_path / "m.h5", "tiny")
    np.save(tmp_path / "rows.npy", np.random.default_rng(0).integers(1, 200, (4, 12)))
    saved = {}
    for fused in (False, True):
        out = tmp_path / f"o-{fused}"
        run_training(MPI.COMM_SELF, load_job(None, [
            f"model.checkpoint='{tmp_path / 'm.h5'}'", "parallel.backend='cupy'",
            "model.dtype='bfloat16'", f"data.dataset='{tmp_path / 'rows.npy'}'",
            "train.steps=3", "train.global_batch=2", "train.weight_decay=0.1",
            "train.clip_grad=1e-3", "train.lr=0.01", f"train.fused={str(fused).lower()}",
            f"output.path='{out}'"]), progress=False)
        with h5py.File(out / "step-3.h5") as f:
            saved[fused] = {}
            f.visititems(lambda name, d: saved[fused].__setitem__(name, d[()])
                         if isinstance(d, h5py.Dataset) else None)
    assert saved[True].keys() == saved[False].keys()
    for name, value in saved[False].items():
        np.testing.assert_array_equal(saved[True][name], value, err_msg=name)
