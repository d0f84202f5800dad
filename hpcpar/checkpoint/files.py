"""The rules every file hpcpar writes follows (checkpoints, generations, scores, training runs):
what a command that writes a file or folder checks before any work starts, and holds while it
runs.

- The output is not one of the job's inputs (a checkpoint, prompts, data, source weights):
  writing it would destroy the input.
- Its folder exists and can be written, found now rather than after hours of work.
- One writer at a time: a lock file beside the output, holding ``host:pid``, is created
  exclusively; a second job writing the same output stops with a message. A lock left by a
  process that no longer runs on this host (a crash, a ``kill -9``) is taken over.
- Temporary files that a crashed writer left beside the output are removed.
- An output file has the suffix of its format, and an existing file at its path is
  replaced only when it is an hpcpar output of the same kind (a file of ``OUTPUT_KIND``),
  never a file someone put there for another reason.

And while it writes: a failed write (a full disk, a quota, a read-only or failing file
system) is one ``WriteError`` naming the path and the cause (``writing``). HDF5 must not
meet a full disk at all: after a failed write its next flush can crash the process (HDF5
2.0, measured), so a large HDF5 file is sized before it is created (``check_space``) and its
blocks are reserved once it exists (``reserve``); later writes go into reserved space.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ..parallel.errors import HpcparError

EMPTY_LOCK_SECONDS = 10.0             # an empty lock older than this is a dead writer's
OUTPUT_KIND = "hpcpar_output"          # attribute of every HDF5 output: its kind
OUTPUT_SUFFIXES = (".h5", ".hdf5")
JSONL_KINDS = ("generation",)         # kinds that also write JSON lines (.jsonl)
# the keys of every line of a generation's .jsonl output, in order
JSONL_KEYS = ("index", "text", "token_ids", "finish_reason", "prompt_tokens",
              "completion_tokens")
JSONL_OPTIONAL_KEYS = ("sample", "logprobs", "prompt_logprobs")   # where the run has them
# kind -> a dataset only that kind of file holds (files written before OUTPUT_KIND existed)
_KIND_MARKS = {"generation": "tokens", "scores": "token_logprobs"}
_ADVICE = {errno.ENOSPC: "free space or write elsewhere",
           errno.EDQUOT: "free space under your quota or write elsewhere",
           errno.EROFS: "write elsewhere",
           errno.EIO: "check the file system, or write elsewhere",
           errno.EACCES: "choose a folder you can write"}


class WriteError(HpcparError):
    """Writing an output failed (ENOSPC, EDQUOT, EROFS, EIO, ...)."""


def is_write_failure(e: BaseException) -> bool:
    """An ``OSError``, or HDF5's report of a failed system call, which h5py raises as
    whichever type the call maps to ("Unable to flush file (file write failed: ... errno =
    28 ...)" as ``RuntimeError``, dataset creation as ``ValueError``)."""
    return isinstance(e, OSError) or (isinstance(e, Exception) and "errno = " in str(e))


def write_failure(path: str | Path, e: BaseException) -> WriteError:
    """The one-line ``WriteError`` for ``e``, raised while writing ``path``. HDF5 reports
    the system error inside its message ("errno = 28"); its number is found there."""
    code = getattr(e, "errno", None)
    if code is None:
        found = re.search(r"errno = (\d+)", str(e))
        code = int(found.group(1)) if found else None
    cause = os.strerror(code) if code else (getattr(e, "strerror", None)
                                            or str(e).splitlines()[0])
    advice = _ADVICE.get(code, "check the file system, or write elsewhere")
    return WriteError(f"cannot write {path}: {cause}; {advice}")


@contextmanager
def quiet_deallocation():
    """Yields a list that collects the write failures h5py meets while freeing an object
    (its chunk cache is written then, and the error can only be printed as "Exception
    ignored"): kept, not printed, for the caller to report once."""
    caught: list[BaseException] = []
    previous, previous_print = sys.unraisablehook, sys.excepthook

    def hook(unraisable):
        if is_write_failure(unraisable.exc_value):
            caught.append(unraisable.exc_value)
        else:
            previous(unraisable)

    def print_hook(kind, value, tb):         # Cython prints the traceback first
        if not is_write_failure(value):
            previous_print(kind, value, tb)

    sys.unraisablehook, sys.excepthook = hook, print_hook
    try:
        yield caught
    finally:
        sys.unraisablehook, sys.excepthook = previous, previous_print


@contextmanager
def writing(path: str | Path):
    """``with writing(path):`` a failed write in the body (an ``OSError``, HDF5's
    ``RuntimeError``, or one h5py meets while freeing an object) becomes
    ``write_failure``."""
    with quiet_deallocation() as caught:
        try:
            yield
        except WriteError:
            raise
        except Exception as e:
            if not is_write_failure(e):
                raise
            raise write_failure(path, e) from None
    if caught:
        raise write_failure(path, caught[0])


# called at every write point with its path: the jobs' fault injection (``jobs.faults``) adds
# itself here, so tests can fail a write of any layer that knows no faults
WRITE_HOOKS: list[Callable[[Path], None]] = []


def write_point(path: str | Path) -> None:
    """Where tests inject a failed write (``HPCPAR_FAULT=...,phase=write,kind=enospc``):
    each call is one write of this rank, counted from 1."""
    for hook in WRITE_HOOKS:
        hook(Path(path))


SPACE_MARGIN = 1 << 20                 # bytes kept free beyond a file's size (metadata)


def check_space(path: str | Path, nbytes: int) -> None:
    """A ``WriteError`` now if the file system of ``path`` has less than ``nbytes`` (plus
    a margin) free for this user, before anything is written."""
    path = Path(path)
    where = path.parent
    while not where.exists() and where != where.parent:   # a folder the job will make
        where = where.parent
    try:
        stat = os.statvfs(where)
    except OSError:
        return
    free = stat.f_bavail * stat.f_frsize
    if free < nbytes + SPACE_MARGIN:
        raise WriteError(f"cannot write {path}: it needs about {_megabytes(nbytes)} and the "
                         f"file system holds {_megabytes(free)} free; free space or write "
                         "elsewhere")


def reserve(path: str | Path) -> None:
    """Give the existing file ``path`` real blocks for all its bytes (``posix_fallocate``),
    so that writing into it later cannot meet a full disk or a quota; a file system that
    cannot reserve is left as it is."""
    path = Path(path)
    with writing(path):
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size:
                os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
        finally:
            os.close(fd)


def _megabytes(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


class AtomicPath:
    """A temporary sibling of ``path`` that replaces it on ``commit`` and vanishes on
    ``discard``. Use for every output file, so none is ever left half-written. Temporaries
    that crashed writers on this host left beside ``path`` are removed first."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        remove_stale_temporaries(self.path)
        self.tmp = self.path.with_name(
            f".{self.path.name}.tmp-{socket.gethostname()}-{os.getpid()}")

    def commit(self) -> None:
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        try:
            self.tmp.unlink(missing_ok=True)
        except OSError:        # a read-only file system, where no temporary was made either
            pass


def write_text(path: str | Path, text: str) -> None:
    """Replace the small text file ``path`` with ``text`` at once (``AtomicPath``): a failed
    write leaves the old file, and no temporary."""
    target = AtomicPath(path)
    try:
        with writing(path):
            write_point(path)
            target.tmp.write_text(text)
            target.commit()
    finally:
        target.discard()


BATCH_KEYS = ("id", "custom_id", "response", "error")     # an OpenAI Batch API output line


def is_generation_line(record) -> bool:
    """Whether a parsed JSON line is one of a generation's JSON-lines output (its own
    lines, or a Batch API file's output lines)."""
    return isinstance(record, dict) and (tuple(record) == BATCH_KEYS or tuple(
        k for k in record if k not in JSONL_OPTIONAL_KEYS) == JSONL_KEYS)


def output_kind(path: str | Path) -> str | None:
    """The kind of hpcpar output ``path`` holds ("generation", "scores", "checkpoint"), or
    None for any other file."""
    import h5py

    from .format import ATTR_VERSION
    if Path(path).suffix.lower() == ".jsonl":
        try:
            with open(path, encoding="utf-8") as f:
                first = json.loads(f.readline() or "{}")
        except (OSError, ValueError):
            return None
        return "generation" if is_generation_line(first) else None
    try:
        with h5py.File(path, "r") as f:
            if OUTPUT_KIND in f.attrs:
                return str(f.attrs[OUTPUT_KIND])
            if ATTR_VERSION in f.attrs:
                return "checkpoint"
            if "hpcpar_version" in f.attrs:
                return next((k for k, mark in _KIND_MARKS.items() if mark in f), None)
    except OSError:
        return None
    return None


def _holds_training_state(path: Path) -> bool:
    """A checkpoint a training run saved: its optimizer state is a run's, not remade by
    converting or initialising again."""
    import h5py
    try:
        with h5py.File(path, "r") as f:
            return "optimizer" in f
    except OSError:
        return False


def check_output(path: str | Path, inputs: dict[str, str | Path] | None = None,
                 folder: bool = False, kind: str | None = None) -> None:
    """Raise ``HpcparError`` if ``path`` cannot be this job's output (see the module doc).
    ``inputs`` names the job's input files ({"checkpoint": ..., "prompts": ...});
    ``folder`` says the output is a folder (training checkpoints) rather than a file;
    ``kind`` the kind of HDF5 output written there ("generation", "scores", "checkpoint")."""
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
    suffixes = OUTPUT_SUFFIXES + ((".jsonl",) if kind in JSONL_KINDS else ())
    if kind is not None and path.suffix.lower() not in suffixes:
        written = "HDF5 or JSON lines" if kind in JSONL_KINDS else "HDF5"
        raise HpcparError(f"output {path}: this command writes {written}; give a name ending "
                          f"in {', '.join(suffixes)}, such as {path.with_suffix('.h5')}")
    found = output_kind(path) if kind is not None and path.is_file() else kind
    if found == "checkpoint" and _holds_training_state(path):
        found = "training checkpoint"           # its optimizer state would be lost
    if found != kind:
        what = f"an hpcpar {found} file" if found else "not an hpcpar output"
        raise HpcparError(f"output {path} exists and is {what}; this command writes a {kind} "
                          "file and will not replace it: remove it or choose another name")
    check_writable(path if folder and path.is_dir() else parent)


def check_writable(folder: str | Path) -> None:
    """An ``HpcparError`` now unless a file can be created in ``folder``: one is, and removed
    (permissions, read-only mounts and quotas all show only so)."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hpcpar-probe-"):
            pass
    except OSError as e:
        raise HpcparError(f"cannot write into {folder} ({e.strerror}); choose a folder you "
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
    try:                 # a writer that died but is not yet reaped (a zombie) is gone too
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


class OutputLock:
    """``with OutputLock(path):`` the only writer of ``path`` (a file or a folder). The lock
    of a folder is inside it, unless ``beside``: a folder written elsewhere and renamed into
    place at the end (``export``) must be empty then."""

    def __init__(self, path: str | Path, beside: bool = False):
        self.path = Path(path)
        self.lock = (self.path / ".lock" if self.path.is_dir() and not beside
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
                    age = time.time() - self.lock.stat().st_mtime
                except OSError:
                    owner, age = "", 0.0
                # empty and old: its writer died between creating and filling it
                if _owner_alive(owner) and (owner.strip() or age < EMPTY_LOCK_SECONDS):
                    raise HpcparError(f"another job ({owner.strip() or 'unknown'}) is writing "
                                      f"{self.path}; wait for it, or remove {self.lock} if it "
                                      "is gone") from None
                self.lock.unlink(missing_ok=True)          # its writer died: take over
                continue
            try:
                with writing(self.lock), os.fdopen(fd, "w") as f:
                    f.write(self.mine + "\n")
            except WriteError:
                self.lock.unlink(missing_ok=True)
                raise
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
