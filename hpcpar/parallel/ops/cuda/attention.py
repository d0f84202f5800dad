"""Attention through cuDNN's fused flash attention (``nvidia-cudnn-frontend``): scores and
softmax in float32 inside the kernel, GQA, causal, per-row lengths through cuDNN's padding
mask (``seq_len_q`` / ``seq_len_kv``). One graph per shape and stride pattern, built once and
cached. Measured on an H100 (B 16, T 512, d 64, causal): 0.086 ms against 6.05 ms for the
reference's three passes (../shared/notes/gpu-h100.md).

cuDNN takes half-precision inputs only: float32 runs the reference (it is the exact mode
parity checks use).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import cupy

from ...errors import HpcparError
from ..attention import Attention, AttentionRows
from . import varlen_attention as varlen

_CUDNN_DTYPES = ("float16", "bfloat16")
# scores rescaled by ``AttentionRows.scale`` (latent attention's, Gemma 2's without a cap)
# through cuDNN's attn_scale, for heads of at most MAX_FUSED_DIM: off until it has run on a
# GPU (``tests/test_ops_gpu.py``, ``benchmarks/gpu_check.sh``); the reference until then
SCALED = False
MAX_FUSED_DIM = 256


def _cudnn():
    try:
        import cudnn
    except ImportError as e:
        raise HpcparError(f"half-precision attention on the GPU needs cuDNN's frontend ({e}); "
                          "pip install nvidia-cudnn-frontend (hpcpar[gpu-cuda12] or "
                          "[gpu-cuda13] bring it), or use --dtype float32") from None
    return cudnn


def _dims_strides(a, order):
    """cuDNN's (dims, strides in elements) of array ``a`` viewed with its axes in ``order``."""
    item = a.itemsize
    return [a.shape[i] for i in order], [a.strides[i] // item for i in order]


class FusedContext(NamedTuple):
    """What cuDNN's backward needs: the inputs, the output and the softmax statistics."""

    q: object
    keys: object
    values: object
    out: object
    stats: object               # (B, heads, T, 1) float32: max + log(sum of exps) per query
    rows: AttentionRows
    causal: bool


class _Graph:
    """One built cuDNN graph, its tensors' uids by name, and a workspace."""

    def __init__(self, graph, tensors: dict, workspace):
        self.graph, self.workspace = graph, workspace
        self.names = tuple(tensors)
        self.uids = tuple(tensors[name].get_uid() for name in self.names)

    def run(self, handle, arrays: dict) -> None:
        # the ordered form (pointers in uid order) costs half the host time of a dict:
        # 0.069 against 0.127 ms per call, measured on an H100 (decode is launch-bound)
        _cudnn().set_stream(handle, cupy.cuda.get_current_stream().ptr)
        pointers = tuple(arrays[name].data.ptr for name in self.names)
        self.graph.execute(pointers, self.workspace, handle=handle, tensor_uids=self.uids)


# Built graphs outlive one job's ops (a process runs several jobs in tests and benchmarks;
# a graph takes ~35 ms to build); one cuDNN handle per process, which owns one GPU.
_GRAPHS: dict = {}
_HANDLE: list = []


class CudnnAttention(Attention):
    ragged = varlen.RAGGED          # packed rows through cuDNN's ragged form (else the reference)

    def __init__(self, xp):
        super().__init__(xp)
        self._graphs = _GRAPHS

    def _handle_now(self):
        if not _HANDLE:
            _HANDLE.append(_cudnn().create_handle())
        return _HANDLE[0]

    # ---- graphs ---------------------------------------------------------------------------

    def _graph(self, kind: str, q, keys, values, causal: bool, extra=(), scale=None):
        key = (kind, q.dtype.name, q.shape, q.strides, keys.shape, keys.strides,
               values.strides, causal, scale) + tuple(extra)
        built = self._graphs.get(key)
        if built is None:
            built = self._build(kind, q, keys, values, causal, scale)
            self._graphs[key] = built
        return built

    def _build(self, kind: str, q, keys, values, causal: bool, scale=None) -> _Graph:
        cudnn = _cudnn()
        io = {"float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16}[q.dtype.name]
        B, T, nh, hd = q.shape
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self._handle_now())
        t = {}

        def tensor(name, dims, strides, dtype=io):
            t[name] = g.tensor(name=name, dim=dims, stride=strides, data_type=dtype)
            return t[name]

        q_dims, q_strides = _dims_strides(q, (0, 2, 1, 3))          # (B, heads, T, d)
        qt = tensor("q", q_dims, q_strides)
        kt = tensor("k", *_dims_strides(keys, (0, 1, 2, 3)))        # (B, kv, S, d)
        vt = tensor("v", *_dims_strides(values, (0, 1, 2, 3)))
        seq_q = tensor("seq_q", [B, 1, 1, 1], [1, 1, 1, 1], cudnn.data_type.INT32)
        seq_kv = tensor("seq_kv", [B, 1, 1, 1], [1, 1, 1, 1], cudnn.data_type.INT32)
        o_strides = [T * nh * hd, hd, nh * hd, 1]                   # o stored (B, T, heads, d)
        scale = 1.0 / math.sqrt(hd) if scale is None else scale
        mask = dict(use_causal_mask=causal, use_padding_mask=True, seq_len_q=seq_q,
                    seq_len_kv=seq_kv)
        training = kind != "forward"
        if kind == "backward":
            ot = tensor("o", q_dims, o_strides)
            dot = tensor("do", q_dims, o_strides)
            stats = tensor("stats", [B, nh, T, 1], [nh * T, T, 1, 1], cudnn.data_type.FLOAT)
            dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=qt, k=kt, v=vt, o=ot, dO=dot,
                                         stats=stats, attn_scale=scale, **mask)
            dq.set_output(True).set_dim(q_dims).set_stride(o_strides).set_data_type(io)
            S, nkv = keys.shape[2], keys.shape[1]
            kv_strides = [S * nkv * hd, hd, nkv * hd, 1]              # stored (B, S, kv, d)
            for name, out in (("dq", dq), ("dk", dk), ("dv", dv)):
                if name != "dq":
                    out.set_output(True).set_dim([B, nkv, S, hd]).set_stride(
                        kv_strides).set_data_type(io)
                t[name] = out
        else:
            o, stats = g.sdpa(name="sdpa", q=qt, k=kt, v=vt, attn_scale=scale,
                              generate_stats=training, **mask)
            o.set_output(True).set_dim(q_dims).set_stride(o_strides).set_data_type(io)
            t["o"] = o
            if training:
                stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
                t["stats"] = stats
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        workspace = cupy.empty(max(g.get_workspace_size(), 1), dtype=cupy.uint8)
        return _Graph(g, t, workspace)

    def _ragged_graph(self, kind: str, q, keys, values, count: int, scale=None) -> _Graph:
        """The ragged graph of packed rows' ``count`` sequences (``varlen_attention``)."""
        key = ("ragged", kind, q.dtype.name, q.shape, q.strides, keys.shape, keys.strides,
               values.strides, count, scale)
        built = self._graphs.get(key)
        if built is None:
            g, tensors = varlen.build(_cudnn(), self._handle_now(), kind, q, keys, count,
                                      1.0 / math.sqrt(q.shape[3]) if scale is None else scale)
            workspace = cupy.empty(max(g.get_workspace_size(), 1), dtype=cupy.uint8)
            built = self._graphs[key] = _Graph(g, tensors, workspace)
        return built

    # ---- the op ---------------------------------------------------------------------------

    def _lengths(self, rows: AttentionRows):
        return rows.q_lengths.reshape(-1, 1, 1, 1), rows.kv_lengths.reshape(-1, 1, 1, 1)

    def _fused(self, q, rows: AttentionRows | None = None) -> bool:
        """cuDNN serves half precision, and (its causal mask being top-left aligned) either
        one query per row or queries from position 0; anything else runs the reference."""
        if q.dtype.name not in _CUDNN_DTYPES:
            return False
        if rows is not None and (rows.window is not None or rows.softcap is not None
                                 or (rows.scale is not None
                                     and not (SCALED and q.shape[-1] <= MAX_FUSED_DIM))):
            return False      # no sliding-window or soft-capped graph yet (rescaled: SCALED)
        if rows is not None and rows.documents is not None and not self.ragged:
            return False      # packed rows: the ragged graphs have not run on a GPU yet
        return rows is None or q.shape[1] == 1 or rows.from_start

    def forward(self, q, keys, values, rows: AttentionRows):
        if not self._fused(q, rows):
            if cupy.cuda.get_current_stream().is_capturing():
                raise HpcparError(
                    f"attention in {q.dtype.name}{' over a sliding window' if rows.window else ''}"
                    " runs the reference, whose matmuls CUDA-graph capture refuses: use "
                    "--dtype bfloat16 or float16 (cuDNN's kernel), or run without --cuda-graphs")
            return super().forward(q, keys, values, rows)
        if rows.documents is not None:
            return self._packed(q, keys, values, rows, training=False)[0]
        causal = q.shape[1] > 1
        if rows.from_start:           # prefill reads its own T keys: one graph per (B, T)
            keys, values = keys[:, :, :q.shape[1]], values[:, :, :q.shape[1]]
        graph = self._graph("forward", q, keys, values, causal, scale=rows.scale)
        # zeros: cuDNN leaves the rows past a row's length alone, and they must stay finite
        out = cupy.zeros(q.shape, dtype=q.dtype)
        seq_q, seq_kv = self._lengths(rows)
        graph.run(self._handle_now(), {"q": q, "k": keys, "v": values, "o": out,
                                       "seq_q": seq_q, "seq_kv": seq_kv})
        return out

    def forward_train(self, q, keys, values, rows: AttentionRows):
        if not self._fused(q, rows):
            return super().forward_train(q, keys, values, rows)
        if rows.documents is not None:
            return self._packed(q, keys, values, rows, training=True)
        causal = q.shape[1] > 1
        graph = self._graph("forward_train", q, keys, values, causal, scale=rows.scale)
        B, T, nh, _ = q.shape
        out = cupy.zeros(q.shape, dtype=q.dtype)
        stats = cupy.zeros((B, nh, T, 1), dtype=cupy.float32)
        seq_q, seq_kv = self._lengths(rows)
        graph.run(self._handle_now(), {"q": q, "k": keys, "v": values, "o": out,
                                       "stats": stats, "seq_q": seq_q, "seq_kv": seq_kv})
        return out, FusedContext(q, keys, values, out, stats, rows, causal)

    def _packed(self, q, keys, values, rows: AttentionRows, training: bool):
        """Packed rows through the ragged graphs: the rows' own T keys, the keys' and
        values' layouts alike (the views of one (B, T, kv, d) layout training passes)."""
        keys, values = keys[:, :, :q.shape[1]], values[:, :, :q.shape[1]]
        if keys.strides != values.strides or keys.shape != values.shape:
            return (super().forward_train(q, keys, values, rows) if training else
                    (super().forward(q, keys, values, rows), None))
        return varlen.run_forward(self, q, keys, values, rows, training)

    def backward(self, dout, ctx):
        if isinstance(ctx, varlen.RaggedContext):
            return varlen.run_backward(self, dout, ctx)
        if not isinstance(ctx, FusedContext):
            return super().backward(dout, ctx)
        q, keys, values, out, stats, rows, causal = ctx
        dout = cupy.ascontiguousarray(dout)
        graph = self._graph("backward", q, keys, values, causal, scale=rows.scale)
        B, S, nkv, hd = keys.shape[0], keys.shape[2], keys.shape[1], keys.shape[3]
        dq = cupy.zeros(q.shape, dtype=q.dtype)
        dk = cupy.zeros((B, S, nkv, hd), dtype=q.dtype)
        dv = cupy.zeros((B, S, nkv, hd), dtype=q.dtype)
        seq_q, seq_kv = self._lengths(rows)
        graph.run(self._handle_now(), {"q": q, "k": keys, "v": values, "o": out, "do": dout,
                                       "stats": stats, "dq": dq, "dk": dk, "dv": dv,
                                       "seq_q": seq_q, "seq_kv": seq_kv})
        return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)
