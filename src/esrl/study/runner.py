"""Every (algorithm, grid point, seed) of a study as its own `esrl fit`, locally one after another or one per
SLURM array task, each in OUT/runs/<run>/ as `esrl sweep` runs one (fit.log, returncode).

Each run gets its resolved fit config (OUT/runs/<run>/config.yaml: the base config, the study's overrides, the
algorithm's, the grid point's, its seed and algo). Resumable: a run with a final/ is skipped; an interrupted one
resumes from its newest checkpoint (`--ckpt_path`: the study's periodic ones, or the interrupted.ckpt a signal
saved), else starts again. A signal to the study reaches its running fits (esrl.fit_runs).
"""

from __future__ import annotations

import copy
import itertools
import json
import shlex
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from esrl.fit_runs import Fits, final_dir, last_checkpoint
from esrl.study.config import AlgorithmSpec, StudyConfig, set_key
from esrl.sweep import fit_command, run_name


@dataclass
class Run:
    """One fit of the study."""

    algorithm: AlgorithmSpec
    point: dict[str, Any]
    """The grid point's values (empty without a grid)."""
    seed: int
    root: Path
    """The fit's default_root_dir (OUT/runs/<name>)."""

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def point_name(self) -> str:
        return point_name(self.point)


def point_name(point: dict[str, Any]) -> str:
    """`max_new_tokens=32_sigma=0.01` (`esrl sweep`'s run names), or `all` without a grid."""
    return run_name({k: str(v) for k, v in point.items()}) if point else "all"


def grid_points(study: StudyConfig) -> list[dict[str, Any]]:
    keys = list(study.grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(study.grid[k] for k in keys))]


def plan(study: StudyConfig) -> list[Run]:
    """All runs: algorithm-major, then grid point, then seed (the SLURM array index is a position here)."""
    runs = []
    for algorithm in study.algorithms:
        for point in grid_points(study):
            for seed in study.seeds:
                parts = [algorithm.label] + ([point_name(point)] if point else []) + [f"seed={seed}"]
                runs.append(Run(algorithm, point, seed, Path(study.out) / "runs" / "_".join(parts)))
    return runs


def resolved_config(study: StudyConfig, run: Run) -> dict[str, Any]:
    """The fit config of one run: base, then study overrides, algorithm overrides, grid point, seed, algo."""
    config = copy.deepcopy(study.base)
    for overrides in (study.overrides, run.algorithm.overrides, run.point):
        for key, value in overrides.items():
            set_key(config, key, value)
    config["seed_everything"] = run.seed
    config["algo"] = run.algorithm.algo
    set_key(config, "trainer.default_root_dir", str(run.root.resolve()))
    if study.checkpoint_every_n_steps:
        set_key(config, "trainer.enable_checkpointing", True)
        callbacks = list(config["trainer"].get("callbacks") or [])
        callbacks.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                          "init_args": {"dirpath": str((run.root / "checkpoints").resolve()),
                                        "filename": "{step}", "every_n_train_steps": study.checkpoint_every_n_steps,
                                        "save_top_k": 1}})
        config["trainer"]["callbacks"] = callbacks
    return config


def fit_line(study: StudyConfig, run: Run) -> str:
    """The run as one `esrl fit` command over the base config (what --dry-run prints): the study's, the algorithm's
    and the grid point's keys as flags. The run itself writes them into its config.yaml and fits that."""
    flags = {**study.overrides, **run.algorithm.overrides, **run.point, "seed_everything": run.seed,
             "algo": run.algorithm.algo, "trainer.default_root_dir": str(run.root)}
    words = ["esrl", "fit", "--config", study.base_config]
    for key, value in flags.items():
        words += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    if study.checkpoint_every_n_steps:
        words.append(f"# + a ModelCheckpoint every {study.checkpoint_every_n_steps} steps in its checkpoints/")
    return " ".join(shlex.quote(w) if not w.startswith("# +") else w for w in words)


def status(run: Run) -> str:
    """done (final/ exists), interrupted (a checkpoint, no final/), failed/started (a fit.log only), or new."""
    if final_dir(run.root) is not None:
        return "done"
    if last_checkpoint(run.root) is not None:
        return "interrupted"
    if (run.root / "fit.log").is_file():
        return "failed" if (run.root / "returncode").is_file() else "started"
    return "new"


def changed_setting(study: StudyConfig, run: Run) -> str | None:
    """A finished run's first setting that its config.yaml holds otherwise than the study now gives ("key: old
    there, new now"), else None. A rerun after an edit of the study file once skipped such runs as done and
    reported them under the new settings."""
    path = run.root / "config.yaml"
    if status(run) != "done" or not path.is_file():
        return None
    try:
        old = _leaves(_without_place(yaml.safe_load(path.read_text())))
    except (yaml.YAMLError, TypeError, KeyError):
        return None
    new = _leaves(_without_place(yaml.safe_load(yaml.safe_dump(resolved_config(study, run), sort_keys=False))))
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            return f"{key}: {old.get(key)!r} there, {new.get(key)!r} now"
    return None


def _without_place(config: Any) -> Any:
    """A fit config without what says where and how often it saves (its folder, checkpointing), which a moved
    study folder or a new checkpoint_every_n_steps changes and the results do not."""
    if not isinstance(config, dict):
        raise TypeError("not a mapping")
    config = copy.deepcopy(config)
    trainer = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    trainer.pop("default_root_dir", None)
    trainer.pop("enable_checkpointing", None)
    if isinstance(trainer.get("callbacks"), list):
        trainer["callbacks"] = [c for c in trainer["callbacks"] if not (
            isinstance(c, dict) and str(c.get("class_path", "")).endswith("ModelCheckpoint"))] or None
    return config


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists and scalars are leaves, a None or an empty mapping none (as if absent)."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        elif value is not None:
            out[f"{prefix}{key}"] = value
    return out


def run_one(study: StudyConfig, run: Run, position: str = "", fits: Fits | None = None) -> int:
    """Fit one run unless it is done; resume it from its last checkpoint when it has one. Returns the exit status
    (-1: not started, the study was stopped)."""
    fits = fits or Fits()
    state = status(run)
    if state == "done":
        print(f"esrl study: {position}{run.name}: done (final/ exists), skipped", flush=True)
        return 0
    if fits.signal:
        return -1
    run.root.mkdir(parents=True, exist_ok=True)
    config_path = run.root / "config.yaml"
    config_path.write_text(yaml.safe_dump(resolved_config(study, run), sort_keys=False))
    ckpt = last_checkpoint(run.root)
    extra = ["--ckpt_path", str(ckpt)] if ckpt is not None else []
    print(f"esrl study: {position}{run.name}: " + (f"resuming from {ckpt.name}" if ckpt else "running"), flush=True)
    start = time.perf_counter()
    rc = fits.run(fit_command(str(config_path), {}, run.root, extra), run.root, append=state != "new")
    took = time.perf_counter() - start
    if rc is None:
        return -1
    if rc != 0 and fits.signal:
        ckpt = last_checkpoint(run.root)
        print(f"esrl study: {position}{run.name}: interrupted by {fits.signal} (exit {rc}, {took:.0f} s); "
              + (f"a rerun resumes it from {ckpt.name}" if ckpt else "no checkpoint yet, a rerun starts it again"),
              flush=True)
        return rc
    if rc == 0 and final_dir(run.root) is not None and not study.keep_checkpoints:
        shutil.rmtree(run.root / "checkpoints", ignore_errors=True)
    print(f"esrl study: {position}{run.name}: " + (f"ok ({took:.0f} s)" if rc == 0 else
                                                   f"failed (exit {rc}, {took:.0f} s); see {run.root / 'fit.log'}"),
          flush=True)
    return rc


def run_all(study: StudyConfig, runs: list[Run], jobs: int = 1, fits: Fits | None = None) -> list[Run]:
    """Fit the given runs, `jobs` at a time (as `esrl sweep --jobs`; default one after another); returns those
    that failed or were stopped (`fits`: where a signal handler reaches them, esrl.study.cli)."""
    fits = fits or Fits()
    with fits.under_way(), ThreadPoolExecutor(max(1, jobs)) as pool:
        codes = list(pool.map(lambda ir: run_one(study, ir[1], f"[{ir[0] + 1}/{len(runs)}] ", fits), enumerate(runs)))
    return [run for run, rc in zip(runs, codes) if rc != 0]
