"""Continuous batching: each micro-batch keeps up to ``batch_size`` rows in flight, and a row
that finishes (EOS, or its own token limit) gives its slot to the next prompt of the
micro-batch's queue, as vLLM's offline ``LLM.generate`` does.

The run is a series of segments of ``S`` steps, each one static pipeline schedule
(``schedule.generation``). Between segments every stage of a replica learns, from its last
stage, which rows finished and each slot's last token (one small broadcast over the pipeline
group), and every stage applies the same rule: free slots take the next prompts in order. A
segment whose micro-batch got new prompts starts with a prefill of those rows alone into
their slots of the KV cache (``CacheRows``: the decoding rows wait that one step); every other
step decodes one token for every slot. With one stage a segment is one step, so a slot is
refilled at once; with several, S steps keep the pipeline full between the refills, and a
finished row waits at most S - 1 steps for its successor. A refill prefills at most
``PREFILL_TOKENS`` prompt tokens (vLLM's max_num_batched_tokens), so filling many free slots
at the start takes several segments and the memory a prefill needs stays bounded. Once no
prompt is waiting, the last segment runs to the end of the longest row, as static batching
does.

Rows carry their own lengths and cache positions (``AttentionRows``), so a row's tokens are
those of running it alone; draws are keyed by (seed, prompt index, token index, sample), so a
seed gives the same tokens whatever the batching. Outputs stay in input order: the prompts of
a micro-batch are the ones static batching gives it, in the same rows of the output. The
samples of a prompt (``--n``) refilled together share one prefill: it runs on one slot per
prompt and the others take copies of its KV-cache rows and logits.

Where it is exact (``paged_rows.pages_rows``) the rows live in a paged KV cache instead, with
automatic prefix caching: a prompt that begins as an earlier one did prefills only the rest,
and the samples of a prompt share its blocks rather than copies of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...models.decoder import DecoderStage
from ...models.kv_blocks import blocks_for
from ...models.kv_cache import CacheRows
from ...parallel.context_parallel.ring_attention import SplitKV, split_batch
from ...parallel.ops import AttentionRows
from ...parallel.pipeline.schedule import Action, Op
from ..faults import fault_point
from ..inputs.batching import MicroBatch
from ..inputs.schedule import generation
from .decode import decode_steps
from .paged_rows import PagedRows, kv_memory_budget
from .program import GenerationSettings, ReplicaProgram, RowRules, WaveEvents
from .sampling import next_tokens

SEGMENT_STEPS = 8          # steps between refills when the pipeline has several stages
PREFILL_TOKENS = 8192      # at most this many (padded) prompt tokens in one refill's prefill


def segment_steps(pp: int) -> int:
    return 1 if pp == 1 else SEGMENT_STEPS


@dataclass
class _Slots:
    """One micro-batch's rows in flight, the same on every stage of the replica."""

    prompt: np.ndarray                  # (B,) replica-local prompt in each slot, -1: none
    position: np.ndarray                # (B,) tokens of the row in the KV cache
    queue: list[int]                    # prompts still waiting, in input order
    new: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # refilled slots
    # the refill's prefill: one of the new slots per prompt (``first``: their places in
    # ``new``; ``inverse``: each new slot's place in ``first``), its samples take copies
    first: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    inverse: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def active(self, done: np.ndarray) -> np.ndarray:
        """(B,) slots holding an unfinished prompt."""
        held = self.prompt >= 0
        return held & ~done[np.where(held, self.prompt, 0)]


class ContinuousProgram(ReplicaProgram):
    """The ``StageProgram`` of one segment at a time (``start_segment``); its per-prompt
    results (``tokens``, ``lengths``, ``done``) are in the replica's row order, as
    ``GenerationProgram``'s are."""

    def __init__(self, stage: DecoderStage, mbs: list[MicroBatch], rules: RowRules, backend,
                 batch_size: int, steps: int, events: WaveEvents | None = None, cp=None,
                 kv_blocks: int = 0, earlier: PagedRows | None = None):
        """``batch_size``: the rows in flight per micro-batch; ``steps``: decode steps per
        segment; ``kv_blocks``: the blocks of a paged cache (``kv_pool_blocks``; 0: a
        contiguous cache), ``earlier``: the paged rows of the replica's previous wave, whose
        cached prompts this wave's share. ``ReplicaProgram`` says what the other arguments
        are."""
        super().__init__(stage, mbs, rules, backend, events, cp)
        pad_id = rules.pad_id
        self.steps = steps
        rows = len(self.done)
        self.prompt_ids = [mb.ids[j, :mb.lengths[j]] for mb in mbs for j in range(mb.size)]
        self.width = [min(batch_size, mb.size) for mb in mbs]
        # a row finished mid-segment is fed until the segment ends, its position held at the
        # last slot (its cache is no longer read)
        self.capacity = max((len(p) + k for p, k in zip(self.prompt_ids, self.limit)),
                            default=1)
        local = self.cache_capacity(self.capacity)
        self.paged = (PagedRows(stage, self.width, self.capacity, rules.settings.kv_block_size,
                                min(kv_blocks, self._every_row_blocks(rules.settings)),
                                earlier)
                      if kv_blocks else None)
        self.caches = (self.paged.views if self.paged is not None
                       else [stage.new_cache(w, local) for w in self.width])
        self.split = [self.split_kv(w, local) for w in self.width]     # under cp
        self.decode = decode_steps(stage, self.caches, self.width, backend,
                                   rules.settings.cuda_graphs, cp)
        self.shards: dict[int, object] = {}                 # mb -> its refill's ContextShard
        self.slots = [_Slots(np.full(w, -1, np.int64), np.zeros(w, np.int64),
                             list(range(int(self.offsets[i]), int(self.offsets[i + 1]))))
                      for i, w in enumerate(self.width)]
        self.generated = np.zeros(rows, dtype=np.int64)
        self.step_tokens = [np.full(w, pad_id, np.int64) for w in self.width]  # last sampled
        self.logits_of: dict[int, np.ndarray] = {}                 # prompt -> (L, vocab)
        self.decoded = [0] * len(mbs)                      # decode steps run per micro-batch
        self.held = 0                                      # the most rows in flight at once

    def _every_row_blocks(self, settings: GenerationSettings) -> int:
        """The blocks of every row at its end, none shared: the most a paged cache needs."""
        return max(sum(blocks_for(len(p) + int(k), settings.kv_block_size)
                       for p, k in zip(self.prompt_ids, self.limit)), 1)

    # ---- between segments --------------------------------------------------------------------

    def start_segment(self, pp_host) -> list[Action]:
        """Agree with the pipeline (``pp_host``: the pipeline group on the host) on what
        finished (the last stage knows) and refill the free slots; returns this stage's
        actions for the segment (none when nothing is left)."""
        stage = self.stage
        last = pp_host.size - 1
        state = np.concatenate([self.done.astype(np.int64), self.generated,
                                *self.step_tokens]) if self.mbs else np.zeros(0, np.int64)
        pp_host.broadcast(state, root=last)
        rows = len(self.done)
        if not stage.last:
            self.done[:] = state[:rows].astype(bool)
            self.generated[:] = state[rows:2 * rows]
            at = 2 * rows
            for i, w in enumerate(self.width):
                self.step_tokens[i][:] = state[at:at + w]
                at += w
        if self.paged is not None:
            self._share_tokens(self._make_room(), pp_host)
        work, steps, in_flight = False, 1, 0
        for s in self.slots:
            free = np.flatnonzero(~s.active(self.done))
            take = self._admit(s.queue[:len(free)])
            s.new = free[:take]
            s.prompt[free[take:]] = -1                    # finished, nothing to take its place
            for slot in s.new:
                s.prompt[slot] = s.queue.pop(0)
            s.first, s.inverse = self._groups(s.prompt[s.new])
            active = s.active(self.done)
            in_flight += int(active.sum())
            work = work or bool(active.any())
            held = s.prompt[active]
            steps = max(steps, int((self.limit[held] - self.generated[held]).max(initial=0)))
        self.held = max(self.held, in_flight)
        if not work:
            return []
        if any(s.queue for s in self.slots):
            steps = self.steps                    # refill again soon
        if self.paged is not None:
            steps = self._reach(steps)
            for mb, s in enumerate(self.slots):
                self.paged.bind(mb, s.prompt)
        return generation(pp_host.size, len(self.mbs), steps)[pp_host.rank]

    # ---- a paged cache's rows ----------------------------------------------------------------

    def _make_room(self) -> list[int]:
        """Finished rows give their blocks back; every running row takes those of its next
        ``steps`` positions, the newest rows preempted where the pool runs out: they wait at
        the front of their queue and compute their tokens again when readmitted. Returns
        the rows preempted."""
        needs, where = {}, {}
        for s in self.slots:
            for slot in np.flatnonzero(s.prompt >= 0):
                row = int(s.prompt[slot])
                if self.done[row]:
                    self.paged.release(row)
                else:
                    needs[row] = min(int(s.position[slot]) + self.steps, self._total(row))
                    where[row] = (s, slot)
        preempted = self.paged.grow(needs)
        for row in preempted:
            s, slot = where[row]
            s.prompt[slot] = -1
            s.queue.insert(0, row)
        return preempted

    def _share_tokens(self, rows: list[int], pp_host) -> None:
        """The tokens preempted ``rows`` generated, sent from the last stage (which samples
        them; the others keep the first stage's inputs, or none) to every stage: each
        computes them again at the readmission (the first stage embeds them; every stage
        hashes them for its prefix cache, alike)."""
        if pp_host.size == 1 or not rows:
            return
        rows = np.array(sorted(rows), np.int64)
        counts = self.generated[rows]
        flat = (np.concatenate([self.tokens[r, :k] for r, k in zip(rows, counts)])
                if self.stage.last else np.empty(int(counts.sum()), np.int64))
        pp_host.broadcast(flat, root=pp_host.size - 1)
        for r, part in zip(rows, np.split(flat, np.cumsum(counts)[:-1])):
            self.tokens[r, :len(part)] = part

    def _reach(self, steps: int) -> int:
        """The segment's steps: ``steps`` where every active row's blocks can hold them (a
        refill's samples take theirs at its prefill), else the segment's usual length, for
        which ``_make_room`` and the admission kept them."""
        if steps <= self.steps or any(len(s.first) < len(s.new) for s in self.slots):
            return min(steps, self.steps) if steps > self.steps else steps
        needs = {}
        for s in self.slots:
            for slot in np.flatnonzero(s.active(self.done)):
                row = int(s.prompt[slot])
                held = (len(self._ids(row)) if slot in s.new else int(s.position[slot]))
                needs[row] = min(held + steps, self._total(row))
        return steps if self.paged.extend(needs) else self.steps

    def _total(self, row: int) -> int:
        """The positions row ``row`` holds at its end: its prompt and its new tokens."""
        return len(self.prompt_ids[row]) + int(self.limit[row])

    def _reserve(self, row: int) -> int:
        """Positions past its tokens a row is admitted with: a segment's worth."""
        return min(self.steps, int(self.limit[row] - self.generated[row]))

    def _ids(self, row: int) -> np.ndarray:
        """What row ``row``'s refill computes from: its prompt, and the tokens it generated
        before it was preempted."""
        k = int(self.generated[row])
        if k == 0:
            return self.prompt_ids[row]
        return np.concatenate([self.prompt_ids[row], self.tokens[row, :k]])

    def _key(self, row: int):
        """A fresh row's prompt, which its other fresh samples share (None: a readmitted
        row, whose tokens are its own)."""
        return int(self.source[row]) if self.generated[row] == 0 else None

    def _groups(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``prefill_groups``; in a paged cache a readmitted row prefills alone."""
        if self.paged is None:
            return self.prefill_groups(rows)
        rows = np.asarray(rows, np.int64)
        keys = np.where(self.generated[rows] == 0, self.source[rows], -1 - rows)
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        return first, inverse.reshape(-1)

    def _admit(self, waiting: list[int]) -> int:
        """How many of the ``waiting`` prompts (one per free slot) a refill takes: all whose
        padded prefill holds at most ``PREFILL_TOKENS`` tokens (at least one), so a prefill's
        activations stay bounded whatever the rows in flight; the rest wait a segment. In a
        paged cache, the tokens computed count, and the rows take their blocks
        (``PagedRows.admit``)."""
        if self.paged is not None:
            return self.paged.admit(waiting, self._ids, self._key, self._reserve,
                                    PREFILL_TOKENS)
        take, longest = 0, 0
        for p in waiting:
            longest = max(longest, len(self.prompt_ids[p]))
            if take and (take + 1) * longest > PREFILL_TOKENS:
                break
            take += 1
        return take

    # ---- StageProgram ------------------------------------------------------------------------

    def _refill(self, mb: int, step: int) -> bool:
        return step == 0 and len(self.slots[mb].new) > 0

    def prefill_seconds(self, times, start: float) -> float:
        """Refills interleave with decoding: the time the prefill steps took."""
        return times.compute[0] + times.wait[0]

    def phase(self, a: Action) -> int:
        """Prefill (0) for a refill's step, decode (1) for every other (the run report)."""
        return 0 if self._refill(a.mb, a.step) else 1

    def payload(self, a: Action):
        if a.op in (Op.SEND, Op.RECV):
            if self._refill(a.mb, a.step):
                rows, width = self._prefill_ids(a.mb).shape   # one row per prompt
                shape = (rows, self.prefill_width(width))
            else:
                shape = (self.width[a.mb], 1)
            return shape + (self.stage.hidden_size,), self.stage.dtype
        return (self.width[a.mb],), np.dtype(np.int64)

    def finished(self, mb: int) -> bool:
        """The first stage retires a micro-batch for the rest of the segment once every row
        it holds has finished (the next segment refills it), or on a stop request its tp
        ranks agree on (the segment's end then ends the run: ``stopping``)."""
        if not self.stage.first:
            return False
        return self.stopping() or not self.slots[mb].active(self.done).any()

    def receive(self, a: Action, payload) -> None:
        if a.op is Op.RECV:
            self.inputs[a.mb] = payload
        else:
            tokens = self.backend.to_host(payload)
            self._record(a.mb, a.step, tokens)

    def outgoing(self, a: Action):
        if a.op is Op.SEND:
            return self.outputs.pop(a.mb)
        return self.xp.asarray(self.step_tokens[a.mb])

    def compute(self, a: Action) -> None:
        if not self._refill(a.mb, a.step):
            self.decoded[a.mb] += 1
            fault_point("decode", self.decoded[a.mb])
        stage, xp, s = self.stage, self.xp, self.slots[a.mb]
        cache = self.caches[a.mb]
        split = self.split[a.mb]
        if self._refill(a.mb, a.step) and self.paged is not None:
            y = self._prefill_paged(a.mb)
        elif self._refill(a.mb, a.step):
            slots = s.new[s.first]                     # one per prompt; its samples copy it
            lengths = self._lengths(s.prompt[slots])
            ids, rows, shard = split_batch(xp, self._prefill_ids(a.mb), lengths, self.cp)
            x = stage.embed(xp.asarray(ids)) if stage.first else self.inputs.pop(a.mb)
            y = stage.forward(x, rows, CacheRows(cache, xp.asarray(slots)),
                              self.prefill_keep(lengths, s.prompt[slots]))
            self.share_prefill(cache, s.new, s.first, s.inverse)
            s.position[s.new] = lengths[s.inverse]
            if split is not None:
                split.prefilled(shard, lengths, s.new)
                self.shards[a.mb] = shard
        elif self.decode is not None:                    # the whole model on this rank
            logits = self.decode[a.mb](self.step_tokens[a.mb], s.position + 1)
            self._advance(s)
            self._sample(a.mb, a.step, logits=logits)
            return
        else:
            held = s.prompt >= 0
            if split is None:
                rows = AttentionRows.build(xp, np.ones(len(s.prompt), np.int64),
                                           s.position + 1, from_start=False)
            else:
                rows = split.decode_rows(xp, s.position, held)
            x = (stage.embed(xp.asarray(self.step_tokens[a.mb][:, None])) if stage.first
                 else self.inputs.pop(a.mb))
            y = stage.forward(x, rows, cache)
            if split is not None:
                split.decoded(s.position, held)
            self._advance(s)
        if stage.last:
            self._sample(a.mb, a.step, y)
        else:
            self.outputs[a.mb] = y

    def _prefill_paged(self, mb: int):
        """A refill's prefill in the paged cache: each new row from its cached prefix on,
        its prompt's full blocks sealed once this stage has written them."""
        stage, xp, s = self.stage, self.xp, self.slots[mb]
        rows = s.prompt[s.new[s.first]]                 # one per prompt; its samples fork it
        lengths = self._lengths(rows)
        computed = self._computed(rows)
        attention = AttentionRows.build(xp, computed, lengths, from_start=bool(
            (computed == lengths).all()))
        x = (stage.embed(xp.asarray(self._prefill_ids(mb))) if stage.first
             else self.inputs.pop(mb))
        y = stage.forward(x, attention, self.paged.prefill_view(rows, lengths),
                          self.prefill_keep(computed, rows))
        self.paged.seal(rows, self._ids)
        self.paged.fork(s.prompt[s.new], s.first, s.inverse, lengths[s.inverse], self._reserve)
        self.paged.bind(mb, s.prompt, refresh=s.new)    # the new rows' keys, the samples'
                                                        # blocks (taken now)
        s.position[s.new] = lengths[s.inverse]
        return y

    def kv_cache_bytes(self) -> int:
        return self.paged.nbytes if self.paged is not None else super().kv_cache_bytes()

    def prefix_stats(self) -> tuple[int, int]:
        if self.paged is None:
            return super().prefix_stats()
        stats = self.paged.stats()
        return stats.prompt_tokens, stats.hit_tokens

    def rows_held(self) -> int:
        return self.held

    def pool_stats(self) -> tuple[int, int, int]:
        if self.paged is None:
            return super().pool_stats()
        stats = self.paged.stats()
        return stats.blocks, stats.peak_in_use, self.paged.preemptions

    def _advance(self, s: _Slots) -> None:
        """A decode step's slots one position on: every stage alike (slots change at refills
        only); a finished row stays in bounds."""
        s.position = np.minimum(s.position + (s.prompt >= 0), self.capacity - 1)

    def _lengths(self, rows: np.ndarray) -> np.ndarray:
        return np.array([len(self._ids(p)) for p in rows], np.int64)

    def _computed(self, rows: np.ndarray) -> np.ndarray:
        """The prompt tokens a refill computes of each row: past its cached prefix."""
        lengths = self._lengths(rows)
        return lengths if self.paged is None else lengths - self.paged.starts(rows)

    def _prefill_ids(self, mb: int) -> np.ndarray:
        """(prompts, longest) the refill's prompts, one per prompt (``_Slots.first``), each
        from column 0."""
        s = self.slots[mb]
        rows = s.prompt[s.new[s.first]]
        prompts = [self._ids(p) for p in rows]
        if self.paged is not None:                # each from its cached prefix on
            prompts = [p[start:] for p, start in zip(prompts, self.paged.starts(rows))]
        ids = np.zeros((len(prompts), max(len(p) for p in prompts)), dtype=np.int64)
        for j, p in enumerate(prompts):
            ids[j, :len(p)] = p
        return ids

    # ---- the last stage ----------------------------------------------------------------------

    def _sample(self, mb: int, step: int, y=None, logits=None) -> None:
        """The step's tokens from the stage's output ``y``, or from this rank's ``logits``
        (width, 1, vocab_i) where a ``DecodeStep`` ran."""
        stage, s = self.stage, self.slots[mb]
        if self._refill(mb, step):
            slots = s.new
            last = self._prefill_logits(mb, y)
        else:
            slots = np.arange(len(s.prompt))
            last = stage.logits(y) if logits is None else logits
        prompts = np.where(s.prompt[slots] >= 0, s.prompt[slots], 0)
        history = None
        if self.needs_history:
            history = self.history(prompts, [self.prompt_ids[q] for q in prompts],
                                   [self.tokens[q, :self.generated[q]] for q in prompts])
        tokens = next_tokens(stage.head, last[:, 0], self.sampling,
                             self.global_rows[prompts], self.generated[prompts],
                             self.backend.to_host, history)
        if self.reader is not None:              # rows that asked for log-probs
            live = np.isin(slots, self._producing(mb, step)) & ~self.done[prompts]
            self.read_logprobs(last[:, 0], tokens, prompts, self.generated[prompts], live)
        self.step_tokens[mb][slots] = tokens
        self._record(mb, step, self.step_tokens[mb])

    def _prefill_logits(self, mb: int, y):
        """(new slots, 1, vocab_i) each refilled slot's logits at its last prompt token, from
        the prefill's y of one slot per prompt; the prompt logits and log-probs kept."""
        stage, s = self.stage, self.slots[mb]
        rows = s.prompt[s.new]
        lengths = self._lengths(rows[s.first])
        if self.settings.save_logits:
            full = self.backend.to_host(stage.head.full_logits(stage.logits(y)))
            for j, p in enumerate(rows):
                self.logits_of[int(p)] = full[s.inverse[j], :len(self.prompt_ids[p])]
        self.read_prompt_logprobs(y, self._prefill_ids(mb), lengths, rows[s.first])
        self.share_prompt_logprobs(rows, s.first, s.inverse)
        computed = self._computed(rows[s.first])
        last = stage.logits(self.last_states(y, computed, self.prefill_keep(computed,
                                                                            rows[s.first]),
                                             self.shards.pop(mb, None)))
        # y's rows are in ``first``'s order (the prompts' keys sorted: readmitted rows in
        # reverse), the slots in ``new``'s
        if np.array_equal(s.first, np.arange(len(rows))):
            return last
        return last[self.xp.asarray(s.inverse)]

    def _record(self, mb: int, step: int, tokens: np.ndarray) -> None:
        """This step's tokens for the slots that produced one (every active slot; after a
        refill, the new ones alone); a row is done at EOS or its own limit. The first stage
        keeps the same books from the tokens the last stage sends back."""
        s = self.slots[mb]
        producing = self._producing(mb, step)
        if not self.stage.last:
            self.step_tokens[mb][:] = tokens
        for slot in producing:
            p = int(s.prompt[slot])
            if self.done[p]:
                continue
            k = int(self.generated[p])
            self.worked += 1 + (len(self.prompt_ids[p]) if k == 0 else 0)
            self.tokens[p, k] = tokens[slot]
            self.generated[p] = k + 1
            if (self.ends(p, int(tokens[slot])) or k + 1 >= self.limit[p]
                    or self.met_stop_string(p, k + 1)):
                self.done[p] = True
                self.lengths[p] = k + 1
        if self.events is not None:
            self.events.stepped()

    def _producing(self, mb: int, step: int) -> np.ndarray:
        """The slots whose row gets a token at this step: every active one, or after a
        refill the new ones alone."""
        s = self.slots[mb]
        return s.new if self._refill(mb, step) else np.flatnonzero(s.active(self.done))

    def finish(self) -> None:
        """Per micro-batch prompt logits, in the static layout ``_collect`` sends."""
        if not self.settings.save_logits:
            return
        vocab = self.stage.cfg.vocab_size
        for i, mb in enumerate(self.mbs):
            full = np.full((mb.size, mb.length, vocab), np.nan, dtype=np.float32)
            for j in range(mb.size):
                logits = self.logits_of.get(int(self.offsets[i]) + j)
                if logits is not None:
                    full[j, :len(logits)] = logits
            self.prompt_logits[mb.index] = full


def rows_in_flight(settings: GenerationSettings, stage, mbs, limits, backend, world,
                   cp=None, paged: bool = False) -> int:
    """Rows in flight per micro-batch: --batch-size, or what fits: in a paged cache every
    row (the blocks bound them), else the rows whose KV cache (for the longest prompt and
    limit, every micro-batch) takes at most ``--kv-memory`` (bytes, or a fraction of the
    free memory; by default ``KV_SHARE`` of it) on the fullest rank (collective over the
    world)."""
    if settings.batch_size:
        return settings.batch_size
    if paged:
        return max((mb.size for mb in mbs), default=1)
    fit = 2 ** 62
    budget = kv_memory_budget(settings.kv_memory, backend.free_memory_bytes())
    if budget is not None and mbs:
        capacity = max(int(n + limits[r]) for mb in mbs for r, n in zip(mb.rows, mb.lengths))
        if cp is not None:                     # a rank holds its part of each row's cache
            capacity = SplitKV.local_capacity(capacity, cp.size)
        per_row = len(mbs) * stage.kv_bytes_per_row(capacity)
        fit = max(1, int(budget // max(per_row, 1)))
    fit = -int(world.all_reduce(np.array([-fit], dtype=np.int64), op="max")[0])
    return min(fit, max((mb.size for mb in mbs), default=1))
