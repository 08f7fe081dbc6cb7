"""Generated hostile input for every ``%gpumem`` subcommand and the ``%%gpumem`` options.

Each line is run as a cell in the real in-process IPython shell (a fake allocator with two CUDA
devices behind it) and must be either accepted or refused with a one-line UsageError: never a
traceback, never a frame of gpumem's package, never a changed user variable, never a file written
outside the test's own folder (an audit hook watches every open and rename), and the shell keeps
working. The examples are derandomized, so every run tries the same lines.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402 - after the importorskip
from hypothesis import strategies as st  # noqa: E402
from IPython.core.error import UsageError  # noqa: E402
from IPython.utils.capture import capture_output  # noqa: E402

from gpumem.core.monitoring.monitor import Monitor, set_default_monitor  # noqa: E402
from gpumem.testing import MIB, FakeSource  # noqa: E402

_SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Characters that end a line for IPython (str.splitlines): the rest of the cell would be Python code.
_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
# "{...}" in a magic line is evaluated by IPython itself (variable expansion): not gpumem's input.
# "/" stays out of generated text so that no generated path can point outside the test's folder.
_EXCLUDED = _LINE_BREAKS + "{/"
_HOSTILE = "\x00\ud800\udfff\udc80'\"`\\$;#%=-,.:~ \t\u00a0\u2003\u200b\ufeff"
_DIGITS = "0123456789\u0661\u0662\u06f3\u0663\u0969\uff13\u00b2\u2460\U0001d7d9"  # Arabic, Devanagari, fullwidth...

_characters = st.one_of(
    st.characters(blacklist_characters=_EXCLUDED, blacklist_categories=("Cc",)),
    st.characters(whitelist_categories=("Cs", "Nd", "No", "Zs", "Cf")).filter(lambda c: c not in _EXCLUDED),
    st.sampled_from(_HOSTILE + _DIGITS),
)
junk = st.text(_characters, max_size=24)
numbers = st.one_of(
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(st.sampled_from(_DIGITS), min_size=1, max_size=12),
    st.sampled_from(["9" * 5000, "1e400", "-1e400", "1e-400", "nan", "inf", "-0", "0x10", "1_000", "+7", "0.", ".5"]),
)
sizes = st.builds(
    "{}{}{}".format,
    numbers,
    st.sampled_from(["", " ", "\u00a0"]),
    st.sampled_from(["", "B", "KiB", "MiB", "GiB", "TiB", "PiB", "kb", "MB", "g", "%", "s", "min", "h"]),
)
devices = st.one_of(
    st.sampled_from(["0", "1", "0,1", "cuda", "cuda:1", "cuda:7", "cpu", "all", "mps", "cuda:", ",", "0,,1"]),
    st.builds("cuda:{}".format, numbers),
    st.builds("{},{}".format, numbers, numbers),
)
values = st.one_of(junk, numbers, sizes, devices)


def _quoted(value: str) -> st.SearchStrategy[str]:
    return st.sampled_from([value, f'"{value}"', f"'{value}'", f'"{value}', f"{value}'", f"--x={value}"])


quoted_values = values.flatmap(_quoted)
# Paths stay inside the test's folder: relative names (no "/"), "~" is a home made inside it, and a
# few fixed ones no file can have or that gpumem must refuse.
paths = st.one_of(
    junk.filter(lambda text: ".." not in text),
    st.sampled_from(
        [
            "~nosuchuser_gpumem/x.csv",
            "~/cells.csv",
            "",
            ".",
            "a\x00b",
            "\ud800.csv",
            "/dev/null",
            "/nonexistent-gpumem/x",
        ]
    ),
)


def _line(flags: dict[str, st.SearchStrategy[str] | None], extra: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """A line of these flags (each with a generated value where it takes one) and junk, in any order."""
    one = st.sampled_from(sorted(flags)).flatmap(
        lambda flag: st.just(flag) if flags[flag] is None else flags[flag].map(lambda value: f"{flag} {value}")
    )
    parts = st.lists(st.one_of(one, one, extra), max_size=5)
    return st.tuples(parts, st.sampled_from([" ", "  ", "\t", " \u00a0"])).map(lambda pair: pair[1].join(pair[0]))


_PANEL = {
    "-w": quoted_values,
    "--window": quoted_values,
    "-d": devices,
    "--device": quoted_values,
    "-t": quoted_values,
    "--threshold": sizes,
    "-r": numbers,
    "--refresh": quoted_values,
    "--rate": quoted_values,
    "--host": None,
    "--full-scale": None,
    "-h": None,
}
LINES: dict[str, st.SearchStrategy[str]] = {
    "auto": _line(
        {
            "on": None,
            "off": None,
            "ON": None,
            "--threshold": st.one_of(sizes, quoted_values),
            "--threshold=": sizes,
            "--vars": st.one_of(st.sampled_from(["changed", "always", "never", "Always"]), junk),
            "--keep-peaks": None,
            "--reset-peaks": None,
        },
        quoted_values,
    ),
    "history": _line(
        {
            "--last": numbers,
            "--all": None,
            "--csv": paths,
            "--json": paths,
            "--force": None,
            "--clear": None,
            "--help": None,
        },
        junk,
    ),
    "status": _line({"-h": None, "--verbose": None}, quoted_values),
    "who": _line({"-d": devices, "--device": quoted_values, "--all": None, "--depth": numbers, "--cycles": None}, junk),
    "free": _line({"--deep": None, "--deeper": None}, junk),
    "monitor": _line({**_PANEL, "--close": None}, junk),
    "sidebar": _line(_PANEL, junk),
    "cell": _line(
        {
            "-d": devices,
            "--device": quoted_values,
            "-q": None,
            "--quiet": None,
            "-k": None,
            "--keep-peaks": None,
            "--top": numbers,
            "--no-vars": None,
        },
        quoted_values,
    ),
}

# Names IPython itself sets after every cell; everything else in the namespace is the user's.
_IPYTHON_NAMES = frozenset({"_", "__", "___", "_i", "_ii", "_iii", "In", "Out", "_oh", "_ih", "_dh", "exit", "quit"})


def _users(namespace: dict[str, Any]) -> dict[str, int]:
    return {
        name: id(value)
        for name, value in namespace.items()
        if name not in _IPYTHON_NAMES and not (name.startswith(("_i", "_")) and name[1:].lstrip("i").isdigit())
    }


class _Writes:
    """Every file opened for writing, created or renamed while armed, and whether it existed then.

    (An audit hook cannot be removed: one is added for the session and armed around each cell.)
    """

    def __init__(self) -> None:
        self.armed = False
        self.paths: list[tuple[str, bool]] = []
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.armed:
            return
        if event == "open" and isinstance(args[0], (str, bytes)) and _writes(args[1], args[2]):
            self._add(args[0])
        elif event in ("os.rename", "os.replace", "os.symlink", "os.link", "os.mkdir"):
            for path in args[:2]:
                if isinstance(path, (str, bytes)):
                    self._add(path)

    def _add(self, path: str | bytes) -> None:
        self.armed = False  # what follows must not audit itself
        try:
            name = os.path.abspath(os.fsdecode(path))  # noqa: PTH100 - no symlinks resolved
            self.paths.append((name, os.path.lexists(name)))
        except ValueError:  # a NUL in the name: no such file can exist
            pass
        finally:
            self.armed = True

    def outside(self, folder: Path) -> list[str]:
        """Paths outside ``folder`` that were there before, or are there now: written, or made."""
        inside = str(folder) + os.sep
        return [
            name for name, existed in self.paths if not name.startswith(inside) and (existed or os.path.lexists(name))
        ]


def _writes(mode: str | None, flags: int) -> bool:
    if mode is not None:
        return any(letter in mode for letter in "wax+")
    return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))


_watch: list[_Writes] = []
_OUR_FRAME = re.compile(r"gpumem[/\\][\w/\\]*\.py")  # a frame of gpumem's package in a traceback


@pytest.fixture
def hostile(ip: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """A loaded extension in a folder of its own; returns ``run(cell)``, which checks everything above."""
    if not _watch:
        _watch.append(_Writes())
    writes = _watch[0]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no __pycache__ for modules imported on first use
    fake = FakeSource(devices=2)
    set_default_monitor(Monitor(fake))
    assert ip.run_cell("%load_ext gpumem").success
    ip.user_ns.update(src=fake, MIB=MIB, kept=[1, 2, 3], name="value")
    ip.run_cell("h = src.allocate(MIB)", store_history=False)
    users = _users(ip.user_ns)

    def run(cell: str) -> None:
        writes.paths.clear()
        writes.armed = True
        try:
            with capture_output() as cap:
                # Not stored in IPython's history: its SQLite database cannot hold a lone surrogate.
                result = ip.run_cell(cell, store_history=False)
        finally:
            writes.armed = False
        shown = cap.stdout + cap.stderr
        error = result.error_in_exec or result.error_before_exec
        assert error is None or isinstance(error, UsageError), (cell, repr(error), shown)
        assert "Traceback" not in shown and _OUR_FRAME.search(shown) is None, (cell, shown)
        if error is not None:
            assert len(shown.strip().splitlines()) == 1, (cell, shown)
        assert writes.outside(tmp_path) == [], (cell, writes.paths)
        assert _users(ip.user_ns) == users, cell
        with capture_output():
            assert ip.run_cell("40 + 2", store_history=False).result == 42  # the shell still works

    try:
        yield run
    finally:
        ip.run_cell("%unload_ext gpumem", store_history=False)
        set_default_monitor(None)


@pytest.mark.parametrize("subcommand", ["auto", "history", "status", "who", "free", "monitor", "sidebar"])
def test_a_hostile_subcommand_line_is_accepted_or_one_line(hostile: Callable[[str], None], subcommand: str) -> None:
    @_SETTINGS
    @given(line=LINES[subcommand])
    def check(line: str) -> None:
        hostile(f"%gpumem {subcommand} {line}")

    check()


@_SETTINGS
@given(line=st.one_of(junk, st.sampled_from(["help", "-h", "--help", "_cel", "AUTO", "who\u00a0-d 0"])))
def test_a_hostile_subcommand_name_is_accepted_or_one_line(hostile: Callable[[str], None], line: str) -> None:
    hostile(f"%gpumem {line}")


# Bodies that name nothing new: every user variable must stay as it was.
_BODIES = ["", "None", "len(kept)", "40 + 2;", "%%time\nlen(kept)", "%time len(kept)"]


@_SETTINGS
@given(line=LINES["cell"], body=st.sampled_from(_BODIES))
def test_hostile_cell_options_are_accepted_or_one_line(hostile: Callable[[str], None], line: str, body: str) -> None:
    hostile(f"%%gpumem {line}\n{body}")
