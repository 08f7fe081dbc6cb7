"""Sentences naming holders a row's figures alone would hide: a module's tensor attributes, reference cycles,
numpy arrays (host memory the walk, which follows torch tensors, does not list).

All are cheap: the first reads what the walk recorded, the second only the garbage collector's flags and
``gc.garbage``'s length (never ``gc.get_objects`` or a collection, which ``%gpumem who --cycles`` runs on demand),
the third only the namespace's own names (never inside containers or objects).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Mapping
from typing import Any

from gpumem.core.holders.objects import stable_list
from gpumem.core.holders.tensors import StorageKey
from gpumem.core.units import MIB, format_bytes

__all__ = [
    "ARRAY_NOTE_MIN_BYTES",
    "CYCLES_COMMAND",
    "CYCLE_HINT_MIN_BYTES",
    "array_note",
    "cycle_hint",
    "module_attribute_note",
]

CYCLES_COMMAND = "%gpumem who --cycles"
# Below this, the remainder is explained by the cuBLAS workspace (32 MiB on an H200) and allocator rounding.
CYCLE_HINT_MIN_BYTES = 64 * MIB
_ATTRIBUTES_NAMED = 3


def module_attribute_note(attribute_paths: Mapping[StorageKey, str], sizes: Mapping[StorageKey, int]) -> str:
    """``"att.cache 256.0 MiB (tensor attribute of a module, not a parameter or buffer)"``, largest first."""
    if not attribute_paths:
        return ""
    per_path: dict[str, int] = {}
    for key, path in attribute_paths.items():
        per_path[path] = per_path.get(path, 0) + sizes.get(key, 0)
    ranked = sorted(per_path.items(), key=lambda item: (-item[1], item[0]))
    named = ", ".join(f"{path} {format_bytes(nbytes)}" for path, nbytes in ranked[:_ATTRIBUTES_NAMED])
    if len(ranked) == 1:
        return f"{named} (tensor attribute of a module, not a parameter or buffer)"
    rest = ranked[_ATTRIBUTES_NAMED:]
    if rest:
        named += f" and {len(rest)} more ({format_bytes(sum(nbytes for _, nbytes in rest))})"
    return f"{named} (tensor attributes of modules, not parameters or buffers)"


def cycle_hint(unattributed_bytes: int | None) -> str:
    """Whether memory no name holds may be kept by reference cycles, worded as a possibility; "" when small.

    Only a collection can tell for sure (and it frees them), so this never claims more than "may".
    """
    if unattributed_bytes is None or unattributed_bytes < CYCLE_HINT_MIN_BYTES:
        return ""
    garbage = len(gc.garbage)
    if garbage:
        return (
            f"gc.garbage keeps {garbage:,} unreachable objects alive, and so any tensors they hold: "
            "`gc.garbage.clear()` releases them"
        )
    if not gc.isenabled():
        return (
            "the garbage collector is off (gc.disable()), so tensors kept only by reference cycles stay "
            f"until gc.collect(): `{CYCLES_COMMAND}` collects once and shows them"
        )
    return (
        "some of it may be tensors kept only by reference cycles, freed at Python's next full garbage "
        f"collection: `{CYCLES_COMMAND}` collects now and shows them"
    )


# Below this, arrays are not worth a line under a table of tensor memory.
ARRAY_NOTE_MIN_BYTES = MIB


def array_note(namespace: Mapping[str, Any]) -> str:
    """``"numpy arrays, host memory not listed here (who names torch tensors only): big 256.0 MiB"``, largest
    first; "" when numpy is not imported or the namespace's names hold less than :data:`ARRAY_NOTE_MIN_BYTES`.

    Only names of the namespace are read (not what containers or objects hold; not IPython's ``_N``);
    an array that is a view of another is counted as the array whose memory it shares, once.
    Nothing of the user's runs: types are compared, and ``base``/``nbytes`` read through ndarray's own descriptors.
    """
    numpy = sys.modules.get("numpy")
    ndarray = getattr(numpy, "ndarray", None)
    if not isinstance(ndarray, type):
        return ""
    owners: dict[int, tuple[str, int]] = {}  # id of the array owning the memory -> (first name, bytes)
    for name, value in stable_list(namespace.items):
        if not isinstance(name, str) or name.startswith("_") or not issubclass(type(value), ndarray):
            continue
        owner = _memory_owner(value, ndarray)
        owners.setdefault(id(owner), (name, ndarray.nbytes.__get__(owner)))  # type: ignore[attr-defined]
    ranked = sorted(owners.values(), key=lambda item: (-item[1], item[0]))
    if sum(nbytes for _, nbytes in ranked) < ARRAY_NOTE_MIN_BYTES:
        return ""
    named = ", ".join(f"{name} {format_bytes(nbytes)}" for name, nbytes in ranked[:_ATTRIBUTES_NAMED])
    rest = ranked[_ATTRIBUTES_NAMED:]
    if rest:
        named += f" and {len(rest)} more ({format_bytes(sum(nbytes for _, nbytes in rest))})"
    return f"numpy arrays, host memory not listed here (who names torch tensors only): {named}"


def _memory_owner(array: Any, ndarray: type) -> Any:
    """The array whose memory ``array`` uses: itself, or the array at the end of its chain of views."""
    base_of = ndarray.base.__get__  # type: ignore[attr-defined]
    owner = array
    for _ in range(64):  # a chain of views of views; numpy itself collapses most of them
        base = base_of(owner)
        if not issubclass(type(base), ndarray):
            return owner
        owner = base
    return owner
