"""Sentences naming holders a row's figures alone would hide: a module's tensor attributes, reference cycles.

Both are cheap: the first reads what the walk recorded, the second only the garbage collector's flags and
``gc.garbage``'s length (never ``gc.get_objects`` or a collection, which ``%gpumem who --cycles`` runs on demand).
"""

from __future__ import annotations

import gc
from collections.abc import Mapping

from gpumem.core.holders.tensors import StorageKey
from gpumem.core.units import MIB, format_bytes

__all__ = ["CYCLES_COMMAND", "CYCLE_HINT_MIN_BYTES", "cycle_hint", "module_attribute_note"]

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
