"""A job's hold on its output: rank 0 holds the output's lock while every rank works. The rules
every output follows (``checkpoint.files``) are checked before; this is their collective side."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from ..checkpoint.files import OutputLock
from .launch import everyone


@contextmanager
def claimed(comm, path: str | Path | None, folder: bool = False):
    """Collective over ``comm``: rank 0 holds ``path``'s lock while the body runs (creating
    the folder first when the output is one). A lock held by another live job is an agreed
    error on every rank. No path: nothing to hold."""
    lock = None

    def take():
        nonlocal lock
        if path is None or comm.Get_rank() != 0:
            return
        if folder:
            Path(path).mkdir(exist_ok=True)
        lock = OutputLock(path)
        lock.acquire()

    everyone(comm, take)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
