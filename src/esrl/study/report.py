"""OUT/report.md (+ PNGs and summary.json) from the runs' own files and the `esrl analyze` results."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from statistics import fmean
from typing import Any

from esrl.analysis.common import write_json
from esrl.atomic_files import write_text
from esrl.study import plots
from esrl.study.analyses import cosine_classes, run_point, unembedding_share
from esrl.study.config import StudyConfig
from esrl.study.results import RunResult, collect, groups, interval, summarize
from esrl.study.runner import Run, resolved_config


def _fmt(cell: dict[str, Any] | None, seeds: int | None = None) -> str:
    """mean ± 95% half-width, and how many seeds it is over where some seeds lack the number."""
    if cell is None:
        return "–"
    text = f"{cell['mean']:.4g}" + (f" ± {cell['ci95']:.2g}" if cell.get("ci95") is not None else "")
    return text + (f" (n={cell['n']})" if seeds is not None and cell["n"] < seeds else "")


def _num(x: Any) -> str:
    return "–" if x is None else f"{x:.3g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows), ""]


def write_report(study: StudyConfig, runs: list[Run], wall_s: float | None = None) -> Path:
    out = Path(study.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [collect(r) for r in runs]
    by_group = groups(results)
    summary = summarize(results)
    lines = [f"# Study: {study.name}", "",
             f"Base config `{study.base_config}`; seeds {study.seeds}; "
             f"{sum(r.done for r in results)} of {len(results)} runs finished."
             + (f" Wall time of this command: {wall_s:.0f} s." if wall_s is not None else ""), ""]
    lines += ["Algorithms: " + "; ".join(f"**{a.label}** (`--algo {a.algo}`"
                                         + "".join(f", {k}={v}" for k, v in a.overrides.items()) + ")"
                                         for a in study.algorithms) + "."]
    if study.overrides:
        lines += ["Every run: " + ", ".join(f"{k}={v}" for k, v in study.overrides.items()
                                            if k != "trainer.callbacks") + "."]
    if study.grid:
        lines += ["Grid: " + ", ".join(f"{k} in {v}" for k, v in study.grid.items()) + "."]
    missing = [r.run.name for r in results if not r.done]
    if missing:
        lines += ["", f"**Not finished** (left out of every number below): {', '.join(missing)}."]
    lines += ["", "## Final evaluation", "",
              "Mean ± 95% interval (Student t) over seeds of the last evaluation (eval.jsonl): greedy reward, KL to "
              "the base (k3, on sampled completions), sampled reward and pass@k where the evaluation measured them; "
              "hacked = runs whose final evaluation trips `esrl sweep`'s hacking thresholds.", ""]
    names = [m for m in summary["metrics"] if not m.startswith("hacking/")]
    hacking = [m for m in summary["metrics"] if m.startswith("hacking/")]
    rows = [[g["algorithm"], g["point"], str(len(g["seeds"])), _fmt(g["reward@step0"], len(g["seeds"])),
             *(_fmt(g.get(m), len(g["seeds"])) for m in names), str(len(g["hacked_runs"]))]
            for g in summary["groups"]]
    lines += _table(["algorithm", "grid point", "seeds", "reward (step 0)", *names, "hacked"], rows)
    if hacking:
        lines += ["Hacking indicators of the final greedy completions (share of completions):", ""]
        lines += _table(["algorithm", "grid point", *(h.split("/", 1)[1] for h in hacking)],
                        [[g["algorithm"], g["point"], *(_fmt(g.get(h), len(g["seeds"])) for h in hacking)]
                         for g in summary["groups"]])
    plots.reward_curves(by_group, out / "curves.png")
    lines += ["## Reward curves", "", "![reward curves](curves.png)", ""]
    summary["analyses"] = {}
    for point in dict.fromkeys(r.run.point_name for r in results):
        members = {a.label: [r for r in by_group.get((a.label, point), [])] for a in study.algorithms}
        if not any(members.values()):
            continue
        config = resolved_config(study, next(r.run for r in results if r.run.point_name == point))
        found = run_point(study, point, members, config)
        summary["analyses"][point] = _analyses_section(lines, study, point, found, members, out)
    write_json(out / "summary.json", summary)
    path = out / "report.md"
    return write_text(path, "\n".join(lines) + "\n")


def _copy_png(json_path: Path, out: Path, name: str) -> str:
    src = json_path.with_suffix(".png")
    if src.is_file():
        shutil.copyfile(src, out / name)
    return name


def _analyses_section(lines: list[str], study: StudyConfig, point: str, found: dict[str, Any],
                      members: dict[str, list[RunResult]], out: Path) -> dict[str, Any]:
    title = "" if point == "all" else f" ({point})"
    numbers: dict[str, Any] = {}
    for _tag, path in found.get("similarity", []):
        data = json.loads(path.read_text())
        classes = cosine_classes(data)
        numbers["cosine"] = {k: {"pairs": v["pairs"], "whole_model": v["whole_model"], "per_unit": v["per_unit"]}
                             for k, v in classes.items()}
        lines += [f"## Weight changes{title}", "",
                  "Cosine of the weight changes (theta - theta_base) per layer unit (`esrl analyze similarity`), "
                  "pairs of runs grouped across algorithms and within one algorithm across seeds.", ""]
        rows = []
        for name, entry in classes.items():
            per_unit = entry["per_unit"]
            top = max(per_unit, key=lambda u: abs(per_unit[u])) if per_unit else None
            whole = [w for w in entry["whole_model"] if w is not None]  # pairs share runs: no t-interval over them
            rows.append([name, str(len(entry["pairs"])),
                         f"{fmean(whole):.4g} ({min(whole):.3g} to {max(whole):.3g})" if whole else "–",
                         _num(sum(abs(c) for c in per_unit.values()) / len(per_unit) if per_unit else None),
                         f"{_num(per_unit[top])} ({top})" if top else "–"])
        lines += _table(["pairs of", "pairs", "whole-model cosine: mean (range)", "mean abs cosine over units",
                         "largest abs cosine (unit)"], rows)
        png = plots.cosine_layers(classes, data["units"], f"Per-layer cosine of weight changes{title}",
                                  out / f"cosine_{point}.png")
        lines += [f"![per-layer cosine]({png.name}) ![esrl analyze similarity]"
                  f"({_copy_png(path, out, f'similarity_{point}.png')})", ""]
        shares = unembedding_share(data)
        unit = next(iter(shares.values()))["unit"] if shares else None
        by_alg = {a: [shares[f"{a}/s{r.run.seed}"]["share"] for r in runs
                      if shares.get(f"{a}/s{r.run.seed}", {}).get("share") is not None]
                  for a, runs in members.items()}
        numbers["unembedding_share"] = {"unit": unit, "by_algorithm": by_alg}
        lines += [f"Share of each run's squared weight change in the unembedding (unit `{unit}`"
                  + (", the input embedding tied to the output layer" if unit and "tied" in unit else "") + "):", ""]
        lines += _table(["algorithm", "share (mean ± 95%)", "per seed"],
                        [[a, str(interval(v) or "–"), ", ".join(f"{x:.3g}" for x in v)] for a, v in by_alg.items()])
        plots.unembedding_shares(by_alg, str(unit), out / f"unembedding_{point}.png")
        lines += [f"![unembedding share](unembedding_{point}.png)", ""]
    if found.get("connectivity"):
        lines += [f"## Linear mode connectivity{title}", "",
                  "Greedy reward along (1 - a) A + a B (`esrl analyze connectivity`); barrier = largest dip below the "
                  "straight line between the endpoints (reward), or rise above it (NLL of the endpoints' completions).",
                  ""]
        rows, numbers["connectivity"] = [], []
        # the header from the JSONs' own alphas (sorted, deduplicated by the analysis), not the study's list
        loaded = [(tag, path, json.loads(path.read_text())) for tag, path in found["connectivity"]]
        alphas = sorted({float(a) for _, _, data in loaded
                         for a in data.get("alphas") or [pt["alpha"] for p in data["pairs"] for pt in p["points"]]})
        for tag, path, data in loaded:
            for p in data["pairs"]:
                rewards = {pt["alpha"]: pt["reward"] for pt in p["points"]}
                numbers["connectivity"].append({"seed": tag, **{k: p[k] for k in ("a", "b", "kind", "reward_barrier",
                                                                                    "nll_barrier")}})
                rows.append([tag, f"{p['a']} -> {p['b']}", _num(p["reward_barrier"]), _num(p["nll_barrier"]),
                             " / ".join(_num(rewards.get(a)) for a in alphas)])
            lines += [f"![connectivity {tag}]({_copy_png(path, out, f'connectivity_{point}_{tag}.png')})"]
        lines += [""] + _table(["seed", "path", "reward barrier", "NLL barrier",
                                "reward at a = " + ", ".join(map(str, alphas))], rows)
    for _tag, path in found.get("robustness", []):
        data = json.loads(path.read_text())
        lines += [f"## Perturbation robustness{title}", "",
                  "Greedy reward of theta + sigma * N(0, 1) on the whole model and per layer group "
                  f"(`esrl analyze robustness`, {data['seeds']} draw(s) per sigma).", ""]
        sigmas = data["sigmas"]
        rows = []
        numbers["robustness"] = {}
        for model, res in data["models"].items():
            for group, c in res["groups"].items():
                rows.append([model, group, *(_num(p["reward_mean"]) for p in c["points"])])
                numbers["robustness"].setdefault(model, {})[group] = [p["reward_mean"] for p in c["points"]]
        lines += _table(["model", "perturbed", *(f"sigma {s:g}" for s in sigmas)], rows)
        lines += [f"![robustness]({_copy_png(path, out, f'robustness_{point}.png')})", ""]
    return numbers
