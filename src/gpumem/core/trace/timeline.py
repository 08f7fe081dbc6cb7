"""The cell's allocation timeline: bytes over time, stacked by site, as one small inline SVG.

A long cell has 100,000 events; the SVG keeps at most ``columns`` slices of time, each drawn at its
highest moment and at its last one, so no peak is smoothed away and the page stays small. Bands are
the top sites by the most bytes each held at once, then "other", with "before the cell" at the
bottom. Hover needs no network: every band has an SVG ``<title>``, and a few lines of inline script
show the bytes of each band at the moment under the pointer.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass

from gpumem.core.trace.analysis import BEFORE, DeviceTrace
from gpumem.core.units import format_bytes

__all__ = ["Timeline", "build_timeline", "render_svg"]

PALETTE = (
    "#9ca3af", "#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626",
    "#0891b2", "#ca8a04", "#db2777", "#4f46e5", "#65a30d", "#cbd5e1",
)  # fmt: skip
_WIDTH, _HEIGHT, _LEFT, _RIGHT, _TOP, _BOTTOM = 720, 210, 70, 12, 14, 26


@dataclass
class Timeline:
    """Decimated points: ``times[i]`` (µs from the first event) and ``values[i][band]`` bytes."""

    labels: list[str]  # band 0 is "before the cell", the last "other" when there are more sites
    times: list[float]
    values: list[list[int]]
    band_max: list[int]
    peak_bytes: int
    peak_time: float | None  # µs from the first event


def _top_sites(trace: DeviceTrace, bands: int) -> list[int]:
    live = [0] * len(trace.sites)
    most = [0] * len(trace.sites)
    for event in trace.events:
        if event.site != BEFORE:
            live[event.site] += event.delta
            most[event.site] = max(most[event.site], live[event.site])
    ranked = sorted(range(len(trace.sites)), key=lambda site: -most[site])
    return [site for site in ranked[:bands] if most[site] > 0]


def build_timeline(trace: DeviceTrace, *, columns: int = 360, bands: int = 8) -> Timeline:
    """Decimate ``trace``'s events into at most ``2 * columns + 1`` points of ``bands`` (+2) bands."""
    top = _top_sites(trace, bands)
    band_of = {site: position + 1 for position, site in enumerate(top)}
    other = len(top) + 1 if len(top) < len(trace.sites) else None
    labels = ["before the cell", *(trace.sites[site].label for site in top)] + (["other"] if other else [])
    state = [0] * len(labels)
    state[0] = trace.start_bytes
    origin = trace.first_time or 0.0
    span = max((trace.last_time or origin) - origin, 1e-9)
    times, values = [0.0], [list(state)]
    column, best, best_state, best_time, total = -1, -1, state, 0.0, trace.start_bytes

    def close() -> None:
        if column >= 0:
            times.append(best_time - origin)
            values.append(best_state)
            if best_state != state:
                times.append(last_time - origin)
                values.append(list(state))

    last_time = origin
    for event in trace.events:
        here = min(int((event.time - origin) / span * columns), columns - 1)
        if here != column:
            close()
            column, best = here, -1
        band = 0 if event.site == BEFORE else band_of.get(event.site, other or 0)
        state[band] += event.delta
        total += event.delta
        last_time = event.time
        if total > best:
            best, best_state, best_time = total, list(state), event.time
    close()
    band_max = [max(point[band] for point in values) for band in range(len(labels))]
    peak_time = None if trace.peak_time is None else trace.peak_time - origin
    return Timeline(labels, times, values, band_max, trace.peak_bytes, peak_time)


def _duration(microseconds: float) -> str:
    seconds = microseconds / 1e6
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def render_svg(timeline: Timeline, element_id: str) -> str:
    """The stacked-area SVG and its hover script, self-contained (no external resource)."""
    plot_w, plot_h = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM
    span = max(timeline.times[-1], 1e-9) if timeline.times else 1.0
    top = max(max((sum(point) for point in timeline.values), default=0), timeline.peak_bytes, 1)
    xs = [round(_LEFT + time / span * plot_w, 1) for time in timeline.times]

    def y(value: float) -> float:
        return round(_TOP + plot_h - value / top * plot_h, 1)

    parts = [
        (
            f'<svg id="{element_id}" xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
            f'viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" style="font:11px sans-serif;max-width:100%">'
        ),
        f"<title>GPU memory allocated during the cell, by site; peak {format_bytes(timeline.peak_bytes)}</title>",
    ]
    lower = [0] * len(xs)
    for band, label in enumerate(timeline.labels):
        upper = [below + point[band] for below, point in zip(lower, timeline.values, strict=True)]
        if timeline.band_max[band] > 0:
            top_edge = " ".join(f"{x},{y(value)}" for x, value in zip(xs, upper, strict=True))
            bottom_edge = " ".join(f"{x},{y(value)}" for x, value in zip(reversed(xs), reversed(lower), strict=True))
            color = PALETTE[band % len(PALETTE)]
            tip = f"{label}: at most {format_bytes(timeline.band_max[band])} at once"
            parts.append(
                f'<polygon class="band" data-band="{band}" points="{top_edge} {bottom_edge}" fill="{color}" '
                f'fill-opacity="0.85"><title>{html.escape(tip)}</title></polygon>'
            )
        lower = upper
    parts.extend(_axes(timeline, span, top, y))
    parts.append("</svg>")
    return "".join(parts) + _hover_script(timeline, element_id, xs)


def _axes(timeline: Timeline, span: float, top: float, y: object) -> list[str]:
    assert callable(y)
    plot_w = _WIDTH - _LEFT - _RIGHT
    base = y(0)
    parts = [
        f'<line x1="{_LEFT}" y1="{base}" x2="{_WIDTH - _RIGHT}" y2="{base}" stroke="#6b7280"/>',
        f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{base}" stroke="#6b7280"/>',
        f'<text x="{_LEFT - 4}" y="{y(top) + 4}" text-anchor="end">{format_bytes(top)}</text>',
        f'<text x="{_LEFT - 4}" y="{base}" text-anchor="end">0 B</text>',
        f'<text x="{_LEFT}" y="{_HEIGHT - 8}">0</text>',
        f'<text x="{_WIDTH - _RIGHT}" y="{_HEIGHT - 8}" text-anchor="end">{_duration(span)}</text>',
    ]
    if timeline.peak_time is not None:
        x = round(_LEFT + timeline.peak_time / span * plot_w, 1)
        text = f"peak {format_bytes(timeline.peak_bytes)} at {_duration(timeline.peak_time)}"
        parts.append(
            f'<line class="peak" x1="{x}" y1="{_TOP}" x2="{x}" y2="{base}" stroke="#111827" stroke-dasharray="4 3">'
            f"<title>{text}</title></line>"
            f'<text x="{min(x + 3, _WIDTH - 150)}" y="{_TOP + 8}">{text}</text>'
        )
    return parts


_SCRIPT = """<div id="%(id)s-tip" style="position:absolute;display:none;pointer-events:none;background:#fff;
border:1px solid #9ca3af;padding:4px 6px;font:12px sans-serif;white-space:nowrap;z-index:10"></div>
<script>(function(){var d=%(data)s;var s=document.getElementById("%(id)s");
var t=document.getElementById("%(id)s-tip");if(!s||!t)return;
function f(b){var u=["B","KiB","MiB","GiB","TiB"],i=0;while(b>=1024&&i<4){b/=1024;i++;}
return i?b.toFixed(1)+" "+u[i]:b+" B";}
function e(x){return x.replace(/&/g,"&amp;").replace(/</g,"&lt;");}
s.addEventListener("mousemove",function(v){var r=s.getBoundingClientRect();
var x=(v.clientX-r.left)*d.w/r.width,k=0;for(var i=0;i<d.x.length;i++){if(d.x[i]<=x)k=i;}
var p=d.v[k],sum=0,rows=[];for(var b=p.length-1;b>=0;b--){sum+=p[b];
if(p[b]>0)rows.push(e(d.l[b])+": "+f(p[b]));}
t.innerHTML="<b>"+(d.t[k]/1e3).toFixed(1)+" ms: "+f(sum)+"</b><br>"+rows.join("<br>");
t.style.display="block";t.style.left=(v.pageX+12)+"px";t.style.top=(v.pageY+12)+"px";});
s.addEventListener("mouseleave",function(){t.style.display="none";});})();</script>"""


def _hover_script(timeline: Timeline, element_id: str, xs: list[float]) -> str:
    data = {
        "w": _WIDTH,
        "x": xs,
        "t": [round(time) for time in timeline.times],
        "v": timeline.values,
        "l": timeline.labels,
    }
    text = json.dumps(data, separators=(",", ":"))
    text = text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")  # inert inside <script>
    return _SCRIPT % {"id": element_id, "data": text}
