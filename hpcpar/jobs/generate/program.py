"""What one pipeline stage computes during generation (the executor's ``StageProgram``).

Step 0 of a micro-batch is its prefill: the prompts (each row's tokens first, then padding)
go through the stage and fill the KV cache. Step t > 0 feeds the token sampled at step t - 1,
one position per row, at cache slot L_b + t - 1 of row b (L_b its prompt length). The last
stage samples from each row's last real position; with several stages it sends the tokens
back to the first, which embeds them for the next step. The samples of one prompt (``--n``)
are rows of their own that share its prefill: one row per prompt runs it, and the others
take copies of its KV-cache rows and its logits (``prefill_groups``). Where a row asks, the
last stage also reads its tokens' log-probabilities (``generate.logprobs``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from time import perf_counter
from typing import Callable, Protocol

import numpy as np

from ...models.decoder import DecoderStage
from ...models.kv_cache import CacheRows, KVCache
from ...parallel.context_parallel.ring_attention import (ContextShard, SplitKV, last_states,
                                                         split_batch)
from ...parallel.ops import AttentionRows
from ...parallel.pipeline.schedule import Action, Op
from ..faults import fault_point
from ..inputs.batching import MicroBatch, replica_order
from ..inputs.sampling_settings import PromptSampling, SamplingParams
from .decode import decode_steps
from .logprobs import LogprobReader
from .results import ResultShape, RowResults
from .sampling import History, needs_history, next_tokens, of_rows
from .stopping import StopStrings


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_at_eos: bool = True
    save_logits: bool = False
    batching: str = "continuous"    # or "static" (see ``generate.continuous``)
    batch_size: int = 0             # continuous: rows in flight per micro-batch (0: all)
    cuda_graphs: bool = False       # decode steps replayed as CUDA graphs (``generate.decode``)
    prefix_cache: bool | None = None    # rows in a paged cache sharing prompt prefixes: None
                                        # wherever exact (``paged_rows.paging_refusal``)
    kv_block_size: int = 16         # positions per block of that cache (``generate.paged_rows``)
    kv_memory: float = 0.0          # its size: a fraction of free memory up to 1, bytes above


@dataclass(frozen=True)
class RowRules:
    """What every row of a generation runs under: the job's settings, the ids that end a row,
    the pad id, and each prompt's own ``limits`` (max_new_tokens), ``sampling``, ``stops``
    (stop strings) and ``stop_ids`` (stop_token_ids), by global prompt index (None: the
    job's for every prompt; no stop strings or ids)."""

    settings: GenerationSettings
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    limits: np.ndarray | None = None
    sampling: PromptSampling | None = None
    stops: StopStrings | None = None
    stop_ids: list[np.ndarray] | None = None     # each prompt's stop_token_ids (None: none)
    results: ResultShape | None = None   # what rows keep (None: their tokens alone)

    @property
    def shape(self) -> ResultShape:
        return self.results or ResultShape(self.settings.max_new_tokens)


class WaveEvents(Protocol):
    """What a generation program tells its job, and asks it, as it runs."""

    def stepped(self) -> None:
        """A step's tokens are recorded (the rows' results and ``worked`` count)."""

    def stop_requested(self) -> bool:
        """Whether this rank was asked to stop (polled by the first stage)."""


def any_rank(flag: bool, *groups) -> bool:
    """Whether ``flag`` is raised on any rank of ``groups`` (communicators, reduced one after
    the other on the host): every member gets the same answer at the same point."""
    mine = np.array([int(flag)], dtype=np.int64)
    for group in groups:
        if group.size > 1:
            group.on_host().all_reduce(mine, op="max")
    return bool(mine[0])


class AgreedStop:
    """A stop request (SIGTERM / SIGUSR1) polled by the first stage before each forward:
    true once any of its tp (and cp) ranks saw one, for all of them at the same forward (they
    retire the same micro-batches at the same step); final once true."""

    def __init__(self, requested: Callable[[], bool] | None, *groups):
        self.requested, self.groups = requested, [g for g in groups if g is not None]
        self.stopped = False

    def __call__(self) -> bool:
        if not self.stopped and self.requested is not None:
            self.stopped = any_rank(self.requested(), *self.groups)
        return self.stopped


class ReplicaProgram(ABC):
    """What both generation programs (static here, continuous in ``generate.continuous``)
    keep of a replica's rows: results in the replica's row order (``global_rows``: each
    row's prompt), each row's limit, the stop agreement and the activations in flight."""

    def __init__(self, stage: DecoderStage, mbs: list[MicroBatch], rules: RowRules, backend,
                 events: WaveEvents | None = None, cp=None):
        """``rules``: what the rows run under (``RowRules``). ``events``: told after
        each step (``stepped``); its ``stop_requested`` is polled by the first stage
        before each forward, and once its tp ranks agree on a stop, every micro-batch is
        retired there (the STOP reaches the other stages with the activations) and only
        finished rows count. ``cp``: the context-parallel group (a ``Communicator``) the
        prompts and KV cache are split over (``parallel.context_parallel.ring_attention``), or
        None."""
        settings, limits, pad_id = rules.settings, rules.limits, rules.pad_id
        self.stage, self.mbs, self.settings, self.backend = stage, mbs, settings, backend
        self.xp = backend.xp
        n = settings.max_new_tokens
        self.offsets = np.cumsum([0] + [mb.size for mb in mbs])     # each mb's first row
        rows = int(self.offsets[-1])
        self.global_rows = replica_order(mbs)                      # prompt of each row
        self.limit = (limits[self.global_rows] if limits is not None
                      else np.full(rows, n, dtype=np.int64))       # each row's own limit
        self.results = RowResults.empty(rows, rules.shape, pad_id)
        self.tokens = self.results.tokens                          # new tokens
        self.lengths = self.results.lengths                        # tokens up to EOS
        self.lengths[:] = n
        self.done = np.zeros(rows, dtype=bool)
        self.worked = 0          # tokens done: prompts prefilled and tokens generated
        self.eos = np.asarray(rules.eos_ids if settings.stop_at_eos else (), dtype=np.int64)
        self.eos_set = set(self.eos.tolist())
        self.pad_id = pad_id
        self.prompt_logits: dict[int, np.ndarray] = {}             # mb -> (b, L, vocab)
        self.inputs: dict[int, object] = {}
        self.outputs: dict[int, object] = {}
        self.events = events
        self.stopping = AgreedStop(events.stop_requested if events is not None else None,
                                   stage.tp, cp)
        self.sampling = rules.sampling if rules.sampling is not None else settings.sampling
        self.needs_history = needs_history(self.sampling, self.global_rows)
        own = of_rows(self.sampling, self.global_rows)          # each row's settings
        self.min_tokens = own.min_tokens
        self.stop_ids = (None if rules.stop_ids is None
                         else [rules.stop_ids[g] for g in self.global_rows])
        self.stops = rules.stops
        self.cp = cp
        self.token_ks, self.prompt_ks = own.logprobs, own.prompt_logprobs   # -1: none
        self.source = own.prompt              # each row's prompt (its samples share one)
        self.reader = (LogprobReader(stage.head, backend.to_host)
                       if stage.last and max(self.token_ks.max(initial=-1),
                                             self.prompt_ks.max(initial=-1)) >= 0 else None)

    def budget_phase(self, a: Action) -> str:
        """A device budget's phase of a compute action: prefill or decode."""
        return "prefill" if self.phase(a) == 0 else "decode"

    def phase(self, a: Action) -> int:
        """Prefill (0) or decode (1), for the run report's times."""
        return 0 if a.step == 0 else 1

    def cache_capacity(self, positions: int) -> int:
        """KV-cache slots per row on this rank for rows of up to ``positions`` tokens."""
        if self.cp is None:
            return positions
        return SplitKV.local_capacity(positions, self.cp.size)

    def prefill_width(self, length: int) -> int:
        """Positions of prompts ``length`` wide this rank runs (its own under cp)."""
        shard = ContextShard.of(length, self.cp)
        return length if shard is None else shard.local_length()

    def split_kv(self, rows: int, capacity: int) -> SplitKV | None:
        return None if self.cp is None else SplitKV(rows, self.cp.size, self.cp.rank, capacity)

    def prefill_keep(self, lengths: np.ndarray, rows) -> np.ndarray | None:
        """The positions a prefill's last stage computes its final states at: each row's last
        token (all the head reads), or None (every position: the prompt logits are saved,
        or the log-probabilities of ``rows``' prompts (indices here), or the prompts are
        split over cp and the rank holding each last token is elsewhere; with device
        kernels, where this has not run yet)."""
        if (not self.stage.last or self.settings.save_logits or self.cp is not None
                or self.stage.ops.device or self.prompt_ks[rows].max(initial=-1) >= 0):
            return None
        return np.asarray(lengths, dtype=np.int64) - 1

    def prefill_groups(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """How a prefill of rows ``rows`` (indices here) runs once per prompt: (``first``,
        the positions in ``rows`` of each prompt's first row, the rows prefilled;
        ``inverse``, each row's index into them). The other samples of a prompt get copies
        of its KV-cache rows and its logits. Under cp each row prefills its own (a prompt's
        cache is split over the group)."""
        rows = np.asarray(rows, np.int64)
        if self.cp is not None:
            return np.arange(len(rows)), np.arange(len(rows))
        _, first, inverse = np.unique(self.source[rows], return_index=True,
                                      return_inverse=True)
        return first, inverse.reshape(-1)

    def share_prefill(self, cache: KVCache, slots: np.ndarray, first: np.ndarray,
                      inverse: np.ndarray) -> None:
        """Every one of cache rows ``slots`` becomes a copy of its prompt's prefilled row
        (``prefill_groups``; nothing to do when each row is its own prompt's)."""
        if len(first) < len(inverse):
            xp = self.xp
            cache.copy_rows(xp.asarray(slots[first[inverse]]), xp.asarray(slots))

    def read_prompt_logprobs(self, y, ids: np.ndarray, lengths: np.ndarray, rows) -> None:
        """The log-probabilities of prompts ``ids`` of rows ``rows`` (indices here) into the
        results, where they ask (``y``: the prefill's states at every position)."""
        rows = np.asarray(rows, np.int64)
        ks = self.prompt_ks[rows]
        if self.reader is None or (ks < 0).all():
            return
        found = self.reader.of_prompts(self.stage.final_hidden(y), ids, lengths, ks)
        self.results.put_logprobs("prompt_", rows, None, found)

    def share_prompt_logprobs(self, rows: np.ndarray, first: np.ndarray,
                              inverse: np.ndarray) -> None:
        """Rows ``rows`` (indices here) take their prompt's first row's prompt
        log-probabilities (``prefill_groups``)."""
        if self.reader is not None and len(first) < len(inverse):
            self.results.copy_prompt_rows(rows[first[inverse]], rows)

    def read_logprobs(self, last, tokens: np.ndarray, rows, steps, live: np.ndarray) -> None:
        """The log-probability of each ``live`` row's new token (``rows``: indices here,
        ``steps``: each one's token index) into the results, where the row asks; ``last``
        (its logits, this rank's vocabulary) is overwritten."""
        if self.reader is None:            # no row of this replica asks (or not the last stage)
            return
        rows = np.asarray(rows, np.int64)
        ks = np.where(live, self.token_ks[rows], -1)
        if (ks < 0).all():
            return
        found = self.reader.of_tokens(last, tokens, ks)
        self.results.put_logprobs("", rows[live], np.asarray(steps)[live],
                                  found.take(live))

    def last_states(self, y, lengths, keep, shard):
        """(B, 1, hidden) each row's final states at its last token, from a prefill's y."""
        if keep is not None:                         # the stage computed those alone
            return y
        return last_states(self.xp, y, lengths, shard, self.cp)

    def met_stop_string(self, row: int, generated: int) -> bool:
        """Whether row ``row``'s first ``generated`` new tokens hold one of its stop
        strings (a pure function of them: every stage that keeps the books agrees; one
        below the row's ``min_tokens`` does not count, ``StopStrings``)."""
        return self.stops is not None and self.stops.hit(int(self.global_rows[row]),
                                                         self.tokens[row, :generated])

    def ending(self, rows, tokens: np.ndarray) -> np.ndarray:
        """Whether each row's new token ends it: an EOS id (when rows stop at EOS) or one of
        the row's own stop ids (``rows``: their indices here)."""
        out = np.isin(tokens, self.eos)
        if self.stop_ids is not None:
            out |= np.array([t in self.stop_ids[r] for r, t in zip(rows, tokens)], dtype=bool)
        return out

    def ends(self, row: int, token: int) -> bool:
        """``ending`` of one row (the continuous program's, token by token)."""
        return token in self.eos_set or (self.stop_ids is not None
                                         and token in self.stop_ids[row])

    def history(self, rows, prompts: list[np.ndarray], generated: list[np.ndarray]) -> History:
        """What rows ``rows`` (indices here) have seen, for the penalties, and the ids each
        may not generate yet: its EOS and stop ids while below its ``min_tokens``."""
        banned = []
        for r, seen in zip(rows, generated):
            ends = self.eos if self.stop_ids is None else np.union1d(self.eos, self.stop_ids[r])
            banned.append(ends if len(seen) < self.min_tokens[r] else ends[:0])
        return History(prompts, generated, banned)

    def kv_cache_bytes(self) -> int:
        """The bytes of this stage's KV cache."""
        return sum(c.nbytes for c in self.caches)

    def prefix_stats(self) -> tuple[int, int]:
        """(prompt tokens admitted, those served from the prefix cache): none here."""
        return 0, 0

    def pool_stats(self) -> tuple[int, int, int]:
        """(blocks, the most in use at once, rows preempted) of a paged cache: none here."""
        return 0, 0, 0

    def rows_held(self) -> int:
        """The most rows whose keys the KV caches held at once: static batching holds every
        row of the replica's micro-batches from their prefill on."""
        return int(self.offsets[-1])

    @abstractmethod
    def prefill_seconds(self, times, start: float) -> float:
        """The run's prefill time, for the report (``times``: the executor's)."""


class GenerationProgram(ReplicaProgram):
    def __init__(self, stage: DecoderStage, mbs: list[MicroBatch], rules: RowRules, backend,
                 events: WaveEvents | None = None, cp=None):
        """Static batching: every row of a micro-batch from its prefill to its longest row's
        end (``ReplicaProgram`` says what the arguments are)."""
        super().__init__(stage, mbs, rules, backend, events, cp)
        n = rules.settings.max_new_tokens
        capacity = [self.cache_capacity(mb.length + n) for mb in mbs]
        self.caches = [stage.new_cache(mb.size, c) for mb, c in zip(mbs, capacity)]
        self.split = [self.split_kv(mb.size, c) for mb, c in zip(mbs, capacity)]
        self.decode = decode_steps(stage, self.caches, [mb.size for mb in mbs], backend,
                                   rules.settings.cuda_graphs, cp)
        self.shards: dict[int, object] = {}                  # mb -> its prefill's ContextShard
        self.groups = [self.prefill_groups(np.arange(self.offsets[i], self.offsets[i + 1]))
                       for i in range(len(mbs))]            # one prefill row per prompt
        self.prefill_done_at: float | None = None

    def prefill_seconds(self, times, start: float) -> float:
        """Every micro-batch is prefilled first: until the last one's prefill."""
        return (self.prefill_done_at or start) - start

    def _local(self, mb: MicroBatch) -> slice:
        start = int(self.offsets[mb.index])
        return slice(start, start + mb.size)

    # ---- StageProgram ----------------------------------------------------------------------

    def payload(self, a: Action):
        batch = self.mbs[a.mb]
        if a.op in (Op.SEND, Op.RECV):
            if a.step == 0:
                shape = (len(self.groups[a.mb][0]), self.prefill_width(batch.length))
            else:
                shape = (batch.size, 1)
            return shape + (self.stage.hidden_size,), self.stage.dtype
        return (batch.size,), np.dtype(np.int64)

    def finished(self, mb: int) -> bool:
        if not self.stage.first:
            return False
        return self.stopping() or bool(self.done[self._local(self.mbs[mb])].all())

    def receive(self, a: Action, payload) -> None:
        if a.op is Op.RECV:
            self.inputs[a.mb] = payload
        else:
            self._record(self.mbs[a.mb], a.step, self.backend.to_host(payload))

    def outgoing(self, a: Action):
        if a.op is Op.SEND:
            return self.outputs.pop(a.mb)
        return self.xp.asarray(self.tokens[self._local(self.mbs[a.mb]), a.step])

    def compute(self, a: Action) -> None:
        if a.step > 0:
            fault_point("decode", a.step)
        self.forward(a.mb, a.step)

    def forward(self, mb: int, step: int) -> None:
        stage, batch, xp = self.stage, self.mbs[mb], self.xp
        if step > 0 and self.decode is not None:         # the whole model on this rank
            logits = self.decode[mb](self.tokens[self._local(batch), step - 1],
                                     batch.lengths + step)
            self._sample(batch, step, logits=logits[:, 0])
            return
        split, cache = self.split[mb], self.caches[mb]
        keep, first = None, self.groups[mb][0]
        if step == 0:                        # one row per prompt, into its rows of the cache
            ids, rows, self.shards[mb] = split_batch(xp, batch.ids[first],
                                                     batch.lengths[first], self.cp)
            keep = self.prefill_keep(batch.lengths[first], self.offsets[mb] + first)
            cache = CacheRows(cache, xp.asarray(first)) if len(first) < batch.size else cache
        else:
            ids = self.tokens[self._local(batch), step - 1][:, None]
            rows = self.decode_rows(batch, step)
        x = stage.embed(xp.asarray(ids)) if stage.first else self.inputs.pop(mb)
        y = stage.forward(x, rows, cache, keep)
        if step == 0:
            self.share_prefill(self.caches[mb], np.arange(batch.size), *self.groups[mb])
        if split is not None:                            # the KV cache split over cp
            if step == 0:
                split.prefilled(self.shards[mb], batch.lengths)
            else:
                split.decoded(batch.lengths + step - 1)
        if not stage.last:
            self.outputs[mb] = y
        else:
            self._sample(batch, step, y)
        if step == 0 and mb == len(self.mbs) - 1:
            self.prefill_done_at = perf_counter()

    def decode_rows(self, batch: MicroBatch, step: int) -> AttentionRows:
        """Decode step ``step``'s rows: one token per row over a cache that holds the prompt
        and the tokens of the steps before (this rank's part of them under cp)."""
        if self.split[batch.index] is not None:
            return self.split[batch.index].decode_rows(self.xp, batch.lengths + step - 1)
        return AttentionRows.build(self.xp, np.ones(batch.size, np.int64),
                                   batch.lengths + step, from_start=False)

    # ---- the last stage ---------------------------------------------------------------------

    def _sample(self, batch: MicroBatch, step: int, y=None, logits=None) -> None:
        """Step ``step``'s tokens from the stage's output ``y``, or from this rank's
        ``logits`` (b, vocab_i) of each row's next token where a ``DecodeStep`` ran."""
        stage, rows = self.stage, self._local(batch)
        if logits is not None:
            last = logits
        elif step == 0:
            last = self._prefill_logits(batch, y)
        else:
            last = stage.logits(y)[:, 0]                              # (b, vocab_i)
        history = None
        if self.needs_history:
            history = self.history(range(rows.start, rows.stop),
                                   [batch.ids[j, :batch.lengths[j]] for j in range(batch.size)],
                                   list(self.tokens[rows, :step]))
        tokens = next_tokens(stage.head, last, self.sampling, batch.rows, step,
                             self.backend.to_host, history)
        if self.reader is not None:
            self.read_logprobs(last, tokens, range(rows.start, rows.stop),
                               np.full(batch.size, step), ~self.done[rows])
        self._record(batch, step, tokens)

    def _prefill_logits(self, batch: MicroBatch, y):
        """(rows, vocab_i) each row's logits at its last prompt token, from the prefill's y
        of one row per prompt (``groups``); the prompt logits and log-probs kept on the way."""
        stage, xp = self.stage, self.xp
        first, inverse = self.groups[batch.index]
        ids, lengths = batch.ids[first], batch.lengths[first]
        rows = self.offsets[batch.index] + np.arange(batch.size)
        self.read_prompt_logprobs(y, ids, lengths, rows[first])
        self.share_prompt_logprobs(rows, first, inverse)
        if self.settings.save_logits:                    # (no cp: the engine refuses it)
            local = stage.logits(y)                                   # (b, L, vocab_i)
            full = self.backend.to_host(stage.head.full_logits(local))
            self.prompt_logits[batch.index] = full[inverse]
            last = local[xp.arange(len(first)), xp.asarray(lengths - 1)]
        else:
            h = self.last_states(y, lengths, self.prefill_keep(lengths, rows[first]),
                                 self.shards.pop(batch.index))        # each row's last token
            last = stage.logits(h)[:, 0]
        return last if len(first) == batch.size else last[xp.asarray(inverse)]

    def _record(self, batch: MicroBatch, step: int, tokens: np.ndarray) -> None:
        """Store step ``step``'s tokens; rows already done (EOS, or their own limit) get the
        pad id."""
        rows = self._local(batch)
        done = self.done[rows].copy()           # before this step (a slice is a view)
        tokens = np.where(done, self.pad_id, tokens)
        self.tokens[rows, step] = tokens
        hit = ~done & (self.ending(range(rows.start, rows.stop), tokens)
                       | (step + 1 >= self.limit[rows]))
        if self.stops is not None:                   # rows still going, not yet ending
            for j in np.flatnonzero(~done & ~hit):
                hit[j] = self.met_stop_string(rows.start + int(j), step + 1)
        self.lengths[rows] = np.where(hit, step + 1, self.lengths[rows])
        self.done[rows] = done | hit
        self.worked += int((~done).sum()) + (int(batch.lengths.sum()) if step == 0 else 0)
        if self.events is not None:
            self.events.stepped()
