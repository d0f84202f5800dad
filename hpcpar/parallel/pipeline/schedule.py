"""Pipeline schedules as plain data: one list of actions per stage, built by pure functions.

An executor only runs these lists; nothing here touches MPI or arrays, so a schedule can be
checked (``schedule_problems``), drawn (``draw``) and tested on its own.

Actions name a micro-batch ``mb`` and a ``step`` (0 for a plain forward pass; a program that
runs each micro-batch several times, as generation's token loop does, counts them).
Messages are matched in order per (sender, receiver, channel), as MPI and NCCL deliver them.

GPipe forward over S = 3 stages, M = 2 micro-batches (R recv, F forward, S send):

    stage 0:  F0 S0  F1 S1
    stage 1:  R0 F0 S0  R1 F1 S1
    stage 2:  R0 F0  R1 F1

A loop channel goes back from the last stage to the first, for programs whose micro-batches
circulate (generation, ``hpcpar.jobs.inputs.schedule``: the sampled tokens return to stage 0,
and every stage stays busy when M >= S).
Training schedules (``training_schedules``) add backward passes and the gradient channel
back through the stages to the same lists; an action's ``chunk`` names which of a stage's
model chunks it runs (the interleaved schedule holds several per stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Op(Enum):
    RECV = "recv"                 # activations from the previous stage
    FORWARD = "forward"
    SEND = "send"                 # activations to the next stage
    RECV_LOOP = "recv_loop"       # from the last stage back to the first (stage 0)
    SEND_LOOP = "send_loop"       # from the last stage back to the first (last stage)
    BACKWARD = "backward"         # B: input and weight gradients of one chunk
    BACKWARD_INPUT = "backward_input"    # I: the input-gradient half of B (zero-bubble)
    BACKWARD_WEIGHT = "backward_weight"  # W: the weight-gradient half, run later
    SEND_GRAD = "send_grad"       # input gradients to the previous stage
    RECV_GRAD = "recv_grad"       # output gradients from the next stage


SENDS = {Op.SEND: "activations", Op.SEND_LOOP: "loop", Op.SEND_GRAD: "gradients"}
RECVS = {Op.RECV: "activations", Op.RECV_LOOP: "loop", Op.RECV_GRAD: "gradients"}
COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
OP_CODES = {op: i for i, op in enumerate(Op)}
LETTERS = {Op.FORWARD: "F", Op.BACKWARD: "B", Op.BACKWARD_INPUT: "I", Op.BACKWARD_WEIGHT: "W"}
# Relative durations used to simulate and draw schedules: a backward costs two forwards, and
# splits into equal input and weight halves.
UNIT_COST = {Op.FORWARD: 1.0, Op.BACKWARD: 2.0, Op.BACKWARD_INPUT: 1.0,
             Op.BACKWARD_WEIGHT: 1.0}


@dataclass(frozen=True)
class Action:
    op: Op
    mb: int
    step: int = 0
    peer: int | None = None       # the other stage of a send or receive
    nbytes: int = 0               # payload size, filled in by the executor's pre-flight check
    chunk: int = 0                # model chunk computed; for a message, the receiver's chunk

    def __str__(self) -> str:
        tail = f"->{self.peer}" if self.op in SENDS else f"<-{self.peer}" if self.op in RECVS else ""
        where = f", chunk {self.chunk}" if self.chunk else ""
        return f"{self.op.value}(mb {self.mb}, step {self.step}{where}){tail}"


Schedule = list[list[Action]]     # schedule[stage] = that stage's actions, in order


def forward_pass(stage: int, num_stages: int, mb: int, step: int) -> list[Action]:
    out = []
    if stage > 0:
        out.append(Action(Op.RECV, mb, step, stage - 1))
    out.append(Action(Op.FORWARD, mb, step))
    if stage < num_stages - 1:
        out.append(Action(Op.SEND, mb, step, stage + 1))
    return out


def gpipe_forward(num_stages: int, num_micro_batches: int) -> Schedule:
    """All micro-batches forward through every stage in order (GPipe's forward half)."""
    return [[a for mb in range(num_micro_batches) for a in forward_pass(s, num_stages, mb, 0)]
            for s in range(num_stages)]


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """The idle share of a GPipe pass with equal stage times: (S - 1) / (S + M - 1)."""
    return (num_stages - 1) / (num_stages + num_micro_batches - 1)


def simulate(schedule: Schedule, cost: dict[Op, float] | None = None
             ) -> tuple[list[list[tuple[float, float, Action]]], list[str]]:
    """Run the schedule with sends that never block and receives that wait for their send.

    Returns, per stage, (start, end, action) in execution order, and the problems found: a
    receive whose matching send carries another micro-batch or step, a message never
    received, or a deadlock (naming where each stage is stuck). ``cost`` gives each op's
    duration (default ``UNIT_COST``: 1 for a forward, 2 for a backward, 0 for messages).
    """
    cost = cost or UNIT_COST
    n = len(schedule)
    pos, clock = [0] * n, [0.0] * n
    channels: dict[tuple, list[tuple[Action, float]]] = {}
    timeline: list[list] = [[] for _ in range(n)]
    problems: list[str] = []
    progressed = True
    while progressed and not problems:
        progressed = False
        for s in range(n):
            while pos[s] < len(schedule[s]) and not problems:
                a = schedule[s][pos[s]]
                start = clock[s]
                if a.op in SENDS:
                    if not 0 <= (a.peer if a.peer is not None else -1) < n:
                        problems.append(f"stage {s}: {a} goes to a stage that does not exist")
                        break
                    channels.setdefault((s, a.peer, SENDS[a.op]), []).append((a, start))
                elif a.op in RECVS:
                    queue = channels.get((a.peer, s, RECVS[a.op]), [])
                    if not queue:
                        break                         # blocked until the sender gets there
                    sent, at = queue.pop(0)
                    if (sent.mb, sent.step, sent.chunk) != (a.mb, a.step, a.chunk):
                        problems.append(f"stage {s}: {a} would receive stage {a.peer}'s {sent}")
                    elif sent.nbytes != a.nbytes:
                        problems.append(f"stage {s}: {a} expects {a.nbytes} bytes, stage "
                                        f"{a.peer} sends {sent.nbytes}")
                    start = max(start, at)
                clock[s] = start + cost.get(a.op, 0.0)
                timeline[s].append((start, clock[s], a))
                pos[s] += 1
                progressed = True
    if not problems:
        stuck = [f"stage {s} waits at {schedule[s][pos[s]]}" for s in range(n)
                 if pos[s] < len(schedule[s])]
        if stuck:
            problems.append("deadlock: " + "; ".join(stuck))
        for (src, dst, kind), queue in channels.items():
            if queue:
                problems.append(f"stage {src} sends {len(queue)} {kind} message(s) to stage "
                                f"{dst} that are never received, first {queue[0][0]}")
    return timeline, problems


def schedule_problems(schedule: Schedule) -> list[str]:
    """Every mismatched send/receive or deadlock in ``schedule`` (empty when it runs)."""
    return simulate(schedule)[1]


def draw(schedule: Schedule, width: int = 100) -> str:
    """A text timeline: one row per stage, one column per unit of forward time, 'F<mb>'
    (forward), 'B<mb>' (backward, two columns), 'I<mb>' / 'W<mb>' (its input and weight
    halves) while computing, '.' while idle; chunks other than 0 add '.<chunk>'."""
    timeline, problems = simulate(schedule)
    if problems:
        return "cannot draw: " + "; ".join(problems)
    end = int(max((t[-1][1] for t in timeline if t), default=0))

    def label(a: Action) -> str:
        return f"{LETTERS[a.op]}{a.mb}" + (f".{a.chunk}" if a.chunk else "")

    cell = max((len(label(a)) for row in schedule for a in row if a.op in COMPUTE),
               default=2) + 1
    shown = min(end, max(1, width // cell))
    rows = []
    for s, events in enumerate(timeline):
        cells = ["." * (cell - 1)] * shown
        for start, stop, a in events:
            for t in range(int(start), min(int(stop), shown)):
                if a.op in COMPUTE:
                    cells[t] = label(a).ljust(cell - 1)
        more = " ..." if end > shown else ""
        rows.append(f"stage {s}: " + " ".join(cells) + more)
    return "\n".join(rows)


ENCODED_FIELDS = 6


def encode(actions: list[Action]) -> list[tuple[int, ...]]:
    """Actions as integer rows (op, mb, step, peer, nbytes, chunk), to compare schedules
    across ranks without pickling."""
    return [(OP_CODES[a.op], a.mb, a.step, -1 if a.peer is None else a.peer, a.nbytes,
             a.chunk) for a in actions]


def decode(rows) -> list[Action]:
    ops = list(Op)
    return [Action(ops[int(op)], int(mb), int(step), None if peer < 0 else int(peer), int(nb),
                   int(chunk)) for op, mb, step, peer, nb, chunk in rows]
