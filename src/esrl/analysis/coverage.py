"""Coverage: pass@k of weight-perturbation sampling against temperature sampling of one model.

Two ways to draw n candidate answers per prompt from one checkpoint:
- weight perturbation: n perturbed copies theta + sigma * eps_i (esrl.es seeds), each answering greedily
  (what an ES population explores);
- temperature sampling: n samples at a temperature from the unperturbed weights (what GRPO explores).
For k = 1..n: pass@k with the unbiased estimator (correct: the task's accuracy/exact metric, else reward > 0)
and best-of-k reward, the expected maximum reward of k candidates drawn from the n (also unbiased).
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import fmean
from typing import Any, Sequence

from esrl.analysis.common import AnalysisError, Context, finite, pyplot, save_figure, selection
from esrl.es import Member, Perturber, member_seed, weights_checksum
from esrl.metrics import pass_at_k

NAME = "coverage"


def best_of_k(rewards: Sequence[float], k: int) -> float:
    """E[max of k drawn without replacement from rewards]: sum_i r_(i) C(i-1, k-1) / C(n, k), r sorted up."""
    r = sorted(rewards)
    n = len(r)
    return sum(r[i] * math.comb(i, k - 1) for i in range(k - 1, n)) / math.comb(n, k)


def _curves(rewards: list[list[float]], correct: list[list[bool]], n: int) -> list[dict[str, Any]]:
    out = []
    for k in range(1, n + 1):
        out.append({"k": k,
                    "pass_at_k": finite(fmean(pass_at_k(n, sum(c), k) for c in correct)),
                    "best_of_k_reward": finite(fmean(best_of_k(r, k) for r in rewards))})
    return out


def check(n: int, sigma: float, temperature: float) -> None:
    """The inputs, before any model loads (esrl.analysis.cli checks every selected analysis first)."""
    if n < 1:
        raise AnalysisError(f"--coverage-k must be >= 1, got {n}")
    if not (sigma > 0 and temperature > 0 and math.isfinite(sigma) and math.isfinite(temperature)):
        raise AnalysisError(f"--coverage-sigma and --temperature must be finite and > 0, got {sigma} and "
                            f"{temperature}")


def run(ctx: Context, n: int, sigma: float, temperature: float) -> dict[str, Any]:
    check(n, sigma, temperature)
    targets = ctx.models or [ctx.base]
    ev = ctx.evaluator
    results = {}
    for ref in targets:
        model = ctx.model(ref)
        before = weights_checksum([p for _, p in model.named_parameters()])
        perturber = Perturber(selection(model))
        per_member = []  # [member] -> score dict over prompts
        with ctx.task(f"coverage {ref.label}", n + 1) as advance:
            for i in range(n):
                member = Member(i, member_seed(ctx.seed, 1, i), 1.0)
                with perturber.perturbed(member, sigma):
                    per_member.append(ev.score(ev.generate(model)))
                advance()
            perturber.free()
            sampled = ev.score(ev.generate(model, greedy=False, n=n, temperature=temperature, seed=ctx.seed), n=n)
            advance()
        if weights_checksum([p for _, p in model.named_parameters()]) != before:
            raise RuntimeError(f"coverage: weights of {ref.label} were not restored exactly")
        rows = len(ev.rows)
        # perturbation: prompt j's candidates are member i's answer to prompt j
        p_rewards = [[per_member[i]["reward"][j] for i in range(n)] for j in range(rows)]
        p_flat = {k: [per_member[i][k][j] for j in range(rows) for i in range(n)] for k in per_member[0]}
        p_correct_flat, criterion = ev.correct(p_flat)
        p_correct = [p_correct_flat[j * n:(j + 1) * n] for j in range(rows)]
        s_rewards = [sampled["reward"][j * n:(j + 1) * n] for j in range(rows)]
        s_correct_flat, _ = ev.correct(sampled)
        s_correct = [s_correct_flat[j * n:(j + 1) * n] for j in range(rows)]
        results[ref.label] = {
            "path": ref.path, "correct": criterion,
            "perturbation": {"sigma": sigma, "curve": _curves(p_rewards, p_correct, n),
                             "mean_reward": finite(fmean(sum(p_rewards, [])))},
            "temperature": {"temperature": temperature, "curve": _curves(s_rewards, s_correct, n),
                            "mean_reward": finite(fmean(sum(s_rewards, [])))},
        }
    return {"analysis": NAME, "n": n, "prompts": len(ev.rows), "models": results}


def plot(data: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    models = data["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for col, (label, res) in enumerate(models.items()):
        for key, name in (("perturbation", f"weight perturbation (sigma {res['perturbation']['sigma']:g})"),
                          ("temperature", f"temperature {res['temperature']['temperature']:g}")):
            curve = res[key]["curve"]
            ks = [p["k"] for p in curve]
            axes[0][col].plot(ks, [p["pass_at_k"] for p in curve], marker="o", label=name)
            axes[1][col].plot(ks, [p["best_of_k_reward"] for p in curve], marker="o", label=name)
        axes[0][col].set_title(f"{label}: pass@k ({res['correct']})")
        axes[0][col].set_ylim(-0.02, 1.02)
        axes[1][col].set_title(f"{label}: best-of-k reward")
        for ax in axes[:, col]:
            ax.set_xlabel("k")
            ax.set_xscale("log", base=2)
            ax.legend(fontsize=7)
    fig.suptitle("Coverage: perturbation sampling vs temperature sampling")
    return save_figure(fig, path)


def headline(data: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for label, res in data["models"].items():
        out[label] = {f"{key}_pass@{data['n']}": res[key]["curve"][-1]["pass_at_k"]
                      for key in ("perturbation", "temperature")}
        out[label].update({f"{key}_best_of_{data['n']}_reward": res[key]["curve"][-1]["best_of_k_reward"]
                           for key in ("perturbation", "temperature")})
    return out
