"""A training run's folder for ``show``: the newest checkpoint (``latest``), the last steps'
metrics (``metrics.jsonl``) and the run's report (``report.json``). Each of the three is read
on its own: one that is damaged, or not a regular file (a named pipe, a link to a device), is
left out with a note and the others are shown."""

from __future__ import annotations

import json
from pathlib import Path

from ...parallel.errors import HpcparError
from .reading import Unreadable, is_count, is_number, lines_note, not_regular

METRIC_STEPS = 10          # the last steps of a training run shown
NAME_BYTES = 255           # the longest file name a file system takes
# a step's figures show prints, each a number as the trainer writes it (grad_norm: null on
# a step the optimizer skipped)
_STEP_FIELDS = {"step": is_count, "loss": is_number, "lr": is_number,
                "tokens_per_s": is_number, "grad_norm": lambda v: v is None or is_number(v)}


def training_run(folder: Path) -> dict:
    if not (_present(folder / "metrics.jsonl") or _present(folder / "latest")):
        raise HpcparError(f"{folder}: a folder, but not a training run's (no metrics.jsonl or "
                          "latest); show reads a run folder, an output file or a checkpoint")
    metrics, metrics_note = _metrics(folder)
    newest, latest_note = _latest(folder)
    report, report_note = _report(folder)
    return {"kind": "training", "path": str(folder), "steps_logged": len(metrics),
            "latest_checkpoint": str(newest) if newest else None,
            "latest_checkpoint_exists": bool(newest and newest.is_file()),
            "checkpoints": sorted((p.name for p in folder.glob("step-*.h5")), key=_step_of),
            "last_steps": metrics[-METRIC_STEPS:], "report": report,
            "notes": [n for n in (latest_note, metrics_note, report_note) if n]}


def read_metrics(folder: Path) -> list[dict]:
    """A training run's ``metrics.jsonl``, a dict per step logged (none: no file yet, or
    not a file that can be read)."""
    return _metrics(folder)[0]


def _present(path: Path) -> bool:
    return path.exists() or path.is_symlink()          # a dangling link is there, and damage


def _metrics(folder: Path) -> tuple[list[dict], str | None]:
    """The steps logged, and a note on the lines not read. The last line may be one a
    running job is writing: unfinished (no newline yet), it is left out without a note."""
    path = folder / "metrics.jsonl"
    if not _present(path):
        return [], None
    problem = not_regular(path)
    if problem:
        return [], f"metrics.jsonl: {problem}: not read"
    lines = path.read_bytes().split(b"\n")
    metrics, unread, total = [], {}, 0
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            metrics.append(_step(line))
            total += 1
        except Unreadable as e:
            if n < len(lines):                          # a whole line: damage
                unread[n], total = str(e), total + 1
    return metrics, ("metrics.jsonl: " + lines_note(unread, total)) if unread else None


def _step(line: bytes) -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        raise Unreadable("not JSON") from None
    if not isinstance(record, dict):
        raise Unreadable("not a step's metrics")
    wrong = [k for k, ok in _STEP_FIELDS.items() if not ok(record.get(k))]
    if wrong:
        raise Unreadable(f"a null or mistyped {', '.join(wrong)}")
    return record


def _latest(folder: Path) -> tuple[Path | None, str | None]:
    """The checkpoint ``latest`` names (a file name in the folder), and a note if it names
    none."""
    path = folder / "latest"
    if not _present(path):
        return None, None
    problem = not_regular(path)
    if problem:
        return None, f"latest: {problem}: not read"
    with open(path, "rb") as f:
        held = f.read(NAME_BYTES + 2)                 # a name and its newline, or too long
    try:
        name = held.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = ""
    if not name or len(held) > NAME_BYTES + 1 or "/" in name or "\0" in name or name in (
            ".", ".."):
        return None, f"latest: not a checkpoint's file name ({held[:40]!r}): not read"
    return folder / name, None


def _report(folder: Path) -> tuple[dict | None, str | None]:
    path = folder / "report.json"
    if not _present(path):
        return None, None
    problem = not_regular(path)
    if problem:
        return None, f"report.json: {problem}: not read"
    try:
        report = json.loads(path.read_bytes())
    except ValueError:
        return None, "report.json: not JSON: not read"
    if not isinstance(report, dict):
        return None, "report.json: not a JSON object: not read"
    return report, None


def _step_of(name: str) -> tuple:
    """``step-300.h5`` -> (300, name): checkpoints in step order, not the names' order."""
    number = name[len("step-"):-len(".h5")]
    return (int(number), name) if number.isdigit() else (float("inf"), name)
