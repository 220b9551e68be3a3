"""Linear mode connectivity: reward along theta(a) = (1 - a) * theta_A + a * theta_B.

Paths: base -> each run, and run -> run for every pair of runs. At each a of the grid the interpolated weights
(torch.lerp, exact at a = 0 and a = 1) are rolled out greedily on the eval prompts. Besides the reward, the
mean per-token NLL of the two endpoints' own greedy completions is measured along the path: a smooth loss.

Barrier (reward): max over a of [(1 - a) R(0) + a R(1) - R(a)], how far the reward dips below the straight
line between the endpoints; (loss): max over a of [L(a) - ((1 - a) L(0) + a L(1))]. A barrier well above
the noise of R separates the two solutions into different basins.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Sequence

import torch

from esrl.analysis.common import (AnalysisError, Context, ModelRef, check_same_architecture, finite, load_model,
                                  pyplot, save_figure)

NAME = "connectivity"


def barrier(alphas: Sequence[float], values: Sequence[float], higher_is_better: bool) -> float:
    """Largest gap between the straight line joining the endpoints and the curve (>= 0 at the endpoints)."""
    a0, a1 = alphas[0], alphas[-1]
    v0, v1 = values[0], values[-1]
    gaps = []
    for a, v in zip(alphas, values):
        t = (a - a0) / (a1 - a0) if a1 != a0 else 0.0
        line = (1 - t) * v0 + t * v1
        gaps.append(line - v if higher_is_better else v - line)
    return max(gaps)


def paths(base: ModelRef | None, models: Sequence[ModelRef]) -> list[tuple[ModelRef, ModelRef]]:
    out = [(base, m) for m in models] if base is not None else []
    out += list(itertools.combinations(models, 2))
    return out


def check(alphas: Sequence[float], base: ModelRef | None, models: Sequence[ModelRef]) -> None:
    """The inputs, before any model loads (esrl.analysis.cli checks every selected analysis first)."""
    given = [float(a) for a in alphas]
    if any(not 0.0 <= a <= 1.0 for a in given):  # NaN included (a set of floats with NaN once sorted past the check)
        raise AnalysisError(f"--alphas must lie in [0, 1], got {given}")
    alphas = sorted(set(given))
    if len(alphas) < 2 or alphas[0] != 0.0 or alphas[-1] != 1.0:
        raise AnalysisError(f"--alphas must include 0 and 1 (the endpoints), got {alphas}")
    if not paths(base, models):
        raise AnalysisError("connectivity needs --base and one run, or two runs (--models)")


@torch.no_grad()
def run(ctx: Context, alphas: Sequence[float]) -> dict[str, Any]:
    check(alphas, ctx.base, ctx.models)
    alphas = sorted(set(float(a) for a in alphas))
    pairs = paths(ctx.base, ctx.models)
    work = None
    results = []
    with ctx.task("connectivity", len(pairs) * (len(alphas) + 2)) as advance:
        for ref_a, ref_b in pairs:
            model_a, model_b = ctx.model(ref_a), ctx.model(ref_b)
            check_same_architecture(model_a, model_b, ref_a.label, ref_b.label)
            if work is None:
                work = load_model(ref_a, ctx.dtype, ctx.device)
            ends = [ctx.evaluator.generate(model_a), ctx.evaluator.generate(model_b)]
            advance(2)
            pa = dict(model_a.named_parameters())
            pb = dict(model_b.named_parameters())
            points = []
            for a in alphas:
                for name, p in work.named_parameters():
                    p.copy_(torch.lerp(pa[name], pb[name], a))
                reward = ctx.evaluator.reward(work)
                nll = 0.5 * (ctx.evaluator.nll(work, ends[0]) + ctx.evaluator.nll(work, ends[1]))
                points.append({"alpha": a, "reward": finite(reward), "nll": finite(nll)})
                advance()
            rewards = [p["reward"] for p in points]
            nlls = [p["nll"] for p in points]
            kind = "base->run" if ref_a is ctx.base else "run->run"
            results.append({
                "a": ref_a.label, "b": ref_b.label, "kind": kind, "points": points,
                "reward_barrier": finite(barrier(alphas, rewards, True)) if None not in rewards else None,
                "nll_barrier": finite(barrier(alphas, nlls, False)) if None not in nlls else None,
            })
    return {"analysis": NAME, "alphas": alphas, "path": "(1 - a) * theta_A + a * theta_B",
            "barrier": "max_a of the gap between the straight line joining the endpoints and the curve",
            "pairs": results}


def plot(data: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, (ax_r, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    for pair in data["pairs"]:
        xs = [p["alpha"] for p in pair["points"]]
        style = "--" if pair["kind"] == "base->run" else "-"
        label = f"{pair['a']} -> {pair['b']}"
        ax_r.plot(xs, [p["reward"] for p in pair["points"]], style, marker="o",
                  label=f"{label} (barrier {pair['reward_barrier']:.3g})" if pair["reward_barrier"] is not None
                  else label)
        ax_l.plot(xs, [p["nll"] for p in pair["points"]], style, marker="o", label=label)
    ax_r.set_xlabel("a")
    ax_r.set_ylabel("greedy reward")
    ax_r.set_title("Reward along (1 - a) A + a B")
    ax_l.set_xlabel("a")
    ax_l.set_ylabel("NLL of endpoint completions (per token)")
    ax_l.set_title("Loss along the path")
    ax_r.legend(fontsize=7)
    ax_l.legend(fontsize=7)
    return save_figure(fig, path)


def headline(data: dict[str, Any]) -> dict[str, Any]:
    return {f"{p['a']}->{p['b']}": {"reward_barrier": p["reward_barrier"], "nll_barrier": p["nll_barrier"]}
            for p in data["pairs"]}
