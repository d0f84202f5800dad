"""The KV-cache write of a decode step as one kernel over k and v together (the reference's
advanced-index scatter is five launches and 0.38 ms per layer at B 16 on an H100, launch-
bound; this is one launch)."""

from __future__ import annotations

import cupy

from ..kv_write import KVWrite

_write = cupy.ElementwiseKernel(
    "T k, T v, raw int32 starts, int32 steps, int32 heads, int32 dim, int32 capacity",
    "raw T cache_k, raw T cache_v",
    """
    const int d = i % dim, h = (i / dim) % heads, t = (i / (dim * heads)) % steps;
    const long long b = i / ((long long)dim * heads * steps);
    const long long at = ((b * heads + h) * capacity + starts[b] + t) * dim + d;
    cache_k[at] = k;
    cache_v[at] = v;
    """, "hpcpar_kv_write")


class KVWriteCuda(KVWrite):
    def forward(self, cache_k, cache_v, k, v, starts, from_start: bool) -> None:
        if (from_start or k.shape != v.shape       # (latent attention's: keys alone)
                or not (cache_k.flags.c_contiguous and cache_v.flags.c_contiguous)):
            return super().forward(cache_k, cache_v, k, v, starts, from_start)
        B, T, heads, dim = k.shape
        _write(k, v, starts.astype(cupy.int32, copy=False), cupy.int32(T), cupy.int32(heads),
               cupy.int32(dim), cupy.int32(cache_k.shape[2]), cache_k, cache_v)
