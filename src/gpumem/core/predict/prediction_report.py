"""A prediction and a batch search as text (terminals, scripts, logs) and HTML (notebooks)."""

from __future__ import annotations

import html
from typing import Any, TypeAlias

from gpumem.core.units import format_bytes, format_duration

# The types render themselves through this module (their __str__ and _repr_html_), so it cannot import
# them: a Prediction, a DevicePrediction and a BatchSearch (gpumem.core.predict.result, .batch).
Prediction: TypeAlias = Any
DevicePrediction: TypeAlias = Any
BatchSearch: TypeAlias = Any

__all__ = ["render_batch_html", "render_batch_text", "render_html", "render_text"]

MODULES_SHOWN = 5
_KIND_ORDER = ("parameters", "buffers", "gradients", "optimizer state", "activations", "temporaries", "other tensors")


def _refusal_line(prediction: Prediction) -> str:
    refusal = prediction.refusal
    assert refusal is not None
    where = f"line {refusal.line}" if refusal.line is not None else "outside the cell's own lines"
    return f"gpumem --predict: the dry run stopped at {where}: {refusal.reason}. Nothing was changed."


def _device_lines(device: DevicePrediction, *, on_gpu: bool) -> list[str]:
    lines = [f"{device.device}:"]
    # On the CPU the figures are the tensors the dry run saw (those the cell uses, and those it makes).
    label = "allocated " if device.reserved_now is not None else "tensors   "
    lines.append(
        f"  {label} now {format_bytes(device.allocated_now)}  peak {format_bytes(device.peak_allocated)}"
        f"  end of cell {format_bytes(device.end_allocated)}"
    )
    if device.peak_reserved is not None:
        bound = " (at most: the memory cached now was not reused)" if device.reserved_is_bound else ""
        if device.reserved_at_least:
            bound = (
                " (at least: cuDNN picks each convolution's workspace when it runs, which can be hundreds of MiB, and"
                " the allocator keeps it cached; a dry run cannot see it. When memory is short cuDNN takes a plan"
                " with less, so the peak allocated decides whether it fits)"
            )
        lines.append(
            f"  reserved   now {format_bytes(device.reserved_now or 0)}  peak {format_bytes(device.peak_reserved)}"
            f"  end of cell {format_bytes(device.end_reserved or 0)}  (the caching allocator's segments){bound}"
        )
    elif device.reserved_now is not None and device.device.startswith("cuda"):
        lines.append(
            f"  reserved   now {format_bytes(device.reserved_now)}; not predicted: the allocator here is "
            "cudaMallocAsync or uses expandable segments, whose segments gpumem does not model"
        )
    if device.context_bytes is not None:
        what = (
            "the device's other memory (NVML cannot tell this process's share: other processes included)"
            if device.context_is_device_wide
            else "this process's CUDA context and other non-PyTorch memory"
        )
        lines.append(f"  {what}: {format_bytes(device.context_bytes)}")
        if device.context_started:
            lines.append(
                "  the dry run started CUDA here (PyTorch's fake CUDA tensors need a context for a backward):"
                " this process now holds that context, as the cell's real run would; nothing else was allocated"
            )
    elif device.device.startswith("cuda"):
        lines.append(
            "  not counted: the CUDA context this process would create (this process has not used the device yet)"
            + ("" if device.workspace_bytes else " and the cuBLAS workspace of a first matmul")
        )
    if device.workspace_bytes:
        lines.append(
            f"  cuBLAS workspaces {format_bytes(device.workspace_bytes)}: {device.workspace_note} (in the peak)"
        )
    for when, figures in (("at the peak", device.by_kind), ("at the end", device.end_by_kind)):
        kinds = sorted(figures.items(), key=lambda item: _KIND_ORDER.index(item[0]) if item[0] in _KIND_ORDER else 99)
        if kinds:
            lines.append(f"  {when}: " + ", ".join(f"{kind} {format_bytes(value)}" for kind, value in kinds))
    if device.capacity is not None or device.device != "cpu" or not on_gpu:
        lines.append("  " + _fits_line(device))
    return lines


def _fits_line(device: DevicePrediction) -> str:
    if device.capacity is None:
        where = "no GPU memory to compare with" if device.device == "cpu" else "the free memory is unknown"
        return f"fits? not answered: {where} (give --capacity, e.g. --capacity 24GiB)"
    against = "the memory free on the device now" if device.capacity_source == "free now" else "--capacity"
    verdict = "yes" if device.fits else "NO"
    amount = format_bytes(abs(device.headroom or 0))
    margin = f"{amount} to spare" if device.fits else f"{amount} short"
    return (
        f"fits? {verdict}: needs {format_bytes(device.needed)} of {format_bytes(device.capacity)} ({against}), {margin}"
    )


def render_text(prediction: Prediction) -> str:
    """The prediction as plain text."""
    if prediction.refusal is not None:
        return _refusal_line(prediction)
    steps = "" if prediction.iterations == 1 else f", {prediction.iterations} forward passes of the root module"
    lines = [f"gpumem --predict: dry run on fake tensors in {format_duration(prediction.seconds)}{steps}"]
    on_gpu = any(device.device.startswith("cuda") for device in prediction.devices)
    for device in prediction.devices:
        lines.extend(_device_lines(device, on_gpu=on_gpu))
    if not prediction.devices:
        lines.append("  the cell allocates no tensor memory")
    modules = [module for module in prediction.modules if module.forward_bytes > 0][:MODULES_SHOWN]
    if modules:
        lines.append("largest modules (memory their forward leaves allocated, parameters):")
        lines.extend(
            f"  {module.name}: {format_bytes(module.forward_bytes)}, parameters {format_bytes(module.parameter_bytes)}"
            for module in modules
        )
    lines.append("copied as fakes: " + (", ".join(prediction.faked) or "nothing"))
    if prediction.shared:
        lines.append("not copied (the dry run saw the originals): " + ", ".join(prediction.shared))
    return "\n".join(lines)


def render_html(prediction: Prediction) -> str:
    """The prediction for a notebook: the text, in a preformatted block."""
    return f'<pre class="gpumem-predict">{html.escape(render_text(prediction))}</pre>'


def render_batch_text(result: BatchSearch) -> str:
    """The batch search as plain text."""
    head = f"gpumem --batch {result.name}={result.low}..{result.high}: {len(result.runs)} dry runs"
    head += f" in {format_duration(result.seconds)}"
    lines = [head]
    if result.refusal is not None:
        where = f" (line {result.refusal.line})" if result.refusal.line is not None else ""
        lines.append(f"  stopped{where}: {result.refusal.reason}")
    if result.largest is None:
        if result.refusal is None:
            lines.append(f"  even {result.name}={result.low} does not fit")
    else:
        pinned = "" if result.exact else f" (search stopped; {result.first_over} does not fit)"
        top = " (the top of the range)" if result.first_over is None else ""
        lines.append(f"  largest {result.name} that fits: {result.largest}{top}{pinned}")
        prediction = result.at_largest
        if prediction is not None and prediction.devices:
            compared = [d for d in prediction.devices if d.capacity is not None] or list(prediction.devices)
            peaks = ", ".join(
                f"{d.device} peak {format_bytes(d.peak_allocated)} allocated"
                + ("" if d.peak_reserved is None else f", {format_bytes(d.peak_reserved)} reserved")
                for d in compared
            )
            lines.append(f"  at {result.name}={result.largest}: {peaks}")
    if result.bytes_per_sample is not None:
        lines.append(f"  memory per extra {result.name}: about {format_bytes(result.bytes_per_sample)}")
    runs = ", ".join(f"{value}: {'fits' if fits else 'no'}" for value, _, fits in result.runs if fits is not None)
    if runs:
        lines.append(f"  dry runs: {runs}")
    return "\n".join(lines)


def render_batch_html(result: BatchSearch) -> str:
    return f'<pre class="gpumem-predict">{html.escape(render_batch_text(result))}</pre>'
