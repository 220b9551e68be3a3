"""The converted-model cache: a folder is used only if it is provably complete, else it is rebuilt.

A conversion writes into a private temporary folder, records every file's size in `esrl-cache.json` last,
and renames the folder into place, all under a file lock (several processes of one run share the cache).
A folder without that record, with a file missing or of another size, or with a safetensors file whose
header does not parse or does not account for the file's length (a truncated or overwritten file) is
moved aside and rebuilt, never loaded. Content is not hashed: a same-size bit flip inside the weights
would pass, at no cost to every load. A folder recorded as built from another source (the embedded model's GGUF
file of another size, after an upgrade of its package) is rebuilt too; one converted before esrl recorded sources
serves as it is (a shared read-only cache would otherwise stop serving).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from esrl.checkpoints import check_root_dir
from esrl.errors import ConfigError

RECORD = "esrl-cache.json"


def cache_dir() -> Path:
    """$ESRL_CACHE with ~ expanded as a shell would not inside quotes (unset or empty: ~/.cache/esrl, never the
    working folder)."""
    return Path(os.environ.get("ESRL_CACHE") or Path.home() / ".cache" / "esrl").expanduser()


def cache_dir_problem() -> str | None:
    """Why ESRL_CACHE cannot hold converted models (it is a file, or below one), or None: `esrl fit` and
    `esrl env` name it in one line, not makedirs' traceback at the first conversion."""
    try:
        check_root_dir(cache_dir(), "ESRL_CACHE")
    except ConfigError as e:
        return f"{e}; point ESRL_CACHE at a writable folder"
    return None


def _safetensors_whole(path: Path) -> bool:
    """Header parses and its last tensor ends exactly at the end of the file."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        return path.stat().st_size == 8 + n + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False


def problem(folder: Path, source: dict | None = None) -> str | None:
    """Why `folder` cannot be used as a cached model, or None when it is complete (and, when `source` is given,
    built from it: None skips that check, for a source that cannot be found here)."""
    try:
        record = json.loads((folder / RECORD).read_text())
        files = dict(record["files"])
    except FileNotFoundError:
        return f"no {RECORD} (an interrupted or older conversion)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {RECORD} ({type(e).__name__})"
    if source is not None and record.get("source", source) != source:
        return f"built from {record['source']}, not {source}"
    if "config.json" not in files:
        return f"{RECORD} lists no config.json"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
        if name.endswith(".safetensors") and not _safetensors_whole(path):
            return f"{name} is not a whole safetensors file"
    return None


def _record(folder: Path, source: dict | None) -> None:
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    (folder / RECORD).write_text(json.dumps({"files": files, **({"source": source} if source else {})}, indent=1))


def ensure(out: Path, build: Callable[[Path], None], source: dict | None = None) -> Path:
    """`out` when it is a complete cache built from `source`; else build it with `build(tmp_folder)` and move it
    into place."""
    if problem(out, source) is None:
        return out
    check_root_dir(out.parent, "ESRL_CACHE")  # the cache folder (out's parent) is a file, or below one
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f"{out.name}.lock")):
        why = problem(out, source)  # another process may have built it while this one waited
        if why is None:
            return out
        for stale in out.parent.glob(f"{out.name}.tmp*"):  # left by a killed conversion: the lock is ours
            shutil.rmtree(stale, ignore_errors=True)
        if out.exists():
            print(f"esrl: model cache {out} is unusable ({why}); rebuilding it", file=sys.stderr)
            broken = out.with_name(f"{out.name}.tmp-broken{os.getpid()}")
            out.rename(broken)
            shutil.rmtree(broken, ignore_errors=True) if broken.is_dir() else broken.unlink()
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        try:
            build(tmp)
            _record(tmp, source)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
