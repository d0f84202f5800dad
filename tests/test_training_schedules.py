"""Training schedules as plain data (no MPI): every pass exactly once, sends meet receives,
the simulated bubble and the peak of held activations equal each schedule's formula."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcpar.parallel.pipeline.schedule import COMPUTE, Op, draw, schedule_problems, simulate
from hpcpar.parallel.pipeline.training_schedules import (TRAINING_SCHEDULES, bubble_formula,
                                                micro_batch_problems, peak_activations,
                                                peak_activations_formula, training_schedule)


def _cases():
    for kind in TRAINING_SCHEDULES:
        for p in range(1, 7):
            for m in range(1, 13):
                for V in ((2, 3, 4) if kind == "interleaved" else (1,)):
                    if not micro_batch_problems(kind, p, m, V):
                        yield kind, p, m, V


CASES = list(_cases())


def test_every_schedule_is_covered_by_many_cases():
    kinds = Counter(kind for kind, *_ in CASES)
    assert set(kinds) == set(TRAINING_SCHEDULES) and min(kinds.values()) >= 20


@pytest.mark.parametrize("kind,p,m,V", CASES)
def test_each_pass_runs_once_and_the_schedule_runs_to_the_end(kind, p, m, V):
    schedule = training_schedule(kind, p, m, V)
    assert schedule_problems(schedule) == []
    for stage, actions in enumerate(schedule):
        passes = Counter((a.op, a.mb, a.chunk) for a in actions if a.op in COMPUTE)
        for mb in range(m):
            for chunk in range(V):
                assert passes[(Op.FORWARD, mb, chunk)] == 1
                if kind == "zb-h1":
                    assert passes[(Op.BACKWARD_INPUT, mb, chunk)] == 1
                    assert passes[(Op.BACKWARD_WEIGHT, mb, chunk)] == 1
                else:
                    assert passes[(Op.BACKWARD, mb, chunk)] == 1
        assert sum(passes.values()) == m * V * (3 if kind == "zb-h1" else 2)
        # a pass's backward comes after its forward, a weight half after its input half
        order = {(a.op, a.mb, a.chunk): i for i, a in enumerate(actions) if a.op in COMPUTE}
        for (op, mb, chunk), i in order.items():
            if op is not Op.FORWARD:
                assert order[(Op.FORWARD, mb, chunk)] < i
            if op is Op.BACKWARD_WEIGHT:
                assert order[(Op.BACKWARD_INPUT, mb, chunk)] < i


@pytest.mark.parametrize("kind,p,m,V", CASES)
def test_simulated_bubble_and_peak_activations_equal_the_formulas(kind, p, m, V):
    schedule = training_schedule(kind, p, m, V)
    timeline, problems = simulate(schedule)
    assert problems == []
    end = max(events[-1][1] for events in timeline)
    for stage, events in enumerate(timeline):
        busy = sum(stop - start for start, stop, a in events if a.op in COMPUTE)
        assert (end - busy) / end == pytest.approx(bubble_formula(kind, p, m, V), abs=1e-12)
        assert peak_activations(schedule[stage]) == peak_activations_formula(kind, p, m, stage, V)


def test_1f1b_holds_fewer_activations_than_gpipe_at_the_same_bubble():
    p, m = 4, 8
    gpipe, ofob = training_schedule("gpipe", p, m), training_schedule("1f1b", p, m)
    assert [peak_activations(a) for a in gpipe] == [8, 8, 8, 8]
    assert [peak_activations(a) for a in ofob] == [4, 3, 2, 1]
    assert bubble_formula("gpipe", p, m) == bubble_formula("1f1b", p, m)
    assert bubble_formula("zb-h1", p, m) < bubble_formula("1f1b", p, m)
    assert bubble_formula("interleaved", p, m, 2) < bubble_formula("1f1b", p, m)


@pytest.mark.parametrize("kind,p,m,V,message", [
    ("interleaved", 2, 3, 2, "not a multiple of pp 2"),
    ("interleaved", 1, 4, 2, "needs pp >= 2"),
    ("interleaved", 2, 4, 1, "virtual-stages >= 2"),
    ("1f1b", 2, 4, 2, "needs --schedule interleaved"),
    ("pipedream", 2, 4, 1, "not one of"),
])
def test_counts_a_schedule_cannot_run_are_refused_with_a_message(kind, p, m, V, message):
    problems = micro_batch_problems(kind, p, m, V)
    assert problems and message in "; ".join(problems)
    with pytest.raises(ValueError, match=message.split()[0]):
        training_schedule(kind, p, m, V)


def test_the_drawing_shows_forward_backward_and_the_zero_bubble_halves():
    assert draw(training_schedule("1f1b", 2, 2)).splitlines() == [
        "stage 0: F0 F1 .. .. B0 B0 .. B1 B1",
        "stage 1: .. F0 B0 B0 F1 B1 B1 .. ..",
    ]
    zb = draw(training_schedule("zb-h1", 2, 3))
    assert "I0" in zb and "W0" in zb and "B" not in zb.replace("stage", "")
    assert ".1" in draw(training_schedule("interleaved", 2, 2, 2))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b", "zb-h1"]), st.integers(2, 5), st.integers(1, 8))
def test_a_dropped_gradient_receive_is_an_error_not_a_hang(kind, p, m):
    schedule = training_schedule(kind, p, m)
    stage = p - 2
    drop = next(i for i, a in enumerate(schedule[stage]) if a.op is Op.RECV_GRAD)
    del schedule[stage][drop]
    assert schedule_problems(schedule)
