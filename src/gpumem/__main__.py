"""``python -m gpumem run script.py``: see :mod:`gpumem.cli`."""

from __future__ import annotations

from gpumem.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
