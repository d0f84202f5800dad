"""Fault injection for tests: ``HPCPAR_FAULT=rank=2,phase=decode,step=5,kind=raise`` makes
world rank 2 fail at decode step 5.

    rank    the world rank that fails (required)
    phase   load | prefill | decode | train | score | write (required); the points the
            jobs call ``fault_point`` at: before reading the checkpoint, before a wave's
            prefill, before each decode step, before each training step, before each scoring
            micro-batch, and inside every write of an output, partial, checkpoint or metrics
            file (``outputs.write_point``)
    step    decode step (1-based), training step, scoring micro-batch, or the rank's n-th
            write (1-based); absent: the first time the phase comes
    kind    raise (an exception: the normal error path), exit (the process ends with status
            1 without a word, as a crash would), kill (SIGKILL to itself; for both, the
            rank's keeper, ``supervisor``, names it), hang (SIGSTOP to itself: the other
            ranks' watchdog, --timeout, must end the job), slow (a straggler: the rank
            sleeps ``SLOW_SECONDS`` at this point and at every later point of the phase;
            the job must finish as without it); at a write also enospc, eio, erofs (the
            write fails with that system error, as on a full disk, a failing or a
            read-only file system)

Unset, ``fault_point`` costs one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal
import time

from .errors import HpcparError

PHASES = ("load", "prefill", "decode", "train", "score", "write")
WRITE_ERRORS = {"enospc": errno.ENOSPC, "eio": errno.EIO, "erofs": errno.EROFS}
KINDS = ("raise", "exit", "kill", "hang", "slow", *WRITE_ERRORS)
SLOW_SECONDS = 0.1


class InjectedFault(RuntimeError):
    """The failure ``HPCPAR_FAULT`` asked for (a bug-like error, not bad input)."""


def parse(text: str) -> dict:
    """``rank=R,phase=P[,step=S][,kind=K]`` -> a dict; a malformed value is an error."""
    spec = {"kind": "raise", "step": None}
    try:
        for item in text.split(","):
            key, _, value = item.partition("=")
            key = key.strip()
            if key in ("rank", "step"):
                spec[key] = int(value)
            elif key in ("phase", "kind"):
                spec[key] = value.strip()
            else:
                raise ValueError(f"unknown key {key!r}")
    except ValueError as e:
        raise HpcparError(f"HPCPAR_FAULT={text!r}: {e}; expected "
                          f"rank=R,phase=P[,step=S][,kind={'|'.join(KINDS)}]") from None
    if "rank" not in spec or spec.get("phase") not in PHASES or spec["kind"] not in KINDS:
        raise HpcparError(f"HPCPAR_FAULT={text!r}: needs rank=R and phase one of "
                          f"{', '.join(PHASES)}; kind is one of {', '.join(KINDS)}")
    if spec["kind"] in WRITE_ERRORS and spec["phase"] != "write":
        raise HpcparError(f"HPCPAR_FAULT={text!r}: kind {spec['kind']} happens at a write; "
                          "use phase=write")
    return spec


_spec: dict | None = None
_loaded = False
_writes = 0                 # write points this process has passed


def check_environment() -> None:
    """Parse ``HPCPAR_FAULT`` now, so a malformed one is reported before any work."""
    global _spec, _loaded
    text = os.environ.get("HPCPAR_FAULT")
    _spec = parse(text) if text else None
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
