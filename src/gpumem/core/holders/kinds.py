"""Who holds it, by kind: parameters, gradients, optimizer state, ..., workspaces, unattributed.

The kinds add up to ``memory_allocated`` when it is known (the remainder's parts are its last lines),
else to what the walk found.
"""

from __future__ import annotations

from gpumem.core.holders.model import (
    ACTIVATIONS,
    BUFFERS,
    FREE_COMMAND,
    GRADIENTS,
    IPYTHON_HELD,
    OPTIMIZER_STATE,
    OTHER,
    OTHER_TENSORS,
    PARAMETERS,
    ROUNDING,
    TENSORS,
    UNATTRIBUTED,
    WORKSPACES,
    Holder,
    KindTotal,
)
from gpumem.core.holders.remainder import Remainder
from gpumem.core.readers.workspaces import CLEAR_CALL
from gpumem.core.units import format_bytes

__all__ = ["kind_totals", "workspace_note"]

_ROW_KINDS = ((PARAMETERS,), (GRADIENTS,), (OPTIMIZER_STATE,), (BUFFERS,), (TENSORS, OTHER))


def kind_totals(
    user_rows: list[Holder], hidden_bytes: int, graph_saved_bytes: int, remainder: Remainder | None
) -> tuple[KindTotal, ...]:
    """The by-kind summary; kinds with no bytes are left out (except an unexplained remainder below zero)."""
    by_category: dict[str, int] = {}
    for row in user_rows:
        for category, nbytes in row.breakdown.items():
            by_category[category] = by_category.get(category, 0) + nbytes
    totals: list[KindTotal] = []
    for categories in _ROW_KINDS:
        nbytes = sum(by_category.get(category, 0) for category in categories)
        name = OTHER_TENSORS if categories[0] == TENSORS else categories[0]
        totals.append(KindTotal(name, nbytes))
    totals.append(KindTotal(ACTIVATIONS, graph_saved_bytes, "freed by backward(), or when the output is deleted"))
    totals.append(KindTotal(IPYTHON_HELD, hidden_bytes, f"released by {FREE_COMMAND}"))
    if remainder is not None:
        estimate = bool(remainder.workspace_bytes) and not remainder.workspaces_confirmed
        totals.append(KindTotal(WORKSPACES, remainder.workspace_bytes, workspace_note(remainder), estimate))
        rounding_note = "blocks are 512-byte multiples" + ("" if remainder.blocks_read else " (computed from sizes)")
        totals.append(KindTotal(ROUNDING, remainder.rounding_bytes, rounding_note))
        # What the estimate took as workspaces is no longer unattributed: that figure is the estimate's other side.
        totals.append(KindTotal(UNATTRIBUTED, remainder.unexplained_bytes, _unexplained_note(remainder), estimate))
    return tuple(total for total in totals if total.nbytes or (total.kind == UNATTRIBUTED and total.nbytes < 0))


def workspace_note(remainder: Remainder) -> str:
    """What the workspace figure is, how sure it is, and how to release it."""
    if not remainder.workspace_count:
        return ""
    each = format_bytes(remainder.workspace_each_bytes)
    how = "matched to allocator blocks" if remainder.workspaces_confirmed else f"estimate, {each} each"
    count = f"{remainder.workspace_count} x " if remainder.workspace_count > 1 else ""
    return f"{count}kept by PyTorch for matmuls, {how}; released by {CLEAR_CALL} or %gpumem free --workspaces"


def _unexplained_note(remainder: Remainder) -> str:
    if remainder.unexplained_bytes < 0:
        return "negative: memory changed during the walk"
    where = "tensors reachable from no name (closures, C++ objects, other threads, or beyond the walk's limits)"
    if remainder.unexplained_blocks is not None:
        return f"{remainder.unexplained_blocks} blocks: {where}"
    return where
