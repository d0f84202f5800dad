"""Optimizers over any model's parameters: SGD and AdamW as a few elementwise passes over
flat buffers (``optimizers``, ``flat_layout``), and what an optimizer is told, with the
learning-rate schedule (``settings``: pure data, which the jobs' settings import)."""

from ..exports import lazy_names

__getattr__, __dir__, __all__ = lazy_names(__name__, {
    ".optimizers": ("AdamW", "LossScaler", "Optimizer", "SGD", "clip_coefficient"),
    ".settings": ("OptimizerSettings", "learning_rate"),
})
