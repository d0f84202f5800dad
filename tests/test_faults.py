"""Fault injection (HPCPAR_FAULT) over ranks, phases and kinds under mpiexec -n 4: the job
ends promptly with a non-zero status, leaves no process behind and no output file; a raised
error names the rank and what it was doing; a rank that stops (hang) is found by the others'
watchdog (--timeout), which ends the job with status 4 and says where every rank was."""

import os
import time

import numpy as np
import pytest

from helpers import GQA, make_checkpoint, mpirun
from hpcpar.jobs.faults import parse
from hpcpar.parallel.errors import HpcparError


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults")
    make_checkpoint(folder, GQA)
    np.save(folder / "data.npy", np.random.default_rng(0).integers(0, 250, (32, 9)))
    return folder


GENERATE = ["-m", "hpcpar", "generate", "--checkpoint", "model.h5", "--prompts", "random",
            "--max-new-tokens", "4", "--pp", "2", "--tp", "2", "--micro-batches", "2",
            "--timeout", "3"]
TRAIN = ["-m", "hpcpar", "train", "--checkpoint", "model.h5", "--data", "data.npy",
         "--steps", "3", "--global-batch", "8", "--pp", "2", "--tp", "2", "--micro-batches",
         "2", "--timeout", "3"]
POINTS = [("load", 1, None, GENERATE), ("prefill", 3, None, GENERATE),
          ("decode", 2, 2, GENERATE), ("train", 1, 2, TRAIN)]


def _running(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line holds ``marker``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            if state != "Z" and marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                out.append(int(pid))
        except OSError:
            pass
    return out


def _survivors(marker: str, grace: float = 10.0) -> list[int]:
    """Ranks still running ``grace`` seconds after the launcher returned (killed ranks
    take a moment to go)."""
    deadline = time.monotonic() + grace
    while _running(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _running(marker)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["raise", "exit", "kill", "hang"])
@pytest.mark.parametrize("phase, rank, step, command", POINTS,
                         ids=[p[0] for p in POINTS])
def test_a_failing_rank_ends_the_whole_job_promptly_and_cleanly(work, kind, phase, rank, step,
                                                                command):
    out = f"out-{phase}-{kind}"
    fault = f"rank={rank},phase={phase},kind={kind}" + (f",step={step}" if step else "")
    os.environ["HPCPAR_FAULT"] = fault
    try:
        proc, seconds = mpirun(4, [*command, "--out", out + (".h5" if command is GENERATE
                                                             else "")], work, timeout=120)
    finally:
        del os.environ["HPCPAR_FAULT"]
    assert proc.returncode != 0, proc.stdout
    assert seconds < 60
    assert not _survivors(out), "a rank outlived the job"
    assert not (work / f"{out}.h5").exists()
    if command is TRAIN:
        assert not list((work / out).glob("step-*.h5")) if (work / out).exists() else True
    if kind == "raise":
        assert f"rank {rank} (" in proc.stderr and "injected fault at" in proc.stderr, \
            proc.stderr
    if kind in ("exit", "kill"):      # the rank's keeper names it; the launcher only a PID
        said = "was killed by SIGKILL" if kind == "kill" else "exited with status 1"
        assert f"rank {rank} of 4 (pid " in proc.stderr and said in proc.stderr, proc.stderr
    if kind == "hang":
        assert proc.returncode == 4, proc.stderr
        assert "waited 3 s" in proc.stderr and "a rank stopped, died or hangs" in proc.stderr
        assert proc.stderr.count("gave up while") == 1, proc.stderr     # one report
        if phase != "load":            # in the schedule: every rank's action is reported
            report = proc.stderr.split("Where the ranks")[1]
            for r in range(4):
                assert f"rank {r} (" in report, proc.stderr
            assert f"rank {rank} (" in report.split("[stopped]")[0].splitlines()[-1], report
            if phase == "train":       # a training action names its training step
                assert f"step {step})" in report and "step 0)" not in report, report


def test_a_malformed_fault_setting_is_refused():
    for text in ("rank=1", "rank=x,phase=load", "rank=1,phase=lunch",
                 "rank=1,phase=load,kind=melt", "rank=1,phase=load,when=now",
                 "rank=1,phase=load,step=1"):         # load comes once: a step never fires
        with pytest.raises(HpcparError, match="HPCPAR_FAULT"):
            parse(text)
    assert parse("rank=2,phase=decode,step=5,kind=exit") == {
        "rank": 2, "phase": "decode", "step": 5, "kind": "exit"}


@pytest.mark.parametrize("step, fires", [(None, "prefill step 1"), (1, "prefill step 1"),
                                         (3, "prefill step 3"), (4, None)])
def test_a_prefill_fault_fires_at_the_wave_its_step_names(work, monkeypatch, step, fires):
    """prefill's step is the wave (1-based): 5 prompts in waves of 2 have waves 1 to 3."""
    from helpers import generate_here
    from hpcpar.jobs import faults
    monkeypatch.setenv("HPCPAR_FAULT", "rank=0,phase=prefill"
                       + (f",step={step}" if step else ""))
    faults.check_environment()
    try:
        if fires is None:
            generate_here(work / "model.h5", 2, "generate.wave_size=2")
        else:
            with pytest.raises(faults.InjectedFault, match=f"injected fault at {fires}$"):
                generate_here(work / "model.h5", 2, "generate.wave_size=2")
    finally:
        monkeypatch.delenv("HPCPAR_FAULT")
        faults.check_environment()


@pytest.mark.slow
def test_ctrl_c_to_the_launcher_stops_the_job_as_a_stop_request(work):
    """Ctrl-C is SIGTERM's stop request: the finished rows are saved, status 3, one
    "interrupted" line, and the partial file resumes."""
    import signal
    import subprocess
    import sys
    from helpers import MPIEXEC, REPO
    env = dict(os.environ, OMP_NUM_THREADS="1", HPCPAR_CACHE=str(work / "cache"),
               HPCPAR_PROGRESS_SECONDS="0.05",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    marker = "ctrl-c-out.h5"
    proc = subprocess.Popen([MPIEXEC, "-n", "4", sys.executable, *GENERATE[:-2], "--prompts",
                             "random", "--set", "data.random_count=3000", "--max-new-tokens",
                             "60", "--ignore-eos", "--out", marker], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:                            # generating once progress shows
        if line.startswith("progress:"):
            break
    proc.send_signal(signal.SIGINT)                     # one Ctrl-C
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    lines = [line for line in out.splitlines() if line.startswith("interrupted (Ctrl-C)")]
    assert len(lines) == 1 and "run again with --resume auto" in lines[0], out
    assert not _survivors(marker) and not (work / marker).exists()
    assert (work / f".{marker}.partial").exists()


def test_a_second_ctrl_c_ends_at_once_and_copies_of_one_count_once():
    import signal
    from hpcpar.jobs.launch import StopRequest
    before = signal.getsignal(signal.SIGINT)         # SIG_IGN in a shell's background job
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)          # a keeper's copy of the same Ctrl-C
        assert stop.requested and stop.describe("at step 4") == "interrupted (Ctrl-C) at step 4"
        time.sleep(StopRequest.AGAIN_AFTER + 0.1)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)                             # the handler raises here
    assert signal.getsignal(signal.SIGINT) is before


def test_after_a_stop_the_rank_ignores_further_stop_signals_on_its_way_out():
    """A stop acted on ends the job; a second SIGTERM (a launcher's, a keeper's copy) while
    the rank saves and leaves must not kill it (a trial saw "killed by SIGTERM", status 9,
    after "stopped on request"): SIGTERM and SIGUSR1 are ignored from then on. Without a
    stop, the handlers are given back."""
    import signal
    from hpcpar.jobs.launch import StopRequest
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with StopRequest():
            pass
        assert all(signal.getsignal(sig) is h for sig, h in before.items())
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            assert stop.requested
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in before)
        os.kill(os.getpid(), signal.SIGTERM)           # ignored: this process goes on
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.slow
def test_ctrl_c_before_the_steps_is_one_line_from_rank_0(work):
    """During start-up there is nothing to save: the job ends at once, status 130."""
    import signal
    import subprocess
    import sys
    from helpers import MPIEXEC, REPO
    env = dict(os.environ, OMP_NUM_THREADS="1", HPCPAR_CACHE=str(work / "cache"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-c",
                             "import time, sys; from hpcpar.jobs.launch import run_guarded, world;"
                             "world(); sys.exit(run_guarded(lambda: (print('ready', flush=True),"
                             " time.sleep(60))))"], cwd=work,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = ""
    while seen.count("ready") < 2:                     # the ranks' lines may interleave
        line = proc.stdout.readline()
        assert line, "a rank ended before it was ready"
        seen += line
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.startswith("hpcpar:")]
    assert len(lines) == 1 and lines[0].startswith("hpcpar: interrupted (Ctrl-C)"), err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_hang_on_several_nodes_is_reported_by_every_node(work):
    """Two (fake) nodes: each prints where its own ranks are, so the report covers the whole
    pipeline and tp group although no rank can read another node's memory."""
    os.environ.update(HPCPAR_FAULT="rank=2,phase=decode,step=2,kind=hang", HPCPAR_FAKE_NODES="2")
    try:
        proc, seconds = mpirun(4, [*GENERATE, "--out", "two-nodes.h5"], work, timeout=120)
    finally:
        del os.environ["HPCPAR_FAULT"], os.environ["HPCPAR_FAKE_NODES"]
    assert proc.returncode == 4 and seconds < 60, proc.stderr
    parts = proc.stderr.split("Where the ranks of node")[1:]
    assert len(parts) == 2, proc.stderr
    assert {r for part in parts for r in range(4) if f"rank {r} (dp" in part} == {0, 1, 2, 3}
    assert "rank 2 (dp 0, pp 1, tp 0) [stopped]" in proc.stderr
    assert not _survivors("two-nodes.h5") and not (work / "two-nodes.h5").exists()


STRAGGLER = ["-m", "hpcpar", "generate", "--checkpoint", "model.h5", "--prompts",
             "uneven.jsonl", "--max-new-tokens", "40", "--ignore-eos", "--dp", "2", "--pp", "2"]


@pytest.fixture(scope="module")
def uneven(work):
    """Replica 0's four prompts want 2 new tokens, replica 1's 40: replica 0 is done at once."""
    import json
    rng = np.random.default_rng(1)
    with open(work / "uneven.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"ids": rng.integers(0, 250, 5).tolist(),
                                "max_new_tokens": 2 if i < 4 else 40}) + "\n")
    return work


def _tokens(path):
    import h5py
    with h5py.File(path, "r") as f:
        return f["tokens"][...], f["lengths"][...]


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_replica_that_finishes_long_after_the_other_is_no_hang(uneven, batching):
    """Replica 1 (its first stage, world rank 2) is a straggler: 0.1 s more per decode step,
    so it ends about 4 s after replica 0, twice the timeout. Replica 0's ranks wait for it on
    its heartbeats (passed on by rank 0); the job ends as it would without the straggler."""
    work, command = uneven, [*STRAGGLER, "--set", f"generate.batching={batching}"]
    proc, _ = mpirun(4, [*command, "--out", f"even-{batching}.h5"], work, timeout=120)
    assert proc.returncode == 0, proc.stderr
    os.environ["HPCPAR_FAULT"] = "rank=2,phase=decode,step=1,kind=slow"
    try:
        proc, seconds = mpirun(4, [*command, "--timeout", "2", "--out",
                                   f"straggler-{batching}.h5"], work, timeout=120)
    finally:
        del os.environ["HPCPAR_FAULT"]
    assert proc.returncode == 0, proc.stderr
    assert seconds > 4                          # the straggler did outlast the timeout
    expected = _tokens(work / f"even-{batching}.h5")
    got = _tokens(work / f"straggler-{batching}.h5")
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


@pytest.mark.slow
def test_a_replica_that_stops_while_the_other_waits_is_reported(uneven):
    """The heartbeats do not hide a real hang: replica 0 has finished and waits when replica
    1's first stage stops; the job ends with status 4, names the stopped rank and shows
    replica 0 waiting. (Which rank reports is a race of equal timeouts: a rank of replica 0,
    waiting for every replica to finish, or rank 3, waiting for the stopped rank's
    activations.)"""
    os.environ["HPCPAR_FAULT"] = "rank=2,phase=decode,step=20,kind=hang"
    try:
        proc, seconds = mpirun(4, [*STRAGGLER, "--timeout", "3", "--out", "stops.h5"], uneven,
                               timeout=120)
    finally:
        del os.environ["HPCPAR_FAULT"]
    assert proc.returncode == 4 and seconds < 60, proc.stderr
    assert proc.stderr.count("gave up while") == 1, proc.stderr
    assert "rank 2 (dp 1, pp 0, tp 0) [stopped]" in proc.stderr, proc.stderr
    for rank in ("rank 0 (dp 0, pp 0, tp 0)", "rank 1 (dp 0, pp 1, tp 0)"):
        assert f"{rank}: done, waiting for the other replicas" in proc.stderr, proc.stderr
    assert not _survivors("stops.h5") and not (uneven / "stops.h5").exists()


@pytest.mark.slow
def test_a_scoring_replica_that_finishes_long_after_the_other_is_no_hang(work):
    """Scoring runs one pass, so a straggler's whole lag lands at its end: replica 1's first
    stage (world rank 2) takes 0.1 s more per micro-batch, 4 s over 40, twice the timeout."""
    import h5py
    np.save(work / "score.npy", np.random.default_rng(2).integers(0, 250, (80, 6)))
    command = ["-m", "hpcpar", "score", "--checkpoint", "model.h5", "--data", "score.npy",
               "--dp", "2", "--pp", "2", "--micro-batches", "40"]
    proc, _ = mpirun(4, [*command, "--out", "score-even.h5"], work, timeout=120)
    assert proc.returncode == 0, proc.stderr
    os.environ["HPCPAR_FAULT"] = "rank=2,phase=score,step=1,kind=slow"
    try:
        proc, seconds = mpirun(4, [*command, "--timeout", "2", "--out", "score-straggler.h5"],
                               work, timeout=120)
    finally:
        del os.environ["HPCPAR_FAULT"]
    assert proc.returncode == 0, proc.stderr
    assert seconds > 4
    with h5py.File(work / "score-even.h5") as even, h5py.File(work / "score-straggler.h5") as f:
        np.testing.assert_array_equal(f["token_logprobs"][...], even["token_logprobs"][...])
