"""MkDocs hook: the parts of pages written from the code when the site is built, so they cannot
fall behind it. A page holds a marker comment; the hook replaces it with what its function
writes: every command's ``--help`` from the parser, the recorded benchmark runs from the files
in ``benchmarks/results/``, the model families' table from their declarations, what has run
on a GPU from the recorded runs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def every_help() -> str:
    """Each command's ``--help``, in the order of ``python -m hpcpar --help``, at 100 columns."""
    from hpcpar.jobs.parser import build_parser, command_parsers

    width = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"                  # argparse wraps to the terminal's width
    try:
        parser = build_parser()
        parts = [f"## hpcpar\n\n```\n{parser.format_help()}```\n"]
        for name, sub in command_parsers(parser).items():
            parts.append(f"## {name}\n\n```\n{sub.format_help()}```\n")
    finally:
        if width is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = width
    return "\n".join(parts)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def results_table() -> str:
    """One row a file of ``benchmarks/results/``: its date (the file's own, else its name's),
    the machine or GPU, the command or settings, and how many rows it holds."""
    lines = ["| file | date | machine | how it was run | rows |", "|---|---|---|---|---|"]
    for path in sorted(RESULTS.glob("*.json")):
        run = json.loads(path.read_text())
        date = run.get("date") or (re.search(r"\d{4}-\d{2}-\d{2}", path.name) or [""])[0]
        machine = run.get("machine") or run.get("gpu", "")
        how = run.get("command") or json.dumps(run.get("settings", {}))
        lines.append(f"| `{path.name}` | {date} | {_cell(machine)} | {_cell(how)} | "
                     f"{len(run.get('rows', []))} |")
    return "\n".join(lines)


def models_table() -> str:
    """The model families, each one's transformers class and what it declares it does
    differently from Llama (``hpcpar.models.FAMILIES``, ``Family.differs``): written once, in
    the family's module. README.md holds the same table (``tests/test_docs.py`` checks it)."""
    from hpcpar.models import FAMILIES

    lines = ["| `model_type` | transformers class | what differs from Llama |", "|---|---|---|"]
    lines += [f"| `{f.model_type}` | `{f.architecture}` | {_cell(f.differs)} |"
              for f in FAMILIES.values()]
    return "\n".join(lines)


def gpu_table() -> str:
    """What has run on a GPU: ``benchmarks/gpu_paths.py``'s table from the recorded runs
    (README.md holds the same table, ``tests/test_docs.py`` checks it)."""
    import sys
    sys.path.insert(0, str(RESULTS.parent))
    try:
        from gpu_paths import gpu_table as table
    finally:
        sys.path.pop(0)
    return table()


# page -> (its marker, the function that writes what replaces it)
GENERATED = {
    "reference/flags.md": ("<!-- every command's --help: docs/hooks/generated.py -->", every_help),
    "benchmarks.md": ("<!-- the recorded runs: docs/hooks/generated.py -->", results_table),
    "models.md": ("<!-- the families' table: docs/hooks/generated.py -->", models_table),
    "gpu.md": ("<!-- what has run on a GPU: docs/hooks/generated.py -->", gpu_table),
}


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri not in GENERATED:
        return markdown
    mark, write = GENERATED[page.file.src_uri]
    if mark not in markdown:
        raise ValueError(f"{page.file.src_uri} lost its marker {mark!r}: what "
                         f"{write.__name__} writes has nowhere to go")
    return markdown.replace(mark, write())
