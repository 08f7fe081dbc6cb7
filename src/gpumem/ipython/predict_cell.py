"""``%%gpumem --predict`` / ``--batch NAME=LOW..HIGH``: parse the options and show a dry run of the cell.

The cell's body reaches the magic as text (the header transformer leaves a ``--predict`` header in place,
so IPython calls the cell magic): it is translated like IPython would (magics, ``!`` lines) and dry-run by
:mod:`gpumem.core.predict` on fake copies of the user's namespace; the cell itself never runs.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from gpumem.ipython.arguments import UsageError, complain, display, parse_size

__all__ = ["PredictRequest", "parse_predict", "show"]

_BATCH = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*([0-9]+)\s*\.\.\s*([0-9]+)\s*\Z")
_OUTPUT_NAME = re.compile(r"_+\Z|_i+\Z|_i?[0-9]+\Z|_(ih|oh|dh)\Z")  # IPython's inputs and outputs
_FIRST_BODY_LINE = 2  # the body starts below the %%gpumem line


class PredictRequest(NamedTuple):
    capacity: int | None  # bytes; None: the memory free on each device now
    batch: tuple[str, int, int] | None  # NAME, LOW, HIGH


def parse_predict(predict: bool, capacity: str | None, batch: str | None) -> PredictRequest | None:
    """The dry run asked for, or None (--capacity alone is refused: it only qualifies a dry run)."""
    size = parse_size(capacity, "--capacity") if capacity is not None else None
    if size is not None and size <= 0:
        raise UsageError(f"--capacity must be a positive size such as 24GiB, not {capacity!r}")
    span = None
    if batch is not None:
        match = _BATCH.match(batch)
        if match is None:
            raise UsageError(f"--batch expects NAME=LOW..HIGH such as bs=1..4096, not {batch!r}")
        name, low, high = match.group(1), int(match.group(2)), int(match.group(3))
        if not 1 <= low <= high:
            raise UsageError(f"--batch {batch}: LOW must be at least 1 and at most HIGH")
        span = (name, low, high)
    if not predict and span is None:
        if size is not None:
            raise UsageError("--capacity goes with --predict or --batch (it is the memory a dry run must fit in)")
        return None
    return PredictRequest(size, span)


def show(shell: Any, request: PredictRequest, body: str) -> None:
    """Dry-run ``body`` over the shell's namespace and show the prediction or the batch search."""
    try:
        result = _run(shell, request, body)
    except UsageError:
        raise
    except ImportError as error:
        print(f"gpumem --predict needs torch: {error}")
        return
    except Exception as error:
        complain("--predict could not dry-run the cell", error)
        return
    display(text=str(result), html=result._repr_html_())


def _magic_line(body: str, source: str) -> int | None:
    """The first line (1-based, of the body) that IPython turned into a call of itself (a magic, ``!cmd``)."""
    original = body.splitlines()
    for number, line in enumerate(source.splitlines(), start=1):
        if "get_ipython()" in line and (number > len(original) or "get_ipython()" not in original[number - 1]):
            return number
    return None


def _run(shell: Any, request: PredictRequest, body: str) -> Any:
    from gpumem.core.predict import batch, dryrun

    source = shell.transform_cell(body)
    magic = _magic_line(body, source)
    if magic is not None:
        from gpumem.core.predict import Prediction, Refusal

        reason = "IPython magics and shell commands would run for real, on your objects: a dry run cannot run them"
        return Prediction(refusal=Refusal(reason, magic + _FIRST_BODY_LINE - 1))
    skip = set(getattr(shell, "user_ns_hidden", {})) | {"In", "Out", "get_ipython", "exit", "quit"}
    skip.update(name for name in shell.user_ns if _OUTPUT_NAME.match(name))
    namespace = shell.user_ns
    if request.batch is None:
        return dryrun.predict_source(
            source, namespace, first_line=_FIRST_BODY_LINE, skip=skip, capacity=request.capacity
        )
    name, low, high = request.batch
    if dryrun.assigns_name(source, name):
        raise UsageError(f"--batch {name}: the cell sets {name} itself; set it in a cell before and use it here")

    def dry(value: int) -> Any:
        return dryrun.predict_source(
            source, namespace, first_line=_FIRST_BODY_LINE, skip=skip, capacity=request.capacity, values={name: value}
        )

    return batch.search(dry, low, high, name=name)
