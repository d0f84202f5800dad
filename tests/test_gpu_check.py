"""The GPU check's runner (benchmarks/gpu_check.py) and the table of what has run on a GPU
(benchmarks/gpu_paths.py), on the CPU: a lease is minutes long and comes rarely, so the
runner's time limits, its records of each test and the table's verdicts are checked here,
with steps of the runner's own kind over a small test file of known outcomes."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from helpers import MPIEXEC

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402
import gpu_paths  # noqa: E402

pytestmark = pytest.mark.slow

KNOWN = '''
import pytest
from mpi4py import MPI

def test_passes():
    pass

def test_fails():
    assert False

@pytest.mark.skip(reason="a skip")
def test_skips():
    pass

@pytest.mark.mpi(min_size=2)
def test_fails_on_one_rank_only():
    assert MPI.COMM_WORLD.Get_rank() == 0
'''
PYTEST = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder standing for the repository: tests/test_known.py, the runner's out folder."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_known.py").write_text(KNOWN)
    (tmp_path / "tests" / "test_slow.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\n"
        "def test_too_slow():\n    time.sleep(120)\n")
    monkeypatch.setattr(gpu_check, "REPO", tmp_path)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("MPIEXEC", MPIEXEC)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("GPU_CHECK_STARTED", raising=False)
    return tmp_path


def the_record(project: Path) -> dict:
    (path,) = (project / "out").glob("*-check.json")
    return json.loads(path.read_text())


def test_each_step_is_recorded_with_each_tests_outcome_and_a_slow_one_is_stopped(
        project, monkeypatch, capsys):
    steps = (gpu_check.Step("serial", 120, (*PYTEST, "tests/test_known.py")),
             gpu_check.Step("two-ranks", 120, (*PYTEST, "-k", "one_rank_only",
                                               "tests/test_known.py"), ranks=2),
             gpu_check.Step("slow", 10, (*PYTEST, "tests/test_slow.py")))
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    assert gpu_check.main(["--seconds", "600"]) == 1          # a step failed
    record = the_record(project)
    serial, ranks, slow = record["steps"]
    node = "tests/test_known.py::"
    assert serial["status"] == "failed"
    assert serial["tests"] == {node + "test_passes": "passed", node + "test_fails": "failed",
                               node + "test_skips": "skipped",
                               node + "test_fails_on_one_rank_only": "skipped"}
    # rank 1's failure makes the test failed, though rank 0 passed it
    assert ranks["status"] == "failed"
    assert ranks["tests"] == {node + "test_fails_on_one_rank_only": "failed"}
    # stopped at its limit, the tests it ran still recorded
    assert slow["status"] == "timed out" and slow["seconds"] < 40
    assert slow["tests"][node.replace("known", "slow") + "test_quick"] == "passed"
    log = next((project / "out").glob("gpu-check-*.log")).read_text()
    assert "== slow (at most 10 s)" in log and "assert False" in log
    assert re.search(r"slow\s+timed out", capsys.readouterr().out)


def test_steps_past_the_budget_are_not_reached_and_named_for_the_next_lease(
        project, monkeypatch, capsys):
    steps = (gpu_check.Step("first", 60, (sys.executable, "-c", "pass"), junit=False),
             gpu_check.Step("second", 60, (sys.executable, "-c", "pass"), junit=False))
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    assert gpu_check.main(["--seconds", "10", "--steps", "second,first"]) == 1
    assert [(s["name"], s["status"]) for s in the_record(project)["steps"]] == [
        ("second", "not reached"), ("first", "not reached")]
    assert "GPU_CHECK_STEPS=second,first" in capsys.readouterr().out


def test_the_table_says_what_each_run_showed_of_each_path(project, monkeypatch):
    steps = (gpu_check.Step("serial", 120, (*PYTEST, "tests/test_known.py")),)
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    gpu_check.main(["--seconds", "600"])
    out = project / "out"
    check = the_record(project)             # the benchmark's JSON of the same GPU and day
    (out / f"gpu-{check['date']}-1b.json").write_text(json.dumps({
        "gpu": check["gpu"], "rows": [{"workload": "generate-1b-bf16", "phase": "decode"}]}))
    (run,) = gpu_paths.recorded_runs(out)
    node = "tests/test_known.py::"
    GpuPath = gpu_paths.GpuPath
    assert gpu_paths.verdict(GpuPath("a", tests=(node + "test_passes",)), run) == \
        "passed (1 test)"
    assert gpu_paths.verdict(GpuPath("b", tests=(node + "test_",)), run) == \
        "failed: test_fails"
    assert gpu_paths.verdict(GpuPath("c", tests=(node + "test_passes",),
                                     rows=(("generate-1b-bf16", "prefill"),)), run) == \
        "partly; not run: generate-1b-bf16 prefill"
    assert gpu_paths.verdict(GpuPath("d", rows=(("generate-1b-bf16", "decode"),)), run) == \
        "ran (the benchmark's rows)"
    assert gpu_paths.verdict(GpuPath("e", tests=("tests/test_other.py",)), run) is None
    assert gpu_paths.verdict(GpuPath("f", tests=(node + "test_passes",), since="2099-01-01"),
                             run) is None
    assert run.gpu in gpu_paths.gpu_table([run])


def test_every_path_names_tests_that_exist():
    """A renamed test would leave its path without evidence for ever: each prefix names a
    test file, and a test in it."""
    for path in gpu_paths.PATHS:
        assert path.tests or path.rows, path.name
        for prefix in path.tests:
            file, _, name = prefix.partition("::")
            text = (REPO / file).read_text()
            assert not name or re.search(rf"^def {re.escape(name)}", text, re.M), prefix
