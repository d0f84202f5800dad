"""``summary``'s data laid out for a terminal: a heading line, a table, and a line per note
on what could not be read. A value a damaged file did not give is shown as "-"."""

from __future__ import annotations

from .reading import is_number

TEXT_WIDTH = 72            # characters of a row's text on one line


def format_summary(s: dict) -> str:
    """``summary``'s data laid out for a person."""
    body = {"generation": _generation, "scores": _scores, "training": _training,
            "checkpoint": _checkpoint, "trace": _trace}[s["kind"]](s)
    return "\n".join([body] + [f"note: {note}" for note in s["notes"]])


def _figure(value, spec: str) -> str:
    """A number as ``spec`` formats it; anything else (not read, or not a number) as "-"."""
    return format(value, spec) if is_number(value) else "-"


def _trace(s: dict) -> str:
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


def _one_line(text: str) -> str:
    """``text`` on one line, cut to the width; control characters (a model can write ESC,
    which moves a terminal's cursor) written as escapes."""
    flat = " ".join(text.split()).translate(_ESCAPES)
    return flat if len(flat) <= TEXT_WIDTH else flat[:TEXT_WIDTH - 3] + "..."


# C0, DEL and C1 control characters (whitespace is flattened before) -> \xNN
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7f, 0xa0))}


def _generation(s: dict) -> str:
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(s["finish_reasons"].items()))
    reasons = f" ({reasons})" if reasons else ""
    samples = f", {s['samples']} samples" if "samples" in s else ""
    what = "prompts"
    if "requests" in s:
        what = f"Batch API requests ({s['requests']['failed']} failed)"
    lines = [f"{s['path']}: generation, {s['prompts']} {what}{samples}{reasons}, "
             f"{_figure(s['completion_tokens'], ',')} tokens generated"]
    r = s["report"]
    if r:
        lines.append(f"layout {r.get('layout')}; prefill "
                     f"{_figure(r.get('prefill_tokens_per_s'), ',.0f')} tokens/s, decode "
                     f"{_figure(r.get('decode_tokens_per_s'), ',.1f')} tokens/s")
    lines.append(f"{'#':>5} {'finish':<7} {'prompt':>6} {'new':>5}  text")
    for row in s["rows"]:
        ids = row["token_ids"]
        text = row["text"] if row["text"] is not None else str(ids) if ids is not None else "-"
        index = f"{row['index']}.{row['sample']}" if "sample" in row else row["index"]
        new = row["completion_tokens"] if row["completion_tokens"] is not None else ""
        lines.append(f"{index:>5} {row['finish_reason'] or '-':<7} "
                     f"{_figure(row['prompt_tokens'], ''):>6} {new:>5}  {_one_line(text)}")
    return "\n".join(lines + [_page_line(s)])


def _page_line(s: dict) -> str:
    more = f"; --page {s['page'] + 1} for the next" if s["page"] < s["pages"] else ""
    return f"page {s['page']} of {s['pages']}{more}"


def _scores(s: dict) -> str:
    layout = " x ".join(f"{k} {v}" for k, v in s["layout"].items())
    lines = [f"{s['path']}: scores of {s['rows_scored']} rows, "
             f"{_figure(s['tokens_scored'], ',')} tokens, perplexity "
             f"{_figure(s['perplexity'], '.4f')}" + (f"; {layout}" if layout else ""),
             f"{'#':>5} {'tokens':>7} {'nll':>12} {'perplexity':>11}"]
    for row in s["rows"]:
        lines.append(f"{row['index']:>5} {_figure(row['tokens_scored'], ''):>7} "
                     f"{_figure(row['nll'], '.4f'):>12} {_figure(row['perplexity'], '.3f'):>11}")
    return "\n".join(lines + [_page_line(s)])


def _training(s: dict) -> str:
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


def _checkpoint(s: dict) -> str:
    n = s["parameters"]
    count = f"{n / 1e6:,.1f} M" if n >= 100_000 else f"{n:,}"
    lines = [f"{s['path']}: {s['model_type']} checkpoint, {count} parameters in {s['dtype']} "
             f"({s['bytes'] / 1e6:,.1f} MB)",
             f"{s['layers']} layers, hidden {s['hidden_size']}, {s['heads']} heads / "
             f"{s['kv_heads']} KV heads, vocab {s['vocab_size']}; tokenizer "
             f"{'kept' if s['tokenizer'] else 'none'}"]
    if "experts" in s:
        e = s["experts"]
        lines.append(f"mixture of experts: {e['experts']} experts, top-{e['top_k']}, on "
                     f"{e['moe_layers']} layers")
    if "lora" in s:
        a = s["lora"]
        lines[0] = lines[0].replace(" checkpoint, ", " LoRA adapters, ", 1)
        lines.append(f"LoRA rank {a['rank']}, alpha {a['alpha']:g}, on {','.join(a['targets'])}"
                     f"; base {a['base']} (generate and score with --lora, export --lora or "
                     "--merge-lora)")
    if "training" in s:
        t = s["training"]
        zero = f", ZeRO-{t['zero']}" if t.get("zero") else ""
        lines.append(f"training checkpoint: step {t.get('step')}, {t.get('samples')} samples, "
                     f"{t.get('optimizer')}, trained under {t.get('layout')}{zero}")
    return "\n".join(lines)
