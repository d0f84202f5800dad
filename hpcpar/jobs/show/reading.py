"""What every reader of ``show`` shares: a file's kind before it is opened, the checks of a
value read from a file someone may have edited, HDF5 values as plain data, a page of rows, and
the one line that says which lines of a file were not read."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import numpy as np

from ...parallel.errors import HpcparError

PAGE = 20                  # rows per page
NUMBERS_SHOWN = 5          # line numbers a note names before "..."

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


class Unreadable(Exception):
    """A line or value that cannot be read; its text says why, for the note."""


def not_regular(path: Path, folder_ok: bool = False) -> str | None:
    """Why ``path`` is not a regular file (or folder, if ``folder_ok``), from its metadata
    alone: a named pipe blocks whoever opens it and a device (/dev/zero) never ends, so
    nothing is opened before this says None."""
    try:
        mode = os.stat(path).st_mode                 # through links: what a read would open
    except FileNotFoundError:
        if path.is_symlink():
            return f"a link to {os.readlink(path)}, which does not exist"
        return "no such file or folder"
    except OSError as e:
        return f"cannot be looked at ({e.strerror})"
    if stat.S_ISREG(mode) or (folder_ok and stat.S_ISDIR(mode)):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a file")
    link = f"a link to {os.readlink(path)}, " if path.is_symlink() else ""
    return f"{link}{kind}, not a regular file" + (" or folder" if folder_ok else "")


def is_count(value) -> bool:
    """A whole number >= 0 as JSON holds it (not a bool, which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_number(value) -> bool:
    """An int or float as JSON holds it (NaN included: a diverged loss is written so)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value) -> bool:
    return is_number(value) and math.isfinite(value)


def plain(value):
    """An HDF5 value as JSON data."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


def attributes(node, problems: list[str]) -> dict:
    """An HDF5 file's or group's attributes as plain data; one it cannot read is named in
    ``problems``."""
    out = {}
    for key in node.attrs:
        try:
            out[key] = plain(node.attrs[key])
        except (OSError, TypeError, ValueError):
            problems.append(f"attribute {key} (unreadable)")
    return out


def page_of(rows: list[dict], page: int, per_page: int) -> dict:
    pages = max(1, -(-len(rows) // per_page))
    if not 1 <= page <= pages:
        raise HpcparError(f"--page {page}: there are {pages} page(s) of {per_page} rows")
    return {"page": page, "pages": pages, "rows": rows[(page - 1) * per_page:page * per_page]}


def counts(values: list) -> dict:
    """How often each value occurs, None (not read) left out."""
    out: dict = {}
    for v in values:
        if v is not None:
            out[v] = out.get(v, 0) + 1
    return out


def lines_note(unread: dict[int, str], total: int) -> str:
    """One line for the lines of a file not read (line number -> why): how many, the first
    few numbers and the reasons."""
    numbers = list(unread)
    named = ", ".join(map(str, numbers[:NUMBERS_SHOWN])) + (
        ", ..." if len(numbers) > NUMBERS_SHOWN else "")
    return (f"{len(numbers)} of {total} lines not read "
            f"(line{'s' if len(numbers) > 1 else ''} {named}): {reasons(unread)}")


def reasons(unread: dict[int, str]) -> str:
    """Why lines were not read, each reason once, in file order."""
    return "; ".join(dict.fromkeys(unread.values()))


def not_an_output(path: Path) -> HpcparError:
    return HpcparError(f"{path}: not an hpcpar output; show reads a generation output (.h5 or "
                       ".jsonl), a scoring output, a training run's folder, a checkpoint or a "
                       "trace (.json)")


def dataset(f, name: str, wanted: str, problems: list[str], expected: bool = True):
    """The HDF5 dataset ``name`` of ``f`` as an array of at least one axis holding ``wanted``
    ("integers", "numbers" or "strings"), or None: missing (a problem if ``expected``),
    unreadable or of another type (always a problem)."""
    import h5py
    if name not in f:
        if expected:
            problems.append(f"{name} (missing)")
        return None
    if not isinstance(f[name], h5py.Dataset):
        problems.append(f"{name} (a group, not a dataset)")
        return None
    try:
        values = f[name][()]
    except (OSError, TypeError, ValueError) as e:             # a damaged chunk, a filter
        problems.append(f"{name} (unreadable: {e})")
        return None
    held = _held(values)
    if held != wanted and not (wanted == "numbers" and held == "integers"):
        problems.append(f"{name} ({held}, not {wanted})")
        return None
    return values


def _held(values) -> str:
    if not isinstance(values, np.ndarray) or values.ndim == 0:
        return "a single value"
    if np.issubdtype(values.dtype, np.integer):
        return "integers"
    if np.issubdtype(values.dtype, np.floating):
        return "numbers"
    return "strings" if values.dtype.kind in "OSU" else f"{values.dtype} values"


class Cells:
    """The values of a file's rows, each read on its own: one that cannot be read (the wrong
    shape or type at that place) is None, and counted by dataset for the note."""

    def __init__(self):
        self.unread: dict[str, int] = {}

    def get(self, array, at, name: str, convert):
        if array is None:
            return None
        try:
            return convert(array[at])
        except (IndexError, TypeError, ValueError):
            self.unread[name] = self.unread.get(name, 0) + 1
            return None

    def problems(self) -> list[str]:
        return [f"{name} of {n} row{'s' if n > 1 else ''} (unreadable)"
                for name, n in self.unread.items()]


def whole(value) -> int:
    """An HDF5 count (a scalar integer >= 0) as an int."""
    if not isinstance(value, np.integer) or value < 0:
        raise ValueError(value)
    return int(value)


def real(value) -> float:
    if not isinstance(value, (np.integer, np.floating)):
        raise ValueError(value)
    return float(value)


def text(value) -> str:
    value = plain(value)
    if not isinstance(value, str):
        raise ValueError(value)
    return value
