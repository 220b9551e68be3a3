"""The study's weight-space analyses, per grid point, by calling `esrl analyze` (esrl.analysis.cli.main).

- similarity: every finished run of the point against the base (one call, all pairs); the report splits the
  pairs into across algorithms and within an algorithm across seeds, and takes each run's share of its weight
  change in the unembedding layer from the per-unit update magnitudes;
- connectivity: for each of the first `connectivity_seeds` seeds, base -> each algorithm's run and run <-> run;
- robustness: the runs of the first `robustness_seeds` seeds of each algorithm.

Each call writes OUT/analysis/<point>/<analysis>[_seed=S]/ (JSON, PNG, summary.json) and is skipped when that
folder already holds the same models' results under the same settings, so a rerun of the report costs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from esrl.study.config import StudyConfig, get_key
from esrl.study.results import RunResult


def _common_args(study: StudyConfig, config: dict[str, Any]) -> list[str]:
    s = study.analysis
    tokens = s.max_new_tokens or get_key(config, "model.rollout.max_new_tokens", 128)
    args = ["--base", str(get_key(config, "model.policy.name_or_path", "smollm2-135m-instruct")),
            "--task", str(get_key(config, "data.task", "conciseness")),
            "--task-args", json.dumps(get_key(config, "data.task_args", None) or {}),
            "--max-new-tokens", str(tokens), "--num-prompts", str(s.num_prompts),
            "--dtype", str(get_key(config, "model.policy.dtype", "float32")), "--device", s.device,
            "--alphas", ",".join(map(str, s.alphas)), "--sigmas", ",".join(map(str, s.sigmas)),
            "--seeds", str(s.robustness_draws), "--no-progress"]
    return args


def label(r: RunResult) -> str:
    """A model's label in the analyses: `<algorithm>/s<seed>`."""
    return f"{r.run.algorithm.label}/s{r.run.seed}"


# Not compared: the analysis and output are the folder itself, the models are compared by label and path, prompts is
# num_prompts as found, and the device ("auto" is recorded resolved) does not change what is measured.
_NOT_SETTINGS = ("analyses", "models", "out", "device", "no_progress", "prompts")


def _settings(recorded: dict[str, Any]) -> dict[str, Any]:
    """`esrl analyze`'s settings as compared: alphas and sigmas as numbers (0 and 0.0 ask for the same grid)."""
    out = {k: v for k, v in recorded.items() if k not in _NOT_SETTINGS}
    for key in ("alphas", "sigmas"):
        if isinstance(out.get(key), str):
            out[key] = [float(x) for x in out[key].split(",") if x.strip()]
    return out


def _up_to_date(out: Path, models: list[RunResult], argv: list[str]) -> bool:
    """The folder holds these models' results under these settings (alphas, sigmas, prompts, tokens, draws, task,
    dtype, ...): a changed setting reruns the analysis rather than report old numbers under the new settings."""
    from esrl.analysis.cli import parser

    summary = out / "summary.json"
    if not summary.is_file():
        return False
    try:  # a malformed record (a summary cut short, edited by hand): analyze again
        done = json.loads(summary.read_text())
        if [(m.get("label"), m.get("path")) for m in done.get("models", [])] != [(label(r), str(r.final))
                                                                                  for r in models]:
            return False
        return _settings(done.get("settings") or {}) == _settings(vars(parser().parse_args(argv)))
    except (ValueError, AttributeError, TypeError):
        return False


def _analyze(name: str, study: StudyConfig, config: dict[str, Any], models: list[RunResult], out: Path) -> Path:
    from esrl.analysis.cli import main as analyze

    argv = [name, *_common_args(study, config), "--models", *(f"{label(r)}={r.final}" for r in models),
            "--out", str(out)]
    if not _up_to_date(out, models, argv):
        print(f"esrl study: analyze {name} -> {out}", flush=True)
        analyze(argv)
    return out / f"{name}.json"


def run_point(study: StudyConfig, point: str, members: dict[str, list[RunResult]],
              config: dict[str, Any]) -> dict[str, Any]:
    """The analyses of one grid point; members: algorithm label -> finished runs (seed order).
    Returns analysis name -> list of (tag, JSON path)."""
    out = Path(study.out) / "analysis" / point
    every = [r for runs in members.values() for r in runs]
    found: dict[str, list[tuple[str, Path]]] = {}
    wanted = study.analysis.analyses
    if "similarity" in wanted and every:
        found["similarity"] = [("all", _analyze("similarity", study, config, every, out / "similarity"))]
    if "connectivity" in wanted:
        for seed in study.seeds[:study.analysis.connectivity_seeds]:  # by seed: a failed run shifts no pairing
            models = [r for runs in members.values() for r in runs if r.run.seed == seed]
            if models:
                tag = f"seed={seed}"
                found.setdefault("connectivity", []).append(
                    (tag, _analyze("connectivity", study, config, models, out / f"connectivity_{tag}")))
    if "robustness" in wanted:
        seeds = set(study.seeds[:study.analysis.robustness_seeds])
        models = [r for runs in members.values() for r in runs if r.run.seed in seeds]
        if models:
            found["robustness"] = [("all", _analyze("robustness", study, config, models, out / "robustness"))]
    return found


def unembedding_share(similarity: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per model: the unit holding the unembedding (`unembedding`, or the tied embedding matrix) and its share of
    the squared weight change, |d_unit|^2 / |d|^2."""
    units = similarity["units"]
    unit = next((u for u in units if u == "unembedding"), None) or next(
        (u for u in units if u.startswith("embeddings=unembedding")), None)
    out = {}
    for model, per_unit in similarity["update_magnitude"].items():
        total = sum((v["absolute"] or 0.0) ** 2 for v in per_unit.values())
        part = (per_unit[unit]["absolute"] or 0.0) ** 2 if unit else 0.0
        out[model] = {"unit": unit, "share": part / total if total > 0 else None}
    return out


def cosine_classes(similarity: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pairs of runs grouped as `A vs B` (across algorithms) or `A vs A` (one algorithm, across seeds): per unit
    the mean cosine over the class's pairs, and the whole-model cosines."""
    classes: dict[str, dict[str, Any]] = {}
    for pair in similarity["cosine"].values():
        alg_a, alg_b = pair["a"].split("/")[0], pair["b"].split("/")[0]
        name = " vs ".join(sorted((alg_a, alg_b))) if alg_a != alg_b else f"{alg_a} vs {alg_a}"
        entry = classes.setdefault(name, {"pairs": [], "per_unit": {}, "whole_model": []})
        entry["pairs"].append(f"{pair['a']}|{pair['b']}")
        entry["whole_model"].append(pair["whole_model"])
        for unit, c in pair["per_unit"].items():
            if c is not None:
                entry["per_unit"].setdefault(unit, []).append(c)
    for entry in classes.values():
        entry["per_unit"] = {u: sum(v) / len(v) for u, v in entry["per_unit"].items()}
    return classes
