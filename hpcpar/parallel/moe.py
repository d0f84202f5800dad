"""Mixture of experts, for any model: a top-k router, this rank's experts run as a grouped
product, and the expert-parallel dispatch and combine over an ``ep`` group, each with its
backward.

    probs = softmax(x R^T) in float32          (N, E): every expert's probability
    idx, w = top_k(probs, k)                   (N, k); w / sum(w) when ``normalize``
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
The router is replicated over tp.

Communication per layer: forward, 1 AllReduce over tp and 2 all_to_alls over ep (plus one of
P counts); backward, 2 AllReduces over tp (one of N*k routing weights) and 2 all_to_alls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backend import host_array
from .comm import Communicator
from .errors import HpcparError
from .layers import frozen_matrix, keep_slice, product, weight_grads
from .mappings import CopyToGroup, ReduceFromGroup
from .ops import Ops, native_ops
from .params import GradSink, Parameter, join


@dataclass
class Routing:
    """What the router chose for N tokens: ``experts`` (N, k) int64 and their ``weights``
    (N, k) float32, from ``probs`` (N, E) float32 (``chosen``: the weights before they are
    normalized)."""

    experts: object
    weights: object
    probs: object
    chosen: object


def route(xp, logits, top_k: int, normalize: bool) -> Routing:
    """Softmax over every expert in float32, the k most probable (ties: the lower index),
    their probabilities renormalised to sum to 1 when ``normalize`` (Mixtral; Qwen's
    ``norm_topk_prob``)."""
    z = logits.astype(np.float32)
    p = xp.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    experts = xp.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    chosen = xp.take_along_axis(p, experts, axis=-1)
    weights = chosen / chosen.sum(axis=-1, keepdims=True) if normalize else chosen
    return Routing(experts, weights, p, chosen)


def route_backward(xp, routing: Routing, dweights, normalize: bool, dprobs=None):
    """d logits (N, E) float32 from the weights' gradient (N, k), plus ``dprobs`` (N, E),
    the probabilities' own (an auxiliary loss's), when given."""
    dw = dweights.astype(np.float32)
    if normalize:          # w = c / S: dc = (dw - sum(dw w)) / S
        total = routing.chosen.sum(axis=-1, keepdims=True)
        dw = (dw - (dw * routing.weights).sum(axis=-1, keepdims=True)) / total
    p = routing.probs
    dp = xp.zeros_like(p) if dprobs is None else dprobs.astype(np.float32, copy=True)
    rows = xp.arange(p.shape[0])[:, None]
    dp[rows, routing.experts] += dw                 # a row's k experts are distinct
    return p * (dp - (dp * p).sum(axis=-1, keepdims=True))


def load_balancing_loss(xp, routings: list[Routing], mask, group=None):
    """Switch Transformer's auxiliary loss as transformers' ``load_balancing_loss_func``
    computes it, the routings of several layers pooled: E * sum_e f_e p_e, with f_e the
    share of the top-k choices that went to expert e and p_e its mean probability, over
    every (layer, token) pair whose token is in ``mask`` (N,) bool. ``group``: the ranks
    holding the rest of the tokens (context parallelism), whose sums are added first.
    Returns (loss, the gradient of every layer's probabilities per unit of loss, (N, E)):
    the choices have none, so it is E f_e / (tokens x layers) for each token in ``mask``."""
    E = routings[0].probs.shape[1]
    weight = mask.astype(np.float64)
    sums = xp.zeros(2 * E + 1, dtype=np.float64)
    for r in routings:
        sums[:E] += xp.bincount(r.experts.reshape(-1),
                                weights=xp.repeat(weight, r.experts.shape[1]), minlength=E)
        sums[E:2 * E] += (r.probs * weight[:, None]).sum(axis=0)
        sums[2 * E] += weight.sum()
    if group is not None and group.size > 1:
        group.all_reduce(sums)
    choices, probs, rows = sums[:E], sums[E:2 * E], sums[2 * E]
    if float(rows) == 0:
        return 0.0, xp.zeros(routings[0].probs.shape, dtype=np.float32)
    loss = float(E * (choices * probs).sum() / rows ** 2)
    dprobs = (E * choices / rows ** 2).astype(np.float32)[None, :] * mask[:, None]
    return loss, dprobs.astype(np.float32)


class TopKRouter:
    """logits = x R^T (R: (E, hidden), replicated over tp), then ``route``."""

    def __init__(self, ops: Ops, weight, top_k: int, normalize: bool):
        self.ops, self.weight, self.top_k, self.normalize = ops, weight, top_k, normalize

    @property
    def num_experts(self) -> int:
        return self.weight.data.shape[0]

    def forward(self, x2) -> Routing:
        """``x2`` (N, hidden) -> the routing of its N tokens."""
        return route(self.ops.xp, product(self.ops, x2, self.weight), self.top_k,
                     self.normalize)

    def backward(self, routing: Routing, dweights, x2, sink, dprobs=None):
        """d x2 from the weights' (and probabilities') gradients; adds R's to ``sink``."""
        dlogits = route_backward(self.ops.xp, routing, dweights, self.normalize, dprobs)
        return weight_grads(self.ops, dlogits.astype(x2.dtype), x2, self.weight, None, sink)


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
        """For generation: each expert's gate and up merged into one stored-transposed
        matrix, and its down stored transposed (the arrays are copied; drop the originals)."""
        xp = ops.xp
        return cls(ops, [[frozen_matrix(xp, [g.data, u.data])] for g, u in zip(gates, ups)],
                   [frozen_matrix(xp, [d.data]) for d in downs], activation)

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
            parts = [product(self.ops, x[rows], w) for w in self.gate_up[j]]
            gate, up = parts if len(parts) == 2 else xp.split(parts[0], 2, axis=-1)
            act = self.act.forward(gate, up)
            y[rows] = product(self.ops, act, self.down[j])
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
            dact = weight_grads(self.ops, dy[rows], act, self.down[j], None, sink)
            dgate, dup = self.act.backward(dact, gate, up)
            w_gate, w_up = self.gate_up[j]
            d = weight_grads(self.ops, dgate, x[rows], w_gate, None, sink)
            d += weight_grads(self.ops, dup, x[rows], w_up, None, sink)
            dx[rows] = d
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
    counts: list[int]         # rows of each local expert
    all_serving: bool = True  # every rank of the group came with no work of its own


class ExpertDispatch:
    """The tokens' trip to their experts and back, over ``ep`` (None: every expert here)."""

    def __init__(self, num_experts: int, ep: Communicator | None, xp):
        size = ep.size if ep is not None else 1
        if num_experts % size:
            raise HpcparError(f"{num_experts} experts do not split over ep {size}: choose an "
                              f"ep that divides {num_experts}")
        self.num_experts, self.ep, self.xp = num_experts, ep if size > 1 else None, xp
        self.local = num_experts // size
        self.first = (ep.rank if ep is not None else 0) * self.local

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
            return rows, counts.tolist(), _Route(order, tokens, top_k, [], [], None,
                                                 counts.tolist())
        P, L = self.ep.size, self.local
        # each rank's counts for every expert of a rank, and whether it is only serving
        outgoing = np.concatenate([counts.reshape(P, L), np.full((P, 1), int(serving))], 1)
        incoming = self.ep.on_host().all_to_all(outgoing.reshape(P, 1, L + 1), 0, 1)
        by_source, flags = incoming.reshape(P, L + 1)[:, :L], incoming.reshape(P, L + 1)[:, L]
        send, recv = counts.reshape(P, L).sum(axis=1).tolist(), by_source.sum(axis=1).tolist()
        arrived, _ = self.ep.all_to_all_rows(rows, send, recv)
        regroup = xp.asarray(_expert_major(by_source))
        local = by_source.sum(axis=0).tolist()
        return arrived[regroup], local, _Route(order, tokens, top_k, send, recv, regroup, local,
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


def _check_layer(router, gate, up, down, top_k) -> None:
    """``MoE.from_full``'s arrays fit one layer of E experts and top_k is one of 1..E."""
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


def _expert_major(by_source: np.ndarray) -> np.ndarray:
    """The received rows' indices in expert-major order: they arrive by source, then by
    expert (``by_source[s, e]`` rows each), and each expert runs on all of its rows."""
    sizes = by_source.reshape(-1)                          # (s, e) blocks as they arrive
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).reshape(by_source.shape)
    em_sizes, em_starts = by_source.T.reshape(-1), starts.T.reshape(-1)
    em_offsets = np.concatenate([[0], np.cumsum(em_sizes)[:-1]])
    return np.repeat(em_starts - em_offsets, em_sizes) + np.arange(int(sizes.sum()))


class MoE:
    """The routed experts of one layer: ``router``, this rank's ``experts`` (the ep block
    ``dispatch`` says, each split over ``tp``), and the dispatch and combine between them.
    ``forward`` / ``backward`` as hpcpar's other layers; ``tokens_per_expert`` counts each
    local expert's rows since ``reset_load``."""

    def __init__(self, ops: Ops, router: TopKRouter, experts: Experts,
                 dispatch: ExpertDispatch, tp: Communicator | None = None):
        if len(experts) != dispatch.local:
            raise HpcparError(f"this rank holds {len(experts)} experts; its share of "
                              f"{dispatch.num_experts} over ep is {dispatch.local}")
        self.ops, self.router, self.experts, self.dispatch = ops, router, experts, dispatch
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.reset_load()
        self.all_serving = True

    @classmethod
    def from_full(cls, router, gate, up, down, top_k: int, normalize: bool = True, *,
                  ep: Communicator | None = None, tp: Communicator | None = None,
                  activation: str = "silu", ops: Ops | None = None,
                  name: str = "") -> "MoE":
        """From the whole layer, the same on every rank: ``router`` (E, hidden), ``gate`` and
        ``up`` (E, inter, hidden), ``down`` (E, hidden, inter), as transformers' experts
        are stacked. This rank keeps its ep block of experts, each cut over ``tp``."""
        group = tp if tp is not None else ep
        if group is None:
            raise HpcparError("MoE.from_full: give the ep group, the tp group, or both "
                              "(a mesh's groups: mesh.group('ep'))")
        ops = ops or native_ops(group.xp)
        _check_layer(router, gate, up, down, top_k)
        E, inter = gate.shape[0], gate.shape[1]
        dispatch = ExpertDispatch(E, ep, ops.xp)
        t, p = (tp.rank, tp.size) if tp is not None else (0, 1)
        if inter % p:
            raise HpcparError(f"MoE.from_full: experts of {inter} features do not split over "
                              f"tp {p}; choose a tp that divides {inter}")
        cut = slice(t * inter // p, (t + 1) * inter // p)
        mine = range(dispatch.first, dispatch.first + dispatch.local)
        replicas = tp if tp is not None and tp.size > 1 else None
        host = group if tp is None else tp

        def keep(piece, what):
            return keep_slice(host, np.ascontiguousarray(piece), join(name, what))

        r = keep_slice(host, np.asarray(router), join(name, "router.weight"), replicas)
        experts = Experts(ops, [[keep(gate[e, cut], f"experts.{e}.gate.weight"),
                                 keep(up[e, cut], f"experts.{e}.up.weight")] for e in mine],
                          [keep(down[e][:, cut], f"experts.{e}.down.weight") for e in mine],
                          activation)
        return cls(ops, TopKRouter(ops, r, top_k, normalize), experts, dispatch, tp)

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
        self.routing: Routing | None = None       # the last forward's

    def serve(self) -> bool:
        """A forward with no tokens of this rank's own: the other ranks of the ep group may
        still send tokens to its experts. True when every rank of the group was serving
        too: the group's work is done (each rank learns it in the same call)."""
        x = self.ops.xp.empty((0, self.router.weight.data.shape[1]),
                              dtype=self.router.weight.data.dtype)
        self.forward(x, serving=True)
        return self.all_serving

    def forward(self, x, train: bool = False, serving: bool = False):
        """(y, ctx) for x (..., hidden); ctx is what ``backward`` needs when ``train``.
        ``routing`` keeps the last forward's ``Routing`` (for an auxiliary loss)."""
        shape = x.shape
        hidden = self.router.weight.data.shape[1]
        if shape[-1:] != (hidden,):
            raise HpcparError(f"MoE: input of shape {tuple(shape)}; the layer takes {hidden} "
                              "features along the last axis")
        x2 = x.reshape(-1, shape[-1])
        routing = self.router.forward(x2)
        rows, counts, route = self.dispatch.forward(x2, routing.experts, serving)
        self.all_serving, self.routing = route.all_serving, routing
        self.tokens_per_expert += counts
        out, expert_ctx = self.experts.forward(rows, counts, train)
        slots = self.dispatch.back(out, route)                     # partial over tp
        y = (slots * routing.weights.astype(slots.dtype)[..., None]).sum(axis=1)
        if self.tp is not None:
            y = ReduceFromGroup.forward(y, self.tp)
        ctx = (x2, routing, route, expert_ctx, slots) if train else None
        return y.reshape(shape), ctx

    __call__ = forward

    def backward(self, dy, ctx, sink=None, dprobs=None):
        """d x from d y; weight gradients to ``sink`` (default: added at once). ``dprobs``
        (N, E): an auxiliary loss's gradient of the router's probabilities."""
        x2, routing, route, expert_ctx, slots = ctx
        sink = sink if sink is not None else GradSink(self.ops.xp)
        dy2 = dy.reshape(-1, dy.shape[-1])
        dweights = (slots * dy2[:, None, :]).sum(axis=-1, dtype=np.float32)
        if self.tp is not None:          # each tp rank's slots are a part of the outputs
            dweights = self.tp.all_reduce(dweights)
        dslots = dy2[:, None, :] * routing.weights.astype(dy.dtype)[..., None]
        dx_local = self.experts.backward(self.dispatch.to_experts(dslots, route), expert_ctx,
                                         sink)
        dx = self.dispatch.backward(dx_local, route)
        if self.tp is not None:
            dx = CopyToGroup.backward(dx, self.tp)
        dx += self.router.backward(routing, dweights, x2, sink, dprobs)
        return dx.reshape(dy.shape)


__all__ = ["Experts", "ExpertDispatch", "MoE", "Routing", "TopKRouter", "route",
           "route_backward"]
