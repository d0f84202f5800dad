"""The decoder's MLPs: the gated one (SwiGLU, GeGLU) split over tp, and a mixture of
experts' (the core's routed experts, and the shared expert some families add)."""

from __future__ import annotations

from ..parallel.comm import Communicator
from ..parallel.expert_parallel.moe import ExpertDispatch, Experts, MoE
from ..parallel.expert_parallel.routing import Choice, TopKRouter
from ..parallel.ops import Ops
from ..parallel.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                               column_parallel, frozen_matrix, product,
                                               row_parallel, weight_grads)
from .config import ModelConfig

GATE_UP = ("gate", "up")      # the MLP's projections of x that generation merges


class Mlp:
    """down(act(gate(x)) * up(x)); gate/up column-parallel, down row-parallel; ``act`` the
    gated activation op (SwiGLU's silu, GeGLU's tanh GELU).
    Communication: one AllReduce forward (in down), one backward (after gate/up)."""

    def __init__(self, ops: Ops, gate_up: ColumnParallelLinear, down: RowParallelLinear,
                 activation: str = "silu"):
        self.ops, self.gate_up, self.down = ops, gate_up, down
        self.act = ops.gated(activation)

    @classmethod
    def of(cls, ops: Ops, w: dict, tp: Communicator, merge: bool = False,
           activation: str = "silu") -> "Mlp":
        """From a layer's weights by role (gate, up, down and their biases)."""
        return cls(ops, column_parallel(ops, w, GATE_UP, tp, merge),
                   row_parallel(ops, w, "down", tp, merge), activation)

    def forward(self, x, train: bool = False):
        gate, up = self.gate_up(x)
        act = self.act.forward(gate, up)
        return self.down(act), ((x, gate, up, act) if train else None)

    def backward(self, dy, ctx, sink):
        x, gate, up, act = ctx
        dact = self.down.backward(dy, act, sink)                      # g backward: identity
        dgate, dup = self.act.backward(dact, gate, up)
        return self.gate_up.backward([dgate, dup], x, sink)


class MoeMlp:
    """A mixture-of-experts layer's MLP: the core's routed experts
    (``parallel.expert_parallel.moe.MoE``: the router, this rank's ep block of experts, each split
    over tp, and the all_to_alls between them), plus, in Qwen2-MoE, a shared expert every token
    runs, added through a sigmoid gate: y = moe(x) + sigmoid(x g^T) * shared(x)."""

    def __init__(self, ops: Ops, moe: MoE, shared: Mlp | None = None, shared_gate=None):
        self.ops, self.moe, self.shared, self.shared_gate = ops, moe, shared, shared_gate

    @classmethod
    def of(cls, ops: Ops, cfg: ModelConfig, w: dict, tp: Communicator,
           ep: Communicator | None, merge: bool) -> "MoeMlp":
        """From a layer's weights by key (``TensorSpec.key``): its experts are this rank's
        ep block, each expert's (role, e) keys."""
        xp = ops.xp
        dispatch = ExpertDispatch(cfg.num_experts, ep, xp)
        mine = range(dispatch.first, dispatch.first + dispatch.local)
        held = sorted(e for role, e in (k for k in w if isinstance(k, tuple))
                      if role == "expert_down")
        if held != list(mine):
            raise ValueError(f"this rank holds experts {held}, its ep block is {list(mine)}")
        gates, ups, downs = ([w.pop((role, e)) for e in mine]
                             for role in ("expert_gate", "expert_up", "expert_down"))
        if merge:
            experts = Experts.frozen(ops, gates, ups, downs, cfg.activation)
        else:
            experts = Experts(ops, [[g, u] for g, u in zip(gates, ups)], downs, cfg.activation)
        router = frozen_matrix(xp, [w["router"]]) if merge else w["router"]
        moe = MoE(ops, TopKRouter(ops, router, cfg.experts_per_token, cfg.norm_topk_prob,
                                  router_choice(cfg), w.get("router_bias")),
                  experts, dispatch, tp)
        if not cfg.shared_expert_size:
            return cls(ops, moe)
        roles = {"gate": w["shared_gate"], "up": w["shared_up"], "down": w["shared_down"]}
        shared = Mlp.of(ops, roles, tp, merge, cfg.activation)
        if not cfg.shared_expert_gated:                   # DeepSeek's: added as it is
            return cls(ops, moe, shared)
        gate = w["shared_expert_gate"]
        return cls(ops, moe, shared, frozen_matrix(xp, [gate]) if merge else gate)

    def forward(self, x, train: bool = False):
        y, ctx = self.moe.forward(x, train)
        if self.shared is None:
            return y, ctx
        s, shared_ctx = self.shared.forward(x, train)
        if self.shared_gate is None:
            y += s
            return y, ((ctx, shared_ctx) if train else None)
        z = product(self.ops, x, self.shared_gate)
        gate = 1.0 / (1.0 + self.ops.xp.exp(-z))
        y += gate * s
        return y, ((ctx, shared_ctx, x, s, gate) if train else None)

    def backward(self, dy, ctx, sink, dprobs=None):
        """``dprobs``: an auxiliary loss's gradient of the router's probabilities."""
        if self.shared is None:
            return self.moe.backward(dy, ctx, sink, dprobs)
        if self.shared_gate is None:
            ctx, shared_ctx = ctx
            dx = self.moe.backward(dy, ctx, sink, dprobs)
            dx += self.shared.backward(dy, shared_ctx, sink)
            return dx
        ctx, shared_ctx, x, s, gate = ctx
        dx = self.moe.backward(dy, ctx, sink, dprobs)
        dx += self.shared.backward(dy * gate, shared_ctx, sink)
        dz = (dy * s).sum(axis=-1, keepdims=True) * gate * (1.0 - gate)
        dx += weight_grads(self.ops, dz, x, self.shared_gate, None, sink)
        return dx


def router_choice(cfg: ModelConfig) -> Choice:
    """The config's way of choosing experts (DeepSeek's scores, groups and scaling)."""
    return Choice(cfg.router_scoring, cfg.expert_groups, cfg.topk_groups, cfg.group_score,
                  cfg.routed_scaling)
