"""Every ``%gpumem`` subcommand in terminal IPython, with torch missing, with the CPU build of torch and
with no visible CUDA device: each works or says why in one line, never a traceback; and gpumem opens no
listening socket (checked in the terminal shell, where the kernel's own ZMQ sockets do not exist)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from _harness import SRC_DIR

# One command per line (the terminal reads lines); "@@ name" starts each command's share of the output.
_COMMANDS = [
    ("load", "%load_ext gpumem"),
    ("help", "%gpumem help"),
    ("monitor", "%gpumem monitor"),
    ("sidebar", "%gpumem sidebar"),
    ("auto on", "%gpumem auto on"),
    ("torch", "exec('try:\\n import torch; t = torch.ones(1 << 20)\\nexcept ImportError:\\n print(\\'no torch\\')')"),
    ("cells", "x = [0] * 1000; y = bytearray(8 << 20)"),
    ("auto off", "%gpumem auto off"),
    ("cell magic", "get_ipython().run_cell('%%gpumem\\nz = bytearray(4 << 20)')"),
    ("trace", "get_ipython().run_cell('%%gpumem --trace --profile\\nq = 1')"),
    ("history", "%gpumem history"),
    ("status", "%gpumem status"),
    ("who", "%gpumem who"),
    ("free", "%gpumem free"),
    ("free deep", "%gpumem free --deep"),
    ("python api", "import gpumem; print(type(gpumem.free()).__name__, len(gpumem.history()))"),
    (
        "sockets",
        (
            "import psutil; p = psutil.Process(); conns = p.net_connections(kind='inet') "
            "if hasattr(p, 'net_connections') else p.connections(kind='inet'); "
            "print('listening', [c.laddr for c in conns if c.status == psutil.CONN_LISTEN])"
        ),
    ),
    ("unload", "%unload_ext gpumem"),
    ("threads", "import threading; print('threads', [t.name for t in threading.enumerate() if 'gpumem' in t.name])"),
]

_HIDE_TORCH = "import sys; sys.modules['torch'] = None\n"  # `import torch` raises ImportError

_VARIANTS = {
    "cpu torch": ({}, ""),
    "no torch": ({}, _HIDE_TORCH),
    "no visible device": ({"CUDA_VISIBLE_DEVICES": ""}, ""),
}


def run_terminal_ipython(env_extra: dict[str, str], prelude: str, tmp_path: os.PathLike[str]) -> dict[str, str]:
    """Run the commands in ``python -m IPython --simple-prompt`` fed on stdin; output per command."""
    script = "".join(f"print('@' + '@ {name}')\n{code}\n" for name, code in _COMMANDS)
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC_DIR), env.get("PYTHONPATH", "")])
    env["IPYTHONDIR"] = str(tmp_path)
    launcher = (
        prelude
        + "from IPython import start_ipython\n"
        + "start_ipython(argv=['--simple-prompt', '--no-banner', '--colors=nocolor'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", launcher],
        input=script,
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    sections: dict[str, str] = {}
    name = ""
    for raw in (done.stdout + "\n" + done.stderr).splitlines():
        line = raw.split(":", 1)[-1] if raw.strip().startswith("In [") and "@@ " not in raw else raw
        if "@@ " in line:
            name = line.split("@@ ", 1)[1].strip()
            sections[name] = ""
        elif name:
            sections[name] += line.strip() + "\n"
    return sections


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
def test_every_subcommand_works_or_says_why_in_terminal_ipython(variant: str, tmp_path: os.PathLike[str]) -> None:
    env_extra, prelude = _VARIANTS[variant]
    sections = run_terminal_ipython(env_extra, prelude, tmp_path)
    assert list(sections) == [name for name, _ in _COMMANDS], sections
    for name, text in sections.items():
        errors = [line for line in text.splitlines() if re.match(r"[A-Za-z]*(Error|Exception):", line)]
        assert "Traceback" not in text and all(line.startswith("UsageError") for line in errors), (variant, name, text)
        refusals = [line for line in text.splitlines() if "UsageError" in line]
        assert len(refusals) <= 1, (variant, name, text)
    said = {name: text for name, text in sections.items() if name not in ("load", "unload", "cells", "torch")}
    assert all(text.strip() for text in said.values()), (variant, said)
    assert "listening []" in sections["sockets"], sections["sockets"]
    assert "threads []" in sections["threads"], sections["threads"]
    if variant == "no torch":
        assert "torch" in sections["status"], sections["status"]
        # torch cannot be imported here: the advice is not to import it in an earlier cell
        assert "earlier cell" not in sections["trace"], sections["trace"]
        assert sections["trace"].count("PyTorch is not installed in this Python environment") == 2, sections["trace"]
    print(variant, {name: text.strip().splitlines()[:1] for name, text in sections.items()})
