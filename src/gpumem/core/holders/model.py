"""What the holder walk reports: rows (one per name or IPython reference), the byte categories, the limits."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = [
    "ACTIVATIONS",
    "BUFFERS",
    "CATEGORY_ORDER",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_ITEMS",
    "DEFAULT_TIME_BUDGET_S",
    "FREE_COMMAND",
    "GRADIENTS",
    "HIDDEN_RANK",
    "IPYTHON_HELD",
    "MAX_GRAPH_PATHS",
    "OPTIMIZER_STATE",
    "OTHER",
    "OTHER_TENSORS",
    "PARAMETERS",
    "ROUNDING",
    "TENSORS",
    "UNATTRIBUTED",
    "WORKSPACES",
    "CycleReport",
    "HiddenReference",
    "Holder",
    "KindTotal",
]

DEFAULT_MAX_DEPTH = 5
DEFAULT_TIME_BUDGET_S = 1.0
DEFAULT_MAX_ITEMS = 10_000
MAX_GRAPH_PATHS = 8
FREE_COMMAND = "%gpumem free --deep"

# Categories of bytes in a row's breakdown.
PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATE = "optimizer state"
BUFFERS = "buffers"
TENSORS = "tensors"
OTHER = "other"
CATEGORY_ORDER = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, BUFFERS, TENSORS, OTHER)

# Kinds of the by-kind summary (the categories above, then what no row counts).
ACTIVATIONS = "activations (saved by autograd graphs)"
OTHER_TENSORS = "other tensors"
IPYTHON_HELD = "held by IPython"
WORKSPACES = "cuBLAS workspaces"
ROUNDING = "allocator rounding"
UNATTRIBUTED = "unattributed"

# Hidden (IPython-held) references always rank after every user name.
HIDDEN_RANK = 1_000


class Holder(NamedTuple):
    """One name (or one IPython reference) and the tensor memory counted under it.

    ``nbytes`` is the memory attributed to this row (each storage is attributed to one row only);
    ``shared_bytes`` is memory this name also reaches but that is counted under another row
    (``shared_with`` names them). ``graph_paths`` are paths of reached tensors that carry a
    ``grad_fn``: each keeps its autograd graph (and the activations it saved) alive. ``complete`` is
    False when the walk stopped early inside this name (a limit or an error): ``nbytes`` is then a
    lower bound.
    """

    name: str
    type_name: str
    device: str
    nbytes: int
    shared_bytes: int
    tensor_count: int
    graph_paths: tuple[str, ...]
    breakdown: dict[str, int]
    shared_with: tuple[str, ...] = ()
    note: str = ""
    complete: bool = True
    graph_saved_bytes: int = 0  # storages only this row's autograd graphs keep (not in nbytes)


class KindTotal(NamedTuple):
    """One line of the by-kind summary: a kind, its bytes, and what it means or how to release it."""

    kind: str
    nbytes: int
    note: str = ""
    estimate: bool = False  # inferred from sizes: workspaces the blocks could not confirm, and the rest beside them


class CycleReport(NamedTuple):
    """Tensors found in unreachable reference cycles by one ``gc`` pass (those cycles are then freed)."""

    nbytes: int
    tensor_count: int
    object_count: int
    member_types: tuple[tuple[str, int], ...]  # (type name, count) of the cycles' members, most common first


class HiddenReference(NamedTuple):
    """One place IPython keeps an object alive: a row name, the objects, and how to release them."""

    name: str
    objects: tuple[Any, ...]
    note: str
