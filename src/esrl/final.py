"""A run's final/ folder: there whole or not at all.

Sweeps and studies count a run as done when its final/ holds a model (esrl.fit_runs.final_dir), and transformers
writes config.json before the weights: a save killed part way (a full disk, a job's time limit) left a final/ that
counted as done, so a rerun skipped the run instead of resuming it from its checkpoint, and the study's report then
failed to load it. The model is written beside final/ and renamed into place once complete (one rename on the same
file system)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable


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
