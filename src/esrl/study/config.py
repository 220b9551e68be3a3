"""The study file: a base fit config, the algorithms, the seeds, an optional grid, and the report's analyses.

    name: conciseness_cpu
    base_config: configs/demo/es_conciseness_lowrank.yaml   # any `esrl fit` YAML
    out: runs/study_conciseness_cpu
    seeds: [0, 1, 2]
    algorithms:                       # label -> algo (es or grpo) and that algorithm's config overrides
      es_lowrank: {algo: es}
      grpo: {algo: grpo, overrides: {model.grpo.learning_rate: 2.0e-5}}
    overrides: {trainer.max_steps: 10}  # every run
    grid: {model.rollout.max_new_tokens: [32, 48]}   # optional: every combination is a grid point
    analysis: {num_prompts: 8}

Everything is checked here, before any run starts: an unknown algorithm or task, or a grid/override key that is
no config field, is one ConfigError naming it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from esrl.checkpoints import check_root_dir
from esrl.config_files import read_yaml
from esrl.errors import ConfigError, require
from esrl.sweep import name_clash

ALGOS = ("es", "grpo")


@dataclass
class AlgorithmSpec:
    """One compared optimizer: its label in the report, the fit `algo`, and its own config overrides."""

    label: str
    """Name in run folders, tables and plots (letters, digits, `._-`)."""
    algo: str = "es"
    """`es` or `grpo` (the fit's `--algo`)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted config key -> value for this algorithm's runs only (e.g. model.grpo.learning_rate: 2.0e-5)."""


@dataclass
class AnalysisSettings:
    """What the report measures in weight space (through `esrl analyze`) once every run has its final/."""

    analyses: list[str] = field(default_factory=lambda: ["similarity", "connectivity", "robustness"])
    """Any of similarity, connectivity, robustness ([] for none)."""
    num_prompts: int = 8
    """Eval prompts (the task's eval split, first N) of connectivity and robustness."""
    max_new_tokens: int | None = None
    """Tokens per greedy completion in the analyses (None: the runs' model.rollout.max_new_tokens)."""
    alphas: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """Connectivity: interpolation grid (must include 0 and 1)."""
    connectivity_seeds: int = 1
    """Connectivity: the first N seeds; for each, base -> every algorithm and algorithm <-> algorithm (the runs of
    that seed that finished)."""
    sigmas: list[float] = field(default_factory=lambda: [0.0, 0.002, 0.008])
    """Robustness: perturbation sigmas (absolute noise std per weight)."""
    robustness_draws: int = 1
    """Robustness: random perturbations per sigma."""
    robustness_seeds: int = 1
    """Robustness: the final models of the first N seeds of each algorithm are perturbed."""
    device: str = "auto"
    """cpu, cuda, ... (auto: cuda when available)."""


@dataclass
class StudyConfig:
    """One study: every (algorithm, grid point, seed) is one `esrl fit` of the base config."""

    base_config: str
    """The `esrl fit` YAML every run starts from (relative to the working folder, else to the study file)."""
    algorithms: list[AlgorithmSpec]
    """The compared optimizers (a list of es/grpo, or a mapping label -> {algo, overrides})."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Values of seed_everything; the report's intervals are over these."""
    name: str = "study"
    """Title of the report."""
    out: str = "runs/study"
    """Study folder: runs/<run>/ (one fit root each), analysis/, report.md and its PNGs."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted config key -> value for every run (e.g. trainer.max_steps: 10)."""
    grid: dict[str, list[Any]] = field(default_factory=dict)
    """Dotted config key -> values; every combination is a grid point (empty: one point)."""
    checkpoint_every_n_steps: int = 0
    """Save a checkpoint every N steps (the last one kept) so an interrupted run resumes from it (0: none)."""
    keep_checkpoints: bool = False
    """Keep a finished run's checkpoints (default: deleted once its final/ exists; they only serve a resume)."""
    analysis: AnalysisSettings = field(default_factory=AnalysisSettings)
    """The weight-space analyses of the report."""
    base: dict[str, Any] = field(default_factory=dict, repr=False)
    """The base config's contents (filled by load_study)."""

    def __post_init__(self) -> None:
        require(bool(self.algorithms), "algorithms", "give at least one (es, grpo)")
        labels = [a.label for a in self.algorithms]
        require(len(set(labels)) == len(labels), "algorithms", f"labels must differ, got {labels}")
        for a in self.algorithms:
            require(a.algo in ALGOS, f"algorithms.{a.label}.algo",
                    f"unknown algorithm {a.algo!r}; choose {' or '.join(ALGOS)}")
            require(bool(a.label) and all(c.isalnum() or c in "._-" for c in a.label), f"algorithms.{a.label}",
                    "a label uses letters, digits and ._- only")
        integers = all(isinstance(s, int) and not isinstance(s, bool) for s in self.seeds)  # True is an int
        require(bool(self.seeds) and integers, "seeds", f"a non-empty list of integers, got {self.seeds!r}")
        require(len(set(self.seeds)) == len(self.seeds), "seeds", f"seeds must differ, got {self.seeds}")
        require(self.checkpoint_every_n_steps >= 0, "checkpoint_every_n_steps", "must be >= 0")
        for key, values in self.grid.items():
            require(isinstance(values, list) and bool(values), f"grid.{key}", f"a non-empty list, got {values!r}")
        clash = name_clash(self.grid)  # two points in one run folder: seeds counted twice, a point never run
        if clash:
            raise ConfigError(f"grid.{clash}")
        s = self.analysis
        unknown = [a for a in s.analyses if a not in ("similarity", "connectivity", "robustness")]
        require(not unknown, "analysis.analyses", f"unknown analysis {unknown[:1]}; "
                "choose from similarity, connectivity, robustness")
        require(s.num_prompts >= 1, "analysis.num_prompts", "must be >= 1")
        number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
        require(all(number(a) and 0.0 <= a <= 1.0 for a in s.alphas) and 0.0 in s.alphas and 1.0 in s.alphas,
                "analysis.alphas", f"must lie in [0, 1] and include both, got {s.alphas}")
        require(bool(s.sigmas) and all(number(x) and 0.0 <= x < math.inf for x in s.sigmas), "analysis.sigmas",
                f"must be finite non-negative numbers, got {s.sigmas}")
        require(s.max_new_tokens is None or s.max_new_tokens >= 1, "analysis.max_new_tokens", "must be >= 1")
        require(s.connectivity_seeds >= 1 and s.robustness_seeds >= 1 and s.robustness_draws >= 1,
                "analysis", "connectivity_seeds, robustness_seeds and robustness_draws must be >= 1")


# -- config keys --------------------------------------------------------------------------------------------
def _sections() -> dict[str, Any]:
    from lightning.pytorch import Trainer

    from esrl.data import PromptDataModule
    from esrl.module_factory import build_module

    return {"model": build_module, "data": PromptDataModule.__init__, "trainer": Trainer.__init__}


def _fields_of(target: Any) -> dict[str, Any] | None:
    """Field name -> annotation of a dataclass, or of a callable's parameters; None when it has none."""
    target = _dataclass_in(target)
    if target is not None and dataclasses.is_dataclass(target):
        hints = typing.get_type_hints(target)
        return {f.name: hints.get(f.name) for f in dataclasses.fields(target)}
    return None


def _dataclass_in(annotation: Any) -> Any:
    """The dataclass in `X`, `X | None`, `Optional[X]` (else the annotation itself)."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        if dataclasses.is_dataclass(arg):
            return arg
    return annotation


SET_BY_STUDY = {"algo": "algorithms", "ckpt_path": "resume", "seed_everything": "seeds",
                "trainer.default_root_dir": "out: its runs/ folders"}
"""Fit keys the study sets for each run; given as a key (a grid of seed_everything once gave points in their own
folders that ran one config), they are refused."""


def check_study_key(key: str, where: str) -> None:
    """check_key, and not a key the study sets itself."""
    if key in SET_BY_STUDY:
        raise ConfigError(f"{where}: {key!r} is set by the study ({SET_BY_STUDY[key]}), not by a key")
    check_key(key, where)


def check_key(key: str, where: str) -> None:
    """A dotted fit-config key (seed_everything, model.es.sigma, data.task_args.path, trainer.max_steps, ...)
    must name a config field; anything below a field that is not a dataclass (a dict, a callback) is free."""
    parts = key.split(".")
    if parts[0] in ("optimizer", "lr_scheduler") or key in ("seed_everything", "algo", "ckpt_path"):
        return
    sections = _sections()
    if parts[0] not in sections or len(parts) < 2:
        raise ConfigError(f"{where}: {key!r} is not a config field (keys start with model., data., trainer. "
                          "or are seed_everything)")
    target = sections[parts[0]]
    fields = {n: p.annotation for n, p in inspect.signature(target).parameters.items() if n != "self"}
    hints = typing.get_type_hints(target) if callable(target) else {}
    for depth, part in enumerate(parts[1:], start=1):
        if fields is None:
            return  # below a free-form field
        if part not in fields:
            known = ", ".join(sorted(fields)) if len(fields) <= 25 else "see `esrl fit --help`"
            raise ConfigError(f"{where}: {key!r} is not a config field ({'.'.join(parts[:depth]) or key} has no "
                              f"{part!r}; it has: {known})")
        annotation = hints.get(part, fields[part]) if depth == 1 else fields[part]
        fields, hints = _fields_of(annotation), {}


def set_key(config: dict[str, Any], key: str, value: Any) -> None:
    """config['a']['b']['c'] = value for key 'a.b.c', creating the sections on the way."""
    parts = key.split(".")
    node = config
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = copy.deepcopy(value)


def get_key(config: dict[str, Any], key: str, default: Any = None) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


# -- loading ------------------------------------------------------------------------------------------------
def _algorithms(raw: Any) -> list[AlgorithmSpec]:
    if isinstance(raw, list):
        out = []
        for k, item in enumerate(raw):
            if isinstance(item, str):
                out.append(AlgorithmSpec(label=item, algo=item))
            elif isinstance(item, dict):
                require("label" in item, f"algorithms[{k}]", "a mapping in the list needs its label")
                out.append(_build(AlgorithmSpec, {"algo": item["label"], **item}, f"algorithms.{item['label']}."))
            else:
                raise ConfigError(f"algorithms: expected names or mappings, got {item!r}")
        return out
    if isinstance(raw, dict):
        return [_build(AlgorithmSpec, {"label": str(k), **({"algo": str(k)} if v is None else {"algo": str(k), **v}
                                                            if isinstance(v, dict) else {"algo": v})},
                       f"algorithms.{k}.") for k, v in raw.items()]
    raise ConfigError(f"algorithms: expected a list or a mapping, got {raw!r}")


_KINDS = {dict: "a mapping", list: "a list", str: "a string", int: "an integer", float: "a number",
          bool: "true or false"}


def _check_types(cls, raw: dict[str, Any], where: str) -> None:
    """Each given field against its annotation's outer type (a mapping, a list, a string, a number), so a wrong
    shape is one line naming the field, not an AttributeError where the study first reads it."""
    for name, hint in typing.get_type_hints(cls).items():
        if name not in raw or dataclasses.is_dataclass(raw[name]):
            continue
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        value, kinds = raw[name], [typing.get_origin(t) or t for t in options]
        if value is None and type(None) in kinds:
            continue
        ok = [k for k in kinds if k in _KINDS and (isinstance(value, k) and not (k is int and isinstance(value, bool))
                                                    or k is float and isinstance(value, int) and not isinstance(value, bool))]
        known = [k for k in kinds if k in _KINDS]
        if known and not ok:
            raise ConfigError(f"{where}{name}: expected {' or '.join(_KINDS[k] for k in known)}, got {value!r}")


def _build(cls, raw: dict[str, Any], where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{where}{unknown[0]}: unknown study field; fields: {', '.join(sorted(names - {'base'}))}")
    _check_types(cls, raw, where)
    try:
        return cls(**raw)
    except TypeError as e:
        raise ConfigError(f"{where.rstrip('.') or 'study'}: {e}") from None


def load_study(path: str | Path, out: str | None = None, writes: bool = True) -> StudyConfig:
    """Read and check a study file (and its base config) before anything runs. `writes`: the command writes under
    its out folder (not --count or --dry-run), which must then be writable."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"study file {str(path)!r}: no such file")
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of study fields")
    raw = dict(raw)
    if "base_config" not in raw and {"model", "data", "trainer"} & raw.keys():
        raise ConfigError(f"{path}: an `esrl fit` config, not a study file; a study names one as base_config "
                          "(configs/study/ has examples)")
    for needed in ("base_config", "algorithms"):
        if needed not in raw:
            raise ConfigError(f"{needed}: missing in {path}")
    raw["algorithms"] = _algorithms(raw["algorithms"])
    if "analysis" in raw:
        raw["analysis"] = _build(AnalysisSettings, raw["analysis"] or {}, "analysis.")
    if out is not None:
        raw["out"] = out
    raw["base"] = {}
    study = _build(StudyConfig, raw, "")
    check_root_dir(study.out, "--out" if out is not None else "out", writes)  # now, not at a mkdir
    base_path = Path(study.base_config)
    if not base_path.is_file() and (path.parent / base_path).is_file():
        base_path = path.parent / base_path
    if not base_path.is_file():
        raise ConfigError(f"base_config {study.base_config!r}: no such file")
    study.base_config = str(base_path)
    base = read_yaml(base_path) or {}
    if not isinstance(base, dict):
        raise ConfigError(f"base_config {study.base_config}: expected a mapping")
    study.base = base
    for key in study.overrides:
        check_study_key(key, f"overrides.{key}")
    for key in study.grid:
        check_study_key(key, f"grid.{key}")
    for a in study.algorithms:
        for key in a.overrides:
            check_study_key(key, f"algorithms.{a.label}.overrides.{key}")
    for key in ("model.es.seed", "model.grpo.seed"):  # fixed, every study seed would draw the same noise or samples
        given = [where for where, value in [("base_config", get_key(base, key, None)),
                                            ("overrides", study.overrides.get(key)),
                                            *((f"algorithms.{a.label}.overrides", a.overrides.get(key))
                                              for a in study.algorithms)] if value is not None]
        if given or key in study.grid:
            raise ConfigError(f"{(given or ['grid'])[0]}: {key} is fixed, so every seed of the study would draw the "
                              "same noise or samples; leave it null (it then follows each run's seed)")
    from esrl.tasks import known_task

    tasks = {get_key(base, "data.task", "conciseness"), study.overrides.get("data.task")}
    tasks |= set(study.grid.get("data.task", []))
    tasks |= {a.overrides.get("data.task") for a in study.algorithms}
    for task in sorted(t for t in tasks if t is not None):
        if not known_task(str(task)):
            raise ConfigError(f"data.task: unknown task {task!r} in the study")
    return study
