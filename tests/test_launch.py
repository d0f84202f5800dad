"""Whole jobs under mpiexec in a subprocess: failures end every rank promptly, bad input is
reported once, and the demo runs. Serial tests (they start their own MPI jobs)."""

import pytest

from hpcpar.parallel.errors import HpcparError
from hpcpar.jobs.launch import check_launch
from helpers import mpirun as _mpirun

@pytest.mark.slow
def test_an_exception_on_one_rank_ends_the_whole_job(tmp_path):
    job = ("from hpcpar.jobs.launch import run_guarded, world, phase\n"
           "def main():\n"
           "    comm = world()\n"
           "    with phase('testing failure'):\n"
           "        if comm.Get_rank() == 2:\n"
           "            raise RuntimeError('boom')\n"
           "        comm.Barrier()\n"   # the other ranks wait here forever without an abort
           "raise SystemExit(run_guarded(main))\n")
    proc, seconds = _mpirun(4, ["-c", job], tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "rank 2 of 4 failed while testing failure: RuntimeError: boom" in proc.stderr
    assert seconds < 30, f"took {seconds:.1f} s"


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["demo", "--tp", "3"], "dp(1) * pp(1) * tp(3) = 3 != world size 4"),
    (["demo", "--checkpoint", "missing.h5"], "missing.h5: no such file"),
    (["demo", "--checkpoint", "junk.h5"], "junk.h5: not an HDF5 file"),
    (["demo", "--nonsense"], "unrecognized arguments: --nonsense"),
])
def test_bad_input_is_reported_once_and_every_rank_exits_non_zero(tmp_path, args, words):
    (tmp_path / "junk.h5").write_text("not a checkpoint")
    proc, _ = _mpirun(4, ["-m", "hpcpar", *args], tmp_path)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpcpar: error:")]
    assert len(errors) == 1, proc.stderr
    assert words in errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.device
@pytest.mark.parametrize("n, layout", [(1, "dp 1 x pp 1 x tp 1"), (3, "dp 1 x pp 3 x tp 1"),
                                       (8, "dp 2 x pp 2 x tp 2")])
def test_the_demo_job_generates_and_reports(tmp_path, n, layout):
    proc, seconds = _mpirun(n, ["-m", "hpcpar"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("hpcpar demo:") == 1  # the report comes from rank 0 only
    assert "(random weights)" in proc.stdout           # its own checkpoint, made on the spot
    assert f"layout: {layout}" in proc.stdout
    for words in ("tokens/s", "bubble: prefill", "stage  compute s  waiting s",
                  "tp all-reduce", "peak host memory per rank"):
        assert words in proc.stdout
    assert "16 prompts" in proc.stdout and "256 new tokens" in proc.stdout


@pytest.mark.slow
def test_convert_and_init_commands(tmp_path):
    from helpers import TINY, write_hf_checkpoint
    write_hf_checkpoint(tmp_path / "hf", TINY)
    proc, _ = _mpirun(2, ["-m", "hpcpar", "convert", "hf", "m.h5", "--dtype", "float16"],
                      tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("wrote m.h5") == 1
    proc, _ = _mpirun(1, ["-m", "hpcpar", "init", "--preset", "tiny", "t.h5", "--seed", "2"],
                      tmp_path)
    assert proc.returncode == 0 and (tmp_path / "t.h5").exists(), proc.stderr
    proc, _ = _mpirun(1, ["-m", "hpcpar", "demo", "--checkpoint", "t.h5"], tmp_path)
    assert proc.returncode == 0 and "hpcpar demo: t.h5, " in proc.stdout, proc.stderr
    assert "(random weights)" not in proc.stdout      # a checkpoint of the user's: unlabelled
    proc, _ = _mpirun(1, ["-m", "hpcpar", "init", "--preset", "huge", "x.h5"], tmp_path)
    assert proc.returncode == 2 and "invalid choice: 'huge'" in proc.stderr
    assert not (tmp_path / "x.h5").exists()


class _Alone:
    def Get_size(self):
        return 1


def test_a_lone_rank_under_a_multi_task_launch_stops(monkeypatch):
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.raises(HpcparError, match="started 4 tasks but MPI sees a world of 1"):
        check_launch(_Alone())
    monkeypatch.setenv("SLURM_NTASKS", "1")
    check_launch(_Alone())


@pytest.mark.slow
@pytest.mark.parametrize("command", ["generate", "train"])
def test_ranks_started_with_different_jobs_are_one_error_not_a_hang(tmp_path, command):
    """An MPMD launch whose ranks were given different settings: one line naming the
    first setting that differs, status 2 on every rank, at once (it waited until the
    timeout, each rank in another step)."""
    import os
    import subprocess
    import sys
    from helpers import MPIEXEC, REPO
    common = [sys.executable, "-m", "hpcpar", command, "--checkpoint", "preset:tiny",
              "--tp", "2", "--timeout", "60", "--out", "out" + (".jsonl" if command ==
                                                                 "generate" else "")]
    common += (["--prompts", "random"] if command == "generate" else
               ["--data", "synthetic", "--seq-len", "8", "--global-batch", "2"])
    flag = "--max-new-tokens" if command == "generate" else "--steps"
    env = dict(os.environ, HPCPAR_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([MPIEXEC, "-n", "1", *common, flag, "3", ":", "-n", "1", *common,
                           flag, "5"], env=env, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpcpar:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    key = "generate.max_new_tokens" if command == "generate" else "train.steps"
    assert f"rank 1 was started with another job than rank 0's: {key} is 5 there" in errors[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.jsonl").exists()
