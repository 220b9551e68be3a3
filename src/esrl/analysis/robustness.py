"""Perturbation robustness: reward of a checkpoint under random Gaussian perturbations of growing sigma.

For each model, each sigma of the grid and each seed, theta + sigma * eps (eps standard normal, the same
direction for every sigma of one seed, so the curves are smooth) is rolled out greedily on the eval prompts.
Perturbed sets: the whole model, then each layer group (embeddings, attention, MLP, unembedding; with tied
embeddings the shared matrix is one group, reported as such). Weights are restored exactly after each
perturbation (esrl.es.Perturber keeps a backup copy), and a bit-level checksum checks it at the end.

A flat curve means a wide basin: the reward survives noise of that size.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from esrl.analysis.common import (GROUPS, AnalysisError, Context, finite, group_label, group_names, mean_std,
                                  pyplot, save_figure, selection, tied_embeddings)
from esrl.es import Member, Perturber, member_seed, weights_checksum

NAME = "robustness"


def perturbed_sets(model) -> tuple[dict[str, set[str] | None], bool]:
    """Label -> parameter names to perturb (None: all), and whether embeddings are tied."""
    groups = group_names(model)
    tied = tied_embeddings(model)
    sets: dict[str, set[str] | None] = {"all": None}
    for g in GROUPS:
        names = {n for n, gg in groups.items() if gg == g}
        if names:
            sets[group_label(g, tied)] = names
    return sets, tied


def check(sigmas: Sequence[float], seeds: int) -> None:
    """The inputs, before any model loads (esrl.analysis.cli checks every selected analysis first)."""
    if not sigmas or not all(0 <= s < math.inf for s in sigmas):
        raise AnalysisError(f"--sigmas must be finite non-negative numbers, got {list(sigmas)}")
    if seeds < 1:
        raise AnalysisError(f"--seeds must be >= 1, got {seeds}")


def run(ctx: Context, sigmas: Sequence[float], seeds: int) -> dict[str, Any]:
    check(sigmas, seeds)
    sigmas = sorted(set(float(s) for s in sigmas))
    targets = ctx.models or [ctx.base]
    results: dict[str, Any] = {}
    for ref in targets:
        model = ctx.model(ref)
        sets, tied = perturbed_sets(model)
        before = weights_checksum([p for _, p in model.named_parameters()])
        nonzero = [s for s in sigmas if s > 0]
        with ctx.task(f"robustness {ref.label}", 1 + len(sets) * len(nonzero) * seeds) as advance:
            unperturbed = ctx.evaluator.reward(model)
            advance()
            curves: dict[str, Any] = {}
            for label, names in sets.items():
                perturber = Perturber(selection(model, names))
                rows = []
                for sigma in sigmas:
                    if sigma == 0:
                        rewards = [unperturbed]
                    else:
                        rewards = []
                        for s in range(seeds):
                            member = Member(s, member_seed(ctx.seed, 0, s), 1.0)
                            with perturber.perturbed(member, sigma):
                                rewards.append(ctx.evaluator.reward(model))
                            advance()
                    m, sd = mean_std(rewards)
                    rows.append({"sigma": sigma, "reward_mean": finite(m), "reward_std": finite(sd),
                                 "rewards": [finite(r) for r in rewards]})
                perturber.free()
                curves[label] = {"numel": selection(model, names).numel(), "points": rows}
        restored = bool(weights_checksum([p for _, p in model.named_parameters()]) == before)
        if not restored:  # never expected: Perturber restores from a backup copy
            raise RuntimeError(f"robustness: weights of {ref.label} were not restored exactly")
        results[ref.label] = {"path": ref.path, "unperturbed_reward": finite(unperturbed),
                              "tied_embeddings": tied, "restored_exactly": restored, "groups": curves}
    return {"analysis": NAME, "sigmas": sigmas, "seeds": seeds, "noise": "theta + sigma * N(0, 1) per tensor",
            "models": results}


def plot(data: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    models = data["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.8), squeeze=False)
    for ax, (label, res) in zip(axes[0], models.items()):
        for group, curve in res["groups"].items():
            pts = [p for p in curve["points"] if p["reward_mean"] is not None]
            xs = [p["sigma"] for p in pts]
            ys = [p["reward_mean"] for p in pts]
            sd = [p["reward_std"] or 0.0 for p in pts]
            line, = ax.plot(xs, ys, marker="o", label=group, lw=2 if group == "all" else 1)
            ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)],
                            color=line.get_color(), alpha=0.15)
        ax.set_xscale("symlog", linthresh=min([s for s in data["sigmas"] if s > 0] or [1e-3]))
        ax.set_xlabel("sigma")
        ax.set_ylabel("greedy reward")
        ax.set_title(f"{label}" + (" (tied embeddings)" if res["tied_embeddings"] else ""))
        ax.legend(fontsize=7)
    fig.suptitle("Perturbation robustness")
    return save_figure(fig, path)


def headline(data: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for label, res in data["models"].items():
        last = res["groups"]["all"]["points"][-1]
        out[label] = {"unperturbed_reward": res["unperturbed_reward"], "sigma_max": last["sigma"],
                      "reward_at_sigma_max": last["reward_mean"]}
    return out
