"""Every program in examples/ runs under mpiexec with the launch line it carries, and checks
its own result against a dense NumPy computation (it fails with an AssertionError if not)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def _launch_ranks(path: Path) -> int:
    """The -n of the ``mpiexec -n N python examples/NAME.py`` line in its docstring."""
    found = re.search(r"mpiexec -n (\d+) python examples/" + re.escape(path.name), path.read_text())
    assert found, f"{path.name} must carry its launch line"
    return int(found.group(1))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_with_its_launch_line(path):
    n = _launch_ranks(path)
    mpiexec = os.environ.get("MPIEXEC", "mpiexec")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.pop("HPCPAR_BACKEND", None)
    done = subprocess.run([mpiexec, "-n", str(n), sys.executable, str(path)], env=env,
                          cwd=path.parents[1], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "OK" in done.stdout, done.stdout
