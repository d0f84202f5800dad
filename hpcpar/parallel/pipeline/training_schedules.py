"""Training schedules as plain data: per stage, the order of its forward and backward passes,
then the sends and receives that connect them (pure functions, no MPI).

A schedule is built in two steps, as ``torch.distributed.pipelining`` does: a compute-only
order per stage (F, B, or the zero-bubble halves I and W), then ``with_messages`` puts a
receive before every pass that needs another stage's data and a send after every pass whose
result another stage needs. The pre-flight simulator (``schedule.simulate``) checks the
result before any rank runs it.

With p stages, m micro-batches and V chunks per stage (interleaved), chunk c of stage s is
virtual stage v = c p + s: the model's layers are cut into p V consecutive pieces, and
micro-batches flow 0 -> 1 -> ... -> pV - 1 and back.

Unit costs F = 1, B = 2 (I = W = 1); with them the idle share of each stage is

    gpipe, 1f1b      (p - 1) / (m + p - 1)            3(p - 1) idle units per 3m busy
    interleaved      (p - 1) / (V m + p - 1)          3(p - 1) per 3Vm
    zb-h1            (p - 1) / (3m + p - 1)           (p - 1) per 3m when m >= p: W fills
                                                      the bubbles (fewer micro-batches: the
                                                      F and I chains of 2m + 2p - 1 units)

and the micro-batches whose activations stage s holds at once peak at

    gpipe m;  1f1b min(p - s, m);  zb-h1 min(p - s, m);
    interleaved min(2(p - s - 1) + (V - 1) p + 1, V m)  (chunk activations).
"""

from __future__ import annotations

from .schedule import Action, Op, Schedule

TRAINING_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")

Pass = tuple[Op, int, int]            # (F / B / I / W, micro-batch, chunk)


def micro_batch_problems(kind: str, num_stages: int, num_micro_batches: int,
                         virtual_stages: int = 1) -> list[str]:
    """Why ``kind`` cannot run with these counts (empty when it can)."""
    p, m, V = num_stages, num_micro_batches, virtual_stages
    if kind not in TRAINING_SCHEDULES:
        return [f"schedule {kind!r} is not one of {', '.join(TRAINING_SCHEDULES)}"]
    if kind != "interleaved":
        return [] if V == 1 else [f"--virtual-stages {V} needs --schedule interleaved"]
    out = []
    if p < 2:
        out.append("the interleaved schedule needs pp >= 2")
    if V < 2:
        out.append(f"the interleaved schedule needs --virtual-stages >= 2, got {V}")
    if p >= 2 and m % p:
        out.append(f"the interleaved schedule runs micro-batches in groups of pp: "
                   f"micro_batches {m} is not a multiple of pp {p}")
    return out


# ---- compute orders (per stage) -----------------------------------------------------------

def gpipe_order(p: int, m: int, s: int) -> list[Pass]:
    """Every forward, then every backward."""
    return ([(Op.FORWARD, i, 0) for i in range(m)]
            + [(Op.BACKWARD, i, 0) for i in range(m)])


def one_f_one_b_order(p: int, m: int, s: int) -> list[Pass]:
    """Warm-up: p - s - 1 forwards; steady: one forward, one backward; cool-down: the
    remaining backwards. At most p - s micro-batches are in flight on stage s."""
    warmup = min(p - s - 1, m)
    order = [(Op.FORWARD, i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(Op.FORWARD, warmup + i, 0), (Op.BACKWARD, i, 0)]
    return order + [(Op.BACKWARD, i, 0) for i in range(m - warmup, m)]


def interleaved_order(p: int, m: int, s: int, V: int) -> list[Pass]:
    """Megatron's interleaved 1F1B: the k-th forward runs chunk (k // p) % V of micro-batch
    (k // pV) p + k % p, backwards visit the chunks in reverse; warm-up 2(p - s - 1) + (V-1) p
    forwards, then one forward one backward, then the cool-down backwards."""
    total = m * V

    def forward(k: int) -> Pass:
        return Op.FORWARD, (k // (p * V)) * p + k % p, (k // p) % V

    def backward(k: int) -> Pass:
        return Op.BACKWARD, (k // (p * V)) * p + k % p, V - 1 - (k // p) % V

    warmup = min(2 * (p - s - 1) + (V - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [forward(warmup + i), backward(i)]
    return order + [backward(k) for k in range(total - warmup, total)]


def zb_h1_orders(p: int, m: int) -> list[list[Pass]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): each backward splits into I,
    the input gradient the previous stage waits for, and W, the weight gradient nobody waits
    for. Built by list scheduling with unit costs: a free stage runs the next I whose
    gradient has arrived, else the next forward if fewer than p - s micro-batches are
    between F and I (1F1B's memory: I releases the activations, W keeps only the inputs and
    output gradients of the linears), else the oldest pending W (first, once p - 1 are
    waiting); so W fills the time 1F1B spends waiting."""
    orders: list[list[Pass]] = [[] for _ in range(p)]
    clock = [0.0] * p
    f_done = [[None] * m for _ in range(p)]       # finish time of F(mb) on each stage
    i_done = [[None] * m for _ in range(p)]
    next_f, next_i = [0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    finished_w = [0] * p
    while any(finished_w[s] < m for s in range(p)):
        # advance the stage that is free earliest and has something it can start
        best = None
        for s in range(p):
            if finished_w[s] == m:
                continue
            choice = _zb_next(s, p, m, clock, f_done, i_done, next_f, next_i, pending_w,
                              finished_w)
            if choice is not None and (best is None or choice[0] < best[0][0]):
                best = (choice, s)
        (start, op, mb), s = best
        clock[s] = start + 1.0
        orders[s].append((op, mb, 0))
        if op is Op.FORWARD:
            f_done[s][mb] = clock[s]
            next_f[s] += 1
        elif op is Op.BACKWARD_INPUT:
            i_done[s][mb] = clock[s]
            next_i[s] += 1
            pending_w[s].append(mb)
        else:
            pending_w[s].pop(0)
            finished_w[s] += 1
    return orders


def _zb_next(s, p, m, clock, f_done, i_done, next_f, next_i, pending_w, finished_w):
    """(start time, op, micro-batch) of what stage s would run next, by ZB-H1's priorities."""
    now = clock[s]
    candidates = []
    i = next_i[s]
    if i < m and f_done[s][i] is not None:
        ready = f_done[s][i] if s == p - 1 else i_done[s + 1][i]
        if ready is not None:
            candidates.append((max(now, ready), 0, Op.BACKWARD_INPUT, i))
    f = next_f[s]
    if f < m and f - next_i[s] < p - s:
        ready = now if s == 0 else f_done[s - 1][f]
        if ready is not None:
            candidates.append((max(now, ready), 1, Op.FORWARD, f))
    if pending_w[s]:
        # at most p - 1 W's wait on a stage: past that the oldest goes first, so their
        # saved inputs do not pile up (and the bubble stays the formula's)
        urgent = len(pending_w[s]) > p - 1
        candidates.append((now, -1 if urgent else 2, Op.BACKWARD_WEIGHT, pending_w[s][0]))
    if not candidates:
        return None
    start, _, op, mb = min(candidates)
    return start, op, mb


# ---- messages ------------------------------------------------------------------------------

def with_messages(orders: list[list[Pass]], virtual_stages: int = 1) -> Schedule:
    """Insert the receive before, and the send after, every pass that crosses stages.

    Virtual stage v = chunk * p + stage; v > 0 receives activations from v - 1 before its
    forward, v < pV - 1 receives gradients from v + 1 before its backward (B or I), and each
    sends to the other side after computing. A message's ``chunk`` is the receiver's."""
    p = len(orders)
    last = p * virtual_stages - 1
    schedule: Schedule = []
    for s, order in enumerate(orders):
        actions: list[Action] = []
        for op, mb, chunk in order:
            v = chunk * p + s
            if op is Op.FORWARD:
                if v > 0:
                    actions.append(Action(Op.RECV, mb, 0, (v - 1) % p, chunk=chunk))
                actions.append(Action(op, mb, 0, chunk=chunk))
                if v < last:
                    actions.append(Action(Op.SEND, mb, 0, (v + 1) % p, chunk=(v + 1) // p))
            elif op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                if v < last:
                    actions.append(Action(Op.RECV_GRAD, mb, 0, (v + 1) % p, chunk=chunk))
                actions.append(Action(op, mb, 0, chunk=chunk))
                if v > 0:
                    actions.append(Action(Op.SEND_GRAD, mb, 0, (v - 1) % p,
                                          chunk=(v - 1) // p))
            else:
                actions.append(Action(op, mb, 0, chunk=chunk))
        schedule.append(actions)
    return schedule


def training_schedule(kind: str, num_stages: int, num_micro_batches: int,
                      virtual_stages: int = 1) -> Schedule:
    """Every stage's actions for one optimizer step's micro-batches."""
    p, m, V = num_stages, num_micro_batches, virtual_stages
    problems = micro_batch_problems(kind, p, m, V)
    if problems:
        raise ValueError("; ".join(problems))
    if kind == "gpipe":
        orders = [gpipe_order(p, m, s) for s in range(p)]
    elif kind == "1f1b":
        orders = [one_f_one_b_order(p, m, s) for s in range(p)]
    elif kind == "interleaved":
        orders = [interleaved_order(p, m, s, V) for s in range(p)]
    else:
        orders = zb_h1_orders(p, m)
    return with_messages(orders, V)


# ---- formulas --------------------------------------------------------------------------------

def bubble_formula(kind: str, p: int, m: int, V: int = 1) -> float:
    """The idle share of every stage under unit costs (see the module docstring)."""
    if kind == "interleaved":
        return (p - 1) / (V * m + p - 1)
    if kind == "zb-h1":      # W fills the bubbles: only the F and I chains' ramps stay idle
        return 1 - 3 * m / max(3 * m + p - 1, 2 * m + 2 * p - 1)
    return (p - 1) / (m + p - 1)


def peak_activations_formula(kind: str, p: int, m: int, stage: int, V: int = 1) -> int:
    """How many micro-batches' activations (chunk activations when interleaved) ``stage``
    holds at its peak."""
    if kind == "gpipe":
        return m
    if kind == "interleaved":
        return min(2 * (p - stage - 1) + (V - 1) * p + 1, V * m)
    return min(p - stage, m)


def peak_activations(actions: list[Action]) -> int:
    """The most (micro-batch, chunk) activations held at once by a stage running
    ``actions``: held from F until B, or until I when the backward is split (W keeps only the
    linears' inputs and output gradients)."""
    held = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            held += 1
            peak = max(peak, held)
        elif a.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
            held -= 1
    return peak
