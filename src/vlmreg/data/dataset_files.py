"""Dataset files -> records: the JSONL and Parquet readers behind `vlmreg.data.datasets` (which turns each record into
an `Example`) and ``vlmreg validate --data`` (`vlmreg.data.survey`).

A record is named ``path:line`` (JSONL, from 1) or ``path:row`` (Parquet, from 0); a file or record that cannot be
read is a `DataError` naming it, and so is a record nested deeper than `MAX_RECORD_DEPTH`. ``[data] image_roots``
(`image_roots`) and the data paths (`data_path`) are checked here too, before any record is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmreg.sdk.errors import VlmregError

if TYPE_CHECKING:
    from vlmreg.config.schema import DataSection

__all__ = [
    "MAX_RECORD_DEPTH",
    "DataError",
    "data_path",
    "image_roots",
    "jsonl_records",
    "read_records",
    "value_kind",
]

_PARQUET_BATCH = 64
MAX_RECORD_DEPTH = 64  # arrays and objects nested deeper than this in a record are refused (a chat record needs ~6)


class DataError(VlmregError, ValueError):
    """A dataset file or record that cannot be read; the one-line message names the file, record and key."""


def image_roots(section: DataSection, base: Path) -> tuple[Path, ...]:
    """``[data] image_roots``, each resolved (relative ones against ``base``, the config's folder); `DataError`
    naming the entry when one is not an existing folder."""
    roots = []
    for index, entry in enumerate(section.image_roots):
        key = f"[data] image_roots[{index}]"
        if not isinstance(entry, str) or not entry:
            raise DataError(f"{key}: expected a folder path, got {value_kind(entry)}")
        root = Path(entry).expanduser()
        if not root.is_absolute():
            root = base / root
        where = entry if str(root) == entry else f"{entry} (looked for {root})"
        try:
            resolved = root.resolve(strict=True)
        except (OSError, RuntimeError, ValueError):
            raise DataError(f"{key}: image folder not found: {where}") from None
        if not resolved.is_dir():
            raise DataError(f"{key}: not a folder: {where}")
        roots.append(resolved)
    return tuple(roots)


def data_path(shown: str, base: Path) -> Path:
    path = Path(shown).expanduser()
    if not path.is_absolute():
        path = base / path
    where = shown if str(path) == shown else f"{shown} (looked for {path})"
    if not path.exists():
        raise DataError(f"data file not found: {where}")
    if not path.is_file():
        raise DataError(f"data path is not a file: {where}")
    if path.suffix.lower() not in (".jsonl", ".parquet"):
        raise DataError(f"{shown}: unknown data file type {path.suffix or '(none)'!r}; expected .jsonl or .parquet")
    return path


def read_records(path: Path, shown: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(record id, record)`` from a ``.jsonl`` or ``.parquet`` file; ``shown`` is the path as the user wrote
    it."""
    records = _parquet_records(path, shown) if path.suffix.lower() == ".parquet" else jsonl_records(path, shown)
    for record_id, record in records:
        _check_depth(record, record_id)
        yield record_id, record


def _check_depth(record: Any, record_id: str) -> None:
    """`DataError` when arrays and objects nest deeper than `MAX_RECORD_DEPTH` (walked without recursion)."""
    pending: list[tuple[Any, int]] = [(record, 1)]
    while pending:
        value, depth = pending.pop()
        children = value.values() if isinstance(value, Mapping) else value if isinstance(value, list) else ()
        for child in children:
            if isinstance(child, (Mapping, list)):
                if depth + 1 > MAX_RECORD_DEPTH:
                    raise DataError(
                        f"{record_id}: arrays and objects nested more than {MAX_RECORD_DEPTH} deep; a record is "
                        "refused past that"
                    )
                pending.append((child, depth + 1))


def jsonl_records(
    path: Path, shown: str, on_error: Callable[[DataError], None] | None = None
) -> Iterator[tuple[str, Any]]:
    """Each line's ``(record id, record)``; a line that is not UTF-8 JSON raises `DataError`, or with ``on_error`` is
    handed to it and reading goes on (`vlmreg validate --data` reports every bad line)."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            record_id = f"{shown}:{number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.rstrip("\r\n"))
                except RecursionError:  # deeper than Python's JSON reader goes (about 1000 levels)
                    raise DataError(
                        f"{record_id}: arrays and objects nested too deeply to read; a record is refused past "
                        f"{MAX_RECORD_DEPTH} levels"
                    ) from None
            except UnicodeDecodeError as exc:
                error = DataError(f"{record_id}: not UTF-8 text ({exc.reason} at byte {exc.start + 1} of the line)")
            except json.JSONDecodeError as exc:
                error = DataError(f"{record_id}: not valid JSON ({exc.msg} at column {exc.colno})")
            except DataError as exc:
                error = exc
            else:
                yield record_id, record
                continue
            if on_error is None:
                raise error
            on_error(error)


def _parquet_records(path: Path, shown: str) -> Iterator[tuple[str, Any]]:
    # deferred: start-up cost (loads pyarrow)
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH)
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                yield f"{shown}:{row}", record
                row += 1
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{shown}: not a readable Parquet file ({' '.join(str(exc).split())})") from None


def value_kind(value: Any) -> str:
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
    }
    if isinstance(value, list) and not value:
        return "an empty array"
    if isinstance(value, (str, bytes, bytearray)) and not value:
        return f"an empty {'string' if isinstance(value, str) else 'byte string'}"
    return "null" if value is None else names.get(type(value), type(value).__name__)
