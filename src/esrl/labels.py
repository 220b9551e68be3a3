"""`LABEL=PATH` on the command line (esrl elo's --completions, esrl analyze's --models), where a path may hold `=`:
esrl study names its run folders es_seed=0 and esrl sweep sigma=0.01."""

from __future__ import annotations

from pathlib import Path


def split_label(spec: str) -> tuple[str, str]:
    """(label, path), label "" when none is given: a spec that is an existing path is that path (runs/es_seed=0);
    else the text before the first `=` is the label (es=runs/es_seed=0, or esrl study's es/s0=PATH)."""
    label, sep, path = spec.partition("=")
    if not sep or Path(spec).expanduser().exists():
        return "", spec
    return label, path
