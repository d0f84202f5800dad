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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..parallel.tensor.placement import Replicate
from .config import ModelConfig
from .sharding import PLACEMENT_OF_ROLE
from .tensors import TensorSpec, layer_shapes

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
COLUMN_TARGETS = ("q", "k", "v", "gate", "up")
DEFAULT_TARGETS = ("q", "v")             # peft's default for the Llama families
REPLICATED = "lora"                      # the role of an adapter's replicated half
PLACEMENT_OF_ROLE.setdefault(REPLICATED, Replicate())


@dataclass(frozen=True)
class AdapterSpec(TensorSpec):
    """One half (``half``: "A" or "B") of the adapter of ``base`` (its base tensor's name),
    whose role is ``target``."""

    base: str = ""
    target: str = ""
    half: str = ""


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
    experts = [t for t in targets if t in ("gate", "up", "down")]
    if experts and cfg.moe_layers:
        out.append(f"LoRA target(s) {','.join(experts)}: the experts' projections of "
                   f"{cfg.model_type} are not adapted; target the attention's q,k,v,o")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        out.append(f"LoRA rank {rank!r}: give a positive integer (--lora-rank 8)")
    elif not out:
        shapes = layer_shapes(cfg, 0)
        smallest = min(min(shapes[t]) for t in targets)
        if rank > smallest:
            out.append(f"LoRA rank {rank} is above the smallest dimension of the targets' "
                       f"weights ({smallest}); choose at most {smallest}")
    return out


def adapter_specs(cfg: ModelConfig, layers, settings: LoraSettings) -> list[AdapterSpec]:
    """The adapters of ``layers``, per layer and target: A then B."""
    from . import family_of
    family = family_of(cfg.model_type)
    out = []
    for i in layers:
        shapes = layer_shapes(cfg, i)
        for t in TARGETS:
            if t not in settings.targets:
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
                                   half="B"))
    return out


def initial_adapter(spec: AdapterSpec, seed: int) -> np.ndarray:
    """The whole tensor a new adapter starts from, as peft initialises it: A
    kaiming-uniform with a = sqrt(5) (uniform in +-1/sqrt(in)), B zero. Drawn from a
    generator keyed by (seed, layer, target): the same under every layout."""
    if spec.half == "B":
        return np.zeros(spec.shape, np.float32)
    rng = np.random.default_rng([seed, spec.layer, TARGETS.index(spec.target)])
    bound = 1.0 / np.sqrt(spec.shape[1])
    return rng.uniform(-bound, bound, spec.shape).astype(np.float32)
