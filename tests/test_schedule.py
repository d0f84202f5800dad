"""Pipeline schedules as plain data: no MPI needed."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcpar.parallel.pipeline.partition import stage_layer_counts
from hpcpar.jobs.inputs.schedule import generation
from hpcpar.parallel.pipeline.schedule import (Action, Op, bubble_fraction, decode, draw, encode,
                                      gpipe_forward, schedule_problems, simulate)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 5))
def test_generation_schedules_run_to_the_end(stages, micro_batches, steps):
    schedule = generation(stages, micro_batches, steps)
    assert schedule_problems(schedule) == []
    forwards = [[(a.mb, a.step) for a in acts if a.op is Op.FORWARD] for acts in schedule]
    expected = [(m, t) for t in range(steps) for m in range(micro_batches)]
    assert all(f == expected for f in forwards)      # every stage runs every (mb, step) once
    if stages > 1:  # tokens go back from the last stage for every step but the last
        back = [a for a in schedule[-1] if a.op is Op.SEND_LOOP]
        assert len(back) == micro_batches * (steps - 1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8))
def test_simulated_gpipe_idle_time_equals_the_bubble_formula(stages, micro_batches):
    timeline, problems = simulate(gpipe_forward(stages, micro_batches))
    assert problems == []
    end = max(events[-1][1] for events in timeline)
    busy = sum(stop - start for events in timeline for start, stop, a in events)
    idle = 1 - busy / (stages * end)
    assert idle == pytest.approx(bubble_fraction(stages, micro_batches))


def test_a_missing_receive_is_reported_not_hung():
    schedule = gpipe_forward(3, 2)
    schedule[2] = schedule[2][:2]                # stage 2 forgets micro-batch 1
    problems = schedule_problems(schedule)
    assert any("never received" in p and "stage 1" in p for p in problems), problems


def test_a_missing_send_is_a_deadlock_that_names_the_waiting_stage():
    schedule = gpipe_forward(2, 2)
    schedule[0] = [a for a in schedule[0] if not (a.op is Op.SEND and a.mb == 1)]
    problems = schedule_problems(schedule)
    assert problems == ["deadlock: stage 1 waits at recv(mb 1, step 0)<-0"]


def test_receives_in_the_wrong_order_are_reported():
    schedule = gpipe_forward(2, 2)
    r0, f0, r1, f1 = schedule[1]
    schedule[1] = [r1, f1, r0, f0]
    problems = schedule_problems(schedule)
    assert "would receive stage 0's send(mb 0, step 0)->1" in problems[0]


def test_sizes_that_disagree_are_reported():
    schedule = gpipe_forward(2, 1)
    send, = [a for a in schedule[0] if a.op is Op.SEND]
    schedule[0] = [a if a is not send else Action(Op.SEND, 0, 0, 1, nbytes=64)
                   for a in schedule[0]]
    schedule[1] = [Action(a.op, a.mb, a.step, a.peer, 32 if a.op is Op.RECV else 0)
                   for a in schedule[1]]
    assert "expects 32 bytes, stage 0 sends 64" in schedule_problems(schedule)[0]


def test_a_cycle_of_receives_deadlocks():
    schedule = [[Action(Op.RECV, 0, 0, 1), Action(Op.SEND, 0, 0, 1)],
                [Action(Op.RECV, 0, 0, 0), Action(Op.SEND, 0, 0, 0)]]
    assert schedule_problems(schedule)[0].startswith("deadlock: stage 0 waits")


def test_encoding_round_trips():
    for acts in generation(3, 2, 3):
        assert decode(encode(acts)) == acts


def test_draw_shows_the_gpipe_staircase():
    assert draw(gpipe_forward(3, 2)).splitlines() == [
        "stage 0: F0 F1 .. ..",
        "stage 1: .. F0 F1 ..",
        "stage 2: .. .. F0 F1",
    ]


def test_bubble_fraction_formula():
    assert bubble_fraction(1, 7) == 0
    assert bubble_fraction(4, 4) == 3 / 7


@pytest.mark.parametrize("layers, pp, explicit, counts", [
    (9, 2, None, [5, 4]), (9, 4, None, [3, 2, 2, 2]), (4, 4, None, [1, 1, 1, 1]),
    (9, 3, [1, 2, 6], [1, 2, 6]),
])
def test_stage_layer_counts(layers, pp, explicit, counts):
    assert stage_layer_counts(layers, pp, explicit) == counts
