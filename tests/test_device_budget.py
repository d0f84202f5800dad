"""The device budget (``parallel.device.budget`` on the strict backend): what it counts, checked
against operations counted by hand, and what it shows of a generation's decode step."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar.jobs.generate import Prompts, run_generation
from hpcpar.jobs.job import load_job
from hpcpar.parallel.device import budget as device_budget
from hpcpar.parallel.device.budget import Budget
from hpcpar.parallel.device.strict_arrays import xp


def test_each_kind_of_operation_is_counted_as_a_gpu_would_see_it():
    a = xp.asarray(np.ones((4, 8), np.float32))          # before counting: not counted
    b = Budget()
    with b.counting():
        with b.phase("outer"):
            y = a * 2                    # a kernel and a new array (128 bytes)
            y += 1                       # a kernel, in place
            view = y[:, :4], y.reshape(32).T     # views: nothing
            copied = y[:, :4].reshape(16)        # no view of a slice: a kernel copies (64)
            total = y.sum(axis=1)        # a kernel and a new array (16 bytes)
            with b.phase("inner"):
                picked = y[xp.asarray(np.array([0, 2]))]   # upload (16 bytes), gather (64)
                host = total.get()       # a read
            scratch = xp.empty((3,), np.float32)           # an allocation, no kernel
            y[0].set(np.zeros(8, np.float32))    # an upload into y: a copy, no kernel
            with b.staging():
                staged = y.get()         # a communicator's copy through the host
            del y, view, picked
    (outer,), (inner,) = b.per_run("outer"), b.per_run("outer/inner")
    assert (outer.ops, outer.reads, outer.uploads, outer.staged) == (5, 1, 2, 1)
    assert (outer.allocations, outer.allocated_bytes) == (6, 128 + 64 + 16 + 16 + 64 + 12)
    assert (inner.ops, inner.reads, inner.uploads, inner.allocations) == (1, 1, 1, 2)
    assert b.peak == 128 + 64 + 16 + 16 + 64       # y, copied, total, the index and picked
    assert b.live == 64 + 16 + 12                  # copied, total and scratch are alive
    del copied, total, scratch
    assert b.live == 0
    assert host.shape == (4,) and staged.shape == (4, 8)


def test_nothing_is_counted_outside_and_one_budget_counts_at_a_time():
    b = Budget()
    (xp.asarray(np.ones(3)) * 2).get()
    assert b.total.ops == 0 and device_budget.current() is None
    with b.counting():
        with pytest.raises(RuntimeError, match="already counting"):
            with Budget().counting():
                pass
    with device_budget.phase("anything"):               # no budget: a no-op
        pass


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_a_decode_step_reads_the_device_once_and_every_layer_costs_the_same(tmp_path,
                                                                              batching):
    """On the strict backend a generation's decode step reads back one array (the new
    tokens, for the EOS and stop checks), and each decoder layer makes the same operations
    at every step (the first layer one fewer: no branch output to add before it)."""
    from hpcpar.checkpoint import init_checkpoint, preset_config
    cfg = dict(preset_config("tiny"), num_hidden_layers=3)
    init_checkpoint(tmp_path / "model.h5", cfg)
    job = load_job(None, [f"model.checkpoint='{tmp_path / 'model.h5'}'",
                          "parallel.backend='strict'", "generate.max_new_tokens=5",
                          "generate.stop_at_eos=false", f"generate.batching='{batching}'"])
    prompts = Prompts([np.arange(1, 7), np.arange(3, 12), np.arange(2, 5)])
    b = Budget()
    with b.counting():
        result = run_generation(MPI.COMM_SELF, job, prompts=prompts, progress=False)
    assert result.lengths.tolist() == [5, 5, 5]
    steps, layers = b.per_run("decode"), b.per_run("decode/layer")
    assert len(steps) == 4 and len(layers) == 3 * len(steps)
    assert [s.reads for s in steps] == [1] * 4
    ops = np.array([layer.ops for layer in layers]).reshape(len(steps), 3)
    assert (ops == ops[0]).all() and ops[0, 1] == ops[0, 2] == ops[0, 0] + 1
    assert all(s.ops > ops[0].sum() for s in steps)            # the layers and the head
    assert b.per_run("prefill") and b.per_run("prefill/layer")


def test_a_device_kernels_reference_counts_as_its_one_launch():
    """The GPU's table on the strict backend: RMSNorm's reference (several array operations)
    counts as one operation and one new array; the KV-cache write (in place) as one, with no
    array; and it computes what the reference computes."""
    from hpcpar.parallel.ops import native_ops
    from hpcpar.parallel.ops.counted import counted_ops
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 5, 16)).astype(np.float32), rng.random(16).astype(np.float32)
    ops = counted_ops(xp)
    assert ops.device
    b = Budget()
    with b.counting():
        with b.phase("norm"):
            y = ops.rms_norm.forward(xp.asarray(x), xp.asarray(w), 1e-5)
        cache_k, cache_v = xp.zeros((2, 4, 8, 3)), xp.zeros((2, 4, 8, 3))
        k, v = xp.asarray(np.ones((2, 1, 4, 3))), xp.asarray(np.ones((2, 1, 4, 3)))
        starts = xp.asarray(np.array([1, 2]))
        with b.phase("write"):
            ops.kv_write.forward(cache_k, cache_v, k, v, starts, False)
    (norm,), (write,) = b.per_run("norm"), b.per_run("write")
    assert (norm.ops, norm.allocations, norm.uploads) == (1, 3, 2)   # x, w and y
    assert norm.allocated_bytes == 2 * x.nbytes + w.nbytes
    assert (write.ops, write.allocations) == (1, 0)        # in place
    written = cache_k.get()
    assert written[0, :, 1].sum() == written[1, :, 2].sum() == 4 * 3 == written.sum() / 2
    np.testing.assert_array_equal(y.get(), native_ops(np).rms_norm.forward(x, w, 1e-5))


def test_the_gpus_control_flow_on_the_cpu_gives_the_references_tokens(tmp_path, monkeypatch):
    """HPCPAR_OPS=device on the strict backend takes the GPU's path (device ops: whole-prompt
    prefills, every position's states): the same tokens as the references' path."""
    from hpcpar.checkpoint import init_checkpoint, preset_config
    init_checkpoint(tmp_path / "model.h5", dict(preset_config("tiny"), num_hidden_layers=2))
    prompts = Prompts([np.arange(1, 7), np.arange(3, 12), np.arange(2, 5)])
    tokens = {}
    for choice in ("native", "device"):
        monkeypatch.setenv("HPCPAR_OPS", choice)
        job = load_job(None, [f"model.checkpoint='{tmp_path / 'model.h5'}'",
                              "parallel.backend='strict'", "generate.max_new_tokens=6",
                              "generate.stop_at_eos=false", "generate.logprobs=2"])
        result = run_generation(MPI.COMM_SELF, job, prompts=prompts, progress=False)
        tokens[choice] = (result.tokens, result.logprobs.values)
    np.testing.assert_array_equal(tokens["device"][0], tokens["native"][0])
    np.testing.assert_allclose(tokens["device"][1], tokens["native"][1], atol=1e-5)


def test_device_ops_need_a_device_backend(tmp_path, monkeypatch, capfd):
    from hpcpar.checkpoint import init_checkpoint
    from hpcpar.jobs.launch import JobFailed
    init_checkpoint(tmp_path / "model.h5", "tiny")
    monkeypatch.setenv("HPCPAR_OPS", "device")
    job = load_job(None, [f"model.checkpoint='{tmp_path / 'model.h5'}'",
                          "parallel.backend='numpy'", "generate.max_new_tokens=2"])
    with pytest.raises(JobFailed):
        run_generation(MPI.COMM_SELF, job, prompts=Prompts([np.arange(1, 4)]), progress=False)
    err = capfd.readouterr().err
    assert "HPCPAR_OPS=device" in err and len(err.strip().splitlines()) == 1, err


def test_loading_holds_each_weight_once_and_one_check_block_more(tmp_path, monkeypatch):
    """The device bytes alive while a stage loads and builds: its weights, each read straight
    into its place (q/k/v and gate/up into their merged matrix, each part one upload: no
    blocks beside a merged copy), plus the NaN / inf check's temporaries of one block (16 KB
    here, 8 MB in a run): never a second copy of a projection, of the model or of the head."""
    from hpcpar.checkpoint import init_checkpoint, preset_config
    from hpcpar.parallel.device import dtypes
    monkeypatch.setattr(dtypes, "CHECK_BLOCK_BYTES", 16 << 10)
    cfg = dict(preset_config("tiny"), num_hidden_layers=3, vocab_size=4096,
               tie_word_embeddings=False)
    init_checkpoint(tmp_path / "model.h5", cfg)
    job = load_job(None, [f"model.checkpoint='{tmp_path / 'model.h5'}'",
                          "parallel.backend='strict'", "generate.max_new_tokens=2"])
    b = Budget()
    with b.counting():
        result = run_generation(MPI.COMM_SELF, job, prompts=Prompts([np.arange(1, 5)]),
                                progress=False)
    (load,) = b.per_run("load")
    weights = round(max(result.report.weight_mb) * 1e6)
    block = dtypes.check_temporary_bytes(cfg["vocab_size"] * cfg["hidden_size"], 4)
    assert block == (16 << 10) * 5 // 4                   # a block's bits and its comparison
    assert weights <= load.peak_bytes <= weights + block, (load.peak_bytes, weights)


@pytest.mark.parametrize("kind", ["generate", "score", "train"])
def test_a_job_frees_its_device_memory_when_it_returns(tmp_path, kind):
    """A library call that returns has released the model, its caches and its optimizer
    state at once, not when Python's cycle collector next runs: on the H100 a generation left
    its 2.7 GB of weights alive, and the next call in the same process held two models."""
    import gc
    from hpcpar.checkpoint import init_checkpoint, preset_config
    from hpcpar.jobs.score.engine import run_scoring
    from hpcpar.jobs.train.engine import run_training
    cfg = dict(preset_config("tiny"), num_hidden_layers=2)
    init_checkpoint(tmp_path / "model.h5", cfg)
    rows = np.random.default_rng(0).integers(1, cfg["vocab_size"], (4, 12))
    np.save(tmp_path / "rows.npy", rows)
    sets = [f"model.checkpoint='{tmp_path / 'model.h5'}'", "parallel.backend='strict'"]
    run = {
        "generate": lambda: run_generation(MPI.COMM_SELF, load_job(None, sets + [
            "generate.max_new_tokens=3"]), prompts=Prompts(list(rows)), progress=False),
        "score": lambda: run_scoring(MPI.COMM_SELF, load_job(None, sets + [
            f"score.data='{tmp_path / 'rows.npy'}'", f"output.path='{tmp_path / 's.h5'}'"]),
            progress=False),
        "train": lambda: run_training(MPI.COMM_SELF, load_job(None, sets + [
            f"data.dataset='{tmp_path / 'rows.npy'}'", "train.steps=2", "train.global_batch=2",
            f"output.path='{tmp_path / 'out'}'"]), progress=False),
    }[kind]
    b = Budget()
    gc.collect()
    gc.disable()
    try:
        with b.counting():
            result = run()
            assert result is not None and b.peak > 0
            del result
            left = b.live
    finally:
        gc.enable()
    assert left == 0, f"{left} device bytes alive after run_{kind} returned"


def test_an_optimizer_step_makes_the_same_few_operations_for_any_number_of_tensors(tmp_path):
    """A training job's AdamW step on the strict backend, for a model of 2 layers (21
    tensors) and of 4 (39): the passes of torch's single-tensor AdamW counted by hand, 13,
    once over the flat buffers, plus 2 for the weight decay of the matrices alone and 1 for
    the clipping's gradient scale; one allocation (the step's scratch). Tensor by tensor,
    as it was, it made those 16 for each."""
    from hpcpar.checkpoint import init_checkpoint, preset_config
    from hpcpar.jobs.train.engine import run_training
    rows = np.random.default_rng(0).integers(1, 200, (4, 12))
    np.save(tmp_path / "rows.npy", rows)
    steps = {}
    for layers in (2, 4):
        init_checkpoint(tmp_path / f"{layers}.h5",
                        dict(preset_config("tiny"), num_hidden_layers=layers))
        job = load_job(None, [f"model.checkpoint='{tmp_path / f'{layers}.h5'}'",
                              "parallel.backend='strict'",
                              f"data.dataset='{tmp_path / 'rows.npy'}'", "train.steps=3",
                              "train.global_batch=2", "train.weight_decay=0.1",
                              "train.clip_grad=1e-3", f"output.path='{tmp_path / f'o{layers}'}'"])
        b = Budget()
        with b.counting():
            run_training(MPI.COMM_SELF, job, progress=False)
        steps[layers] = [(c.ops, c.reads, c.allocations) for c in b.per_run("optimizer")]
    assert steps[2] == steps[4] == [(13 + 2 + 1, 0, 1)] * 3, steps


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_fused_optimizer_is_one_operation_and_the_same_weights(tmp_path, monkeypatch,
                                                                     optimizer):
    """``--fused-optimizer`` on the GPU's path (the strict backend, HPCPAR_OPS=device): the
    whole step, weight decay of the matrices alone and the clipping's scale included, is one
    kernel per run of the flat buffers (one here) and allocates nothing (the passes' scratch
    is gone); the trained weights and optimizer state are the passes' to the bit."""
    import h5py
    from hpcpar.checkpoint import init_checkpoint
    from hpcpar.jobs.train.engine import run_training
    monkeypatch.setenv("HPCPAR_OPS", "device")
    init_checkpoint(tmp_path / "m.h5", "tiny")
    np.save(tmp_path / "rows.npy", np.random.default_rng(0).integers(1, 200, (4, 12)))
    counts, saved = {}, {}
    for fused in (False, True):
        out = tmp_path / f"o-{fused}"
        job = load_job(None, [f"model.checkpoint='{tmp_path / 'm.h5'}'",
                              "parallel.backend='strict'", f"train.optimizer='{optimizer}'",
                              f"data.dataset='{tmp_path / 'rows.npy'}'", "train.steps=3",
                              "train.global_batch=2", "train.weight_decay=0.1",
                              "train.momentum=0.9" if optimizer == "sgd" else "train.eps=1e-6",
                              "train.clip_grad=1e-3", "train.lr=0.01",
                              f"train.fused={str(fused).lower()}", f"output.path='{out}'"])
        b = Budget()
        with b.counting():
            run_training(MPI.COMM_SELF, job, progress=False)
        counts[fused] = [(c.ops, c.allocations) for c in b.per_run("optimizer")]
        with h5py.File(out / "step-3.h5") as f:
            saved[fused] = {}
            f.visititems(lambda name, d: saved[fused].__setitem__(name, d[()])
                         if isinstance(d, h5py.Dataset) else None)
    passes = 13 + 2 + 1 if optimizer == "adamw" else 8      # (SGD: 7 at its first step)
    assert counts[True] == [(1, 0)] * 3 and counts[False][-1] == (passes, 1), counts
    assert saved[True].keys() == saved[False].keys() and len(saved[True]) > 20
    for name, value in saved[False].items():
        np.testing.assert_array_equal(saved[True][name], value, err_msg=name)


def test_gradient_buckets_are_spans_of_the_buffer_the_optimizer_steps():
    """A GradientReducer's buckets are views of one flat gradient buffer, its params in
    bucket order: a gradient written is in its bucket (nothing is copied in or out), and an
    optimizer made after the reducer steps those same arrays (it moves none of them)."""
    import hpcpar.parallel as hp
    from hpcpar.parallel.comm import create_communicator
    dp = create_communicator(MPI.COMM_SELF, "mpi")
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (4,), (5, 2), (6,)]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params = [hp.Parameter(np.zeros(s, np.float32), decay=len(s) == 2) for s in shapes]
    for p, g in zip(params, grads):
        p.grad[...] = g
    order = [3, 2, 1, 0]                        # the order their gradients complete
    reducer = hp.GradientReducer(dp, [[params[3], params[2]], [params[1], params[0]]],
                                 bucket_bytes=40)
    held = [p.grad for p in params]
    hp.AdamW(params, lr=0.1)
    assert all(p.grad is g for p, g in zip(params, held))
    assert len(reducer.buckets) == 2
    base = reducer.buckets[0].base
    assert base is not None and all(b.base is base for b in reducer.buckets)
    assert all(p.grad.base is base for p in params)
    np.testing.assert_array_equal(np.concatenate(reducer.buckets),
                                  np.concatenate([grads[i].ravel() for i in order]))
    for b, members in ((0, (3, 2)), (1, (1, 0))):
        assert all(np.shares_memory(reducer.buckets[b], params[i].grad) for i in members)
    params[0].grad[...] = 7.0                   # the last of the second bucket
    np.testing.assert_array_equal(reducer.buckets[1][-12:], 7.0)


def test_a_kernels_own_reads_are_not_the_steps(tmp_path, monkeypatch):
    """With the device's kernels, a prefill and a decode step over more than one tile of
    keys read the device once each: the attention reference's read of the tiles it may skip
    is what the device kernel does on the device (it was counted as the step's reads)."""
    from hpcpar.checkpoint import init_checkpoint, preset_config
    monkeypatch.setenv("HPCPAR_OPS", "device")
    init_checkpoint(tmp_path / "model.h5", dict(preset_config("tiny"), num_hidden_layers=2,
                                                max_position_embeddings=512))
    job = load_job(None, [f"model.checkpoint='{tmp_path / 'model.h5'}'",
                          "parallel.backend='strict'", "generate.max_new_tokens=4",
                          "generate.stop_at_eos=false"])
    b = Budget()
    with b.counting():
        run_generation(MPI.COMM_SELF, job, prompts=Prompts([np.arange(1, 300) % 200]),
                       progress=False)
    assert [s.reads for s in b.per_run("prefill") + b.per_run("decode")] == [1] * 4
