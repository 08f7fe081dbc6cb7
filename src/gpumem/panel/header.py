"""The header of the panel: the figures per device and for the host, as a model and as HTML.

:func:`build_header` computes every figure from a snapshot, the device descriptions and the peaks
since open, without any widget, so tests check them exactly; :func:`render_header` turns the model
into the HTML the panel's stylesheet styles.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from gpumem.core.monitoring.peaks import RunningPeak
from gpumem.core.readers.allocator_backend import native_allocator
from gpumem.core.readers.cuda_fault import cuda_faults, status_text
from gpumem.core.readers.sources import DeviceInfo, Snapshot
from gpumem.core.units import Amount, format_bytes
from gpumem.panel.monitor_feed import capacities_of, device_indices

__all__ = ["RECORDING_SPAN", "DeviceFigures", "HeaderModel", "HostFigures", "build_header", "render_header"]


class DeviceFigures(NamedTuple):
    """One device's figures for the header; None means not measurable now (shown as n/a)."""

    device: int
    name: str | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    used_bytes: int | None  # whole device, NVML
    total_bytes: int | None
    peak_allocated_bytes: int | None  # since the panel opened (or Reset peak)
    peak_exact: bool
    peak_sampled_bytes: int | None = None  # the highest sample since then: what the curve reaches
    peak_why: str = ""  # why the peak is not exact (RunningPeak.why_not_exact), "" when it is

    @property
    def cached_free_bytes(self) -> int | None:
        """Reserved but not allocated: cached by PyTorch, held from other processes, used by no tensor.
        Free in PyTorch's reserve, not fragmentation: later requests reuse it unless no piece is large enough."""
        if self.allocated_bytes is None or self.reserved_bytes is None:
            return None
        return self.reserved_bytes - self.allocated_bytes

    @property
    def capacity_fraction(self) -> float | None:
        """Whole-device use over capacity (NVML), else PyTorch's reserved over capacity."""
        if not self.total_bytes:
            return None
        numerator = self.used_bytes if self.used_bytes is not None else self.reserved_bytes
        return None if numerator is None else numerator / self.total_bytes


class HostFigures(NamedTuple):
    rss_bytes: int
    peak_rss_bytes: int | None  # since the panel opened (or Reset peak)
    peak_exact: bool
    available_bytes: int
    total_bytes: int
    peak_sampled_bytes: int | None = None
    peak_why: str = ""


class HeaderModel(NamedTuple):
    """Everything the header shows, ready to render."""

    devices: tuple[DeviceFigures, ...]
    host: HostFigures | None
    notes: tuple[str, ...]  # plain sentences: why something is not shown
    cuda_in_use: bool
    peak_span: str = "panel opened"  # what started the peaks' span, as the mark on the curves is labelled


def _reason(status: Mapping[str, str], key: str) -> str | None:
    value = status.get(key)
    if value is None or value == "ok":
        return None
    return value.removeprefix("unavailable: ")


def build_header(
    snapshot: Snapshot | None,
    infos: Mapping[int, DeviceInfo | None],
    device_peaks: Mapping[int, RunningPeak],
    host_peak: RunningPeak | None,
    status: Mapping[str, str],
    device: int | None = None,
    *,
    peak_span: str = "panel opened",
) -> HeaderModel:
    """Figures per device (only ``device`` when given) and for the host, with plain-language notes.
    ``peak_span`` names the instant the peaks count from, as the curves' mark does."""
    if snapshot is None:
        return HeaderModel((), None, ("Waiting for the first sample.",), False, peak_span)
    indices = device_indices(snapshot)
    notes = _device_notes(snapshot, indices, status)
    if device is not None and indices and device not in indices:
        notes.append(f"cuda:{device} is not visible to this process; showing every device.")
        device = None
    capacities = capacities_of(snapshot, infos)
    figures = tuple(
        _device_figures(snapshot, index, infos.get(index), capacities.get(index), device_peaks.get(index))
        for index in indices
        if device is None or index == device
    )
    host: HostFigures | None = None
    if snapshot.host is not None:
        host = HostFigures(
            rss_bytes=snapshot.host.rss_bytes,
            peak_rss_bytes=_int_or_none(host_peak.value) if host_peak is not None else None,
            peak_exact=host_peak.exact if host_peak is not None else False,
            available_bytes=snapshot.host.available_bytes,
            total_bytes=snapshot.host.total_bytes,
            peak_sampled_bytes=_int_or_none(host_peak.sampled) if host_peak is not None else None,
            peak_why=host_peak.why_not_exact if host_peak is not None else "no counter",
        )
    elif not indices:
        notes.append(_sentence(f"Host memory: {_reason(status, 'host') or 'unavailable'}"))
    return HeaderModel(figures, host, tuple(notes), bool(snapshot.allocator), peak_span)


def _device_notes(snapshot: Snapshot, indices: Sequence[int], status: Mapping[str, str]) -> list[str]:
    """Why PyTorch's or NVML's figures are missing, in a sentence."""
    torch_reason = _reason(status, "torch")
    nvml_reason = _reason(status, "nvml")
    faults = cuda_faults()
    if faults:  # a sticky CUDA error: PyTorch's figures stay frozen until the kernel restarts
        return [_sentence("CUDA error: " + "; ".join(status_text(fault) for fault in faults.values()))
                + " Device used (NVML) and host memory are still read."]
    if not indices:
        return [_sentence(f"No CUDA device is in use: {torch_reason or 'no GPU is visible to this process'}")]
    if not snapshot.allocator:
        why = torch_reason or "not initialized"
        return [f"PyTorch's figures appear once CUDA is in use ({why}); device used is the whole GPU, all processes."]
    if nvml_reason:
        return [f"Device used: unavailable ({nvml_reason.rstrip('.?')}); capacity from PyTorch."]
    return []


def _device_figures(
    snapshot: Snapshot, index: int, info: DeviceInfo | None, total: int | None, tracker: RunningPeak | None
) -> DeviceFigures:
    allocator = snapshot.allocator_for(index)
    nvml = snapshot.device_for(index)
    return DeviceFigures(
        device=index,
        name=info.name if info is not None else None,
        allocated_bytes=allocator.allocated_bytes if allocator is not None else None,
        reserved_bytes=allocator.reserved_bytes if allocator is not None else None,
        used_bytes=nvml.used_bytes if nvml is not None else None,
        total_bytes=total,
        peak_allocated_bytes=_int_or_none(tracker.value) if tracker is not None and allocator else None,
        peak_exact=tracker.exact if tracker is not None else False,
        peak_sampled_bytes=_int_or_none(tracker.sampled) if tracker is not None and allocator else None,
        peak_why=tracker.why_not_exact if tracker is not None else "no counter",
    )


def _sentence(text: str) -> str:
    return text if text.endswith((".", "?", "!")) else text + "."


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _size(value: int | None) -> str:
    return "n/a" if value is None else format_bytes(value)


def _peak(value: int | None, exact: bool) -> str:
    if value is None:
        return "n/a"
    return format_bytes(value) if exact else f"≥ {format_bytes(value)}"


_PEAK_WHY = {
    "": "Exact: the peak counter ({counter}) has covered the whole time since the mark.",
    "reset": (
        "'≥' marks a lower bound: the peak counter was reset since the mark (gpumem resets it when a measured "
        "cell starts, and so does torch.cuda.reset_peak_memory_stats), so it does not cover the whole time since; "
        "shown is the highest value the samples and the counter since its reset saw."
    ),
    "kept": (
        "'≥' marks a lower bound: the peak counter has not risen above the value it held when the mark was "
        "set, so it says nothing of the time since; shown is the highest sample."
    ),
    "no counter": "'≥' marks a lower bound: no peak counter is read here; shown is the highest sample.",
    "either": (
        "Exact when the peak counter ({counter}) has covered the whole time since; '≥' marks a lower bound "
        "(hover a figure to see why)."
    ),
}


_COUNTERS = {
    "PyTorch allocation": "torch.cuda.max_memory_allocated",
    "resident memory (RSS)": "the process's peak RSS, which the OS keeps",
}


def _peak_tip(model: HeaderModel, what: str, why: str) -> str:
    """The hover text of a peak: what it covers, whether it is exact and why, and how the curves differ."""
    if model.peak_span == RECORDING_SPAN:
        return _RECORDING_TIP.format(what=what)
    return (
        f"Highest {what} since the “{model.peak_span}” mark on the curves. "
        f"{_PEAK_WHY.get(why, '').format(counter=_COUNTERS.get(what, 'its own'))} "
        "The curves are samples: a peak between two samples is not on them, and they also show samples from "
        "before the mark."
    )


def _peak_gap(value: int | None, sampled: int | None) -> str:
    """Where the peak stands above the curves' highest sample since the mark: a sentence saying so, else ""."""
    if value is None or sampled is None or format_bytes(value) == format_bytes(sampled):
        return ""
    return f"curve: {format_bytes(sampled)}, the peak fell between samples"


_CACHED_TIP = (
    "reserved - allocated: held by PyTorch's cache, used by no tensor. Later allocations reuse it; it is "
    "fragmentation only when no free piece is large enough for a request (gpumem warns under the cell then, "
    "and %gpumem status says so). Free returns the unused segments to the driver."
)
_ASYNC_CACHED_TIP = (  # backend:cudaMallocAsync: CUDA's pool, not PyTorch's segments, keeps it
    "reserved - allocated: held by CUDA's memory pool (cudaMallocAsync), used by no tensor. Later allocations "
    "reuse it. Free asks the pool to return what it does not use to the driver."
)


def _cached_tip() -> str:
    return _CACHED_TIP if native_allocator() else _ASYNC_CACHED_TIP


# The peak_span of a loaded session's header: its peaks are over the whole recording.
RECORDING_SPAN = "recording"
_RECORDING_TIP = (
    "Highest {what} of the recorded session that is known: the curve's highest sample and each "
    "measured cell's exact peak. A lower bound ('≥'): between measured cells the allocator's peak was not read."
)


def _peak_label(model: HeaderModel) -> str:
    """'peak since open', or 'peak since reset' after Reset peak: the span the mark on the curves starts."""
    if model.peak_span == RECORDING_SPAN:
        return "peak recorded"
    return "peak since reset" if model.peak_span == "peak reset" else "peak since open"


def _peak_sub(model: HeaderModel) -> str:
    if model.peak_span == RECORDING_SPAN:
        return "curves and cells' exact peaks"
    return f"from the \u201c{model.peak_span}\u201d mark"


_USED_TIP = "Whole device as NVML reports it: every process, CUDA contexts included."


def _card(label: str, value: str, tip: str, css: str = "", sub: str = "", note: str = "") -> str:
    sub_html = f'<div class="gm-sub">{html.escape(sub)}</div>' if sub else ""
    if note:
        sub_html += f'<div class="gm-sub gm-peak-gap">{html.escape(note)}</div>'
    return (
        f'<div class="gm-card {css}" title="{html.escape(tip)}"><div class="gm-label">{html.escape(label)}</div>'
        f'<div class="gm-value">{html.escape(value)}</div>{sub_html}</div>'
    )


def _bar(figures: DeviceFigures, threshold: Amount, alert: bool) -> str:
    """A capacity bar: allocated, then reserved, then the rest of device used, with the threshold tick."""
    total = figures.total_bytes
    share = threshold.share_of(total)
    if not total or share is None:
        return ""
    allocated = figures.allocated_bytes or 0
    reserved = max(figures.reserved_bytes or 0, allocated)
    used = max(figures.used_bytes if figures.used_bytes is not None else reserved, reserved)
    parts = [(allocated, "gm-a"), (reserved - allocated, "gm-r"), (used - reserved, "gm-u")]
    segments = "".join(
        f'<span class="{css}" style="width:{100 * min(size, total) / total:.2f}%"></span>'
        for size, css in parts
        if size > 0
    )
    return (
        f'<div class="gm-bar{" gm-alert" if alert else ""}">{segments}'
        f'<span class="gm-tick" style="left:{100 * min(share, 1):.1f}%" title="threshold {_label(threshold)}">'
        "</span></div>"
    )


def render_header(model: HeaderModel, threshold: Amount) -> tuple[str, bool]:
    """The header's HTML (classes styled by the panel's stylesheet) and whether any device is over threshold
    (a share of its capacity, or a size: each device's own capacity says which share that is)."""
    alert = any(_over(f, threshold) for f in model.devices)
    parts: list[str] = ['<div class="gm-header">']
    if len(model.devices) == 1:
        parts.append(_render_single(model, model.devices[0], threshold))
    elif model.devices:
        parts.append(_render_table(model, threshold))
    if model.host is not None:
        host = model.host
        if model.devices:
            tip = html.escape(_peak_tip(model, "resident memory (RSS)", host.peak_why))
            gap = _peak_gap(host.peak_rss_bytes, host.peak_sampled_bytes)
            parts.append(
                f'<div class="gm-host">Host: RSS {format_bytes(host.rss_bytes)} · <span title="{tip}">'
                f"{_peak_label(model)} {_peak(host.peak_rss_bytes, host.peak_exact)}"
                f"{f' ({html.escape(gap)})' if gap else ''}</span> · machine {format_bytes(host.total_bytes)}, "
                f"{format_bytes(host.available_bytes)} available</div>"
            )
        else:
            fraction = 1 - host.available_bytes / host.total_bytes if host.total_bytes else 0.0
            parts.append('<div class="gm-title">Host memory</div>')
            parts.append('<div class="gm-cards">')
            parts.append(_card("process RSS", format_bytes(host.rss_bytes), "Resident memory of this kernel process."))
            parts.append(
                _card(
                    _peak_label(model),
                    _peak(host.peak_rss_bytes, host.peak_exact),
                    _peak_tip(model, "resident memory (RSS)", host.peak_why),
                    sub=_peak_sub(model),
                    note=_peak_gap(host.peak_rss_bytes, host.peak_sampled_bytes),
                )
            )
            parts.append(
                _card(
                    "machine in use",
                    f"{100 * fraction:.0f} %",
                    "All processes on this machine, from the memory the OS reports as available.",
                    sub=f"{format_bytes(host.total_bytes - host.available_bytes)} of {format_bytes(host.total_bytes)}",
                )
            )
            parts.append("</div>")
    parts.extend(f'<div class="gm-note">{html.escape(note)}</div>' for note in model.notes)
    parts.append("</div>")
    return "".join(parts), alert


def _gap_html(value: int | None, sampled: int | None) -> str:
    gap = _peak_gap(value, sampled)
    return f'<div class="gm-sub gm-peak-gap">{html.escape(gap)}</div>' if gap else ""


def _device_title(figures: DeviceFigures) -> str:
    name = f" · {figures.name}" if figures.name else ""
    total = f" · {format_bytes(figures.total_bytes)}" if figures.total_bytes else ""
    return f"cuda:{figures.device}{name}{total}"


def _over(figures: DeviceFigures, threshold: Amount) -> bool:
    fraction, share = figures.capacity_fraction, threshold.share_of(figures.total_bytes)
    return fraction is not None and share is not None and fraction >= share


def _label(threshold: Amount) -> str:
    """``'90 %'``, ``'70.0 GiB'``."""
    if threshold.nbytes is not None:
        return format_bytes(threshold.nbytes)
    return f"{100 * (threshold.fraction or 0):.0f} %"


def _render_single(model: HeaderModel, figures: DeviceFigures, threshold: Amount) -> str:
    fraction = figures.capacity_fraction
    alert = _over(figures, threshold)
    percent = "n/a" if fraction is None else f"{100 * fraction:.1f} %"
    state = f"over the {_label(threshold)} threshold" if alert else f"threshold {_label(threshold)}"
    basis = "device used" if figures.used_bytes is not None else "reserved"
    cards = [
        _card("allocated", _size(figures.allocated_bytes), "Memory held by live PyTorch tensors.", "gm-c-a"),
        _card(
            "reserved",
            _size(figures.reserved_bytes),
            "Memory PyTorch's caching allocator holds from the driver.",
            "gm-c-r",
        ),
        _card(
            "device used",
            _size(figures.used_bytes),
            _USED_TIP,
            "gm-c-u",
            sub=f"of {_size(figures.total_bytes)}",
        ),
        _card(
            "of capacity",
            percent,
            f"{basis.capitalize()} over the device's capacity; the header turns red at the threshold.",
            "gm-c-alert" if alert else "",
            sub=state,
        ),
        _card(
            _peak_label(model),
            _peak(figures.peak_allocated_bytes, figures.peak_exact),
            _peak_tip(model, "PyTorch allocation", figures.peak_why),
            sub=_peak_sub(model),
            note=_peak_gap(figures.peak_allocated_bytes, figures.peak_sampled_bytes),
        ),
        _card("cached, unallocated", _size(figures.cached_free_bytes), _cached_tip(), sub="reserved - allocated"),
    ]
    return (
        f'<div class="gm-title">{html.escape(_device_title(figures))}</div>'
        f"{_bar(figures, threshold, alert)}"
        f'<div class="gm-cards">{"".join(cards)}</div>'
    )


def _render_table(model: HeaderModel, threshold: Amount) -> str:
    devices = model.devices
    peak, cached = _peak_label(model), "cached, unallocated"
    titles = ("device", "allocated", "reserved", "device used", "of capacity", peak, cached)
    tips = {peak: _peak_tip(model, "PyTorch allocation", "either"), cached: _cached_tip()}
    head = "".join(f'<th title="{html.escape(tips.get(h, ""))}">{h}</th>' for h in titles)
    rows: list[str] = []
    for f in devices:
        fraction = f.capacity_fraction
        alert = _over(f, threshold)
        name = f" {html.escape(f.name)}" if f.name else ""
        cells = (
            f'<td title="{html.escape(_device_title(f))}">cuda:{f.device}<span class="gm-dim">{name}</span></td>',
            f"<td>{_size(f.allocated_bytes)}</td>",
            f"<td>{_size(f.reserved_bytes)}</td>",
            f'<td title="{html.escape(_USED_TIP)}">{_size(f.used_bytes)} / {_size(f.total_bytes)}</td>',
            f"<td>{'n/a' if fraction is None else f'{100 * fraction:.1f} %'}</td>",
            (
                f'<td title="{html.escape(_peak_tip(model, "PyTorch allocation", f.peak_why))}">'
                f"{html.escape(_peak(f.peak_allocated_bytes, f.peak_exact))}"
                f"{_gap_html(f.peak_allocated_bytes, f.peak_sampled_bytes)}</td>"
            ),
            f"<td>{_size(f.cached_free_bytes)}</td>",
        )
        rows.append(f'<tr class="{"gm-row-alert" if alert else ""}">{"".join(cells)}</tr>')
    return (
        f'<div class="gm-title">{len(devices)} CUDA devices · threshold {_label(threshold)}</div>'
        f'<div class="gm-scroll"><table class="gm-table"><tr>{head}</tr>{"".join(rows)}</table></div>'
    )
