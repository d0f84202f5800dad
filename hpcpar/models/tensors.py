"""The parameter inventory of a model: every tensor's Hugging Face name, shape and role, from
its config's features and its family's names (``hpcpar.models``).

Conversion, random init, loading, sharding and planning all start from this one list, so they
cannot disagree about what a checkpoint holds. Shapes are Hugging Face's: ``nn.Linear``
weights are ``[out_features, in_features]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class StageSpan:
    """The decoder layers a pipeline stage (or one model chunk of it) holds, and whether it
    holds the embedding (``first``) and the final norm and head (``last``)."""

    layers: range
    first: bool = True
    last: bool = True


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the model computes with. Most are stored as themselves; a part of a fused
    tensor (Phi-3's q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``) is rows
    [offset, offset + shape[0]) of the stored tensor ``stored`` of shape ``stored_shape``:
    each tp rank reads and writes its own slices of each part there."""

    name: str
    shape: tuple[int, ...]
    role: str            # "embed", "q", "k", "v", "o", "gate", "up", "down", "*_bias", norms,
                         # "head"; a MoE layer's "router", "expert_*", "shared_*"
    layer: int | None    # decoder layer index, None for embedding / final norm / head
    stored: str | None = None                  # the fused tensor this is rows of
    offset: int = 0                            # its first row there
    stored_shape: tuple[int, ...] | None = None
    expert: int | None = None                  # an expert's tensor: which expert

    @property
    def key(self):
        """Its key among its layer's tensors: the role, or (role, expert) for an expert's."""
        return self.role if self.expert is None else (self.role, self.expert)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def file_name(self) -> str:
        """The dataset that holds this tensor's values in a checkpoint."""
        return self.stored or self.name

    def file_region(self, region: tuple[slice, ...]) -> tuple[slice, ...]:
        """A region of this tensor as a region of its dataset (rows shifted by ``offset``)."""
        if not self.offset:
            return region
        rows = region[0]
        return (slice(rows.start + self.offset, rows.stop + self.offset),) + tuple(region[1:])


def stored_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """The tensors a checkpoint of ``cfg`` stores: each fused tensor once, whole (role
    "fused", a column split for chunking), the others as themselves."""
    out, seen = [], set()
    for spec in model_tensors(cfg):
        if spec.stored is None:
            out.append(spec)
        elif spec.stored not in seen:
            seen.add(spec.stored)
            out.append(TensorSpec(spec.stored, spec.stored_shape, "fused", spec.layer))
    return out


EXPERT_ROLES = ("expert_gate", "expert_up", "expert_down")


def layer_shapes(cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """Decoder layer ``layer``'s tensors by role, with their shapes: those the config's
    features call for (an expert's once, for every expert)."""
    h, q, kv, inter, hd = (cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size,
                           cfg.head_dim)
    out = {"input_norm": (h,), "q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q),
           "post_attention_norm": (h,)}
    if cfg.mla:
        del out["q"], out["k"], out["v"]
        out |= latent_shapes(cfg)
    if cfg.block_norms == "post":                  # norms of the blocks' outputs only
        del out["input_norm"], out["post_attention_norm"]
    if cfg.block_norms != "pre":
        out |= {"attn_out_norm": (h,), "mlp_out_norm": (h,)}
    if cfg.is_moe(layer):
        e, s = cfg.moe_intermediate_size, cfg.shared_expert_size
        out |= {"router": (cfg.num_experts, h), "expert_gate": (e, h), "expert_up": (e, h),
                "expert_down": (h, e)}
        if cfg.router_bias:                        # DeepSeek-V3's, for the choice only
            out["router_bias"] = (cfg.num_experts,)
        if s:
            out |= {"shared_gate": (s, h), "shared_up": (s, h), "shared_down": (h, s)}
            if cfg.shared_expert_gated:
                out["shared_expert_gate"] = (1, h)
    else:
        out |= {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    if cfg.qkv_bias:
        out |= {"q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,)}
    if cfg.o_bias:
        out["o_bias"] = (h,)
    if cfg.qk_norm:           # per head, or over the whole projection (qk_norm_whole)
        out |= ({"q_norm": (q,), "k_norm": (kv,)} if cfg.qk_norm_whole
                else {"q_norm": (hd,), "k_norm": (hd,)})
    if cfg.mlp_bias:
        out |= {"gate_bias": (inter,), "up_bias": (inter,), "down_bias": (h,)}
    return out


def latent_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Latent attention's tensors (``latent_attention``): q through its latent (or one
    q_proj), the kv latent with the rope key, its expansion into heads, o over v's heads."""
    h, nh, r = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    q = nh * cfg.qk_head_dim
    out = ({"q_a": (cfg.q_lora_rank, h), "q_a_norm": (cfg.q_lora_rank,),
            "q_b": (q, cfg.q_lora_rank)} if cfg.q_lora_rank else {"q": (q, h)})
    return out | {"kv_a": (r + cfg.head_dim, h), "kv_a_norm": (r,),
                  "kv_b": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
                  "o": (h, nh * cfg.v_head_dim)}


def inert_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors of transformers' model of ``cfg`` that compute nothing
    (``Family.inert``), name -> shape."""
    from . import family_of
    family = family_of(cfg.model_type)
    return {family.layer_name(role, i): shape for i in cfg.moe_layers
            for role, shape in family.inert(cfg).items()}


def layer_tensors(cfg: ModelConfig, i: int, experts: range | None = None) -> list[TensorSpec]:
    """The tensors of decoder layer ``i``, named as the model's family names them; the parts
    of a fused tensor are named ``FUSED[role]``. A MoE layer's experts: ``experts`` only
    (default: every one), each expert's gate, up and down together."""
    from . import family_of
    family = family_of(cfg.model_type)
    shapes = layer_shapes(cfg, i)
    out, fused_done = [], set()
    for role, shape in shapes.items():
        if role in EXPERT_ROLES:
            if role == EXPERT_ROLES[0]:
                for e in experts if experts is not None else range(cfg.num_experts):
                    out += [TensorSpec(family.layer_name(r, i, e), shapes[r], r, i, expert=e)
                            for r in EXPERT_ROLES]
            continue
        group = next((g for g in family.fused.values() if role in g), None)
        if group is None:
            out.append(TensorSpec(family.layer_name(role, i), shape, role, i))
            continue
        if group in fused_done:
            continue
        fused_done.add(group)
        stored = family.fused_name(group, i)
        rows = sum(shapes[r][0] for r in group)
        offset = 0
        for part in group:
            out.append(TensorSpec(f"{stored}[{part}]", shapes[part], part, i, stored, offset,
                                  (rows,) + shapes[part][1:]))
            offset += shapes[part][0]
    return out


def stage_tensors(cfg: ModelConfig, layers: range, first: bool, last: bool,
                  experts: range | None = None) -> list[TensorSpec]:
    """The tensors a pipeline stage needs: its layers (of a MoE layer, the experts
    ``experts`` only: this rank's ep block), the embedding on the first stage, the final
    norm and head on the last. With tied embeddings the last stage reads the embedding as
    its head."""
    out = []
    if first or (last and cfg.tie_word_embeddings):
        out.append(TensorSpec(EMBED, (cfg.vocab_size, cfg.hidden_size), "embed", None))
    for i in layers:
        out += layer_tensors(cfg, i, experts)
    if last:
        out.append(TensorSpec(FINAL_NORM, (cfg.hidden_size,), "final_norm", None))
        if not cfg.tie_word_embeddings:
            out.append(TensorSpec(LM_HEAD, (cfg.vocab_size, cfg.hidden_size), "head", None))
    return out


def model_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor a checkpoint of ``cfg`` stores (no ``lm_head`` when embeddings are tied)."""
    return stage_tensors(cfg, range(cfg.num_hidden_layers), first=True, last=True)

