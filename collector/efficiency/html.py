"""A self-contained HTML report (inline SVG, no scripts, no network): per-rank stacked bars and the
per-step trend of lost time."""
from __future__ import annotations

from html import escape

from gpuwatch.collector.efficiency.partition import CATEGORIES

COLOURS = ("#2e7d32", "#81c784", "#1565c0", "#ef6c00", "#8e24aa", "#fdd835", "#e53935", "#9e9e9e")
_BAR_W, _ROW_H = 640, 22


def html_report(doc: dict) -> str:
    """The report page for an `analyze()` document (with per-step entries for the trend chart)."""
    job = doc["job"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>gpuwatch analyze</title>",
        "<style>body{font-family:sans-serif;margin:2em;color:#222}td,th{padding:2px 8px;text-align:right}"
        "th{background:#eee}.k{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px}</style>",
        "</head><body><h1>Where the GPU time went</h1>",
        f"<p>{job['ranks']} rank(s), window {job['window_us'] / 1e6:.3f} GPU-s, "
        f"compute {100 * job['breakdown_fraction']['compute']:.1f} %, lost {job['lost_gpu_hours']:.4f} GPU-hours"
        f"{_cost(job)}; {doc['matched_collectives']} collective(s) matched across ranks.</p>",
        _legend(), _bars(doc), _trend(doc), _table(doc), _stragglers(doc), "</body></html>",
    ]
    return "".join(parts)


def _cost(job: dict) -> str:
    return "" if job["lost_cost"] is None else f" (cost {job['lost_cost']:.2f})"


def _legend() -> str:
    return "<p>" + "".join(
        f"<span class='k' style='background:{c}'></span>{escape(n)}" for n, c in zip(CATEGORIES, COLOURS)
    ) + "</p>"


def _bars(doc: dict) -> str:
    rows = [("job", doc["job"]["breakdown_fraction"])] + [(f"rank {r['rank']}", r["breakdown_fraction"]) for r in doc["ranks"]]
    height = _ROW_H * len(rows) + 10
    svg = [f"<h2>Breakdown per rank</h2><svg width='{_BAR_W + 90}' height='{height}'>"]
    for i, (label, fractions) in enumerate(rows):
        y, x = 5 + i * _ROW_H, 80.0
        svg.append(f"<text x='0' y='{y + 14}' font-size='12'>{escape(label)}</text>")
        for name, colour in zip(CATEGORIES, COLOURS):
            w = fractions[name] * _BAR_W
            if w > 0:
                svg.append(f"<rect x='{x:.2f}' y='{y}' width='{w:.2f}' height='{_ROW_H - 4}' fill='{colour}'>"
                           f"<title>{escape(label)} {name}: {100 * fractions[name]:.2f} %</title></rect>")
            x += w
    return "".join(svg) + "</svg>"


def _trend(doc: dict) -> str:
    series = [(r["rank"], [s for s in r.get("per_step", []) if s["step"] is not None]) for r in doc["ranks"]]
    series = [(rank, steps) for rank, steps in series if len(steps) >= 2]
    if not series:
        return "<p>(per-step trend: needs two or more steps per rank; run with --per-step)</p>"
    w, h = _BAR_W, 200
    n = max(len(steps) for _, steps in series)
    svg = [f"<h2>Lost fraction per step</h2><svg width='{w + 60}' height='{h + 30}'>",
           f"<line x1='40' y1='{h}' x2='{w + 40}' y2='{h}' stroke='#999'/>",
           f"<text x='0' y='12' font-size='11'>100 %</text><text x='0' y='{h}' font-size='11'>0 %</text>"]
    for k, (rank, steps) in enumerate(series):
        points = " ".join(f"{40 + i * w / max(n - 1, 1):.1f},{h - s['lost_fraction'] * h:.1f}" for i, s in enumerate(steps))
        colour = COLOURS[k % len(COLOURS)]
        svg.append(f"<polyline points='{points}' fill='none' stroke='{colour}' stroke-width='2'>"
                   f"<title>rank {rank}</title></polyline>")
    return "".join(svg) + "</svg>"


def _table(doc: dict) -> str:
    head = "<tr><th>rank</th><th>window ms</th>" + "".join(f"<th>{n}</th>" for n in CATEGORIES) + "</tr>"
    rows = [
        f"<tr><td>{r['rank']}</td><td>{r['window_us'] / 1000:.1f}</td>"
        + "".join(f"<td>{100 * r['breakdown_fraction'][n]:.2f} %</td>" for n in CATEGORIES) + "</tr>"
        for r in doc["ranks"]
    ]
    return "<h2>Table</h2><table>" + head + "".join(rows) + "</table>"


def _stragglers(doc: dict) -> str:
    items = [("straggler", s) for s in doc["stragglers"]] + [("delayed", s) for s in doc["delayed"]]
    if not items:
        return "<p>No stragglers or delayed ranks.</p>"
    return "<h2>Stragglers</h2><ul>" + "".join(
        f"<li>{label} rank {s['rank']}: last at {100 * s['last_share']:.0f} % of {s['collectives']} collectives "
        f"(chance {100 * s['chance_share']:.0f} %), mean lateness {s['mean_lateness_us']:.0f} µs, "
        f"busy {s['busy_per_step_us']:.0f} µs/step vs peers {s['peer_median_busy_per_step_us']:.0f}</li>"
        for label, s in items
    ) + "</ul>"
