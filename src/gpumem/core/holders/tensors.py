"""A tensor's storages on the devices asked for: the unit the walk counts, so views and aliases count once."""

from __future__ import annotations

from typing import Any, NamedTuple

from gpumem.core.holders.objects import own_dict

__all__ = ["DeviceFilter", "StorageKey", "storage_keys"]

# (device name, data pointer, nbytes): one storage.
StorageKey = tuple[str, int, int]

_MAX_SUBCLASS_DEPTH = 4  # wrapper subclasses nested in wrapper subclasses: stop looking after this many

# The tensors that make up a sparse tensor, by layout. A COO tensor's indices()/values() refuse an
# uncoalesced tensor; _indices()/_values() are its storage as it is.
_SPARSE_PARTS: dict[str, tuple[str, ...]] = {
    "torch.sparse_coo": ("_indices", "_values"),
    "torch.sparse_csr": ("crow_indices", "col_indices", "values"),
    "torch.sparse_bsr": ("crow_indices", "col_indices", "values"),
    "torch.sparse_csc": ("ccol_indices", "row_indices", "values"),
    "torch.sparse_bsc": ("ccol_indices", "row_indices", "values"),
}


class DeviceFilter(NamedTuple):
    """The devices whose storages count: ``kind`` None means every device, ``number`` None every one of a kind."""

    kind: str | None
    number: int | None

    def name_of(self, device: Any) -> str | None:
        """``"cuda:0"`` / ``"cpu"`` for a wanted ``torch.device``; None for others and for ``meta``."""
        kind = getattr(device, "type", None)
        if not isinstance(kind, str) or kind == "meta":
            return None
        index = getattr(device, "index", None)
        if self.kind is not None and kind != self.kind:
            return None
        if self.number is not None and index != self.number:
            return None
        return kind if index is None else f"{kind}:{index}"


def storage_keys(
    tensor: Any, devices: DeviceFilter, tensor_type: type, depth: int = 0
) -> list[tuple[StorageKey, int]]:
    """``(key, nbytes)`` of every storage behind ``tensor`` on a wanted device (sparse parts, subclass inners)."""
    try:
        device = tensor.device
        names = _DEVICE_NAMES.setdefault(devices, {})
        device_name = names[device] if device in names else names.setdefault(device, devices.name_of(device))
    except Exception:
        return []
    if device_name is None:
        return []
    try:
        layout = tensor.layout
        part_methods = _PARTS_BY_LAYOUT[layout] if layout in _PARTS_BY_LAYOUT else _layout_parts(layout)
    except Exception:
        part_methods = None  # read as strided
    try:
        if part_methods is None:
            storage = tensor.untyped_storage()
            nbytes = int(storage.nbytes())
            pointer = int(storage.data_ptr())
        else:
            parts = [getattr(tensor, method)() for method in part_methods]
    except Exception:  # a wrapper subclass has no storage of its own: its inner tensors do
        return _subclass_keys(tensor, devices, tensor_type, depth)
    if part_methods is None:
        return [((device_name, pointer, nbytes), nbytes)] if nbytes > 0 else []
    return [key for part in parts for key in storage_keys(part, devices, tensor_type, depth + 1)]


# Per-object caches of what never changes for a torch.device or torch.layout (both are hashable values):
# the walk reads them for every tensor, and deciding anew cost a third of its time.
_DEVICE_NAMES: dict[DeviceFilter, dict[Any, str | None]] = {}
_PARTS_BY_LAYOUT: dict[Any, tuple[str, ...] | None] = {}


def _layout_parts(layout: Any) -> tuple[str, ...] | None:
    """The sparse parts' methods of ``layout`` (None for strided and unknown layouts), cached."""
    parts = _SPARSE_PARTS.get(str(layout))
    _PARTS_BY_LAYOUT[layout] = parts
    return parts


def _subclass_keys(tensor: Any, devices: DeviceFilter, tensor_type: type, depth: int) -> list[tuple[StorageKey, int]]:
    """The storages of a traceable wrapper subclass's inner tensors (``__tensor_flatten__``)."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None or depth >= _MAX_SUBCLASS_DEPTH:
        return []
    keys: list[tuple[StorageKey, int]] = []
    try:
        inner_names, _ = flatten(tensor)
        for inner_name in inner_names:
            inner = own_dict(tensor)
            value = inner.get(inner_name) if inner is not None else None
            if isinstance(value, tensor_type):
                keys.extend(storage_keys(value, devices, tensor_type, depth + 1))
    except Exception:
        return keys
    return keys
