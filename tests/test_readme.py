"""The README as a user reads it: every Python block runs as written under the ``mpiexec``
line it starts with, and the library reference names every public name of
``hpcpar.parallel``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hpcpar.parallel as hp
from helpers import MPIEXEC

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def _launch(block: str) -> list[str]:
    """The command of the block's first line: ``# mpiexec -n N python this.py`` or
    ``# python this.py``."""
    first = block.splitlines()[0]
    found = re.fullmatch(r"# (?:mpiexec -n (\d+) )?python this\.py", first.strip())
    assert found, f"a README Python block must start with its launch line, not {first!r}"
    return [MPIEXEC, "-n", found.group(1)] if found.group(1) else []


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_every_python_block_runs_under_its_launch_line(block, tmp_path):
    program = tmp_path / "this.py"
    program.write_text(block)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.pop("HPCPAR_BACKEND", None)
    done = subprocess.run(_launch(block) + [sys.executable, str(program)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_the_reference_names_every_public_name():
    reference = README[README.index("## Library reference"):]
    reference = reference[:reference.index("\n## ", 1)]
    missing = [name for name in hp.__all__ if not re.search(rf"`{name}\b", reference)]
    assert not missing, f"the README's library reference does not name {missing}"
