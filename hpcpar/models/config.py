"""Typed configuration of a model, from a Hugging Face ``config.json``.

A frozen dataclass. Validation never stops at the first problem: it returns every
problem with the numbers involved, so one run tells the user everything to fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..parallel.errors import HpcparError
from ..parallel.tensor.splits import unit_split_problem

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ACTIVATIONS = ("silu", "gelu_tanh")          # the gated MLP's: SwiGLU, GeGLU
BLOCK_NORMS = ("pre", "sandwich", "post")    # norms of each block's input, both, its output


class ConfigError(HpcparError):
    """One or more problems in a configuration; ``problems`` lists each with its numbers."""

    def __init__(self, what: str, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{what}: " + "; ".join(self.problems))


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (``models.rope``): ``llama3`` is the Llama 3.1/3.2 piecewise
    rule, ``yarn`` YaRN's ramp between interpolated and original frequencies (Qwen's,
    DeepSeek's), ``longrope`` Phi-3's per-frequency short factors; the last two also scale
    cos and sin (``attention_factor``). ``where`` names the config.json field the parameters
    came from (for messages)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0             # yarn: the ramp's bounds, in rotations
    beta_slow: float = 1.0
    mscale: float | None = None         # yarn: attention_factor's terms (DeepSeek's)
    mscale_all_dim: float | None = None
    attention_factor: float | None = None   # cos and sin times it (None: the type's rule)
    truncate: bool = True               # yarn: the ramp's bounds rounded outwards
    short_factor: tuple[float, ...] = ()    # longrope: each frequency's divisor
    long_factor: tuple[float, ...] = ()     # longrope: past original_max_position_embeddings
    where: str = field(default="rope_parameters", compare=False)

    def problems(self) -> list[str]:
        """Parameters out of their domain for this rope type (a factor <= 0 divides every
        frequency by zero or flips it; high = low divides by zero)."""
        out = []
        used = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                "yarn": ("factor", "beta_fast", "beta_slow"), "longrope": ("factor",)}
        for name in used.get(self.rope_type, ()):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                out.append(f"{self.where} {name} must be a positive finite number, got {value}")
        for value in self.short_factor + self.long_factor:
            if not (math.isfinite(value) and value > 0):
                out.append(f"{self.where} short_factor and long_factor must be positive "
                           f"finite numbers, got {value}")
                break
        if self.rope_type == "llama3" and self.high_freq_factor == self.low_freq_factor:
            out.append(f"{self.where} high_freq_factor {self.high_freq_factor} equals "
                       "low_freq_factor: llama3 rope divides by their difference")
        if self.rope_type in ("llama3", "yarn", "longrope"):
            old = self.original_max_position_embeddings
            if not isinstance(old, int) or isinstance(old, bool) or old < 1:
                out.append(f"{self.where} original_max_position_embeddings must be a positive "
                           f"integer, got {old!r}")
        return out


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Hugging Face config that define the computation: Llama's, and the
    features by which the other families differ (``hpcpar.models``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False               # biases on q, k, v (Qwen2; Llama's attention_bias)
    o_bias: bool = False                 # a bias on o (Llama's attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False                # per-head RMSNorm of q and k before rotary (Qwen3)
    qk_norm_whole: bool = False          # ... over the whole q and k projections (OLMo 2)
    norm_offset: float = 0.0             # RMSNorm scales by (offset + w) (Gemma: 1)
    embed_scale: float = 1.0             # the embedding's output times this (Gemma: sqrt(h))
    activation: str = "silu"             # the gated MLP's: silu (SwiGLU), gelu_tanh (GeGLU)
    sliding_window: int | None = None    # attention to the last W keys only (Mistral)
    window_layers: tuple[int, ...] | None = None   # the layers with that window (None: all;
                                         # Gemma 2's every other one, Qwen2's from a layer on)
    # norms around each block: "pre" (Llama: of the block's input), "sandwich" (Gemma 2: of
    # its input and of its output), "post" (OLMo 2: of its output only)
    block_norms: str = "pre"
    attn_scale: float | None = None      # the scores' scale (None: 1/sqrt(head_dim); Gemma 2:
                                         # query_pre_attn_scalar^-1/2)
    attn_softcap: float | None = None    # scores through cap tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None   # the logits through cap tanh(z / cap) (Gemma 2)
    local_rope_theta: float | None = None  # the windowed layers' own rope base, their rope
                                         # the default one (Gemma 3's rope_local_base_freq)
    partial_rotary: float = 1.0          # the share of head_dim rotary turns (Phi-3.5/4 < 1)
    # mixture of experts (Mixtral, Qwen-MoE): the layers in ``moe_layers`` route each token to
    # ``experts_per_token`` of ``num_experts`` experts (``hpcpar.parallel.expert_parallel.moe``)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0       # an expert's intermediate size
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False         # the k weights renormalised to sum to 1 (Mixtral)
    shared_expert_size: int = 0          # a shared expert beside the routed ones (Qwen2-MoE)
    router_aux_loss_coef: float = 0.0    # training's load-balancing loss (when the config
                                         # sets output_router_logits), else 0
    router_jitter_noise: float = 0.0     # Mixtral's training-time input jitter
    # DeepSeek's routers (``parallel.expert_parallel.routing``): scores by softmax or sigmoid,
    # a bias added for the choice only, the choice limited to the best ``topk_groups`` of
    # ``expert_groups`` groups (a group's score its best expert's, "max", or its best two's
    # sum, "top2"), the weights times ``routed_scaling``; a shared expert without a gate
    router_scoring: str = "softmax"
    router_bias: bool = False            # e_score_correction_bias (DeepSeek-V3)
    expert_groups: int = 1               # n_group
    topk_groups: int = 1                 # topk_group
    group_score: str = "max"
    routed_scaling: float = 1.0          # routed_scaling_factor
    shared_expert_gated: bool = True     # Qwen2-MoE's sigmoid gate; DeepSeek's none
    # multi-head latent attention (DeepSeek-V2/V3, ``models.latent_attention``): keys and
    # values from a latent of ``kv_lora_rank`` per token (0: ordinary attention), queries
    # through a latent of ``q_lora_rank`` (0: one q_proj); head_dim is the rope part's
    # (qk_rope_head_dim), each head's q and k (qk_nope_head_dim + head_dim) and v
    # (v_head_dim) apart from it
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False        # the rope part's pairs (x0, x1), (x2, x3), ...
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @property
    def positions(self) -> tuple[int, str]:
        """The positions a row may hold, and the field that sets them: max_position_embeddings,
        or with longrope its original_max_position_embeddings, past which transformers turns
        to the long factors in the middle of a sequence (for the whole batch), which hpcpar
        does not."""
        s = self.rope_scaling
        if s.rope_type == "longrope" and s.original_max_position_embeddings < (
                self.max_position_embeddings):
            return (s.original_max_position_embeddings, f"longrope's "
                    f"original_max_position_embeddings {s.original_max_position_embeddings} "
                    f"(past it transformers turns to the long factors within a sequence, "
                    f"which hpcpar does not run)")
        return self.max_position_embeddings, (f"max_position_embeddings "
                                              f"{self.max_position_embeddings}")

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head rotary turns (``partial_rotary_factor``): the first."""
        return int(self.head_dim * self.partial_rotary)

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek's)."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """A head's dimensions in q and k: head_dim, or MLA's unturned and turned parts."""
        return self.qk_nope_head_dim + self.head_dim if self.mla else self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.qk_head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``'s attention, or None (all causal keys)."""
        if self.window_layers is not None and layer not in self.window_layers:
            return None
        return self.sliding_window

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is routed experts."""
        return layer in self.moe_layers

    @property
    def dense_layers(self) -> int:
        return self.num_hidden_layers - len(self.moe_layers)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], source: str = "config") -> "ModelConfig":
        """Parse a ``config.json`` dict as written by transformers 4.x or 5.x, into the model
        transformers' class of its family builds from it, or refuse it in one line.

        4.x keeps ``rope_theta`` and ``rope_scaling`` at the top level; 5.x folds both into
        ``rope_parameters``. The family (``model_type``) says how the rest reads and what a
        field left out means (its transformers class's default); a ``model_type`` of no
        family is one error naming the supported ones. A field of the wrong JSON type, a
        value transformers refuses, or one hpcpar cannot compute exactly (an activation or
        rope type it does not have, a number out of its domain) is refused with its value.
        """
        from . import FAMILIES
        from .family import FieldError, MalformedField
        if not isinstance(hf, Mapping):
            raise ConfigError(source, [f"holds a JSON {_json_kind(hf)}, not an object of "
                                       "fields; a model's config.json is one JSON object"])
        model_type = hf.get("model_type", "llama")
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            raise ConfigError(source, [f"model_type {model_type!r} is not supported; hpcpar "
                                       f"runs {', '.join(sorted(FAMILIES))}"])
        family = FAMILIES[model_type]
        archs = hf.get("architectures") or [family.architecture]
        if not isinstance(archs, list) or family.architecture not in archs:
            raise ConfigError(source, [
                f"architectures {archs!r} is not [{family.architecture!r}], the causal LM of "
                f"model_type {model_type!r}; hpcpar runs causal LMs only"])
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ConfigError(source, [f"missing required field(s) {', '.join(missing)}"])

        quantized = hf.get("quantization_config")
        if quantized is not None:               # e.g. DeepSeek-V3's released fp8 weights
            method = quantized.get("quant_method") if isinstance(quantized, Mapping) else None
            raise ConfigError(source, [
                f"quantization_config ({method if method else repr(quantized)}): hpcpar reads "
                "float weights (float32, float16, bfloat16) only; dequantize the checkpoint "
                "first (DeepSeek-V3's: its fp8_cast_bf16.py) and drop quantization_config"])
        full = family.defaults | dict(hf)          # what transformers' class takes for the rest
        try:
            full = family.prepare(full)
            cfg = cls._build(full, source, family.features(full) | {"model_type": model_type})
        except FieldError as e:
            malformed = "malformed value: " if isinstance(e, MalformedField) else ""
            raise ConfigError(source, [malformed + str(e)]) from None
        except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
            raise ConfigError(source, [f"malformed value ({type(e).__name__}: {e}); fields must "
                                       "be numbers as transformers writes them"]) from None
        problems = cfg.problems()
        if cfg.partial_rotary != 1.0 and not family.partial_rotary:
            problems.append(f"partial_rotary_factor {cfg.partial_rotary}: "
                            f"{family.architecture} turns every dimension of a head")
        rope_type = cfg.rope_scaling.rope_type
        if family.rope_types is not None and rope_type not in family.rope_types:
            problems.append(f"rope type {rope_type!r} is not one {family.architecture} runs "
                            f"(transformers accepts {', '.join(family.rope_types)})")
        if problems:
            raise ConfigError(source, problems)
        return cfg

    @classmethod
    def _build(cls, hf: Mapping[str, Any], source: str, features: dict) -> "ModelConfig":
        from .family import flag
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads")              # null: as many as the heads
        kv_heads = heads if kv_heads is None else kv_heads
        head_dim = hf.get("head_dim")                         # null: hidden / heads
        if head_dim is None:
            head_dim = hf["hidden_size"] // heads if heads else 0
        rope_theta, scaling, partial = _parse_rope(hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(**dict(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=_number(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope_theta=rope_theta, rope_scaling=scaling, partial_rotary=partial,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=flag(hf, "tie_word_embeddings"),
            bos_token_id=hf.get("bos_token_id"), eos_token_id=eos_ids,
            pad_token_id=hf.get("pad_token_id")) | features)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            hf = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise HpcparError(f"{path}: no such file; a Hugging Face model folder holds "
                              "config.json beside its weights") from None
        except (IsADirectoryError, UnicodeDecodeError) as e:
            raise HpcparError(f"{path}: not a readable config.json ({e})") from None
        except json.JSONDecodeError as e:
            raise HpcparError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf(hf, source=str(path))

    def problems(self) -> list[str]:
        """Internal inconsistencies, each with its numbers (empty when the config is usable)."""
        out = []
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                out.append(f"{name} must be a positive integer, got {value!r}")
        if out:
            return out
        if self.num_attention_heads % self.num_key_value_heads:
            out.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                       f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            out.append(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.eos_token_id):
            out.append(f"eos_token_id must be an integer or a list of integers, got "
                       f"{list(self.eos_token_id)}")
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                out.append(f"{name} must be an integer or null, got {value!r}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            out.append(f"rms_norm_eps must be a positive finite number, got {self.rms_norm_eps}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            out.append(f"rope_theta must be a positive finite number, got {self.rope_theta}")
        out += self.rope_scaling.problems()
        if self.activation not in ACTIVATIONS:
            out.append(f"activation {self.activation!r} is not supported (supported: "
                       f"{', '.join(ACTIVATIONS)})")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                                   or window < 1):
            out.append(f"sliding_window must be a positive integer or null, got {window!r}")
        rotated = int(self.head_dim * self.partial_rotary)
        if not 0 < self.partial_rotary <= 1 or rotated % 2:
            out.append(f"partial_rotary_factor {self.partial_rotary} must be in (0, 1] and "
                       f"turn an even number of each head's {self.head_dim} dimensions "
                       f"(it turns {rotated})")
        elif (self.rope_scaling.rope_type == "longrope"
              and len(self.rope_scaling.short_factor) != rotated // 2):
            out.append(f"{self.rope_scaling.where} short_factor holds "
                       f"{len(self.rope_scaling.short_factor)} numbers, and rotary turns "
                       f"{rotated // 2} frequencies")
        if self.block_norms not in BLOCK_NORMS:
            out.append(f"block_norms {self.block_norms!r} is not one of {', '.join(BLOCK_NORMS)}")
        for name in ("attn_scale", "attn_softcap", "final_softcap", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                out.append(f"{name} must be a positive finite number or null, got {value}")
        out += self._moe_problems() + self._mla_problems()
        if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            out.append(f"rope type {self.rope_scaling.rope_type!r} is not supported "
                       f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        return out

    def _moe_problems(self) -> list[str]:
        if not self.moe_layers:
            return []
        out = []
        for name in ("num_experts", "experts_per_token", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                out.append(f"{name} must be a positive integer in a mixture of experts, got "
                           f"{value!r}")
        if out:
            return out
        if self.experts_per_token > self.num_experts:
            out.append(f"num_experts_per_tok {self.experts_per_token} is more than the "
                       f"{self.num_experts} experts")
        size = self.shared_expert_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            out.append(f"shared_expert_intermediate_size must be an integer >= 0, got {size!r}")
        for name in ("router_aux_loss_coef", "router_jitter_noise"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                out.append(f"{name} must be a finite number >= 0, got {value}")
        return out + self._router_problems()

    def _mla_problems(self) -> list[str]:
        if not self.mla:
            return []
        out = [f"{name} must be a positive integer in latent attention, got {value!r}"
               for name, value in (("qk_nope_head_dim", self.qk_nope_head_dim),
                                   ("v_head_dim", self.v_head_dim))
               if not isinstance(value, int) or isinstance(value, bool) or value < 1]
        if self.num_key_value_heads != self.num_attention_heads:
            out.append(f"num_key_value_heads {self.num_key_value_heads} is not "
                       f"num_attention_heads {self.num_attention_heads}: latent attention "
                       "expands one latent into every head's keys and values")
        return out

    def _router_problems(self) -> list[str]:
        out = []
        groups, best = self.expert_groups, self.topk_groups
        if self.router_scoring not in ("softmax", "sigmoid"):
            out.append(f"scoring_func {self.router_scoring!r} is not softmax or sigmoid")
        if not (isinstance(groups, int) and isinstance(best, int) and 1 <= best <= groups
                and self.num_experts % groups == 0):
            out.append(f"n_group {groups} and topk_group {best}: the groups must divide the "
                       f"{self.num_experts} experts and 1 <= topk_group <= n_group")
        elif self.experts_per_token > best * (self.num_experts // groups):
            out.append(f"num_experts_per_tok {self.experts_per_token} is more than the "
                       f"{best * (self.num_experts // groups)} experts of the topk_group "
                       f"{best} groups a token may choose from")
        elif self.group_score == "top2" and self.num_experts // groups < 2:
            out.append(f"n_group {groups}: a group's score is its best two experts' sum, and "
                       f"each group holds {self.num_experts // groups}")
        if not (math.isfinite(self.routed_scaling) and self.routed_scaling > 0):
            out.append(f"routed_scaling_factor must be a positive finite number, got "
                       f"{self.routed_scaling}")
        return out

    def valid_tp_sizes(self, limit: int = 64) -> list[int]:
        """Tensor-parallel sizes this model can be split over (see ``tp_problems``)."""
        return [tp for tp in range(1, limit + 1) if not tp_problems(self, tp)]


# the parameters each rope type needs, which transformers refuses a config without
ROPE_REQUIRED = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                 "yarn": ("factor",), "longrope": ("short_factor", "long_factor")}


def _parse_rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling, float]:
    """(rope_theta, the scaling, partial_rotary_factor) as transformers 5 reads them: a
    non-empty ``rope_scaling`` (4.x) wins over ``rope_parameters`` (5.x); ``rope_theta`` and
    ``partial_rotary_factor`` inside it win over the top-level fields; llama3's
    ``original_max_position_embeddings`` is the top-level field where there is one, else the
    rope's own, else ``max_position_embeddings``. A rope field that is not an object, a
    parameter that is not a number, or a required one left out is a ``FieldError``."""
    from .family import FieldError, MalformedField
    for key in ("rope_scaling", "rope_parameters"):
        value = hf.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise MalformedField(f"{key} must be an object of rope parameters or null, got "
                                 f"a JSON {_json_kind(value)} {value!r:.60}")
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(where) or {}
    nested = [k for k, v in rope.items() if isinstance(v, Mapping)]
    if nested:
        raise FieldError(f"{where} per layer type ({', '.join(map(str, nested))}) is not "
                         "supported; hpcpar runs one rope for every layer")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(rope_type, str):
        raise MalformedField(f"{where} rope_type must be a string, got {rope_type!r}")
    missing = [k for k in ROPE_REQUIRED.get(rope_type, ()) if k not in rope]
    if missing:
        raise FieldError(f"{where} of rope_type {rope_type!r} lacks {', '.join(missing)} "
                         "(transformers refuses it too)")
    theta = _number(rope.get("rope_theta", hf.get("rope_theta", 10000.0)), "rope_theta")
    partial = _number(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)),
                      "partial_rotary_factor")
    old = hf.get("original_max_position_embeddings",
                 rope.get("original_max_position_embeddings", hf.get("max_position_embeddings")))
    if rope_type not in ("llama3", "yarn", "longrope"):
        old = 8192                                          # unused
    factor = rope.get("factor")
    if factor is None and rope_type == "longrope":          # Phi-3: the context's growth
        factor = hf.get("max_position_embeddings", 2048) / old
    optional = {name: _number(rope[name], f"{where} {name}")
                for name in ("mscale", "mscale_all_dim", "attention_factor")
                if rope.get(name) is not None}
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=_number(1.0 if factor is None else factor, f"{where} factor"),
        low_freq_factor=_number(rope.get("low_freq_factor", 1.0), f"{where} low_freq_factor"),
        high_freq_factor=_number(rope.get("high_freq_factor", 4.0),
                                 f"{where} high_freq_factor"),
        original_max_position_embeddings=old,
        beta_fast=_number(rope.get("beta_fast") or 32, f"{where} beta_fast"),
        beta_slow=_number(rope.get("beta_slow") or 1, f"{where} beta_slow"),
        truncate=bool(rope.get("truncate", True)),
        short_factor=_numbers(rope.get("short_factor", ()), f"{where} short_factor"),
        long_factor=_numbers(rope.get("long_factor", ()), f"{where} long_factor"),
        where=where, **optional), partial


def _numbers(value, name: str) -> tuple[float, ...]:
    """A JSON list of numbers as floats, or a ``FieldError``."""
    from .family import MalformedField
    if not isinstance(value, (list, tuple)):
        raise MalformedField(f"{name} must be a list of numbers, got {value!r:.60}")
    return tuple(_number(v, name) for v in value)


def _number(value, name: str) -> float:
    """A JSON number as a float (domains are checked by ``problems``), or a ``FieldError``:
    ``true``, a string or null is not a number here, though Python would take some."""
    from .family import FieldError, MalformedField
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedField(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise FieldError(f"{name} {value} is too large for a float") from None


def _json_kind(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def tp_problems(model: ModelConfig, tp: int) -> list[str]:
    """Why ``model`` cannot be split over ``tp`` ranks (empty when it can)."""
    out = []
    if model.num_attention_heads % tp:
        out.append(f"num_attention_heads {model.num_attention_heads} is not divisible by tp {tp}")
    kv_problem = unit_split_problem(model.num_key_value_heads, tp)     # KV heads may replicate
    if kv_problem:
        out.append(f"num_key_value_heads {kv_problem.replace(' of ', ' of tp ')}")
    if model.dense_layers and model.intermediate_size % tp:
        out.append(f"intermediate_size {model.intermediate_size} is not divisible by tp {tp}")
    if model.moe_layers and model.moe_intermediate_size % tp:
        out.append(f"the experts' intermediate size {model.moe_intermediate_size} is not "
                   f"divisible by tp {tp}")
    if model.moe_layers and model.shared_expert_size % tp:
        out.append(f"shared_expert_intermediate_size {model.shared_expert_size} is not "
                   f"divisible by tp {tp}")
    return out


def ep_problems(model: ModelConfig, ep: int) -> list[str]:
    """Why ``model``'s experts cannot be split over ``ep`` ranks (empty when they can)."""
    if ep == 1:
        return []
    if not model.moe_layers:
        return [f"ep {ep} splits a mixture of experts' experts, but {model.model_type} has "
                "none; use ep 1"]
    if model.num_experts % ep:
        return [f"ep {ep} does not divide the {model.num_experts} experts; choose an ep that "
                f"divides {model.num_experts}"]
    return []
