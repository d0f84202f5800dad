"""``--fused-optimizer``'s CUDA kernel bodies (``ops/cuda/optimizer_update.py``) on the CPU:
each body compiled as C++ with the same float32 arithmetic (no fused multiply-adds, IEEE
division and square root, as NVRTC compiles it with ``--fmad=false``), run over the arrays
the reference's NumPy passes update, and held to them to the bit. The GPU test
(``tests/test_ops_gpu.py``) runs the kernel itself; this one needs only a C++ compiler."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from hpcpar.parallel.ops import OptimizerUpdate, UpdateStep
from hpcpar.parallel.ops.cuda.optimizer_update import SOURCES
from hpcpar.parallel.ops.optimizer_update import bias_corrections
from hpcpar.parallel.optim.flat_layout import Block
from hpcpar.parallel.optim.settings import OptimizerSettings

from helpers import optimizer_arrays

CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


def _cpp(rule: str) -> str:
    """The kernel as a C loop over N elements: scalars by value, a per-element ``decays``
    flag, each output a float reference to its element (G: float32 gradients)."""
    inputs, outputs, body = SOURCES[rule]
    ins = [p.split() for p in inputs.split(", ")]
    outs = [p.split()[1] for p in outputs.split(", ")]
    scalars = ", ".join(f"{'bool' if t == 'bool' else 'float'} {n}"
                        for t, n in ins if n != "decays")
    arrays = ", ".join(f"float* {n}_" for n in outs)
    refs = " ".join(f"float &{n} = {n}_[k];" for n in outs)
    return (f'extern "C" void {rule}({scalars}, const bool* decays_, {arrays}, long N) {{\n'
            f"  for (long k = 0; k < N; ++k) {{ const bool decays = decays_[k]; {refs}\n"
            f"{body}\n  }}\n}}\n")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kernels")
    source = folder / "update.cpp"
    source.write_text("#include <cmath>\ntypedef float G;\n" + _cpp("adamw") + _cpp("sgd"))
    library = folder / "update.so"
    subprocess.run([CXX, "-O2", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
                    str(source), "-o", str(library)], check=True)
    return ctypes.CDLL(str(library))


def _scalars(rule: str, s: OptimizerSettings, step: UpdateStep) -> list:
    """The kernel's scalar arguments as ``OptimizerUpdateCuda`` passes them."""
    f = ctypes.c_float
    if rule == "adamw":
        b1, b2 = s.betas
        bc1, bc2_sqrt = bias_corrections(b1, b2, step.count)
        decay = 1.0 - step.lr * s.weight_decay
        return [f(step.grad_scale), f(decay), f(1.0 - b1), f(b2), f(1.0 - b2), f(bc2_sqrt),
                f(s.eps), f(step.lr / bc1)]
    return [f(step.grad_scale), f(s.weight_decay), ctypes.c_bool(bool(s.momentum)),
            ctypes.c_bool(step.count == 1), f(s.momentum), f(step.lr)]


@pytest.mark.parametrize("rule, momentum", [("adamw", 0.0), ("sgd", 0.0), ("sgd", 0.9)])
def test_the_kernels_body_makes_the_passes_roundings(kernels, rule, momentum):
    """Weight decay on all, some (a mask) and none of the elements; a first step, a later one
    with a clipping's scale, a third: every array equal to the bit after each."""
    rng = np.random.default_rng(1)
    n = 50_001
    s = OptimizerSettings(rule, lr=3e-3, weight_decay=0.1, momentum=momentum,
                          betas=(0.9, 0.95), eps=1e-8)
    ref = optimizer_arrays(rng, rule, n)
    got = {k: v.copy() for k, v in ref.items()}
    mask = rng.random(n) < 0.4
    reference = getattr(OptimizerUpdate(np), rule)
    for decay in ("all", "some", "none"):
        for count, scale in ((1, 1.0), (2, 0.37), (3, 1.0)):
            step = UpdateStep(s.lr, count, scale)
            reference(ref, s, step, Block(0, n, decay, mask if decay == "some" else None),
                      np.empty(n, np.float32))
            decays = np.ascontiguousarray(mask if decay == "some" else
                                          np.full(n, decay == "all"))
            pointers = [a.ctypes.data_as(ctypes.c_void_p) for a in got.values()]
            getattr(kernels, rule)(*_scalars(rule, s, step),
                                   decays.ctypes.data_as(ctypes.c_void_p), *pointers,
                                   ctypes.c_long(n))
            for k, want in ref.items():
                np.testing.assert_array_equal(got[k], want, err_msg=f"{k}: {decay}, {count}")
