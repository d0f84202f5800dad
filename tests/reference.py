"""An independent float64 NumPy Llama forward pass, for checking hpcpar's model.

Written from the Llama architecture (and transformers' LlamaForCausalLM) directly: it reads
tensors by their Hugging Face names and the raw config.json dict, and imports nothing from
hpcpar. No cache, no padding, no parallelism: the whole sequence every time.
"""

from __future__ import annotations

import math

import numpy as np


def _inv_freq(cfg: dict) -> np.ndarray:
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta = cfg.get("rope_theta", 10000.0)
    scaling = cfg.get("rope_scaling") or {}
    inv = np.array([theta ** (-2.0 * j / d) for j in range(d // 2)])
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < old / hi:
                out.append(f)
            elif wavelen > old / lo:
                out.append(f / factor)
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                out.append((1 - smooth) * f / factor + smooth * f)
        inv = np.array(out)
    return inv


def _rms(x, w, eps):
    return w * x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)


def _linear(t, x, name):
    y = x @ t[name + ".weight"].T
    return y + t[name + ".bias"] if name + ".bias" in t else y


def llama_logits(t: dict, cfg: dict, ids: np.ndarray) -> np.ndarray:
    """Logits (B, T, vocab) of token ids (B, T), all in float64."""
    t = {k: np.asarray(v, dtype=np.float64) for k, v in t.items()}
    B, T = ids.shape
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // nh
    eps = cfg.get("rms_norm_eps", 1e-6)
    angles = np.arange(T)[:, None] * _inv_freq(cfg)[None, :]          # (T, d/2)
    cos, sin = np.cos(angles), np.sin(angles)

    def rope(x):                                                       # (B, h, T, d)
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    x = t["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((T, T), dtype=bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, t[p + "input_layernorm.weight"], eps)
        q = _linear(t, h, p + "self_attn.q_proj").reshape(B, T, nh, d).transpose(0, 2, 1, 3)
        k = _linear(t, h, p + "self_attn.k_proj").reshape(B, T, nkv, d).transpose(0, 2, 1, 3)
        v = _linear(t, h, p + "self_attn.v_proj").reshape(B, T, nkv, d).transpose(0, 2, 1, 3)
        q, k = rope(q), rope(k)
        k = np.repeat(k, nh // nkv, axis=1)                            # (B, nh, T, d)
        v = np.repeat(v, nh // nkv, axis=1)
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d)
        s = np.where(causal, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = (a @ v).transpose(0, 2, 1, 3).reshape(B, T, nh * d)
        x = x + _linear(t, o, p + "self_attn.o_proj")
        h = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
        g = _linear(t, h, p + "mlp.gate_proj")
        x = x + _linear(t, g / (1 + np.exp(-g)) * _linear(t, h, p + "mlp.up_proj"),
                        p + "mlp.down_proj")
    x = _rms(x, t["model.norm.weight"], eps)
    head = t["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else t["lm_head.weight"]
    return x @ head.T


def greedy(t: dict, cfg: dict, prompt: np.ndarray, n: int) -> list[int]:
    """n greedy tokens after ``prompt`` (1-D), recomputing the whole sequence each step."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(llama_logits(t, cfg, np.array([seq]))[0, -1])))
    return seq[len(prompt):]
