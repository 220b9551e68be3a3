"""How GRPO's step metrics combine over processes (Lightning's sync_dist reduce_fx), as TRL logs them."""

from __future__ import annotations

COUNTS = {"train/bad_rewards"}
"""Step metrics that count samples: summed over processes, so the logged number is the step's, as ES logs it."""


def rank_reduction(key: str) -> str:
    """How a step metric combines over processes: "sum" for COUNTS, "min" for a ..._min or .../min key, "max"
    likewise, else "mean"."""
    if key in COUNTS:
        return "sum"
    for reduce_fx in ("min", "max"):
        if key.endswith((f"_{reduce_fx}", f"/{reduce_fx}")):
            return reduce_fx
    return "mean"
