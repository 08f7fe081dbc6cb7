"""Reclaim actions: what each will return (:func:`promise`), and doing it, measured (:func:`perform`).

Each action releases one kind of holder and then empties the allocator's cache, so that what it frees
goes back to the device too: IPython's output-cache entries that reach tensors (``outputs``), the last
exception's frames (``exception``), a model's gradients (``gradients:<name>``, ``zero_grad(set_to_none=True)``),
the cuBLAS workspaces (``workspaces``), the cache alone (``cache``), one name (``unbind:<name>``).

:func:`perform` computes the promise again just before it acts (the session may have changed since a
label was drawn), holds no reference to what it releases while it acts (only torch's weak storage
references, to see which storages died), collects cycles only when a promised storage survived the
release, and reads the allocator's counters right before and after: the result is measured, exactly.
Actions and :func:`gpumem.core.cleanup.free` run one at a time, from any thread, also while a cell runs.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from gpumem.core.cleanup import empty_cache, free_lock
from gpumem.core.diagnoses.fragmentation import read_segments
from gpumem.core.holders.objects import own_dict
from gpumem.core.readers.workspaces import clear_cublas_workspaces, workspace_sizes
from gpumem.core.reclaim.held import HeldReferences
from gpumem.core.reclaim.promises import (
    CACHE,
    EXCEPTION,
    GRADIENTS,
    OUTPUTS,
    UNBIND,
    WORKSPACES,
    DeviceBytes,
    Outcome,
    Promise,
    allocator_promise,
    workspace_blocks,
)
from gpumem.core.reclaim.storages import RootObjects, expired, reached_storages, released_storages, weak_refs

__all__ = ["available_actions", "perform", "promise"]

_Release = Callable[[], tuple[list[str], list[str]]]


class _Spec(NamedTuple):
    """One action, resolved against the session: what it releases, what else holds memory, how to act."""

    action: str
    label: str
    targets: list[RootObjects]
    others: list[RootObjects]
    cut: tuple[Any, ...]
    release: _Release
    workspaces: bool = False


def available_actions(held: HeldReferences) -> list[str]:
    """The actions that can apply now: outputs and the exception when IPython keeps any, a gradients action per
    model whose parameters have gradients, workspaces and cache once CUDA is initialized, in that order."""
    found: list[str] = []
    if any(reached_storages([root])[0] for root in held.output_roots()):
        found.append(OUTPUTS)
    if held.exception_roots():
        found.append(EXCEPTION)
    found.extend(f"{GRADIENTS}:{name}" for name, objects in held.user_roots() if _gradients(objects[0]))
    if _cuda_initialized():
        found.extend((WORKSPACES, CACHE))
    return found


def promise(action: str, held: HeldReferences, source: Any = None) -> Promise:
    """What ``action`` will return now, before it runs. Raises LookupError for an action that cannot apply.

    It only reads (no lock: a Free or an action clicked meanwhile is not kept waiting by a walk)."""
    result, _ = _promise(_spec(action, held), _source(source), keep=False)
    return result


def perform(action: str, held: HeldReferences, source: Any = None) -> Outcome:
    """Do ``action`` and measure it: the allocator's counters right before and after, per device.

    Never raises for a failure of the action itself: the outcome says what went wrong.
    """
    started = time.perf_counter()
    source = _source(source)
    with free_lock:
        try:
            spec = _spec(action, held)
        except LookupError as error:
            empty = Promise(action, action, (), 0, 0, exact=True)
            return Outcome(empty, (), (), (), 0, 0, 0, time.perf_counter() - started, str(error))
        promised, refs = _promise(spec, source, keep=True)
        release, workspaces = spec.release, spec.workspaces
        del spec  # holds the targets: nothing here may keep them alive while they are released
        before = _readings(source)
        try:
            released, _kept = release()
            if workspaces:
                _clear_workspaces()
            gone, alive = _settle(refs)
            note = empty_cache(source)
        except Exception as error:
            expired(refs)
            return Outcome(promised, before, (), (), 0, 0, 0, time.perf_counter() - started, f"{error}")
        after = _readings(source)
    return Outcome(
        promised, before, after, tuple(released), len(gone), len(alive), sum(alive.values()),
        time.perf_counter() - started, note,
    )  # fmt: skip


def _spec(action: str, held: HeldReferences) -> _Spec:
    kind, _, name = action.partition(":")
    users = held.user_roots()
    outputs = held.output_roots()
    exception = held.exception_roots()
    if kind == OUTPUTS:
        return _outputs_spec(held, users, outputs, exception)
    if kind == EXCEPTION:
        return _Spec(action, "Drop the last exception's frames", exception, users + outputs, (), held.release_exception)
    if kind == GRADIENTS:
        model = next((objects[0] for root, objects in users if root == name), None)
        grads = _gradients(model)
        if not grads:
            raise LookupError(f"{name} is not a model with gradients")
        zero = _zero_grad(model)
        return _Spec(action, f"Drop {name}'s gradients", [(f"{name} gradients", grads)], users + outputs + exception,
                     grads, zero)  # fmt: skip
    if kind == UNBIND:
        target = [root for root in users if root[0] == name]
        if not target:
            raise LookupError(f"{name} is not bound")
        others = [root for root in users if root[0] != name] + outputs + exception
        return _Spec(action, f"del {name}", target, others, (), lambda: ([name] if held.unbind(name) else [], []))
    if kind in (WORKSPACES, CACHE):
        if not _cuda_initialized():
            raise LookupError("CUDA is not initialized")
        label = "Clear cuBLAS workspaces" if kind == WORKSPACES else "Empty the cache"
        return _Spec(action, label, [], users + outputs + exception, (), lambda: ([], []), kind == WORKSPACES)
    raise LookupError(f"unknown action {action!r}")


def _outputs_spec(
    held: HeldReferences, users: list[RootObjects], outputs: list[RootObjects], exception: list[RootObjects]
) -> _Spec:
    """The output-cache references that reach tensors; while a cell runs only ``Out[N]`` / ``_N`` (the aliases
    stay, as holders)."""
    aliases = not held.cell_running()
    # Only the entries that reach tensor memory: a result without tensors stays in Out (as in free(deep=True)).
    holding = [root for root in outputs if reached_storages([root])[0]]
    targets = [root for root in holding if aliases or root[0].startswith("Out[")]
    kept = [root for root in holding if root not in targets]
    names = [name for name, _ in targets]
    label = "Release Out[…]" if not names else f"Release {_names_text(names)}"
    return _Spec(OUTPUTS, label, targets, users + kept + exception, (),
                 lambda: held.release_outputs(names, aliases=aliases))  # fmt: skip


def _names_text(names: list[str]) -> str:
    shown = [name for name in names if name.startswith("Out[")] or names
    return ", ".join(shown[:2]) + (f" +{len(shown) - 2}" if len(shown) > 2 else "")  # noqa: PLR2004


def _promise(spec: _Spec, source: Any, *, keep: bool) -> tuple[Promise, dict[Any, Any]]:
    """The promise, and weak references to the storages it promises (when ``keep``)."""
    tensors: list[Any] = []
    released = released_storages(spec.targets, spec.others, cut_gradients=spec.cut, tensors=tensors)
    refs = weak_refs(tensors, released.freed) if keep else {}
    tensors.clear()
    segments = read_segments(source)
    devices = tuple(source.cuda_devices()) if _cuda_initialized() or segments is not None else ()
    extra: list[tuple[str, int]] = []
    note = ""
    if spec.workspaces:
        known, done = reached_storages(spec.others)
        sizes = {f"cuda:{n}": (s.cublas_bytes, s.cublaslt_bytes) for n in devices if (s := workspace_sizes(n))}
        blocks = workspace_blocks(segments, known, sizes)
        extra = [address for address, _ in blocks]
        note = f"{len(blocks)} workspace block{'' if len(blocks) == 1 else 's'}"
        released = released._replace(complete=released.complete and done)
    per_device, exact = allocator_promise(released.freed, segments, devices, extra_blocks=extra)
    if not devices:
        per_device = ()
    result = Promise(
        action=spec.action,
        label=spec.label,
        devices=per_device,
        storage_count=len(released.freed),
        storage_bytes=sum(released.freed.values()),
        exact=exact and released.complete,
        kept_by=released.shared_with,
        kept_bytes=sum(released.shared.values()),
        note=note,
        host_bytes=sum(n for key, n in released.freed.items() if not key[0].startswith("cuda")),
    )
    return result, refs


def _settle(refs: dict[Any, Any]) -> tuple[dict[Any, int], dict[Any, int]]:
    """Which promised storages died; a collection runs only if some survived the release (cycles)."""
    if any(not storage_type._expired(ref) for storage_type, ref in refs.values()):  # noqa: SLF001
        gc.collect()
    return expired(refs)


def _readings(source: Any) -> tuple[DeviceBytes, ...]:
    try:
        snapshot = source.snapshot()
    except Exception:
        return ()
    return tuple(DeviceBytes(r.device, r.allocated_bytes, r.reserved_bytes) for r in snapshot.allocator)


def _source(source: Any) -> Any:
    if source is not None:
        return source
    from gpumem.core.monitoring.monitor import default_monitor

    return default_monitor().source


def _cuda_initialized() -> bool:
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        return cuda is not None and bool(cuda.is_initialized())
    except Exception:
        return False


def _clear_workspaces() -> None:
    torch = sys.modules.get("torch")
    if torch is not None:
        clear_cublas_workspaces(torch)


def _gradients(model: Any) -> tuple[Any, ...]:
    """The gradients of a module's parameters (read through the modules' own dicts, no user code), or ()."""
    module_type = getattr(getattr(sys.modules.get("torch"), "nn", None), "Module", None)
    if module_type is None or not isinstance(model, module_type):
        return ()
    grads: dict[int, Any] = {}
    stack, seen = [model], set()
    while stack:
        own = own_dict(stack.pop())
        if own is None or id(own) in seen:
            continue
        seen.add(id(own))
        for param in dict(own.get("_parameters") or {}).values():
            grad = getattr(param, "grad", None) if param is not None else None
            if grad is not None:
                grads[id(grad)] = grad
        stack.extend(child for child in dict(own.get("_modules") or {}).values() if child is not None)
    return tuple(grads.values())


def _zero_grad(model: Any) -> _Release:
    def release() -> tuple[list[str], list[str]]:
        model.zero_grad(set_to_none=True)
        return ["zero_grad(set_to_none=True)"], []

    return release
