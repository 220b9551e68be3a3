"""What a tournament leaves: ratings.png (ratings with 95% intervals per criterion) and a rich table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from esrl.atomic_files import write_with


def plot(ratings: dict[str, dict[str, dict[str, float]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    groups = list(ratings)
    models = list(next(iter(ratings.values())))
    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(groups) * max(1, len(models) / 3), 4))
    for i, model in enumerate(models):
        x = [g + (i - (len(models) - 1) / 2) * width for g in range(len(groups))]
        y = [ratings[g][model]["rating"] for g in groups]
        err = [[r - ratings[g][model]["ci_low"] for g, r in zip(groups, y)],
               [ratings[g][model]["ci_high"] - r for g, r in zip(groups, y)]]
        ax.errorbar(x, y, yerr=err, fmt="o", capsize=4, label=model)
    ax.axhline(1000, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("Elo (mean 1000), 95% bootstrap interval")
    ax.set_title("Judge Elo tournament")
    ax.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    write_with(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
    return path


def print_table(summary: dict[str, Any]) -> None:
    """Models by overall rating, one column per criterion: rating [low, high]; then the overall record."""
    import sys

    from rich.console import Console
    from rich.table import Table

    ratings = summary["ratings"]
    overall = ratings["overall"]
    table = Table(title=f"Elo, judge {summary['judge']['model']}: {summary['prompts']} prompts, "
                        f"95% intervals from {summary['bootstrap']} resamples of the prompts")
    table.add_column("model")
    for group in ratings:
        table.add_column(group, justify="right")
    table.add_column("W / T / L (overall)", justify="right")
    for model in sorted(overall, key=lambda m: -overall[m]["rating"]):
        cells = [f"{r['rating']:.0f} [{r['ci_low']:.0f}, {r['ci_high']:.0f}]"
                 for r in (ratings[g][model] for g in ratings)]
        table.add_row(model, *cells, f"{overall[model]['wins']} / {overall[model]['ties']} / "
                                      f"{overall[model]['losses']}")
    Console(width=None if sys.stdout.isatty() else 160).print(table)  # no wrapping in logs and pipes


__all__ = ["plot", "print_table"]
