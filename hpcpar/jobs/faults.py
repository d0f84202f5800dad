"""Fault injection for tests: ``HPCPAR_FAULT=rank=2,phase=decode,step=5,kind=raise`` makes
world rank 2 fail at decode step 5.

    rank    the world rank that fails (required; one of the job's, 0..N-1)
    phase   load | prefill | decode | train | score | write (required); the points the
            jobs call ``fault_point`` at: before reading the checkpoint, before a wave's
            prefill, before each decode step, before each training step, before each scoring
            micro-batch, and inside every write of an output, partial, checkpoint or metrics
            file (``checkpoint.files.write_point``)
    step    decode step (1-based), wave (prefill, 1-based), training step, scoring
            micro-batch, or the rank's n-th write (1-based); absent: the first time the
            phase comes. load comes once and takes none
    kind    raise (an exception: the normal error path), exit (the process ends with status
            1 without a word, as a crash would), kill (SIGKILL to itself; for both, the
            rank's keeper, ``supervisor``, names it), hang (SIGSTOP to itself: the other
            ranks' watchdog, --timeout, must end the job), slow (a straggler: the rank
            sleeps ``SLOW_SECONDS`` at this point and at every later point of the phase;
            the job must finish as without it); at a write also enospc, eio, erofs (the
            write fails with that system error, as on a full disk, a failing or a
            read-only file system)

Unset, ``fault_point`` costs one dictionary lookup. The variable is read through the
environment table (declared here), so a malformed one, or one whose rank or step no
job has, is one error before any work.
"""

from __future__ import annotations

import errno
import os
import signal
import time

from ..checkpoint import files
from ..parallel.environment import Spec, declare, environment_value, parse_environment

PHASES = ("load", "prefill", "decode", "train", "score", "write")
WRITE_ERRORS = {"enospc": errno.ENOSPC, "eio": errno.EIO, "erofs": errno.EROFS}
KINDS = ("raise", "exit", "kill", "hang", "slow", *WRITE_ERRORS)
SLOW_SECONDS = 0.1


class InjectedFault(RuntimeError):
    """The failure ``HPCPAR_FAULT`` asked for (a bug-like error, not bad input)."""


def parse_fields(text: str, world_size: int | None = None) -> dict:
    """``rank=R,phase=P[,step=S][,kind=K]`` -> a dict; raises ValueError saying what is wrong
    (the message around it is ``parallel.environment``'s). With
    ``world_size``, R must be one of its ranks."""
    spec = {"kind": "raise", "step": None}
    for item in text.split(","):
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key in ("rank", "step"):
            try:
                spec[key] = int(value)
            except ValueError:
                raise ValueError(f"{key} {value!r} is not an integer") from None
        elif key in ("phase", "kind"):
            spec[key] = value
        else:
            raise ValueError(f"unknown key {key!r}")
    if "rank" not in spec or "phase" not in spec:
        raise ValueError("needs rank=R and phase=P")
    if spec["phase"] not in PHASES:
        raise ValueError(f"phase {spec['phase']!r} is not one of {', '.join(PHASES)}")
    if spec["kind"] not in KINDS:
        raise ValueError(f"kind {spec['kind']!r} is not one of {', '.join(KINDS)}")
    if spec["kind"] in WRITE_ERRORS and spec["phase"] != "write":
        raise ValueError(f"kind {spec['kind']} happens at a write; use phase=write")
    if spec["rank"] < 0 or (world_size is not None and spec["rank"] >= world_size):
        job = f"this job's ranks are 0..{world_size - 1}" if world_size else "ranks count from 0"
        raise ValueError(f"rank {spec['rank']} is no rank of the job ({job})")
    if spec["step"] is not None and spec["step"] < 1:
        raise ValueError(f"step {spec['step']}: steps and writes count from 1")
    if spec["step"] is not None and spec["phase"] == "load":
        raise ValueError("phase load comes once, without steps; drop step")
    return spec


declare({"HPCPAR_FAULT": (Spec("rank=R,phase=P[,step=S][,kind=K] (tests: a fault to inject, "
                                "see hpcpar/jobs/faults.py)", parse_fields), None)})


def parse(text: str, world_size: int | None = None) -> dict:
    """``HPCPAR_FAULT``'s text -> a dict; a malformed one is an ``HpcparError`` naming it."""
    return parse_environment("HPCPAR_FAULT", text, world_size)


_spec: dict | None = None
_loaded = False
_writes = 0                 # write points this process has passed


def check_environment(world_size: int | None = None) -> None:
    """Parse ``HPCPAR_FAULT`` now, so a malformed one (or a rank outside a world of
    ``world_size``) is reported before any work."""
    global _spec, _loaded
    _spec = environment_value("HPCPAR_FAULT", world_size)
    _loaded = True


def fault_point(phase: str, step: int | None = None, path=None) -> None:
    """Fail here if ``HPCPAR_FAULT`` names this rank, phase and step. A write point counts
    its own steps and names the ``path`` being written."""
    global _spec, _writes
    if not _loaded:
        check_environment()
    if phase == "write":
        _writes += 1
        step = _writes
    if _spec is None or _spec["phase"] != phase:
        return
    if _spec["step"] is not None and _spec["step"] != step:
        return
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() != _spec["rank"]:
        return
    if _spec["kind"] == "slow":                    # from here on, every point of the phase
        _spec["step"] = None
        time.sleep(SLOW_SECONDS)
        return
    kind, _spec = _spec["kind"], None              # fire once
    if kind in WRITE_ERRORS:
        code = WRITE_ERRORS[kind]
        raise OSError(code, os.strerror(code), str(path))
    if kind == "raise":
        raise InjectedFault(f"injected fault at {phase}" + (f" step {step}" if step else ""))
    if kind == "exit":
        os._exit(1)
    os.kill(os.getpid(), signal.SIGSTOP if kind == "hang" else signal.SIGKILL)


def _write_point(path) -> None:
    fault_point("write", path=path)


files.WRITE_HOOKS.append(_write_point)     # every write of any layer passes the write point
