"""The documentation site: ``mkdocs build --strict`` builds docs/ with no broken link or
anchor, every page under docs/ is in mkdocs.yml's nav, the flags page is the parser's own
``--help`` of every command, the benchmarks page lists every recorded run, the models table
(the site's and README's) is the families' declarations, and the API page holds the
docstrings it names."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml                     # PyYAML: mkdocs's own dependency, in the test extra

REPO = Path(__file__).resolve().parents[1]


def _nav_pages(nav) -> list[str]:
    """Every page path of a mkdocs nav: a list of strings and one-key dicts, nested."""
    pages = []
    for entry in nav:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_every_docs_page_is_in_the_nav():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs" and config["strict"] is True
    listed = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md"))
    assert sorted(set(listed)) == sorted(listed), f"a page is listed twice: {listed}"
    assert set(pages) == set(listed), (f"not in the nav: {sorted(set(pages) - set(listed))}; "
                                       f"in the nav, no such page: {sorted(set(listed) - set(pages))}")


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert (tmp_path / "site" / "index.html").is_file()
    # the flags page, written by docs/hooks/generated.py: every command's every flag, as the
    # parser has it
    import html
    import re

    from hpcpar.jobs.parser import build_parser, command_parsers
    page = html.unescape((tmp_path / "site" / "reference" / "flags" / "index.html").read_text())
    for name, sub in command_parsers(build_parser()).items():
        section = page.split(f'id="{name}"', 1)[1].split("<h2", 1)[0]
        flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        missing = [f for f in flags if not re.search(rf"{re.escape(f)}\b", section)]
        assert flags and not missing, f"{name}: {missing} not on the flags page"
    # the benchmarks page lists every recorded run (docs/hooks/generated.py)
    benchmarks = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    for run in (REPO / "benchmarks" / "results").glob("*.json"):
        assert run.name in benchmarks, f"{run.name} is not listed on the benchmarks page"
    # the API page: each object it names is rendered from its docstring (mkdocstrings)
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in re.findall(r"^::: (\S+)", (REPO / "docs" / "reference" / "api.md").read_text(),
                           flags=re.M):
        section = api.split(f'id="{name}"', 1)
        assert len(section) == 2 and "doc-contents" in section[1][:4000], f"{name}: no docstring"


# the README's tables the docs' hook writes too, and how to bring one up to date
README_TABLES = {"models.md": "paste the families' table (docs/hooks/generated.py) in",
                 "gpu.md": "run: python benchmarks/gpu_paths.py --write"}


@pytest.mark.parametrize("page", README_TABLES)
def test_the_readme_tables_are_written_from_the_code_and_the_records(page):
    """README.md's table of families is what docs/hooks/generated.py writes into the models
    page from each family's ``Family.differs`` (a family's differences written once, in its
    module); its table of what has run on a GPU is what ``benchmarks/gpu_paths.py`` writes
    from ``benchmarks/results/`` (after a GPU run, ``--write``, never an edit by hand)."""
    sys.path.insert(0, str(REPO / "docs" / "hooks"))
    try:
        from generated import GENERATED
    finally:
        sys.path.pop(0)
    mark, write = GENERATED[page]
    table = write()
    assert table in (REPO / "README.md").read_text(), (
        f"README.md's table for docs/{page} is not what the code writes; "
        f"{README_TABLES[page]}:\n{table}")
    assert mark in (REPO / "docs" / page).read_text()
