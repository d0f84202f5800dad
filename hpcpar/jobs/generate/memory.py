"""Generation's device memory per rank, from the config and the layout alone (for ``hpcpar
plan``): the activations a rank holds at its peak, on the device path (a GPU, or the strict
backend with the device ops): a prefill runs its whole prompt at once, every position
through every layer (``DecoderStage.prefill_chunk`` is None there).

What the code keeps alive (``models.decoder``, ``models.attention``, the device ops'
outputs; a kernel's own scratch is not an array), for N = B T tokens, in elements per token
(H hidden, q = heads d, kv = KV heads d, I the MLP's width: q, kv, I per tp rank):

    the stage     its input x (the embedding's output, or the activations received), held
                  by the program through every layer: H; the rotary tables cos, sin: 2 d
    a layer       from its second on, the residual x and the branch it takes in: 2 H; then
                  the largest of three moments:
      attention     normed input H, residual sum H (from the second layer), merged qkv
                    output q + 2 kv, rotary's q and k: q + kv; and at most one of: the
                    per-head norms' q and k (q + kv, before rotary), the attention output
                    and its copy as (N, q) for o_proj (2 q: the reference's layout; when
                    T = 1 the copy is a view, q), that copy and o_proj's output (q + H)
      second norm   both norms' inputs and outputs beside the attention output: 5 H (4 H
                    in the first layer, whose residual is the stage's input)
      MLP           attention output, normed input, residual sum: 3 H; merged gate/up
                    output 2 I; the activation I and down's output H (GeGLU's reference
                    holds 3 I of temporaries before that, its output among them)
    the head      (last stage, after the layers) the stage's input and output x + pending,
                  2 H; each row's last states and their final norm, 2 H a row; float32
                  logits, V/p a row (and the product's own in a narrower compute dtype);
                  sampling's temporaries

A decode step is the same with T = 1. A mixture-of-experts layer's MLP is estimated, not
derived: its k routed rows of H four times (dispatched, the experts' outputs, their slots,
weighted), one expert's 3 I for every token, the router's float32 logits and
probabilities, a shared expert as a dense MLP. Not counted: --save-logits and prompt
log-probabilities (their logits per position), arrays of a few bytes per row.

Loading (``checkpoint.load_shard``) reads each matrix straight into its place: its only
device bytes beside the weights are the NaN / inf check's, one block of a tensor at a time
(``dtypes.check_temporary_bytes``; ``loading_bytes``).

On the CPU (NumPy) a prefill runs ``PREFILL_CHUNK`` positions at a time and its last layer
at each row's last token: this bound is the device path's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...models.config import ModelConfig
from ...models.decoder import matrix_stacks
from ...models.kv_blocks import block_bytes, blocks_for
from ...models.kv_cache import kv_cache_bytes
from ...models.sharding import padded_vocab_size, piece_of
from ...models.tensors import StageSpan, TensorSpec, layer_tensors
from ...parallel.comm import split_sizes
from ...parallel.device.dtypes import check_temporary_bytes
from ..job import GenerateSection
from ..layout import ParallelConfig
from .continuous import PREFILL_TOKENS

FLOAT32 = 4


@dataclass(frozen=True)
class Widths:
    """A tp rank's share of the model's widths (tp splits the heads, the MLPs, the vocab)."""

    tp: int
    hidden: int
    q: int                   # heads * head_dim
    kv: int                  # KV heads * head_dim (a replicated KV head counts whole)
    inter: int
    vocab: int
    head_dim: int
    expert_inter: int = 0    # a mixture of experts': an expert's MLP width, a shared one's
    shared_inter: int = 0


def rank_widths(cfg: ModelConfig, tp: int) -> Widths:
    if cfg.mla:       # latent attention: q by heads, the latent and rope key on every rank
        return Widths(tp, cfg.hidden_size, cfg.num_attention_heads // tp * cfg.qk_head_dim,
                      cfg.kv_lora_rank + cfg.head_dim, cfg.intermediate_size // tp,
                      padded_vocab_size(cfg.vocab_size, tp) // tp, cfg.head_dim,
                      cfg.moe_intermediate_size // tp, cfg.shared_expert_size // tp)
    k_proj = next(s for s in layer_tensors(cfg, 0) if s.role == "k")
    return Widths(tp, cfg.hidden_size, cfg.num_attention_heads // tp * cfg.head_dim,
                  piece_of(k_proj, cfg, 0, tp).shape[0], cfg.intermediate_size // tp,
                  padded_vocab_size(cfg.vocab_size, tp) // tp, cfg.head_dim,
                  cfg.moe_intermediate_size // tp, cfg.shared_expert_size // tp)


@dataclass(frozen=True)
class Rows:
    """The rows a replica runs at once: a prefill's (of the longest prompt), a decode
    step's, and those the KV caches of all its micro-batches hold."""

    prefill: int
    decode: int
    cached: int


def rows_at_once(layout: ParallelConfig, batch: int, prompt_length: int,
                 gen: GenerateSection) -> Rows:
    """Static batching runs each micro-batch whole; continuous batching keeps
    ``batch_size`` rows of one in flight (0: all) and refills at most ``PREFILL_TOKENS``
    prompt tokens at once (one prompt at least). A wave holds ``wave_size`` prompts, each
    prompt ``n`` rows."""
    prompts = min(batch, gen.wave_size) if gen.wave_size else batch
    sizes = split_sizes(-(-prompts // layout.dp) * gen.n, layout.micro_batches)
    if gen.batching == "continuous" and gen.batch_size:
        sizes = [min(gen.batch_size, m) for m in sizes]
    largest = max(sizes, default=0)
    prefill = (min(largest, max(1, PREFILL_TOKENS // max(prompt_length, 1)))
               if gen.batching == "continuous" else largest)
    return Rows(prefill, largest, sum(sizes))


def pass_bytes(cfg: ModelConfig, w: Widths, rows: int, tokens: int, layers: int, last: bool,
               itemsize: int, gen: GenerateSection) -> int:
    """The peak device bytes of activations of one pass of ``rows`` x ``tokens`` through a
    stage of ``layers`` decoder layers (and the head when ``last``): see the module."""
    N, H = rows * tokens, w.hidden
    second = layers > 1                       # the peak layer: the second one, if any
    stage = H + 2 * w.head_dim + (2 * H if second else 0)
    sums = H + (H if second else 0)           # the first norm's output and residual sum
    qkv = (w.q + 2 * w.kv) + (w.q + w.kv)
    attention = sums + qkv + max(w.q + w.kv if cfg.qk_norm else 0,
                                 2 * w.q if tokens > 1 else w.q, w.q + H)
    second_norm = 5 * H if second else 4 * H
    layer = N * (stage + max(attention, second_norm, 3 * H + _mlp(cfg, w, itemsize))) * itemsize
    if not last:
        return layer
    # the stage's input and output, each row's last states and their norm, the logits
    head = (2 * H * N + 2 * H * rows) * itemsize + _logit_bytes(w, rows, itemsize, gen)
    return max(layer, head)


def _mlp(cfg: ModelConfig, w: Widths, itemsize: int) -> int:
    """The MLP's own elements per token at its peak: gate/up beside the activation and
    then the down output (or GeGLU's reference's three temporaries of I); a mixture of
    experts' estimate (see the module)."""
    dense = 2 * w.inter + max(3 * w.inter if cfg.activation == "gelu_tanh" else 0,
                              w.inter + w.hidden)
    if not cfg.moe_layers:
        return dense
    shared = 3 * w.shared_inter + w.hidden if w.shared_inter else 0
    moe = (4 * cfg.experts_per_token * w.hidden + 3 * w.expert_inter
           + 2 * cfg.num_experts * FLOAT32 // itemsize + shared)
    return max(moe, dense)


def _logit_bytes(w: Widths, rows: int, itemsize: int, gen: GenerateSection) -> int:
    """Each row's float32 logits of this rank's vocabulary (and the product's own in a
    narrower dtype), with sampling's temporaries: none for greedy; top-k's negated logits
    and their int64 order (12 bytes a logit); without top-k, the whole vocabulary's
    gathered (over tp, or copied); the penalties' copy."""
    per_row = w.vocab * (FLOAT32 + (itemsize if itemsize < FLOAT32 else 0))
    if gen.temperature != 0.0:
        per_row += FLOAT32 * w.vocab * (3 if gen.top_k else w.tp)
    if (gen.repetition_penalty, gen.presence_penalty, gen.frequency_penalty) != (1.0, 0.0, 0.0):
        per_row += FLOAT32 * w.vocab
    return rows * per_row


def paged_cache_bytes(layers: int, kv_heads: int, head_dim: int, rows: int, row_length: int,
                      itemsize: int, gen: GenerateSection, v_dim: int | None = None) -> int:
    """A stage's paged KV cache (``paged_rows.PagedRows``) for ``rows`` rows of
    ``row_length`` positions, each micro-batch's rows in flight at once: the pool, every
    row's blocks at its end or the fewer ``--kv-memory`` bytes hold, and its null block;
    each micro-batch's rows also in position order (``PagedKVCache.contiguous``), their
    blocks' positions and one more. The blocks prompts share are not taken out: a bound."""
    per_block = block_bytes(layers, kv_heads, gen.kv_block_size, head_dim, itemsize, v_dim)
    width = blocks_for(row_length, gen.kv_block_size)
    blocks = rows * width
    if gen.kv_memory > 1:
        blocks = min(blocks, int(gen.kv_memory // per_block))
    views = kv_cache_bytes(layers, rows, kv_heads, width * gen.kv_block_size + 1, head_dim,
                           itemsize, v_dim)
    return (blocks + 1) * per_block + views


@dataclass(frozen=True)
class StageMemory:
    """A rank's device bytes beside its weights: the KV cache, activations at their peak
    (prefill or decode) and loading's temporaries; ``peak`` adds its weights."""

    kv_cache: int
    activations: int
    loading: int

    def peak(self, weights: int) -> int:
        """Loading ends before the KV cache and the activations exist."""
        return weights + max(self.loading, self.kv_cache + self.activations)


def stage_memory(cfg: ModelConfig, tp: int, rows: Rows, prompt_length: int, span: StageSpan,
                 specs: list[TensorSpec], sizes: dict[str, int], kv_cache: int, itemsize: int,
                 gen: GenerateSection) -> StageMemory:
    """A stage's ``StageMemory``: ``specs``, its tensors in the order loading reads them,
    each of ``sizes[name]`` elements on a rank."""
    w = rank_widths(cfg, tp)
    layers = len(span.layers)
    activations = max(pass_bytes(cfg, w, rows.prefill, prompt_length, layers, span.last,
                                 itemsize, gen),
                      pass_bytes(cfg, w, rows.decode, 1, layers, span.last, itemsize, gen))
    return StageMemory(kv_cache, activations, loading_bytes(specs, sizes, span, itemsize))


def loading_bytes(specs: list[TensorSpec], sizes: dict[str, int], span: StageSpan,
                  itemsize: int) -> int:
    """The device bytes beside the weights at loading's peak: ``load_shard`` allocates a
    stack of matrices (``matrix_stacks``) at its first part, any other tensor as it comes,
    and checks each tensor read with one block's temporaries; the peak is at the check
    that has the fewest bytes still to come after it."""
    first = {}                                  # a stack's first part -> the stack's elements
    for names in matrix_stacks(specs, span):
        first |= {names[0]: sum(sizes[n] for n in names)} | {n: 0 for n in names[1:]}
    held, peak = 0, 0
    for spec in specs:
        held += first.get(spec.name, sizes[spec.name]) * itemsize
        peak = max(peak, held + check_temporary_bytes(sizes[spec.name], itemsize))
    return peak - held
