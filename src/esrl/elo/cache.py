"""The judgment cache: an append-only JSON Lines file, one judgment per line, written as each answer arrives.

Each line is flushed at once, so killing a tournament loses at most the requests in flight, and rerunning the
same command asks the judge only what is missing (or was unreadable). A line torn by a kill is skipped (and counted) on reading.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JudgmentCache:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries: dict[str, dict[str, Any]] = {}
        self.damaged = 0
        data = self.path.read_bytes() if self.path.exists() else b""
        # Lines end at b"\n" only: str.splitlines() also splits at U+2028/U+2029, which a judge's answer may hold
        for line in (raw.decode("utf-8", errors="replace") for raw in data.split(b"\n")):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                self.damaged += bool(line.strip())
                continue
            if isinstance(record, dict) and isinstance(record.get("key"), str) and "raw" in record:
                self.entries[record["key"]] = record
            else:
                self.damaged += 1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        if data and not data.endswith(b"\n"):
            self._file.write("\n")  # end the torn line, so the next record starts on its own line

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __getitem__(self, key: str) -> dict[str, Any]:
        return self.entries[key]

    def add(self, record: dict[str, Any]) -> None:
        self.entries[record["key"]] = record
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


__all__ = ["JudgmentCache"]
