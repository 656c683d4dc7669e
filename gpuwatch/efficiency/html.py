"""A self-contained HTML report of an `analyze()` result: inline CSS and SVG, no scripts, no network.

Top to bottom, what a reader needs first: the headline numbers, what was analysed (coverage and window,
in the same words as the text report), where each rank's time went (stragglers marked), how it moved
step by step, what the job would gain without stragglers (the what-if), which kernels take the time and
which are the many small ones, then the full table and the trace's own metadata.
"""
from __future__ import annotations

import math
from html import escape

from gpuwatch.efficiency.partition import CATEGORIES
from gpuwatch.efficiency.result import Analysis
from gpuwatch.efficiency.words import coverage_lines, what_if_lines

COLOURS = ("#2e7d32", "#81c784", "#1565c0", "#ef6c00", "#8e24aa", "#fbc02d", "#e53935", "#9e9e9e")
_W = 760          # width of the plotting area
_LABEL = 110      # room for row labels left of it
_ROW = 24
_CSS = (
    "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#1f2328;background:#f6f8fa}"
    "main{max-width:1000px;margin:0 auto;padding:24px}"
    "h1{font-size:24px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px}"
    "section{background:#fff;border:1px solid #d0d7de;border-radius:8px;padding:16px 20px;margin-bottom:16px}"
    ".cards{display:flex;gap:12px;flex-wrap:wrap;margin:16px 0}"
    ".card{background:#fff;border:1px solid #d0d7de;border-radius:8px;padding:10px 16px;min-width:140px}"
    ".card b{display:block;font-size:22px}.card span{color:#57606a;font-size:12px}"
    ".warn{background:#fff8c5;border-color:#d4a72c}.bad b{color:#cf222e}"
    "table{border-collapse:collapse;font-size:13px;width:100%}td,th{padding:3px 8px;text-align:right;"
    "border-bottom:1px solid #eaeef2}th{background:#f6f8fa}td.n,th.n{text-align:left;max-width:520px;"
    "overflow:hidden;text-overflow:ellipsis;white-space:nowrap}"
    ".k{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;border-radius:2px;vertical-align:-1px}"
    "ul{margin:4px 0;padding-left:20px}p.note{color:#57606a;font-size:13px}svg text{font-family:inherit}"
)


def html_report(doc: Analysis) -> str:
    """The report page (per-step entries in `doc` feed the trend chart)."""
    body = [
        f"<h1>Where the GPU time went</h1><p class='note'>{escape(_subtitle(doc))}</p>",
        _cards(doc),
        _section("What was analysed", _coverage(doc)),
        _section("Breakdown per rank", _legend() + _bars(doc) + _stragglers(doc)),
        _section("Lost time per step", _trend(doc)),
        _section("What-if: the job without stragglers", _what_if(doc)),
        _section("Top kernels", _top_kernels(doc)),
        _section("Breakdown table", _table(doc)),
        _section("Trace metadata", _metadata(doc)),
    ]
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'><title>gpuwatch analyze</title>"
            f"<style>{_CSS}</style></head><body><main>{''.join(body)}</main></body></html>")


def _section(title: str, content: str) -> str:
    return f"<section><h2>{escape(title)}</h2>{content}</section>"


def _subtitle(doc: Analysis) -> str:
    job = doc.job
    return (f"{job.ranks} rank(s), {doc.window.activities} GPU activities, "
            f"{doc.matched_collectives} collective(s) matched across ranks; spec {doc.spec}")


def _cards(doc: Analysis) -> str:
    job, cov, w = doc.job, doc.coverage, doc.what_if
    verdict = doc.straggler_verdict
    cards = [
        ("compute", f"{100 * job.breakdown_fraction['compute']:.1f} %", ""),
        ("lost GPU-hours",
         f"{job.lost_gpu_hours:.4f}" + ("" if job.lost_cost is None else f" ({job.lost_cost:.2f})"), ""),
        ("window (all ranks)", f"{job.window_us / 1e6:.3f} GPU-s", ""),
        ("ranks present", f"{cov.ranks_present} of {cov.world_size or '?'}", "" if cov.complete else "warn"),
        ("stragglers", verdict, {"found": "bad", "undetermined": "warn"}.get(verdict, "")),
    ]
    if w:
        cards.append(("what-if slowdown", f"{w.slowdown:.3f}x", "bad" if w.slowdown > 1.05 else ""))
    return "<div class='cards'>" + "".join(
        f"<div class='card {cls}'><b>{escape(value)}</b><span>{escape(label)}</span></div>"
        for label, value, cls in cards) + "</div>"


def _coverage(doc: Analysis) -> str:
    return "<ul>" + "".join(f"<li>{escape(line)}</li>" for line in coverage_lines(doc)) + "</ul>"


def _legend() -> str:
    return "<p>" + "".join(
        f"<span class='k' style='background:{c}'></span>{escape(n)}" for n, c in zip(CATEGORIES, COLOURS)
    ) + "</p>"


def _bars(doc: Analysis) -> str:
    marked = {s.rank: "straggler" for s in doc.stragglers}
    marked.update({s.rank: "delayed" for s in doc.delayed})
    rows = [("job", doc.job.breakdown_fraction, None)] + [
        (f"rank {r.rank}", r.breakdown_fraction, marked.get(r.rank)) for r in doc.ranks]
    height = _ROW * len(rows) + 34
    svg = [f"<svg width='{_W + _LABEL + 20}' height='{height}' role='img'>"]
    for pct in range(0, 101, 25):
        x = _LABEL + pct / 100 * _W
        svg.append(f"<line x1='{x}' y1='4' x2='{x}' y2='{height - 22}' stroke='#d0d7de'/>"
                   f"<text x='{x}' y='{height - 6}' font-size='11' text-anchor='middle'>{pct} %</text>")
    for i, (label, fractions, mark) in enumerate(rows):
        y, x = 6 + i * _ROW, float(_LABEL)
        colour = "#cf222e" if mark == "straggler" else ("#9a6700" if mark == "delayed" else "#1f2328")
        text = label + (" ★" if mark == "straggler" else (" ◆" if mark == "delayed" else ""))
        svg.append(f"<text x='4' y='{y + 15}' font-size='12' fill='{colour}' font-weight='{600 if mark else 400}'>"
                   f"{escape(text)}</text>")
        for name, fill in zip(CATEGORIES, COLOURS):
            w = fractions[name] * _W
            if w > 0:
                svg.append(f"<rect x='{x:.2f}' y='{y}' width='{w:.2f}' height='{_ROW - 6}' fill='{fill}'>"
                           f"<title>{escape(label)} {name}: {100 * fractions[name]:.2f} %</title></rect>")
            x += w
    note = ("<p class='note'>★ straggler (holds peers back through its own work), ◆ delayed (late, but waiting "
            "on another).</p>") if marked else ""
    return "".join(svg) + "</svg>" + note


def _stragglers(doc: Analysis) -> str:
    items = [("straggler", s) for s in doc.stragglers] + [("delayed", s) for s in doc.delayed]
    if not items:
        return ""
    return "<ul>" + "".join(
        f"<li><b>{label} rank {s.rank}</b>: last at {100 * s.last_share:.0f} % of {s.collectives} collectives "
        f"(chance {100 * s.chance_share:.0f} %), mean lateness {s.mean_lateness_us / 1000:.2f} ms, "
        f"busy {s.busy_per_step_us / 1000:.2f} ms/step vs peers {s.peer_median_busy_per_step_us / 1000:.2f}</li>"
        for label, s in items) + "</ul>"


def _trend(doc: Analysis) -> str:
    series = [(r.rank, [s for s in (r.per_step or []) if s.step is not None]) for r in doc.ranks]
    series = [(rank, steps) for rank, steps in series if steps]
    if not series:
        return "<p class='note'>No step annotations in the analysed window (or run with --per-step).</p>"
    step_ids = sorted({s.step for _, steps in series for s in steps if s.step is not None})
    h, left, bottom = 220, 50, 40
    n = len(step_ids)

    def x_of(step: int) -> float:
        return left + (step_ids.index(step) + 0.5) * _W / n

    top = max(s.lost_fraction for _, steps in series for s in steps)
    y_max = min(1.0, max(0.2, math.ceil((top + 0.02) * 5) / 5))  # a multiple of 20 %: round ticks
    svg = [f"<svg width='{_W + left + 20}' height='{h + bottom}' role='img'>"]
    for k in range(5):
        frac = y_max * k / 4
        y = h - frac / y_max * (h - 10)
        svg.append(f"<line x1='{left}' y1='{y:.1f}' x2='{left + _W}' y2='{y:.1f}' stroke='#eaeef2'/>"
                   f"<text x='{left - 6}' y='{y + 4:.1f}' font-size='11' text-anchor='end'>{100 * frac:.0f} %</text>")
    every = max(1, n // 12)
    for i, step in enumerate(step_ids):
        if i % every == 0:
            svg.append(f"<text x='{x_of(step):.1f}' y='{h + 16}' font-size='11' text-anchor='middle'>{step}</text>")
    svg.append(f"<line x1='{left}' y1='{h}' x2='{left + _W}' y2='{h}' stroke='#57606a'/>"
               f"<text x='{left + _W / 2}' y='{h + 34}' font-size='12' text-anchor='middle'>step</text>")
    for k, (rank, steps) in enumerate(series):
        colour = _PALETTE[k % len(_PALETTE)]
        pts = [(x_of(s.step), h - s.lost_fraction / y_max * (h - 10), s) for s in steps if s.step is not None]
        svg.append(f"<polyline points='{' '.join(f'{x:.1f},{y:.1f}' for x, y, _ in pts)}' fill='none' "
                   f"stroke='{colour}' stroke-width='2'/>")
        svg += [f"<circle cx='{x:.1f}' cy='{y:.1f}' r='3' fill='{colour}'><title>rank {rank} step {s.step}: "
                f"lost {100 * s.lost_fraction:.1f} % of {s.window_us / 1000:.1f} ms</title></circle>"
                for x, y, s in pts]
    legend = "".join(f"<span class='k' style='background:{_PALETTE[k % len(_PALETTE)]}'></span>rank {rank}"
                     for k, (rank, _) in enumerate(series))
    return ("<p class='note'>Share of each step's window not spent computing (lost), per rank.</p>"
            + "".join(svg) + "</svg><p>" + legend + "</p>")


_PALETTE = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#e16f24", "#57606a", "#1b7c83")


def _what_if(doc: Analysis) -> str:
    w = doc.what_if
    if not w:
        return "<p class='note'>No what-if (nothing to replay).</p>"
    text = "<ul>" + "".join(f"<li>{escape(line.strip())}</li>" for line in what_if_lines(w)) + "</ul>"
    rows = [(f"rank {r.rank}", r.slowdown) for r in w.per_rank] + [
        (k.kind, k.slowdown) for k in w.per_op_kind]
    top = max([w.slowdown] + [s for _, s in rows] + [1.0])
    svg = [f"<svg width='{_W + _LABEL + 60}' height='{_ROW * (len(rows) + 1) + 10}' role='img'>"]
    for i, (label, s) in enumerate([("whole job", w.slowdown)] + rows):
        y = 4 + i * _ROW
        width = max(0.0, (s - 1.0)) / max(top - 1.0, 1e-9) * _W
        svg.append(f"<text x='4' y='{y + 14}' font-size='12'>{escape(label)}</text>"
                   f"<rect x='{_LABEL}' y='{y}' width='{width:.1f}' height='{_ROW - 8}' "
                   f"fill='{'#cf222e' if i == 0 else '#0969da'}'/>"
                   f"<text x='{_LABEL + width + 6:.1f}' y='{y + 13}' font-size='12'>{s:.3f}x</text>")
    return (text + "<p class='note'>Slowdown left when only that rank (or op kind) keeps its measured durations and "
            "everything else runs at the job's typical duration (1.000x: no excess).</p>" + "".join(svg) + "</svg>")


def _top_kernels(doc: Analysis) -> str:
    out = []
    for rows, title in ((doc.top_kernels.by_time, "by GPU time"),
                        (doc.top_kernels.by_count, "by count (short = under 10 µs)")):
        head = ("<tr><th class='n'>kernel</th><th>kind</th><th>count</th><th>short</th><th>time ms</th>"
                "<th>mean µs</th></tr>")
        body = "".join(
            f"<tr><td class='n' title='{escape(k.name)}'>{escape(_short(k.name))}</td><td>{k.kind}</td>"
            f"<td>{k.count}</td><td>{k.short_count}</td><td>{k.time_us / 1000:.2f}</td><td>{k.mean_us:.1f}</td></tr>"
            for k in rows)
        out.append(f"<h3>{escape(title)}</h3><table>{head}{body}</table>")
    return "".join(out)


def _short(name: str, limit: int = 90) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"


def _table(doc: Analysis) -> str:
    head = "<tr><th class='n'>rank</th><th>window ms</th>" + "".join(f"<th>{n}</th>" for n in CATEGORIES) + "</tr>"
    rows = [
        f"<tr><td class='n'>{r.rank}</td><td>{r.window_us / 1000:.1f}</td>"
        + "".join(f"<td>{100 * r.breakdown_fraction[n]:.2f} %</td>" for n in CATEGORIES) + "</tr>"
        for r in doc.ranks
    ]
    return "<table>" + head + "".join(rows) + "</table>"


def _metadata(doc: Analysis) -> str:
    meta = dict(doc.trace_meta)
    meta["sources"] = ", ".join(r.source for r in doc.ranks)
    return "<table>" + "".join(
        f"<tr><th class='n'>{escape(str(k))}</th><td class='n'>{escape(str(v))}</td></tr>" for k, v in meta.items()
    ) + "</table>"
