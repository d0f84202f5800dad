"""``hpcpar show OUT``: what a person wants first from anything hpcpar writes, without h5py.

    generation output (.h5 or .jsonl)   per prompt: finish reason, token counts, the text
                                        (a page at a time); the run's report
    scoring output (.h5)                perplexity, tokens scored; per row: nll, tokens
    training run folder                 the newest checkpoint, the last steps' metrics
    checkpoint (.h5)                    family, shape, parameters, dtype, size, step
    trace (--trace's .json)             per rank: time computing, waiting and in collectives

``summary(path)`` gathers it as plain data (what ``--json`` prints); ``format_summary`` lays
it out for a terminal. Reading only: nothing is written, and a file that is none of these is
one error naming what ``show`` reads.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from pathlib import Path

import numpy as np

from ..checkpoint.files import is_generation_line, output_kind
from ..parallel.errors import HpcparError

PAGE = 20                  # rows per page
TEXT_WIDTH = 72            # characters of a row's text on one line
METRIC_STEPS = 10          # the last steps of a training run shown


def summary(path: str | Path, page: int = 1, per_page: int = PAGE) -> dict:
    """The summary of ``path`` as plain data, rows ``page`` (from 1) of ``per_page``."""
    path = Path(path)
    if not path.exists():
        raise HpcparError(f"{path}: no such file or folder")
    if path.is_dir():
        return _training_run(path)
    if path.suffix.lower() == ".json":
        return _trace(path)
    kind = output_kind(path)
    if kind == "checkpoint":
        return _checkpoint(path)
    if kind == "generation":
        return (_generation_jsonl(path, page, per_page) if path.suffix.lower() == ".jsonl"
                else _generation_h5(path, page, per_page))
    if kind == "scores":
        return _scores(path, page, per_page)
    raise HpcparError(f"{path}: not an hpcpar output; show reads a generation output (.h5 or "
                      ".jsonl), a scoring output, a training run's folder, a checkpoint or a "
                      "trace (.json)")


def _page(rows: list[dict], page: int, per_page: int) -> dict:
    pages = max(1, -(-len(rows) // per_page))
    if not 1 <= page <= pages:
        raise HpcparError(f"--page {page}: there are {pages} page(s) of {per_page} rows")
    return {"page": page, "pages": pages, "rows": rows[(page - 1) * per_page:page * per_page]}


def _plain(value):
    """An HDF5 attribute as JSON data."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _generation_h5(path: Path, page: int, per_page: int) -> dict:
    import h5py
    with h5py.File(path, "r") as f:
        attrs = {k: _plain(v) for k, v in f.attrs.items()}
        lengths = f["lengths"][()]
        reasons = [_plain(r) for r in f["finish_reason"][()]]
        prompt_lengths = f["prompt_lengths"][()] if "prompt_lengths" in f else None
        texts = [_plain(t) for t in f["text"][()]] if "text" in f else None
        tokens = f["tokens"][()]
        samples = f["samples"][()] if "samples" in f else None   # a sample axis: n > 1
    rows = []
    for i in range(len(lengths)):
        prompt = {"index": i,
                  "prompt_tokens": int(prompt_lengths[i]) if prompt_lengths is not None
                  else None}
        for s in range(1 if samples is None else int(samples[i])):
            at = i if samples is None else (i, s)
            rows.append(prompt | ({} if samples is None else {"sample": s}) | {
                "finish_reason": _plain(reasons[at] if samples is None else reasons[i][s]),
                "completion_tokens": int(lengths[at]),
                "text": (texts[at] if samples is None else texts[i][s]) if texts is not None
                else None,
                "token_ids": tokens[at][:lengths[at]].tolist()})
    report = {k[len("report_"):]: v for k, v in attrs.items() if k.startswith("report_")}
    return {"kind": "generation", "path": str(path), "prompts": len(lengths),
            **({} if samples is None else {"samples": len(rows)}),
            "finish_reasons": _counts([r["finish_reason"] for r in rows]),
            "completion_tokens": int(lengths.sum()),
            "report": report, **_page(rows, page, per_page)}


def _generation_jsonl(path: Path, page: int, per_page: int) -> dict:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            try:
                row = json.loads(line)
            except ValueError:
                raise HpcparError(f"{path}:{n}: not a JSON line (a run still writing it "
                                  "leaves its last line whole)") from None
            if not is_generation_line(row):
                raise HpcparError(f"{path}:{n}: not a line of hpcpar's generation output")
            rows.append(row)
    if rows and "custom_id" in rows[0]:
        return _batch_output(path, rows, page, per_page)
    rows.sort(key=lambda r: (r["index"], r.get("sample", 0)))
    sampled = any("sample" in r for r in rows)
    return {"kind": "generation", "path": str(path),
            "prompts": len({r["index"] for r in rows}),
            **({"samples": len(rows)} if sampled else {}),
            "finish_reasons": _counts([r["finish_reason"] for r in rows]),
            "completion_tokens": sum(r["completion_tokens"] for r in rows), "report": {},
            **_page(rows, page, per_page)}


def _batch_output(path: Path, lines: list[dict], page: int, per_page: int) -> dict:
    """A Batch API output file: a row per choice of each request (its custom_id as the
    index), a request's error as its one row."""
    rows = []
    for line in lines:
        if line.get("error") is not None or not line.get("response"):
            message = (line.get("error") or {}).get("message", "no response")
            rows.append({"index": line["custom_id"], "finish_reason": "error",
                         "prompt_tokens": None, "completion_tokens": 0, "text": message,
                         "token_ids": []})
            continue
        body = line["response"]["body"]
        choices = body["choices"]
        for choice in choices:
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            rows.append({"index": line["custom_id"],
                         **({"sample": choice["index"]} if len(choices) > 1 else {}),
                         "finish_reason": choice["finish_reason"],
                         "prompt_tokens": body["usage"]["prompt_tokens"],
                         "completion_tokens": None, "text": text, "token_ids": []})
        rows[-1]["completion_tokens"] = body["usage"]["completion_tokens"]
    failed = sum(1 for line in lines if line.get("error") is not None)
    return {"kind": "generation", "path": str(path), "prompts": len(lines),
            "requests": {"served": len(lines) - failed, "failed": failed},
            "finish_reasons": _counts([r["finish_reason"] for r in rows]),
            "completion_tokens": sum(line["response"]["body"]["usage"]["completion_tokens"]
                                     for line in lines if line.get("response")),
            "report": {}, **_page(rows, page, per_page)}


def _counts(values: list[str]) -> dict:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _scores(path: Path, page: int, per_page: int) -> dict:
    import h5py
    with h5py.File(path, "r") as f:
        attrs = {k: _plain(v) for k, v in f.attrs.items()}
        nll, scored = f["nll"][()], f["tokens_scored"][()]
    rows = [{"index": i, "tokens_scored": int(n), "nll": float(v),
             "perplexity": float(np.exp(v / n)) if n else None}
            for i, (v, n) in enumerate(zip(nll, scored))]
    return {"kind": "scores", "path": str(path), "rows_scored": len(rows),
            "tokens_scored": int(scored.sum()), "perplexity": attrs.get("perplexity"),
            "tokens_per_s": attrs.get("tokens_per_s"),
            "layout": {k: attrs.get(k) for k in ("dp", "pp", "cp", "tp", "ep") if k in attrs},
            **_page(rows, page, per_page)}


def _checkpoint(path: Path) -> dict:
    from ..checkpoint import open_checkpoint
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    params = sum(int(np.prod(s.shape)) for s in ckpt.tensors.values())
    out = {"kind": "checkpoint", "path": str(path), "model_type": cfg.model_type,
           "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
           "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
           "vocab_size": cfg.vocab_size, "parameters": params, "dtype": str(ckpt.dtype),
           "bytes": path.stat().st_size,
           "tokenizer": "tokenizer.json" in ckpt.tokenizer_files()}
    if cfg.moe_layers:
        out["experts"] = {"experts": cfg.num_experts, "top_k": cfg.experts_per_token,
                          "moe_layers": len(cfg.moe_layers)}
    import h5py
    with h5py.File(path, "r") as f:
        if "train" in f:
            train = {k: _plain(v) for k, v in f["train"].attrs.items()}
            out["training"] = {k: train[k] for k in ("step", "samples", "optimizer", "layout")
                               if k in train}
    return out


def read_metrics(folder: Path) -> list[dict]:
    """A training run's ``metrics.jsonl``, a dict per step logged (none: no file yet)."""
    path, metrics = folder / "metrics.jsonl", []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                metrics.append(json.loads(line))
            except ValueError:
                continue                        # a line a stopped run left torn
    return metrics


def _training_run(folder: Path) -> dict:
    metrics_path = folder / "metrics.jsonl"
    latest = folder / "latest"
    if not metrics_path.exists() and not latest.exists():
        raise HpcparError(f"{folder}: a folder, but not a training run's (no metrics.jsonl or "
                          "latest); show reads a run folder, an output file or a checkpoint")
    metrics = read_metrics(folder)
    newest = None
    if latest.exists():
        newest = folder / latest.read_text(encoding="utf-8").strip()
    report = folder / "report.json"
    return {"kind": "training", "path": str(folder), "steps_logged": len(metrics),
            "latest_checkpoint": str(newest) if newest else None,
            "latest_checkpoint_exists": bool(newest and newest.is_file()),
            "checkpoints": sorted((p.name for p in folder.glob("step-*.h5")), key=_step_of),
            "last_steps": metrics[-METRIC_STEPS:],
            "report": json.loads(report.read_text()) if report.exists() else None}


def read_trace(path: Path) -> tuple[dict, dict[int, str], list[dict]]:
    """A ``--trace`` file's metadata, track names (by pid) and complete events."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        events = data["traceEvents"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise HpcparError(f"{path}: not a trace hpcpar wrote (Chrome trace JSON with "
                          "traceEvents); show reads the file a job's --trace wrote") from None
    try:
        names = {e["pid"]: str(e["args"]["name"]) for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
        spans = [e for e in events if e.get("ph") == "X"]
        for e in spans:
            if not (_number(e["ts"]) and _number(e["dur"]) and e["pid"] in names):
                raise ValueError
            e.setdefault("cat", "")
    except (KeyError, TypeError, ValueError, AttributeError):
        raise HpcparError(f"{path}: a trace event without a number for its time or length, "
                          "or of no named track; show reads the file a job's --trace wrote, "
                          "unchanged") from None
    meta = data.get("otherData")
    return meta if isinstance(meta, dict) else {}, names, spans


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        np.isfinite(value)


def _trace(path: Path) -> dict:
    """Per rank, over its window (from its first compute span to the end of its last):
    seconds computing, and waiting or in collectives outside the compute spans (a
    collective inside a forward pass is part of that pass), each clipped to the window."""
    meta, names, spans = read_trace(path)
    ranks = []
    for pid in sorted(names):
        mine = [e for e in spans if e["pid"] == pid]
        work = outermost([e for e in mine if e["cat"] == "compute"])
        start = min((e["ts"] for e in work), default=0.0)
        end = max((e["ts"] + e["dur"] for e in work), default=0.0)
        outside = [e for e in outermost([e for e in mine if e["cat"] in ("wait", "comm")])
                   if not inside(e, work)]
        seconds = {"compute": sum(e["dur"] for e in work) / 1e6}
        for cat in ("wait", "comm"):
            seconds[cat] = sum(max(0.0, min(e["ts"] + e["dur"], end) - max(e["ts"], start))
                               for e in outside if e["cat"] == cat) / 1e6
        window = (end - start) / 1e6
        ranks.append({"rank": pid, "track": names[pid], "window_s": window,
                      "spans": len(mine), **{f"{k}_s": v for k, v in seconds.items()},
                      "busy": seconds["compute"] / window if window else None})
    return {"kind": "trace", "path": str(path), "job": meta.get("job"),
            "layout": meta.get("layout"), "dropped_spans": meta.get("dropped_spans", 0),
            "ranks": ranks}


def outermost(events: list[dict]) -> list[dict]:
    """The events not inside another of ``events`` (spans of a track nest or are apart),
    sorted by start."""
    out: list[dict] = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if not out or e["ts"] >= out[-1]["ts"] + out[-1]["dur"]:
            out.append(e)
    return out


def inside(event: dict, spans: list[dict]) -> bool:
    """Whether ``event`` lies within one of ``spans`` (sorted, apart)."""
    i = bisect_right([s["ts"] for s in spans], event["ts"]) - 1
    return i >= 0 and event["ts"] + event["dur"] <= spans[i]["ts"] + spans[i]["dur"]


def _step_of(name: str) -> tuple:
    """``step-300.h5`` -> (300, name): checkpoints in step order, not the names' order."""
    number = name[len("step-"):-len(".h5")]
    return (int(number), name) if number.isdigit() else (float("inf"), name)


def format_summary(s: dict) -> str:
    """``summary``'s data laid out for a person."""
    return {"generation": _format_generation, "scores": _format_scores,
            "training": _format_training, "checkpoint": _format_checkpoint,
            "trace": _format_trace}[s["kind"]](s)


def _format_trace(s: dict) -> str:
    width = max([28] + [len(r["track"]) for r in s["ranks"]])
    of = f"a {s['job']} job's trace" if s["job"] else "a trace"
    layout = f", {s['layout']}" if s["layout"] else ""
    lines = [f"{s['path']}: {of}, {len(s['ranks'])} ranks{layout}"
             + (f"; {s['dropped_spans']:,} spans not kept" if s["dropped_spans"] else ""),
             f"{'track':<{width}} {'window s':>9} {'compute s':>10} {'busy':>6} "
             f"{'waits s':>8} {'collectives s':>14}"]
    for r in s["ranks"]:
        busy = f"{100 * r['busy']:.0f}%" if r["busy"] is not None else "-"
        lines.append(f"{r['track']:<{width}} {r['window_s']:>9.3f} {r['compute_s']:>10.3f} "
                     f"{busy:>6} {r['wait_s']:>8.3f} {r['comm_s']:>14.3f}")
    lines.append("window: a rank's first compute to its last; busy: compute over the window; "
                 "waits and collectives: outside compute, in the window. ui.perfetto.dev opens "
                 "the file as a timeline")
    return "\n".join(lines)


def _one_line(text: str | None) -> str:
    if text is None:
        return ""
    flat = " ".join(text.split())
    return flat if len(flat) <= TEXT_WIDTH else flat[:TEXT_WIDTH - 3] + "..."


def _format_generation(s: dict) -> str:
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(s["finish_reasons"].items()))
    samples = f", {s['samples']} samples" if "samples" in s else ""
    what = "prompts"
    if "requests" in s:
        what = f"Batch API requests ({s['requests']['failed']} failed)"
    lines = [f"{s['path']}: generation, {s['prompts']} {what}{samples} ({reasons}), "
             f"{s['completion_tokens']:,} tokens generated"]
    r = s["report"]
    if r:
        lines.append(f"layout {r.get('layout')}; prefill {r.get('prefill_tokens_per_s', 0):,.0f} "
                     f"tokens/s, decode {r.get('decode_tokens_per_s', 0):,.1f} tokens/s")
    lines.append(f"{'#':>5} {'finish':<7} {'prompt':>6} {'new':>5}  text")
    for row in s["rows"]:
        text = row["text"] if row["text"] is not None else str(row["token_ids"])
        prompt = row["prompt_tokens"] if row["prompt_tokens"] is not None else "-"
        index = f"{row['index']}.{row['sample']}" if "sample" in row else row["index"]
        new = row["completion_tokens"] if row["completion_tokens"] is not None else ""
        lines.append(f"{index:>5} {row['finish_reason']:<7} {prompt:>6} "
                     f"{new:>5}  {_one_line(text)}")
    return "\n".join(lines + [_page_line(s)])


def _page_line(s: dict) -> str:
    more = f"; --page {s['page'] + 1} for the next" if s["page"] < s["pages"] else ""
    return f"page {s['page']} of {s['pages']}{more}"


def _format_scores(s: dict) -> str:
    layout = " x ".join(f"{k} {v}" for k, v in s["layout"].items())
    lines = [f"{s['path']}: scores of {s['rows_scored']} rows, {s['tokens_scored']:,} tokens, "
             f"perplexity {s['perplexity']:.4f}" + (f"; {layout}" if layout else ""),
             f"{'#':>5} {'tokens':>7} {'nll':>12} {'perplexity':>11}"]
    for row in s["rows"]:
        ppl = f"{row['perplexity']:.3f}" if row["perplexity"] is not None else "-"
        lines.append(f"{row['index']:>5} {row['tokens_scored']:>7} {row['nll']:>12.4f} "
                     f"{ppl:>11}")
    return "\n".join(lines + [_page_line(s)])


def _format_training(s: dict) -> str:
    latest = s["latest_checkpoint"] or "none"
    if s["latest_checkpoint"] and not s["latest_checkpoint_exists"]:
        latest += " (named by latest, but missing)"
    lines = [f"{s['path']}: training run, {s['steps_logged']} steps logged; latest checkpoint "
             f"{latest}"]
    steps = s["last_steps"]
    if steps:
        lines.append(f"{'step':>6} {'loss':>10} {'grad norm':>10} {'lr':>10} {'tokens/s':>10}")
        for m in steps:
            norm = f"{m['grad_norm']:.4f}" if m.get("grad_norm") is not None else "skipped"
            lines.append(f"{m['step']:>6} {m['loss']:>10.4f} {norm:>10} {m['lr']:>10.3g} "
                         f"{m['tokens_per_s']:>10,.0f}")
    return "\n".join(lines)


def _format_checkpoint(s: dict) -> str:
    lines = [f"{s['path']}: {s['model_type']} checkpoint, {s['parameters'] / 1e6:,.1f} M "
             f"parameters in {s['dtype']} ({s['bytes'] / 1e6:,.1f} MB)",
             f"{s['layers']} layers, hidden {s['hidden_size']}, {s['heads']} heads / "
             f"{s['kv_heads']} KV heads, vocab {s['vocab_size']}; tokenizer "
             f"{'kept' if s['tokenizer'] else 'none'}"]
    if "experts" in s:
        e = s["experts"]
        lines.append(f"mixture of experts: {e['experts']} experts, top-{e['top_k']}, on "
                     f"{e['moe_layers']} layers")
    if "training" in s:
        t = s["training"]
        lines.append(f"training checkpoint: step {t.get('step')}, {t.get('samples')} samples, "
                     f"{t.get('optimizer')}, trained under {t.get('layout')}")
    return "\n".join(lines)
