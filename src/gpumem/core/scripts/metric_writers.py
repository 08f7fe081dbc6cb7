"""Where step metrics go: CSV, JSON lines, TensorBoard. Each writer takes ``write(step, metrics)``.

Files are appended a whole line per ``write`` call and flushed, so a crash loses at most the line being
written and a reader never sees half a row; a CSV whose columns grow (a GPU initialized mid-run) is
rewritten once, atomically, with the wider header.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from gpumem.core.atomic_files import write_file

__all__ = ["CsvWriter", "JsonlWriter", "MetricsWriter", "TensorBoardWriter"]


class MetricsWriter(Protocol):
    def write(self, step: int | None, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _finite(metrics: Mapping[str, float]) -> dict[str, float]:
    """Numbers only: a NaN or a non-number is left out alone, the rest of the row is kept."""
    kept: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        kept[str(name)] = value
    return kept


def _append_line(path: Path, line: str) -> None:
    """One ``write`` of one whole line with O_APPEND: concurrent appenders never interleave within it."""
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # less the umask
    try:
        os.write(descriptor, line.encode("utf-8"))
    finally:
        os.close(descriptor)


class JsonlWriter:
    """One JSON object per line: ``{"step": 100, "wall_time_s": ..., "gpumem/cuda0/allocated_bytes": ...}``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int | None, metrics: Mapping[str, float]) -> None:
        row: dict[str, Any] = {"step": step, "wall_time_s": time.time(), **_finite(metrics)}
        _append_line(self.path, json.dumps(row, separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Nothing is held open between writes."""


class CsvWriter:
    """A table with one row per measured step; columns are ``step``, ``wall_time_s`` and the metric names."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._columns: list[str] = self._existing_columns()

    def _existing_columns(self) -> list[str]:
        try:
            with self.path.open(encoding="utf-8", newline="") as file:
                return next(csv.reader(file), [])
        except FileNotFoundError:
            return []

    def write(self, step: int | None, metrics: Mapping[str, float]) -> None:
        row: dict[str, Any] = {"step": "" if step is None else step, "wall_time_s": time.time(), **_finite(metrics)}
        new = [name for name in row if name not in self._columns]
        if new:
            self._widen([*self._columns, *new] if self._columns else list(row))
        _append_line(self.path, self._line([row.get(name, "") for name in self._columns]))

    def _widen(self, columns: list[str]) -> None:
        rows: list[dict[str, str]] = []
        if self._columns:
            with self.path.open(encoding="utf-8", newline="") as file:
                rows = list(csv.DictReader(file))
        text = self._line(columns) + "".join(self._line([old.get(name, "") for name in columns]) for old in rows)
        write_file(self.path, lambda handle: handle.write(text))
        self._columns = columns

    @staticmethod
    def _line(values: list[Any]) -> str:
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerow(values)
        return buffer.getvalue()

    def close(self) -> None:
        """Nothing is held open between writes."""


class TensorBoardWriter:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` (needs the tensorboard package)."""

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, *, summary_writer: Any = None) -> None:
        if summary_writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ImportError(
                    f"gpumem's TensorBoard writer needs torch and tensorboard (pip install tensorboard); {error}"
                ) from None
            summary_writer = SummaryWriter(log_dir=None if log_dir is None else str(log_dir))
            self._owned = True
        else:
            self._owned = False
        self.summary_writer = summary_writer

    def write(self, step: int | None, metrics: Mapping[str, float]) -> None:
        for name, value in _finite(metrics).items():
            self.summary_writer.add_scalar(name, value, global_step=step)
        self.summary_writer.flush()

    def close(self) -> None:
        if self._owned:
            self.summary_writer.close()
