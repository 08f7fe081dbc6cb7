"""The one device parser: every spelling a user types, and the look-alike digits that int() refuses."""

from __future__ import annotations

import pytest

from gpumem.core.devices import (
    DeviceSpec,
    describe_devices,
    parse_cuda_device,
    parse_cuda_indices,
    parse_device,
    parse_visible_devices,
)


def test_parse_device_spellings() -> None:
    assert parse_device(None) == DeviceSpec("cuda", None)
    assert parse_device("cuda") == DeviceSpec("cuda", None)
    assert parse_device(" CUDA:1 ") == DeviceSpec("cuda", 1)
    assert parse_device("3") == DeviceSpec("cuda", 3)
    assert parse_device(2) == DeviceSpec("cuda", 2)
    assert parse_device("cpu") == DeviceSpec("cpu", None)
    assert parse_device("all") == DeviceSpec(None, None)


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "all:1", -1, "²", "①", "cuda:²", "1.5", "cuda:-1", ""])
def test_parse_device_refuses_with_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match="device"):
        parse_device(bad)  # type: ignore[arg-type]


def test_cuda_indices_and_single_cuda_device() -> None:
    assert parse_cuda_indices("0, 1,cuda:1") == (0, 1)
    assert parse_cuda_device("cuda:1") == 1
    assert parse_cuda_device("all") is None
    assert parse_cuda_device(None) is None
    for bad in ("²", "cpu", "0,1", "cuda:①"):
        with pytest.raises(ValueError, match="CUDA"):
            parse_cuda_device(bad)
    for bad in ("²", "cpu", "0,,1", "cuda:①"):
        with pytest.raises(ValueError, match="CUDA"):
            parse_cuda_indices(bad)


def test_describe_devices() -> None:
    assert describe_devices([0]) == "1 CUDA device (cuda:0)"
    assert describe_devices(list(range(8))) == "8 CUDA devices (cuda:0 … cuda:7)"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("0", ["0"]),
        ("1,0", ["1", "0"]),
        (" 2 , 3 ", ["2", "3"]),
        ("0,-1,1", ["0"]),
        ("0,foo,1", ["0"]),
        ("GPU-abc123,1", ["GPU-abc123", "1"]),
        ("MIG-xyz", ["MIG-xyz"]),
        ("0,²,1", ["0"]),  # not a digit to CUDA, nor to int()
        ("0,,1", ["0"]),
    ],
)
def test_visible_devices_parsed_like_cuda(value: str | None, expected: list[str] | None) -> None:
    assert parse_visible_devices(value) == expected
