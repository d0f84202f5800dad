"""The device budget (``parallel.budget`` on the strict backend): what it counts, checked
against operations counted by hand, and what it shows of a generation's decode step."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar.jobs.generate import Prompts, run_generation
from hpcpar.jobs.job import load_job
from hpcpar.parallel import budget as device_budget
from hpcpar.parallel.budget import Budget
from hpcpar.parallel.strict import xp


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
            y[0] = np.zeros(8, np.float32)                 # an upload into y: one copy
            with b.staging():
                staged = y.get()         # a communicator's copy through the host
            del y, view, picked
    (outer,), (inner,) = b.per_run("outer"), b.per_run("outer/inner")
    assert (outer.ops, outer.reads, outer.uploads, outer.staged) == (6, 1, 2, 1)
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
