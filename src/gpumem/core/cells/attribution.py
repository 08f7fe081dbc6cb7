"""Which variables hold more GPU memory after a cell than before it.

The holders walk (:func:`gpumem.core.holders.find_holders`, or any function of the same shape) says
who holds what now; :class:`VariableAttribution` remembers the previous answer and compares. In
automatic mode it walks only the names whose value changed since then (by identity, and by length
for built-in containers), unless the cell changed allocated memory by at least
:data:`~gpumem.core.cells.kind_changes.KIND_LINE_MIN_BYTES` (then the whole namespace, time-bounded like every
walk, so that the cell's by-kind line can be told) or that leaves most of its growth unexplained.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from gpumem.core.cells.kind_changes import KIND_LINE_MIN_BYTES, Kinds, kind_changes, read_kinds
from gpumem.core.cells.record import CellOptions, DeviceChange, HeldVariable, KindChange, VariableChange
from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.units import format_bytes

__all__ = [
    "MAX_CHANGED_NAMES",
    "Attribution",
    "HolderFinder",
    "VariableAttribution",
    "VariableReport",
    "held_variables",
    "holders_walk",
    "not_inspected_note",
    "should_attribute",
    "signatures",
]

# (namespace, device filter such as "cuda" or "cuda:1", names to walk or None for all of them and
# IPython's hidden references) -> a holders report (see gpumem.core.holders.find_holders)
HolderFinder = Callable[[Mapping[str, Any], str, "Collection[str] | None"], Any]

# An automatic-mode walk covers only the names whose value changed; past this many it walks everything.
MAX_CHANGED_NAMES = 100
_SIZED = frozenset({list, dict, set, frozenset, tuple, deque})

Signatures = dict[str, int]
_LENGTH_BITS = 64  # a signature is the value's id above its length (+1; 0 for no length): one int


class Attribution(NamedTuple):
    """Who holds what, as one walk (or several put together) found it."""

    held: dict[str, HeldVariable]
    note: str
    ok: bool
    kinds: Kinds | None = None  # by kind, only from a walk of the whole namespace


class VariableReport(NamedTuple):
    """What a cell's attribution found: the new or grown names, what they mean, autograd graphs kept."""

    changes: tuple[VariableChange, ...]
    note: str
    graph_paths: tuple[str, ...]
    kinds: tuple[KindChange, ...] = ()  # empty: this walk or the one before did not cover every kind
    kinds_since: str = ""
    graph_saved_bytes: int = 0  # activations kept by the graphs of ``graph_paths``' names
    gradient_holders: tuple[tuple[str, int], ...] = ()  # (name, bytes of .grad) after the cell, largest first


def signatures(namespace: Mapping[str, Any]) -> Signatures:
    """Per name: the value's id, and its length for built-in containers (so an append shows). Plain ints,
    which the garbage collector does not track: a tuple per name made every attributed cell of a large
    namespace start collections."""
    found: Signatures = {}
    for name, value in list(namespace.items()):
        length = len(value) + 1 if type(value) in _SIZED else 0
        found[name] = id(value) << _LENGTH_BITS | length
    return found


def holders_walk(monitor: Monitor) -> HolderFinder:
    """The default finder: the holders walk, reading devices through ``monitor``'s source at each call."""

    def find(namespace: Mapping[str, Any], device: str, names: Collection[str] | None) -> Any:
        from gpumem.core.holders import find_holders

        if names is None:
            return find_holders(namespace, device=device, source=monitor.source)
        return find_holders(namespace, device=device, source=monitor.source, names=names, include_hidden=False)

    return find


def should_attribute(options: CellOptions, devices: Sequence[DeviceChange], threshold_bytes: int) -> bool:
    if options.attribute is not None:
        return options.attribute
    return any(abs(change.allocated_delta_bytes) >= threshold_bytes for change in devices)


def not_inspected_note(
    options: CellOptions, devices: Sequence[DeviceChange], namespace: Mapping[str, Any] | None, threshold_bytes: int
) -> str:
    """Why a cell's variables were not inspected."""
    if not devices:
        return "no CUDA device in use"
    if options.attribute is False:
        return "variables not inspected (turned off)"
    if namespace is None:
        return "variables not inspected (no namespace)"
    return f"variables not inspected: CUDA allocated memory changed by less than {format_bytes(threshold_bytes)}"


class VariableAttribution:
    """The tracker's memory of who held what at the last inspection, and the walks that update it."""

    def __init__(self, holder_finder: HolderFinder) -> None:
        self.holder_finder = holder_finder
        self.incremental = True  # automatic mode walks only the names whose value changed...
        self.kinds_walk_min_bytes = KIND_LINE_MIN_BYTES  # ...unless allocated memory changed this much: walk all
        self.walks = {"full": 0, "changed names": 0}
        self._baseline: dict[str, HeldVariable] = {}
        self._baseline_label = ""
        self._kinds: tuple[Kinds, str] | None = None  # the last whole walk's kinds, and "since cell [N]"
        self._signatures: Signatures | None = None

    def at_start(self, namespace: Mapping[str, Any], devices: tuple[int, ...] | None) -> Attribution:
        """Who holds what as a ``%%gpumem`` cell starts: that cell is compared with this."""
        start = self.attribute(namespace, devices, None)
        self._signatures = signatures(namespace)
        return start

    def attribute(
        self, namespace: Mapping[str, Any], devices: tuple[int, ...] | None, names: Collection[str] | None
    ) -> Attribution:
        device = f"cuda:{devices[0]}" if devices is not None and len(devices) == 1 else "cuda"
        try:
            report = self.holder_finder(namespace, device, names)
        except KeyboardInterrupt:
            # Ctrl-C while gpumem walks the namespace (the user's code is not running): stop the walk only.
            return Attribution({}, "inspection interrupted", False)
        except ImportError as error:
            return Attribution({}, f"variable attribution unavailable: {error}", False)
        except Exception as error:
            return Attribution({}, f"variable attribution failed: {type(error).__name__}: {error}", False)
        self.walks["full" if names is None else "changed names"] += 1
        held = held_variables(report)
        if devices is not None and len(devices) > 1:
            wanted = {f"cuda:{d}" for d in devices}
            held = [h for h in held if wanted.intersection(h.device.split(","))]
        note = ""
        truncated = bool(getattr(report, "truncated", False))
        if truncated:
            note = "the namespace walk stopped early (too many objects); the list may be incomplete"
        whole = names is None and not truncated and (devices is None or len(devices) == 1)
        kinds = read_kinds(report) if whole else None
        return Attribution({h.name: h for h in held}, note, True, kinds)

    def variable_changes(
        self,
        start: Attribution | None,
        namespace: Mapping[str, Any],
        options: CellOptions,
        count: int | None,
        devices: Sequence[DeviceChange],
        hidden: Mapping[str, Any] | None,
        threshold_bytes: int,
    ) -> VariableReport:
        """The names holding more than at ``start`` (the cell's own baseline) or at the last inspection;
        the autograd graphs kept alive by the names this cell made, changed or grew."""
        before = self._signatures
        attribution = self._walk(namespace, options, devices, hidden, threshold_bytes)
        if not attribution.ok:
            self._signatures = None
            return VariableReport((), attribution.note, ())
        kinds, kinds_since = self._kind_changes(start, attribution, count)
        if start is not None and start.ok:
            baseline, since, then = start.held, "since the start of the cell", "at the start of the cell"
        elif self._baseline_label:
            baseline, since, then = self._baseline, f"since {self._baseline_label}", f"after {self._baseline_label}"
        else:
            baseline, since, then = {}, "(first inspection)", ""
        changes = _grown(attribution.held, baseline)
        self._baseline = attribution.held
        self._baseline_label = f"cell [{count}]" if count is not None else "the previous inspection"
        touched = {change.name for change in changes} | _changed_names(before, self._signatures)
        graph_paths: list[str] = []
        graph_saved = 0
        for held in sorted(attribution.held.values(), key=lambda h: -h.nbytes):
            if held.graph_paths and (before is None or held.name in touched):
                graph_paths.extend(held.graph_paths)
                graph_saved += held.graph_saved_bytes
        if changes:
            note = f"new or grown {since}"
        elif then:
            note = f"no variable holds more GPU memory than {then}"
        else:
            note = "no variable holds GPU memory"
        if attribution.note:
            note += f"; {attribution.note}"
        gradients = sorted(
            ((h.name, h.gradient_bytes) for h in attribution.held.values() if h.gradient_bytes and not h.hidden),
            key=lambda pair: -pair[1],
        )
        return VariableReport(
            tuple(changes), note, tuple(graph_paths), kinds, kinds_since, graph_saved, tuple(gradients)
        )

    def _kind_changes(
        self, start: Attribution | None, attribution: Attribution, count: int | None
    ) -> tuple[tuple[KindChange, ...], str]:
        """By kind, compared with the cell's start or else the last walk of the whole namespace (a walk of
        the changed names alone sums no kinds); nothing when either is missing."""
        if start is not None and start.ok:
            before = None if start.kinds is None else (start.kinds, "since the start of the cell")
        else:
            before = self._kinds
        if attribution.kinds is None:
            return (), ""
        self._kinds = (attribution.kinds, f"since cell [{count}]" if count is not None else "since an earlier walk")
        if before is None:
            return (), ""
        return kind_changes(before[0], attribution.kinds), before[1]

    def _walk(
        self,
        namespace: Mapping[str, Any],
        options: CellOptions,
        devices: Sequence[DeviceChange],
        hidden: Mapping[str, Any] | None,
        threshold_bytes: int,
    ) -> Attribution:
        """Who holds what now. In automatic mode only the names whose value changed are walked, unless
        that leaves most of the cell's growth unexplained (memory grew inside an unchanged object)."""
        now = signatures(namespace)
        previous = self._signatures
        self._signatures = now
        if options.mode == "magic" or previous is None or not self.incremental or self._wants_kinds(devices):
            return self.attribute(namespace, options.devices, None)
        changed = [name for name, signature in now.items() if previous.get(name) != signature]
        if len(changed) > MAX_CHANGED_NAMES:
            return self.attribute(namespace, options.devices, None)
        part = self.attribute(namespace, options.devices, changed)
        if not part.ok:
            return part
        held = {
            name: value
            for name, value in self._baseline.items()
            if (value.hidden or name in now) and name not in part.held and name not in changed
        }
        held.update(part.held)
        if hidden:
            extra = self.attribute(hidden, options.devices, list(hidden))
            held.update({name: value._replace(hidden=True) for name, value in extra.held.items()})
        growth = sum(max(change.allocated_delta_bytes, 0) for change in devices)
        explained = sum(
            max(value.nbytes - (self._baseline[name].nbytes if name in self._baseline else 0), 0)
            for name, value in held.items()
            if name in part.held or value.hidden
        )
        if growth >= threshold_bytes and explained < growth // 2:
            return self.attribute(namespace, options.devices, None)
        return Attribution(held, part.note, True)

    def _wants_kinds(self, devices: Sequence[DeviceChange]) -> bool:
        """Whether the cell changed allocated memory enough for a by-kind line, which needs a whole walk: a
        cell such as ``opt.step()`` rebinds no name, so a walk of the changed names would say nothing."""
        return any(abs(change.allocated_delta_bytes) >= self.kinds_walk_min_bytes for change in devices)


def _changed_names(before: Signatures | None, after: Signatures | None) -> set[str]:
    """Names bound to another value (or a built-in container of another length) since ``before``."""
    if before is None or after is None:
        return set(after or ())
    return {name for name, signature in after.items() if before.get(name) != signature}


def _grown(held: Mapping[str, HeldVariable], baseline: Mapping[str, HeldVariable]) -> list[VariableChange]:
    """The holders that are new or hold more than in ``baseline``, largest growth first."""
    changes: list[VariableChange] = []
    for holder in held.values():
        previous = baseline.get(holder.name)
        previous_bytes = previous.nbytes if previous is not None else None
        if previous_bytes is None or holder.nbytes > previous_bytes:
            changes.append(
                VariableChange(
                    holder.name, holder.type_name, holder.device, holder.nbytes, previous_bytes, holder.hidden
                )
            )
    changes.sort(key=lambda change: (-change.grown_bytes, change.name))
    return changes


def held_variables(report: Any) -> list[HeldVariable]:
    """Read a holders report (``holders`` and ``hidden`` lists of Holder-like objects) defensively."""
    held: list[HeldVariable] = []
    for hidden, holders in ((False, getattr(report, "holders", ())), (True, getattr(report, "hidden", ()))):
        for holder in _iterable(holders):
            name = str(getattr(holder, "name", "?"))
            device = getattr(holder, "device", "")
            device_text = f"cuda:{device}" if isinstance(device, int) else str(device or "")
            paths = getattr(holder, "graph_paths", ()) or ()
            breakdown = getattr(holder, "breakdown", None)
            gradients = breakdown.get("gradients", 0) if isinstance(breakdown, dict) else 0
            held.append(
                HeldVariable(
                    name=name,
                    type_name=str(getattr(holder, "type_name", "")),
                    device=device_text,
                    nbytes=int(getattr(holder, "nbytes", 0) or 0),
                    graph_paths=tuple(str(path) for path in paths),
                    hidden=hidden,
                    graph_saved_bytes=int(getattr(holder, "graph_saved_bytes", 0) or 0),
                    gradient_bytes=int(gradients or 0),
                )
            )
    return held


def _iterable(value: Any) -> Iterable[Any]:
    return value if isinstance(value, (list, tuple)) else ()
