"""The command line: ``python -m gpumem run script.py [args...]`` (the logic is :mod:`gpumem.core.scripts.runner`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gpumem", description="Where did my GPU memory go?")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run a Python script under gpumem and report its memory on stderr at exit",
        description="Run SCRIPT as `python SCRIPT ARGS` would; at exit, print its memory report to stderr.",
    )
    run.add_argument(
        "--save",
        metavar="PATH",
        help="also keep the session (figures and timeline) as a JSON export, which %%gpumem load shows",
    )
    run.add_argument("--rate", metavar="HZ", type=float, default=10.0, help="samples per second (default 10)")
    run.add_argument("script", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    options = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    if options.rate <= 0:
        sys.stderr.write(f"gpumem run: --rate takes a positive number of samples per second, not {options.rate}\n")
        return 2
    from gpumem.core.scripts.runner import run_script

    return run_script(options.script, list(options.args), save=options.save, rate_hz=options.rate)


if __name__ == "__main__":
    raise SystemExit(main())
