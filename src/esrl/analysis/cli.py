"""`esrl analyze`: weight-space analyses of trained checkpoints, each writing JSON and a PNG plot.

    esrl analyze all --base smollm2-135m-instruct --models es=runs/es/.../final grpo=runs/grpo/.../final \\
        --task conciseness --max-new-tokens 64 --num-prompts 8 --out runs/analysis

Analyses: robustness, connectivity (alias lmc), similarity, coverage, or all. Outputs under --out:
<analysis>.json and <analysis>.png for each, and summary.json (settings, files, headline numbers).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import yaml

from esrl.analysis import connectivity, coverage, robustness, similarity
from esrl.analysis.common import (AnalysisError, Context, ModelRef, RewardEvaluator, check_same_configs, eval_rows,
                                  write_json)
from esrl.checkpoints import check_root_dir
from esrl.config_files import load_yaml
from esrl.errors import ConfigError
from esrl.labels import split_label
from esrl.needs import checked_device

ANALYSES = {"robustness": robustness, "connectivity": connectivity, "similarity": similarity,
            "coverage": coverage}
ALIASES = {"lmc": "connectivity", "cosine": "similarity", "weights": "similarity"}


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AnalysisError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="esrl analyze", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("analyses", nargs="*", default=["all"],
                   help=f"which analyses: {', '.join(ANALYSES)}, or all (default); lmc = connectivity")
    p.add_argument("--base", default=None,
                   help="base model: HF folder or `smollm2-135m-instruct` (needed by similarity and base->run LMC)")
    p.add_argument("--models", nargs="+", action="extend", default=[], metavar="[LABEL=]PATH",  # twice: both kept
                   help="trained models: HF folders (a run's final/), or run folders holding one final/")
    p.add_argument("--task", default="conciseness", help="task name (esrl.tasks.build_task)")
    p.add_argument("--task-args", default=None, help="task options as a JSON/YAML mapping")
    p.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="one task option")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=8, help="first N prompts of the task's eval split")
    p.add_argument("--batch-size", type=int, default=64, help="most sequences per generate call")
    p.add_argument("--sigmas", default="0,0.0005,0.001,0.002,0.004,0.008",
                   help="robustness: sigma grid (absolute noise std per weight, as ES's sigma)")
    p.add_argument("--seeds", type=int, default=3, help="robustness: perturbations per sigma")
    p.add_argument("--alphas", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1",
                   help="connectivity: interpolation grid (must include 0 and 1)")
    p.add_argument("--coverage-k", type=int, default=8, help="coverage: candidates per prompt (k up to this)")
    p.add_argument("--coverage-sigma", type=float, default=0.001, help="coverage: sigma of the perturbed copies")
    p.add_argument("--temperature", type=float, default=1.0, help="coverage: sampling temperature")
    p.add_argument("--correct-metric", default=None,
                   help="task metric marking a correct sample for pass@k (default accuracy, exact, else reward > 0)")
    p.add_argument("--dtype", default="float32", help="weights dtype: float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the perturbations and samples")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def resolve_model(spec: str, index: int) -> ModelRef:
    """`[LABEL=]PATH` -> ModelRef; a run folder (or its lightning_logs) resolves to its single final/."""
    from esrl.models.loading import EMBEDDED_MODELS

    label, path = split_label(spec)
    if path in EMBEDDED_MODELS:
        return ModelRef(label or path, path)
    folder = Path(path).expanduser()
    if not folder.exists():
        raise AnalysisError(f"model {path!r}: no such folder ({folder.resolve()})")
    if not (folder / "config.json").is_file():
        finals = sorted(f.parent for f in folder.glob("**/final/config.json"))
        if len(finals) != 1:
            raise AnalysisError(f"model {path!r}: {folder.resolve()} has no config.json"
                                + (f" and {len(finals)} final/ folders below it; pass one" if finals else
                                   " (pass an HF folder such as a run's final/)"))
        folder = finals[0]
    if not label:
        parts = [x for x in folder.resolve().parts if x not in ("final", "lightning_logs")]
        label = "/".join(parts[-2:]) if parts and parts[-1].startswith("version_") else (parts[-1] if parts
                                                                                          else f"model{index}")
    return ModelRef(label, str(folder))


def _yaml(text: str, flag: str) -> Any:
    """A value as `esrl fit` reads the same one in its config (jsonargparse's YAML loader: `1e-4` is a number)."""
    try:
        return load_yaml(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise AnalysisError(f"{flag}: not valid JSON/YAML ({problem}): {text!r}") from None


def task_options(args) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.task_args:
        loaded = _yaml(args.task_args, "--task-args")
        if not isinstance(loaded, dict):
            raise AnalysisError(f"--task-args: expected a mapping, got {args.task_args!r}")
        options.update(loaded)
    for item in args.task_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise AnalysisError(f"--task-arg: expected KEY=VALUE, got {item!r}")
        options[key] = _yaml(value, f"--task-arg {key}")
    return options


def selected(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        name = ALIASES.get(name, name)
        if name == "all":
            out.extend(ANALYSES)
        elif name in ANALYSES:
            out.append(name)
        else:
            raise AnalysisError(f"unknown analysis {name!r}; choose from {', '.join(ANALYSES)}, all "
                                f"(aliases: {', '.join(ALIASES)})")
    return list(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    names = selected(args.analyses)
    base = resolve_model(args.base, 0) if args.base else None
    models = [resolve_model(s, i + 1) for i, s in enumerate(args.models)]
    labels = [m.label for m in models] + ([base.label] if base else [])
    if len(set(labels)) != len(labels):
        raise AnalysisError(f"model labels must differ, got {labels}; name them with LABEL=PATH")
    if base is None and not models:
        raise AnalysisError("no model: pass --base and/or --models")
    for flag in ("max_new_tokens", "batch_size", "num_prompts", "seeds", "coverage_k"):  # 0 ran as 1, or nothing
        if getattr(args, flag) < 1:
            raise AnalysisError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    sigmas = _floats(args.sigmas, "--sigmas")
    alphas = _floats(args.alphas, "--alphas")
    options = task_options(args)
    for name in names:  # each selected analysis's inputs before any model loads: `all` ran robustness in full, then
        if name == "robustness":  # stopped at connectivity's --alphas or similarity's missing --base
            robustness.check(sigmas, args.seeds)
        elif name == "connectivity":
            connectivity.check(alphas, base, models)
        elif name == "similarity":
            similarity.check(base, models)
        else:
            coverage.check(args.coverage_k, args.coverage_sigma, args.temperature)
    check_root_dir(args.out, "--out")

    from esrl.models.loading import DTYPES, load_tokenizer, resolve_model_path
    from esrl.tasks import build_task

    if args.dtype not in DTYPES:
        raise AnalysisError(f"--dtype {args.dtype!r}: choose one of {', '.join(DTYPES)}")
    device = str(checked_device(args.device, "--device"))
    for ref in [base, *models]:
        if ref is not None:
            ref.path = resolve_model_path(ref.path)  # the embedded model: its cached folder
    if {"similarity", "connectivity"} & set(names):  # they compare the models weight by weight
        check_same_configs([r for r in [base, *models] if r is not None])
    try:
        task = build_task(args.task, **options)
    except ConfigError as e:  # named as this command's flags, not a fit config's fields
        message = str(e).replace("data.task_args.", "--task-arg ", 1).replace("data.task:", "--task:", 1)
        raise AnalysisError(message) from None
    tokenizer = load_tokenizer((models[0] if models else base).path)
    evaluator = RewardEvaluator(task, tokenizer, eval_rows(task, args.num_prompts), args.max_new_tokens,
                                args.batch_size, args.correct_metric)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("no_progress",)}
    settings.update(device=device, analyses=names, prompts=len(evaluator.rows))
    ctx = Context(base=base, models=models, evaluator=evaluator, out=out, dtype=args.dtype, device=device,
                  seed=args.seed, settings=settings)

    summary: dict[str, Any] = {"settings": settings,
                               "base": {"label": base.label, "path": base.path} if base else None,
                               "models": [{"label": m.label, "path": m.path} for m in models], "analyses": {}}
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), disable=args.no_progress)
    with progress:
        ctx.progress = progress
        for name in names:
            module = ANALYSES[name]
            start = time.perf_counter()
            if name == "robustness":
                data = module.run(ctx, sigmas, args.seeds)
            elif name == "connectivity":
                data = module.run(ctx, alphas)
            elif name == "similarity":
                data = module.run(ctx)
            else:
                data = module.run(ctx, args.coverage_k, args.coverage_sigma, args.temperature)
            data["seconds"] = round(time.perf_counter() - start, 3)
            json_path = write_json(out / f"{name}.json", data)
            png_path = module.plot(data, out / f"{name}.png")
            summary["analyses"][name] = {"json": json_path.name, "png": png_path.name,
                                         "seconds": data["seconds"], "headline": module.headline(data)}
    write_json(out / "summary.json", summary)
    print(json.dumps({k: v["headline"] for k, v in summary["analyses"].items()}, indent=1, default=str))
    print(f"esrl analyze: wrote {', '.join(f'{n}.json/.png' for n in names)} and summary.json to {out}")
    return summary
