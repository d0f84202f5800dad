"""Megatron's tensor-parallel layers, for any model: generation and training alike.

Notation: a linear layer computes Y = X A^T + b with A of shape [out, in] (Hugging Face's and
torch's orientation). p is the tp size, i this rank. The communication is Megatron's two
conjugate operators (``mappings``): f (identity forward, AllReduce backward) and g (AllReduce
forward, identity backward). Every layer has both halves: ``forward`` / ``__call__`` and
``backward``, which returns the input gradient and hands weight gradients to a ``GradSink``
(added at once, or deferred to a zero-bubble schedule's W pass). X of shape (B, T, ...) is
flattened to N = B*T rows for every product.

Weights are objects with a ``data`` array in [out, in] orientation, read at every call (an
optimizer may move it): a ``Parameter`` (training), or a ``Frozen`` weight (inference), whose
matrices are laid out as ``stored_matrix`` says: on the host transposed, [in, out] and
contiguous, so that the product's operand ``data.T`` is (NumPy's BLAS runs a transposed
operand ~20% slower at decode sizes); on a device [out, in] itself (cuBLAS takes the
transposed operand at full speed, and loading fills each row block with one upload). A host
generation's stage then holds them as ``ops.linear.BlockedMatrix``es (``block_frozen``),
whose products read them at the memory's rate. Inference may merge the projections that
read the same input (q/k/v, gate/up) into one GEMM, as vLLM's QKVParallelLinear does.
``from_full`` builds a layer from the whole weight, each rank keeping its slice; the
constructors take this rank's shards.

The products, lookups and the cross-entropy's local pieces are ``hpcpar.parallel.ops`` (a NumPy
reference, or a device kernel chosen once per backend); ``ops`` defaults to the references.

Sequence parallelism (Megatron's, Korthikanti et al. 2022): with ``sequence_axis`` set, the
activations outside a column/row pair are split along that axis over tp (each rank holds
its own positions). The column layer then AllGathers its input along the sequence
(backward: ReduceScatter of dX) and the row layer ReduceScatters its output (backward:
AllGather of dY), in place of f and g; the pair's communication volume is the same as the
AllReduce's, and what lies between pairs (norms, residual adds) is 1/p as large. The column
layer keeps its input split and gathers it again in backward for dW (Megatron does the
same). A replicated weight that reads the split activations (a norm's) then has a gradient
that is a partial sum over tp: sum it (``Parameter(partial_grad=True)``,
``sum_partial_grads``).

A weight may carry a LoRA adapter (``LoraAdapter``, in its ``lora``): the layer then adds
s (X A^T) B^T to that weight's product, with A [r, in] and B [out, r] split as the base
(Hu et al. 2021, peft's ``LoraLayer``). Column-parallel base: A replicated, B_i the rows of
the base's A_i; row-parallel base: A_i the base's columns, B replicated. No communication
of its own: the column layer's dX AllReduce and the row layer's output AllReduce carry the
adapter's share, and the replicated half's gradient is a partial sum over tp (A of a
column-parallel base, B of a row-parallel one), which its owner sums as it sums other
tp-partial gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..tensor import splits
from ..comm import Communicator
from ..errors import HpcparError
from .mappings import CopyToGroup, GatherFromGroup, ReduceFromGroup, ReduceScatterToGroup
from ..ops import Ops, native_ops
from ..ops.linear import BlockedMatrix, block_width, blocked_linear
from ..params import GradSink, Parameter, join


@dataclass(eq=False)
class LoraAdapter:
    """A low-rank update of a weight W [out, in]: W x + s B A x, ``A`` [r, in] and ``B``
    [out, r] (this rank's pieces: ``Parameter``s, or ``Frozen``), s = ``scale`` (peft's
    lora_alpha / r)."""

    A: object
    B: object
    scale: float


@dataclass(eq=False)
class Frozen:
    """A weight without a gradient (generation, or a LoRA run's base): ``data`` in Hugging
    Face's orientation. Loading may have placed it in ``stack`` (the [rows, in] view of a
    ``stored_matrix`` it shares with the projections merged with it) at row ``start``:
    merging it is then free. ``lora``: an adapter the layers add (unmerged layers only)."""

    data: object
    stack: object = None
    start: int = 0
    lora: LoraAdapter | None = None


def stored_matrix(xp, rows: int, cols: int, dtype):
    """An empty frozen matrix [rows, cols] as the products read it fastest, given as its
    [rows, cols] view: on the host stored transposed ([cols, rows] contiguous: ``data.T`` is a
    contiguous operand), on a device as it is (the transposed operand costs cuBLAS nothing,
    and each row block is contiguous: one upload fills it)."""
    if xp is np:
        return np.empty((cols, rows), dtype=dtype).T
    return xp.empty((rows, cols), dtype=dtype)


def _in_layout(xp, a) -> bool:
    """Whether ``a`` [rows, cols] is laid out as ``stored_matrix`` lays out a matrix."""
    return bool((a.T if xp is np else a).flags.c_contiguous)


def frozen_matrix(xp, weights: list) -> Frozen:
    """The ``Frozen`` weights' [out_k, in] blocks stacked along out, in ``stored_matrix``'s
    layout. Blocks that loading placed one after another in one matrix (``Frozen.stack``) are
    that matrix, and one block already in the layout is itself: nothing is copied, so
    loading holds each weight once. Others are copied once, each straight into its place
    (no merged copy on the way); the caller drops them."""
    stack = _placed(weights)
    if stack is not None:
        return Frozen(stack)
    blocks = [w.data for w in weights]
    if len(blocks) == 1 and _in_layout(xp, blocks[0]):
        return Frozen(blocks[0])
    out = stored_matrix(xp, sum(b.shape[0] for b in blocks), blocks[0].shape[1], blocks[0].dtype)
    at = 0
    for block in blocks:
        out[at:at + block.shape[0]] = block
        at += block.shape[0]
    return Frozen(out)


def _placed(weights: list):
    """The stack that ``weights`` fill whole, one after another from its first row; else
    None."""
    stack, at = weights[0].stack, 0
    for w in weights:
        if stack is None or w.stack is not stack or w.start != at:
            return None
        at += w.data.shape[0]
    return stack if at == stack.shape[0] else None


def _rows(a):
    """(..., k) -> (N, k), a view."""
    return a.reshape(-1, a.shape[-1])


def product(ops: Ops, x, w):
    """X W^T in the weight's dtype."""
    if isinstance(w.data, BlockedMatrix):          # the host's generation (``block_frozen``)
        return blocked_linear(x, w.data)
    return ops.linear.forward(x, w.data.T).astype(w.data.dtype, copy=False)


def block_frozen(w) -> None:
    """A host generation's weight ``w`` as a ``BlockedMatrix``, in place of its array: a
    ``Frozen`` float32 matrix without an adapter, with few enough input features
    (``block_width``). Others stay as they are. The array is dropped: held once."""
    a = getattr(w, "data", None)
    if (type(w) is not Frozen or w.lora is not None or type(a) is not np.ndarray
            or a.ndim != 2 or a.dtype != np.float32):
        return
    width = block_width(a.shape[1])
    if width and a.shape[0] >= width:
        w.data, w.stack, w.start = BlockedMatrix(a, width), None, 0


def weight_grads(ops: Ops, dy, x, w, b, sink) -> object:
    """dW = dY^T X, db = sum of dY over rows (of ``Parameter``s: a ``Frozen`` weight takes
    none); returns dX = dY W."""
    dy2 = _rows(dy)
    if isinstance(w, Parameter):
        sink.outer(w, dy2, _rows(x))
    if isinstance(b, Parameter):
        sink.add(b, lambda: dy2.sum(axis=0))
    return ops.linear.input_grad(dy, w.data.T).astype(x.dtype, copy=False)


def lora_delta(ops: Ops, x, lora: LoraAdapter):
    """s (X A^T) B^T: the adapter's share of the product (peft's lora_B(lora_A(x)) *
    scaling), in B's dtype; a partial sum over tp when A is split (row-parallel base)."""
    y = product(ops, product(ops, x, lora.A), lora.B)
    y *= y.dtype.type(lora.scale)
    return y


def lora_grads(ops: Ops, dy, x, lora: LoraAdapter, sink):
    """The adapter's backward: with U = X A^T (recomputed, N x r) and dZ = s dY,
    dB = dZ^T U, dU = dZ B, dA = dU^T X; returns its share of dX, dU A."""
    u = product(ops, x, lora.A)
    dz = dy * dy.dtype.type(lora.scale)
    du = weight_grads(ops, dz, u, lora.B, None, sink)
    return weight_grads(ops, du, x, lora.A, None, sink)


def keep_slice(tp: Communicator, piece, name: str, replicas: Communicator | None = None,
          partial_grad: bool = False) -> Parameter:
    """This rank's slice of a whole weight, as a Parameter on the group's backend."""
    backend = tp.backend
    if isinstance(piece, np.ndarray) and backend.on_device:
        data = backend.asarray(np.ascontiguousarray(piece))
    else:
        data = tp.xp.array(piece, copy=True)
    # 16 bits compute, 32 bits learn: an update far below a bfloat16 weight's last bit
    # would be lost in it (the optimizer updates the master and refreshes the copy)
    master = data.astype(tp.xp.float32) if data.dtype.itemsize < 4 else None
    return Parameter(data, name=name, decay=data.ndim > 1, master=master, replicas=replicas,
                     partial_grad=partial_grad)


def _my_cut(tp: Communicator, what: str, weight, bias, length: int, sizes, unit: int,
            kind: str) -> tuple[int, int]:
    """This rank's [start, stop) of the weight's split dimension, the ranks having agreed on
    the weight's shape and the split (one check over tp)."""
    try:
        cut, error = splits.bounds(length, tp.size, sizes, unit, what=kind)[tp.rank], None
    except HpcparError as e:
        cut, error = (0, 0), e
    tp.agree(what, [("weight's shape", tuple(weight.shape)), ("weight's dtype", str(weight.dtype)),
                    ("bias's shape", None if bias is None else tuple(bias.shape)),
                    ("sizes", None if sizes is None else [int(n) for n in sizes]),
                    ("unit", unit)], error)
    return cut


def named_of(prefix: str, role: str, params: list) -> dict[str, Parameter]:
    """``role`` (one parameter) or ``role.k`` (several), trainable ones only."""
    if len(params) == 1:
        return {join(prefix, role): params[0]} if isinstance(params[0], Parameter) else {}
    return {join(prefix, f"{role}.{k}"): p for k, p in enumerate(params)
            if isinstance(p, Parameter)}


def _check_input(layer, x, features: int, what: str) -> None:
    """x (..., features): a wrong width would be a NumPy error deep in a product."""
    if x.shape[-1:] != (features,):
        raise HpcparError(f"{type(layer).__name__}: input of shape {tuple(x.shape)}; this rank's "
                          f"weight takes {features} features along the last axis: {what}")


def _single(params: list, what: str):
    if len(params) != 1:
        raise HpcparError(f"this layer has {len(params)} {what}: use .{what}[k]")
    return params[0]


def sink_or_new(sink, xp):
    return GradSink(xp) if sink is None else sink


def split_axis(tp: Communicator, sequence_axis: int | None) -> int | None:
    """The axis a layer's outside activations are split along over ``tp`` (sequence
    parallelism), or None: not set, or a group of one (nothing to split)."""
    return sequence_axis if sequence_axis is not None and tp.size > 1 else None


def gathered(x, tp: Communicator, sequence_axis: int | None):
    """x with every rank's positions along ``sequence_axis`` (AllGather), or x itself
    without sequence parallelism."""
    axis = split_axis(tp, sequence_axis)
    if axis is None:
        return x
    if not -x.ndim <= axis < x.ndim or axis % x.ndim == x.ndim - 1:   # the features' axis
        raise HpcparError(f"sequence_axis {sequence_axis} is not a positions axis of an input "
                          f"of shape {tuple(x.shape)} (its last axis holds the features): "
                          "give (batch, positions, features) inputs with sequence_axis=1, "
                          "or (positions, features) with sequence_axis=0")
    return GatherFromGroup.forward(x, tp, axis)


class ColumnParallelLinear:
    """Y_i = X A_i^T + b_i, with A = [A_1; ...; A_p] split along its output features.

    Forward: no communication (f: identity); every rank keeps its own column block Y_i.
    Backward: dX = sum_i dY_i A_i, an AllReduce over tp (f's backward).
    With ``sequence_axis`` (sequence parallelism) X comes split along that axis: forward
    AllGathers it, backward gathers it again for dW and ReduceScatters dX.
    Several projections read the same X (q/k/v, gate/up) and come out as a list: one weight
    each (training), or one merged weight whose output is split at ``sizes`` (generation;
    see ``merged``).
    """

    def __init__(self, ops: Ops, weights: list, biases: list | None, tp: Communicator,
                 sizes: list[int] | None = None, *, sequence_axis: int | None = None):
        self.ops, self.weights, self.biases, self.tp = ops, weights, biases, tp
        self.bounds = [sum(sizes[:k]) for k in range(1, len(sizes))] if sizes else None
        self.sequence_axis = sequence_axis

    @classmethod
    def merged(cls, ops: Ops, weights: list, biases: list | None,
               tp: Communicator) -> "ColumnParallelLinear":
        """One GEMM for ``weights`` (frozen): their arrays stacked (``frozen_matrix``)."""
        xp = ops.xp
        sizes = [w.data.shape[0] for w in weights]
        weight = frozen_matrix(xp, weights)
        bias = None
        if biases:
            bias = [Frozen(xp.concatenate([
                b.data if b is not None else xp.zeros(n, dtype=w.data.dtype)
                for b, w, n in zip(biases, weights, sizes)]))]
        return cls(ops, [weight], bias, tp, sizes)

    @classmethod
    def from_full(cls, tp: Communicator, weight, bias=None, sizes=None, ops: Ops | None = None,
                  name: str = "", *, unit: int = 1,
                  sequence_axis: int | None = None) -> "ColumnParallelLinear":
        """From the whole ``weight`` [out, in] (and ``bias`` [out]), the same on every rank:
        this rank keeps output features [start_i, stop_i): even, cut at ``sizes``, or by
        whole units of ``unit`` features (heads). With fewer units than ranks each unit is
        held by tp / units consecutive ranks (GQA's KV heads): those ranks are its
        ``replicas``, each adding its own part of the gradient (``sum_partial_grads``)."""
        a, b = _my_cut(tp, "ColumnParallelLinear.from_full", weight, bias, weight.shape[0],
                       sizes, unit, "output features")
        copies = splits.unit_replicas(weight.shape[0], tp.size, unit) if sizes is None else 1
        replicas = tp.split(tp.rank // copies, "replicas") if copies > 1 else None
        w = keep_slice(tp, weight[a:b], name, replicas, replicas is not None)
        bs = ([keep_slice(tp, bias[a:b], join(name, "bias"), replicas, replicas is not None)]
              if bias is not None else None)
        return cls(ops or native_ops(tp.xp), [w], bs, tp, sequence_axis=sequence_axis)

    @property
    def weight(self):
        """The weight of a single-weight layer (``weights[0]``)."""
        return _single(self.weights, "weights")

    @property
    def bias(self):
        """The bias of a single-weight layer, or None."""
        return _single(self.biases, "biases") if self.biases else None

    def named_parameters(self, prefix: str = "") -> dict[str, Parameter]:
        """``weight`` and ``bias`` (``weight.k`` / ``bias.k`` with several weights)."""
        return named_of(prefix, "weight", self.weights) | named_of(prefix, "bias",
                                                               self.biases or [])

    def parameters(self) -> list[Parameter]:
        return list(self.named_parameters().values())

    def forward(self, x):
        """(Y_i, ctx) of a single-weight layer (a list of Y's for several weights)."""
        ys = self(x)
        return (ys[0] if len(ys) == 1 else ys), x

    def __call__(self, x) -> list:
        _check_input(self, x, self.weights[0].data.shape[1], "the whole input (f copies it)")
        x = gathered(x, self.tp, self.sequence_axis)
        ys = []
        for k, w in enumerate(self.weights):
            y = product(self.ops, x, w)
            if self.biases and self.biases[k] is not None:
                y += self.biases[k].data
            if getattr(w, "lora", None) is not None:
                y += lora_delta(self.ops, x, w.lora)
            ys.append(y)
        return self.ops.xp.split(ys[0], self.bounds, axis=-1) if self.bounds else ys

    def backward(self, dys, x, sink=None):
        """dX, AllReduced over tp, from the outputs' gradients (one weight per output; an
        array for one weight). Weight gradients go to ``sink`` (default: added at once)."""
        dys = dys if isinstance(dys, (list, tuple)) else [dys]
        sink = sink_or_new(sink, self.ops.xp)
        biases = self.biases or [None] * len(self.weights)
        x = gathered(x, self.tp, self.sequence_axis)      # kept split: gathered again for dW
        dx = None
        for dy, w, b in zip(dys, self.weights, biases):
            d = weight_grads(self.ops, dy, x, w, b, sink)
            if getattr(w, "lora", None) is not None:     # a partial sum: the AllReduce below
                d += lora_grads(self.ops, dy, x, w.lora, sink)
            if dx is None:
                dx = d
            else:
                dx += d
        axis = split_axis(self.tp, self.sequence_axis)
        if axis is not None:
            return ReduceScatterToGroup.forward(dx, self.tp, axis)
        return CopyToGroup.backward(dx, self.tp)


def column_parallel(ops: Ops, w: dict, roles: tuple, tp: Communicator,
                    merge: bool) -> ColumnParallelLinear:
    """The column-parallel projections ``roles`` of a layer's weights ``w`` (by role; biases
    under role + "_bias", where the model has them), merged when ``merge``: then taken out
    of ``w``, so that each block is freed once merged (loading holds one copy at a time)."""
    biases = [w.get(r + "_bias") for r in roles]
    biases = biases if any(b is not None for b in biases) else None
    if merge:
        return ColumnParallelLinear.merged(ops, [w.pop(r) for r in roles], biases, tp)
    return ColumnParallelLinear(ops, [w[r] for r in roles], biases, tp)


def row_parallel(ops: Ops, w: dict, role: str, tp: Communicator,
                 merge: bool) -> "RowParallelLinear":
    """The row-parallel projection ``role``, in ``stored_matrix``'s layout when ``merge``
    (frozen; then taken out of ``w``, as ``column_parallel`` does)."""
    weight = frozen_matrix(ops.xp, [w.pop(role)]) if merge else w[role]
    return RowParallelLinear(ops, weight, w.get(role + "_bias"), tp)


class RowParallelLinear:
    """Y = sum_i X_i A_i^T + b, with A = [A_1, ..., A_p] split along its input features and X
    already split the same way (the output of a column-parallel layer).

    Forward: each rank's partial product is AllReduced over tp (g), then the replicated bias
    is added once. Backward: dX_i = dY A_i, no communication (g's backward is the identity).
    With ``sequence_axis`` (sequence parallelism) the partial products are ReduceScattered
    along that axis instead (Y comes out split, the bias added to each rank's positions),
    and backward first AllGathers dY (the bias's gradient then whole on every rank).
    """

    def __init__(self, ops: Ops, weight, bias, tp: Communicator, *,
                 sequence_axis: int | None = None):
        self.ops, self.weight, self.bias, self.tp = ops, weight, bias, tp
        self.sequence_axis = sequence_axis

    @classmethod
    def from_full(cls, tp: Communicator, weight, bias=None, sizes=None, ops: Ops | None = None,
                  name: str = "", *, sequence_axis: int | None = None) -> "RowParallelLinear":
        """From the whole ``weight`` [out, in] (and ``bias`` [out], replicated over tp: its
        ``replicas``, counted once in the gradient norm): this rank keeps input features
        [start_i, stop_i) (even, or cut at ``sizes``)."""
        a, b = _my_cut(tp, "RowParallelLinear.from_full", weight, bias, weight.shape[1], sizes,
                       1, "input features")
        w = keep_slice(tp, weight[:, a:b], name)
        bias = keep_slice(tp, bias, join(name, "bias"), tp if tp.size > 1 else None) \
            if bias is not None else None
        return cls(ops or native_ops(tp.xp), w, bias, tp, sequence_axis=sequence_axis)

    def named_parameters(self, prefix: str = "") -> dict[str, Parameter]:
        """``weight`` and ``bias``."""
        return named_of(prefix, "weight", [self.weight]) | (
            named_of(prefix, "bias", [self.bias]) if self.bias is not None else {})

    def parameters(self) -> list[Parameter]:
        return list(self.named_parameters().values())

    def forward(self, x):
        """(Y, ctx)."""
        return self(x), x

    def __call__(self, x):
        _check_input(self, x, self.weight.data.shape[1], "this rank's slice of the input "
                     "features, as a column-parallel layer leaves it")
        partial = product(self.ops, x, self.weight)
        if getattr(self.weight, "lora", None) is not None:   # partial too: one AllReduce
            partial += lora_delta(self.ops, x, self.weight.lora)
        axis = split_axis(self.tp, self.sequence_axis)
        y = (ReduceFromGroup.forward(partial, self.tp) if axis is None
             else ReduceScatterToGroup.forward(partial, self.tp, axis))
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, dy, x, sink=None):
        """dX_i = dY A_i (g's backward: no communication; with sequence parallelism dY
        AllGathered first); weight gradients to ``sink``."""
        sink = sink_or_new(sink, self.ops.xp)
        axis = split_axis(self.tp, self.sequence_axis)
        if axis is not None:
            dy = GatherFromGroup.forward(dy, self.tp, axis)
        dx = weight_grads(self.ops, dy, x, self.weight, self.bias, sink)
        if getattr(self.weight, "lora", None) is not None:
            dx += lora_grads(self.ops, dy, x, self.weight.lora, sink)
        return dx
