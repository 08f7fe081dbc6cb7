"""Reclaim actions with a promise: the bytes each will return, computed before, and the bytes measured after.

Modules: :mod:`~.promises` (the promise in the allocator's blocks and segments, and the outcome),
:mod:`~.storages` (which storages only the targets hold), :mod:`~.held` (the session's holders: names,
IPython's output cache, the last exception), :mod:`~.actions` (the actions).
"""

from __future__ import annotations

from gpumem.core.reclaim.actions import available_actions, perform, promise
from gpumem.core.reclaim.held import HeldReferences, NamespaceReferences, ShellReferences
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
)

__all__ = [
    "CACHE",
    "EXCEPTION",
    "GRADIENTS",
    "OUTPUTS",
    "UNBIND",
    "WORKSPACES",
    "DeviceBytes",
    "HeldReferences",
    "NamespaceReferences",
    "Outcome",
    "Promise",
    "ShellReferences",
    "available_actions",
    "perform",
    "promise",
]
