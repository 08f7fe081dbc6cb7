"""One grammar per option: a spelling means the same in every subcommand that takes the option, each kind
of value has one parser, an old spelling still works with one note per kernel, and a bad value is refused
alone with a line that says what is accepted. The magics run in the real in-process IPython shell over a
fake allocator with two CUDA devices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from _harness import gpumem_loaded, run_cell_capture
from gpumem.core.units import Amount
from gpumem.ipython import arguments, cell_magic, memory_magics, panel_magics
from gpumem.ipython import extension as _extension
from gpumem.ipython.arguments import UsageError, parse_argstring
from gpumem.ipython.state import ExtensionState
from gpumem.panel.options import make_options
from gpumem.testing import GIB, MIB, FakeSource


@pytest.fixture
def fake() -> FakeSource:
    return FakeSource(devices=2)


@pytest.fixture
def shell(ip: Any, fake: FakeSource, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setattr(arguments, "_told", set())  # a fresh kernel: no old spelling noted yet
    with gpumem_loaded(ip, fake) as loaded:
        loaded.user_ns.update(src=fake, MIB=MIB)
        yield loaded


def state() -> ExtensionState:
    loaded = _extension.get_state()
    assert loaded is not None
    return loaded


# What each subcommand makes of an option's value, read through its own parsing --------------------------


def _auto_threshold(shell: Any, value: str) -> Amount:
    shell.run_line_magic("gpumem", f"auto --threshold {value}")
    return state().config.threshold


def _panel(magic: Callable[..., None], line: str) -> Any:
    return make_options(**panel_magics._panel_options(parse_argstring(magic, line)))


def _cell_devices(shell: Any, value: str) -> tuple[int, ...] | None:
    return cell_magic.parse_cell_options(f"--device {value}", state().monitor.source).options.devices


def _who_devices(shell: Any, value: str) -> tuple[int, ...] | None:
    kind, index = arguments.parse_device_option(memory_magics._who_options(f"--device {value}").device).spec()
    assert kind in ("cuda", None)
    return None if index is None else (index,)


def _panel_devices(magic: Callable[..., None]) -> Callable[[Any, str], tuple[int, ...] | None]:
    def devices(_shell: Any, value: str) -> tuple[int, ...] | None:
        device = _panel(magic, f"--device {value}").device
        return None if device is None else (device,)

    return devices


THRESHOLD_READERS = {
    "auto": _auto_threshold,
    "monitor": lambda _shell, value: _panel(panel_magics.magic_monitor, f"--threshold {value}").threshold,
    "sidebar": lambda _shell, value: _panel(panel_magics.magic_sidebar, f"--threshold {value}").threshold,
}


@pytest.mark.parametrize("subcommand", sorted(THRESHOLD_READERS))
@pytest.mark.parametrize(
    ("spelling", "meaning"),
    [("512MiB", Amount(nbytes=512 * MIB)), ("80%", Amount(fraction=0.8)), ("'2 GiB'", Amount(nbytes=2 * GIB))],
)
def test_a_threshold_means_the_same_in_every_subcommand(
    shell: Any, subcommand: str, spelling: str, meaning: Amount, capsys: pytest.CaptureFixture[str]
) -> None:
    assert THRESHOLD_READERS[subcommand](shell, spelling) == meaning
    assert "old spelling" not in capsys.readouterr().err


DEVICE_READERS = {
    "%%gpumem": _cell_devices,
    "who": _who_devices,
    "monitor": _panel_devices(panel_magics.magic_monitor),
    "sidebar": _panel_devices(panel_magics.magic_sidebar),
}


@pytest.mark.parametrize("subcommand", sorted(DEVICE_READERS))
@pytest.mark.parametrize(("spelling", "meaning"), [("cuda:1", (1,)), ("1", (1,)), ("CUDA:0", (0,))])
def test_a_device_means_the_same_in_every_subcommand(
    shell: Any, subcommand: str, spelling: str, meaning: tuple[int, ...]
) -> None:
    assert DEVICE_READERS[subcommand](shell, spelling) == meaning


@pytest.mark.parametrize("subcommand", ["%%gpumem", "monitor", "sidebar"])
@pytest.mark.parametrize("spelling", ["all", "cuda"])
def test_every_cuda_device_is_spelled_alike(shell: Any, subcommand: str, spelling: str) -> None:
    assert DEVICE_READERS[subcommand](shell, spelling) is None


def test_a_list_of_devices_is_one_grammar_where_one_device_is_shown(shell: Any) -> None:
    assert _cell_devices(shell, "0,cuda:1") == (0, 1)
    for magic in (panel_magics.magic_monitor, panel_magics.magic_sidebar):
        with pytest.raises(UsageError, match="choose one CUDA device"):
            _panel(magic, "--device 0,1")
    with pytest.raises(UsageError, match="choose one device"):
        memory_magics._who_options("--device 0,1")


def test_a_capacity_is_a_size_like_every_other(shell: Any) -> None:
    request = cell_magic.parse_cell_options("--predict --capacity 24GiB", state().monitor.source)
    assert request.predict is not None
    assert request.predict.capacity == 24 * GIB == _auto_threshold(shell, "24GiB").nbytes
    request = cell_magic.parse_cell_options("--predict --capacity 24 GiB", state().monitor.source)
    assert request.predict is not None and request.predict.capacity == 24 * GIB  # two words, as --threshold


@pytest.mark.parametrize(("mode", "attribute"), [("changed", None), ("always", True), ("never", False)])
def test_vars_means_the_same_for_a_cell_and_for_automatic_mode(shell: Any, mode: str, attribute: bool | None) -> None:
    shell.run_line_magic("gpumem", f"auto --vars {mode}")
    assert state().auto_options().attribute is attribute
    assert cell_magic.parse_cell_options(f"--vars {mode}", state().monitor.source).options.attribute is attribute
    assert state().config.vars == mode


# Old spellings: they still work, with one note per kernel ----------------------------------------------


def test_no_vars_still_works_and_is_noted_once(shell: Any) -> None:
    shell.user_ns["n"] = 0
    notes = []
    for _ in range(2):
        result, cap = run_cell_capture(shell, "%%gpumem --no-vars\nn += 1\nh = src.allocate(MIB)")
        assert result.success
        notes.append(cap.stderr)
        assert cap.outputs and "variables not inspected (turned off)" in cap.outputs[0].data["text/plain"]
    assert notes[0].strip() == ("gpumem: --no-vars still works but is an old spelling; write --vars never (said once)")
    assert notes[1] == ""
    assert shell.user_ns["n"] == 2
    with pytest.raises(UsageError, match="--no-vars is --vars never"):
        cell_magic.parse_cell_options("--no-vars --vars always", state().monitor.source)


def test_the_panels_bare_number_threshold_keeps_its_meaning_with_a_note(
    shell: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _panel(panel_magics.magic_monitor, "--threshold 0.8").threshold == Amount(fraction=0.8)
    assert capsys.readouterr().err.strip() == (
        "gpumem: --threshold 0.8 still works but is an old spelling; write --threshold 80% (said once)"
    )
    assert _panel(panel_magics.magic_sidebar, "--threshold 0.8").threshold == Amount(fraction=0.8)
    assert _panel(panel_magics.magic_monitor, "--threshold 95").threshold == Amount(fraction=0.95)
    assert capsys.readouterr().err.strip() == (
        "gpumem: --threshold 95 still works but is an old spelling; write --threshold 95% (said once)"
    )


@pytest.mark.parametrize("magic", [panel_magics.magic_monitor, panel_magics.magic_sidebar])
def test_the_panels_rate_is_now_refresh_and_still_works_with_one_note(
    shell: Any, magic: Callable[..., None], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--rate`` means samples per second (``python -m gpumem run``); the panel's most updates a second sent to
    the browser is ``--refresh`` (``-r``), and the panel's old ``--rate`` still sets it, noted once per kernel."""
    assert _panel(magic, "--refresh 4").refresh_hz == _panel(magic, "-r 4").refresh_hz == 4.0
    assert capsys.readouterr().err == ""
    notes = []
    for value in ("4", "0.5"):
        assert _panel(magic, f"--rate {value}").refresh_hz == float(value)
        notes.append(capsys.readouterr().err)
    assert notes == ["gpumem: --rate still works but is an old spelling; write --refresh (said once)\n", ""]
    with pytest.raises(UsageError, match="--rate is the old spelling of --refresh: give one of them"):
        _panel(magic, "--rate 4 --refresh 2")
    with pytest.raises(UsageError, match=r"refresh must be between 0\.2 and 10 updates per second"):
        _panel(magic, "--rate 100")
    assert "--refresh HZ" in magic.__doc__ and "old spelling of --refresh" in magic.__doc__  # %gpumem? says both


def test_the_panels_old_keyword_still_works_with_one_warning(recwarn: pytest.WarningsRecorder) -> None:
    assert make_options(rate_hz=4).refresh_hz == make_options(refresh_hz="4").refresh_hz == 4.0
    assert [str(w.message) for w in recwarn] == [
        "gpumem: Panel(rate_hz=...) still works but is an old spelling; write Panel(refresh_hz=...)"
    ]
    assert recwarn[0].category is FutureWarning
    with pytest.raises(TypeError, match="rate_hz is the old name of refresh_hz"):
        make_options(rate_hz=4, refresh_hz=2)


def test_rate_is_samples_per_second_of_the_script_runner(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpumem import __main__ as cli
    from gpumem.core.scripts import runner

    asked: dict[str, Any] = {}
    monkeypatch.setattr(runner, "run_script", lambda script, _argv, **kwargs: asked.update(kwargs, script=script) or 0)
    assert cli.main(["run", "--rate", "50", "train.py"]) == 0
    assert asked == {"script": "train.py", "save": None, "rate_hz": 50.0}
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "--rate HZ samples per second" in " ".join(capsys.readouterr().out.split())


def test_old_setting_names_still_work_and_are_noted_once(shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    config = state().config
    for _ in range(2):
        shell.run_line_magic("config", "GpuMem.threshold_bytes = 1048576")
        shell.run_line_magic("config", "GpuMem.attribute = 'never'")
    assert config.threshold == Amount(nbytes=MIB) and config.vars == "never"
    assert state().auto_options().attribute is False
    assert capsys.readouterr().err.splitlines() == [
        "gpumem: GpuMem.threshold_bytes still works but is an old spelling; write GpuMem.threshold (said once)",
        "gpumem: GpuMem.attribute still works but is an old spelling; write GpuMem.vars (said once)",
    ]
    shell.run_line_magic("gpumem", "auto --threshold 5%")  # the name now wins over the old one after a reload
    assert shell.run_cell("%reload_ext gpumem").success
    assert state().config.threshold == Amount(fraction=0.05) and state().config.vars == "never"


# Bad values: refused alone, saying what is accepted ----------------------------------------------------


@pytest.mark.parametrize(
    ("line", "accepted"),
    [
        ("%gpumem auto --threshold lots --vars never", "a size such as 512MiB or a share of the device's capacity"),
        ("%gpumem auto --threshold 150% --vars never", "between 0 and 100%"),
        ("%gpumem monitor --threshold lots", "a size such as 512MiB or a share of the device's capacity"),
        ("%gpumem monitor --device gpu", "use cuda, cuda:N or N, a list such as 0,1, cpu or all"),
        ("%gpumem who --device gpu", "use cuda, cuda:N or N, a list such as 0,1, cpu or all"),
        ("%gpumem summary --device gpu", "use cuda, cuda:N or N, a list such as 0,1, cpu or all"),
        ("%gpumem summary --device cpu", "is not a CUDA device"),
        ("%%gpumem --device gpu\nn = 1", "use cuda, cuda:N or N, a list such as 0,1, cpu or all"),
        ("%%gpumem --predict --capacity lots\nn = 1", "--capacity: expected a size such as 64MiB"),
    ],
)
def test_a_bad_value_is_refused_alone_saying_what_is_accepted(shell: Any, line: str, accepted: str) -> None:
    before = (state().config.threshold, state().config.vars, state().tracker.history)
    result, cap = run_cell_capture(shell, line)
    assert isinstance(result.error_in_exec, UsageError), line
    shown = (cap.stderr + cap.stdout).strip()
    assert accepted in shown and len(shown.splitlines()) == 1 and "Traceback" not in shown, shown
    assert (state().config.threshold, state().config.vars, state().tracker.history) == before
    assert "n" not in shell.user_ns


# The %%gpumem header: parsed once per cell ------------------------------------------------------------


def test_the_header_is_parsed_and_its_devices_checked_once_per_cell(
    shell: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks: list[tuple[int, ...]] = []
    check = arguments.check_devices_exist

    def counted(devices: tuple[int, ...], source: Any) -> None:
        checks.append(devices)
        check(devices, source)

    monkeypatch.setattr(arguments, "check_devices_exist", counted)
    for number in range(2):
        result, cap = run_cell_capture(shell, "%%gpumem --device cuda:1\nh = src.allocate(MIB, device=1)")
        assert result.success and "cuda:1" in cap.outputs[0].data["text/plain"]
        assert checks == [(1,)] * (number + 1)  # once per cell, again for the next one


# A share of capacity is read against each device's own capacity ---------------------------------------


def test_a_share_of_capacity_under_auto_counts_against_the_devices_capacity(shell: Any) -> None:
    shell.run_line_magic("gpumem", "auto on --threshold 5% --vars never")  # 5% of 80 GiB: 4 GiB
    assert "a line shows under cells\nthat change memory by 5%+ of a device's capacity" in _said(shell, "%gpumem auto")
    shell.user_ns.update(GIB=GIB)
    _result, small = run_cell_capture(shell, "a = src.allocate(3 * GIB)")
    _result, large = run_cell_capture(shell, "b = src.allocate(5 * GIB)")
    assert small.outputs == []
    assert [output.data["text/plain"][:8] for output in large.outputs] == ["gpumem ["]
    assert len(state().tracker.history) == 2  # both measured; only the large one was worth a line


def test_a_size_threshold_in_the_panel_header_is_a_share_of_each_devices_capacity() -> None:
    from gpumem.panel.header import DeviceFigures, HeaderModel, render_header

    def figures(device: int, used: int, total: int) -> DeviceFigures:
        return DeviceFigures(device, None, used, used, used, total, used, True)

    devices = (figures(0, 50 * GIB, 80 * GIB), figures(1, 30 * GIB, 40 * GIB))  # 62.5% and 75% used
    model = HeaderModel(devices, host=None, notes=(), cuda_in_use=True)
    html, alert = render_header(model, Amount(nbytes=60 * GIB))  # 75% of cuda:0, more than all of cuda:1
    assert not alert and "threshold 60.0 GiB" in html
    html, alert = render_header(model, Amount(nbytes=35 * GIB))  # 43.75% of cuda:0 (past it), 87.5% of cuda:1
    assert alert and html.count("gm-row-alert") == 1


def _said(shell: Any, line: str) -> str:
    _result, cap = run_cell_capture(shell, line)
    return cap.stdout
