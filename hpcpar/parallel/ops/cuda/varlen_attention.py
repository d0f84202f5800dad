"""Attention over packed rows (``AttentionRows.documents``) through cuDNN's ragged form: each
document is one of cuDNN's sequences, found in the rows' memory by a ragged offset (the
element where it begins: row b's position p is at b * stride_row + p * stride_token), so the
rows' layout is read as it is and the padding between documents is never touched (the
"padded offsets" of TransformerEngine's THD layout). Causal within each sequence (top-left:
every document starts at its own position 0), per-sequence lengths as cuDNN's padding mask.

The sequences are padded to a power of two (empty ones at the end: length 0), so a graph
serves every step whose documents are as many or fewer; its max sequence length is the rows'
T. The softmax statistics the backward reads are (documents, heads, T, 1), not ragged.

Off until it has run on a GPU (``RAGGED``): packed rows take the reference there, exact and
slower. ``tests/test_ops_gpu.py`` turns it on for its check against the tiles'
(``benchmarks/gpu_check.sh`` runs it).
"""

from __future__ import annotations

from typing import NamedTuple

import cupy
import numpy as np

from ...device.backend import host_array
from ..attention import AttentionRows

RAGGED = False                   # packed rows on cuDNN: off until it has run on a GPU


class Sequences(NamedTuple):
    """The documents of packed rows as cuDNN's sequences (device int arrays): their lengths
    (n, 1, 1, 1) and the element offsets of their first token in each layout (n + 1, 1, 1,
    1): the queries', the keys' and values', and the contiguous outputs' and gradients'."""

    count: int                   # n: the documents, padded to a power of two
    lengths: object
    offsets: dict                # layout name -> offsets
    scale: float | None = None   # the scores' scale (None: 1/sqrt(d))


def documents(rows: AttentionRows) -> list[tuple[int, int, int]]:
    """(row, start, length) of each document of the rows, in order (host)."""
    starts = rows.documents.host
    lengths = host_array(rows.q_lengths)
    out = []
    for b in range(starts.shape[0]):
        n = int(lengths[b])
        firsts = np.flatnonzero(starts[b, :n] == np.arange(n))
        ends = np.append(firsts[1:], n)
        out += [(b, int(s), int(e - s)) for s, e in zip(firsts, ends)]
    return out


def sequences(rows: AttentionRows, layouts: dict) -> Sequences:
    """The rows' documents as cuDNN sequences; ``layouts``: name -> (row stride, token
    stride) in elements of each array read or written."""
    docs = documents(rows) or [(0, 0, 0)]                  # (no document: one empty)
    count = 1 << max(len(docs) - 1, 0).bit_length()
    lengths = np.zeros((count, 1, 1, 1), np.int32)
    lengths[:len(docs), 0, 0, 0] = [n for _, _, n in docs]
    offsets = {}
    for name, (row, token) in layouts.items():
        at = np.array([b * row + s * token for b, s, _ in docs]
                      + [docs[-1][0] * row + (docs[-1][1] + docs[-1][2]) * token], np.int64)
        padded = np.full((count + 1, 1, 1, 1), at[-1], np.int64)
        padded[:len(docs), 0, 0, 0] = at[:-1]
        offsets[name] = cupy.asarray(padded)
    return Sequences(count, cupy.asarray(lengths), offsets, rows.scale)


def layout(a, token_axis: int, head_axis: int) -> tuple[int, int, int]:
    """(row stride, token stride, head stride) of ``a`` in elements."""
    item = a.itemsize
    return a.strides[0] // item, a.strides[token_axis] // item, a.strides[head_axis] // item


def build(cudnn, handle, kind: str, q, keys, count: int, scale: float):
    """The graph of ``kind`` (forward, forward_train, backward) over ``count`` sequences of at
    most T positions, q (B, T, heads, d) and keys (B, kv, S, d) with their own strides, the
    outputs contiguous as (B, T, heads, d) and (B, S, kv, d). Returns (graph, tensors)."""
    io = {"float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16}[q.dtype.name]
    B, T, nh, hd = q.shape
    nkv = keys.shape[1]
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    t: dict = {}

    def tensor(name, dims, strides, dtype=io):
        t[name] = g.tensor(name=name, dim=dims, stride=strides, data_type=dtype)
        return t[name]

    def offsets(name):
        if name not in t:
            tensor(name, [count + 1, 1, 1, 1], [1, 1, 1, 1], cudnn.data_type.INT64)
        return t[name]

    def shape(heads, token, head):           # [sequences, heads, T, d]; the row stride is
        return [count, heads, T, hd], [T * token, head, token, 1]   # the offsets' business

    def ragged_in(name, heads, token, head, where):
        x = tensor(name, *shape(heads, token, head))
        x.set_ragged_offset(offsets(where))
        return x

    def ragged_out(x, heads, token, where):
        dims, strides = shape(heads, token, hd)
        x.set_output(True).set_dim(dims).set_stride(strides).set_data_type(io)
        x.set_ragged_offset(offsets(where))

    _, qt, qh = layout(q, 1, 2)
    _, kt, kh = layout(keys, 2, 1)
    q_ = ragged_in("q", nh, qt, qh, "at_q")
    k_ = ragged_in("k", nkv, kt, kh, "at_kv")
    v_ = ragged_in("v", nkv, kt, kh, "at_kv")
    seq = tensor("seq", [count, 1, 1, 1], [1, 1, 1, 1], cudnn.data_type.INT32)
    mask = dict(use_causal_mask=True, use_padding_mask=True, seq_len_q=seq, seq_len_kv=seq)
    if kind == "backward":
        o = ragged_in("o", nh, nh * hd, hd, "at_o")
        do = ragged_in("do", nh, nh * hd, hd, "at_o")
        stats = tensor("stats", [count, nh, T, 1], [nh * T, T, 1, 1], cudnn.data_type.FLOAT)
        dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=q_, k=k_, v=v_, o=o, dO=do,
                                     stats=stats, attn_scale=scale, **mask)
        ragged_out(dq, nh, nh * hd, "at_o")
        ragged_out(dk, nkv, nkv * hd, "at_dkv")
        ragged_out(dv, nkv, nkv * hd, "at_dkv")
        t.update(dq=dq, dk=dk, dv=dv)
    else:
        training = kind == "forward_train"
        o, stats = g.sdpa(name="sdpa", q=q_, k=k_, v=v_, attn_scale=scale,
                          generate_stats=training, **mask)
        ragged_out(o, nh, nh * hd, "at_o")
        t["o"] = o
        if training:
            stats.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(
                [count, nh, T, 1]).set_stride([nh * T, T, 1, 1])
            t["stats"] = stats
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return g, t


class RaggedContext(NamedTuple):
    """What the ragged backward needs: the inputs, the output, the statistics, the sequences."""

    q: object
    keys: object
    values: object
    out: object
    stats: object                # (documents, heads, T, 1) float32
    sequences: Sequences


def run_forward(op, q, keys, values, rows: AttentionRows, training: bool):
    """(out (B, T, heads, d), RaggedContext or None) through the cached graph of ``op``
    (a ``CudnnAttention``): zeros where no document is (padding)."""
    T, nh = q.shape[1], q.shape[2]
    seqs = _sequences(rows, q, keys)
    kind = "forward_train" if training else "forward"
    graph = op._ragged_graph(kind, q, keys, values, seqs.count, rows.scale)
    out = cupy.zeros(q.shape, dtype=q.dtype)
    arrays = {"q": q, "k": keys, "v": values, "o": out, "seq": seqs.lengths, **seqs.offsets}
    stats = None
    if training:
        stats = arrays["stats"] = cupy.zeros((seqs.count, nh, T, 1), dtype=cupy.float32)
    graph.run(op._handle_now(), arrays)
    ctx = RaggedContext(q, keys, values, out, stats, seqs) if training else None
    return out, ctx


def run_backward(op, dout, ctx: RaggedContext):
    """(dq (B, T, heads, d), dk, dv (B, kv, S, d)) of the ragged forward ``ctx``."""
    q, keys, values, out, stats, seqs = ctx
    B, S, nkv, hd = keys.shape[0], keys.shape[2], keys.shape[1], keys.shape[3]
    graph = op._ragged_graph("backward", q, keys, values, seqs.count, seqs.scale)
    dq = cupy.zeros(q.shape, dtype=q.dtype)
    dk = cupy.zeros((B, S, nkv, hd), dtype=q.dtype)
    dv = cupy.zeros((B, S, nkv, hd), dtype=q.dtype)
    graph.run(op._handle_now(), {"q": q, "k": keys, "v": values, "o": out,
                                 "do": cupy.ascontiguousarray(dout), "stats": stats,
                                 "dq": dq, "dk": dk, "dv": dv, "seq": seqs.lengths,
                                 **seqs.offsets})
    return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


def _sequences(rows: AttentionRows, q, keys) -> Sequences:
    """The rows' sequences for these layouts, made once per rows and layout (every layer of
    a step has the same)."""
    B, T, nh, hd = q.shape
    nkv = keys.shape[1]
    qr, qt, _ = layout(q, 1, 2)
    kr, kt, _ = layout(keys, 2, 1)
    layouts = {"at_q": (qr, qt), "at_kv": (kr, kt), "at_o": (T * nh * hd, nh * hd),
               "at_dkv": (keys.shape[2] * nkv * hd, nkv * hd)}
    key = ("ragged", tuple(sorted(layouts.items())))
    return rows.cached(key, lambda: sequences(rows, layouts))
