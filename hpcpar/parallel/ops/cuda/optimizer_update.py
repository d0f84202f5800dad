"""AdamW and SGD as one elementwise pass over a span of flat buffers (``--fused-optimizer``):
each array read once and what changes written once, where the reference's passes read and
write them a dozen times (for a 1B model's AdamW step, about 30 bytes a parameter against
about 150). Compiled without fused multiply-adds, it makes the reference's float32 roundings
in the reference's order: the two agree to the bit where the gradients are float32
(``tests/test_ops_gpu.py``; on the CPU, ``tests/test_optimizer_kernel.py`` compiles the same
bodies as C++ and holds them to the passes). The master weights and states are float32; any
other dtype takes the reference."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..optimizer_update import OptimizerUpdate, UpdateStep, bias_corrections

# g: the gradient (float32, or 16-bit), scaled in place as the reference does
_SCALE = """
float grad = static_cast<float>(g);
if (scale != 1.0f) { g = static_cast<G>(grad * scale); grad = static_cast<float>(g); }
"""
_ADAMW = _SCALE + """
if (decays) w = w * decay;
m = m + (grad - m) * one_minus_b1;
v = v * b2 + grad * grad * one_minus_b2;
w = w - m / (sqrtf(v) / bc2_sqrt + eps) * step_size;
"""
_SGD = _SCALE + """
if (decays) grad = w * weight_decay + grad;
if (with_momentum) { buf = first ? grad : buf * momentum + grad; grad = buf; }
w = w - grad * lr;
"""
# rule -> (inputs, outputs, body): the kernels' sources (CuPy is imported when one is built)
_INPUTS = {"adamw": "bool decays, float32 scale, float32 decay, float32 one_minus_b1, "
                    "float32 b2, float32 one_minus_b2, float32 bc2_sqrt, float32 eps, "
                    "float32 step_size",
           "sgd": "bool decays, float32 scale, float32 weight_decay, bool with_momentum, "
                  "bool first, float32 momentum, float32 lr"}
_OUTPUTS = {"adamw": "float32 w, G g, float32 m, float32 v",
            "sgd": "float32 w, G g, float32 buf"}
_BODIES = {"adamw": _ADAMW, "sgd": _SGD}
SOURCES = {rule: (_INPUTS[rule], _OUTPUTS[rule], _BODIES[rule]) for rule in _BODIES}


@lru_cache(maxsize=None)
def _kernel(rule: str, refresh: bool):
    """The update ``rule``'s kernel; ``refresh``: it writes the 16-bit compute copy too."""
    import cupy
    inputs, outputs, body = SOURCES[rule]
    if refresh:
        outputs, body = outputs + ", D data", body + "data = static_cast<D>(w);"
    return cupy.ElementwiseKernel(inputs, outputs, body, f"hpcpar_{rule}",
                                  options=("--fmad=false",))


class OptimizerUpdateCuda(OptimizerUpdate):
    def adamw(self, a: dict, s, step: UpdateStep, blk, tmp=None) -> None:
        if a["master"].dtype != np.float32:
            return super().adamw(a, s, step, blk, tmp)
        b1, b2 = s.betas
        bc1, bc2_sqrt = bias_corrections(b1, b2, step.count)
        decay = 1.0 - step.lr * s.weight_decay
        f = np.float32
        _kernel("adamw", "data" in a)(
            _decays(blk, decay != 1.0), f(step.grad_scale), f(decay), f(1.0 - b1), f(b2),
            f(1.0 - b2), f(bc2_sqrt), f(s.eps), f(step.lr / bc1),
            a["master"], a["grad"], a["exp_avg"], a["exp_avg_sq"], *_data(a))

    def sgd(self, a: dict, s, step: UpdateStep, blk, tmp=None) -> None:
        if a["master"].dtype != np.float32:
            return super().sgd(a, s, step, blk, tmp)
        f = np.float32
        _kernel("sgd", "data" in a)(
            _decays(blk, bool(s.weight_decay)), f(step.grad_scale), f(s.weight_decay),
            bool(s.momentum), step.count == 1, f(s.momentum), f(step.lr),
            a["master"], a["grad"], a["momentum_buffer"], *_data(a))


def _decays(blk, applies: bool):
    """The kernel's ``decays``: one flag for the block, or its mask."""
    if not applies or blk.decay == "none":
        return False
    return True if blk.decay == "all" else blk.mask


def _data(a: dict) -> tuple:
    return (a["data"],) if "data" in a else ()
