"""Per-layer cosine similarity of weight changes between runs, and per-layer update magnitudes.

delta_r = theta_r - theta_base per tensor. Per layer unit (`embeddings`, `L0.attention`, `L0.mlp`,
`L0.norm`, ..., `norm`, `unembedding`; with tied embeddings the shared matrix is one unit, reported as such)
the cosine between two runs' deltas is <d_r, d_s> / (|d_r| |d_s|) over the unit's concatenated tensors, and
the update magnitude of a run is |d_r| / |theta_base| (relative) and |d_r| (absolute). Sums are in float64.

Near-zero cosines at every unit mean orthogonal updates (e.g. ES against GRPO); a unit where runs of one
optimizer agree most shows where that optimizer concentrates its change.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import torch

from esrl.analysis.common import (AnalysisError, Context, check_same_architecture, finite, group_label,
                                  group_names, layer_unit, pyplot, save_figure, tied_embeddings, unit_order)

NAME = "similarity"


def check(base, models) -> None:
    """The inputs, before any model loads (esrl.analysis.cli checks every selected analysis first)."""
    if base is None or not models:
        raise AnalysisError("similarity needs --base and at least one run (--models)")


@torch.no_grad()
def run(ctx: Context) -> dict[str, Any]:
    check(ctx.base, ctx.models)
    base = ctx.model(ctx.base)
    groups = group_names(base)
    tied = tied_embeddings(base)
    unit_of = {n: layer_unit(n, group_label(g, tied)) for n, g in groups.items()}
    units = unit_order(unit_of.values())
    runs = [(ref, ctx.model(ref)) for ref in ctx.models]
    for ref, m in runs:
        check_same_architecture(base, m, ctx.base.label, ref.label)
    labels = [ref.label for ref, _ in runs]
    base_sq = dict.fromkeys(units, 0.0)
    sq = {lab: dict.fromkeys(units, 0.0) for lab in labels}
    dots = {(a, b): dict.fromkeys(units, 0.0) for a, b in itertools.combinations(labels, 2)}
    tensors = {}
    params = {lab: dict(m.named_parameters()) for (ref, m), lab in zip(runs, labels)}
    names = [n for n, _ in base.named_parameters()]
    with ctx.task("similarity", len(names)) as advance:
        for name, p0 in base.named_parameters():
            u = unit_of[name]
            p0d = p0.double()
            base_sq[u] += float((p0d * p0d).sum())
            deltas = {lab: params[lab][name].double() - p0d for lab in labels}
            norms = {lab: float((d * d).sum()) for lab, d in deltas.items()}
            for lab in labels:
                sq[lab][u] += norms[lab]
            entry = {"unit": u, "relative_norm": {lab: finite(math.sqrt(norms[lab] / max(float((p0d * p0d).sum()),
                                                                                          1e-300)))
                                                  for lab in labels}, "cosine": {}}
            for a, b in itertools.combinations(labels, 2):
                dot = float((deltas[a] * deltas[b]).sum())
                dots[(a, b)][u] += dot
                entry["cosine"][f"{a}|{b}"] = _cos(dot, norms[a], norms[b])
            tensors[name] = entry
            advance()
    magnitudes = {lab: {u: {"relative": finite(math.sqrt(sq[lab][u] / base_sq[u]) if base_sq[u] > 0 else math.nan),
                            "absolute": finite(math.sqrt(sq[lab][u]))} for u in units} for lab in labels}
    totals = {lab: {"relative": finite(math.sqrt(sum(sq[lab].values()) / sum(base_sq.values()))),
                    "absolute": finite(math.sqrt(sum(sq[lab].values())))} for lab in labels}
    cosines = {}
    for (a, b), per_unit in dots.items():
        cosines[f"{a}|{b}"] = {
            "a": a, "b": b,
            "per_unit": {u: _cos(per_unit[u], sq[a][u], sq[b][u]) for u in units},
            "whole_model": _cos(sum(per_unit.values()), sum(sq[a].values()), sum(sq[b].values())),
        }
    # A run against itself (the matrix diagonal): 1 wherever it moved, a check on the arithmetic.
    self_cos = {lab: {u: _cos(sq[lab][u], sq[lab][u], sq[lab][u]) for u in units} for lab in labels}
    return {"analysis": NAME, "base": ctx.base.label, "runs": labels, "units": units, "tied_embeddings": tied,
            "cosine": cosines, "self_cosine": self_cos, "update_magnitude": magnitudes,
            "update_magnitude_total": totals, "tensors": tensors}


def _cos(dot: float, sq_a: float, sq_b: float) -> float | None:
    if sq_a <= 0 or sq_b <= 0:
        return None  # a unit that did not move has no direction
    return finite(max(-1.0, min(1.0, dot / math.sqrt(sq_a * sq_b))))


def plot(data: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    units = data["units"]
    fig, (ax_c, ax_m) = plt.subplots(2, 1, figsize=(max(8, 0.45 * len(units) + 3), 7), sharex=True)
    xs = list(range(len(units)))
    for key, pair in data["cosine"].items():
        ys = [pair["per_unit"][u] if pair["per_unit"][u] is not None else float("nan") for u in units]
        ax_c.plot(xs, ys, marker="o", label=f"{pair['a']} vs {pair['b']}")
    if not data["cosine"]:
        ax_c.text(0.5, 0.5, "one run: no pair to compare", ha="center", va="center", transform=ax_c.transAxes)
    ax_c.axhline(0.0, color="grey", lw=0.8)
    ax_c.set_ylim(-1.05, 1.05)
    ax_c.set_ylabel("cosine of (theta - theta_base)")
    ax_c.set_title(f"Per-layer cosine similarity of weight changes (base: {data['base']})")
    for lab in data["runs"]:
        ys = [data["update_magnitude"][lab][u]["relative"] for u in units]
        ax_m.plot(xs, [y if y is not None else float("nan") for y in ys], marker="s", label=lab)
    ax_m.set_yscale("log")
    ax_m.set_ylabel("|theta - theta_base| / |theta_base|")
    ax_m.set_title("Per-layer update magnitude")
    ax_m.set_xticks(xs)
    ax_m.set_xticklabels(units, rotation=60, ha="right", fontsize=7)
    for ax in (ax_c, ax_m):
        if ax.lines:
            ax.legend(fontsize=7)
    return save_figure(fig, path)


def headline(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"update_magnitude_total": data["update_magnitude_total"]}
    for key, pair in data["cosine"].items():
        vals = {u: c for u, c in pair["per_unit"].items() if c is not None}
        out[key] = {"whole_model": pair["whole_model"],
                    "max_abs_unit_cosine": max((abs(c) for c in vals.values()), default=None),
                    "most_similar_unit": max(vals, key=vals.get) if vals else None}
    return out
