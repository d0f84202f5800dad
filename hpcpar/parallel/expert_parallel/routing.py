"""A mixture of experts' router, for any model: each token's softmax over the experts in
float32, its top k, their weights (renormalised where the model does), and the auxiliary
load-balancing loss over the routings of several layers, each with its backward. The experts
and the dispatch to them are ``moe``'s.

    probs = softmax(x R^T) in float32          (N, E): every expert's probability
    idx, w = top_k(probs, k)                   (N, k); w / sum(w) when ``normalize``

DeepSeek's routers (``Choice``) score by softmax or sigmoid, choose by the scores plus a
bias (V3's ``e_score_correction_bias``: the choice only, never the weights), among the best
``topk_groups`` of ``groups`` groups of experts (a group scored by its best expert, V2, or
its best two's sum, V3), and scale the weights by ``scaling``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..tensor_parallel.layers import product, weight_grads
from ..ops import Ops


@dataclass
class Routing:
    """What the router chose for N tokens: ``experts`` (N, k) int64 and their ``weights``
    (N, k) float32, from ``probs`` (N, E) float32 (``chosen``: the weights before they are
    normalized)."""

    experts: object
    weights: object
    probs: object
    chosen: object


@dataclass(frozen=True)
class Choice:
    """How the scores are made and the k experts chosen: softmax top-k over all experts by
    default (Mixtral, Qwen), or DeepSeek's (the module's docstring)."""

    scoring: str = "softmax"        # or "sigmoid"
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"        # a group's: its best expert's score, or "top2"
    scaling: float = 1.0


PLAIN = Choice()


def _scores(xp, logits, scoring: str):
    z = logits.astype(np.float32)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + xp.exp(-z))
    p = xp.exp(z - z.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def _grouped(xp, scores, choice: Choice):
    """The scores outside each token's best ``topk_groups`` groups at -inf (never chosen)."""
    N, E = scores.shape
    g = scores.reshape(N, choice.groups, E // choice.groups)
    if choice.group_score == "top2":
        best = xp.sort(g, axis=-1)[..., -2:].sum(axis=-1)
    else:
        best = g.max(axis=-1)
    kept = xp.argsort(-best, axis=-1, kind="stable")[:, :choice.topk_groups]
    mask = xp.zeros((N, choice.groups), dtype=bool)
    mask[xp.arange(N)[:, None], kept] = True
    return xp.where(mask[..., None], g, -np.inf).reshape(N, E)


def route(xp, logits, top_k: int, normalize: bool, choice: Choice = PLAIN,
          bias=None) -> Routing:
    """The scores in float32 (softmax over every expert, or ``choice``'s), the k best
    (ties: the lower index) by the scores plus ``bias`` (E,) where given, within the best
    groups where ``choice`` groups them; their scores as weights, renormalised to sum to 1
    when ``normalize`` (Mixtral; ``norm_topk_prob``), times ``choice.scaling``."""
    p = _scores(xp, logits, choice.scoring)
    select = p if bias is None else p + bias.astype(np.float32)
    if choice.groups > 1:
        select = _grouped(xp, select, choice)
    experts = xp.argsort(-select, axis=-1, kind="stable")[:, :top_k]
    chosen = xp.take_along_axis(p, experts, axis=-1)
    weights = chosen / chosen.sum(axis=-1, keepdims=True) if normalize else chosen
    if choice.scaling != 1.0:
        weights = weights * np.float32(choice.scaling)
    return Routing(experts, weights, p, chosen)


def route_backward(xp, routing: Routing, dweights, normalize: bool, dprobs=None,
                   choice: Choice = PLAIN):
    """d logits (N, E) float32 from the weights' gradient (N, k), plus ``dprobs`` (N, E),
    the probabilities' own (an auxiliary loss's), when given. The choice (and its bias)
    has no gradient."""
    dw = dweights.astype(np.float32)
    if choice.scaling != 1.0:
        dw = dw * np.float32(choice.scaling)
    if normalize:          # w = c / S: dc = (dw - sum(dw w)) / S
        total = routing.chosen.sum(axis=-1, keepdims=True)
        dw = (dw - (dw * (routing.chosen / total)).sum(axis=-1, keepdims=True)) / total
    p = routing.probs
    dp = xp.zeros_like(p) if dprobs is None else dprobs.astype(np.float32, copy=True)
    rows = xp.arange(p.shape[0])[:, None]
    dp[rows, routing.experts] += dw                 # a row's k experts are distinct
    if choice.scoring == "sigmoid":
        return dp * p * (1.0 - p)
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
    return loss, (E * choices / rows ** 2).astype(np.float32)[None, :] * mask[:, None]


class TopKRouter:
    """logits = x R^T (R: (E, hidden), replicated over tp), then ``route`` by ``choice``
    (and ``bias``, (E,) replicated, which has no gradient)."""

    def __init__(self, ops: Ops, weight, top_k: int, normalize: bool, choice: Choice = PLAIN,
                 bias=None):
        self.ops, self.weight, self.top_k, self.normalize = ops, weight, top_k, normalize
        self.choice, self.bias = choice, bias

    def forward(self, x2) -> Routing:
        """``x2`` (N, hidden) -> the routing of its N tokens."""
        return route(self.ops.xp, product(self.ops, x2, self.weight), self.top_k,
                     self.normalize, self.choice,
                     None if self.bias is None else self.bias.data)

    def backward(self, routing: Routing, dweights, x2, sink, dprobs=None):
        """d x2 from the weights' (and probabilities') gradients; adds R's to ``sink``."""
        dlogits = route_backward(self.ops.xp, routing, dweights, self.normalize, dprobs,
                                 self.choice)
        return weight_grads(self.ops, dlogits.astype(x2.dtype), x2, self.weight, None, sink)


__all__ = ["Choice", "Routing", "TopKRouter", "load_balancing_loss", "route",
           "route_backward"]
