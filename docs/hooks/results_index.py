"""MkDocs hook: the benchmarks page's list of recorded runs, written from the files in
``benchmarks/results/`` when the site is built, so a run recorded there is listed with its date,
machine and command without anyone copying it."""

from __future__ import annotations

import json
import re
from pathlib import Path

PAGE = "benchmarks.md"
MARK = "<!-- the recorded runs: docs/hooks/results_index.py -->"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


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


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARK not in markdown:
        raise ValueError(f"{PAGE} lost its marker {MARK!r}: the runs have nowhere to go")
    return markdown.replace(MARK, results_table())
