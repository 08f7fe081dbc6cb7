"""The one parser of device names, and of ``CUDA_VISIBLE_DEVICES``.

One grammar for every ``--device`` option and ``device=`` argument: ``cuda`` (every CUDA device), ``cuda:N``
or ``N`` (one), a list such as ``0,1`` or ``cuda:0,cuda:2``, ``cpu`` (host tensors) and ``all`` (every device).
What a command can show narrows it: :meth:`DeviceSelection.cuda_indices` (a report of CUDA devices) and
:meth:`DeviceSelection.one_cuda` (a panel of one device) refuse the rest with a line saying what is accepted.

Digits are ASCII only: ``str.isdigit`` accepts ``'²'`` and ``'①'``, which ``int`` then refuses.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "DEVICE_GRAMMAR",
    "DeviceSelection",
    "DeviceSpec",
    "describe_devices",
    "parse_device",
    "parse_devices",
    "parse_visible_devices",
]

DEVICE_GRAMMAR = "cuda, cuda:N or N, a list such as 0,1, cpu or all"
_LISTED_AT_MOST = 4  # longer lists are described by their first and last device
_DEVICE = re.compile(r"(cuda|cpu|all|mps|xpu)(?::([0-9]+))?|([0-9]+)", re.ASCII)
_INDEX = re.compile(r"[0-9]+", re.ASCII)


class DeviceSpec(NamedTuple):
    """Which tensors to look at: ``kind`` None means any device; ``number`` None means every index."""

    kind: str | None
    number: int | None


class DeviceSelection(NamedTuple):
    """A parsed device option: ``kind`` None means every device; ``indices`` empty means every one of ``kind``."""

    kind: str | None
    indices: tuple[int, ...] = ()
    text: str = ""  # as written, for messages

    def cuda_indices(self) -> tuple[int, ...] | None:
        """The CUDA indices chosen, or None for every CUDA device (``cuda``, ``all``); ``cpu`` is a ValueError."""
        if self.kind not in (None, "cuda"):
            raise ValueError(f"device {self.text!r} is not a CUDA device (host memory is always reported)")
        return self.indices or None

    def one_cuda(self) -> int | None:
        """The one CUDA index chosen, or None for every CUDA device; a list or ``cpu`` is a ValueError."""
        indices = self.cuda_indices()
        if indices is not None and len(indices) > 1:
            raise ValueError(f"device {self.text!r}: choose one CUDA device (such as cuda:1) or all")
        return indices[0] if indices else None

    def spec(self) -> DeviceSpec:
        """One kind and at most one index (what a walk of tensors filters on); a list is a ValueError."""
        if len(self.indices) > 1:
            raise ValueError(f"device {self.text!r}: choose one device (such as cuda:1), cuda, cpu or all")
        return DeviceSpec(self.kind, self.indices[0] if self.indices else None)


def parse_devices(value: str | int | None, *, default: str = "cuda") -> DeviceSelection:
    """``'cuda'``, ``'cuda:1'``, ``1``, ``'0,1'``, ``'cpu'``, ``'all'`` -> a :class:`DeviceSelection`.

    None is ``default``. A bad name is a ValueError saying what is accepted.
    """
    if value is None:
        value = default
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"device index must be 0 or more, not {value}: use {DEVICE_GRAMMAR}")
        return DeviceSelection("cuda", (value,), str(value))
    text = str(value).strip()
    parts = [_one_device(part, text) for part in text.lower().replace(" ", "").split(",")]
    if len(parts) == 1:
        kind, index = parts[0]
        return DeviceSelection(kind, () if index is None else (index,), text)
    if any(kind != "cuda" or index is None for kind, index in parts):
        raise ValueError(f"unknown device {text!r}: a list names CUDA devices, such as 0,1 or cuda:0,cuda:2")
    return DeviceSelection("cuda", tuple(dict.fromkeys(index for _kind, index in parts if index is not None)), text)


def _one_device(part: str, text: str) -> tuple[str | None, int | None]:
    match = _DEVICE.fullmatch(part)
    if match is None:
        raise ValueError(f"unknown device {text!r}: use {DEVICE_GRAMMAR}")
    kind, index, bare = match.groups()
    if bare is not None:
        return "cuda", int(bare)
    if kind == "all":
        if index is not None:
            raise ValueError(f"unknown device {text!r}: 'all' takes no index")
        return None, None
    return kind, int(index) if index is not None else None


def parse_device(device: str | int | None) -> DeviceSpec:
    """``"cuda"`` -> every CUDA device, ``"cuda:1"`` / ``1`` -> one, ``"cpu"``, ``"all"`` -> any device."""
    return parse_devices(device).spec()


def parse_visible_devices(value: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of entries (indices or UUID prefixes); None means all devices.

    CUDA stops at the first invalid entry and so do we; an empty string hides every device.
    """
    if value is None:
        return None
    entries: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not (_INDEX.fullmatch(entry) or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


def describe_devices(indices: Sequence[int]) -> str:
    """``[0, 1]`` -> ``'2 CUDA devices (cuda:0, cuda:1)'``."""
    count = len(indices)
    noun = "CUDA device" if count == 1 else "CUDA devices"
    if count > _LISTED_AT_MOST:
        return f"{count} {noun} (cuda:{indices[0]} … cuda:{indices[-1]})"
    return f"{count} {noun} ({', '.join(f'cuda:{i}' for i in indices)})"
