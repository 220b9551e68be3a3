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
        lo, dash, hi = part.strip().partition("-")
        if dash and not hi.strip():  # '10-' is no open range: refused, not read as layer 10
            raise ValueError(f"layer range {part.strip()!r} has no last layer")
        first, last = int(lo), int(hi or lo)
        if not 0 <= first <= last:
            raise ValueError(f"layer range {part.strip()!r} is empty or negative")
        out.update(range(first, last + 1))
    return out


def check_layers_exist(layers: set[int] | None, model, field: str, spec: str | None) -> None:
    """Layer ranges reaching past the model's layers are refused in one line, not dropped silently."""
    from esrl.errors import ConfigError

    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if layers and count is not None and max(layers) >= count:
        raise ConfigError(f"{field}: {spec!r} reaches past the model's {count} layers (0-{count - 1})")
