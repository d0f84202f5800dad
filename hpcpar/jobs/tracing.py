"""A job's ``--trace FILE``: a timeline of every rank, one Chrome trace file.

Every rank traces (``parallel.trace``) on rank 0's time axis (``trace.aligned_origin``: each
clock set against rank 0's by ping-pong, to within half the fastest round trip, microseconds). When the
job has finished, rank 0 gathers each rank's spans as JSON bytes through MPI's buffer methods
(``Gatherv``, never pickled) and writes the file atomically: one track per rank, named by its
place in the mesh. A job that fails or is stopped writes none.
"""

from __future__ import annotations

from pathlib import Path

from .. import __version__
from ..checkpoint.files import AtomicPath, check_writable, write_point, writing
from ..parallel import trace
from ..parallel.errors import HpcparError
from .launch import everyone, location, phase


def check_trace_path(path: str, output: str | None, output_is_folder: bool = False) -> None:
    """One line if the trace cannot be written where asked (checked before the work): a
    folder, not ``.json``, a folder that does not exist or cannot be written, the job's own
    output or a file it writes, or an existing file that is not an hpcpar trace."""
    if not path:
        raise HpcparError("trace file '': give a file name, e.g. trace.json")
    target = Path(path)
    if target.is_dir():
        raise HpcparError(f"trace file {path}: is a folder; give a file name, e.g. "
                          f"{target / 'trace.json'}")
    if target.suffix.lower() != ".json":
        better = (target.with_suffix(".json").name if target.suffix or not
                  target.name.startswith(".") else "trace.json")
        raise HpcparError(f"trace file {path}: the trace is Chrome trace JSON; name it "
                          f"{better}")
    folder = target.resolve().parent
    if output:
        out = Path(output).resolve()
        if target.resolve() == out or (output_is_folder and folder == out
                                       and target.name in OUTPUT_FOLDER_FILES):
            raise HpcparError(f"trace file {path} is also the job's output; give the trace a "
                              "name of its own")
        if output_is_folder and folder == out and not out.exists():
            folder = out.parent         # in a run's folder that the job makes
    if not folder.is_dir():
        raise HpcparError(f"trace file {path}: the folder {target.parent} does not exist")
    if target.exists() and not is_trace(target):
        raise HpcparError(f"trace file {path} exists and is not an hpcpar trace; it will not "
                          "be replaced: remove it or choose another name")
    check_writable(folder)


OUTPUT_FOLDER_FILES = ("report.json",)     # what a training run writes beside its checkpoints
TRACE_HEAD = b'{"displayTimeUnit": "ms", "otherData": {'


def is_trace(path: Path) -> bool:
    """Whether ``path`` is a trace an hpcpar job wrote (its first bytes say so)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    return head.startswith(TRACE_HEAD) and b'"hpcpar": ' in head


class JobTrace:
    """``start()`` on every rank before the job opens, ``write(metadata)`` on every rank
    once it has finished (collective); ``abandon()`` where it ended otherwise."""

    def __init__(self, comm, path: str):
        self.comm, self.path = comm, Path(path)

    def start(self) -> None:
        trace.start(trace.aligned_origin(self.comm))

    def abandon(self) -> None:
        trace.stop()

    def write(self, metadata: dict) -> None:
        tracer = trace.stop()
        with phase("gathering the trace on rank 0"):
            gathered = trace.gather(self.comm, tracer, location(),
                                    dict(metadata, hpcpar=__version__))
        everyone(self.comm, self._write_file, gathered)

    def _write_file(self, gathered: tuple[bytes, dict] | None) -> None:
        if gathered is None:                    # not rank 0
            return
        data, info = gathered
        target = AtomicPath(self.path)
        try:
            with writing(self.path):
                write_point(self.path)
                target.tmp.write_bytes(data)
            target.commit()
        except BaseException:
            target.discard()
            raise
        cut = (f"; {info['dropped_spans']:,} spans past {trace.MAX_SPANS:,} per rank were "
               "not kept" if info["dropped_spans"] else "")
        ranks = f"{info['ranks']} rank" + ("s" if info["ranks"] != 1 else "")
        print(f"wrote {self.path} (a timeline of {ranks}: open it in "
              f"ui.perfetto.dev or chrome://tracing{cut})", flush=True)
