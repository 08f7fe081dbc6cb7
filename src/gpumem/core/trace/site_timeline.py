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
from typing import Any

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


class _Events:
    """A trace's event lists as arrays, each converted once per timeline (a conversion costs as much as a
    pass over the events)."""

    def __init__(self, trace: DeviceTrace) -> None:
        import numpy as np

        made = trace.arrays  # the analysis's own arrays, while the lists are still the ones made from them
        if made and made[0] is trace.deltas and made[2] is trace.owners:
            self.deltas, self.owners = made[1], made[3].astype(np.intp, copy=False)
            return
        self.deltas = _integers(trace.deltas)  # None: not all int64
        self.owners = np.asarray(trace.owners, dtype=np.intp)


def _top_sites(trace: DeviceTrace, bands: int, events: _Events) -> list[int]:
    """The ``bands`` sites that held the most bytes at once (sites that never held any left out)."""
    most = _most_at_once(trace, events)
    ranked = sorted(range(len(trace.sites)), key=lambda site: -most[site])
    return [site for site in ranked[:bands] if most[site] > 0]


def _most_at_once(trace: DeviceTrace, events: _Events) -> list[int]:
    """Per site, the most bytes it held at once (at least 0), from cumulative sums grouped by site."""
    import numpy as np

    most = [0] * len(trace.sites)
    deltas = events.deltas
    if deltas is None:  # sizes that are not plain integers: summed as Python does
        live = [0] * len(trace.sites)
        for site, delta in zip(trace.owners, trace.deltas, strict=True):
            if site != BEFORE:
                live[site] += delta
                most[site] = max(most[site], live[site])
        return most
    owners = events.owners
    mask = owners != BEFORE
    keys = owners[mask]
    order = np.argsort(keys.astype(np.int16) if len(trace.sites) < 1 << 15 else keys, kind="stable")  # int16: radix
    grouped, sizes = owners[mask][order], deltas[mask][order]
    if not len(grouped):
        return most
    held = np.cumsum(sizes)
    starts = np.flatnonzero(np.diff(grouped, prepend=grouped[0] - 1))
    held -= np.repeat(held[starts] - sizes[starts], np.diff(starts, append=len(grouped)))  # per site from 0
    for site, value in zip(grouped[starts].tolist(), np.maximum.reduceat(held, starts).tolist(), strict=True):
        most[site] = max(value, 0)
    return most


def _integers(values: list[int]) -> Any:
    """``values`` as an int64 array, or None where they are not all integers that fit."""
    import numpy as np

    try:
        array = np.asarray(values) if values else np.zeros(0, dtype=np.int64)
    except OverflowError:
        return None
    return array if array.dtype == np.int64 else None


def build_timeline(trace: DeviceTrace, *, columns: int = 360, bands: int = 8) -> Timeline:
    """Decimate ``trace``'s events into at most ``2 * columns + 1`` points of ``bands`` (+2) bands."""
    events = _Events(trace)
    top = _top_sites(trace, bands, events)
    band_of = {site: position + 1 for position, site in enumerate(top)}
    other = len(top) + 1 if len(top) < len(trace.sites) else None
    labels = ["before the cell", *(trace.sites[site].label for site in top)] + (["other"] if other else [])
    state = [0] * len(labels)
    state[0] = trace.start_bytes
    origin = trace.first_time or 0.0
    span = max((trace.last_time or origin) - origin, 1e-9)
    slices = _Slices(trace, [band_of.get(site, other or 0) for site in range(len(trace.sites))], columns, events)
    points = slices.by_arrays(state, origin, span) or slices.by_loop(state, origin, span)
    band_max = [max(point[band] for point in points[1]) for band in range(len(labels))]
    peak_time = None if trace.peak_time is None else trace.peak_time - origin
    return Timeline(labels, points[0], points[1], band_max, trace.peak_bytes, peak_time)


class _Slices:
    """The events cut into slices of time (runs of one column), each kept at its highest moment and its end."""

    def __init__(self, trace: DeviceTrace, bands: list[int], columns: int, events: _Events | None = None) -> None:
        self.trace, self.bands, self.columns = trace, bands, columns  # bands: the band of each site
        self.events = events or _Events(trace)

    def by_arrays(self, state: list[int], origin: float, span: float) -> tuple[list[float], list[list[int]]] | None:
        """From cumulative sums per band; None where the data do not fit int64 arrays as they are."""
        import numpy as np

        trace, deltas = self.trace, self.events.deltas
        if deltas is None or not len(deltas) or type(trace.start_bytes) is not int:
            return None
        moments = np.asarray(trace.times, dtype=np.float64)
        column = ((moments - origin) / span * self.columns).astype(np.int64)  # truncated to 0, as int() does
        totals = trace.start_bytes + np.cumsum(deltas)
        if not np.isfinite(moments).all() or column.min() < 0 or totals.min() < 0:
            return None  # the loop's own edge cases (it starts at column -1 and a best of -1)
        column = np.minimum(column, self.columns - 1)
        starts = np.flatnonzero(np.diff(column, prepend=column[0] - 1))
        lengths = np.diff(starts, append=len(deltas))
        highest = np.repeat(np.maximum.reduceat(totals, starts), lengths)
        bests = np.minimum.reduceat(np.where(totals == highest, np.arange(len(deltas)), len(deltas)), starts)
        lookup = np.asarray([*self.bands, 0], dtype=np.intp)  # BEFORE (-1) reads the last entry: band 0
        ends = starts + lengths - 1
        # Each band's bytes are read only after the events in `read`: every event's bytes are summed into
        # the first of them at or after it, then those sums are accumulated (no row per event).
        read = np.union1d(bests, ends)  # ends holds the last event: every event is summed into one
        width = len(state)
        sums = np.zeros(len(read) * width, dtype=np.int64)
        np.add.at(sums, np.searchsorted(read, np.arange(len(deltas))) * width + lookup[self.events.owners], deltas)
        rows = sums.reshape(len(read), width)
        np.cumsum(rows, axis=0, out=rows)
        rows += np.asarray(state, dtype=np.int64)
        times, values = [0.0], [list(state)]
        best_rows, end_rows = rows[np.searchsorted(read, bests)], rows[np.searchsorted(read, ends)]
        for best, end, best_state, end_state in zip(
            bests.tolist(), ends.tolist(), best_rows.tolist(), end_rows.tolist(), strict=True
        ):
            times.append(trace.times[best] - origin)
            values.append(best_state)
            if best_state != end_state:
                times.append(trace.times[end] - origin)
                values.append(end_state)
        return times, values

    def by_loop(self, state: list[int], origin: float, span: float) -> tuple[list[float], list[list[int]]]:
        """One pass over the events, for data the arrays do not hold as they are."""
        trace, columns = self.trace, self.columns
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
        for time, delta, site in zip(trace.times, trace.deltas, trace.owners, strict=True):
            here = min(int((time - origin) / span * columns), columns - 1)
            if here != column:
                close()
                column, best = here, -1
            state[0 if site == BEFORE else self.bands[site]] += delta
            total += delta
            last_time = time
            if total > best:
                best, best_state, best_time = total, list(state), time
        close()
        return times, values


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
    heights: dict[int, str] = {}  # value -> its y as written, each once (flat bands repeat their values)
    at_x = [f"{x}," for x in xs]

    def edge(values: list[int]) -> list[str]:
        for value in set(values).difference(heights):
            heights[value] = f"{y(value)}"
        return list(map(str.__add__, at_x, map(heights.__getitem__, values)))

    lower = [0] * len(xs)
    lower_edge: list[str] | None = None  # the previous band's top edge, once drawn
    for band, label in enumerate(timeline.labels):
        upper = [below + point[band] for below, point in zip(lower, timeline.values, strict=True)]
        upper_edge = None
        if timeline.band_max[band] > 0:
            upper_edge = edge(upper)
            bottom_edge = " ".join(reversed(lower_edge if lower_edge is not None else edge(lower)))
            color = PALETTE[band % len(PALETTE)]
            tip = f"{label}: at most {format_bytes(timeline.band_max[band])} at once"
            parts.append(
                f'<polygon class="band" data-band="{band}" points="{" ".join(upper_edge)} {bottom_edge}" '
                f'fill="{color}" fill-opacity="0.85"><title>{html.escape(tip)}</title></polygon>'
            )
        lower, lower_edge = upper, upper_edge
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
