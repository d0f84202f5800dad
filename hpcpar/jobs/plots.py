"""Pictures of a run for ``hpcpar show ... --plot OUT.png`` (matplotlib, an optional extra:
``pip install "hpcpar[plot]"``).

    a training run's folder    loss, learning rate, gradient norm and tokens/s by step
    a trace (--trace's .json)  every rank's timeline: compute coloured by micro-batch, waits
                               on messages, and collectives outside compute, so a pipeline's
                               bubbles and a straggler are seen at a glance
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.files import AtomicPath, check_writable, writing
from ..parallel.errors import HpcparError
from .show import inside, outermost, read_metrics, read_trace

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
          ("tokens_per_s", "tokens/s"))
WAIT_COLOUR, COMM_COLOUR = "#d62728", "#ff9f1c"
# micro-batches: no red or orange, which are the waits' and the collectives'
MICRO_BATCH_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#17becf", "#8c564b", "#7f7f7f",
                       "#bcbd22", "#e377c2", "#aec7e8", "#98df8a")


def plot(source: Path, summary: dict, out: str | Path) -> None:
    """Draw ``summary`` (``show.summary`` of ``source``) into the image ``out``."""
    out = Path(out)
    if out.is_dir():
        raise HpcparError(f"--plot {out}: is a folder; give a file name, e.g. {out / 'plot.png'}")
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise HpcparError(f"--plot {out}: name the picture .png, .svg or .pdf")
    if not out.resolve().parent.is_dir():
        raise HpcparError(f"--plot {out}: the folder {out.parent} does not exist")
    if summary["kind"] not in ("training", "trace"):
        what = "a checkpoint" if summary["kind"] == "checkpoint" else (
            f"a {summary['kind']} output")
        raise HpcparError(f"--plot draws a training run's folder or a trace (--trace's .json); "
                          f"{source} is {what}")
    check_writable(out.resolve().parent)
    pyplot = _pyplot()
    figure = (_training if summary["kind"] == "training" else _timeline)(pyplot, source)
    target = AtomicPath(out)
    try:
        with writing(out):
            figure.savefig(target.tmp, format=out.suffix[1:].lower(), dpi=120)
        target.commit()
    except BaseException:
        target.discard()
        raise
    finally:
        pyplot.close(figure)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise HpcparError('--plot needs matplotlib: pip install "hpcpar[plot]" (or pip install '
                          "matplotlib)") from None
    matplotlib.use("Agg")                     # files only: no display on a cluster node
    from matplotlib import pyplot
    return pyplot


def _training(pyplot, folder: Path):
    metrics = read_metrics(folder)
    if not metrics:
        raise HpcparError(f"{folder}: no steps logged yet (metrics.jsonl is empty); nothing to "
                          "plot")
    figure, axes = pyplot.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for ax, (key, title) in zip(axes.flat, PANELS):
        points = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker="." if len(points) < 50 else None, lw=1.2)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    figure.suptitle(f"{folder.name}: {len(metrics)} steps", fontsize=11)
    figure.tight_layout()
    return figure


def _timeline(pyplot, path: Path):
    meta, names, spans = read_trace(path)
    computes = [e for e in spans if e["cat"] == "compute"]
    if not computes:
        raise HpcparError(f"{path}: the trace holds no compute spans; nothing to draw")
    start = min(e["ts"] for e in computes)
    end = max(e["ts"] + e["dur"] for e in computes)
    pids = sorted(names)
    figure, ax = pyplot.subplots(figsize=(12, 0.5 * len(pids) + 1.6))
    for row, pid in enumerate(pids):
        mine = [e for e in spans if e["pid"] == pid and e["ts"] < end and e["ts"] + e["dur"]
                > start]
        work = [e for e in mine if e["cat"] == "compute"]
        for mb in sorted({e.get("args", {}).get("micro-batch", 0) for e in work}):
            bars = [_bar(e, start) for e in work if e.get("args", {}).get("micro-batch", 0) == mb]
            ax.broken_barh(bars, (row - 0.4, 0.8), lw=0,
                           color=MICRO_BATCH_COLOURS[mb % len(MICRO_BATCH_COLOURS)])
        passes = outermost(work)
        comm = [_bar(e, start) for e in mine if e["cat"] == "comm" and not inside(e, passes)]
        ax.broken_barh(comm, (row - 0.4, 0.8), color=COMM_COLOUR, lw=0)
        waits = [_bar(e, start) for e in mine if e["cat"] == "wait"]
        ax.broken_barh(waits, (row - 0.15, 0.3), color=WAIT_COLOUR, lw=0)
    ax.set_yticks(range(len(pids)), [names[p] for p in pids], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, (end - start) / 1e3)
    ax.set_xlabel("ms from the first compute")
    facts = ", ".join(str(meta[k]) for k in ("job", "layout") if meta.get(k))
    ax.set_title(f"{path.name}" + (f": {facts}" if facts else ""), fontsize=10)
    from matplotlib.patches import Patch
    figure.legend(handles=[Patch(color=MICRO_BATCH_COLOURS[0], label="compute (a colour per "
                                                                     "micro-batch)"),
                           Patch(color=WAIT_COLOUR, label="waiting for a message"),
                           Patch(color=COMM_COLOUR, label="collective outside compute")],
                  loc="lower center", ncol=3, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.5 / figure.get_figheight(), 1, 1))
    return figure


def _bar(event: dict, start: float) -> tuple[float, float]:
    """(start, width) in milliseconds from ``start`` (microseconds)."""
    return (event["ts"] - start) / 1e3, event["dur"] / 1e3
