"""What a dry run predicts: per device, by kind and by module, and whether it fits."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from gpumem.core.predict.guards import Refusal
from gpumem.core.predict.tracking import ModuleFigures

__all__ = ["DevicePrediction", "Prediction"]


@dataclass(frozen=True)
class DevicePrediction:
    """One device. Bytes; ``*_now`` as measured before the dry run, the rest predicted.

    On a CUDA device ``peak_allocated`` is PyTorch's ``max_memory_allocated`` the cell would reach (what is
    allocated now plus the cell's growth, the allocator's block rounding and the cuBLAS workspace included)
    and ``peak_reserved`` the reserved memory (segments) it would reach. On the CPU the figures are what
    the cell's tensors and the objects it uses hold (the CPU has no caching allocator: reserved is None).
    """

    device: str
    allocated_now: int
    peak_allocated: int
    end_allocated: int
    reserved_now: int | None = None
    peak_reserved: int | None = None
    end_reserved: int | None = None
    reserved_is_bound: bool = False  # the cached free memory now was not reused in the model: an upper bound
    reserved_at_least: bool = False  # cuDNN convolutions ran: their run-time workspaces come on top (a lower bound)
    context_bytes: int | None = None  # this process's memory on the device outside PyTorch's (CUDA context...)
    context_is_device_wide: bool = False  # the context figure is the whole device's use less PyTorch's reserve
    context_started: bool = False  # the dry run started CUDA on this device (context_bytes measured after)
    workspace_bytes: int = 0  # a cuBLAS workspace the cell's first matmul would make (counted in the peaks)
    workspace_note: str = ""
    by_kind: dict[str, int] = field(default_factory=dict)  # at the peak, MemTracker's kinds (512 B rounded)
    end_by_kind: dict[str, int] = field(default_factory=dict)  # at the end of the cell
    capacity: int | None = None  # what the peak is compared with
    capacity_source: str = ""  # "--capacity", "free now"

    @property
    def needed(self) -> int:
        """What the cell needs of the device at its peak: reserved (else allocated) plus the context."""
        peak = self.peak_reserved if self.peak_reserved is not None else self.peak_allocated
        if self.capacity_source == "free now":  # free memory already excludes what the process holds
            return peak - (self.reserved_now or 0)
        return peak + (self.context_bytes or 0)

    @property
    def headroom(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.needed

    @property
    def fits(self) -> bool | None:
        headroom = self.headroom
        return None if headroom is None else headroom >= 0


@dataclass(frozen=True)
class Prediction:
    """A dry run's answer; ``refusal`` set when it stopped (then no figures)."""

    devices: tuple[DevicePrediction, ...] = ()
    modules: tuple[ModuleFigures, ...] = ()
    faked: tuple[str, ...] = ()  # names whose values were copied as fakes
    shared: tuple[str, ...] = ()  # names that could not be copied
    seconds: float = 0.0
    iterations: int = 1  # forwards of the root module
    started_contexts: tuple[str, ...] = ()  # CUDA devices the dry run started a context on (PyTorch's fakes did)
    refusal: Refusal | None = None

    @property
    def fits(self) -> bool | None:
        """True when every device with a capacity fits; None when nothing could be compared."""
        answers = [device.fits for device in self.devices if device.fits is not None]
        return None if not answers or self.refusal is not None else all(answers)

    def against(self, capacity: int) -> Prediction:
        """The same prediction, each device compared with ``capacity`` bytes instead."""
        devices = tuple(replace(device, capacity=capacity, capacity_source="--capacity") for device in self.devices)
        return replace(self, devices=devices)

    def device(self, name: str) -> DevicePrediction | None:
        return next((device for device in self.devices if device.device == name), None)

    def __str__(self) -> str:
        from gpumem.core.predict.prediction_report import render_text

        return render_text(self)

    def _repr_html_(self) -> str:
        from gpumem.core.predict.prediction_report import render_html

        return render_html(self)
