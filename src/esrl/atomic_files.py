"""Files and folders written whole or not at all: beside their place, then renamed into it (one rename on the same
file system), so a reader never sees one cut short by a kill or a full disk.

A run's final/: sweeps and studies count a run as done when its final/ holds a model (esrl.fit_runs.final_dir), and
transformers writes config.json before the weights: a save killed part way left a final/ that counted as done, so a
rerun skipped the run instead of resuming it from its checkpoint, and the study's report then failed to load it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable


def write_with(path: str | Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` writes the file, which then becomes the whole of `path` (a temporary file per process beside it,
    so processes writing the same file at once, as a sweep's array tasks summarize, each replace it whole). The
    temporary name does not end as `path` does: a writer that infers a format from the suffix needs it given."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    """`text` as the whole of `path` (write_with)."""
    return write_with(path, lambda tmp: tmp.write_text(text))


def partial_dir(out: Path) -> Path:
    """Where final/ is written before it is complete."""
    return out.with_name(out.name + ".partial")


def write_final(save: Callable[[Path], object], out: str | Path) -> Path:
    """`save(folder)` writes the model into a fresh folder beside `out`, which then becomes `out`; a save that fails
    leaves no `out` (an older one, from a run resumed after it finished, is replaced only by a complete one)."""
    out = Path(out)
    partial = partial_dir(out)
    shutil.rmtree(partial, ignore_errors=True)  # a save killed before
    save(partial)
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return out
