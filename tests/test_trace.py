"""``--trace``: a Chrome trace of every rank (one track each, named by its mesh place) whose
spans follow the schedule that ran: as many forward and backward passes as the schedule has,
a stage's forward after the stage before it sent the micro-batch, collectives inside the passes
that made them; ``show`` of a trace and the pictures ``--plot`` draws; what is refused."""

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest
from helpers import TINY, hpcpar_here, make_checkpoint, mpirun

from hpcpar.parallel import trace


def _hpcpar(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpcpar", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def _tracks(path):
    data = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    spans = {pid: [e for e in data["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]
             for pid in names}
    return data, names, spans


def _nested(spans) -> bool:
    """Spans of one track either nest or are apart (they come from one thread's calls)."""
    open_ends = []
    for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        start, end = e["ts"], e["ts"] + e["dur"]
        while open_ends and open_ends[-1] <= start + 1e-3:
            open_ends.pop()
        if open_ends and end > open_ends[-1] + 1e-3:
            return False
        open_ends.append(end)
    return True


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("trace")
    make_checkpoint(work, TINY)
    np.save(work / "rows.npy", np.random.default_rng(0).integers(3, 250, (4, 10)))
    return work


@pytest.fixture(scope="module")
def training_trace(work):
    """4 ranks, pp 2 x tp 2, 1F1B, 3 micro-batches, 2 steps."""
    proc, _ = mpirun(4, ["-m", "hpcpar", "train", "--checkpoint", "model.h5", "--data",
                         "synthetic", "--seq-len", "16", "--steps", "2", "--global-batch", "6",
                         "--micro-batches", "3", "--pp", "2", "--tp", "2", "--out", "run",
                         "--trace", "run/train.json"], work, timeout=300)   # in the new folder
    assert proc.returncode == 0, proc.stderr
    assert "wrote run/train.json" in proc.stdout
    (work / "run" / "train.json").rename(work / "train.json")
    return _tracks(work / "train.json")


@pytest.mark.slow
def test_one_track_per_rank_named_by_its_place_in_the_mesh(training_trace):
    data, names, spans = training_trace
    assert names == {0: "rank 0 (dp 0, pp 0, tp 0)", 1: "rank 1 (dp 0, pp 0, tp 1)",
                     2: "rank 2 (dp 0, pp 1, tp 0)", 3: "rank 3 (dp 0, pp 1, tp 1)"}
    assert data["otherData"]["layout"] == "dp 1 x pp 2 x tp 2"
    assert data["otherData"]["job"] == "train" and data["otherData"]["dropped_spans"] == 0
    for pid, mine in spans.items():
        assert _nested(mine), f"rank {pid}: spans overlap without nesting"


@pytest.mark.slow
def test_the_spans_follow_the_schedule_that_ran(training_trace):
    _, _, spans = training_trace
    steps, micro = 2, 3
    for pid, mine in spans.items():
        passes = [e for e in mine if e["cat"] == "compute" and e["name"] != "optimizer step"]
        assert sorted(e["name"].split()[0] for e in passes) == (
            ["backward"] * steps * micro + ["forward"] * steps * micro)
        assert sorted(e["args"]["step"] for e in passes) == [1] * 2 * micro + [2] * 2 * micro
        assert sum(e["name"] == "optimizer step" for e in mine) == steps
        # tensor parallelism: all-reduces inside the passes, with their bytes
        inner = [e for e in mine if e["cat"] == "comm" and e["name"] == "tp.all_reduce"]
        assert inner and all(e["args"]["bytes"] > 0 for e in inner)
        assert all(any(p["ts"] <= e["ts"] and e["ts"] + e["dur"] <= p["ts"] + p["dur"] + 1e-3
                       for p in passes) for e in inner[:20])
        assert any(e["cat"] == "phase" for e in mine)
    # stage 1 runs a micro-batch's forward after stage 0 finished it (one clock, one node)
    for first, second in ((0, 2), (1, 3)):
        ends = {}
        for e in spans[first]:
            if e["name"].startswith("forward"):
                ends.setdefault(e["args"]["micro-batch"], []).append(e["ts"] + e["dur"])
        starts = {}
        for e in spans[second]:
            if e["name"].startswith("forward"):
                starts.setdefault(e["args"]["micro-batch"], []).append(e["ts"])
        for mb in range(micro):
            for end, start in zip(sorted(ends[mb]), sorted(starts[mb])):
                assert start >= end - 50, (mb, end, start)      # microseconds
    # stage 1 waits for stage 0's activations: receive waits on the pp group
    assert any(e["name"] == "wait pp.recv" for e in spans[2])


@pytest.mark.slow
def test_show_summarises_a_trace_and_draws_its_timeline(work, training_trace):
    proc = _hpcpar("show", "train.json", "--json", cwd=work)
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    _, _, spans = training_trace
    assert s["kind"] == "trace" and [r["rank"] for r in s["ranks"]] == [0, 1, 2, 3]
    for r in s["ranks"]:
        mine = spans[r["rank"]]
        assert r["spans"] == len(mine)
        assert r["compute_s"] == pytest.approx(
            sum(e["dur"] for e in mine if e["cat"] == "compute") / 1e6)
        assert 0 < r["busy"] <= 1
    proc = _hpcpar("show", "train.json", "--plot", "timeline.png", cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert "rank 3 (dp 0, pp 1, tp 1)" in proc.stdout and "wrote timeline.png" in proc.stdout
    assert (work / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_show_plots_a_training_runs_curves(work, training_trace):
    proc = _hpcpar("show", "run", "--plot", "curves.svg", cwd=work)
    assert proc.returncode == 0, proc.stderr
    svg = (work / "curves.svg").read_text()
    for title in ("loss", "learning rate", "gradient norm", "tokens/s"):
        assert f"<!-- {title} -->" in svg
    for args, message in ((["--plot", "curves.txt"], "--plot curves.txt"),
                          (["--plot", "run"], "is a folder"),
                          (["--page", "2"], "--page and --per-page page")):
        refused = _hpcpar("show", "run", *args, cwd=work)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1


def _synthetic_trace(path, ranks: int, units: int) -> None:
    """A trace as hpcpar writes it (``trace.Tracer``, ``trace.chrome_trace``): on each of
    ``ranks`` ranks, ``units`` times 60 us of a wait (10), a forward pass (40) with a
    collective inside it, and a collective after it (10): 4 spans a unit."""
    parts = []
    for rank in range(ranks):
        tracer = trace.Tracer(origin=0.0)
        for i in range(units):
            at = i * 60e-6
            tracer.add("wait pp.recv", "wait", at, at + 10e-6)
            tracer.add("tp.all_reduce", "comm", at + 20e-6, at + 30e-6, {"bytes": 64})
            tracer.add(f"forward {i % 4}", "compute", at + 10e-6, at + 50e-6,
                       {"micro-batch": i % 4})
            tracer.add("dp.all_reduce", "comm", at + 50e-6, at + 60e-6, {"bytes": 64})
        parts.append(tracer.encoded(rank, f"rank {rank}"))
    path.write_bytes(trace.chrome_trace(parts, {"job": "train", "dropped_spans": 0}))


def test_show_summarises_a_trace_of_many_spans_a_rank(tmp_path):
    """40k spans a rank (a rank keeps up to 250k): each rank's sums are a sort and a pass
    (finding a collective inside a pass once went over every pass: minutes at this size)."""
    units = 10_000
    _synthetic_trace(tmp_path / "big.json", 2, units)
    proc = hpcpar_here(["show", "big.json", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert [r["spans"] for r in s["ranks"]] == [4 * units] * 2 and s["notes"] == []
    for r in s["ranks"]:
        # the window: the first pass's start to the last's end; the first wait lies before
        # it, the last collective after it, the collectives inside the passes are theirs
        assert r["window_s"] == pytest.approx(((units - 1) * 60 + 40) * 1e-6)
        assert r["compute_s"] == pytest.approx(units * 40e-6)
        assert r["wait_s"] == pytest.approx((units - 1) * 10e-6)
        assert r["comm_s"] == pytest.approx((units - 1) * 10e-6)


@pytest.mark.parametrize("damage", [{"ts": None}, {"dur": "40"}, {"pid": 9}, {"args": 5}])
def test_show_leaves_out_a_span_it_cannot_read_with_a_note(tmp_path, damage):
    _synthetic_trace(tmp_path / "t.json", 2, 2)
    data = json.loads((tmp_path / "t.json").read_text())
    next(e for e in data["traceEvents"] if e["ph"] == "X").update(damage)    # rank 0's
    (tmp_path / "t.json").write_text(json.dumps(data))
    proc = hpcpar_here(["show", "t.json", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert [r["spans"] for r in s["ranks"]] == [7, 8]
    assert len(s["notes"]) == 1 and s["notes"][0].startswith("1 of 16 spans not read: ")
    text = hpcpar_here(["show", "t.json"], tmp_path).stdout.splitlines()
    assert text[-1] == f"note: {s['notes'][0]}"


def test_plot_without_matplotlib_says_how_to_get_it(work, monkeypatch, training_trace):
    from hpcpar.jobs.plots import plot
    from hpcpar.jobs.show import summary
    from hpcpar.parallel.errors import HpcparError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(HpcparError, match=r'pip install "hpcpar\[plot\]"'):
        plot(work / "run", summary(work / "run"), work / "none.png")
    assert not (work / "none.png").exists()


@pytest.mark.slow
@pytest.mark.device
def test_a_traced_generation_gives_the_same_tokens_and_a_trace(work):
    args = ["-m", "hpcpar", "generate", "--checkpoint", "model.h5", "--prompts", "random",
            "--max-new-tokens", "6", "--pp", "2", "--micro-batches", "2"]
    plain, _ = mpirun(2, [*args, "--out", "plain.h5"], work, timeout=300)
    traced, _ = mpirun(2, [*args, "--out", "traced.h5", "--trace", "gen.json"], work,
                       timeout=300)
    assert plain.returncode == 0 and traced.returncode == 0, traced.stderr
    with h5py.File(work / "plain.h5") as a, h5py.File(work / "traced.h5") as b:
        np.testing.assert_array_equal(a["tokens"][()], b["tokens"][()])
    _, names, spans = _tracks(work / "gen.json")
    assert len(names) == 2
    for mine in spans.values():      # 2 micro-batches, a prefill and 5 decode steps each
        assert sum(e["name"].startswith("forward") for e in mine) == 2 * 6
    plot = _hpcpar("show", "gen.json", "--plot", "gen.png", cwd=work)
    assert plot.returncode == 0, plot.stderr
    plot = _hpcpar("show", "traced.h5", "--plot", "gen2.png", cwd=work)
    assert plot.returncode == 2 and "a training run's folder or a trace" in plot.stderr
    assert not (work / "gen2.png").exists()


@pytest.mark.parametrize("job, path, message", [
    ("score", "trace.txt", "name it trace.json"),
    ("score", ".json", "name it trace.json"),
    ("score", "", "give a file name"),
    ("score", "missing/trace.json", "does not exist"),
    ("score", "run", "is a folder"),
    ("score", "/proc/trace.json", "cannot write into /proc"),
    ("score", "notes.json", "is not an hpcpar trace"),
    ("train", "out.json", "also the job's output"),
    ("train", "out/report.json", "also the job's output"),
])
def test_a_trace_that_cannot_be_written_is_refused_before_the_work(work, job, path, message):
    (work / "notes.json").write_text('{"mine": 1}')
    (work / "run").mkdir(exist_ok=True)
    out = "out.h5" if job == "score" else ("out" if "/" in path else "out.json")
    data = "rows.npy" if job == "score" else "synthetic"
    proc = hpcpar_here([job, "--checkpoint", "model.h5", "--data", data, "--out", out,
                        "--trace", path], work)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (work / out).exists()
    assert (work / "notes.json").read_text() == '{"mine": 1}'
    if path not in ("", "notes.json"):
        assert not (work / path).is_file()


@pytest.mark.slow
def test_a_trace_that_cannot_be_written_is_one_error_from_one_of_two_ranks(work):
    """The cases above run on one rank, in this process; under mpiexec the ranks agree."""
    proc, _ = mpirun(2, ["-m", "hpcpar", "score", "--checkpoint", "model.h5", "--data",
                         "rows.npy", "--out", "out2.h5", "--trace", "trace.txt"], work)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "name it trace.json" in lines[0], proc.stderr
    assert not (work / "out2.h5").exists() and not (work / "trace.txt").exists()


@pytest.mark.slow
def test_a_trace_replaces_an_earlier_trace(work, training_trace):
    args = ["-m", "hpcpar", "score", "--checkpoint", "model.h5", "--data", "rows.npy"]
    for out in ("a.h5", "b.h5"):
        proc, _ = mpirun(2, [*args, "--out", out, "--trace", "again.json"], work, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "wrote again.json (a timeline of 2 ranks" in proc.stdout
    assert json.loads((work / "again.json").read_text())["otherData"]["job"] == "score"


def test_tracing_off_records_nothing_and_spans_nest_in_the_file():
    from hpcpar.parallel.errors import HpcparError
    assert trace.current() is None
    with trace.span("nothing"):
        pass
    tracer = trace.start()
    try:
        with pytest.raises(HpcparError, match="tracing already"):
            trace.start()
        with trace.span("outer", "phase", step=np.int64(1)):      # NumPy values are written
            with trace.span("inner", "compute"):
                pass
    finally:
        assert trace.stop() is tracer and trace.current() is None
    data = json.loads(trace.chrome_trace([tracer.encoded(5, "rank 5")], {"job": "test"}))
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["inner", "outer"] and spans[1]["args"] == {"step": 1}
    assert _nested(spans) and data["otherData"] == {"job": "test"}
    inner, outer = spans
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def test_a_long_run_keeps_the_first_spans_and_counts_the_rest(monkeypatch):
    monkeypatch.setattr(trace, "MAX_SPANS", 3)
    tracer = trace.Tracer(origin=0.0)
    for i in range(5):
        tracer.add(f"span {i}", "compute", i, i + 0.5)
    assert [s[0] for s in tracer.spans] == ["span 0", "span 1", "span 2"]
    assert tracer.dropped == 2


@pytest.mark.mpi(min_size=2)
def test_gather_puts_every_ranks_spans_on_its_own_track_at_the_root():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    tracer = trace.Tracer(origin=0.0)
    for i in range(rank + 1):                         # rank r: r + 1 spans, of r + 1 bytes
        tracer.add(f"r{rank}", "comm", float(i), i + 0.25, {"bytes": rank + 1})
    tracer.dropped = rank
    from hpcpar.parallel.errors import HpcparError
    with pytest.raises(HpcparError, match="trace.gather"):     # one rank's mistake, on all
        trace.gather(comm, tracer if rank else None, "r", {}, root=1)
    gathered = trace.gather(comm, tracer, f"rank {rank} of {size}", {"job": np.int64(7)},
                            root=1)
    if rank != 1:
        assert gathered is None
        return
    data, info = gathered
    assert info["ranks"] == size and info["dropped_spans"] == size * (size - 1) // 2
    assert json.loads(data)["otherData"]["job"] == 7
    events = json.loads(data)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r} of {size}" for r in range(size)}
    for r in range(size):
        mine = [e for e in events if e["ph"] == "X" and e["pid"] == r]
        assert [e["name"] for e in mine] == [f"r{r}"] * (r + 1)
        assert [e["ts"] for e in mine] == [i * 1e6 for i in range(r + 1)]
        assert all(e["dur"] == 0.25e6 and e["args"] == {"bytes": r + 1} for e in mine)
