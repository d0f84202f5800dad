"""One optimizer update of a span of flat buffers (``parallel.optim.optimizers``), elementwise:
torch's single-tensor AdamW and SGD, with the gradient's scale (clipping, loss scaling) in front and
the refresh of a 16-bit compute copy behind.

    g  = g * grad_scale                                   (in place: the step's gradient)
    AdamW   w = w * (1 - lr wd)                           (where the weights decay)
            m = m + (g - m)(1 - b1)                       (torch: exp_avg.lerp_(g, 1 - b1))
            v = v b2 + g g (1 - b2)
            w = w - m / (sqrt(v) / sqrt(1 - b2^t) + eps) * lr / (1 - b1^t)
    SGD     d = g + wd w                                  (where the weights decay)
            b = d at step 1, else b momentum + d;  d = b  (momentum without dampening)
            w = w - lr d
    data = w                                              (a 16-bit compute copy, rounded)

The reference makes the passes torch's single-tensor optimizers make, through a scratch
array of the block's size (``tmp``): a dozen kernels a span on a device, each reading and
writing memory again. The device kernel (``ops/cuda/optimizer_update``, ``--fused-optimizer``)
makes them all in one pass, reading each array once and writing what changes once, in the
same order of float32 roundings (it is compiled without fused multiply-adds), so the two
agree to the bit where the gradients are float32.

``a``: the block's arrays by name, 1-D views of equal length: ``master`` (w), ``grad`` (g),
the optimizer's states (``exp_avg`` and ``exp_avg_sq``, or ``momentum_buffer``), and
``data`` where a separate compute copy exists. ``blk``: how weight decay covers the block
(``.decay``: "all", "none", or "some" with ``.mask``, True where it decays).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class UpdateStep:
    """What one update is told besides its arrays and settings."""

    lr: float
    count: int                   # optimizer steps taken, this one included (from 1)
    grad_scale: float = 1.0      # the gradient is multiplied by it first (1: untouched)


class OptimizerUpdate:
    """The reference: NumPy's passes on any array module."""

    def __init__(self, xp):
        self.xp = xp

    def adamw(self, a: dict, s, step: UpdateStep, blk, tmp=None) -> None:
        """torch's single-tensor AdamW over one block (``s``: the ``OptimizerSettings``)."""
        xp = self.xp
        tmp = self._scratch(a, tmp)
        w, g = self._scaled(a, step)
        m, v = a["exp_avg"], a["exp_avg_sq"]
        b1, b2 = s.betas
        decay = 1.0 - step.lr * s.weight_decay
        if blk.decay == "all" and decay != 1.0:        # torch: param.mul_(1 - lr * wd)
            w *= decay
        elif blk.decay == "some" and decay != 1.0:
            xp.multiply(w, decay, out=tmp)
            xp.copyto(w, tmp, where=blk.mask)
        xp.subtract(g, m, out=tmp)                      # torch: exp_avg.lerp_(grad, 1 - b1)
        tmp *= 1.0 - b1
        m += tmp
        v *= b2                              # exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
        xp.multiply(g, g, out=tmp)
        tmp *= 1.0 - b2
        v += tmp
        bc1, bc2_sqrt = bias_corrections(b1, b2, step.count)
        xp.sqrt(v, out=tmp)                             # denom = sqrt(v) / sqrt(bc2) + eps
        tmp /= bc2_sqrt
        tmp += s.eps
        xp.divide(m, tmp, out=tmp)                      # param.addcdiv_(m, denom, -lr / bc1)
        tmp *= step.lr / bc1
        w -= tmp
        self._refresh(a)

    def sgd(self, a: dict, s, step: UpdateStep, blk, tmp=None) -> None:
        """torch's SGD (momentum without dampening) over one block."""
        xp = self.xp
        tmp = self._scratch(a, tmp)
        w, g = self._scaled(a, step)
        if s.weight_decay and blk.decay != "none":       # torch: g = g + wd * w
            xp.multiply(w, s.weight_decay, out=tmp)
            if blk.decay == "some":
                xp.multiply(tmp, blk.mask, out=tmp)   # 0 where it does not decay: g + 0 is g
            tmp += g
            g = tmp
        if s.momentum:
            buf = a["momentum_buffer"]
            if step.count == 1:                       # torch: the buffer starts as the grad
                buf[...] = g
            else:
                buf *= s.momentum
                buf += g
            g = buf
        if g is tmp:                                  # w -= lr * g
            tmp *= step.lr
        else:
            xp.multiply(g, step.lr, out=tmp)
        w -= tmp
        self._refresh(a)

    def _scratch(self, a: dict, tmp):
        """The caller's scratch, or one made here (a device kernel needs none)."""
        w = a["master"]
        return self.xp.empty(w.shape, dtype=w.dtype) if tmp is None else tmp

    @staticmethod
    def _scaled(a: dict, step: UpdateStep):
        """(w, g), the gradient multiplied by the step's scale in place."""
        if step.grad_scale != 1.0:
            a["grad"] *= step.grad_scale
        return a["master"], a["grad"]

    @staticmethod
    def _refresh(a: dict) -> None:
        if "data" in a:          # a 16-bit compute copy follows its master weights
            a["data"][...] = a["master"]


def bias_corrections(b1: float, b2: float, count: int) -> tuple[float, float]:
    """AdamW's 1 - b1^t and sqrt(1 - b2^t) at step ``count``."""
    return 1.0 - b1 ** count, math.sqrt(1.0 - b2 ** count)
