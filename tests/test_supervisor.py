"""The rank keeper (``hpcpar.jobs.supervisor``): a child ended by a signal or an unexplained exit is
named in one line with the launcher's rank; signals reach the child; killing the keeper takes
the child with it, which names it; an exit through hpcpar's own path stays quiet."""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO

KEEPER = ("import sys; from hpcpar.jobs.supervisor import supervise; "
          "raise SystemExit(supervise(sys.argv[1:]))")


def _keeper(child_code: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PMI_RANK="3", PMI_SIZE="4", PYTHONPATH=str(REPO))
    env.pop("HPCPAR_SUPERVISED_FD", None)
    return subprocess.Popen([sys.executable, "-c", KEEPER, sys.executable, "-c", child_code],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)


@pytest.mark.slow
def test_a_child_killed_by_a_signal_is_named_and_its_status_kept():
    proc = _keeper("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL
    assert err.count("\n") == 1 and "rank 3 of 4 (pid " in err and "SIGKILL" in err, err


@pytest.mark.slow
def test_an_unexplained_exit_is_named_and_an_explained_one_is_not():
    proc = _keeper("import os; os._exit(7)")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 7 and "rank 3 of 4" in err and "status 7" in err, err
    proc = _keeper("from hpcpar.jobs.supervisor import mark_known_exit; mark_known_exit(); "
                   "raise SystemExit(2)")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and err == "", err


@pytest.mark.slow
def test_signals_reach_the_child():
    code = ("import signal, sys, time; signal.signal(signal.SIGUSR1, lambda *a: sys.exit(3)); "
            "print('ready', flush=True); time.sleep(30)")
    proc = _keeper(code)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, err


@pytest.mark.slow
def test_killing_the_keeper_leaves_no_orphan():
    proc = _keeper("import os, time; print(os.getpid(), flush=True); time.sleep(60)")
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


@pytest.mark.slow
def test_a_killed_keeper_is_named_by_its_rank():
    code = ("import os, time; from hpcpar.jobs.supervisor import watch_keeper; watch_keeper(); "
            "print(os.getpid(), flush=True); time.sleep(60)")
    proc = _keeper(code)
    int(proc.stdout.readline())
    proc.kill()                                          # the keeper, not the rank
    _, err = proc.communicate(timeout=30)
    assert "rank 3 of 4 (pid " in err and "lost its keeper (pid " in err, err
    assert err.count("\n") == 1, err


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("env, wanted", [
    ({"PMI_RANK": "0", "PMI_SIZE": "4"}, True),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, True),
    ({"PMI_RANK": "0", "PMI_SIZE": "1"}, False),                 # alone: nothing to name
    ({}, False),                                                 # no launcher
    ({"PMI_RANK": "0", "PMI_SIZE": "4", "HPCPAR_SUPERVISE": "0"}, False),
    ({"PMI_RANK": "0", "PMI_SIZE": "4", "HPCPAR_SUPERVISED_FD": "5"}, False),  # the child
])
def test_the_keeper_runs_only_under_a_launcher_of_several_tasks(monkeypatch, env, wanted):
    from hpcpar.jobs import supervisor
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "PMIX_RANK", "PMIX_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "HPCPAR_SUPERVISE",
                 "HPCPAR_SUPERVISED_FD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert supervisor.wanted() is wanted
