"""Generation's schedule, which scoring runs too (one step): the token loop over the pipeline
(pure, no MPI).

Built from the core's actions: each (micro-batch, step) is a forward pass through every stage,
and the last stage sends the sampled tokens back to the first over the pipeline's loop
channel (``Op.SEND_LOOP`` / ``Op.RECV_LOOP``), so micro-batches circulate. Stopping a
micro-batch whose rows have all finished is the generation program's ``finished``; the
executor then retires it (its STOP flag).
"""

from __future__ import annotations

from ...parallel.pipeline.schedule import Action, Op, Schedule, forward_pass


def generation(num_stages: int, num_micro_batches: int, num_steps: int) -> Schedule:
    """Prefill (step 0) then ``num_steps - 1`` decode steps for every micro-batch.

    Step t of micro-batch m needs the token the last stage sampled at step t - 1, so the last
    stage sends it back to stage 0 (unless there is one stage). Micro-batches are interleaved
    step by step: while m waits for its token, stage 0 runs m + 1, ... Each step produces one
    token per row; the last step's tokens stay on the last stage.
    """
    last = num_stages - 1
    schedule: Schedule = [[] for _ in range(num_stages)]
    for step in range(num_steps):
        for mb in range(num_micro_batches):
            for s in range(num_stages):
                if s == 0 and step > 0 and last > 0:
                    schedule[s].append(Action(Op.RECV_LOOP, mb, step - 1, last))
                schedule[s] += forward_pass(s, num_stages, mb, step)
                if s == last and last > 0 and step < num_steps - 1:
                    schedule[s].append(Action(Op.SEND_LOOP, mb, step, 0))
    return schedule
