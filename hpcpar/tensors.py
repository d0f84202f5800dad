"""The parameter inventory of a Llama model: every tensor's Hugging Face name, shape and role.

Conversion, random init, loading, sharding and planning all start from this one list, so they
cannot disagree about what a checkpoint holds. Shapes are Hugging Face's: ``nn.Linear``
weights are ``[out_features, in_features]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import LlamaConfig

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    role: str            # "embed", "q", "k", "v", "o", "gate", "up", "down", "*_bias", norms, "head"
    layer: int | None    # decoder layer index, None for embedding / final norm / head

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def layer_tensors(cfg: LlamaConfig, i: int) -> list[TensorSpec]:
    """The tensors of decoder layer ``i``."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    p = f"model.layers.{i}."
    out = [
        TensorSpec(p + "input_layernorm.weight", (h,), "input_norm", i),
        TensorSpec(p + "self_attn.q_proj.weight", (q, h), "q", i),
        TensorSpec(p + "self_attn.k_proj.weight", (kv, h), "k", i),
        TensorSpec(p + "self_attn.v_proj.weight", (kv, h), "v", i),
        TensorSpec(p + "self_attn.o_proj.weight", (h, q), "o", i),
        TensorSpec(p + "post_attention_layernorm.weight", (h,), "post_attention_norm", i),
        TensorSpec(p + "mlp.gate_proj.weight", (inter, h), "gate", i),
        TensorSpec(p + "mlp.up_proj.weight", (inter, h), "up", i),
        TensorSpec(p + "mlp.down_proj.weight", (h, inter), "down", i),
    ]
    if cfg.attention_bias:
        out += [TensorSpec(p + "self_attn.q_proj.bias", (q,), "q_bias", i),
                TensorSpec(p + "self_attn.k_proj.bias", (kv,), "k_bias", i),
                TensorSpec(p + "self_attn.v_proj.bias", (kv,), "v_bias", i),
                TensorSpec(p + "self_attn.o_proj.bias", (h,), "o_bias", i)]
    if cfg.mlp_bias:
        out += [TensorSpec(p + "mlp.gate_proj.bias", (inter,), "gate_bias", i),
                TensorSpec(p + "mlp.up_proj.bias", (inter,), "up_bias", i),
                TensorSpec(p + "mlp.down_proj.bias", (h,), "down_bias", i)]
    return out


def stage_tensors(cfg: LlamaConfig, layers: range, first: bool, last: bool) -> list[TensorSpec]:
    """The tensors a pipeline stage needs: its layers, the embedding on the first stage, the
    final norm and head on the last. With tied embeddings the last stage reads the embedding
    as its head."""
    out = []
    if first or (last and cfg.tie_word_embeddings):
        out.append(TensorSpec(EMBED, (cfg.vocab_size, cfg.hidden_size), "embed", None))
    for i in layers:
        out += layer_tensors(cfg, i)
    if last:
        out.append(TensorSpec(FINAL_NORM, (cfg.hidden_size,), "final_norm", None))
        if not cfg.tie_word_embeddings:
            out.append(TensorSpec(LM_HEAD, (cfg.vocab_size, cfg.hidden_size), "head", None))
    return out


def model_tensors(cfg: LlamaConfig) -> list[TensorSpec]:
    """Every tensor a checkpoint of ``cfg`` stores (no ``lm_head`` when embeddings are tied)."""
    return stage_tensors(cfg, range(cfg.num_hidden_layers), first=True, last=True)

