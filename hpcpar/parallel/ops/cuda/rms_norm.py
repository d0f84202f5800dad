"""RMSNorm (with the residual add fused in front) and its input gradient: one block per row,
the sum of squares reduced in float32, one pass to write. Replaces 6 (8 with the add) array
operations of the reference, each a full pass over the activations."""

from __future__ import annotations

import cupy

from ..rms_norm import RMSNorm
from .kernels import cuda_type, module, row_threads

SOURCE = r"""
template <typename T, bool ADD>
__global__ void rms_norm(const T* __restrict__ x, const T* __restrict__ residual,
                         T* __restrict__ sum_out, const T* __restrict__ w, T* __restrict__ y,
                         float* __restrict__ r_out, int width, float eps) {
  const long long base = (long long)blockIdx.x * width;
  float acc = 0.f;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    float v = to_f(x[base + i]);
    if (ADD) {
      const T s = from_f<T>(v + to_f(residual[base + i]));   // the sum, in the compute dtype
      sum_out[base + i] = s;
      v = to_f(s);
    }
    acc += v * v;
  }
  const float r = 1.0f / sqrtf(block_sum(acc) / width + eps);
  if (threadIdx.x == 0) r_out[blockIdx.x] = r;
  const T* src = ADD ? sum_out : x;        // this thread wrote these elements itself
  for (int i = threadIdx.x; i < width; i += blockDim.x)
    y[base + i] = from_f<T>(to_f(w[i]) * to_f(from_f<T>(to_f(src[base + i]) * r)));
}

template <typename T>
__global__ void rms_norm_backward(const T* __restrict__ dy, const T* __restrict__ x,
                                  const T* __restrict__ w, const float* __restrict__ r,
                                  T* __restrict__ dx, int width) {
  const long long base = (long long)blockIdx.x * width;
  const float rr = r[blockIdx.x];
  float acc = 0.f;
  for (int i = threadIdx.x; i < width; i += blockDim.x)
    acc += to_f(dy[base + i]) * to_f(w[i]) * to_f(x[base + i]) * rr;
  const float mean = block_sum(acc) / width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    const float g = to_f(dy[base + i]) * to_f(w[i]);
    dx[base + i] = from_f<T>(rr * (g - to_f(x[base + i]) * rr * mean));
  }
}
"""

_TYPES = ("float", "__half", "__nv_bfloat16")
_NAMES = tuple([f"rms_norm<{t}, {a}>" for t in _TYPES for a in ("true", "false")]
               + [f"rms_norm_backward<{t}>" for t in _TYPES])


def _kernel(name: str):
    return module(SOURCE, _NAMES).get_function(name)


class RMSNormCuda(RMSNorm):
    def _run(self, x, residual, w, eps):
        x = cupy.ascontiguousarray(x)
        width = x.shape[-1]
        rows = x.size // width
        y = cupy.empty_like(x)
        r = cupy.empty(x.shape[:-1] + (1,), dtype=cupy.float32)
        add = residual is not None
        total = cupy.empty_like(x) if add else y
        residual = cupy.ascontiguousarray(residual) if add else x
        kernel = _kernel(f"rms_norm<{cuda_type(x.dtype)}, {'true' if add else 'false'}>")
        kernel((rows,), (row_threads(width),),
               (x, residual, total, cupy.ascontiguousarray(w.astype(x.dtype, copy=False)), y,
                r, cupy.int32(width), cupy.float32(eps)))
        return y, total, r

    def forward(self, x, w, eps: float):
        return self._run(x, None, w, eps)[0]

    def add_forward(self, x, residual, w, eps: float):
        y, total, _ = self._run(x, residual, w, eps)
        return y, total

    def forward_train(self, x, w, eps: float):
        x = cupy.ascontiguousarray(x)
        y, _, r = self._run(x, None, w, eps)
        return y, (x, r)

    def backward(self, dy, ctx, w):
        x, r = ctx
        dy = cupy.ascontiguousarray(dy)
        width = x.shape[-1]
        dx = cupy.empty_like(dy)
        _kernel(f"rms_norm_backward<{cuda_type(dy.dtype)}>")(
            (x.size // width,), (row_threads(width),),
            (dy, x, cupy.ascontiguousarray(w.astype(dy.dtype, copy=False)), r, dx,
             cupy.int32(width)))
        xhat = x.astype(cupy.float32) * r
        dw = (dy.astype(cupy.float32) * xhat).reshape(-1, width).sum(axis=0)
        return dx, dw
