"""What every command that writes a file or folder checks before any work starts, and holds
while it runs.

- The output is not one of the job's inputs (a checkpoint, prompts, data, source weights):
  writing it would destroy the input.
- Its folder exists and can be written, found now rather than after hours of work.
- One writer at a time: a lock file beside the output, holding ``host:pid``, is created
  exclusively; a second job writing the same output stops with a message. A lock left by a
  process that no longer runs on this host (a crash, a ``kill -9``) is taken over.
- Temporary files that a crashed writer left beside the output are removed.
"""

from __future__ import annotations

import os
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import HpcparError
from .launch import everyone


def check_output(path: str | Path, inputs: dict[str, str | Path] | None = None,
                 folder: bool = False) -> None:
    """Raise ``HpcparError`` if ``path`` cannot be this job's output (see the module doc).
    ``inputs`` names the job's input files ({"checkpoint": ..., "prompts": ...});
    ``folder`` says the output is a folder (training checkpoints) rather than a file."""
    path = Path(path)
    if not folder and path.is_dir():
        raise HpcparError(f"output {path} is a folder; give a file name such as {path}/out.h5")
    if folder and path.exists() and not path.is_dir():
        raise HpcparError(f"output {path} is a file; this command writes a folder")
    parent = path.parent
    if not parent.is_dir():
        raise HpcparError(f"output folder {parent} does not exist; create it first")
    for what, source in (inputs or {}).items():
        if source is None or not Path(source).exists():
            continue
        source = Path(source).resolve()
        target = path.resolve()
        if source == target or (folder and target in source.parents):
            where = "is" if source == target else "lies inside"
            raise HpcparError(f"the {what} {source} {where} the output {path}; writing there "
                              "would destroy it; choose another output")
    writable = path if folder and path.is_dir() else parent
    try:                       # really create a file: permissions, read-only mounts, quotas
        with tempfile.NamedTemporaryFile(dir=writable, prefix=".hpcpar-probe-"):
            pass
    except OSError as e:
        raise HpcparError(f"cannot write into {writable} ({e.strerror}); choose a folder you "
                          "can write") from None


def _owner_alive(text: str) -> bool:
    host, _, pid = text.strip().rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True                      # another machine's, or unreadable: assume it runs
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLock:
    """``with OutputLock(path):`` the only writer of ``path`` (a file or a folder)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.lock = (self.path / ".lock" if self.path.is_dir()
                     else self.path.with_name(f".{self.path.name}.lock"))
        self.mine = f"{socket.gethostname()}:{os.getpid()}"
        self.held = False

    def acquire(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    owner = self.lock.read_text()
                except OSError:
                    owner = ""
                if _owner_alive(owner):
                    raise HpcparError(f"another job ({owner.strip() or 'unknown'}) is writing "
                                      f"{self.path}; wait for it, or remove {self.lock} if it "
                                      "is gone") from None
                self.lock.unlink(missing_ok=True)          # its writer died: take over
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.mine + "\n")
            self.held = True
            return

    def release(self) -> None:
        if self.held:
            self.lock.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Hidden ``.NAME.tmp-HOST-PID`` files beside ``path`` whose writer no longer runs here."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        owner = tmp.name.rsplit(".tmp-", 1)[1]
        host, _, pid = owner.rpartition("-")
        if not _owner_alive(f"{host}:{pid}"):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


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
