"""A user's ``.npy`` input (prompts, scoring rows, training rows): NumPy's arrays only, never
pickled objects, and a file that is not a ``.npy`` at all named as such (NumPy's own message
for one blames pickled data)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..parallel.errors import HpcparError

MAGIC = b"\x93NUMPY"


def read_npy(path: Path, what: str, error=HpcparError) -> np.ndarray:
    """The array in ``path``; ``what`` it should hold, for the message; ``error`` the
    ``HpcparError`` subclass its caller raises."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror})") from None
    if head != MAGIC:
        raise error(f"{path}: not a .npy file (it does not begin with NumPy's header); save "
                    f"{what} with numpy.save") from None
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise error(f"{path}: not a readable .npy array ({e})") from None
