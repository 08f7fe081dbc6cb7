"""A dry run: run code on fake copies of the user's objects, count, and predict per device; the public entry
points (:func:`predict` a function call, :func:`predict_source` a cell's source, :func:`search_batch`).

The user's namespace is copied (:mod:`~gpumem.core.predict.isolation`), the code runs on the copy under
``FakeTensorMode`` inside the counting (:mod:`~gpumem.core.predict.tracking`) and the guards
(:mod:`~gpumem.core.predict.guards`); then the copy is dropped. What the process holds now on each CUDA
device (allocated, reserved, the allocator's segments, the CUDA context, whether the cuBLAS workspace is
made) is read before, without creating a CUDA context, and the model starts from it.
"""

from __future__ import annotations

import ast
import itertools
import os
import time
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from gpumem.core.predict.batch import BatchSearch, search
from gpumem.core.predict.guards import Refusal, guarded, refusal_from
from gpumem.core.predict.isolation import (
    Isolation,
    isolate,
    kernels_as_real,
    modules_convert,
    no_context_probe,
    rebuild,
)
from gpumem.core.predict.result import DevicePrediction, Prediction
from gpumem.core.predict.tracking import StepTracker
from gpumem.core.readers.workspaces import workspace_sizes

__all__ = [
    "DeviceNow",
    "assigns_name",
    "dry_run",
    "predict",
    "predict_source",
    "read_devices",
    "search_batch",
]


class DeviceNow(NamedTuple):
    """One CUDA device as the process has it now."""

    allocated: int
    reserved: int
    free: int | None  # on the whole device (NVML), None when unknown
    context: int | None  # this process's device memory outside PyTorch's reserve, None when unknown
    context_is_device_wide: bool  # NVML could not tell this process's share: the whole device's used memory
    workspace_bytes: int  # one cuBLAS workspace on it
    lt_workspace_bytes: int  # one cuBLASLt workspace
    workspace_blocks: tuple[int, ...]  # addresses of allocated blocks that may be the cuBLAS workspace
    segments: list[tuple[int, bool, list[tuple[int, int, bool]]]]


def read_devices() -> dict[str, DeviceNow]:
    """Each CUDA device this process uses now (none before CUDA is initialized: nothing is held then)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return {}
    nvml = _nvml_readings()
    devices: dict[str, DeviceNow] = {}
    for index in range(torch.cuda.device_count()):
        stats = torch.cuda.memory_stats(index)
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        free, used, device_used = nvml.get(index, (None, None, None))
        sizes = workspace_sizes(index)
        each = sizes.cublas_bytes if sizes is not None else 0
        lt = sizes.cublaslt_bytes if sizes is not None else 0
        segments = _segments(index)
        # A workspace fills a segment of its own: its candidates (a tensor of that size could be one too; the
        # dry run drops those that a copied tensor's storage starts at).
        made = tuple(
            address
            for _, _, blocks in segments
            if len(blocks) == 1
            for address, size, free in blocks
            if not free and size == each
        )
        wide = used is None and device_used is not None
        used = device_used if used is None else used
        context = None if used is None else max(used - reserved, 0)
        devices[f"cuda:{index}"] = DeviceNow(allocated, reserved, free, context, wide, each, lt, made, segments)
    return devices


_SOURCES: list[Any] = []  # one SystemSource, made at the first dry run (NVML is started once)


def _nvml_readings() -> dict[int, tuple[int, int | None, int]]:
    from gpumem.core.readers.sources import SystemSource

    try:
        if not _SOURCES:
            _SOURCES.append(SystemSource())
        snapshot = _SOURCES[0].snapshot(process_memory=True)
    except Exception:
        return {}
    return {
        reading.device: (reading.free_bytes, reading.process_used_bytes, reading.used_bytes)
        for reading in snapshot.devices
    }


def _segments_modelled() -> bool:
    try:
        native = torch.cuda.get_allocator_backend() == "native"
    except Exception:
        native = False
    settings = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return native and "expandable_segments:true" not in settings.replace(" ", "").lower()


def _segments(index: int) -> list[tuple[int, bool, list[tuple[int, int, bool]]]]:
    """The allocator's segments on the device, for the model to start from (none under cudaMallocAsync)."""
    try:
        if torch.cuda.get_allocator_backend() != "native":
            return []
        snapshot = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
    except Exception:
        return []
    segments = []
    for segment in snapshot:
        if segment.get("device") != index:
            continue
        address = int(segment["address"])
        blocks, offset = [], address
        for block in segment.get("blocks", []):
            blocks.append((offset, int(block["size"]), block.get("state") == "inactive"))
            offset += int(block["size"])
        segments.append((address, segment.get("segment_type") == "small", blocks))
    return sorted(segments)


def dry_run(
    run: Callable[[dict[str, Any]], Any],
    namespace: Mapping[str, Any],
    *,
    filename: str,
    first_line: int = 1,
    skip: Iterable[str] = (),
    capacity: int | None = None,
    home: Mapping[str, Any] | None = None,
) -> Prediction:
    """Run ``run(copied namespace)`` as a dry run and predict; the user's objects are not touched.

    ``filename`` is the one the code was compiled under (refusals name its lines, numbered from
    ``first_line``); ``capacity`` replaces the free memory now as what the peak must fit in.
    """
    contexts: list[str] = []
    with no_context_probe(contexts):
        prediction = _predicted(run, namespace, filename, first_line, skip, capacity, home)
    if not contexts:
        return prediction
    # PyTorch started CUDA for the fakes on a device this process had not used: its context is now held,
    # as the real run would hold it; measured after, and named in the report.
    after = read_devices()
    devices = tuple(
        replace(device, context_bytes=after[device.device].context, context_started=True)
        if device.device in contexts and device.device in after
        else device
        for device in prediction.devices
    )
    return replace(prediction, devices=devices, started_contexts=tuple(contexts))


def _predicted(
    run: Callable[[dict[str, Any]], Any],
    namespace: Mapping[str, Any],
    filename: str,
    first_line: int,
    skip: Iterable[str],
    capacity: int | None,
    home: Mapping[str, Any] | None,
) -> Prediction:
    started = time.perf_counter()
    now = read_devices()
    try:
        isolation = isolate(namespace, skip, home)
    except Exception as error:
        return Prediction(refusal=Refusal(f"the namespace could not be copied: {type(error).__name__}: {error}"))
    tensors = {address for _, address in isolation.placements}
    made = {name: len(set(device.workspace_blocks) - tensors) for name, device in now.items()}
    tracker = StepTracker(
        {name: (device.workspace_bytes, device.lt_workspace_bytes, made[name]) for name, device in now.items()}
    )
    for name, device in now.items():
        tracker.models.setdefault(name, _seeded(device))
    try:
        figures = _counted(run, isolation, tracker, filename)
    except (Exception, Refusal) as error:
        refusal = refusal_from(error, filename, first_line)
        return Prediction(refusal=refusal, faked=tuple(isolation.faked), seconds=time.perf_counter() - started)
    finally:
        isolation.namespace.clear()
    names = sorted(set(figures[1]) | set(figures[0]))
    cuda = any(name.startswith("cuda") for name in names)
    # With CUDA in use, the CPU tensors a step touches (an optimizer's step counters) are shown but not
    # compared with --capacity, which is about the GPU.
    devices = tuple(
        _device(name, figures, tracker, now.get(name), None if cuda and name == "cpu" else capacity, made.get(name))
        for name in names
    )
    return Prediction(
        devices=devices,
        modules=tuple(sorted(tracker.module_figures(), key=lambda module: -module.forward_bytes)),
        faked=tuple(isolation.faked),
        shared=tuple(isolation.shared),
        seconds=time.perf_counter() - started,
        iterations=tracker.iterations,
    )


def _seeded(device: DeviceNow) -> Any:
    from gpumem.core.predict.allocator import AllocatorModel

    model = AllocatorModel()
    model.seed(device.segments)
    return model


_Figures = tuple[dict[str, dict[str, int]], dict[str, dict[str, int]], dict[str, dict[str, int]]]


def _counted(
    run: Callable[[dict[str, Any]], Any], isolation: Isolation, tracker: StepTracker, filename: str
) -> _Figures:
    """(before, peak, end) by device and kind."""
    fakes_as_real = (kernels_as_real(), modules_convert(isolation.fake_mode))
    with guarded(filename, tracker.empty_cache), fakes_as_real[0], fakes_as_real[1], isolation.fake_mode:
        tracker.adopt(isolation.roots, isolation.placements)
        # Only the copied namespace may keep the copies alive now: a `del x` in the cell frees x's copy.
        isolation.roots.clear()
        isolation.placements.clear()
        before = tracker.by_kind("current")
        with tracker:
            run(isolation.namespace)
            end = tracker.by_kind("current")
            tracker.keep_end()  # the copies are dropped afterwards, which frees them in the model too
            peak = tracker.by_kind("peak")
    for device, kinds in before.items():  # MemTracker's peak starts when it is entered: at least what was there
        if peak.setdefault(device, kinds)["total"] < kinds["total"]:
            peak[device] = kinds
    return before, peak, end


def _device(
    name: str,
    figures: _Figures,
    tracker: StepTracker,
    now: DeviceNow | None,
    capacity: int | None,
    workspaces_made: int | None,
) -> DevicePrediction:
    before, peak, end = (figure.get(name, {"total": 0}) for figure in figures)
    model = tracker.models.get(name)
    if model is None or now is None:  # the CPU, or a CUDA device this process has not used yet
        return _counted_device(name, before, peak, end, model, tracker, capacity)
    workspace = tracker.workspaces_made.get(name, 0)
    note = (
        "made by the cell's matmuls (one per thread: the forward's and autograd's)"
        if workspace
        else (f"{workspaces_made} made already" if workspaces_made else "")
    )
    return DevicePrediction(
        device=name,
        allocated_now=now.allocated,
        peak_allocated=now.allocated + model.peak_allocated,
        end_allocated=now.allocated + model.end_allocated,
        reserved_now=now.reserved,
        # Reserved is modelled for the native allocator with fixed segments only (not cudaMallocAsync, not
        # expandable segments, whose rules differ).
        peak_reserved=now.reserved + model.peak_reserved if _segments_modelled() else None,
        end_reserved=now.reserved + model.end_reserved if _segments_modelled() else None,
        reserved_is_bound=not now.segments and now.reserved > now.allocated,  # the cache could not be read
        reserved_at_least=name in tracker.convolutions,
        context_bytes=now.context,
        context_is_device_wide=now.context_is_device_wide,
        workspace_bytes=workspace,
        workspace_note=note,
        by_kind=_kinds(peak),
        end_by_kind=_kinds(end),
        capacity=capacity if capacity is not None else now.free,
        capacity_source="--capacity" if capacity is not None else ("free now" if now.free is not None else ""),
    )


def _counted_device(
    name: str,
    before: dict[str, int],
    peak: dict[str, int],
    end: dict[str, int],
    model: Any,
    tracker: StepTracker,
    capacity: int | None,
) -> DevicePrediction:
    """MemTracker's counts alone (the CPU), or with the model from an empty allocator (an unused CUDA device)."""
    if model is None:
        return DevicePrediction(
            device=name,
            allocated_now=before["total"],
            peak_allocated=peak["total"],
            end_allocated=end["total"],
            by_kind=_kinds(peak),
            end_by_kind=_kinds(end),
            capacity=capacity,
            capacity_source="--capacity" if capacity is not None else "",
        )
    workspace = tracker.workspaces_made.get(name, 0)
    return DevicePrediction(
        device=name,
        allocated_now=before["total"],
        peak_allocated=before["total"] + model.peak_allocated,
        end_allocated=before["total"] + model.end_allocated,
        reserved_now=0,
        peak_reserved=model.peak_reserved,
        end_reserved=model.end_reserved,
        reserved_at_least=name in tracker.convolutions,
        workspace_bytes=workspace,
        workspace_note="made by the cell's matmuls (one per thread: the forward's and autograd's)" if workspace else "",
        by_kind=_kinds(peak),
        end_by_kind=_kinds(end),
        capacity=capacity,
        capacity_source="--capacity" if capacity is not None else "",
    )


def _kinds(peak: dict[str, int]) -> dict[str, int]:
    return {kind: value for kind, value in peak.items() if kind != "total" and value}


# The public entry points: predict a function call or a cell's source, and search the largest batch.
_ARGS, _KWARGS, _CELLS, _FUNCTION = "__gpumem_args__", "__gpumem_kwargs__", "__gpumem_cells__", "__gpumem_fn__"
_numbers = itertools.count(1)


def predict(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Prediction:
    """Dry-run ``fn(*args, **kwargs)`` on fake copies of its arguments, its globals and closure, and predict
    its memory per device. Nothing of the caller's changes; ``Prediction.against(capacity)`` answers
    "does it fit in CAPACITY bytes?" (by default: in the memory free on the device now)."""
    return _predict_call(fn, args, kwargs, None)


def _predict_call(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], capacity: int | None
) -> Prediction:
    function = fn if isinstance(fn, types.FunctionType) else None
    home: dict[str, Any] = function.__globals__ if function is not None else {}
    cells = [cell.cell_contents for cell in (function.__closure__ or ())] if function is not None else []
    namespace = {**home, _ARGS: args, _KWARGS: kwargs, _CELLS: cells, _FUNCTION: fn}
    filename = function.__code__.co_filename if function is not None else "<gpumem-predict>"

    def run(copied: dict[str, Any]) -> Any:
        target = copied[_FUNCTION]
        if function is not None:
            closure = tuple(types.CellType(value) for value in copied[_CELLS]) if function.__closure__ else None
            target = rebuild(function, copied, closure)
        return target(*copied[_ARGS], **copied[_KWARGS])

    return dry_run(run, namespace, filename=filename, capacity=capacity, home=home)


def predict_source(
    source: str,
    namespace: Mapping[str, Any],
    *,
    first_line: int = 1,
    skip: Iterable[str] = (),
    capacity: int | None = None,
    values: Mapping[str, Any] | None = None,
) -> Prediction:
    """Dry-run Python ``source`` (a cell's code, magics already translated) over a copy of ``namespace``.

    ``first_line`` numbers the source's first line in refusals (2 under a ``%%gpumem`` header); ``values``
    are set in the copy before the code runs (the batch search's NAME=value).
    """
    filename = f"<gpumem-dry-run-{next(_numbers)}>"
    try:
        code = compile(source, filename, "exec")
    except SyntaxError as error:
        line = None if error.lineno is None else error.lineno + first_line - 1
        return Prediction(refusal=Refusal(f"the cell is not valid Python: {error.msg}", line))

    def run(copied: dict[str, Any]) -> None:
        copied.update(values or {})
        exec(code, copied)  # noqa: S102 - the user's own cell, on copies

    return dry_run(run, namespace, filename=filename, first_line=first_line, skip=skip, capacity=capacity)


def assigns_name(source: str, name: str) -> bool:
    """Whether ``source`` binds ``name`` at its top level (then a batch search cannot set it)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if any(isinstance(sub, ast.Name) and sub.id == name for sub in ast.walk(target or ast.Pass())):
                return True
    return False


def search_batch(
    step: Callable[[int], Any], low: int, high: int, *, capacity: int | None = None, max_runs: int = 9
) -> BatchSearch:
    """The largest ``n`` in ``[low, high]`` for which a dry run of ``step(n)`` fits ``capacity`` bytes (default:
    the memory free on the device now), in at most ``max_runs`` dry runs. ``step(n)`` runs one step (or
    several) for a batch of ``n``; it is never run for real."""
    return search(lambda value: _predict_call(step, (value,), {}, capacity), low, high, max_runs=max_runs)
