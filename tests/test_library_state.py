"""The library's optimizers and parameters on one process, against torch: an optimizer
resumed from its ``state_dict`` takes the same steps as one that never stopped (its step
count travels with the state), and a 16-bit layer learns in float32 (its master weights),
its compute copy refreshed by each step."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcpar.parallel as hp


def _steps(opt, params, grads):
    for g in grads:
        for p, gp in zip(params, g):
            p.grad[...] = gp
        opt.step()


@pytest.mark.parametrize("make", [lambda p: hp.AdamW(p, lr=0.05),
                                  lambda p: hp.SGD(p, lr=0.1, momentum=0.9)])
def test_an_optimizer_resumed_from_its_state_dict_steps_as_one_that_never_stopped(make):
    rng = np.random.default_rng(0)
    start = [rng.standard_normal((3, 4)), rng.standard_normal(4)]
    grads = [[rng.standard_normal(w.shape) for w in start] for _ in range(4)]
    straight = {"w": hp.Parameter(start[0].copy()), "b": hp.Parameter(start[1].copy())}
    _steps(make(straight), list(straight.values()), grads)
    first = {"w": hp.Parameter(start[0].copy()), "b": hp.Parameter(start[1].copy())}
    opt = make(first)
    _steps(opt, list(first.values()), grads[:2])
    saved = {name: {k: np.array(v) for k, v in st.items()} for name, st in
             opt.state_dict().items()}
    resumed = {name: hp.Parameter(p.data.copy()) for name, p in first.items()}
    again = make(resumed)
    again.load_state_dict(saved)
    _steps(again, list(resumed.values()), grads[2:])
    for name in straight:
        np.testing.assert_allclose(resumed[name].data, straight[name].data, rtol=1e-13)


def test_a_bfloat16_layer_learns_in_float32_and_computes_with_the_refreshed_copy():
    from hpcpar.parallel.comm import create_communicator
    from hpcpar.parallel.dtypes import bfloat16
    tp = create_communicator(MPI.COMM_SELF, "mpi")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 8)).astype(np.float32)
    layer = hp.ColumnParallelLinear.from_full(tp, w.astype(bfloat16))
    p = layer.weight
    assert p.data.dtype == bfloat16 and p.master.dtype == np.float32
    x = rng.standard_normal((16, 8)).astype(bfloat16)
    opt = hp.AdamW([p], lr=1e-4, weight_decay=0.0)
    ref = torch.tensor(w.astype(bfloat16).astype(np.float32), requires_grad=True)
    ref_opt = torch.optim.AdamW([ref], lr=1e-4, weight_decay=0.0)
    for _ in range(20):
        opt.zero_grad()
        y, ctx = layer.forward(x)
        layer.backward(np.ones_like(y), ctx)
        opt.step()
        ref_opt.zero_grad()
        (torch.tensor(x.astype(np.float32)) @ ref.T).sum().backward()
        ref_opt.step()
    moved = np.abs(p.master - w.astype(bfloat16).astype(np.float32))
    assert moved.min() > 1e-3                  # every weight moved, as float32 moves it
    np.testing.assert_allclose(p.master, ref.detach().numpy(), rtol=1e-4, atol=2e-5)
    np.testing.assert_array_equal(p.data, p.master.astype(bfloat16))      # refreshed
