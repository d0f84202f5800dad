"""Data parallelism over any model's parameters: gradients summed over replicas in buckets
while the backward runs (``reducer``), in flat buffers that hold many tensors end to end
(``flat_buffers``, which the optimizers share)."""

from ..exports import lazy_names

__getattr__, __dir__, __all__ = lazy_names(__name__, {
    ".reducer": ("GradientReducer", "grad_norm", "sum_partial_grads"),
})
