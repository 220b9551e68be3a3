"""Reading task data files so that every bad line is reported as `file:line: what is wrong`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

from esrl.errors import DataError

# field -> accepted JSON types (as Python types), e.g. {"question": str, "numbers": list}.
Schema = Mapping[str, type | tuple[type, ...]]
# Further checks of a row: f(row, where) raises DataError(f"{where}: ...") when the row is unusable; it may
# also normalise the row in place.
RowCheck = Callable[[dict[str, Any], str], None]


def _read_bytes(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        where = "" if Path(path).is_absolute() else \
            f" in {Path.cwd()} (a relative path is read from the current folder)"
        raise DataError(f"{path}: file not found{where}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def _type_names(types: type | tuple[type, ...]) -> str:
    names = {str: "string", int: "integer", float: "number", list: "list", dict: "object", bool: "boolean"}
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(names.get(t, t.__name__) for t in types)


def check_row(row: Any, schema: Schema, where: str) -> dict[str, Any]:
    """Check that a row is an object with the schema's fields and types; `where` is `file:line`."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key, types in schema.items():
        if key not in row:
            raise DataError(f"{where}: missing field {key!r}")
        value = row[key]
        # bool is an int in Python, never a valid number or string here.
        if isinstance(value, bool) or not isinstance(value, types):
            raise DataError(f"{where}: field {key!r} must be a {_type_names(types)}, got {value!r:.60}")
    return row


def read_jsonl(path: str | Path, schema: Schema | None = None,
               check: RowCheck | None = None) -> list[dict[str, Any]]:
    """Rows of a JSON Lines file (blank lines skipped); each must be an object matching `schema` and `check`.

    Lines are split and decoded one by one so that even an encoding error names its line.
    """
    rows = []
    for number, raw in enumerate(_read_bytes(path).splitlines(), start=1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        rows.append(check_row(row, schema or {}, where))
        if check is not None:
            check(row, where)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def read_json_list(path: str | Path, schema: Schema | None = None,
                   check: RowCheck | None = None) -> list[dict[str, Any]]:
    """Rows of a file holding one JSON list of objects (e.g. TinyZero's countdown.json).

    A syntax error names its line; a bad row names its position in the list (0-based, as `id` counts).
    """
    try:
        text = _read_bytes(path).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    if not data:
        raise DataError(f"{path}: no rows")
    for i, row in enumerate(data):
        check_row(row, schema or {}, f"{path}: item {i}")
        if check is not None:
            check(row, f"{path}: item {i}")
    return data


def read_rows(path: str | Path, schema: Schema | None = None,
              check: RowCheck | None = None) -> list[dict[str, Any]]:
    """A JSON list file or a JSON Lines file, told apart by the first non-blank character."""
    head = _read_bytes(path).lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    return (read_json_list if head == b"[" else read_jsonl)(path, schema, check)


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a Parquet file (pyarrow, which `datasets` brings); an unreadable file is one line naming it."""
    import pyarrow.parquet as pq

    _read_bytes(path)  # a missing or unreadable file says so first
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow's errors are several types; one line naming the file
        raise DataError(f"{path}: not a readable Parquet file "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def hub_reachable() -> str | None:
    """None when the hub answers (esrl.hub) or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set (then `datasets` reads
    its cache without asking), else why not."""
    import os

    from esrl.hub import hub_unreachable

    offline = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in offline):
        return None
    return hub_unreachable()


def read_hub(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """Rows of a hub data set split; offline, an unknown id/config/split: one line naming it."""
    where = f"{name} (config {config!r}, split {split!r})"
    problem = hub_reachable()
    if problem is not None:
        raise DataError(f"{where}: cannot load from the hub: {problem}; give a local JSONL or Parquet file, "
                        "or set HF_HUB_OFFLINE=1 to use a cached copy")
    import datasets

    try:
        data = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001 - offline, unknown id/config/split: one line naming it
        raise DataError(f"{where}: cannot load from the hub "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return [dict(r) for r in data]
