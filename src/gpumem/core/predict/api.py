"""The public entry points: predict a function call or a cell's source, and search the largest batch."""

from __future__ import annotations

import ast
import itertools
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpumem.core.predict.batch import BatchSearch, search
from gpumem.core.predict.dryrun import dry_run
from gpumem.core.predict.guards import Refusal
from gpumem.core.predict.isolation import rebuild
from gpumem.core.predict.result import Prediction

__all__ = ["assigns_name", "predict", "predict_source", "search_batch"]

_ARGS, _KWARGS, _CELLS, _FUNCTION = "__gpumem_args__", "__gpumem_kwargs__", "__gpumem_cells__", "__gpumem_fn__"
_numbers = itertools.count(1)


def predict(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Prediction:
    """Dry-run ``fn(*args, **kwargs)`` on fake copies of its arguments, its globals and closure, and predict
    its memory per device. Nothing of the caller's changes; ``Prediction.against(capacity)`` answers
    "does it fit in CAPACITY bytes?" (by default: in the memory free on the device now)."""
    return _predict_call(fn, args, kwargs, None)


def _predict_call(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], capacity: int | None
) -> Prediction:
    function = fn if isinstance(fn, types.FunctionType) else None
    home: dict[str, Any] = function.__globals__ if function is not None else {}
    cells = [cell.cell_contents for cell in (function.__closure__ or ())] if function is not None else []
    namespace = {**home, _ARGS: args, _KWARGS: kwargs, _CELLS: cells, _FUNCTION: fn}
    filename = function.__code__.co_filename if function is not None else "<gpumem-predict>"

    def run(copied: dict[str, Any]) -> Any:
        target = copied[_FUNCTION]
        if function is not None:
            closure = tuple(types.CellType(value) for value in copied[_CELLS]) if function.__closure__ else None
            target = rebuild(function, copied, closure)
        return target(*copied[_ARGS], **copied[_KWARGS])

    return dry_run(run, namespace, filename=filename, capacity=capacity, home=home)


def predict_source(
    source: str,
    namespace: Mapping[str, Any],
    *,
    first_line: int = 1,
    skip: Iterable[str] = (),
    capacity: int | None = None,
    values: Mapping[str, Any] | None = None,
) -> Prediction:
    """Dry-run Python ``source`` (a cell's code, magics already translated) over a copy of ``namespace``.

    ``first_line`` numbers the source's first line in refusals (2 under a ``%%gpumem`` header); ``values``
    are set in the copy before the code runs (the batch search's NAME=value).
    """
    filename = f"<gpumem-dry-run-{next(_numbers)}>"
    try:
        code = compile(source, filename, "exec")
    except SyntaxError as error:
        line = None if error.lineno is None else error.lineno + first_line - 1
        return Prediction(refusal=Refusal(f"the cell is not valid Python: {error.msg}", line))

    def run(copied: dict[str, Any]) -> None:
        copied.update(values or {})
        exec(code, copied)  # noqa: S102 - the user's own cell, on copies

    return dry_run(run, namespace, filename=filename, first_line=first_line, skip=skip, capacity=capacity)


def assigns_name(source: str, name: str) -> bool:
    """Whether ``source`` binds ``name`` at its top level (then a batch search cannot set it)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if any(isinstance(sub, ast.Name) and sub.id == name for sub in ast.walk(target or ast.Pass())):
                return True
    return False


def search_batch(
    step: Callable[[int], Any], low: int, high: int, *, capacity: int | None = None, max_runs: int = 9
) -> BatchSearch:
    """The largest ``n`` in ``[low, high]`` for which a dry run of ``step(n)`` fits ``capacity`` bytes (default:
    the memory free on the device now), in at most ``max_runs`` dry runs. ``step(n)`` runs one step (or
    several) for a batch of ``n``; it is never run for real."""
    return search(lambda value: _predict_call(step, (value,), {}, capacity), low, high, max_runs=max_runs)
