"""Mixture of experts, for any model: this rank's experts run as a grouped product, and the
expert-parallel dispatch and combine over an ``ep`` group, each with its backward; the layer
(``MoE``) puts them behind the top-k router of ``routing``.

    idx, w = route(x)                          (N, k) experts and weights (``routing``)
    y[n] = sum_j w[n, j] expert_idx[n, j](x[n]),   expert_e(x) = down_e(act(gate_e x) * up_e x)

Routing is dropless: every token reaches its k experts (no capacity factor, nothing dropped),
as transformers computes Mixtral and Qwen's MoE models.

Dispatch: the N*k (token, choice) slots are sorted by expert (stably), so each expert's rows
are contiguous. Over an ep group of P ranks the E experts are split in contiguous blocks of
E/P (rank r holds experts [r E/P, (r+1) E/P)), and each block's rows go to its rank by one
all_to_all of counts and one of rows (``Communicator.all_to_all_rows``). There they are
regrouped by expert, each expert runs once on its rows (a loop over experts, never over
tokens), and the outputs go back the same way; the source adds each token's k outputs,
weighted (the combine). A rank with no tokens takes part with zero rows: its group's
all_to_alls need every rank. A rank whose own work is done while the others of its group
still run (generation's replicas finish at different times) keeps serving its experts
(``MoE.serve``) until every rank of the group is serving: the counts carry that flag.

Under tp each expert is split as the dense MLP is (gate/up by output features, down by
input features): an expert's output is a partial sum over tp, added once after the combine
(one AllReduce of (N, hidden), as the dense MLP's down), and the input gradient likewise.
The router is replicated over tp. With ``sequence_axis`` (sequence parallelism) the input
comes split along the sequence over tp: it is AllGathered (every tp rank routes every token
alike) and the partial outputs ReduceScattered back, in place of the AllReduce; backward
mirrors it (dY AllGathered, the experts' dX ReduceScattered, the router's, whole on every
rank, sliced).

Communication per layer: forward, 1 AllReduce over tp and 2 all_to_alls over ep (plus one of
P counts); backward, 2 AllReduces over tp (one of N*k routing weights) and 2 all_to_alls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..device.backend import host_array
from ..comm import Communicator
from ..comm.failfast import fails_together
from ..errors import HpcparError
from ..tensor_parallel.layers import (frozen_matrix, gathered, keep_slice, lora_delta,
                                      lora_grads, product, split_axis, weight_grads)
from ..tensor_parallel.mappings import (CopyToGroup, ReduceFromGroup, ReduceScatterToGroup,
                                        ScatterToGroup)
from ..ops import Ops, native_ops
from ..params import GradSink, Parameter, join
from .routing import Routing, TopKRouter
from ..tensor.splits import expert_block


class Experts:
    """This rank's experts (their tp slices): expert j computes down_j(act(gate_j x) * up_j x)
    on its own contiguous rows, one product each. ``gate_up[j]`` is [gate_j, up_j] (training:
    parameters) or [merged] (generation: one frozen [gate; up] matrix); ``down[j]`` its down."""

    def __init__(self, ops: Ops, gate_up: list[list], down: list, activation: str = "silu"):
        self.ops, self.gate_up, self.down = ops, gate_up, down
        self.act = ops.gated(activation)

    @classmethod
    def frozen(cls, ops: Ops, gates: list, ups: list, downs: list,
               activation: str = "silu") -> "Experts":
        """For generation: each expert's gate and up merged into one matrix and its down,
        in ``layers.stored_matrix``'s layout (``frozen_matrix``: copied only where loading
        did not place them so; drop the originals)."""
        xp = ops.xp
        return cls(ops, [[frozen_matrix(xp, [g, u])] for g, u in zip(gates, ups)],
                   [frozen_matrix(xp, [d]) for d in downs], activation)

    def __len__(self) -> int:
        return len(self.down)

    def forward(self, x, counts: list[int], train: bool = False):
        """(y, ctx): ``x`` holds ``counts[j]`` rows for expert j, one expert after the other."""
        xp = self.ops.xp
        y = xp.empty((x.shape[0], self.down[0].data.shape[0]), dtype=x.dtype)
        saved, start = [], 0
        for j, n in enumerate(counts):
            rows, start = slice(start, start + n), start + n
            if n == 0:
                saved.append(None)
                continue
            parts = [_adapted(self.ops, x[rows], w) for w in self.gate_up[j]]
            gate, up = parts if len(parts) == 2 else xp.split(parts[0], 2, axis=-1)
            act = self.act.forward(gate, up)
            y[rows] = _adapted(self.ops, act, self.down[j])
            saved.append((gate, up, act) if train else None)
        return y, ((x, counts, saved) if train else None)

    def backward(self, dy, ctx, sink):
        """d x from d y; the weights' gradients go to ``sink``."""
        x, counts, saved = ctx
        dx = self.ops.xp.empty_like(x)
        start = 0
        for j, n in enumerate(counts):
            rows, start = slice(start, start + n), start + n
            if n == 0:
                continue
            gate, up, act = saved[j]
            dact = _adapted_grads(self.ops, dy[rows], act, self.down[j], sink)
            dgate, dup = self.act.backward(dact, gate, up)
            w_gate, w_up = self.gate_up[j]
            d = _adapted_grads(self.ops, dgate, x[rows], w_gate, sink)
            d += _adapted_grads(self.ops, dup, x[rows], w_up, sink)
            dx[rows] = d
        return dx


def _adapted(ops: Ops, x, w):
    """X W^T, plus s (X A^T) B^T where ``w`` carries a LoRA adapter (a LoRA run's frozen
    expert: ``tensor_parallel.layers.lora_delta``; a partial sum over tp for down, as its
    base's product is)."""
    y = product(ops, x, w)
    if getattr(w, "lora", None) is not None:
        y += lora_delta(ops, x, w.lora)
    return y


def _adapted_grads(ops: Ops, dy, x, w, sink):
    """``_adapted``'s backward: the weight's (none when frozen) and the adapter's gradients
    to ``sink`` (an A that gate and up share gets both shares); returns dX."""
    dx = weight_grads(ops, dy, x, w, None, sink)
    if getattr(w, "lora", None) is not None:
        dx += lora_grads(ops, dy, x, w.lora, sink)
    return dx


@dataclass
class _Route:
    """Where one batch's slots went (``ExpertDispatch.forward``), to bring them back."""

    order: object             # (N*k,) the slots sorted by expert
    tokens: int
    top_k: int
    send: list[int]           # rows to each ep rank
    recv: list[int]           # rows from each ep rank
    regroup: object           # received rows -> by expert (None without ep)
    all_serving: bool = True  # every rank of the group came with no work of its own


class ExpertDispatch:
    """The tokens' trip to their experts and back, over ``ep`` (None: every expert here)."""

    def __init__(self, num_experts: int, ep: Communicator | None, xp):
        size, rank = (ep.size, ep.rank) if ep is not None else (1, 0)
        block = expert_block(num_experts, size, rank)
        self.num_experts, self.ep, self.xp = num_experts, ep if size > 1 else None, xp
        self.local, self.first = len(block), block.start

    def forward(self, x2, experts, serving: bool = False) -> tuple[object, list[int], _Route]:
        """(this rank's rows, by expert; the rows of each of its experts; the route).
        ``serving``: this rank has no work of its own left (``MoE.serve``)."""
        xp = self.xp
        tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = xp.argsort(flat, kind="stable")
        counts = host_array(xp.bincount(flat, minlength=self.num_experts)).astype(np.int64)
        rows = x2[order // top_k]
        if self.ep is None:
            return rows, counts.tolist(), _Route(order, tokens, top_k, [], [], None)
        P, L = self.ep.size, self.local
        # each rank's counts for every expert of a rank, and whether it is only serving
        outgoing = np.concatenate([counts.reshape(P, L), np.full((P, 1), int(serving))], 1)
        incoming = self.ep.on_host().all_to_all(outgoing.reshape(P, 1, L + 1), 0, 1)
        by_source, flags = incoming.reshape(P, L + 1)[:, :L], incoming.reshape(P, L + 1)[:, L]
        send, recv = counts.reshape(P, L).sum(axis=1).tolist(), by_source.sum(axis=1).tolist()
        arrived, _ = self.ep.all_to_all_rows(rows, send, recv)
        regroup = xp.asarray(_expert_major(by_source))
        local = by_source.sum(axis=0).tolist()
        return arrived[regroup], local, _Route(order, tokens, top_k, send, recv, regroup,
                                               bool(flags.all()))

    def back(self, y_local, route: _Route):
        """The experts' outputs (by expert, as ``forward`` gave the rows) back at their
        tokens: (N, k, hidden), slot j of token n its j-th choice's output."""
        xp = self.xp
        if self.ep is not None:
            grouped = xp.empty_like(y_local)
            grouped[route.regroup] = y_local
            y_local, _ = self.ep.all_to_all_rows(grouped, route.recv, route.send)
        slots = xp.empty_like(y_local)
        slots[route.order] = y_local
        return slots.reshape(route.tokens, route.top_k, y_local.shape[-1])

    def to_experts(self, slots, route: _Route):
        """``back``'s backward: (N, k, hidden) per slot -> by expert on the expert's rank."""
        rows = slots.reshape(route.tokens * route.top_k, slots.shape[-1])[route.order]
        if self.ep is None:
            return rows
        arrived, _ = self.ep.all_to_all_rows(rows, route.send, route.recv)
        return arrived[route.regroup]

    def backward(self, dx_local, route: _Route):
        """``forward``'s backward: d x2 (N, hidden), each token's k slots summed."""
        return self.back(dx_local, route).sum(axis=1)


@dataclass(frozen=True)
class _WholeLayer:
    """What ``MoE.from_full`` is given, the same on every rank: the whole layer's arrays
    and its settings."""

    router: object
    gate: object
    up: object
    down: object
    top_k: int
    normalize: bool
    activation: str


def _agree_on_layer(layer: _WholeLayer, ep, tp) -> None:
    """``_check_layer``, its error raised on every rank of ``ep`` and ``tp``, and the ranks
    agreed on the layer's settings and shapes (a rank routing with another top_k, or experts
    of another width, would route its tokens its own way without a word). Both checks run
    on every rank, an error of the first carried into the second: no rank of the layer is
    left waiting in one while the others leave, and an error every rank found the same way
    is told to nobody (``comm.failfast``)."""
    try:
        _check_layer(layer.router, layer.gate, layer.up, layer.down, layer.top_k,
                     layer.activation, ep.size if ep is not None else 1,
                     tp.size if tp is not None else 1)
        error = None
    except HpcparError as e:
        error = e
    fields = [("top_k", layer.top_k), ("normalize", layer.normalize),
              ("activation", layer.activation),
              *((name, tuple(getattr(layer, name).shape))
                for name in ("router", "gate", "up", "down"))]
    for group in (ep, tp):
        if group is not None:
            try:
                group.agree("MoE.from_full", fields, error)
            except HpcparError as e:
                if not hasattr(e, "agreed_ranks"):      # a timeout, another rank's failure
                    raise
                error = e                               # raised by the whole group
    if error is not None:
        raise error


def _check_layer(router, gate, up, down, top_k, activation, ep: int, tp: int) -> None:
    """``MoE.from_full``'s arrays fit one layer of E experts, top_k is one of 1..E, and the
    experts split over ``ep`` ranks, their features over ``tp``."""
    shapes = {name: tuple(a.shape) for name, a in
              (("router", router), ("gate", gate), ("up", up), ("down", down))}
    if len(shapes["gate"]) != 3 or len(shapes["router"]) != 2:
        raise HpcparError(f"MoE.from_full: router (E, hidden) and gate, up (E, inter, hidden), "
                          f"down (E, hidden, inter) as transformers stacks them; got {shapes}")
    E, inter, hidden = shapes["gate"]
    want = {"router": (E, hidden), "gate": (E, inter, hidden), "up": (E, inter, hidden),
            "down": (E, hidden, inter)}
    wrong = [f"{name} {shapes[name]} (expected {want[name]})" for name in want
             if shapes[name] != want[name]]
    if wrong:
        raise HpcparError(f"MoE.from_full: {', '.join(wrong)}: router (E, hidden), gate and up "
                          "(E, inter, hidden), down (E, hidden, inter)")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) \
            or not 1 <= top_k <= E:
        raise HpcparError(f"MoE.from_full: top_k {top_k!r} must be an integer from 1 to the "
                          f"{E} experts")
    if activation not in ("silu", "gelu_tanh"):
        raise HpcparError(f"MoE.from_full: activation {activation!r}: the experts' gated MLP "
                          "takes 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU)")
    if E % ep:
        raise HpcparError(f"MoE.from_full: {E} experts do not split over ep {ep}; choose an "
                          f"ep that divides {E}")
    if inter % tp:
        raise HpcparError(f"MoE.from_full: experts of {inter} features do not split over "
                          f"tp {tp}; choose a tp that divides {inter}")


def _expert_major(by_source: np.ndarray) -> np.ndarray:
    """The received rows' indices in expert-major order: they arrive by source, then by
    expert (``by_source[s, e]`` rows each), and each expert runs on all of its rows."""
    sizes = by_source.reshape(-1)                          # (s, e) blocks as they arrive
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).reshape(by_source.shape)
    em_sizes, em_starts = by_source.T.reshape(-1), starts.T.reshape(-1)
    em_offsets = np.concatenate([[0], np.cumsum(em_sizes)[:-1]])
    return np.repeat(em_starts - em_offsets, em_sizes) + np.arange(int(sizes.sum()))


@fails_together            # a failure here, after the agreement, is this rank's alone
def _keep_pieces(group, cls, layer: _WholeLayer, ep, tp, ops, name,
                 sequence_axis=None) -> "MoE":
    """``MoE.from_full`` once the ranks agreed: this rank's pieces (no communication)."""
    ops = ops or native_ops(group.xp)
    router, gate, up, down = layer.router, layer.gate, layer.up, layer.down
    E, inter = gate.shape[0], gate.shape[1]
    dispatch = ExpertDispatch(E, ep, ops.xp)
    t, p = (tp.rank, tp.size) if tp is not None else (0, 1)
    cut = slice(t * inter // p, (t + 1) * inter // p)
    mine = range(dispatch.first, dispatch.first + dispatch.local)
    host = group if tp is None else tp

    def keep(piece, what):
        return keep_slice(host, np.ascontiguousarray(piece), join(name, what))

    r = keep_slice(host, np.asarray(router), join(name, "router.weight"),
                   _router_replicas(ep, tp))
    experts = Experts(ops, [[keep(gate[e, cut], f"experts.{e}.gate.weight"),
                             keep(up[e, cut], f"experts.{e}.up.weight")] for e in mine],
                      [keep(down[e][:, cut], f"experts.{e}.down.weight") for e in mine],
                      layer.activation)
    return cls(ops, TopKRouter(ops, r, layer.top_k, layer.normalize), experts, dispatch, tp,
               sequence_axis=sequence_axis)


def _router_replicas(ep, tp):
    """The groups over which every rank holds the same router: each ep rank routes its own
    tokens with it (its gradient is summed over ep, as over dp), each tp rank the same ones;
    counted once in a gradient norm over ep and tp (``grad_norm``)."""
    groups = tuple(g for g in (ep, tp) if g is not None and g.size > 1)
    return groups[0] if len(groups) == 1 else (groups or None)


class MoE:
    """The routed experts of one layer: ``router``, this rank's ``experts`` (the ep block
    ``dispatch`` says, each split over ``tp``), and the dispatch and combine between them.
    ``forward`` / ``backward`` as hpcpar's other layers; ``tokens_per_expert`` counts each
    local expert's rows since ``reset_load``."""

    def __init__(self, ops: Ops, router: TopKRouter, experts: Experts,
                 dispatch: ExpertDispatch, tp: Communicator | None = None, *,
                 sequence_axis: int | None = None):
        if len(experts) != dispatch.local:
            raise HpcparError(f"this rank holds {len(experts)} experts; its share of "
                              f"{dispatch.num_experts} over ep is {dispatch.local}")
        self.ops, self.router, self.experts, self.dispatch = ops, router, experts, dispatch
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.sequence_axis = sequence_axis      # sequence parallelism's split axis, or None
        group = tp if tp is not None else dispatch.ep
        self.error_board = group.error_board if group is not None else None   # its mesh's
        self.reset_load()
        self.all_serving = True
        self.routing: Routing | None = None       # the last forward's

    def world_ranks(self) -> tuple[int, ...]:
        """The ranks that run this layer's calls with this one: its ep and tp groups'."""
        groups = [g for g in (self.dispatch.ep, self.tp) if g is not None]
        return tuple(sorted({r for g in groups for r in g.world_ranks()}))

    @classmethod
    def from_full(cls, router, gate, up, down, top_k: int, normalize: bool = True, *,
                  ep: Communicator | None = None, tp: Communicator | None = None,
                  activation: str = "silu", ops: Ops | None = None,
                  name: str = "", sequence_axis: int | None = None) -> "MoE":
        """From the whole layer, the same on every rank: ``router`` (E, hidden), ``gate`` and
        ``up`` (E, inter, hidden), ``down`` (E, hidden, inter), as transformers' experts
        are stacked. This rank keeps its ep block of experts, each cut over ``tp``; the
        router is replicated over both (its ``replicas``: ``ep``, ``tp`` or the pair).
        ``sequence_axis``: sequence parallelism's split axis of the input and output (see
        the module's docstring)."""
        if ep is None and tp is None:
            raise HpcparError("MoE.from_full: give the ep group, the tp group, or both "
                              "(a mesh's groups: mesh.group('ep'))")
        layer = _WholeLayer(router, gate, up, down, top_k, normalize, activation)
        _agree_on_layer(layer, ep, tp)
        return _keep_pieces(tp if tp is not None else ep, cls, layer, ep, tp, ops, name,
                            sequence_axis)

    def named_parameters(self, prefix: str = "") -> dict[str, Parameter]:
        """``router.weight`` and this rank's ``experts.{e}.gate/up/down.weight`` (e global)."""
        out = {}
        if isinstance(self.router.weight, Parameter):
            out[join(prefix, "router.weight")] = self.router.weight
        for j, (gu, d) in enumerate(zip(self.experts.gate_up, self.experts.down)):
            e = self.dispatch.first + j
            names = ("gate", "up") if len(gu) == 2 else ("gate_up",)
            for role, w in zip(names + ("down",), gu + [d]):
                if isinstance(w, Parameter):
                    out[join(prefix, f"experts.{e}.{role}.weight")] = w
        return out

    def parameters(self) -> list[Parameter]:
        return list(self.named_parameters().values())

    def reset_load(self) -> None:
        self.tokens_per_expert = np.zeros(self.dispatch.local, dtype=np.int64)

    def serve(self) -> bool:
        """A forward with no tokens of this rank's own: the other ranks of the ep group may
        still send tokens to its experts. True when every rank of the group was serving
        too: the group's work is done (each rank learns it in the same call)."""
        x = self.ops.xp.empty((0, self.router.weight.data.shape[1]),
                              dtype=self.router.weight.data.dtype)
        self.forward(x, serving=True)
        return self.all_serving

    def _split(self) -> int | None:
        """The sequence axis split over tp, or None."""
        return None if self.tp is None else split_axis(self.tp, self.sequence_axis)

    @fails_together
    def forward(self, x, train: bool = False, serving: bool = False):
        """(y, ctx) for x (..., hidden); ctx is what ``backward`` needs when ``train``.
        ``routing`` keeps the last forward's ``Routing`` (for an auxiliary loss)."""
        shape, axis, kept = x.shape, self._split(), x
        hidden = self.router.weight.data.shape[1]
        if shape[-1:] != (hidden,):
            raise HpcparError(f"MoE: input of shape {tuple(shape)}; the layer takes {hidden} "
                              "features along the last axis")
        if axis is not None:
            x = gathered(x, self.tp, axis)                     # every tp rank's positions
        x2 = x.reshape(-1, shape[-1])
        routing = self.router.forward(x2)
        rows, counts, route = self.dispatch.forward(x2, routing.experts, serving)
        self.all_serving, self.routing = route.all_serving, routing
        self.tokens_per_expert += counts
        out, expert_ctx = self.experts.forward(rows, counts, train)
        slots = self.dispatch.back(out, route)                     # partial over tp
        y = (slots * routing.weights.astype(slots.dtype)[..., None]).sum(axis=1)
        if axis is not None:
            y = ReduceScatterToGroup.forward(y.reshape(x.shape), self.tp, axis)
        elif self.tp is not None:
            y = ReduceFromGroup.forward(y, self.tp)
        # split: the input kept as it came, gathered again in backward (for the router's dW)
        ctx = ((x2 if axis is None else kept), routing, route, expert_ctx, slots) \
            if train else None
        return y.reshape(shape), ctx

    __call__ = forward

    @fails_together
    def backward(self, dy, ctx, sink=None, dprobs=None):
        """d x from d y; weight gradients to ``sink`` (default: added at once). ``dprobs``
        (N, E): an auxiliary loss's gradient of the router's probabilities."""
        x2, routing, route, expert_ctx, slots = ctx
        sink = sink if sink is not None else GradSink(self.ops.xp)
        axis, shape = self._split(), dy.shape
        if axis is not None:                        # every position's: as the forward's
            dy, x2 = gathered(dy, self.tp, axis), gathered(x2, self.tp, axis)
            x2 = x2.reshape(-1, x2.shape[-1])
        dy2 = dy.reshape(-1, dy.shape[-1])
        dweights = (slots * dy2[:, None, :]).sum(axis=-1, dtype=np.float32)
        if self.tp is not None:          # each tp rank's slots are a part of the outputs
            dweights = self.tp.all_reduce(dweights)
        dslots = dy2[:, None, :] * routing.weights.astype(dy.dtype)[..., None]
        dx_local = self.experts.backward(self.dispatch.to_experts(dslots, route), expert_ctx,
                                         sink)
        dx = self.dispatch.backward(dx_local, route)
        drouter = self.router.backward(routing, dweights, x2, sink, dprobs)   # whole, alike
        if axis is not None:
            dx = ReduceScatterToGroup.forward(dx.reshape(dy.shape), self.tp, axis)
            dx += ScatterToGroup.forward(drouter.reshape(dy.shape), self.tp, axis)
            return dx.reshape(shape)
        if self.tp is not None:
            dx = CopyToGroup.backward(dx, self.tp)
        dx += drouter
        return dx.reshape(dy.shape)


__all__ = ["ExpertDispatch", "Experts", "MoE"]
