"""Y = X W^T as one GEMM over the flattened rows.

Weights are held transposed, W^T of shape [in, out] (contiguous for inference: on the CPU a
transposed operand costs ~20% at decode sizes; a training parameter's ``data.T`` view works
too); a host generation's are ``BlockedMatrix``es, multiplied by ``blocked_linear`` (a
decode step's few rows read them at the memory's rate). The backward halves: dX = dY W
(``linear_input_grad``) and dW = dY^T X (the training ``GradSink.outer``, which may defer it
to a zero-bubble W pass). A GEMM runs at the hardware's peak through cuBLAS already (CuPy's
2-D ``@``: 803 TFLOP/s bf16 on an H100), so there is no device override.
"""

from __future__ import annotations

import numpy as np


def linear(x, weight_t):
    """x (..., in) @ weight_t (in, out) -> (..., out), as a single 2-D GEMM."""
    lead = x.shape[:-1]
    return _gemm(x.reshape(-1, x.shape[-1]), weight_t).reshape(lead + (weight_t.shape[1],))


def linear_input_grad(dy, weight_t):
    """dX = dY W for Y = X W^T: dy (..., out) -> (..., in)."""
    lead = dy.shape[:-1]
    return (dy.reshape(-1, dy.shape[-1]) @ weight_t.T).reshape(lead + (weight_t.shape[0],))


def _gemm(a, b):
    """a @ b in the operands' dtype, as cuBLAS gives it: NumPy multiplies bfloat16
    (ml_dtypes') in float32 and returns that, and the cast the caller then makes would be a
    second output in the device budget (``layers.product`` casts to the weight's dtype: the
    same values)."""
    return (a @ b).astype(np.result_type(a.dtype, b.dtype), copy=False)


# OpenBLAS multiplies without packing its operands (its small-matrix kernel, float32) while
# rows x in x out stays under about 96**3; above, it packs the whole weight at every call,
# and a decode step's few rows then read the weight at a quarter of the memory's rate.
SMALL_PRODUCT = 96 ** 3
DECODE_ROWS = 8     # the rows a block's product keeps in that kernel (a prefill: tiles of 8)
BLOCK = 32          # decode's fastest width at 1-8 rows (64: 5-20% slower); prefill's as fast


def block_width(features_in: int) -> int:
    """The output features per block of a ``BlockedMatrix`` with ``features_in`` inputs:
    ``BLOCK`` where a block times ``DECODE_ROWS`` rows runs unpacked (up to 3456 inputs),
    else 0: the matrix stays as it is (16 wide blocks would speed a decode step, but slow a
    prefill's products by a third)."""
    return BLOCK if DECODE_ROWS * features_in * BLOCK <= SMALL_PRODUCT else 0


class BlockedMatrix:
    """A frozen host matrix W [out, in] held as blocks of ``width`` output features, each
    [in, width] contiguous (``blocks``, [out // width, in, width]), the last out % width rows
    as they are (``tail``). A product of a few rows multiplies each block in OpenBLAS's
    small-matrix kernel, which reads it once, in order: 2.5-3x one ``x @ W.T`` at 8 rows, near
    the memory's rate (``blocked_linear``). It stands for W where the model reads its shape,
    dtype or bytes, or rows of it (a tied embedding's lookup)."""

    def __init__(self, w, width: int):
        out, k = w.shape
        whole = out // width * width
        self.width, self.shape, self.dtype, self.ndim = width, (out, k), w.dtype, 2
        self.blocks = np.ascontiguousarray(w[:whole].reshape(-1, width, k).transpose(0, 2, 1))
        self.tail = w[whole:].copy()        # a copy even when empty: no hold on w

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.tail.nbytes

    def __getitem__(self, rows):
        """W[rows] for integer ``rows`` >= 0 (an array, or one): a new (*rows.shape, in)
        array (indexed by a 1-D array: a copy, never a view of the blocks)."""
        rows = np.asarray(rows)
        flat, whole = rows.reshape(-1), len(self.blocks) * self.width
        inside = flat < whole
        if whole:
            block, col = np.divmod(np.where(inside, flat, 0), self.width)
            out = self.blocks[block, :, col]
        else:
            out = np.empty((len(flat), self.shape[1]), dtype=self.dtype)
        out[~inside] = self.tail[flat[~inside] - whole]
        return out.reshape(rows.shape + (self.shape[1],))


def blocked_linear(x, m: BlockedMatrix):
    """x (..., in) @ W.T -> (..., out) for W a ``BlockedMatrix``: batched matmuls of tiles of
    ``DECODE_ROWS`` rows by blocks, each in the small-matrix kernel, writing its piece of the
    output in place (a prefill's many rows too: block by block, each block read from cache
    once per tile, as fast as one packed GEMM), and the tail's product. Each output is the
    same dot product as in ``linear``, in the same precision."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    rows, width, blocks = x2.shape[0], m.width, len(m.blocks)
    whole = blocks * width
    out = np.empty((rows, m.shape[0]), dtype=np.result_type(x.dtype, m.dtype))
    tiled = rows // DECODE_ROWS * DECODE_ROWS if rows > DECODE_ROWS else 0
    if tiled:      # out[tiles, DECODE_ROWS, blocks, width] as [blocks, tiles, ...]: views
        tiles = tiled // DECODE_ROWS
        by_tile = out[:tiled, :whole].reshape(tiles, DECODE_ROWS, blocks, width)
        np.matmul(x2[:tiled].reshape(1, tiles, DECODE_ROWS, k), m.blocks[:, None],
                  out=by_tile.transpose(2, 0, 1, 3))
    if rows > tiled:
        by_block = out[tiled:, :whole].reshape(rows - tiled, blocks, width)
        np.matmul(x2[tiled:], m.blocks, out=by_block.transpose(1, 0, 2))
    if len(m.tail):
        np.matmul(x2, m.tail.T, out=out[:, whole:])
    return out.reshape(lead + (m.shape[0],))


class Linear:
    """The op form of ``linear``, so that a device can plan its GEMMs (``ops/cuda/linear``:
    planned cuBLASLt matmuls, which a CUDA graph can capture; CuPy's cuBLAS calls cannot)."""

    def __init__(self, xp):
        self.xp = xp

    def forward(self, x, weight_t):
        return linear(x, weight_t)

    def input_grad(self, dy, weight_t):
        return linear_input_grad(dy, weight_t)
