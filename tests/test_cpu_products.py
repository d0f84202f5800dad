"""The host's blocked products (``ops.linear.BlockedMatrix``, ``blocked_linear``) against plain
NumPy: every row count (a decode step's few, a prefill's many), widths that leave a tail, a
matrix narrower than one block; the rows an embedding looks up; which weights a generation
stage blocks (``layers.block_frozen``)."""

from __future__ import annotations

import numpy as np
import pytest

from hpcpar.cores import one_blas_thread
from hpcpar.parallel.ops.linear import (SMALL_PRODUCT, BlockedMatrix, block_width,
                                        blocked_linear)
from hpcpar.parallel.tensor_parallel.layers import Frozen, LoraAdapter, block_frozen, product
from hpcpar.parallel.ops import native_ops


def _reference(x, w):
    """x @ w.T in float64, as float32 inputs give it exactly."""
    return x.astype(np.float64) @ w.astype(np.float64).T


@pytest.mark.parametrize("out,width", [(256, 64), (100, 32), (70, 16), (5, 16)])
@pytest.mark.parametrize("rows", [1, 3, 8, 40, 300])
def test_blocked_product_is_the_plain_product(out, width, rows):
    rng = np.random.default_rng(out + rows)
    w = rng.standard_normal((out, 48), dtype=np.float32)
    x = rng.standard_normal((2, rows, 48), dtype=np.float32)
    m = BlockedMatrix(w, width)
    got = blocked_linear(x, m)
    assert got.shape == (2, rows, out) and got.dtype == np.float32 and got.flags.c_contiguous
    ref = _reference(x, w)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_blocked_matrix_stands_for_its_matrix():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((100, 48), dtype=np.float32)       # 3 blocks of 32 and 4 rows
    m = BlockedMatrix(w, 32)
    assert (m.shape, m.dtype, m.nbytes, m.ndim) == (w.shape, w.dtype, w.nbytes, 2)
    ids = np.array([[0, 31, 32, 95], [96, 99, 5, 64]])        # in blocks and in the tail
    assert np.array_equal(m[ids], w[ids])
    assert np.array_equal(BlockedMatrix(w[:7], 32)[np.array([6, 0])], w[[6, 0]])
    for one in (np.int64(99), 5, np.array(40)):               # one row, a copy each time
        got = m[one]
        got[:] = -1
        assert np.array_equal(m[np.arange(100)], w)
    base = np.ascontiguousarray(w[:96])
    assert BlockedMatrix(base, 32).tail.base is None          # no view keeps w alive


def test_block_width_keeps_a_decode_steps_product_unpacked():
    for k in (64, 768, 2048, 3456):
        assert block_width(k) == 32 and 8 * k * 32 <= SMALL_PRODUCT
    assert block_width(3457) == block_width(4096) == 0


def test_block_frozen_takes_host_float32_frozen_matrices_only():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 32), dtype=np.float32)
    frozen = Frozen(w.copy())
    block_frozen(frozen)
    assert isinstance(frozen.data, BlockedMatrix)
    x = rng.standard_normal((3, 32), dtype=np.float32)
    got = product(native_ops(np), x, frozen)
    assert np.abs(got - _reference(x, w)).max() <= 1e-5 * np.abs(_reference(x, w)).max()
    adapter = LoraAdapter(Frozen(w[:4].copy()), Frozen(w[:, :4].copy()), 1.0)
    kept = [Frozen(w.astype(np.float64)), Frozen(w[:8].copy()),      # dtype; fewer rows
            Frozen(w.copy(), lora=adapter), Frozen(w[0].copy())]      # an adapter; a vector
    for f in kept:
        before = f.data
        block_frozen(f)
        assert f.data is before


@pytest.mark.parametrize("env,one", [({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "4"}, True),
                                     ({"OMP_NUM_THREADS": "4"}, False),
                                     ({"OMP_NUM_THREADS": "1"}, True)])
def test_one_blas_thread_reads_the_settings_as_openblas_does(monkeypatch, env, one):
    for var in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert one_blas_thread() is one


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_host_stage_is_blocked_with_one_blas_thread_and_gives_the_same_logits(tmp_path,
                                                                                monkeypatch,
                                                                                threads):
    """One thread: the dense projections and the (tied) head are blocked, and the logits are
    those of the plain products; several: the stage keeps its arrays (one GEMM on all)."""
    from mpi4py import MPI
    from hpcpar.checkpoint import init_checkpoint, load_shard, open_checkpoint, preset_config
    from hpcpar.models.decoder import DecoderStage, matrix_stacks
    from hpcpar.models.tensors import StageSpan, stage_tensors
    from hpcpar.parallel.comm import create_communicator
    from hpcpar.parallel.device.backend import NUMPY
    from hpcpar.parallel.ops import AttentionRows, ops_for
    init_checkpoint(tmp_path / "m.h5", dict(preset_config("tiny"), num_hidden_layers=2))
    ckpt = open_checkpoint(tmp_path / "m.h5")
    span = StageSpan(range(2))
    specs = stage_tensors(ckpt.config, span.layers, True, True)
    tp, ops = create_communicator(MPI.COMM_SELF, "mpi"), ops_for(NUMPY)
    ids = np.arange(1, 7)[None]
    rows = AttentionRows.build(np, np.array([6]), np.array([6]), from_start=True)

    def logits(n: str):
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", n)
        shard = load_shard(ckpt, specs, stacks=matrix_stacks(specs, span))
        stage = DecoderStage.from_tensors(ckpt.config, specs, shard.tensors, span, tp, ops,
                                          np.dtype(np.float32), placed=shard.placed)
        layer = stage.decoder[0]
        held = [layer.attention.qkv.weights[0], layer.mlp.down.weight, stage.head.weight]
        return stage.logits(stage.forward(stage.embed(ids), rows, None)), held

    got, held = logits(threads)
    assert all(isinstance(w.data, BlockedMatrix) is (threads == "1") for w in held)
    plain, _ = logits("4")
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
