"""``hpcpar show OUT``: what a person wants first from anything hpcpar writes, without h5py.

    generation output (.h5 or .jsonl)   per prompt: finish reason, token counts, the text
                                        (a page at a time); the run's report
    scoring output (.h5)                perplexity, tokens scored; per row: nll, tokens
    training run folder                 the newest checkpoint, the last steps' metrics
    checkpoint (.h5)                    family, shape, parameters, dtype, size, step
    trace (--trace's .json)             per rank: time computing, waiting and in collectives

``summary(path)`` gathers it as plain data (what ``--json`` prints); ``format_summary`` lays
it out for a terminal. Reading only: nothing is written, and a file that is none of these is
one error naming what ``show`` reads.

A damaged or hand-edited output is read as far as it can be: what is readable is shown, and
what is not is said in the summary's ``notes`` (a line each, after the table); only an output
with nothing readable left is an error. What is not a regular file or folder (a named pipe,
a link to /dev/zero) is refused from its metadata, before it is opened: a pipe would block the
read, a device never end it.
"""

from __future__ import annotations

from pathlib import Path

from ...checkpoint.files import OUTPUT_SUFFIXES, output_kind
from ...parallel.errors import HpcparError
from .checkpoints import checkpoint
from .generation import generation_h5, generation_jsonl
from .reading import PAGE, not_an_output, not_regular
from .scores import scores
from .text import format_summary
from .traces import inside, outermost, read_trace, trace_summary
from .training import read_metrics, training_run

__all__ = ["PAGE", "format_summary", "inside", "outermost", "read_metrics", "read_trace",
           "summary"]


def summary(path: str | Path, page: int = 1, per_page: int = PAGE) -> dict:
    """The summary of ``path`` as plain data, rows ``page`` (from 1) of ``per_page``."""
    path = Path(path)
    stopped = _stopped_run(path)
    if stopped:
        raise HpcparError(stopped)
    problem = not_regular(path, folder_ok=True)
    if problem == "no such file or folder":
        raise HpcparError(f"{path}: no such file or folder")
    if problem:
        raise HpcparError(f"{path}: {problem}; show reads an output file or a run's folder")
    try:
        return _summary(path, page, per_page)
    except OSError as e:            # permissions, a disk error, an HDF5 file cut short
        raise HpcparError(f"{path}: cannot read it ({e.strerror or e}); check its "
                          "permissions, or write it again") from None


def _stopped_run(path: Path) -> str | None:
    """What to say of a generation output a stopped run has not written yet (``path`` absent,
    its hidden ``.NAME.partial`` there), or of that partial file itself; None otherwise."""
    if path.name.startswith(".") and path.name.endswith(".partial"):
        partial, output = path, path.with_name(path.name[1:-len(".partial")])
    else:
        partial, output = path.with_name(f".{path.name}.partial"), path
    if output.exists() or not partial.is_file():
        return None
    try:
        import h5py
        with h5py.File(partial, "r") as f:
            done = f"{int(f['done'][()].sum())} of {len(f['done'])} rows finished"
    except (OSError, KeyError):
        done = "its finished rows unreadable"
    return (f"{output}: not written yet: a stopped run left {partial.name} ({done}); run the "
            "same command again with --resume auto to finish it")


def _summary(path: Path, page: int, per_page: int) -> dict:
    if path.is_dir():
        return training_run(path)
    suffix = path.suffix.lower()
    if suffix == ".json":
        return trace_summary(path)
    if suffix == ".jsonl":
        return generation_jsonl(path, page, per_page)
    kind = output_kind(path)
    if kind == "checkpoint":
        return checkpoint(path)
    if kind == "generation":
        return generation_h5(path, page, per_page)
    if kind == "scores":
        return scores(path, page, per_page)
    if suffix in OUTPUT_SUFFIXES:
        _check_opens(path)
    raise not_an_output(path)


def _check_opens(path: Path) -> None:
    """An ``.h5`` that HDF5 cannot open is named so: most often a copy or a write that did
    not finish, not some other kind of file."""
    import h5py
    try:
        h5py.File(path, "r").close()
    except OSError as e:
        raise HpcparError(f"{path}: HDF5 cannot open it ({e}); a copy or a write that did not "
                          "finish leaves a file cut short: copy or write it again") from None
