"""Training across dp × pp × tp: hand-written backward passes, pipeline schedules that mix
forward and backward, data-parallel gradient reduction, optimizers and resumable checkpoints."""
