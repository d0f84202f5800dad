"""A trace (``--trace``'s Chrome trace JSON) for ``show``: per rank, seconds computing, and
waiting or in collectives outside the compute. A span that is not as hpcpar writes it (no
number for its time or length, no named track, a category or args of another type) is left
out with a note.

A rank keeps up to ``trace.MAX_SPANS`` (250k) spans, so every step here is a sort or a pass:
the spans are grouped by track once, and a span is found inside the compute spans by
bisecting their starts, taken once (``Apart``)."""

from __future__ import annotations

import gc
import json
from bisect import bisect_right
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ...parallel.errors import HpcparError
from .reading import is_count


_NUMBERS, _INF = (int, float), float("inf")


@contextmanager
def _collector_paused():
    """The cyclic garbage collector paused: a full-size trace is a million small dicts, none
    of them garbage, and the collector's passes over them as they are made cost a third of
    the time to parse them (4 ranks of 250k spans: 12.1 s to 10.4 s here)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class Apart(list):
    """Spans none of which lies inside another, sorted by start; ``starts`` for bisecting."""

    def __init__(self, spans):
        super().__init__(spans)
        self.starts = [s["ts"] for s in self]


def read_trace(path: Path) -> tuple[dict, dict[int, str], list[dict]]:
    """A ``--trace`` file's metadata, track names (by pid) and complete events (the ones
    that can be read)."""
    with _collector_paused():
        meta, names, spans, _ = _read(path)
    return meta, names, spans


def _read(path: Path) -> tuple[dict, dict[int, str], list[dict], list[str]]:
    try:
        data = json.loads(path.read_bytes())
        events = data["traceEvents"]
        if not isinstance(events, list):
            raise TypeError(events)
    except (ValueError, KeyError, TypeError):
        raise HpcparError(f"{path}: not a trace hpcpar wrote (Chrome trace JSON with "
                          "traceEvents); show reads the file a job's --trace wrote") from None
    kinds = {"M": [], "X": []}                  # metadata and complete events
    for e in events:
        if type(e) is dict and e.get("ph") in ("M", "X"):     # == only: any JSON value
            kinds[e["ph"]].append(e)
    names = {e["pid"]: str(e["args"]["name"]) for e in kinds["M"] if _names_a_track(e)}
    if not names:
        raise HpcparError(f"{path}: a trace without a named track (no process_name event); "
                          "show reads the file a job's --trace wrote, unchanged")
    complete = kinds["X"]
    spans = [e for e in complete if _readable(e, names)]
    for e in spans:
        e.setdefault("cat", "")
    meta = data.get("otherData")
    notes = []
    if len(spans) < len(complete):
        notes.append(f"{len(complete) - len(spans):,} of {len(complete):,} spans not read: no "
                     "number for their time or length, no named track, or a category or args "
                     "of another type")
    return meta if isinstance(meta, dict) else {}, names, spans, notes


def _names_a_track(e: dict) -> bool:
    return (e.get("name") == "process_name" and is_count(e.get("pid"))
            and isinstance(e.get("args"), dict) and "name" in e["args"])


def _readable(e: dict, names: dict) -> bool:
    """A span as hpcpar writes it: finite numbers for its time and length, an int pid of a
    named track, text for its category. Checked by exact type, inline (a million spans):
    JSON gives exactly int or float, and NaN fails every comparison."""
    ts, dur, pid = e.get("ts"), e.get("dur"), e.get("pid")
    return (type(ts) in _NUMBERS and type(dur) in _NUMBERS and -_INF < ts < _INF
            and 0 <= dur < _INF and type(pid) is int and pid in names
            and type(e.get("cat", "")) is str and type(e.get("args", {})) is dict)


def trace_summary(path: Path) -> dict:
    """Per rank, over its window (from its first compute span to the end of its last):
    seconds computing, and waiting or in collectives outside the compute spans (a
    collective inside a forward pass is part of that pass), each clipped to the window."""
    with _collector_paused():
        meta, names, spans, notes = _read(path)
        tracks: dict[int, list[dict]] = {pid: [] for pid in names}
        for e in spans:
            tracks[e["pid"]].append(e)
        ranks = [_rank(pid, names[pid], tracks[pid]) for pid in sorted(names)]
    dropped = meta.get("dropped_spans", 0)
    if not is_count(dropped):
        notes.append("otherData.dropped_spans (not a count): not read")
        dropped = 0
    return {"kind": "trace", "path": str(path), "job": meta.get("job"),
            "layout": meta.get("layout"), "dropped_spans": dropped,
            "ranks": ranks, "notes": notes}


def _rank(pid: int, track: str, mine: list[dict]) -> dict:
    work = outermost([e for e in mine if e["cat"] == "compute"])
    start = work[0]["ts"] if work else 0.0
    end = max((e["ts"] + e["dur"] for e in work), default=0.0)
    others = outermost([e for e in mine if e["cat"] in ("wait", "comm")])
    ts = np.array(others.starts, dtype=np.float64)
    ends = ts + np.array([e["dur"] for e in others], dtype=np.float64)
    # inside: a span ends within the compute span that starts last at or before it (the
    # vector form of ``inside``)
    i = np.searchsorted(np.array(work.starts, dtype=np.float64), ts, side="right") - 1
    work_ends = np.array([e["ts"] + e["dur"] for e in work] + [-np.inf])   # [-1]: none before
    outside = ~((i >= 0) & (ends <= work_ends[i]))
    clipped = np.maximum(0.0, np.minimum(ends, end) - np.maximum(ts, start))
    cats = np.array([e["cat"] for e in others], dtype=object)
    seconds = {"compute": sum(e["dur"] for e in work) / 1e6}
    for cat in ("wait", "comm"):
        seconds[cat] = float(clipped[outside & (cats == cat)].sum()) / 1e6
    window = (end - start) / 1e6
    return {"rank": pid, "track": track, "window_s": window, "spans": len(mine),
            **{f"{k}_s": v for k, v in seconds.items()},
            "busy": seconds["compute"] / window if window else None}


def outermost(events: list[dict]) -> Apart:
    """The events not inside another of ``events`` (spans of a track nest or are apart),
    sorted by start."""
    out: list[dict] = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if not out or e["ts"] >= out[-1]["ts"] + out[-1]["dur"]:
            out.append(e)
    return Apart(out)


def inside(event: dict, spans: Apart) -> bool:
    """Whether ``event`` lies within one of ``spans`` (``outermost``'s)."""
    i = bisect_right(spans.starts, event["ts"]) - 1
    return i >= 0 and event["ts"] + event["dur"] <= spans[i]["ts"] + spans[i]["dur"]
