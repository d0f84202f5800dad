"""Which communicator a group gets, decided from facts every rank reports (pure functions, so
the decision is testable without GPUs, NCCL or a CUDA-aware MPI).

NCCL when the arrays live on GPUs, CuPy's NCCL binding has its library (``nccl.available``;
importing ``cupy.cuda.nccl`` succeeds without it), and no two ranks of the group share a
physical GPU (NCCL refuses that). Ranks are told apart by host and PCI bus id, not by CUDA
ordinal: with ``CUDA_VISIBLE_DEVICES`` narrowed to one GPU per rank (Slurm's
``--gpus-per-task=1``) every rank sees its GPU as device 0. Otherwise MPI, CUDA-aware when the
library says so, else staged through pinned host buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import HpcparError


@dataclass(frozen=True)
class RankDevice:
    """What one rank reports about itself."""

    host: str
    gpu: str            # PCI bus id of its GPU ("" without one)
    nccl: bool          # CuPy's NCCL binding has its library


def choose(kind: str, on_gpu: bool, ranks: list[RankDevice]) -> str:
    """``"nccl"`` or ``"mpi"`` for a group, from ``--comm`` (auto, mpi, nccl) and every rank's
    report; ``nccl`` asked for where it cannot work is an error that says why."""
    if kind == "mpi":
        return "mpi"
    reason = nccl_unusable(on_gpu, ranks)
    if kind == "nccl" and reason:
        raise HpcparError(f"--comm nccl: {reason}; use --comm mpi (or auto)")
    return "mpi" if reason else "nccl"


def nccl_unusable(on_gpu: bool, ranks: list[RankDevice]) -> str:
    """Why NCCL cannot serve this group ("" when it can)."""
    if not on_gpu:
        return "the arrays are not on GPUs (backend numpy)"
    missing = [i for i, r in enumerate(ranks) if not r.nccl]
    if missing:
        return (f"CuPy has no NCCL library on group rank(s) {_few(missing)}: install hpcpar"
                "[gpu-cuda12] or [gpu-cuda13] (they bring the NCCL wheel)")
    seen: dict[tuple[str, str], int] = {}
    for i, r in enumerate(ranks):
        first = seen.setdefault((r.host, r.gpu), i)
        if first != i:
            return (f"group ranks {first} and {i} share one GPU ({r.gpu} on {r.host}) and NCCL "
                    "needs a GPU per rank: start one rank per GPU")
    return ""


def cuda_aware(setting: str, library_says: bool | None, mpi4py_version: str) -> tuple[bool, str]:
    """Whether device buffers go to MPI directly, and why.

    ``setting`` is ``HPCPAR_CUDA_AWARE`` (1, 0, or auto/unset); ``library_says`` is the MPI
    library's own answer (MPIX_Query_cuda_support; None where it has no such query). mpi4py
    before 4.0.3 frees CuPy buffers twice through DLPack, so device buffers are staged there."""
    if setting in ("0", "no", "false"):
        return False, "HPCPAR_CUDA_AWARE=0"
    if _version(mpi4py_version) < (4, 0, 3):
        return False, f"mpi4py {mpi4py_version} < 4.0.3 mishandles CuPy buffers; staging"
    if setting in ("1", "yes", "true"):
        return True, "HPCPAR_CUDA_AWARE=1"
    if library_says is None:
        return False, "the MPI library cannot say whether it is CUDA-aware; staging"
    return library_says, ("the MPI library is CUDA-aware" if library_says
                          else "the MPI library is not CUDA-aware; staging")


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _few(items: list[int]) -> str:
    return ", ".join(map(str, items[:4])) + (", ..." if len(items) > 4 else "")
