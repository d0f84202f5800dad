"""RMSNorm, as Llama (and transformers) computes it:

    r = 1 / sqrt(mean(x^2) + eps)        over the hidden dimension, in float32 at least
    y = w * round(x r)                   x r rounded to the compute dtype, then times w

With the residual add fused in front (vLLM's ``fused_add_rms_norm``): s = x + residual in the
compute dtype, y = rms_norm(s); the sum is the next residual.

Backward, with x̂ = x r (float32) and g = dy w:
    dx = r (g - x̂ mean(g x̂))            dw = sum over rows of dy x̂
"""

from __future__ import annotations

from ..device.dtypes import at_least_float32


class RMSNorm:
    def __init__(self, xp):
        self.xp = xp

    def forward(self, x, w, eps: float):
        """y = rms_norm(x) * w, in x's dtype."""
        return self.forward_train(x, w, eps)[0]

    def add_forward(self, x, residual, w, eps: float):
        """(rms_norm(x + residual) * w, x + residual)."""
        s = x + residual
        return self.forward(s, w, eps), s

    def add_forward_train(self, x, residual, w, eps: float):
        """(rms_norm(x + residual) * w, x + residual, ctx) for ``backward``."""
        s = x + residual
        y, ctx = self.forward_train(s, w, eps)
        return y, s, ctx

    def forward_train(self, x, w, eps: float):
        """(y, ctx) where ctx = (x, r) is what ``backward`` needs."""
        xp = self.xp
        xf = at_least_float32(xp, x)
        squares = xp.einsum("...d,...d->...", xf, xf)[..., None]  # no x^2 temporary
        r = 1.0 / xp.sqrt(squares * (1.0 / x.shape[-1]) + eps)    # (..., 1) float32
        y = (xf * r).astype(x.dtype, copy=False)
        if y.dtype != w.dtype:
            return w * y, (x, r)
        y *= w
        return y, (x, r)

    def backward(self, dy, ctx, w):
        """(dx, dw) for y = forward(x, w); dw in float32 at least."""
        xp = self.xp
        x, r = ctx
        xhat = at_least_float32(xp, x) * r
        dyf = at_least_float32(xp, dy)
        dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
        g = dyf * at_least_float32(xp, w)
        dx = r * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
        return dx.astype(dy.dtype, copy=False), dw
