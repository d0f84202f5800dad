"""What the CUDA kernels share: float conversions for every compute dtype, and one compiled
module per source, built on first use (CuPy caches the binary on disk)."""

from __future__ import annotations

from functools import lru_cache

import cupy

CONVERSIONS = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
// the sum of v over the block (blockDim.x a multiple of 32, at most 1024), on every thread
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();                      // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < (blockDim.x >> 5) ? partial[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}
"""

CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}


def cuda_type(dtype) -> str:
    return CUDA_TYPES[cupy.dtype(dtype).name]


@lru_cache(maxsize=None)
def module(source: str, names: tuple[str, ...]) -> cupy.RawModule:
    return cupy.RawModule(code=CONVERSIONS + source, options=("-std=c++17",),
                          name_expressions=list(names))


def row_threads(width: int) -> int:
    """Threads for a block that owns one row of ``width`` elements (a multiple of 32)."""
    return min(1024, max(32, 32 * ((width // 4 + 31) // 32)))
