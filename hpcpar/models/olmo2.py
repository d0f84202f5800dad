"""OLMo 2: a norm of each block's output instead of its input (``block_norms`` "post":
x + norm(attention(x)), then x + norm(mlp(x))), and RMSNorms of q and k over their whole
projections (one weight of q_size, one of kv_size), before the heads are cut and rotary
turns them. Under tp the weights are split as q and k are, and each rank's norm sums its
squares with the other ranks' (``norms.SpanNorms``: one AllReduce of two numbers per
token forward, q's and k's, one backward)."""

from .family import LLAMA_NAMES, Family, activation, flag

OLMO2_NAMES = {role: name for role, name in LLAMA_NAMES.items()
               if role not in ("input_norm", "post_attention_norm")}
OLMO2_NAMES |= {"attn_out_norm": "post_attention_layernorm.weight",
                "mlp_out_norm": "post_feedforward_layernorm.weight"}


def _features(hf) -> dict:
    bias = flag(hf, "attention_bias")
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True,
            "qk_norm_whole": True, "block_norms": "post", "activation": activation(hf)}


FAMILY = Family("olmo2", "Olmo2ForCausalLM", "a norm of each block's output, not its input; "
                                             "RMSNorms of q and k over the whole projection "
                                             "before rotary (under tp their weights split as q "
                                             "and k are, each token's sum of squares AllReduced "
                                             "over the tp group)", features=_features,
                names=OLMO2_NAMES,
                defaults={"hidden_act": "silu", "rms_norm_eps": 1e-5,
                          "max_position_embeddings": 2048, "tie_word_embeddings": False,
                          "num_key_value_heads": None, "head_dim": None})
