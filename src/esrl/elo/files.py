"""Completion files for `esrl elo`, lined up by prompt across models; every bad line names `file:line`.

Formats:
- JSON Lines, one row per prompt: {"prompt": ..., "completion": ...} ("response" is accepted for
  "completion"), with an optional "id" (string or integer);
- a run's samples.csv written by the Evaluation callback (columns step, prompt, greedy, ...): the greedy
  completions of its last step.
Rows are paired across files by id when every row of every file has one, else by the prompt text.
"""

from __future__ import annotations

import ast
import csv
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from esrl.errors import ConfigError, DataError
from esrl.labels import split_label
from esrl.tasks.base import prompt_text
from esrl.tasks.io import read_jsonl


@dataclass(frozen=True)
class Row:
    prompt: str
    completion: str
    id: str | None
    where: str  # file:line


@dataclass(frozen=True)
class Tournament:
    """The models (in command-line order), the prompts, and completions[model][k] for prompt k."""

    models: list[str]
    prompts: list[str]
    completions: dict[str, list[str]]
    prompt_ids: list[str]


def parse_spec(spec: str) -> tuple[str, Path]:
    """`name=path` or `path` (name: the file's stem, or for a samples.csv its run's folder, above lightning_logs/
    version_N). A path may hold `=` (a study's runs/es_seed=0/...): esrl.labels.split_label."""
    name, path = split_label(spec)
    file = Path(path)
    if not name:  # a run's samples.csv (RUN/lightning_logs/version_N/samples.csv): the run's folder
        folders = [p for p in file.parent.parts if p != "lightning_logs" and not re.fullmatch(r"version_\d+", p)]
        name = folders[-1] if file.stem == "samples" and folders else file.stem  # ./samples.csv: "samples"
    if not path or not name:
        raise ConfigError(f"--completions {spec!r}: expected NAME=PATH")
    return name, file


def _check_jsonl(row: dict[str, Any], where: str) -> None:
    if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise DataError(f"{where}: needs a non-empty string field 'prompt'")
    text = row.get("completion", row.get("response"))
    if not isinstance(text, str):
        raise DataError(f"{where}: needs a string field 'completion' (or 'response')")
    if "id" in row and (isinstance(row["id"], bool) or not isinstance(row["id"], (str, int))):
        raise DataError(f"{where}: field 'id' must be a string or an integer, got {row['id']!r:.60}")
    row["_where"] = where


def _readable(prompt: str) -> str:
    """A chat prompt that esrl before 2026-11-27 wrote to samples.csv as a Python list repr, as its text."""
    if prompt.startswith("[{'role'"):
        try:
            return prompt_text(ast.literal_eval(prompt))
        except (ValueError, SyntaxError, TypeError, AttributeError):
            return prompt
    return prompt


def _read_samples_csv(path: Path) -> list[Row]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = {"step", "prompt", "greedy"} - set(reader.fieldnames or [])
            if missing:
                raise DataError(f"{path}:1: a samples.csv needs the columns step, prompt and greedy "
                                f"(missing {', '.join(sorted(missing))})")
            rows = []
            for raw in reader:
                where = f"{path}:{reader.line_num}"
                try:
                    step = int(raw["step"])
                except (TypeError, ValueError):
                    raise DataError(f"{where}: column 'step' must be an integer, got {raw['step']!r:.60}") from None
                rows.append((step, Row(_readable(raw["prompt"] or ""), raw["greedy"] or "", None, where)))
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path}: cannot read as CSV ({e})") from None
    if not rows:
        raise DataError(f"{path}: no rows")
    last = max(step for step, _ in rows)
    return [row for step, row in rows if step == last]


def read_completions(path: Path) -> list[Row]:
    """The rows of one completion file, in file order."""
    if path.suffix.lower() == ".csv":
        return _read_samples_csv(path)
    rows = read_jsonl(path, check=_check_jsonl)
    return [Row(r["prompt"], r.get("completion", r.get("response")),
                None if "id" not in r else str(r["id"]), r["_where"]) for r in rows]


def line_up(specs: list[str], max_prompts: int | None = None) -> Tournament:
    """Read every file and pair their rows by prompt: the first file sets the prompts and their order."""
    files = [parse_spec(s) for s in specs]
    names = [name for name, _ in files]
    if len(files) < 2:
        raise ConfigError("--completions: give at least two models (NAME=PATH ...)")
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"--completions: model name {dup!r} given twice (name them: NAME=PATH)")
    tables = [read_completions(path) for _, path in files]
    by_id = all(row.id is not None for rows in tables for row in rows)
    keyed: list[dict[str, Row]] = []
    for rows in tables:
        table: dict[str, Row] = {}
        for row in rows:
            key = row.id if by_id else row.prompt
            if key in table:
                what = f"id {key!r}" if by_id else "prompt"
                raise DataError(f"{row.where}: duplicate {what} (first at {table[key].where})")
            table[key] = row
        keyed.append(table)
    reference = keyed[0]
    keys = list(reference)[:max_prompts] if max_prompts else list(reference)
    for (name, path), table in zip(files[1:], keyed[1:]):
        for key in keys:
            if key not in table:
                first = reference[key]
                raise DataError(f"{path}: no completion for the prompt of {first.where} ({first.prompt!r:.80})")
            if by_id and table[key].prompt != reference[key].prompt:
                raise DataError(f"{table[key].where}: id {key!r} has another prompt than {reference[key].where}")
        if not max_prompts:
            extra = next((row for k, row in table.items() if k not in reference), None)
            if extra is not None:
                raise DataError(f"{extra.where}: prompt not in {files[0][1]} ({extra.prompt!r:.80})")
    return Tournament(models=names, prompts=[reference[k].prompt for k in keys],
                      completions={name: [table[k].completion for k in keys] for name, table in zip(names, keyed)},
                      prompt_ids=[str(k) if by_id else str(i) for i, k in enumerate(keys)])


__all__ = ["Row", "Tournament", "line_up", "parse_spec", "read_completions"]
