"""The README and the documentation as a user reads them: every Python block of README.md and
of every docs/**/*.md page runs as written under the ``mpiexec`` line it starts with, and the
library reference (docs/reference/library.md) names every public name of
``hpcpar.parallel``."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hpcpar.parallel as hp
from helpers import MPIEXEC

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))
LIBRARY_REFERENCE = REPO / "docs" / "reference" / "library.md"


def _blocks() -> dict[str, str]:
    """Every Python block of the pages, by page and number; a block shown on several pages
    (the README repeats one of the library guide's) runs once."""
    found: dict[str, str] = {}
    for page in PAGES:
        text = page.read_text()
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, flags=re.S)):
            if block not in found.values():
                found[f"{page.relative_to(REPO).as_posix()}:{i}"] = block
    return found


BLOCKS = _blocks()


def _launch(block: str) -> list[str]:
    """The command of the block's first line: ``# mpiexec -n N python this.py`` or
    ``# python this.py``."""
    first = block.splitlines()[0]
    found = re.fullmatch(r"# (?:mpiexec -n (\d+) )?python this\.py", first.strip())
    assert found, f"a documented Python block must start with its launch line, not {first!r}"
    return [MPIEXEC, "-n", found.group(1)] if found.group(1) else []


def test_the_readme_and_the_docs_have_python_blocks():
    readme = (REPO / "README.md").read_text()
    assert re.search(r"```python\n", readme)
    assert len(BLOCKS) >= 4


def test_every_python_block_has_its_launch_line():
    for block in BLOCKS.values():
        _launch(block)          # asserts its first line: "# [mpiexec -n N ]python this.py"


@pytest.mark.slow
@pytest.mark.parametrize("block", list(BLOCKS.values()), ids=list(BLOCKS))
def test_every_python_block_runs_under_its_launch_line(block, tmp_path):
    program = tmp_path / "this.py"
    program.write_text(block)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.pop("HPCPAR_BACKEND", None)
    done = subprocess.run(_launch(block) + [sys.executable, str(program)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_the_reference_names_every_public_name():
    reference = LIBRARY_REFERENCE.read_text()
    missing = [name for name in hp.__all__ if not re.search(rf"`{name}\b", reference)]
    assert not missing, f"docs/reference/library.md does not name {missing}"
