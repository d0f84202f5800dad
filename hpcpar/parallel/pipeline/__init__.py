"""Pipeline parallelism: schedules as data, and the executor that runs stage functions.

    partition            which layers each stage holds
    schedule             a schedule's actions, drawn, simulated and encoded for the wire
    training_schedules   GPipe, 1F1B, interleaved 1F1B and ZB-H1 as orders of actions
    executor             runs one stage's actions, messages and all
    runner               ``Pipeline`` and ``Stage``: a model's stages as functions
"""

from ..exports import lazy_names

__getattr__, __dir__, __all__ = lazy_names(__name__, {
    ".partition": ("stage_layer_counts", "stage_layers"),
    ".runner": ("Pipeline", "Stage", "concat_micro_batches", "split_micro_batches"),
    ".schedule": ("bubble_fraction", "draw"),
    ".training_schedules": ("TRAINING_SCHEDULES", "bubble_formula", "training_schedule"),
})
