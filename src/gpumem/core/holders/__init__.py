"""Who holds the memory: a bounded walk from named variables to tensors, storages counted once.

The walk starts at each name of a namespace and follows containers, ``nn.Module`` members, optimizer
state, and plain objects' own ``__dict__`` / ``__slots__`` to a bounded depth and time. It never calls
user code on the way: no properties, no ``__getattr__``, no ``__eq__`` / ``__hash__`` / ``__len__`` of
user classes (objects are tracked by ``id``, containers read through the built-in base methods).

Every tensor storage is attributed to exactly one row, so rows add up to the total without double
counting; a storage reached from several names is counted under the most direct one and the others
show it as ``shared_bytes``. IPython's own references (output cache, last exception) are walked
separately and listed as ``hidden``: they are what ``gpumem.free(deep=True)`` releases.

torch is never imported here: with no torch in ``sys.modules`` there can be no tensors to find.

Modules: :mod:`~.model` (rows, categories, limits), :mod:`~.objects` (reading objects without running
their code), :mod:`~.tensors` (storages), :mod:`~.walk` (the walk), :mod:`~.hidden` (IPython's
references), :mod:`~.attribution` (one owner per storage), :mod:`~.find` (entry points),
:mod:`~.render` (the report and its tables), :mod:`~.snapshot` (copying what other threads change),
:mod:`~.graphs` (what autograd graphs saved), :mod:`~.remainder` (what no row counts: workspaces,
rounding, the rest), :mod:`~.kinds` (the by-kind summary).
"""

from __future__ import annotations

from gpumem.core.holders.find import find_cycles, find_holders
from gpumem.core.holders.hidden import hidden_references, ipython_names
from gpumem.core.holders.holder_report import HolderReport, escape_html, render_html, render_text
from gpumem.core.holders.model import (
    BUFFERS,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_ITEMS,
    DEFAULT_TIME_BUDGET_S,
    FREE_COMMAND,
    GRADIENTS,
    OPTIMIZER_STATE,
    OTHER,
    PARAMETERS,
    TENSORS,
    CycleReport,
    HiddenReference,
    Holder,
    KindTotal,
)
from gpumem.core.holders.remainder import Remainder
from gpumem.core.readers.devices import parse_device

__all__ = [
    "BUFFERS",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_ITEMS",
    "DEFAULT_TIME_BUDGET_S",
    "FREE_COMMAND",
    "GRADIENTS",
    "OPTIMIZER_STATE",
    "OTHER",
    "PARAMETERS",
    "TENSORS",
    "CycleReport",
    "HiddenReference",
    "Holder",
    "HolderReport",
    "KindTotal",
    "Remainder",
    "escape_html",
    "find_cycles",
    "find_holders",
    "hidden_references",
    "ipython_names",
    "parse_device",
    "render_html",
    "render_text",
]
