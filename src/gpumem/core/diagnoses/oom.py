"""When a cell dies of CUDA out-of-memory, say why beneath the error and how to get the memory back.

The figures come from PyTorch's out-of-memory observer when it is available (called with the device,
the requested size and the device's total and free memory just before the error is raised), else from
the error message, which has stated allocated and reserved-but-unallocated memory since torch 1.x.
The holders of the device's memory come from :mod:`gpumem.core.holders`. torch is never imported here,
and neither is IPython: :mod:`gpumem.ipython.oom_explainer` calls :func:`explain_if_oom` after each cell and
shows the report.

PyTorch's caching allocator words the message as: "Tried to allocate A. GPU 0 has a total capacity of T of
which F is free. Including non-PyTorch memory, this process has P memory in use. C allowed; Of the allocated
memory X is allocated by PyTorch, and Y is reserved by PyTorch but unallocated." The "C allowed" part is
there only under ``torch.cuda.set_per_process_memory_fraction``: C is the process's cap, and the
allocator refused because its reserve plus the request would pass C, whatever the device has free.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from typing import Any, NamedTuple

from gpumem.core.diagnoses.fragmentation import (
    FreeReserve,
    empty_cache_advice,
    expandable_segments_advice,
    expandable_segments_on,
    free_reserve,
    read_segments,
)
from gpumem.core.readers.allocator_backend import native_allocator
from gpumem.core.runtime import cuda_source
from gpumem.core.units import format_bytes

__all__ = [
    "OomFigures",
    "OomObservation",
    "OomReport",
    "attach_observer",
    "explain",
    "explain_if_oom",
    "find_oom_error",
    "observation_since",
    "parse_oom_message",
    "render_html",
    "render_text",
    "start_observing",
    "stop_observing",
]

FREE_COMMAND = "%gpumem free --deep"


# ----------------------------------------------------------------------------------------------
# Reading the message (torch 1.x and 2.x wordings)
# ----------------------------------------------------------------------------------------------


class OomFigures(NamedTuple):
    """An out-of-memory error's figures: parsed from its message (None where it does not say), or, in an
    :class:`OomReport`, the observer's and the allocator's with the message's."""

    device: int | None
    requested_bytes: int | None
    device_total_bytes: int | None
    device_free_bytes: int | None
    process_bytes: int | None
    allocated_bytes: int | None
    reserved_unallocated_bytes: int | None
    allowed_bytes: int | None = None  # the process's cap (set_per_process_memory_fraction), when one is set


_UNIT_BYTES = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50}
_SIZE = r"([\d.]+)\s*(bytes|B|KiB|MiB|GiB|TiB|PiB)"  # torch writes sizes up to 1 KiB as "N bytes"
_PATTERNS: dict[str, tuple[re.Pattern[str], ...]] = {
    "requested": (re.compile(r"Tried to allocate " + _SIZE),),
    "total": (re.compile(r"total capacity of " + _SIZE), re.compile(_SIZE + r" total capacity")),
    "free": (re.compile(r"of which " + _SIZE + r" is free"), re.compile(_SIZE + r" free;")),
    "process": (re.compile(r"this process has " + _SIZE + r" memory in use"),),
    "allocated": (re.compile(_SIZE + r" is allocated by PyTorch"), re.compile(_SIZE + r" already allocated")),
    "unallocated": (re.compile(_SIZE + r" is reserved by PyTorch but unallocated"),),
    "reserved_total": (re.compile(_SIZE + r" reserved in total by PyTorch"),),
    "allowed": (re.compile(_SIZE + r" allowed;"),),
}
_GPU = re.compile(r"GPU (\d+)")


def _size(text: str, key: str) -> int | None:
    for pattern in _PATTERNS[key]:
        match = pattern.search(text)
        if match is not None:
            try:
                return int(float(match.group(1)) * _UNIT_BYTES[match.group(2)])
            except ValueError:
                return None
    return None


def parse_oom_message(message: str) -> OomFigures:
    """Figures from a CUDA out-of-memory message (torch 1.x and 2.x wordings)."""
    gpu = _GPU.search(message)
    allocated = _size(message, "allocated")
    unallocated = _size(message, "unallocated")
    if unallocated is None:
        reserved_total = _size(message, "reserved_total")
        if reserved_total is not None and allocated is not None:
            unallocated = max(0, reserved_total - allocated)
    return OomFigures(
        device=int(gpu.group(1)) if gpu else None,
        requested_bytes=_size(message, "requested"),
        device_total_bytes=_size(message, "total"),
        device_free_bytes=_size(message, "free"),
        process_bytes=_size(message, "process"),
        allocated_bytes=allocated,
        reserved_unallocated_bytes=unallocated,
        allowed_bytes=_size(message, "allowed"),
    )


_MAX_CHAIN = 32  # causes and contexts followed at most (a chain can loop)


def find_oom_error(error: BaseException | None) -> BaseException | None:
    """The CUDA out-of-memory error in ``error`` or its cause / context chain, else None."""
    torch = sys.modules.get("torch")
    oom_types: tuple[type, ...] = tuple(
        t
        for t in (
            getattr(torch, "OutOfMemoryError", None),
            getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None),
        )
        if isinstance(t, type)
    )
    seen: set[int] = set()
    current = error
    while current is not None and id(current) not in seen and len(seen) < _MAX_CHAIN:
        seen.add(id(current))
        if oom_types and isinstance(current, oom_types):
            return current
        if isinstance(current, RuntimeError) and "CUDA out of memory" in str(current):
            return current
        current = current.__cause__ or current.__context__
    return None


class OomObservation(NamedTuple):
    """What PyTorch's out-of-memory observer reported (numbers only, no references)."""

    device: int
    requested_bytes: int
    device_total_bytes: int
    device_free_bytes: int
    monotonic_s: float


class OomReport(NamedTuple):
    """Everything shown beneath an out-of-memory error: the figures (the observer's and the message's, with
    the allocator's where the message says nothing), whether the reserve is fragmented, advice and holders."""

    figures: OomFigures
    fragmentation: bool
    advice: tuple[str, ...]
    holders: Any  # gpumem.core.holders.HolderReport | None
    source_of_figures: str  # "observer", "message", "observer+message"
    free_reserve: FreeReserve | None = None  # the allocator's free pieces after the error, where readable


# ----------------------------------------------------------------------------------------------
# Explaining
# ----------------------------------------------------------------------------------------------


def explain(
    error: BaseException,
    *,
    observation: OomObservation | None = None,
    shell: Any = None,
    namespace: Any = None,
    source: Any = None,
    time_budget_s: float = 0.5,
    holder_device: str | None = None,
) -> OomReport:
    """Put the OOM's figures, the device's top holders and the advice together."""
    figures = parse_oom_message(str(error))
    device = observation.device if observation is not None else figures.device
    requested = observation.requested_bytes if observation is not None else figures.requested_bytes
    total, allowed = _capacity(observation, figures.device_total_bytes, figures.allowed_bytes)
    free_bytes = observation.device_free_bytes if observation is not None else figures.device_free_bytes
    if observation is None:
        origin = "message"
    elif any(value is not None for value in figures):
        origin = "observer+message"
    else:
        origin = "observer"
    allocated = figures.allocated_bytes
    unallocated = figures.reserved_unallocated_bytes
    if (allocated is None or unallocated is None) and device is not None:
        reading = _allocator_reading(source, device)
        if reading is not None:
            allocated = reading.allocated_bytes if allocated is None else allocated
            if unallocated is None:
                unallocated = max(0, reading.reserved_bytes - reading.allocated_bytes)
    reserve = _free_reserve(source, device)
    # Fragmentation: more is free in the reserve than was asked for, yet no free piece is large enough.
    fragmentation = bool(
        native_allocator()  # CUDA's own pool (cudaMallocAsync) has no segments of PyTorch's to fragment
        and requested is not None
        and unallocated is not None
        and unallocated >= requested
        and unallocated > 0
        and (reserve is None or reserve.largest_free_bytes < requested)
    )
    if namespace is None and shell is not None:
        namespace = getattr(shell, "user_ns", None)
    report_holders = None
    if namespace is not None:
        device_name = holder_device or (f"cuda:{device}" if device is not None else "cuda")
        report_holders = _holders(namespace, device_name, shell, source, time_budget_s)
    fragmented = _Fragmented(unallocated, reserve) if fragmentation and unallocated is not None else None
    advice = _cap_advice(requested, allowed, allocated, unallocated, free_bytes)
    advice += _advice(requested, total, free_bytes, fragmented, report_holders, str(error))
    return OomReport(
        figures=OomFigures(
            device, requested, total, free_bytes, figures.process_bytes, allocated, unallocated, allowed
        ),
        fragmentation=fragmentation,
        advice=tuple(advice),
        holders=report_holders,
        source_of_figures=origin,
        free_reserve=reserve,
    )


_ROUNDING = 0.01  # the message rounds to two decimals of its unit: within 1% is the same figure


def _capacity(
    observation: OomObservation | None, message_total: int | None, message_allowed: int | None
) -> tuple[int | None, int | None]:
    """The device's total and the process's cap. Under a memory fraction PyTorch's observer reports the cap
    as its "total", so the device's own total comes from the message; the exact cap from the observer."""
    if observation is None:
        return message_total, message_allowed
    observed = observation.device_total_bytes
    if message_allowed is not None:
        close = abs(observed - message_allowed) <= _ROUNDING * message_allowed
        return message_total, observed if close else message_allowed
    return (message_total if message_total is not None else observed), None


def _cap_advice(
    requested: int | None, allowed: int | None, allocated: int | None, unallocated: int | None, free: int | None
) -> list[str]:
    """Under a cap, say that the cap refused the request, and whether the device itself had room."""
    if allowed is None or requested is None:
        return []
    setting = "torch.cuda.set_per_process_memory_fraction"
    if requested > allowed:
        alone = (
            f"The request alone ({format_bytes(requested)}) is larger than this process's cap "
            f"({format_bytes(allowed)}): raise the cap with `{setting}` or use a smaller batch."
        )
        return [alone]
    room = f"the device has {format_bytes(free)} free, so " if free is not None and free >= requested else ""
    in_use = "" if allocated is None or unallocated is None else f" ({format_bytes(allocated + unallocated)} in use)"
    refused = (
        f"This process's cap of {format_bytes(allowed)}{in_use} refused the request: {room}raising the cap "
        f"(`{setting}`) or freeing memory under it helps."
    )
    return [refused]


def _holders(namespace: Any, device: str, shell: Any, source: Any, time_budget_s: float) -> Any:
    """The holders of ``device``'s memory (a HolderReport), or None if looking for them failed."""
    from gpumem.core.holders import find_holders

    try:
        return find_holders(namespace, device=device, shell=shell, time_budget_s=time_budget_s, source=source)
    except Exception:
        return None


def _allocator_reading(source: Any, device: int) -> Any:
    source = cuda_source(source)
    if source is None:
        return None
    try:
        return source.snapshot().allocator_for(device)
    except Exception:
        return None


def _free_reserve(source: Any, device: int | None) -> FreeReserve | None:
    """The failing device's free pieces, from the allocator's segments (never initializing CUDA)."""
    if device is None:
        return None
    segments = read_segments(cuda_source(source))
    return free_reserve(segments).get(device) if segments is not None else None


def _alloc_conf_variable(message: str) -> str:
    return "PYTORCH_ALLOC_CONF" if "PYTORCH_ALLOC_CONF" in message else "PYTORCH_CUDA_ALLOC_CONF"


class _Fragmented(NamedTuple):
    unallocated_bytes: int
    reserve: FreeReserve | None  # None: the segments could not be read


def _fragmentation_advice(fragmented: _Fragmented, message: str) -> str:
    """Expandable segments for the next kernel; empty_cache only as far as it would return anything."""
    reserve = fragmented.reserve
    held = format_bytes(fragmented.unallocated_bytes)
    if reserve is not None:
        pieces = f"in {reserve.pieces:,} pieces, the largest {format_bytes(reserve.largest_free_bytes)}"
        free_now = " " + _sentence(empty_cache_advice(reserve))
    else:
        pieces, free_now = "not in one contiguous piece", ""
    if expandable_segments_on():
        return f"PyTorch has {held} reserved but unallocated, {pieces}, although expandable_segments is on.{free_now}"
    setting = _sentence(expandable_segments_advice(_alloc_conf_variable(message)))
    return (
        f"Fragmentation: PyTorch holds {held} reserved but unallocated, more than the request, but {pieces}. "
        f"{setting}{free_now}"
    )


def _sentence(text: str) -> str:
    return f"{text[:1].upper()}{text[1:]}."


def _advice(
    requested: int | None,
    total: int | None,
    free_bytes: int | None,
    fragmented: _Fragmented | None,
    report_holders: Any,
    message: str,
) -> list[str]:
    advice: list[str] = []
    too_large = requested is not None and total is not None and requested > total
    if too_large and requested is not None and total is not None:
        asked, whole = format_bytes(requested), format_bytes(total)
        if asked == whole:  # close enough to read alike: the bytes show which is larger
            asked, whole = f"{requested:,} B", f"{total:,} B"
        advice.append(
            f"The request alone ({asked}) is larger than the whole device "
            f"({whole}): no amount of freeing helps; use a smaller batch or shard the tensor."
        )
    if fragmented is not None:
        advice.append(_fragmentation_advice(fragmented, message))
    if report_holders is not None:
        hidden = sum(row.nbytes for row in report_holders.hidden)
        if hidden:
            advice.append(
                f"IPython itself holds {format_bytes(hidden)} of tensors (output cache / last exception): "
                f"`{FREE_COMMAND}` releases them."
            )
        if report_holders.holders and report_holders.holders[0].nbytes and not too_large:
            top = report_holders.holders[0]
            advice.append(f"The largest holder is `{top.name}` ({format_bytes(top.nbytes)}): `del {top.name}` if done.")
    if (
        advice
        and free_bytes is not None
        and requested is not None
        and free_bytes < requested
        and fragmented is None
        and not too_large
    ):
        # "Then" follows a step above; alone it would repeat the closing line, which always names the command.
        advice.append(f"Then `{FREE_COMMAND}` returns what is freed to the driver.")
    return advice


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------


def _b(value: int | None) -> str:
    return "n/a" if value is None else format_bytes(value)


def _summary_lines(report: OomReport) -> list[str]:
    figures = report.figures
    where = f"cuda:{figures.device}" if figures.device is not None else "the GPU"
    lines = [f"gpumem: CUDA out of memory on {where}"]
    device_figures = (figures.requested_bytes, figures.device_free_bytes, figures.device_total_bytes)
    if any(value is not None for value in device_figures):
        lines.append(
            f"  requested {_b(figures.requested_bytes)}; free on the device {_b(figures.device_free_bytes)} "
            f"of {_b(figures.device_total_bytes)}"
            + (f"; this process uses {_b(figures.process_bytes)}" if figures.process_bytes is not None else "")
        )
    if figures.allowed_bytes is not None:
        lines.append("  " + _cap_line(figures))
    if figures.allocated_bytes is not None or figures.reserved_unallocated_bytes is not None:
        reserve = report.free_reserve
        pieces = (
            f" in {reserve.pieces:,} pieces, the largest {format_bytes(reserve.largest_free_bytes)}"
            if reserve is not None and report.fragmentation
            else ""
        )
        lines.append(
            f"  PyTorch: allocated {_b(figures.allocated_bytes)}, reserved but unallocated "
            f"{_b(figures.reserved_unallocated_bytes)}{pieces}" + (" (fragmentation)" if report.fragmentation else "")
        )
    if len(lines) == 1:
        lines.append("  the error states no sizes, and none could be read from the device")
    return lines


def _cap_line(figures: OomFigures) -> str:
    """The cap as the cap: what PyTorch's reserve may reach, how much of it is in use, how much is left."""
    allowed = figures.allowed_bytes or 0
    text = f"this process's cap (set_per_process_memory_fraction): allowed {format_bytes(allowed)}"
    if figures.allocated_bytes is None or figures.reserved_unallocated_bytes is None:
        return text
    in_use = figures.allocated_bytes + figures.reserved_unallocated_bytes
    return f"{text}, in use {format_bytes(in_use)} (reserved by PyTorch), left {format_bytes(max(0, allowed - in_use))}"


def render_text(report: OomReport, *, limit: int = 5) -> str:
    lines = _summary_lines(report)
    holders = report.holders
    if holders is not None:
        named = [row for row in holders.holders if row.nbytes][:limit]
        hidden = [row for row in holders.hidden if row.nbytes][:limit]
        shown = [*named, *hidden]
        width = max((len(row.name) for row in shown), default=0)
        type_width = max((len(row.type_name) for row in shown), default=0)
        if named:
            lines.append("  top holders:")
            lines.extend(
                f"    {row.name:<{width}}  {row.type_name:<{type_width}}  {format_bytes(row.nbytes):>10}"
                for row in named
            )
        if hidden:
            lines.append(f"  held by IPython (release with {FREE_COMMAND}):")
            lines.extend(
                f"    {row.name:<{width}}  {row.type_name:<{type_width}}  {format_bytes(row.nbytes):>10}"
                for row in hidden
            )
    lines.extend(f"  - {item}" for item in report.advice)
    lines.append(f"  to free what IPython keeps and return the cache: {FREE_COMMAND}")
    return "\n".join(lines)


def _html_row(row: Any) -> str:
    from gpumem.core.holders import escape_html

    return (
        f"<tr><td><code>{escape_html(row.name)}</code></td><td>{escape_html(row.type_name)}</td>"
        f"<td style='text-align:right'>{format_bytes(row.nbytes)}</td></tr>"
    )


def render_html(report: OomReport, *, limit: int = 5) -> str:
    from gpumem.core.holders import escape_html

    summary = _summary_lines(report)
    parts = [
        "<div class='gpumem-oom' style='border-left:3px solid #d9534f;padding:4px 8px'>",
        f"<b>{escape_html(summary[0])}</b><br>",
        "<br>".join(escape_html(line.strip()) for line in summary[1:]),
    ]
    holders = report.holders
    named = [row for row in holders.holders if row.nbytes][:limit] if holders is not None else []
    hidden = [row for row in holders.hidden if row.nbytes][:limit] if holders is not None else []
    if named or hidden:
        parts.append("<table><tbody>")
        parts.extend(_html_row(row) for row in named)
        if hidden:
            parts.append("<tr><td colspan=3><b>Held by IPython</b></td></tr>")
            parts.extend(_html_row(row) for row in hidden)
        parts.append("</tbody></table>")
    if report.advice:
        parts.append("<ul>" + "".join(f"<li>{escape_html(item)}</li>" for item in report.advice) + "</ul>")
    parts.append(f"To free what IPython keeps and return the cache: <code>{FREE_COMMAND}</code></div>")
    return "".join(parts)


# ----------------------------------------------------------------------------------------------
# PyTorch's out-of-memory observer
# ----------------------------------------------------------------------------------------------


class _ObserverState:
    """PyTorch cannot detach an observer: ours is attached once per process and records only while observed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attached = False
        self.observers = 0  # start_observing() calls not yet matched by stop_observing()
        self.last_observation: OomObservation | None = None


_state = _ObserverState()


def _observer(device: int, alloc: int, device_total: int, device_free: int) -> None:
    """Called by PyTorch just before it raises OutOfMemoryError: store numbers only, allocate nothing on GPU."""
    if _state.observers <= 0:
        return
    _state.last_observation = OomObservation(
        int(device), int(alloc), int(device_total), int(device_free), time.monotonic()
    )


def attach_observer() -> None:
    """Attach once CUDA is initialized (before that the allocator has no device to attach to); cheap to repeat."""
    if _state.attached:
        return
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    attach = getattr(getattr(torch, "_C", None), "_cuda_attach_out_of_memory_observer", None)
    if cuda is None or attach is None or not cuda.is_initialized():
        return
    with _state.lock:
        if _state.attached:
            return
        try:
            attach(_observer)
        except Exception:
            return
        _state.attached = True


def start_observing() -> None:
    """Record PyTorch's out-of-memory figures from now on (until the matching :func:`stop_observing`)."""
    with _state.lock:
        _state.observers += 1
    attach_observer()


def stop_observing() -> None:
    """The last one to stop turns the observer into a no-op and forgets what it recorded."""
    with _state.lock:
        _state.observers = max(0, _state.observers - 1)
        if _state.observers == 0:
            _state.last_observation = None


def observation_since(started_s: float) -> OomObservation | None:
    """The observer's figures if they were taken at or after ``started_s`` (``time.monotonic()``)."""
    observation = _state.last_observation
    if observation is None or observation.monotonic_s < started_s:
        return None
    return observation


def explain_if_oom(
    error: BaseException | None,
    *,
    started_s: float,
    shell: Any = None,
    source: Any = None,
    holder_device: str | None = None,
) -> OomReport | None:
    """The report for a cell that failed with ``error`` and started at ``started_s``, if it ran out of memory."""
    oom = find_oom_error(error)
    if oom is None:
        return None
    return explain(
        oom, observation=observation_since(started_s), shell=shell, source=source, holder_device=holder_device
    )
