"""The one parser of device names: ``cuda``, ``cuda:N``, ``N``, ``cpu``, ``all``, lists such as ``0,1``,
and of ``CUDA_VISIBLE_DEVICES``.

Digits are ASCII only: ``str.isdigit`` accepts ``'²'`` and ``'①'``, which ``int`` then refuses.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "DeviceSpec",
    "describe_devices",
    "parse_cuda_device",
    "parse_cuda_indices",
    "parse_device",
    "parse_visible_devices",
]

_LISTED_AT_MOST = 4  # longer lists are described by their first and last device
_DEVICE = re.compile(r"(cuda|cpu|all|mps|xpu)(?::([0-9]+))?|([0-9]+)", re.ASCII)
_INDEX = re.compile(r"[0-9]+", re.ASCII)


class DeviceSpec(NamedTuple):
    """Which tensors to look at: ``kind`` None means any device; ``number`` None means every index."""

    kind: str | None
    number: int | None


def parse_device(device: str | int | None) -> DeviceSpec:
    """``"cuda"`` -> every CUDA device, ``"cuda:1"`` / ``1`` -> one, ``"cpu"``, ``"all"`` -> any device."""
    if device is None:
        return DeviceSpec("cuda", None)
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"device index must be >= 0, got {device}")
        return DeviceSpec("cuda", device)
    text = str(device).strip().lower()
    match = _DEVICE.fullmatch(text)
    if match is None:
        raise ValueError(f"unknown device {device!r}: use cuda, cuda:N (or N), cpu or all")
    kind, index, bare = match.groups()
    if bare is not None:
        return DeviceSpec("cuda", int(bare))
    if kind == "all":
        if index is not None:
            raise ValueError(f"unknown device {device!r}: 'all' takes no index")
        return DeviceSpec(None, None)
    return DeviceSpec(kind, int(index) if index is not None else None)


def parse_cuda_indices(text: str) -> tuple[int, ...]:
    """``'0,1'``, ``'cuda:1'`` -> CUDA device indices, in order, without repeats."""
    devices: list[int] = []
    for part in text.replace(" ", "").split(","):
        spec = _cuda_spec(part)
        if spec is None:
            raise ValueError(f"expected CUDA device indices such as 0 or 0,1 or cuda:1, not {text!r}")
        devices.append(spec)
    return tuple(dict.fromkeys(devices))


def parse_cuda_device(value: str | int | None) -> int | None:
    """``0``, ``'1'``, ``'cuda:1'`` -> that index; ``None``, ``''``, ``'all'`` or ``'cuda'`` -> every device."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"device must be a CUDA index (0 or more), not {value!r}")
        return value
    text = str(value).strip().lower()
    if text in ("all", "", "auto", "cuda"):
        return None
    index = _cuda_spec(text)
    if index is None:
        raise ValueError(f"device must be a CUDA index such as 0 or cuda:1, or all, not {value!r}")
    return index


def _cuda_spec(text: str) -> int | None:
    try:
        spec = parse_device(text)
    except ValueError:
        return None
    return spec.number if spec.kind == "cuda" else None


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
