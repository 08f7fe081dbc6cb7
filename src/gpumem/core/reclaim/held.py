"""What reclaim actions reach of the user's session: names, IPython's output cache, the last exception.

:class:`HeldReferences` is the interface the actions need; :class:`ShellReferences` provides it for an
IPython shell, read duck-typed as :mod:`gpumem.core.holders.hidden` reads it (core imports no IPython:
the shell object is handed in by the layer that has one), and :class:`NamespaceReferences` for a plain
namespace (a script: no output cache; the last exception is ``sys``'s).
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping
from typing import Any, Protocol

from gpumem.core.cleanup import cell_running, release_last_exception, release_output
from gpumem.core.holders.hidden import hidden_references, ipython_names, last_error_places
from gpumem.core.holders.objects import ATOMIC_TYPES, stable_list
from gpumem.core.reclaim.storages import RootObjects

__all__ = ["OUTPUT_ALIASES", "HeldReferences", "NamespaceReferences", "ShellReferences"]

OUTPUT_ALIASES = ("_", "__", "___", "last result")


class HeldReferences(Protocol):
    """The holders a reclaim action may release or must respect."""

    def user_roots(self) -> list[RootObjects]:
        """The user's own names and what each holds (IPython's names left out)."""
        ...

    def output_roots(self) -> list[RootObjects]:
        """IPython's output cache: one root per ``Out[N]``, then ``_`` / ``__`` / ``___`` / the last result."""
        ...

    def exception_roots(self) -> list[RootObjects]:
        """Every place the last exception or its traceback is kept, as one root (empty without one)."""
        ...

    def cell_running(self) -> bool:
        """Whether a cell executes now (the display hook may then move ``_``: aliases are left alone)."""
        ...

    def release_outputs(self, names: list[str], *, aliases: bool) -> tuple[list[str], list[str]]:
        """Drop the output-cache entries ``names`` (``"Out[3]"``); ``(released, kept)``."""
        ...

    def release_exception(self) -> tuple[list[str], list[str]]:
        """Drop the last exception's frames; ``(released, kept)``."""
        ...

    def unbind(self, name: str) -> bool:
        """``del name`` in the user's namespace; False if it was not bound."""
        ...


class NamespaceReferences:
    """A plain namespace: its names; the last exception as ``sys`` keeps it; no output cache."""

    def __init__(self, namespace: MutableMapping[str, Any]) -> None:
        self.namespace = namespace

    def user_roots(self) -> list[RootObjects]:
        return _roots(self.namespace, set())

    def output_roots(self) -> list[RootObjects]:
        return []

    def exception_roots(self) -> list[RootObjects]:
        return _exception_roots(None)

    def cell_running(self) -> bool:
        return False

    def release_outputs(self, names: list[str], *, aliases: bool) -> tuple[list[str], list[str]]:  # noqa: ARG002
        return [], []

    def release_exception(self) -> tuple[list[str], list[str]]:
        released = [name for name in ("last_traceback", "last_value", "last_exc") if getattr(sys, name, None)]
        for name in released:
            setattr(sys, name, None)
        return [f"sys.{name}" for name in released], []

    def unbind(self, name: str) -> bool:
        return self.namespace.pop(name, _MISSING) is not _MISSING


class ShellReferences:
    """An IPython shell's user namespace, output cache and last exception (the shell read duck-typed)."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell

    def user_roots(self) -> list[RootObjects]:
        user_ns = getattr(self.shell, "user_ns", None)
        if not isinstance(user_ns, dict):
            return []
        return _roots(user_ns, ipython_names(self.shell))

    def output_roots(self) -> list[RootObjects]:
        roots = [(ref.name, ref.objects) for ref in hidden_references(self.shell) if not _is_exception(ref.name)]
        seen = {(name, id(objects[0])) for name, objects in roots}
        # The aliases of an Out[N] entry are part of its row; they are roots of their own here, so that an
        # action that leaves them (while a cell runs) counts them as holders.
        for name, value in _alias_values(self.shell):
            if (name, id(value)) not in seen:
                seen.add((name, id(value)))
                roots.append((name, (value,)))
        return roots

    def exception_roots(self) -> list[RootObjects]:
        return _exception_roots(self.shell)

    def cell_running(self) -> bool:
        return cell_running(self.shell)

    def release_outputs(self, names: list[str], *, aliases: bool) -> tuple[list[str], list[str]]:
        released: list[str] = []
        kept: list[str] = []
        wanted = set(names)
        for name, objects in self.output_roots():
            if name in wanted and (aliases or name.startswith("Out[")):
                done, left = release_output(self.shell, objects[0], name, aliases=aliases)
                released.extend(done)
                kept.extend(left)
        return released, kept

    def release_exception(self) -> tuple[list[str], list[str]]:
        return release_last_exception(self.shell)

    def unbind(self, name: str) -> bool:
        user_ns = getattr(self.shell, "user_ns", None)
        return isinstance(user_ns, dict) and user_ns.pop(name, _MISSING) is not _MISSING


_MISSING = object()


def _is_exception(name: str) -> bool:
    return name.startswith("last exception")


def _roots(namespace: MutableMapping[str, Any], skip: set[str]) -> list[RootObjects]:
    roots: list[RootObjects] = []
    for name, value in stable_list(namespace.items):
        if not isinstance(name, str) or name in skip or type(value) in ATOMIC_TYPES:
            continue
        if name.startswith("__") and name.endswith("__"):
            continue
        roots.append((name, (value,)))
    return roots


def _alias_values(shell: Any) -> list[tuple[str, Any]]:
    """``_`` / ``__`` / ``___`` (namespace, hidden copy, display hook) and the last result, where set."""
    user_ns = getattr(shell, "user_ns", {}) or {}
    hidden_ns = getattr(shell, "user_ns_hidden", {}) or {}
    displayhook = getattr(shell, "displayhook", None)
    found: list[tuple[str, Any]] = []
    for name in OUTPUT_ALIASES[:3]:
        values = (user_ns.get(name), hidden_ns.get(name), getattr(displayhook, name, None))
        found.extend((name, value) for value in values if value is not None and type(value) not in ATOMIC_TYPES)
    last = getattr(getattr(shell, "last_execution_result", None), "result", None)
    if last is not None and type(last) not in ATOMIC_TYPES:
        found.append(("last result", last))
    return found


def _exception_roots(shell: Any) -> list[RootObjects]:
    objects = tuple(value for _, value in last_error_places(shell) if value is not None)
    return [("last exception", objects)] if objects else []
