"""Every program in examples/ runs under mpiexec with each launch line it carries, and checks
its own result against a dense NumPy (or torch) computation (it fails with an AssertionError
if not)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import MPIEXEC

# processes of their own: the whole suite's tier, not tests/run --quick
pytestmark = pytest.mark.slow

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def _launch_lines(path: Path) -> list[tuple[int, list[str]]]:
    """(-n, arguments) of each ``mpiexec -n N python examples/NAME.py [ARGS]`` line of its
    docstring."""
    found = re.findall(r"mpiexec -n (\d+) python examples/" + re.escape(path.name)
                       + r"([^\n#]*)", path.read_text())
    assert found, f"{path.name} must carry its launch line"
    return [(int(n), args.split()) for n, args in found]


LAUNCHES = [(path, n, args) for path in EXAMPLES for n, args in _launch_lines(path)]


@pytest.mark.parametrize("path, n, args", LAUNCHES,
                         ids=[f"{p.stem}-{n}{''.join(a)}" for p, n, a in LAUNCHES])
def test_example_runs_with_its_launch_lines(path, n, args):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.pop("HPCPAR_BACKEND", None)
    done = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(path), *args], env=env,
                          cwd=path.parents[1], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "OK" in done.stdout, done.stdout
