"""What the runs wrote, gathered per run and summarized per (algorithm, grid point) over seeds.

Per run: its evaluations (eval.jsonl of every lightning_logs/version_N, a resumed run's versions merged: the newest
version whole, an older one only below the steps the newer ones logged), its training reward per step (metrics.csv,
`train/reward_mean`, merged alike) and its final/.
Per group: mean and 95% interval (Student t over seeds) of every number of the final evaluation: reward, KL to
the base (k3, `kl`), sampled reward, pass@k, and the hacking indicators (`hacking/*`).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean, stdev
from typing import Any

from esrl.callbacks.evaluation import evaluation_records
from esrl.fit_runs import final_dir, version_folders
from esrl.study.runner import Run
from esrl.sweep import hacked

# Two-sided 95% Student t quantiles by degrees of freedom (1..30).
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(df: int) -> float:
    """The two-sided 95% Student t quantile: the table up to 30 degrees of freedom, beyond it the Cornish-Fisher
    expansion around the normal quantile (within 1e-4 of the exact value from 31 on: 2.0395 at 31, 2.0003 at 60;
    it once jumped to 1.96, intervals 4% too narrow at 32 seeds). No scipy: esrl does not depend on it."""
    if df < 1:
        raise ValueError(f"t95 needs at least 1 degree of freedom, got {df}")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.959963984540054
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


@dataclass
class Interval:
    """Mean over seeds and the half-width of its 95% interval (None with one seed)."""

    mean: float
    half: float | None
    n: int
    values: list[float] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.mean:.4g}" + (f" ± {self.half:.2g}" if self.half is not None else "")


def interval(values: list[float]) -> Interval | None:
    values = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not values:
        return None
    n = len(values)
    half = t95(n - 1) * stdev(values) / math.sqrt(n) if n > 1 else None
    return Interval(fmean(values), half, n, values)


@dataclass
class RunResult:
    run: Run
    evals: list[dict[str, Any]]
    """Evaluations by step (step 0 first)."""
    train: dict[int, float]
    """Step -> train/reward_mean."""
    final: Path | None

    @property
    def done(self) -> bool:
        return self.final is not None and bool(self.evals)

    @property
    def last(self) -> dict[str, Any]:
        return self.evals[-1] if self.evals else {}


def _eval_records(version: Path) -> dict[int, dict[str, Any]]:
    path = version / "eval.jsonl"
    records = evaluation_records(path) if path.is_file() else []
    return {int(r["step"]): r for r in records}


def _train_rewards(version: Path) -> dict[int, float]:
    path, out = version / "metrics.csv", {}
    if path.is_file():
        with path.open() as f:
            for row in csv.DictReader(f):
                value = row.get("train/reward_mean")
                if value not in (None, "") and row.get("step") not in (None, ""):
                    out[int(float(row["step"]))] = float(value)
    return out


def _merge(per_version: list[dict[int, Any]]) -> dict[int, Any]:
    """Newest version first; an older one adds only steps below the smallest step taken so far. A resume into a
    new version keeps its past; a restart from scratch (a failed first attempt without a checkpoint) drops the
    failed attempt's later steps, which would otherwise read as the finished run's final evaluation."""
    merged: dict[int, Any] = {}
    for steps in per_version:
        floor = min(merged, default=math.inf)
        merged.update({s: v for s, v in steps.items() if s < floor})
    return merged


def collect(run: Run) -> RunResult:
    versions = version_folders(run.root)[::-1]
    evals = _merge([_eval_records(v) for v in versions])
    train = _merge([_train_rewards(v) for v in versions])
    return RunResult(run, [evals[s] for s in sorted(evals)], dict(sorted(train.items())), final_dir(run.root))


def group_key(run: Run) -> tuple[str, str]:
    return run.algorithm.label, run.point_name


def groups(results: list[RunResult]) -> dict[tuple[str, str], list[RunResult]]:
    """(algorithm label, grid point name) -> that group's finished runs (seed order)."""
    out: dict[tuple[str, str], list[RunResult]] = {}
    for r in results:
        out.setdefault(group_key(r.run), [])
        if r.done:
            out[group_key(r.run)].append(r)
    return out


def metric_names(results: list[RunResult]) -> list[str]:
    """Numbers of the final evaluations: reward first, then kl, sampled reward, pass@k, task metrics, hacking."""
    names = list(dict.fromkeys(k for r in results if r.done for k, v in r.last.items()
                               if k != "step" and isinstance(v, (int, float))))

    def rank(k: str) -> tuple[int, str]:
        order = ["reward", "kl", "sampled/reward"]
        if k in order:
            return order.index(k), k
        return (4 if k.startswith("pass@") else 6 if k.startswith("hacking/") else 5), k

    return sorted(names, key=rank)


def summarize(results: list[RunResult]) -> dict[str, Any]:
    """The numbers of report.md, also written as summary.json."""
    names = metric_names(results)
    rows = []
    for (label, point), members in groups(results).items():
        row: dict[str, Any] = {"algorithm": label, "point": point, "seeds": [r.run.seed for r in members],
                               "runs": [r.run.name for r in members]}
        start = interval([r.evals[0].get("reward") for r in members if r.evals and r.evals[0].get("step") == 0])
        row["reward@step0"] = _json(start)
        for name in names:
            row[name] = _json(interval([final_value(r.last, name) for r in members]))
        row["hacked_runs"] = [r.run.name for r in members if hacked(r.last)]
        rows.append(row)
    return {"metrics": names, "groups": rows}


def final_value(record: dict[str, Any], name: str) -> Any:
    """record[name]; a missing bad_rewards (sampled/bad_rewards) is 0 where its reward was measured: the evaluation
    writes the count only when above 0, and a mean over the seeds that have it (0, 0, 6 -> 6) overstates it."""
    if name not in record and name.endswith("bad_rewards") and name[:-len("bad_rewards")] + "reward" in record:
        return 0.0
    return record.get(name)


def _json(iv: Interval | None) -> dict[str, Any] | None:
    return None if iv is None else {"mean": iv.mean, "ci95": iv.half, "n": iv.n, "values": iv.values}


def curve(members: list[RunResult], which: str) -> tuple[list[int], list[float], list[float]]:
    """Steps every member has, the mean reward there and its 95% half-width (0 with one seed)."""
    series = [{int(e["step"]): e.get("reward") for e in r.evals} if which == "eval" else r.train for r in members]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    means, halves = [], []
    for step in steps:
        iv = interval([s[step] for s in series])
        means.append(iv.mean if iv else math.nan)
        halves.append((iv.half or 0.0) if iv else 0.0)
    return steps, means, halves
