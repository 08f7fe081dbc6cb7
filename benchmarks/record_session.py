"""Record the session the README's pictures are taken from: run notebooks/gpu_session.ipynb in a real kernel.

The notebook trains a small MLP with the panel open and automatic mode on: a leak found (``%gpumem who``) and
fixed, a transient peak, ``%gpumem free``, an out-of-memory error explained; then ``%gpumem export``. This
script executes it with nbclient (a real ipykernel) and writes into ``--out``:

* ``--name`` (default ``h200-training.json``): the export, which docs/sessions/ keeps as the README's source;
* ``gpu_session.executed.ipynb``: the notebook with every output, to read what each cell reported;
* ``record.txt``: the machine, torch and what the export holds.

On a GPU machine, from the repository root (the GPU machine's wheels installed into .site as .ci/gpu does)::

    PYTHONPATH=.site:src python3 benchmarks/record_session.py --out "$OUT"

Without CUDA it runs too, with small sizes, and records host memory only: that tests the recording, and
``--require-cuda`` (on by default when CUDA is available) refuses such an export as the README's source.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "gpu_session.ipynb"
# The export stays a small fixture in the repository: the notebook's panel samples at 10 Hz for ~30 s.
MAX_EXPORT_BYTES = 500_000
CUDA_CHANNELS = ("cuda:0/allocated", "cuda:0/reserved", "cuda:0/used")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="folder for the files")
    parser.add_argument("--name", default="h200-training.json", help="the export's file name")
    parser.add_argument("--notebook", type=Path, default=NOTEBOOK)
    parser.add_argument("--cell-timeout", type=int, default=180, help="seconds per cell")
    parser.add_argument(
        "--require-cuda",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fail unless the export has cuda:0's allocated, reserved and device-used curves "
        "(default: when CUDA is available)",
    )
    return parser.parse_args(argv)


def environment() -> list[str]:
    lines = [f"date: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}", f"python: {sys.version.split()[0]}"]
    lines.append(f"platform: {platform.platform()}")
    try:
        import torch
    except ImportError as error:
        return [*lines, f"torch: not importable ({error})"]
    lines.append(f"torch: {torch.__version__} (CUDA {torch.version.cuda}, available: {torch.cuda.is_available()})")
    return lines


def device_name() -> list[str]:
    """cuda:0's name, asked only after the notebook ran: asking creates a CUDA context in this process,
    which the recorded session would otherwise show as another process holding device memory."""
    try:
        import torch
    except ImportError:
        return []
    return [f"cuda:0: {torch.cuda.get_device_name(0)}"] if torch.cuda.is_available() else []


def execute(notebook: Path, export: Path, cell_timeout: int, executed: Path) -> str | None:
    """Run the notebook in a fresh kernel (cwd: the export's folder); None, or why it failed."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    document = nbformat.read(notebook, as_version=4)
    os.environ["GPUMEM_SESSION_EXPORT"] = str(export)  # the kernel inherits it; the last cell exports there
    # The kernel runs in the export's folder: a relative PYTHONPATH (.site:src) would name nothing there.
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ["PYTHONPATH"] = os.pathsep.join(str(Path(entry).resolve()) for entry in entries if entry)
    client = NotebookClient(
        document,
        timeout=cell_timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(export.parent)}},
    )
    failure = None
    try:
        client.execute()
    except CellExecutionError as error:
        failure = str(error)[-4000:]
    finally:
        nbformat.write(document, executed)
    return failure


def describe(export: Path, require_cuda: bool) -> tuple[list[str], list[str]]:
    """What the export holds, and what is wrong with it as the README's source."""
    sys.path.insert(0, str(REPO / "src"))
    from gpumem.core.sessions.loaded_session import LoadedSession
    from gpumem.core.sessions.session_file import read_session

    problems: list[str] = []
    size = export.stat().st_size
    data = read_session(export)
    lines = [f"export: {export.name}, {size:,} bytes", *LoadedSession(data, export.name).channel_lines()]
    lines.append(f"marks: {', '.join(mark.label for mark in data.marks)}")
    lines.append(f"cells: {', '.join(str(cell.execution_count) for cell in data.cells)}")
    if size > MAX_EXPORT_BYTES:
        problems.append(f"the export is {size:,} bytes, over the {MAX_EXPORT_BYTES:,} a fixture may take")
    missing = [name for name in CUDA_CHANNELS if name not in data.timeline.values]
    if require_cuda and missing:
        problems.append(f"no {', '.join(missing)} curve in the export")
    return lines, problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    export = out / args.name
    if export.exists():
        export.unlink()  # %gpumem export refuses to replace a file by surprise; this one is ours
    lines = environment()
    require_cuda = args.require_cuda
    if require_cuda is None:
        require_cuda = any("available: True" in line for line in lines)
    started = time.monotonic()
    failure = execute(args.notebook, export, args.cell_timeout, out / "gpu_session.executed.ipynb")
    lines.extend(device_name())
    lines.append(f"notebook ran in {time.monotonic() - started:.1f} s" + (": FAILED" if failure else ""))
    problems = [f"a cell failed:\n{failure}"] if failure else []
    if export.exists():
        described, wrong = describe(export, require_cuda)
        lines.extend(described)
        problems.extend(wrong)
    else:
        problems.append(f"the notebook wrote no export at {export}")
    lines.extend(f"PROBLEM: {problem}" for problem in problems)
    text = "\n".join(lines)
    print(text)
    (out / "record.txt").write_text(text + "\n", encoding="utf-8")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
