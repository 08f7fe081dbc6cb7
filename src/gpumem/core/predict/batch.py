"""The largest batch that fits: dry runs at chosen values, never a real run.

Memory grows about linearly with the batch, so after the two ends the next value is read off the line
through the closest fitting and not-fitting runs (regula falsi), falling back to halving the interval when
the line does not shrink it; the search stops when the two are neighbours, or after ``max_runs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gpumem.core.predict.guards import Refusal
from gpumem.core.predict.result import Prediction

__all__ = ["BatchSearch", "search"]


@dataclass(frozen=True)
class BatchSearch:
    """A search's answer: ``largest`` fits (None: not even ``low``), ``first_over`` does not (None: ``high`` fits)."""

    name: str
    low: int
    high: int
    largest: int | None
    first_over: int | None
    at_largest: Prediction | None  # the dry run at the largest value
    bytes_per_sample: float | None  # the growth of the peak per extra unit, between the two ends' dry runs
    runs: tuple[tuple[int, int | None, bool | None], ...] = field(default=())  # (value, peak needed, fits)
    seconds: float = 0.0
    refusal: Refusal | None = None

    @property
    def exact(self) -> bool:
        """True when the answer is pinned: the next value was dry-run and does not fit (or high fits)."""
        return self.largest is not None and (self.first_over is None or self.first_over == self.largest + 1)

    def __str__(self) -> str:
        from gpumem.core.predict.prediction_report import render_batch_text

        return render_batch_text(self)

    def _repr_html_(self) -> str:
        from gpumem.core.predict.prediction_report import render_batch_html

        return render_batch_html(self)


def _shortfall(prediction: Prediction) -> int | None:
    """How far the peak is above the capacity (negative: headroom); None when nothing could be compared."""
    headrooms = [device.headroom for device in prediction.devices if device.headroom is not None]
    return None if not headrooms else -min(headrooms)


def search(dry: Callable[[int], Prediction], low: int, high: int, *, name: str = "n", max_runs: int = 9) -> BatchSearch:
    """Search ``[low, high]`` with ``dry(value)``, at most ``max_runs`` dry runs."""
    state = _Search(dry, max_runs)
    bottom = state.run(low)
    if bottom is None or not bottom.fits:
        return state.answer(name, low, high, None, low if bottom is not None else None)
    if high == low:
        return state.answer(name, low, high, low, None)
    top = state.run(high)
    if top is None or top.fits:
        return state.answer(name, low, high, high if top is not None else low, None)
    fitting, over = low, high
    sides: list[bool] = []
    while over - fitting > 1 and state.left() > 0:
        # Three guesses in a row on the same side: the line is bent there; halve once to get past the bend.
        halve = len(sides) > 2 and sides[-1] == sides[-2] == sides[-3]  # noqa: PLR2004
        guess = _next_value(fitting, over, state.shortfall[fitting], state.shortfall[over], halve)
        result = state.run(guess)
        if result is None:
            break
        sides.append(bool(result.fits) if not halve else not sides[-1])
        if result.fits:
            fitting = guess
        else:
            over = guess
    return state.answer(name, low, high, fitting, over)


def _next_value(fitting: int, over: int, short_fit: int, short_over: int, halve: bool) -> int:
    if halve or short_over <= short_fit:
        guess = (fitting + over) // 2
    else:
        guess = fitting + int((0 - short_fit) * (over - fitting) / (short_over - short_fit))
    return min(max(guess, fitting + 1), over - 1)


class _Search:
    def __init__(self, dry: Callable[[int], Prediction], max_runs: int) -> None:
        self.dry = dry
        self.max_runs = max_runs
        self.results: dict[int, Prediction] = {}
        self.shortfall: dict[int, int] = {}
        self.order: list[int] = []
        self.refusal: Refusal | None = None

    def left(self) -> int:
        return self.max_runs - len(self.order)

    def run(self, value: int) -> Prediction | None:
        """The dry run at ``value``; None when it was refused or could not be compared (the search stops)."""
        prediction = self.dry(value)
        self.order.append(value)
        self.results[value] = prediction
        if prediction.refusal is not None:
            self.refusal = prediction.refusal
            return None
        shortfall = _shortfall(prediction)
        if shortfall is None:
            self.refusal = Refusal("no capacity to compare with: give --capacity (no memory free now is known)")
            return None
        self.shortfall[value] = shortfall
        return prediction

    def answer(self, name: str, low: int, high: int, largest: int | None, over: int | None) -> BatchSearch:
        per_sample = None
        if low in self.shortfall and high in self.shortfall and high > low:
            per_sample = (self.shortfall[high] - self.shortfall[low]) / (high - low)
        runs = tuple(
            (value, None if value not in self.shortfall else _needed(self.results[value]), self.results[value].fits)
            for value in self.order
        )
        return BatchSearch(
            name=name,
            low=low,
            high=high,
            largest=None if self.refusal is not None and largest is None else largest,
            first_over=over,
            at_largest=self.results.get(largest) if largest is not None else None,
            bytes_per_sample=per_sample,
            runs=runs,
            seconds=sum(result.seconds for result in self.results.values()),
            refusal=self.refusal,
        )


def _needed(prediction: Prediction) -> int:
    return max((device.needed for device in prediction.devices), default=0)
