"""The settings (``c.GpuMem.*``) and what one loaded extension owns: its monitor, config and cell tracker.

The hooks and the magics are built around one :class:`ExtensionState`; keeping it apart from
:mod:`gpumem.ipython.extension` (which builds and wires them) keeps the imports one-way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from traitlets import Bool, Enum, Int, TraitError, TraitType, observe
from traitlets.config import Config, Configurable

from gpumem.core.cells import CellOptions, CellTracker
from gpumem.core.cells.tracker import TRACKER_DEFAULTS
from gpumem.core.monitoring.monitor import Monitor
from gpumem.core.units import AMOUNT_GRAMMAR, MAX_SIZE_BYTES, MIB, Amount, parse_amount, parse_size
from gpumem.ipython.arguments import complain, deprecated

__all__ = ["DEFAULT_TOP", "VARS_HELP", "VARS_MODES", "ExtensionState", "GpuMem", "vars_attribute"]

DEFAULT_TOP = 5
VARS_MODES = ("changed", "always", "never")  # --vars and GpuMem.vars: when to look for the variables holding memory
VARS_HELP = (
    "when to look for the variables holding GPU memory: changed (only after cells that changed CUDA allocated "
    "memory by at least GpuMem.attribute_threshold_bytes), always (after every cell) or never"
)
_OLD_NAMES = {"threshold_bytes": "threshold", "attribute": "vars"}  # old setting -> its name now


def vars_attribute(mode: str) -> bool | None:
    """A ``--vars`` mode as :class:`~gpumem.core.cells.CellOptions`' ``attribute`` (None: only after a change)."""
    return {"changed": None, "always": True, "never": False}[mode]


class ByteSize(Int):  # type: ignore[type-arg]
    """A number of bytes that may also be written as a size: ``"64MiB"``, ``"1 GiB"`` (core/units.py reads it)."""

    info_text = "a number of bytes or a size such as '64MiB'"

    def validate(self, obj: Any, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = parse_size(value)
            except ValueError as error:
                raise TraitError(f"{self.name}: {error}") from None
        value = super().validate(obj, value)
        if value >= MAX_SIZE_BYTES:  # as parse_size refuses the same size written as text
            raise TraitError(f"{self.name}: {value:.3g} bytes is too large for a memory size (at most 1 EiB)")
        return value

    def from_string(self, s: str) -> Any:
        return s  # validate() reads it, so that "64MiB" works on a command line too


class MemoryAmount(TraitType):  # type: ignore[type-arg]
    """A size (``"64MiB"``, or a number of bytes) or a share of a device's capacity (``"5%"``): an
    :class:`~gpumem.core.units.Amount`, read by :func:`~gpumem.core.units.parse_amount` like every ``--threshold``."""

    info_text = AMOUNT_GRAMMAR

    def validate(self, obj: Any, value: Any) -> Any:
        if isinstance(value, Amount):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            value = str(value)
        if isinstance(value, str):
            try:
                return parse_amount(value)
            except ValueError as error:
                raise TraitError(f"{self.name}: {error}") from None
        return self.error(obj, value)

    def from_string(self, s: str) -> Any:
        return s


def _tracked(name: str, minimum: int, text: str, kind: type[Int] = ByteSize) -> Any:  # type: ignore[type-arg]
    """A setting of the cell tracker's (its default is the tracker's, :data:`TRACKER_DEFAULTS`), which a change
    at run time reaches (:meth:`ExtensionState.config_changed`); byte settings also take a size such as '64MiB'."""
    sizes = " A number of bytes or a size such as '64MiB'." if kind is ByteSize else ""
    return kind(TRACKER_DEFAULTS[name], min=minimum, help=text + sizes).tag(config=True)


class GpuMem(Configurable):
    """gpumem settings, e.g. ``c.GpuMem.auto = True`` in ipython_config.py; ``%config GpuMem`` lists them."""

    auto = Bool(False, help="Measure every cell (automatic mode) from the start.").tag(config=True)
    threshold = MemoryAmount(
        Amount(nbytes=64 * MIB),
        help="Automatic mode: show a summary line under a cell whose memory changed by at least this much: a size "
        "such as '64MiB', or a share of the device's capacity such as '5%' (%gpumem auto --threshold).",
    ).tag(config=True)
    vars = Enum(
        VARS_MODES,
        "changed",
        help="Automatic mode: when to look for the variables holding GPU memory (a namespace walk). "
        "'changed': only after cells that changed CUDA allocated memory by attribute_threshold_bytes "
        "(%gpumem auto --vars).",
    ).tag(config=True)
    threshold_bytes = ByteSize(None, allow_none=True, help="The old name of threshold; still read.").tag(config=True)
    attribute = Enum(VARS_MODES, None, allow_none=True, help="The old name of vars; still read.").tag(config=True)
    attribute_threshold_bytes = _tracked(
        "attribute_threshold_bytes", 0, "Automatic mode: the allocated-memory change that makes it look for variables."
    )
    keep_peaks = Bool(
        False,
        help="Automatic mode: do not reset PyTorch's peak counters at each cell start (peaks become sampled "
        "lower bounds; torch.cuda.max_memory_allocated() keeps covering the whole session).",
    ).tag(config=True)
    top_variables = Int(DEFAULT_TOP, min=0, help="Variables listed per cell.").tag(config=True)
    history_size = _tracked("history_size", 1, "Measured cells kept in the history (oldest dropped first).", Int)
    leak_runs = _tracked("leak_runs", 2, "Runs of the same cell, each growing alike, before a leak warning.", Int)
    leak_min_bytes = _tracked("leak_min_bytes", 1, "Smallest per-run growth that counts towards a leak warning.")
    host_leak_min_bytes = _tracked(
        "host_leak_min_bytes",
        1,
        "Smallest per-run growth of host memory (RSS) that counts towards a leak warning; RSS moves by a few MiB on "
        "its own.",
    )
    pattern_min_bytes = _tracked(
        "pattern_min_bytes", 1, "Smallest growth inside a cell (a staircase) or of kept gradients that is reported."
    )
    record_own_commands = Bool(
        False,
        help="Automatic mode: also measure and record cells that are only %gpumem line magics (status, history, "
        "who...); by default they stay out of the history. %%gpumem cells are always recorded.",
    ).tag(config=True)

    @observe(*_OLD_NAMES)
    def _old_name_set(self, change: Any) -> None:
        """An old name still works: it sets the setting's name now (with a note, once), and is emptied."""
        if change["new"] is None:
            return
        new = _OLD_NAMES[change["name"]]
        deprecated(f"GpuMem.{change['name']}", f"GpuMem.{new}")
        setattr(self, new, change["new"])
        setattr(self, change["name"], None)


_SECTION = GpuMem.__name__  # the configuration section: c.GpuMem.*


def make_config(shell: Any) -> GpuMem:
    """The settings from the shell's config: a value GpuMem refuses is one line and left out, the rest apply."""
    config = getattr(shell, "config", None)
    if isinstance(config, Config) and _SECTION in config:
        _drop_refused(config[_SECTION])
    try:
        return GpuMem(parent=shell)
    except Exception as error:  # a refused value the section above does not hold (c.InteractiveShell.GpuMem.x)
        complain(f"ignoring the {_SECTION} configuration", error)
        return GpuMem()


def _drop_refused(section: Config) -> None:
    """Take each value GpuMem would refuse out of ``section``, saying which and why, once."""
    known = set(GpuMem.class_trait_names(config=True))  # unknown names: traitlets' own "did you mean" warning
    for name, value in list(section.items()):
        if name not in known:
            continue
        try:
            GpuMem(config=Config({_SECTION: {name: value}}))
        except Exception as error:
            del section[name]
            complain(f"ignoring {_SECTION}.{name} = {value!r} (the other settings apply)", error)


class ExtensionState:
    """Everything the loaded extension owns; other modules add cleanup with :meth:`on_unload`."""

    def __init__(self, shell: Any, monitor: Monitor, config: GpuMem) -> None:
        self.shell = shell
        self.monitor = monitor
        self.config = config
        self.tracker = CellTracker(monitor, **{name: getattr(config, name) for name in TRACKER_DEFAULTS})
        self._unload_callbacks: list[Callable[[], None]] = []
        self._auto_options: CellOptions | None = None  # built from the settings; dropped when one changes

    @property
    def auto(self) -> bool:
        return bool(self.config.auto)

    @auto.setter
    def auto(self, value: bool) -> None:
        self.config.auto = bool(value)

    def on_unload(self, callback: Callable[[], None]) -> None:
        """Run ``callback()`` when the extension is unloaded (latest first; failures are reported, not raised)."""
        self._unload_callbacks.append(callback)

    def run_unload_callbacks(self) -> None:
        while self._unload_callbacks:
            callback = self._unload_callbacks.pop()
            try:
                callback()
            except Exception as error:
                complain("an unload callback failed", error)

    def config_changed(self, change: Any) -> None:
        """A setting changed (``%gpumem auto ...``, ``%config GpuMem.x = ...``): keep it, pass it to the tracker."""
        name, value = change["name"], change["new"]
        self._auto_options = None
        self._keep_setting(name, value)
        if name in TRACKER_DEFAULTS:
            setattr(self.tracker, name, value)
        if name == "auto":
            if value:
                self.warm_up()
            else:
                self.tracker.release_sampler()

    def _keep_setting(self, name: str, value: Any) -> None:
        """Write a setting made at run time into the session's configuration.

        ``%reload_ext gpumem`` builds the settings from the shell's configuration, so it keeps the
        change; and a later ``%config`` (which reloads every configured value) does not undo it. An old
        name is kept as its name now, which replaces the old name there (it would set it back at a reload).
        """
        for config in (getattr(self.shell, "config", None), self.config.config):
            if isinstance(config, Config):
                section = config[_SECTION]
                for old, new in _OLD_NAMES.items():
                    if name in (old, new):
                        section.pop(old, None)
                if name not in _OLD_NAMES:
                    section[name] = value

    def warm_up(self) -> None:
        """Start sampling now so that opening NVML and psutil happens off the first measured cell."""
        self.tracker._ensure_sampling()  # noqa: SLF001 - CellTracker has no public way to start sampling yet

    def auto_options(self) -> CellOptions:
        """How automatic mode measures a cell, from the current settings (built again after any change of
        them: :meth:`config_changed` sees every one, ``%gpumem auto``'s and ``%config``'s alike)."""
        options = self._auto_options
        if options is None:
            attribute = vars_attribute(self.config.vars)
            options = CellOptions(keep_peaks=self.config.keep_peaks, attribute=attribute, mode="auto")
            self._auto_options = options
        return options
