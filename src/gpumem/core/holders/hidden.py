"""IPython's own references to user objects: the output cache, its ``_`` aliases and the last exception.

The shell is duck-typed (core never imports IPython): ``user_ns``, ``user_ns_hidden``, ``displayhook``,
``last_execution_result`` and ``InteractiveTB`` are read with ``getattr`` and may be missing. The namespace
is copied before it is read: a widget thread may list holders while a cell adds names.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from gpumem.core.holders.model import HiddenReference
from gpumem.core.holders.objects import ATOMIC_TYPES, stable_list

__all__ = ["hidden_references", "ipython_names", "last_error_places"]

# Names IPython puts into the user namespace (its own section covers what they hold).
_IPYTHON_NAMES = frozenset({"In", "Out", "_ih", "_oh", "_dh", "exit", "quit", "get_ipython", "_exit_code"})
_IPYTHON_NAME_RE = re.compile(r"^(_+|_\d+|_i+|_i\d+)$")
_OUTPUT_ALIASES = ("_", "__", "___")
_MISSING = object()


def ipython_names(shell: Any) -> set[str]:
    """Names in ``shell.user_ns`` that IPython manages (output cache aliases, input history, helpers)."""
    user_ns: dict[str, Any] = shell.user_ns
    hidden: dict[str, Any] = getattr(shell, "user_ns_hidden", {}) or {}
    out_ids = {id(value) for value in stable_list(_output_cache(user_ns).values)}
    displayhook = getattr(shell, "displayhook", None)
    return {
        name
        for name, value in stable_list(user_ns.items)
        if isinstance(name, str) and _is_ipython_name(name, value, hidden, out_ids, displayhook)
    }


def _is_ipython_name(name: str, value: Any, hidden: dict[str, Any], out_ids: set[int], displayhook: Any) -> bool:
    if name in _IPYTHON_NAMES:
        return True
    set_by_ipython = hidden.get(name, _MISSING) is value
    if _IPYTHON_NAME_RE.match(name):
        return (
            set_by_ipython
            or id(value) in out_ids
            or (name in _OUTPUT_ALIASES and getattr(displayhook, name, None) is value)
            or name.startswith("_i")
        )
    return set_by_ipython and name.startswith("_")


def hidden_references(shell: Any) -> list[HiddenReference]:
    """IPython's output cache entries and the last exception, as rows to walk."""
    user_ns: dict[str, Any] = shell.user_ns
    hidden_ns: dict[str, Any] = getattr(shell, "user_ns_hidden", {}) or {}
    displayhook = getattr(shell, "displayhook", None)
    covered: set[int] = set()
    refs = _output_references(user_ns, hidden_ns, covered)
    refs.extend(_alias_references(hidden_ns, displayhook, covered))
    last_result = getattr(getattr(shell, "last_execution_result", None), "result", None)
    if last_result is not None and type(last_result) not in ATOMIC_TYPES and id(last_result) not in covered:
        refs.append(HiddenReference("last result", (last_result,), "shell.last_execution_result.result"))
    error = _last_error_reference(shell)
    if error is not None:
        refs.append(error)
    return refs


def _output_cache(user_ns: dict[str, Any]) -> dict[Any, Any]:
    out = user_ns.get("_oh")
    return out if isinstance(out, dict) else {}


def _output_references(user_ns: dict[str, Any], hidden_ns: dict[str, Any], covered: set[int]) -> list[HiddenReference]:
    """One row per ``Out[N]``, noting the aliases (``_N``, ``_``, ...) that point to the same value."""
    refs: list[HiddenReference] = []
    entries = stable_list(_output_cache(user_ns).items)
    for number, value in sorted(entries, key=lambda item: item[0] if isinstance(item[0], int) else 0):
        aliases = [f"_{number}"]
        aliases.extend(name for name in _OUTPUT_ALIASES if user_ns.get(name) is value or hidden_ns.get(name) is value)
        covered.add(id(value))
        refs.append(HiddenReference(f"Out[{number}]", (value,), "also " + ", ".join(aliases)))
    return refs


def _alias_references(hidden_ns: dict[str, Any], displayhook: Any, covered: set[int]) -> list[HiddenReference]:
    """Results that are no longer in Out (culled, or Out cleared by hand) but still in _, __, ___."""
    refs: list[HiddenReference] = []
    for name in _OUTPUT_ALIASES:
        for value in (hidden_ns.get(name), getattr(displayhook, name, None) if displayhook is not None else None):
            if value is None or type(value) in ATOMIC_TYPES or id(value) in covered:
                continue
            covered.add(id(value))
            refs.append(HiddenReference(name, (value,), "output-cache alias"))
    return refs


def _last_error_reference(shell: Any) -> HiddenReference | None:
    """Every place the last exception (or its traceback) is kept, as one row."""
    places = [(label, value) for label, value in last_error_places(shell) if value is not None]
    if not places:
        return None
    objects = tuple(value for _, value in places)
    name = next(
        (f"last exception ({type(value).__name__})" for value in objects if isinstance(value, BaseException)),
        "last exception",
    )
    return HiddenReference(name, objects, ", ".join(label for label, _ in places))


def last_error_places(shell: Any) -> list[tuple[str, Any]]:
    """``(where, object)`` of every reference to the last exception or traceback (the object may be None)."""
    places: list[tuple[str, Any]] = [
        ("sys.last_value", getattr(sys, "last_value", None)),
        ("sys.last_exc", getattr(sys, "last_exc", None)),
        ("sys.last_traceback", getattr(sys, "last_traceback", None)),
    ]
    if shell is not None:
        interactive_tb = getattr(shell, "InteractiveTB", None)
        places.append(("shell.InteractiveTB.tb", getattr(interactive_tb, "tb", None)))
        last = getattr(shell, "last_execution_result", None)
        places.append(("shell.last_execution_result.error_in_exec", getattr(last, "error_in_exec", None)))
    return places
