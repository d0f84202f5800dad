"""The decoder every family runs, as one pipeline stage on one tensor-parallel rank, for
generation and training alike.

    x = embed(ids) * embed_scale                      first stage only
    for each layer of this stage:
        x = x + o_proj(attention(rope(q, k), v))      over rms_norm(x); q, k each through
                                                      a per-head rms_norm first (qk_norm)
        x = x + down_proj(act(gate_proj(h)) * up_proj(h)),  h = rms_norm(x)
    logits = lm_head(rms_norm(x))                     last stage only

rms_norm scales by (norm_offset + w); act is silu (SwiGLU) or the tanh GELU (GeGLU). The
families' variants of the block (``ModelConfig.block_norms``): Gemma 2 also normalizes each
branch's output before it is added (x + rms_norm(attention(rms_norm(x)))), OLMo 2 that
output only (x + rms_norm(attention(x))); OLMo 2's q/k norms span the whole projection; the
attention's scale, soft-capping and window are the config's, per layer
(``Attention``), and so is the head's soft-capping (``softcap.SoftCappedLMHead``). With
the config's features at Llama's values this is Hugging Face's ``LlamaForCausalLM``
exactly, and with each family's, that family's class (``hpcpar.models``). Split by
``hpcpar.models.sharding``: two AllReduces per layer over tp (o_proj, down_proj), one for the
embedding, none for the head. With tied embeddings the last stage's head is the embedding's
weight. Under sequence parallelism (``split_sequence``; a generation's prefill:
``prefill_sequence_parallel``) the residual stream and the norms hold T / tp positions per tp
rank, and each AllReduce is an AllGather before the pair and a ReduceScatter after it.

Generation builds a stage from loaded tensors (``DecoderStage.from_tensors``: frozen weights,
projections merged) and runs ``forward`` over a KV cache. Training builds it from its
``Param``s (``DecoderStage.from_params``) and runs the same layers with ``train=True``, each
keeping what its ``backward`` needs (``train.model_chunk`` drives them and adds the loss).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..cores import one_blas_thread
from ..parallel.device import budget
from ..parallel.device.backend import host_array
from ..parallel.comm import Communicator
from ..parallel.tensor_parallel.layers import Frozen, block_frozen, frozen_matrix, gathered
from ..parallel.tensor_parallel.mappings import ScatterToGroup
from ..parallel.ops import AttentionRows, Ops
from ..parallel.ops.attention import at_positions
from ..parallel.tensor.splits import unit_replicas
from ..parallel.tensor_parallel.vocab import ParallelLMHead, VocabParallelEmbedding
from .attention import QKV, Attention
from .config import ModelConfig, RopeScaling
from .kv_cache import KVCache, kv_cache_bytes, kv_dims
from .latent_attention import LatentAttention
from .mlp import GATE_UP, Mlp, MoeMlp
from .norms import Norm, SpanNorms
from .rope import RotaryEmbedding
from .softcap import SoftCappedLMHead
from .tensors import EXPERT_ROLES, StageSpan, TensorSpec

# the replicated weights that read sequence-split activations under sequence parallelism:
# each tp rank's gradient is its positions' part, summed over tp (``split_sequence``)
SEQUENCE_SPLIT_ROLES = ("input_norm", "post_attention_norm", "attn_out_norm", "mlp_out_norm",
                        "final_norm", "shared_expert_gate")
# the matrices generation multiplies as one GEMM (in this order) and those it multiplies
# alone: what loading reads straight into their place (``matrix_stacks``)
MERGED = (QKV, GATE_UP, tuple("shared_" + r for r in GATE_UP), EXPERT_ROLES[:2],
          ("q_a", "kv_a"))                     # latent attention's two latents of x
ALONE = ("o", "down", "router", "shared_down", "shared_expert_gate", EXPERT_ROLES[2], "head",
         "q_b", "kv_b")

LATENT_NORM_EPS = 1e-6       # DeepSeek's q_a_layernorm and kv_a_layernorm (their class's)

# Positions per pass of a long prefill: one chunk's activations stay in a CPU's caches (the
# MLP's of 8192 positions are 150 MB), and GEMMs of 1024 rows still run at the BLAS's peak.
PREFILL_CHUNK = 1024


def matrix_stacks(specs: list[TensorSpec], span: StageSpan) -> list[tuple[str, ...]]:
    """The frozen matrices of a stage's tensors ``specs``, by name, grouped as generation
    multiplies them: several merged into one GEMM (q, k and v; gate and up; an expert's
    gate and up), or one alone (o, down, the router, the head; a tied head on a stage without
    the embedding). ``load_shard`` reads each group straight into one ``stored_matrix``."""
    groups: dict = {}
    for spec in specs:
        role = "head" if spec.role == "embed" and span.last and not span.first else spec.role
        roles = next((g for g in MERGED if role in g), (role,) if role in ALONE else None)
        if roles is not None:
            groups.setdefault((spec.layer, spec.expert, roles), {})[role] = spec.name
    return [tuple(names[r] for r in roles if r in names)
            for (_, _, roles), names in groups.items()]


class DecoderLayer:
    """h = x + attention(norm1(x));  y = h + mlp(norm2(h)), the residual adds fused into the
    next norm: the layer takes and returns (x, pending), pending being the branch output not
    yet added to the residual stream x (None before the first layer).

    ``w`` maps the layer's roles (``tensors.layer_tensors``) to weights: ``Param``s, used as
    they are, or (``merge``) frozen arrays, whose projections are merged and laid out for
    the products (``layers.frozen_matrix``)."""

    def __init__(self, cfg: ModelConfig, w: dict, tp: Communicator, ops: Ops, merge: bool,
                 layer: int = 0, ep: Communicator | None = None):
        def norm(role: str) -> Norm:
            return Norm(ops, w[role], cfg.rms_norm_eps, cfg.norm_offset)

        qk_norms = (norm("q_norm"), norm("k_norm")) if cfg.qk_norm else None
        if cfg.qk_norm and cfg.qk_norm_whole:     # over q's and k's heads on every tp rank
            qk_norms = SpanNorms(*qk_norms, tp, (cfg.q_size, cfg.kv_size),
                                 (1, unit_replicas(cfg.num_key_value_heads, tp.size)))
        if cfg.mla:     # its latents' norms: transformers' default eps, not the config's
            self.attention = LatentAttention(
                ops, cfg, w, tp, merge,
                Norm(ops, w["q_a_norm"], LATENT_NORM_EPS) if cfg.q_lora_rank else None,
                Norm(ops, w["kv_a_norm"], LATENT_NORM_EPS))
        else:
            self.attention = Attention.of(ops, w, cfg.head_dim, tp, merge, qk_norms,
                                          cfg.window_of(layer), cfg.attn_scale,
                                          cfg.attn_softcap, cfg.qk_norm_whole)
        self.mlp = (MoeMlp.of(ops, cfg, w, tp, ep, merge) if cfg.is_moe(layer)
                    else Mlp.of(ops, w, tp, merge, cfg.activation))
        pre, post = cfg.block_norms != "post", cfg.block_norms != "pre"
        # norms of the attention's and the MLP's input (Llama), and of their output (Gemma 2
        # both, OLMo 2 the second only); None where the family has none
        self.input_norm = norm("input_norm") if pre else None
        self.post_norm = norm("post_attention_norm") if pre else None
        self.attn_out_norm = norm("attn_out_norm") if post else None
        self.mlp_out_norm = norm("mlp_out_norm") if post else None
        self.ops = ops
        self.rope = None      # a rope of the layer's own (Gemma 3's local layers), else None

    def split_sequence(self, axis: int | None) -> None:
        """The layer's pairs (attention's, the MLP's or the MoE's) take and give activations
        split along ``axis`` over tp (sequence parallelism), or whole (None)."""
        if not isinstance(self.attention, Attention):
            raise ValueError("sequence parallelism splits the standard attention's pair "
                             f"only, not {type(self.attention).__name__}")
        self.attention.qkv.sequence_axis = self.attention.o.sequence_axis = axis
        mlp = self.mlp
        if isinstance(mlp, MoeMlp):
            mlp.moe.sequence_axis = axis
            mlp = mlp.shared            # Qwen2-MoE's shared expert: a pair of its own
        if mlp is not None:
            mlp.gate_up.sequence_axis = mlp.down.sequence_axis = axis

    def forward(self, x, pending, cos, sin, rows: AttentionRows, cache: KVCache | None = None,
                layer: int = 0, train: bool = False, keep=None):
        """(x, pending, ctx): ctx is what ``backward`` needs when ``train``, else None. With
        ``keep`` (B,) host positions, x and pending come back at those alone, (B, 1, hidden)
        (``Attention.forward``'s ``keep``)."""
        if self.rope is not None:       # tables of the layer's own rope, once for the rows
            T, rope = cos.shape[1], self.rope     # every position (x may be split)
            cos, sin = rows.cached(("rope", id(rope), T),
                                   lambda: rope.tables(rows.positions(self.ops.xp, T)))
        h, x, n1 = self._norm(pending, x, self.input_norm, train)
        a, actx = self.attention.forward(h, cos, sin, rows, cache, layer, train, keep)
        if keep is not None:
            x = at_positions(self.ops.xp, x, keep)
        a, o1 = self._out(a, self.attn_out_norm, train)
        h, x, n2 = self._norm(a, x, self.post_norm, train)
        m, mctx = self.mlp.forward(h, train)
        m, o2 = self._out(m, self.mlp_out_norm, train)
        return x, m, ((n1, actx, n2, mctx, o1, o2) if train else None)

    @staticmethod
    def _norm(branch, x, norm: Norm | None, train: bool):
        """(rms_norm(x + branch), x + branch, ctx); no add when ``branch`` is None; no norm
        (x + branch itself) when ``norm`` is None."""
        if norm is None:
            x = x if branch is None else x + branch
            return x, x, None
        if branch is None:
            h, ctx = norm.forward(x, train)
            return h, x, ctx
        return norm.add_forward(branch, x, train)

    @staticmethod
    def _out(y, norm: Norm | None, train: bool):
        """(rms_norm(y), ctx) of a block's output ``y``; y itself without such a norm."""
        return (y, None) if norm is None else norm.forward(y, train)

    def backward(self, dy, ctx, sink, dprobs=None):
        """The gradient of the layer's input residual (x + pending) from that of its output
        (x + pending after it); ``dprobs`` as ``MoeMlp.backward``'s (a MoE layer)."""
        n1, actx, n2, mctx, o1, o2 = ctx
        dm = dy if o2 is None else self.mlp_out_norm.backward(dy, o2, sink)
        dmlp = (self.mlp.backward(dm, mctx, sink) if dprobs is None
                else self.mlp.backward(dm, mctx, sink, dprobs))
        dx1 = dy + (dmlp if n2 is None else self.post_norm.backward(dmlp, n2, sink))
        da = dx1 if o1 is None else self.attn_out_norm.backward(dx1, o1, sink)
        dh = self.attention.backward(da, actx, sink)
        return dx1 + (dh if n1 is None else self.input_norm.backward(dh, n1, sink))


class DecoderStage:
    """The layers of ``span`` on this (pp, tp) rank, plus the embedding on the first stage
    and the final norm and head on the last; a MoE layer's experts are this rank's block of
    them over ``ep`` (None: all of them).

    ``weights`` maps each layer (None: the embedding, final norm and head) to its weights by
    role (``tensors.TensorSpec.role``); ``merge`` as in ``DecoderLayer``. The layers take
    each layer's weights out of ``weights`` as they are built, so that merged copies replace
    the originals one layer at a time.
    """

    def __init__(self, cfg: ModelConfig, weights: dict, span: StageSpan, tp: Communicator,
                 ops: Ops, dtype, merge: bool, ep: Communicator | None = None):
        layers, first, last = span.layers, span.first, span.last
        self.cfg, self.layers, self.first, self.last = cfg, layers, first, last
        xp = ops.xp
        self.ops, self.xp, self.dtype, self.tp = ops, xp, dtype, tp
        top = weights.get(None, {})
        self.embedding = (VocabParallelEmbedding(xp, top["embed"], cfg.vocab_size, tp,
                                                 cfg.pad_token_id) if first else None)
        self.decoder = [DecoderLayer(cfg, weights.pop(i), tp, ops, merge, i, ep) for i in layers]
        if last:
            self.final_norm = top["final_norm"]
            self.norm = Norm(ops, self.final_norm, cfg.rms_norm_eps, cfg.norm_offset)
            head = top["embed"] if cfg.tie_word_embeddings else top["head"]
            if merge and not (first and cfg.tie_word_embeddings):
                # in the products' layout; a tied head beside its embedding reads that table
                head = frozen_matrix(xp, [head])
            self.head = (ParallelLMHead(ops, head, cfg.vocab_size, tp)
                         if cfg.final_softcap is None
                         else SoftCappedLMHead(ops, head, cfg.vocab_size, tp, cfg.final_softcap))
        self.rope = RotaryEmbedding(cfg, xp, dtype)
        if cfg.local_rope_theta is not None:          # the windowed layers' own rope base
            local = RotaryEmbedding(replace(cfg, rope_theta=cfg.local_rope_theta,
                                            rope_scaling=RopeScaling()), xp, dtype)
            for i, layer in zip(layers, self.decoder):
                if cfg.window_of(i) is not None:
                    layer.rope = local
        self._embed_scales: dict = {}     # the embedding's scale on the device, by dtype
        self.hidden_size = cfg.hidden_size
        self.weight_bytes = self.expert_bytes = 0        # set by the constructors
        self.sequence_split = 1        # tp under sequence parallelism (``split_sequence``)
        # generation: a prefill's residual stream and norms split over tp (``_forward``)
        self.prefill_sequence_parallel = False
        # chunked prefill has not run on a GPU yet: there a prompt goes whole
        self.prefill_chunk = None if ops.device else PREFILL_CHUNK

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, specs: list[TensorSpec], tensors: dict,
                     span: StageSpan, tp: Communicator, ops: Ops, dtype,
                     ep: Communicator | None = None, placed: dict | None = None
                     ) -> "DecoderStage":
        """For generation, from this rank's loaded slices (``load_shard``'s tensors by Hugging
        Face name, taken out of ``tensors``): frozen, in ``dtype``, projections merged.
        ``placed``: where loading put the matrices of ``matrix_stacks`` (``load_shard``'s
        ``placed``, taken out of it as ``tensors`` are), which are then taken as they lie,
        nothing copied. On the host, with a BLAS of one thread, the products' matrices are
        then blocked (``block_weights``)."""
        placed = placed if placed is not None else {}
        by_layer: dict = {}
        for spec in specs:
            a = tensors.pop(spec.name)
            at = placed.pop(spec.name, (None, 0)) if a.dtype == dtype else (None, 0)
            by_layer.setdefault(spec.layer, {})[spec.key] = Frozen(a.astype(dtype, copy=False),
                                                                   *at)
        weight_bytes = sum(w.data.nbytes for group in by_layer.values() for w in group.values())
        expert_bytes = sum(w.data.nbytes for group in by_layer.values()
                           for key, w in group.items() if isinstance(key, tuple))
        stage = cls(cfg, by_layer, span, tp, ops, dtype, merge=True, ep=ep)
        stage.weight_bytes, stage.expert_bytes = weight_bytes, expert_bytes
        # the blocked products run one thread: a BLAS of several runs the plain GEMMs on all
        if ops.xp is np and not ops.device and one_blas_thread():
            stage.block_weights()
        return stage

    def block_weights(self) -> None:
        """The dense layers' projections and the head as ``BlockedMatrix``es (host only):
        a decode step's products then read each weight once, in order, at the memory's rate
        (``ops.linear.blocked_linear``). A tied head's table serves the embedding's lookups
        too. Others (experts, latent attention's) stay as they are."""
        weights = [self.head.weight] if self.last else []
        for layer in self.decoder:
            attention, mlp = layer.attention, layer.mlp
            if isinstance(attention, Attention):
                weights += attention.qkv.weights + [attention.o.weight]
            if isinstance(mlp, Mlp):
                weights += mlp.gate_up.weights + [mlp.down.weight]
        for w in weights:
            block_frozen(w)

    @classmethod
    def from_params(cls, cfg: ModelConfig, params: dict, span: StageSpan, tp: Communicator,
                    ops: Ops, ep: Communicator | None = None) -> "DecoderStage":
        """For training, over ``Param``s by Hugging Face name (their ``data`` in the compute
        dtype, read at every call)."""
        by_layer: dict = {}
        for p in params.values():
            by_layer.setdefault(p.spec.layer, {})[p.spec.key] = p
        dtype = next(iter(params.values())).data.dtype
        stage = cls(cfg, by_layer, span, tp, ops, dtype, merge=False, ep=ep)
        stage.weight_bytes = sum(p.data.nbytes for p in params.values())
        return stage

    @property
    def kv_heads(self) -> int:
        """The KV heads this rank holds (per layer)."""
        return self.decoder[0].attention.kv_heads if self.decoder else 0

    @property
    def kv_dims(self) -> tuple[int, int]:
        """(key, value) dimensions of each cached head: head_dim both, or latent attention's
        latent and rope key as keys, no values (``latent_attention``)."""
        return kv_dims(self.cfg)

    def kv_bytes_per_row(self, capacity: int) -> int:
        """KV-cache bytes one row of ``capacity`` tokens takes on this stage."""
        k, v = self.kv_dims
        return kv_cache_bytes(len(self.decoder), 1, self.kv_heads, capacity, k,
                              np.dtype(self.dtype).itemsize, v)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """This stage's KV cache for a micro-batch of ``batch`` rows and ``capacity`` slots."""
        k, v = self.kv_dims
        return KVCache(self.ops, len(self.decoder), batch, self.kv_heads, capacity, k,
                       self.dtype, v)

    def embed(self, ids):
        """(B, T) token ids -> (B, T, hidden) (first stage)."""
        return self.scale_embedding(self.embedding.forward(ids)[0])

    def scale_embedding(self, x):
        """x times the config's ``embed_scale`` (Gemma: sqrt(hidden), rounded to x's dtype as
        transformers does); the same for the gradient. Llama: x itself."""
        if self.cfg.embed_scale == 1.0:
            return x
        scale = self._embed_scales.get(x.dtype)
        if scale is None:       # once per dtype: copied in at every step, a CUDA graph's
            scale = self._embed_scales[x.dtype] = self.xp.asarray(   # replay could not
                self.cfg.embed_scale, dtype=x.dtype)
        return x * scale

    def positions(self, rows: AttentionRows, T: int):
        """The rotary tables (cos, sin) of each row's T positions from its start (this rank's
        positions of the rows, under context parallelism)."""
        return self.rope.tables(rows.positions(self.xp, T))

    def forward(self, x, rows: AttentionRows, cache: KVCache | None, keep=None):
        """Run this stage's layers on x (B, T, hidden): row b's T tokens sit at positions
        [starts[b], starts[b] + T) of its sequence (``rows``), and go to those cache slots
        (no cache: the T tokens are whole sequences, their keys their own).

        ``keep`` (B,) host indices into T (the last stage of a prefill: each row's last
        token, all the head reads): the states at those alone, (B, 1, hidden). The last
        layer then runs its attention, MLP and residual adds at them only; its keys and
        values, which the cache keeps, at every position.

        A prefill longer than ``prefill_chunk`` positions runs a chunk at a time
        (``_prefill_in_chunks``); with device kernels, ``prefill_chunk`` is None: whole."""
        if (cache is not None and rows.from_start and rows.context is None
                and self.prefill_chunk is not None and x.shape[1] > self.prefill_chunk):
            return self._prefill_in_chunks(x, rows, cache, keep)
        return self._forward(x, rows, cache, keep)

    def _prefill_in_chunks(self, x, rows: AttentionRows, cache, keep):
        """``forward`` of a prefill of whole prompts, ``prefill_chunk`` positions at a time
        through every layer, each chunk's attention reading the chunks before it from the
        cache. Causal attention sees nothing later, so the states are the same; the
        activations are one chunk's, not the prompt's, and stay in cache: long prefills run
        faster and in less memory (vLLM's chunked prefill). Every row's chunk starts at
        the same position; a row whose prompt ended before it has padding queries only."""
        xp = self.xp
        B, T = x.shape[:2]
        lengths = host_array(rows.q_lengths).astype(np.int64)
        out = None
        for c0 in range(0, T, self.prefill_chunk):
            c1 = min(c0 + self.prefill_chunk, T)
            queries = np.clip(lengths - c0, 0, c1 - c0)
            part = AttentionRows.build(xp, queries, c0 + queries, from_start=c0 == 0)
            if keep is None:
                y = self._forward(x[:, c0:c1], part, cache)
                out = xp.empty((B, T) + y.shape[2:], dtype=y.dtype) if out is None else out
                out[:, c0:c1] = y
                continue
            y = self._forward(x[:, c0:c1], part, cache, np.clip(keep - c0, 0, c1 - c0 - 1))
            out = xp.zeros_like(y) if out is None else out
            here = np.flatnonzero((keep >= c0) & (keep < c1))
            if len(here):
                out[xp.asarray(here)] = y[xp.asarray(here)]
        return out

    def _forward(self, x, rows: AttentionRows, cache: KVCache | None, keep=None):
        if self._prefill_splits(x, rows):
            return self._split_forward(x, rows, cache, keep)
        cos, sin = self.positions(rows, x.shape[1])
        pending = None
        last = len(self.decoder) - 1
        for i, layer in enumerate(self.decoder):
            x, pending = self._layer(layer, i, x, pending, cos, sin, rows, cache,
                                     keep if i == last else None)
        if keep is not None and last < 0:
            x = at_positions(self.xp, x, keep)
        return x + pending if pending is not None else x

    @staticmethod
    def _layer(layer, i, x, pending, cos, sin, rows, cache, keep):
        if budget._current is None:
            return layer.forward(x, pending, cos, sin, rows, cache, i, keep=keep)[:2]
        with budget.phase("layer"):               # a device budget counts each layer
            return layer.forward(x, pending, cos, sin, rows, cache, i, keep=keep)[:2]

    def _prefill_splits(self, x, rows: AttentionRows) -> bool:
        """Whether this pass runs sequence-parallel (``prefill_sequence_parallel``): a
        prefill of several positions per row that tp divides, without cp."""
        T, p = x.shape[1], self.tp.size
        return (self.prefill_sequence_parallel and p > 1 and T > 1 and T % p == 0
                and rows.context is None and bool(self.decoder))

    def _split_forward(self, x, rows: AttentionRows, cache, keep):
        """``_forward`` with the residual stream and the norms on this tp rank's T / tp
        positions (sequence parallelism: each pair gathers its input and reduce-scatters its
        output), gathered at the end, or before a last layer that keeps some queries only
        (they read every position's state)."""
        cos, sin = self.positions(rows, x.shape[1])
        x, pending, last = ScatterToGroup.forward(x, self.tp, 1), None, len(self.decoder) - 1
        split = True
        try:
            for i, layer in enumerate(self.decoder):
                if keep is not None and i == last:
                    x, pending = (None if a is None else gathered(a, self.tp, 1)
                                  for a in (x, pending))
                    split = False
                layer.split_sequence(1 if split else None)
                x, pending = self._layer(layer, i, x, pending, cos, sin, rows, cache,
                                         keep if i == last else None)
        finally:
            for layer in self.decoder:
                layer.split_sequence(None)
        x = x + pending
        return gathered(x, self.tp, 1) if split else x

    def serve_experts(self) -> None:
        """What a replica whose work is done runs while the others of its ep group still
        send tokens to its experts: forwards with no tokens of its own, every MoE layer's
        all_to_alls in order, each meeting a forward of theirs, until every replica of the
        group is serving (``MoE.serve``)."""
        moes = [layer.mlp.moe for layer in self.decoder if isinstance(layer.mlp, MoeMlp)]
        if not moes or moes[0].dispatch.ep is None:
            return
        done = False
        while not done:
            done = [moe.serve() for moe in moes][0]     # every layer, as a forward runs them

    def final_hidden(self, x):
        """The final norm of x (B, T, hidden): what the head reads (last stage)."""
        return self.norm.forward(x)[0]

    def split_sequence(self, axis: int = 1) -> None:
        """Megatron's sequence parallelism over this stage's tp group: the activations
        between the column/row pairs (the embedding's output, the norms, the residual
        stream, what goes to the next stage) split along ``axis`` into tp equal parts,
        each rank its own positions. Each pair's input is AllGathered and its output
        ReduceScattered (layers.py), the embedding's sum a ReduceScatter, the head's input
        gathered; a MoE layer gathers its input and routes every token on every tp rank.
        The weights in ``SEQUENCE_SPLIT_ROLES`` then get partial gradients, summed over tp
        by the trainer."""
        for layer in self.decoder:
            layer.split_sequence(axis)
        for part in (self.embedding, getattr(self, "head", None)):
            if part is not None:
                part.sequence_axis = axis
        self.sequence_split = self.tp.size if axis is not None else 1

    def logits(self, x):
        """(B, T, hidden) -> this rank's (B, T, vocab_per_partition) float32 logits (last)."""
        return self.head.local_logits(self.final_hidden(x))
