"""The one device parser: every spelling a user types, and the look-alike digits that int() refuses."""

from __future__ import annotations

import pytest

from gpumem.core.readers.devices import (
    DeviceSelection,
    DeviceSpec,
    describe_devices,
    parse_device,
    parse_devices,
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


def test_one_grammar_narrowed_by_what_a_command_shows() -> None:
    assert parse_devices("0, 1,cuda:1").cuda_indices() == (0, 1)
    assert parse_devices("cuda:1").one_cuda() == 1
    assert parse_devices("all").one_cuda() is None
    assert parse_devices("cuda").cuda_indices() is None
    assert parse_devices(None, default="all") == DeviceSelection(None, (), "all")
    assert parse_devices(None).spec() == DeviceSpec("cuda", None)
    for bad in ("cpu", "0,1"):
        with pytest.raises(ValueError, match="CUDA device"):
            parse_devices(bad).one_cuda()
    with pytest.raises(ValueError, match="choose one device"):
        parse_devices("0,1").spec()
    for bad in ("²", "0,,1", "cuda:①", "0,cpu", "all,1"):
        with pytest.raises(ValueError, match="device"):
            parse_devices(bad)


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
