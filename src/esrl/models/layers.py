"""Transformer layer ranges ('0-5,20'): which layers a parameter filter or a LoRA adapter covers."""

from __future__ import annotations

import re

LAYER = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")
"""The layer index in a parameter or module name (Llama/Qwen `.layers.N.`, GPT-2 `.h.N.`, ...)."""


def parse_layer_ranges(spec: str | None) -> set[int] | None:
    """'0-3,10' -> {0, 1, 2, 3, 10}; None or '' -> no restriction. A malformed spec raises ValueError."""
    if not spec:
        return None
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        first, last = int(lo), int(hi or lo)
        if not 0 <= first <= last:
            raise ValueError(f"layer range {part.strip()!r} is empty or negative")
        out.update(range(first, last + 1))
    return out
