"""A scoring output for ``show``: the perplexity, then per row its tokens, nll and perplexity.
A damaged file shows what it still holds, with one note: a missing perplexity is computed
from the rows (as the scoring job computes it), a missing dataset leaves its column empty."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...parallel.errors import HpcparError
from .reading import Cells, attributes, dataset, is_finite, is_number, page_of, real, whole

LAYOUT = ("dp", "pp", "cp", "tp", "ep")


def scores(path: Path, page: int, per_page: int) -> dict:
    import h5py
    problems: list[str] = []
    with h5py.File(path, "r") as f:
        attrs = attributes(f, problems)
        nll = dataset(f, "nll", "numbers", problems)
        scored = dataset(f, "tokens_scored", "integers", problems)
    nll, scored = _same_rows(nll, scored, problems)
    perplexity = _perplexity(attrs.get("perplexity"), nll, scored, problems)
    if nll is None and scored is None and perplexity is None:
        raise HpcparError(f"{path}: a scoring output without its nll, tokens_scored or "
                          "perplexity; nothing to show; score the data again")
    count = len(nll) if nll is not None else len(scored) if scored is not None else 0
    cells = Cells()
    rows = [_row(i, cells.get(nll, i, "nll", real), cells.get(scored, i, "tokens_scored", whole))
            for i in range(count)]
    problems += cells.problems()
    return {"kind": "scores", "path": str(path), "rows_scored": len(rows),
            "tokens_scored": int(scored.sum()) if scored is not None else None,
            "perplexity": perplexity,
            "tokens_per_s": attrs["tokens_per_s"] if is_finite(attrs.get("tokens_per_s"))
            else None,
            "layout": {k: attrs.get(k) for k in LAYOUT if k in attrs},
            **page_of(rows, page, per_page),
            "notes": ["not read: " + "; ".join(problems)] if problems else []}


def _row(index: int, nll: float | None, scored: int | None) -> dict:
    return {"index": index, "tokens_scored": scored, "nll": nll,
            "perplexity": float(np.exp(nll / scored)) if nll is not None and scored else None}


def _same_rows(nll, scored, problems: list[str]):
    """The two datasets over the rows both have (a file cut short holds fewer of one)."""
    if nll is None or scored is None or len(nll) == len(scored):
        return nll, scored
    rows = min(len(nll), len(scored))
    problems.append(f"nll and tokens_scored hold {len(nll)} and {len(scored)} rows: the first "
                    f"{rows} shown")
    return nll[:rows], scored[:rows]


def _perplexity(value, nll, scored, problems: list[str]) -> float | None:
    """The file's perplexity, else exp(total nll / total tokens) of its rows."""
    if is_number(value):                  # NaN included: written when no token was scored
        return value
    what = "missing" if value is None else "not a number"
    if nll is None or scored is None:
        problems.append(f"perplexity ({what})")
        return None
    problems.append(f"perplexity ({what}): computed from the rows")
    total = int(scored.sum())
    return float(np.exp(nll.sum() / total)) if total else float("nan")
