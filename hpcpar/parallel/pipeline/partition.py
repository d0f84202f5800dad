"""Which decoder layers each pipeline stage holds: contiguous ranges, pure math."""

from __future__ import annotations

from typing import Sequence

from ..errors import HpcparError


def stage_layer_counts(num_layers: int, pp: int,
                       explicit: Sequence[int] | None = None) -> list[int]:
    """Layers per stage: ``explicit`` when given, else even with the remainder on the first
    stages (10 layers over 4 stages -> [3, 3, 2, 2])."""
    if explicit is not None:
        counts = list(explicit)
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
            raise HpcparError(f"stage_layers {counts} must give each of {pp} stages at least one "
                              f"layer and sum to {num_layers}")
        return counts
    if not 1 <= pp <= num_layers:
        raise HpcparError(f"cannot split {num_layers} layers over {pp} pipeline stages")
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def stage_layers(num_layers: int, pp: int, stage: int,
                 explicit: Sequence[int] | None = None) -> range:
    """The global indices of the layers on pipeline stage ``stage``."""
    counts = stage_layer_counts(num_layers, pp, explicit)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])
