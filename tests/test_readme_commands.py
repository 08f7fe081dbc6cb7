"""Every command the README tells a user to type is run by CI exactly as written.

The commands are the lines of the README's ```sh / ```bash / ```shell / ```console blocks (in a
console block, the lines after a `$ ` prompt). CI is .ci/run and every file of this repository it
names, followed from file to file (.ci/install_check runs the install command, for one). A command
counts as run when a line of those files is that command, once leading `NAME=value` environment
settings (`GPUMEM_DEMO_CHECK=1 make demo`) and a trailing comment are set aside. `%gpumem` magics
live in ```python blocks and are not shell commands.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CI_ENTRY = REPO / ".ci" / "run"
SHELL_LANGUAGES = {"sh", "bash", "shell", "console"}
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_COMMENT = re.compile(r"(?:^|\s+)#.*$")
_ENV_PREFIX = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+")
_REPO_PATH = re.compile(r"[\w./-]+")


def _logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined and comments dropped, stripped, blanks left out."""
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    lines = (_COMMENT.sub("", line).strip() for line in joined.splitlines())
    return [line for line in lines if line]


def readme_commands(markdown: str) -> list[str]:
    commands: list[str] = []
    for language, body in _FENCE.findall(markdown):
        if language not in SHELL_LANGUAGES:
            continue
        typed = body
        if language == "console":
            typed = "\n".join(line[2:] for line in body.splitlines() if line.startswith("$ "))
        commands.extend(_logical_lines(typed))
    return commands


def ci_files(entry: Path = CI_ENTRY) -> list[Path]:
    """`entry` and every file of the repository it names, recursively (by relative path)."""
    seen: list[Path] = []
    pending = [entry]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.append(path)
        for token in _REPO_PATH.findall(path.read_text(encoding="utf-8")):
            candidate = (REPO / token).resolve()
            if "/" in token and candidate.is_file() and REPO in candidate.parents and candidate not in seen:
                pending.append(candidate)
    return seen


def ci_command_lines(files: list[Path]) -> set[str]:
    lines: set[str] = set()
    for path in files:
        for line in _logical_lines(path.read_text(encoding="utf-8")):
            lines.add(line)
            lines.add(_ENV_PREFIX.sub("", line))
    return lines


def missing_from_ci(markdown: str, files: list[Path]) -> list[str]:
    run = ci_command_lines(files)
    return [command for command in readme_commands(markdown) if command not in run]


def test_every_readme_command_is_run_by_ci() -> None:
    markdown = (REPO / "README.md").read_text(encoding="utf-8")
    commands = readme_commands(markdown)
    assert commands, "the README shows no shell command: the extractor no longer finds its ```sh blocks"
    files = ci_files()
    assert REPO / ".ci" / "install_check" in files
    missing = missing_from_ci(markdown, files)
    assert not missing, (
        f"the README tells users to type {missing}, which CI does not run as written: run it from .ci/run "
        f"(or a script .ci/run names: {[str(p.relative_to(REPO)) for p in files]})"
    )


def test_a_command_ci_does_not_run_is_reported(tmp_path: Path) -> None:
    ci = tmp_path / "run"
    ci.write_text("#!/usr/bin/env bash\nset -e\nGPUMEM_DEMO_CHECK=1 make demo  # the demo\npip install \\\n  .\n")
    markdown = (
        "# x\n\n```sh\nmake demo\npip install .   # from a checkout\nmake deploy\n```\n\n"
        "```python\n%gpumem auto on\n```\n\n```console\n$ make demo\nsome output\n$ make clean\n```\n"
    )
    assert readme_commands(markdown) == ["make demo", "pip install .", "make deploy", "make demo", "make clean"]
    assert missing_from_ci(markdown, [ci]) == ["make deploy", "make clean"]
    # A command that only appears inside a longer line, or in a comment, is not run as written.
    ci.write_text("echo make deploy\n# make clean\n")
    assert missing_from_ci(markdown, [ci]) == ["make demo", "pip install .", "make deploy", "make demo", "make clean"]


def test_ci_runs_the_readme_commands_before_the_suite() -> None:
    """The demo and the install are checked from the fresh clone before `make test` installs the test tools."""
    lines = _logical_lines(CI_ENTRY.read_text(encoding="utf-8"))
    assert "GPUMEM_DEMO_CHECK=1 make demo" in lines
    assert ".ci/install_check" in lines
    assert lines.index("GPUMEM_DEMO_CHECK=1 make demo") < lines.index("make test")
    assert lines.index(".ci/install_check") < lines.index("make test")
