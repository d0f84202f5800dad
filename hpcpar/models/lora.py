"""LoRA adapters of a model's linear projections (Hu et al. 2021, as peft's ``LoraConfig``
builds them): which projections a run may adapt, the adapter's tensors as ``TensorSpec``s
beside their base, and how each is split over tp.

    W x  ->  W x + s B A x        A [r, in], B [out, r], s = lora_alpha / r (not rslora)

A target is a role (``q, k, v, o, gate, up, down``: Hugging Face's ``q_proj`` ...
``down_proj`` modules). An adapter is split as its base (``layers.LoraAdapter``): a
column-parallel base (q, k, v, gate, up) has A replicated and B cut as the base's rows (by
heads, KV heads replicated as theirs), a row-parallel one (o, down) has A cut as the base's
columns and B replicated. So the cut half's spec takes its base's role, whose placement is
exactly that cut, and the replicated half the role ``lora`` (``Replicate()``, registered
below in the split plan's table).

Names: the base's module name plus ``.lora_A.weight`` / ``.lora_B.weight``
(``model.layers.0.self_attn.q_proj.lora_A.weight``): peft's names without its
``base_model.model.`` prefix (``checkpoint.peft``).

A mixture's experts (targets ``experts.gate_up`` and ``experts.down``) are adapted as peft
adapts transformers' fused expert parameters (``mlp.experts.gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I], ``LoraConfig(target_parameters=...)``): per expert e, one A_e [r, H]
for gate and up together and B_e [2I, r], whose first I rows adapt the gate and the last I
the up (``gate_e x + s B_e[:I] A_e x``, ``up_e x + s B_e[I:] A_e x``), and A_e [r, I], B_e
[H, r] for down. hpcpar keeps them per expert, so each is held, split and reduced as its
expert's tensors are (its ep block, the ``edp`` group): A_e under
``model.layers.{i}.mlp.experts.{e}.gate_up_proj.lora_A.weight``, the gate's and the up's
rows of B_e under ``...experts.{e}.gate_proj.lora_B.weight`` and ``...up_proj.lora_B.weight``
(each split over tp as its base, A whole); down's as a row-parallel target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..parallel.tensor.placement import Replicate
from .config import ModelConfig
from .sharding import PLACEMENT_OF_ROLE
from .tensors import TensorSpec, layer_shapes

TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "experts.gate_up", "experts.down")
COLUMN_TARGETS = ("q", "k", "v", "gate", "up")
EXPERT_TARGETS = ("experts.gate_up", "experts.down")
# an expert target's halves: (its base's role, the name of its module in peft's folder)
EXPERT_MODULES = {"experts.gate_up": "mlp.experts.gate_up_proj",
                  "experts.down": "mlp.experts.down_proj"}
DEFAULT_TARGETS = ("q", "v")             # peft's default for the Llama families
REPLICATED = "lora"                      # the role of an adapter's replicated half
PLACEMENT_OF_ROLE.setdefault(REPLICATED, Replicate())


@dataclass(frozen=True)
class AdapterSpec(TensorSpec):
    """One half (``half``: "A" or "B") of the adapter of ``base`` (its base tensor's name),
    whose role is ``target``; a B names its A (``a``: an expert's gate and up share one)."""

    base: str = ""
    target: str = ""
    half: str = ""
    a: str = ""


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def module_leaf(cfg: ModelConfig, role: str) -> str:
    """The Hugging Face module name of ``role`` in a layer (``q_proj``), as peft's
    ``target_modules`` names it."""
    from . import family_of
    return family_of(cfg.model_type).names[role].rsplit(".", 2)[-2]


def target_problems(cfg: ModelConfig, targets, rank) -> list[str]:
    """Why ``targets`` at ``rank`` cannot adapt ``cfg``'s model (empty: they can)."""
    from . import family_of
    out = []
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        out.append(f"LoRA target(s) {', '.join(map(repr, unknown)) or 'none'}: choose among "
                   f"{','.join(TARGETS)}")
        return out
    family = family_of(cfg.model_type)
    fused = [t for t in targets if any(t in g for g in family.fused.values())]
    if fused:
        out.append(f"LoRA target(s) {','.join(fused)}: {cfg.model_type} stores them fused "
                   f"({', '.join(family.fused)}), which LoRA does not adapt here; target "
                   "o,down")
    latent = [t for t in targets if t in ("q", "k", "v")]
    if latent and cfg.mla:
        out.append(f"LoRA target(s) {','.join(latent)}: {cfg.model_type}'s latent attention "
                   "projects through q_a/q_b and kv_a/kv_b, which LoRA does not adapt here; "
                   "target o")
    experts = [t for t in targets if t in ("gate", "up", "down")]
    if experts and cfg.moe_layers:
        out.append(f"LoRA target(s) {','.join(experts)}: {cfg.model_type}'s MLPs are "
                   "mixtures of experts; target experts.gate_up,experts.down (each expert's "
                   "projections) or the attention's q,k,v,o")
    routed = [t for t in targets if t in EXPERT_TARGETS]
    if routed and not cfg.moe_layers:
        out.append(f"LoRA target(s) {','.join(routed)}: {cfg.model_type} has no experts; "
                   "target gate,up,down")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        out.append(f"LoRA rank {rank!r}: give a positive integer (--lora-rank 8)")
    elif not out:
        shapes = layer_shapes(cfg, cfg.moe_layers[0] if routed else 0)
        shapes |= {"experts.gate_up": shapes.get("expert_gate"),
                   "experts.down": shapes.get("expert_down")}
        smallest = min(min(shapes[t]) for t in targets)
        if rank > smallest:
            out.append(f"LoRA rank {rank} is above the smallest dimension of the targets' "
                       f"weights ({smallest}); choose at most {smallest}")
    return out


def adapter_specs(cfg: ModelConfig, layers, settings: LoraSettings,
                  experts=None) -> list[AdapterSpec]:
    """The adapters of ``layers``, per layer and target: A then its B (an expert's gate and
    up: A, then the gate's B and the up's); of the experts, those of ``experts`` only (a
    rank's ep block; default: every one)."""
    from . import family_of
    family = family_of(cfg.model_type)
    out = []
    for i in layers:
        shapes = layer_shapes(cfg, i)
        for t in TARGETS:
            if t not in settings.targets:
                continue
            if t in EXPERT_TARGETS:
                if cfg.is_moe(i):
                    out += _expert_specs(cfg, family, i, t, settings.rank, shapes,
                                         range(cfg.num_experts) if experts is None
                                         else experts)
                continue
            base = family.layer_name(t, i)
            module = base.removesuffix(".weight")
            rows, cols = shapes[t]
            column = t in COLUMN_TARGETS
            out.append(AdapterSpec(f"{module}.lora_A.weight", (settings.rank, cols),
                                   REPLICATED if column else t, i, base=base, target=t,
                                   half="A"))
            out.append(AdapterSpec(f"{module}.lora_B.weight", (rows, settings.rank),
                                   t if column else REPLICATED, i, base=base, target=t,
                                   half="B", a=f"{module}.lora_A.weight"))
    return out


def _expert_specs(cfg: ModelConfig, family, i: int, target: str, r: int, shapes: dict,
                  experts) -> list[AdapterSpec]:
    """The adapters of layer ``i``'s experts ``experts`` for ``target``: per expert, A then
    its B (gate_up: one A, then the gate's B and the up's)."""
    out = []
    for e in experts:
        module = f"model.layers.{i}.mlp.experts.{e}"
        if target == "experts.gate_up":
            gate, up = (family.layer_name(role, i, e) for role in ("expert_gate", "expert_up"))
            a = f"{module}.gate_up_proj.lora_A.weight"
            out += [AdapterSpec(a, (r, shapes["expert_gate"][1]), REPLICATED, i, expert=e,
                                base=gate, target=target, half="A"),
                    AdapterSpec(f"{module}.gate_proj.lora_B.weight",
                                (shapes["expert_gate"][0], r), "expert_gate", i, expert=e,
                                base=gate, target=target, half="B", a=a),
                    AdapterSpec(f"{module}.up_proj.lora_B.weight",
                                (shapes["expert_up"][0], r), "expert_up", i, expert=e,
                                base=up, target=target, half="B", a=a)]
        else:
            down = family.layer_name("expert_down", i, e)
            rows, cols = shapes["expert_down"]
            a = f"{module}.down_proj.lora_A.weight"
            out += [AdapterSpec(a, (r, cols), "expert_down", i, expert=e, base=down,
                                target=target, half="A"),
                    AdapterSpec(f"{module}.down_proj.lora_B.weight", (rows, r), REPLICATED, i,
                                expert=e, base=down, target=target, half="B", a=a)]
    return out


def adapter_pairs(specs: list[AdapterSpec]) -> list[tuple[AdapterSpec, AdapterSpec]]:
    """(A, B) for every B of ``specs``: what each adapted weight adds, s B A."""
    by_name = {s.name: s for s in specs}
    return [(by_name[s.a], s) for s in specs if s.half == "B"]


def initial_adapter(spec: AdapterSpec, seed: int) -> np.ndarray:
    """The whole tensor a new adapter starts from, as peft initialises it: A
    kaiming-uniform with a = sqrt(5) (uniform in +-1/sqrt(in)), B zero. Drawn from a
    generator keyed by (seed, layer, target): the same under every layout."""
    if spec.half == "B":
        return np.zeros(spec.shape, np.float32)
    key = [seed, spec.layer, TARGETS.index(spec.target)]
    rng = np.random.default_rng(key if spec.expert is None else key + [spec.expert])
    bound = 1.0 / np.sqrt(spec.shape[1])
    return rng.uniform(-bound, bound, spec.shape).astype(np.float32)
