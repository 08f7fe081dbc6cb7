"""``python -m gpumem run script.py``: the script runs as under ``python``; gpumem speaks only on stderr."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

from gpumem.core.sessions.session_file import read_session

SRC = str(Path(__file__).resolve().parents[2] / "src")


def gpumem_run(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "gpumem", "run", str(path), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
        check=False,
    )


SCRIPT = """
    import sys
    print("argv", sys.argv[1:], __name__, sys.argv[0].endswith("train.py"))
    sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def test_the_script_gets_its_argv_and_stdout_and_keeps_its_exit_code(tmp_path: Path) -> None:
    done = gpumem_run(tmp_path, SCRIPT, "7", "--lr", "0.1")
    assert done.returncode == 7
    assert done.stdout == "argv ['7', '--lr', '0.1'] __main__ True\n"  # nothing of gpumem's on stdout
    assert "gpumem: memory report for train.py (exit code 7)" in done.stderr
    assert "host: peak RSS" in done.stderr and "timeline:" in done.stderr
    assert "CUDA: not used by this run" in done.stderr


def test_an_exception_prints_the_scripts_traceback_and_exits_1(tmp_path: Path) -> None:
    done = gpumem_run(tmp_path, "def main():\n    raise ValueError('bad data')\nmain()\n")
    assert done.returncode == 1
    traceback = done.stderr[: done.stderr.index("gpumem: memory report")]
    assert traceback.startswith("Traceback (most recent call last):")
    assert 'train.py", line 3, in <module>' in traceback and "ValueError: bad data" in traceback
    assert "runpy" not in traceback and "scriptrun" not in traceback  # starts at the script, as python shows it
    assert "(exit code 1)" in done.stderr


def test_system_exit_with_a_message_prints_it_and_exits_1(tmp_path: Path) -> None:
    done = gpumem_run(tmp_path, "raise SystemExit('usage: train.py FILE')\n")
    assert done.returncode == 1
    assert done.stderr.startswith("usage: train.py FILE\n")


def test_save_keeps_the_session_as_an_export_that_load_reads(tmp_path: Path) -> None:
    script = "x = bytearray(32 << 20)\nprint('ok')\n"
    path = tmp_path / "train.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": SRC}
    session = tmp_path / "out" / "session.json"
    done = subprocess.run(
        [sys.executable, "-m", "gpumem", "run", "--save", str(session), str(path)],
        capture_output=True, text=True, timeout=120, env=env, check=False, preexec_fn=lambda: os.umask(0o022),
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == "ok\n"
    assert stat.S_IMODE(session.stat().st_mode) == 0o644  # the mode any new file gets under umask 022
    data = json.loads(session.read_text())
    assert data["gpumem_session"] == 1 and data["run"]["exit_code"] == 0  # the format %gpumem export writes
    assert data["run"]["script"] == str(path.resolve()) and data["run"]["argv"] == []
    host = data["run"]["figures"][0]
    assert host["host_peak_rss_bytes"] >= 32 << 20  # the script's bytearray is in the process's peak
    assert "host/rss" in data["timeline"]["values"]
    assert f"session saved to {session}" in done.stderr
    loaded = read_session(session)
    assert loaded.run == data["run"] and loaded.timeline.times == data["timeline"]["times"]


def test_a_missing_script_is_an_error_of_its_own(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-m", "gpumem", "run", str(tmp_path / "nope.py")],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "no such script" in done.stderr and done.stdout == ""


def test_the_scripts_own_imports_find_its_folder(tmp_path: Path) -> None:
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    done = gpumem_run(tmp_path, "import helper\nprint(helper.VALUE)\n")
    assert done.returncode == 0 and done.stdout == "42\n"
