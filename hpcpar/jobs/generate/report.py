"""The run report: what rank 0 prints at the end and stores in the output's attributes.

Every rank contributes one row of numbers (``RankFigures``); ``RunReport.build`` turns the
table into per-stage times, throughput, the measured pipeline bubble next to the formula's,
bytes by kind of communication and peak memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from ...parallel.pipeline.schedule import bubble_fraction
from ..layout import ParallelConfig, by_stage


@dataclass
class RankFigures:
    compute_prefill: float = 0.0
    compute_decode: float = 0.0
    wait_prefill: float = 0.0
    wait_decode: float = 0.0
    prefill_end: float = 0.0      # seconds from the common start to this stage's last prefill
                                  # (continuous batching: seconds in its prefill steps)
    total: float = 0.0            # seconds from the common start to the end of this rank's run
    tp_all_reduce_bytes: float = 0.0
    tp_all_gather_bytes: float = 0.0
    tp_reduce_scatter_bytes: float = 0.0     # a sequence-parallel prefill's
    pp_send_bytes: float = 0.0
    pp_recv_bytes: float = 0.0
    peak_host_bytes: float = 0.0
    device_bytes: float = 0.0
    kv_cache_bytes: float = 0.0
    weight_bytes: float = 0.0
    load_seconds: float = 0.0     # reading this rank's slices to its device
    load_bytes: float = 0.0
    ep_all_to_all_bytes: float = 0.0     # a mixture of experts' tokens to their experts
    expert_bytes: float = 0.0            # the experts' share of ``weight_bytes``
    prefix_prompt_tokens: float = 0.0    # prompt tokens admitted to a paged cache
    prefix_hit_tokens: float = 0.0       # of those, served from its prefix cache
    kv_blocks: float = 0.0               # the blocks of its paged cache
    kv_blocks_peak: float = 0.0          # the most in use at once
    preemptions: float = 0.0             # rows preempted when the blocks ran out
    rows_in_flight: float = 0.0          # the most rows its KV caches held at once

    def to_array(self) -> np.ndarray:
        return np.array([getattr(self, f.name) for f in fields(self)], dtype=np.float64)

    def combine(self, later: "RankFigures") -> "RankFigures":
        """Two waves of one run: times and bytes add up, memory is the larger."""
        peaks = ("peak_host_bytes", "device_bytes", "kv_cache_bytes", "weight_bytes",
                 "load_seconds", "load_bytes", "expert_bytes", "kv_blocks", "kv_blocks_peak",
                 "rows_in_flight")
        return RankFigures(**{f.name: (max if f.name in peaks else sum)(
            (getattr(self, f.name), getattr(later, f.name))) for f in fields(self)})

    @classmethod
    def from_array(cls, row) -> "RankFigures":
        return cls(*(float(v) for v in row))

    @classmethod
    def width(cls) -> int:
        return len(fields(cls))


@dataclass
class RunReport:
    layout: str
    micro_batches: int
    prompts: int
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    bubble_formula: float
    bubble_prefill: float
    bubble_decode: float
    stage_compute_s: list[float]
    stage_wait_s: list[float]
    tp_all_reduce_bytes: int
    tp_all_gather_bytes: int
    pp_send_recv_bytes: int
    peak_host_mb: list[float]
    device_mb: list[float]
    kv_cache_mb: list[float]
    weight_mb: list[float]
    load_seconds: float
    load_gb_per_s: float          # all ranks' bytes over the slowest rank's seconds
    ep_all_to_all_bytes: int = 0
    expert_mb: list[float] | None = None     # a mixture of experts: per rank
    prefix_hit_rate: float = 0.0  # prompt tokens served from the prefix cache, of those admitted
    kv_blocks: int = 0            # the paged cache's blocks per rank (0: a contiguous cache)
    kv_blocks_peak: int = 0       # the most in use at once, on the fullest rank
    preemptions: int = 0          # rows preempted (their blocks freed, recomputed), all replicas
    rows_in_flight: int = 0       # the most rows a replica's KV caches held at once
    samples: int = 0                         # rows generated (n per prompt with --n)
    tp_reduce_scatter_bytes: int = 0         # a sequence-parallel prefill's

    @classmethod
    def build(cls, table: np.ndarray, layout: ParallelConfig, micro_batches: int, prompts: int,
              prompt_tokens: int, new_tokens: int, rows: int | None = None) -> "RunReport":
        """``rows``: the samples generated (``prompts``, one each, when None); each one's
        first token comes from the prefill."""
        rows = prompts if rows is None else rows
        ranks = [RankFigures.from_array(row) for row in table]
        stages = by_stage(ranks, layout)

        def mean(values):
            return float(np.mean(values)) if values else 0.0

        prefill = max(f.prefill_end for f in ranks)
        total = max(f.total for f in ranks)
        decode = max(total - prefill, 0.0)
        compute_p = [mean([f.compute_prefill for f in g]) for g in stages]
        compute_d = [mean([f.compute_decode for f in g]) for g in stages]
        return cls(
            layout=layout.describe(),
            micro_batches=micro_batches, prompts=prompts, prompt_tokens=prompt_tokens,
            new_tokens=new_tokens, prefill_seconds=prefill, decode_seconds=decode,
            prefill_tokens_per_s=prompt_tokens / prefill if prefill else 0.0,
            decode_tokens_per_s=max(new_tokens - rows, 0) / decode if decode else 0.0,
            samples=rows,
            bubble_formula=bubble_fraction(layout.pp, micro_batches),
            bubble_prefill=1 - mean(compute_p) / prefill if prefill else 0.0,
            bubble_decode=1 - mean(compute_d) / decode if decode else 0.0,
            stage_compute_s=[c + d for c, d in zip(compute_p, compute_d)],
            stage_wait_s=[mean([f.wait_prefill + f.wait_decode for f in g]) for g in stages],
            tp_all_reduce_bytes=int(sum(f.tp_all_reduce_bytes for f in ranks)),
            tp_all_gather_bytes=int(sum(f.tp_all_gather_bytes for f in ranks)),
            tp_reduce_scatter_bytes=int(sum(f.tp_reduce_scatter_bytes for f in ranks)),
            pp_send_recv_bytes=int(sum(f.pp_send_bytes + f.pp_recv_bytes for f in ranks)),
            peak_host_mb=[f.peak_host_bytes / 1e6 for f in ranks],
            device_mb=[f.device_bytes / 1e6 for f in ranks],
            kv_cache_mb=[f.kv_cache_bytes / 1e6 for f in ranks],
            weight_mb=[f.weight_bytes / 1e6 for f in ranks],
            load_seconds=max(f.load_seconds for f in ranks),
            load_gb_per_s=(sum(f.load_bytes for f in ranks) / 1e9
                           / max(max(f.load_seconds for f in ranks), 1e-9)),
            ep_all_to_all_bytes=int(sum(f.ep_all_to_all_bytes for f in ranks)),
            prefix_hit_rate=(sum(f.prefix_hit_tokens for f in ranks)
                             / max(sum(f.prefix_prompt_tokens for f in ranks), 1)),
            kv_blocks=int(max(f.kv_blocks for f in ranks)),
            kv_blocks_peak=int(max(f.kv_blocks_peak for f in ranks)),
            # every rank of a replica keeps the same books: each preemption counts once
            preemptions=round(sum(f.preemptions for f in ranks)
                              / (layout.pp * layout.tp * layout.cp)),
            rows_in_flight=int(max(f.rows_in_flight for f in ranks)),
            expert_mb=[f.expert_bytes / 1e6 for f in ranks])

    def attrs(self) -> dict:
        """Flat HDF5-friendly attributes, prefixed ``report_``."""
        return {f"report_{k}": (np.asarray(v) if isinstance(v, list) else v)
                for k, v in asdict(self).items()}

    def format(self) -> str:
        samples = f" ({self.samples} samples)" if self.samples > self.prompts else ""
        lines = [
            f"layout: {self.layout}, {self.micro_batches} micro-batch(es) per replica; "
            f"{self.prompts} prompts{samples}, {self.prompt_tokens} prompt tokens, "
            f"{self.new_tokens} new tokens",
            f"prefill: {self.prefill_seconds:.3f} s, {self.prefill_tokens_per_s:,.0f} tokens/s   "
            f"decode: {self.decode_seconds:.3f} s, {self.decode_tokens_per_s:,.1f} tokens/s",
            f"bubble: prefill {self.bubble_prefill:.1%} measured, "
            f"{self.bubble_formula:.1%} by (S-1)/(S+M-1); decode {self.bubble_decode:.1%} "
            "measured",
            "stage  compute s  waiting s",
        ]
        lines += [f"{s:>5} {c:>10.3f} {w:>10.3f}"
                  for s, (c, w) in enumerate(zip(self.stage_compute_s, self.stage_wait_s))]
        ep = (f", ep all-to-all {_mb(self.ep_all_to_all_bytes)}"
              if self.ep_all_to_all_bytes else "")
        scatter = (f", tp reduce-scatter {_mb(self.tp_reduce_scatter_bytes)}"
                   if self.tp_reduce_scatter_bytes else "")
        lines.append(f"communicated (all ranks): tp all-reduce {_mb(self.tp_all_reduce_bytes)}, "
                     f"tp all-gather {_mb(self.tp_all_gather_bytes)}{scatter}, pp send/recv "
                     f"{_mb(self.pp_send_recv_bytes)}{ep}")
        experts = (f" (experts {max(self.expert_mb):.1f} MB)"
                   if self.expert_mb and max(self.expert_mb) else "")
        memory = (f"peak host memory per rank: {min(self.peak_host_mb):.0f}-"
                  f"{max(self.peak_host_mb):.0f} MB; weights {max(self.weight_mb):.1f} MB"
                  f"{experts}, KV cache {max(self.kv_cache_mb):.1f} MB on the largest rank"
                  + (f", {self.rows_in_flight} rows in flight at most" if self.rows_in_flight
                     else ""))
        if max(self.device_mb) > 0:
            memory += f"; GPU pool {max(self.device_mb):.0f} MB"
        lines.append(memory)
        if self.kv_blocks:
            lines.append(f"paged KV cache: {self.kv_blocks_peak} of {self.kv_blocks} blocks in "
                         f"use at most, {self.preemptions} rows preempted; prefix cache: "
                         f"{self.prefix_hit_rate:.1%} of the prompt tokens served from it")
        lines.append(f"loading: {self.load_seconds:.2f} s, {self.load_gb_per_s:.2f} GB/s "
                     "(all ranks' bytes over the slowest rank's time)")
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"
