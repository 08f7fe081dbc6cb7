"""Which storages an action releases: those its targets reach and nothing else does.

Two walks with the holder walk's rules (:mod:`gpumem.core.holders.walk`, no user code runs): one from
the targets, one from every other holder (the user's names and IPython's other references), each
followed into the autograd graphs its tensors keep (:mod:`gpumem.core.holders.graphs`). A storage is
counted once, by identity (device, data pointer, size): views and aliases of one storage are one.
Storages in both walks stay alive after the action and are not promised; the other holders reaching
them are named. Gradients a ``zero_grad`` drops are cut from the other walk where it reaches them as a
parameter's ``.grad`` (that reference is what the action removes); a name bound to the gradient itself
still counts as a holder.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

from gpumem.core.gc_pause import collector_paused
from gpumem.core.holders.graphs import GraphWalker, saved_by_graphs
from gpumem.core.holders.model import DEFAULT_MAX_ITEMS, GRADIENTS
from gpumem.core.holders.objects import type_name
from gpumem.core.holders.tensors import DeviceFilter, StorageKey
from gpumem.core.holders.walk import OutOfTimeError, Root, walk_root

__all__ = ["Released", "RootObjects", "expired", "reached_storages", "released_storages", "weak_refs"]

RootObjects = tuple[str, tuple[Any, ...]]  # a holder's name and the objects it keeps
_MAX_DEPTH = 8
_DEVICES = DeviceFilter(None, None)  # every device: a CPU tensor's storage counts as well


class Released(NamedTuple):
    """The storages only the targets reach (``freed``), and those other holders keep too."""

    freed: dict[StorageKey, int]
    shared: dict[StorageKey, int]
    shared_with: tuple[str, ...]  # the other holders reaching a target's storage, most bytes first
    complete: bool  # both walks finished within their limits


class _CutWalker(GraphWalker):
    """The holder walk, not following a parameter's ``.grad`` into the gradients the action sets to None."""

    def __init__(self, cut_gradients: set[int], tensors: list[Any] | None, *args: Any) -> None:
        super().__init__(*args)
        self.cut_gradients = cut_gradients
        self.tensors = tensors  # where to keep the tensors met (the targets' walk, for weak references)

    def tensor(self, tensor: Any, path: str, rank: int, category: str) -> list[StorageKey]:
        if category == GRADIENTS and id(tensor) in self.cut_gradients:
            return []
        keys = super().tensor(tensor, path, rank, category)
        if keys and self.tensors is not None:
            self.tensors.append(tensor)
        return keys


def released_storages(
    targets: Iterable[RootObjects],
    others: Iterable[RootObjects],
    *,
    cut_gradients: Iterable[Any] = (),
    time_budget_s: float = 5.0,
    tensors: list[Any] | None = None,
) -> Released:
    """Walk ``targets`` and ``others``; the storages only the targets reach are what releasing them frees.

    ``tensors``, when given, receives the tensors the targets reach (for :func:`weak_refs`): the caller must
    clear it before acting, or it would keep them alive itself.
    """
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        return Released({}, {}, (), complete=True)
    deadline = time.perf_counter() + time_budget_s
    cut = {id(gradient) for gradient in cut_gradients}
    with collector_paused():
        target_keys, _, target_done = _walk_group(torch, targets, set(), deadline, tensors)
        other_keys, other_roots, other_done = _walk_group(torch, others, cut, deadline, None)
    freed = {key: n for key, n in target_keys.items() if key not in other_keys}
    shared = {key: n for key, n in target_keys.items() if key in other_keys}
    return Released(freed, shared, _holders_of(shared, other_roots), complete=target_done and other_done)


def reached_storages(roots: Iterable[RootObjects], *, time_budget_s: float = 5.0) -> tuple[dict[StorageKey, int], bool]:
    """Every storage the roots reach (graphs included), and whether the walk finished."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        return {}, True
    with collector_paused():
        keys, _, done = _walk_group(torch, roots, set(), time.perf_counter() + time_budget_s, None)
    return keys, done


def _walk_group(
    torch: Any, group: Iterable[RootObjects], cut: set[int], deadline: float, tensors: list[Any] | None
) -> tuple[dict[StorageKey, int], list[Root], bool]:
    """Every storage the group's roots reach, directly or through the autograd graphs they keep."""
    walker = _CutWalker(cut, tensors, torch, _DEVICES, _MAX_DEPTH, DEFAULT_MAX_ITEMS, deadline)
    roots: list[Root] = []
    try:
        for order, (name, objects) in enumerate(group):
            roots.append(Root(name, type_name(objects[0]) if objects else "", order, hidden=False))
            walk_root(walker, roots[-1], objects, 0)
    except OutOfTimeError:
        walker.incomplete.add(id(walker.root))
    _, _, notes = saved_by_graphs(torch, walker, roots)
    keys = {key: walker.sizes[key] for root in roots for key in root.reach}
    keys.update(walker.saved_keys)
    return keys, roots, not walker.incomplete and not notes


def _holders_of(shared: dict[StorageKey, int], roots: list[Root]) -> tuple[str, ...]:
    """The roots reaching any of ``shared``, by the bytes of it they reach (largest first)."""
    reached = [(sum(n for key, n in shared.items() if key in root.reach), root.name) for root in roots]
    return tuple(name for nbytes, name in sorted(reached, key=lambda pair: (-pair[0], pair[1])) if nbytes)


def weak_refs(tensors: list[Any], keys: Iterable[StorageKey]) -> dict[StorageKey, Any]:
    """A weak reference to the storage of each of ``keys`` that one of ``tensors`` uses (to see which died).

    The references are torch's own (``UntypedStorage._weak_ref``); give them back with :func:`expired`.
    """
    wanted = set(keys)
    found: dict[StorageKey, Any] = {}
    for tensor in tensors:
        key, storage = _storage_of(tensor)
        if key in wanted and key not in found:
            found[key] = (type(storage), storage._weak_ref())  # noqa: SLF001 - torch's weak storage reference
    return found


def _storage_of(tensor: Any) -> tuple[StorageKey | None, Any]:
    """A plain tensor's storage key and storage; ``(None, None)`` for one without (sparse, wrapper)."""
    try:
        storage = tensor.untyped_storage()
        return (_device_name(tensor.device), int(storage.data_ptr()), int(storage.nbytes())), storage
    except Exception:
        return None, None


def expired(refs: dict[StorageKey, Any]) -> tuple[dict[StorageKey, int], dict[StorageKey, int]]:
    """``(gone, alive)``: the watched storages freed and those still held (the references are released)."""
    gone: dict[StorageKey, int] = {}
    alive: dict[StorageKey, int] = {}
    for key, (storage_type, ref) in refs.items():
        try:
            dead = bool(storage_type._expired(ref))  # noqa: SLF001
        finally:
            storage_type._free_weak_ref(ref)  # noqa: SLF001
        (gone if dead else alive)[key] = key[2]
    refs.clear()
    return gone, alive


def _device_name(device: Any) -> str:
    return device.type if device.index is None else f"{device.type}:{device.index}"
