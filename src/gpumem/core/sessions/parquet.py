"""The Parquet form of a session export: the very document the JSON file holds
(:func:`gpumem.core.sessions.session_file.session_to_json`), in columns, so pandas reads the samples and the cell
rows directly and :func:`gpumem.core.sessions.session_file.read_session` checks what comes back as it checks the JSON.

``STEM.samples.parquet``: a row per time, a column per channel (NaN: not measured). ``STEM.cells.parquet``:
the history's flat rows, and the rest of the document (the cells themselves, marks, reports, export times)
as JSON in its schema's metadata. ``STEM.levelN.parquet``: one level of the timeline store. Each file is
written aside and renamed; one export id in every file lets the reader refuse a set mixed from two exports
(a failure between two files). pyarrow (the ``parquet`` extra) is imported only here, only when asked for.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from gpumem.core.atomic_files import write_file

__all__ = ["ParquetExportError", "parquet_stem", "read_document", "read_store_document", "write_document"]

_SESSION_META = "gpumem_session"  # the cells file's metadata key (the samples file: its export id only)
_STORE_META = "gpumem_store"  # each level file's
_MAGIC = b"PAR1"
_MEMBER = re.compile(r"(?P<stem>.+)\.(?:samples|cells|level[0-9]+)\.parquet")


class ParquetExportError(ValueError):
    """A Parquet file that is not (or no longer) part of a gpumem export; the message says which and why."""


def _member(stem: Path, part: str) -> Path:
    return stem.with_name(f"{stem.name}.{part}.parquet")


# Writing ----------------------------------------------------------------------------------------


def write_document(document: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], stem: Path) -> list[Path]:
    """The session ``document`` and the history's flat ``rows`` as ``STEM.*.parquet``; ImportError without
    pyarrow. Returns the files written, samples and cells first."""
    pa = importlib.import_module("pyarrow")
    pq = importlib.import_module("pyarrow.parquet")
    export = uuid.uuid4().hex
    timeline, store = document["timeline"], document["store"]
    head = {key: value for key, value in document.items() if key not in {"timeline", "store"}}
    head.update(export=export, levels=None if store is None else len(store["levels"]))
    samples = pa.table(
        {"time_s": timeline["times"], **{name: _floats(pa, column) for name, column in timeline["values"].items()}}
    )
    cells = pa.Table.from_pylist(list(rows)) if rows else pa.table({"cell": pa.array([], pa.int64())})
    tables = [
        (".samples.parquet", samples.replace_schema_metadata({_SESSION_META: json.dumps({"export": export})})),
        (".cells.parquet", cells.replace_schema_metadata({_SESSION_META: json.dumps(head, allow_nan=False)})),
    ]
    if store is not None:
        tables += [
            (f".level{index}.parquet", _level_table(pa, store, index, export)) for index in range(head["levels"])
        ]
    written = []
    for suffix, table in tables:
        target = stem.with_name(stem.name + suffix)
        write_file(target, partial(pq.write_table, table), binary=True)
        written.append(target)
    return written


def _floats(pa: Any, values: Sequence[float | None]) -> Any:
    """The document's null (not measured) as NaN, as the timeline itself holds it."""
    return pa.array([math.nan if value is None else value for value in values], pa.float64())


def _level_table(pa: Any, store: Mapping[str, Any], index: int, export: str) -> Any:
    """A level's keys and, per channel, one column per value of a row (``NAME@0``, ``NAME@1``); the rest
    of the store (spans, open buckets, marks) as JSON in the schema's metadata."""
    level = store["levels"][index]
    rows = len(level["keys"])
    width = len(next(iter(level["columns"].values()), [])) // rows if rows else 1
    columns: dict[str, Any] = {"key": pa.array(level["keys"], pa.float64())}
    for name, values in level["columns"].items():
        for part in range(width):
            columns[f"{name}@{part}"] = _floats(pa, values[part::width])
    rest = {key: value for key, value in level.items() if key not in {"keys", "columns"}}
    meta = {**{k: v for k, v in store.items() if k != "levels"}, "level": index, "width": width, **rest}
    meta["of"] = len(store["levels"])  # how many to read back: an earlier export may have left more
    meta["export"] = export
    return pa.table(columns).replace_schema_metadata({_STORE_META: json.dumps(meta, allow_nan=False)})


# Reading ----------------------------------------------------------------------------------------


def parquet_stem(path: Path) -> Path | None:
    """The stem of the Parquet export ``path`` belongs to (its first bytes say Parquet), or that it names
    (no such file, but ``PATH.samples.parquet`` is there); None: not Parquet."""
    if not path.exists():
        stems = (path, path.with_suffix("")) if path.suffix == ".parquet" else (path,)
        return next((stem for stem in stems if _member(stem, "samples").is_file()), None)
    if not path.is_file():
        return None
    with path.open("rb") as handle:
        if handle.read(len(_MAGIC)) != _MAGIC:
            return None
    match = _MEMBER.fullmatch(path.name)
    if match is None:
        raise ParquetExportError(
            "a Parquet file, but not one of a gpumem export's (STEM.samples.parquet, STEM.cells.parquet, "
            "STEM.levelN.parquet)"
        )
    return path.with_name(match["stem"])


def read_document(stem: Path) -> dict[str, Any]:
    """The document :func:`write_document` wrote, unchecked (the caller checks it as a JSON file's); ImportError
    without pyarrow, and any other failure (a missing, truncated or foreign file) a :class:`ParquetExportError`."""
    pa = importlib.import_module("pyarrow")
    pq = importlib.import_module("pyarrow.parquet")
    try:
        return _document(pq, stem)
    except ParquetExportError:
        raise
    except FileNotFoundError as error:
        missing = Path(error.filename or str(error)).name
        raise ParquetExportError(f"{missing} is missing (a Parquet export is read as a set)") from None
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, pa.ArrowException) as error:
        raise ParquetExportError(f"{type(error).__name__}: {error}") from None


def _document(pq: Any, stem: Path) -> dict[str, Any]:
    samples = pq.read_table(_member(stem, "samples"))
    head = _metadata(pq.read_table(_member(stem, "cells")), _SESSION_META, f"{stem.name}.cells.parquet")
    if "export" not in head:
        raise ParquetExportError(
            f"{stem.name}.cells.parquet is of an older export (flat cell rows only); load the JSON file written with it"
        )
    if _metadata(samples, _SESSION_META, f"{stem.name}.samples.parquet").get("export") != head["export"]:
        raise ParquetExportError(f"{stem.name}.samples.parquet is of another export than {stem.name}.cells.parquet")
    columns = samples.to_pydict()
    times = columns.pop("time_s")
    values = {name: [_null(value) for value in column] for name, column in columns.items()}
    store = None if head.get("levels") is None else read_store_document(stem, head["export"])
    return {**head, "timeline": {"times": times, "values": values}, "store": store}


def _metadata(table: Any, key: str, name: str) -> dict[str, Any]:
    meta = json.loads((table.schema.metadata or {}).get(key.encode(), b"null"))
    if not isinstance(meta, dict):
        raise ParquetExportError(f"{name}: not a gpumem export's (no {key} metadata)")
    return meta


def _null(value: Any) -> Any:
    """NaN (not measured) as the JSON document's null: what the caller's checks read as not measured."""
    return None if isinstance(value, float) and math.isnan(value) else value


def read_store_document(stem: Path, export: str | None = None) -> dict[str, Any]:
    """The timeline store from ``STEM.levelN.parquet``, unchecked; ImportError without pyarrow, OSError when a
    file is missing, :class:`ParquetExportError` when one is not a level (or, given ``export``, not of it)."""
    pq = importlib.import_module("pyarrow.parquet")
    levels: list[dict[str, Any]] = []
    store: dict[str, Any] = {}
    count = 1
    while len(levels) < count:
        path = _member(stem, f"level{len(levels)}")
        table = pq.read_table(path)
        meta = _metadata(table, _STORE_META, path.name)
        if export is not None and meta.get("export") != export:
            raise ParquetExportError(f"{path.name} is of another export than {stem.name}.cells.parquet")
        meta.pop("export", None)
        width, data = int(meta.pop("width")), table.to_pydict()
        parts = {name.rpartition("@")[0] for name in data if name != "key"}
        columns = {
            name: [data[f"{name}@{i % width}"][i // width] for i in range(width * table.num_rows)] for name in parts
        }
        store = {key: meta.pop(key) for key in ("channels", "last_time_s", "max_marks", "marks")}
        meta.pop("level")
        of = meta.pop("of", None)
        levels.append({**meta, "keys": data["key"], "columns": columns})
        following = _member(stem, f"level{len(levels)}").exists()
        count = int(of) if of is not None else len(levels) + following  # without "of": every file there
    return {**store, "levels": levels}
