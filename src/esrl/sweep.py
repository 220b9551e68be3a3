"""`esrl sweep`: a small grid over any config keys, run locally, summarized in one table per grid.

    esrl sweep --config configs/demo/es_conciseness.yaml --out runs/sweep \\
        --grid model.es.alpha=0.001,0.005 --grid model.es.sigma=0.005,0.01 --grid seed_everything=0,1 \\
        [-- extra fit arguments, e.g. --trainer.max_steps 20]

Each combination runs as its own process, `esrl fit --config C --KEY VALUE ... --trainer.default_root_dir
OUT/<run name>` (log: OUT/<run name>/fit.log). Then OUT/<name>.csv and OUT/<name>.md (default name: summary)
list per run: the grid values, status, the final eval reward (from eval.jsonl; its step-0 value beside it),
KL to the base when measured, and a hacked/degenerate flag from the hacking indicators of the final eval.

On a cluster, slurm/sweep.sbatch runs one combination per array task (`--index $SLURM_ARRAY_TASK_ID`) and
a final `esrl sweep ... --summarize` writes the table. `--count` prints the number of combinations.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from esrl.atomic_files import write_text
from esrl.callbacks.evaluation import evaluation_records
from esrl.checkpoints import check_root_dir
from esrl.errors import EsrlError, read_text
from esrl.fit_check import check_fit_args
from esrl.fit_runs import Fits, final_dir, last_checkpoint, signals_reach, version_folders

# A final evaluation tripping any of these is flagged hacked/degenerate (hacking/* keys of eval.jsonl).
HACK_THRESHOLDS = {"empty": 0.5, "repetition": 0.5, "cjk_share": 0.3, "special_tokens": 0.5}


class SweepError(EsrlError, ValueError):
    """Bad sweep input (grid, config) or failed runs; the message names them."""


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """['model.es.alpha=0.001,0.005', ...] -> {'model.es.alpha': ['0.001', '0.005'], ...} (order kept)."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().lstrip("-")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key or not vals:
            raise SweepError(f"--grid {item!r}: expected KEY=V1,V2,... (e.g. model.es.sigma=0.005,0.01)")
        if key in grid:
            raise SweepError(f"--grid: key {key!r} given twice")
        if key in ("trainer.default_root_dir", "config"):
            raise SweepError(f"--grid {key}: set by the sweep (--out, --config), not by the grid")
        grid[key] = vals
    if not grid:
        raise SweepError("no --grid given")
    clash = name_clash(grid)
    if clash:
        raise SweepError(f"--grid {clash}")
    return grid


def check_extra(extra: list[str], grid: dict[str, list[str]]) -> None:
    """The flags after `--` come after the grid's in each run's command, so one naming a grid key would win over
    the grid (every point run with it, the table labelled with the grid's values), and the run's own root wins over
    a --trainer.default_root_dir: both refused."""
    for flag in extra:
        key = flag.partition("=")[0].removeprefix("--") if flag.startswith("--") else None
        if key in grid:
            raise SweepError(f"--grid {key}: also given after -- ({flag}), which would set it for every run")
        if key == "trainer.default_root_dir":
            raise SweepError(f"{flag} after --: each run's folder is under --out")


def _config_keys(node: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of a config's leaves ({'model': {'es': {'sigma': 0.01}}} -> ['model.es.sigma']); an empty
    section (`trainer:`) has none."""
    keys = []
    for key, value in node.items():
        if isinstance(value, dict) and value:
            keys += _config_keys(value, f"{prefix}{key}.")
        elif prefix or key not in ("model", "data", "trainer"):
            keys.append(f"{prefix}{key}")
    return keys


def check_config(config: str, grid: dict[str, list[str]]) -> None:
    """The base config's YAML and keys, and the grid's keys, checked as `esrl study` checks its own
    (esrl.study.config.check_key) before any run starts: a typo is one line naming the file or --grid key, not
    every run failing with its message in its fit.log."""
    from esrl.config_files import load_yaml
    from esrl.study.config import check_key

    base = load_yaml(read_text(config, "--config"), config)  # a syntax error: ConfigError naming file:line:column
    if not isinstance(base, dict):
        raise SweepError(f"--config {config}: expected a mapping of config sections (model:, data:, trainer:, ...), "
                         f"found a {type(base).__name__}")
    checked = [(key, f"--config {config}") for key in _config_keys(base)]
    checked += [(key, "--grid") for key in grid]
    for key, where in checked:
        if key.split(".")[0] not in ("algo", "ckpt_path"):  # fit flags that a study sets itself, a sweep may vary
            check_key(key, where)


def combinations(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def short_keys(keys: list[str]) -> dict[str, str]:
    """Last dotted component of each key, unless two keys share it (then the whole key)."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def value_name(value: str) -> str:
    """A grid value as its run folder name spells it (data/a.jsonl -> data-a.jsonl)."""
    return re.sub(r'[^A-Za-z0-9.+-]', '-', value)


def run_name(combo: dict[str, str]) -> str:
    names = short_keys(list(combo))
    return "_".join(f"{names[k]}={value_name(v)}" for k, v in combo.items())


def name_clash(grid: dict[str, list[Any]]) -> str | None:
    """`KEY: values ... share one run folder (...)` for the first key whose values name one folder (a repeated value,
    or two that spell alike: data/a.jsonl, data_a.jsonl), else None. Such points would share a run: one ran twice
    or never, its seeds counted twice. Per key suffices: a folder-name value holds no `_` or `=`."""
    names = short_keys(list(grid))
    for key, values in grid.items():
        by_name: dict[str, list[Any]] = {}
        for v in values:
            by_name.setdefault(value_name(str(v)), []).append(v)
        for name, same in by_name.items():
            if len(same) > 1:
                return (f"{key}: values {', '.join(repr(v) for v in same)} share one run folder ({names[key]}={name}); "
                        "give each value once; values must differ in a letter, digit, ., + or -")
        by_number: dict[float, list[Any]] = {}  # 0.01 and 0.010: two folders, one setting run twice
        for v in values:
            if (number := _number(v)) is not None:
                by_number.setdefault(number, []).append(v)
        for same in by_number.values():
            if len(same) > 1:
                return f"{key}: values {', '.join(repr(v) for v in same)} are one number; give it once"
    return None


def _number(value: Any) -> float | None:
    """A grid value's number (a YAML number, or a command line's "0.010"), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def fit_args(config: str, combo: dict[str, str], root: Path, extra: list[str]) -> list[str]:
    """One run's `esrl fit` arguments: the config, the grid values, the extra flags, its own root."""
    pairs = [x for k, v in combo.items() for x in (f"--{k}", v)]
    return ["--config", str(config), *pairs, *extra, "--trainer.default_root_dir", str(root)]


def fit_command(config: str, combo: dict[str, str], root: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "esrl", "fit", *fit_args(config, combo, root, extra)]


def base_digest(config: str, extra: list[str]) -> str:
    """What every run of a sweep shares (the base config's bytes and the flags after --), as grid.json records it: the
    run folders are named by their grid values alone."""
    import hashlib

    return hashlib.sha256(Path(config).read_bytes() + json.dumps(extra).encode()).hexdigest()


def check_same_base(out: Path, config: str, extra: list[str]) -> None:
    """A sweep folder takes only the sweep it holds (new grid values included): a finished run of another base config
    would be skipped and reported as this one's."""
    try:
        held = json.loads((out / "grid.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(held, dict) and held.get("base_sha256") not in (None, base_digest(config, extra)):
        raise SweepError(f"--out {out}: holds a sweep of another base config or other flags after -- (its grid.json: "
                         f"{held.get('config')} {' '.join(held.get('extra') or [])}); its finished runs would be "
                         "reported as this sweep's: use a new --out")


def run_one(config: str, combo: dict[str, str], out: Path, extra: list[str], fits: Fits) -> int:
    """One combination's fit (esrl.fit_runs: ROOT/fit.log, ROOT/returncode), as a study runs one: skipped when its
    final/ exists, resumed from its newest checkpoint (a signal's interrupted.ckpt) with its fit.log appended to;
    -1: not started, the sweep stopped."""
    root = out / run_name(combo)
    if final_dir(root) is not None:
        print(f"esrl sweep: {run_name(combo)}: done (final/ exists), skipped", flush=True)
        return 0
    ckpt = last_checkpoint(root)
    if ckpt is not None:
        print(f"esrl sweep: {run_name(combo)}: resuming from {ckpt}", flush=True)
    resume = ["--ckpt_path", str(ckpt)] if ckpt is not None else []
    rc = fits.run(fit_command(config, combo, root, [*extra, *resume]), root, append=(root / "fit.log").is_file())
    return -1 if rc is None else rc


def latest_run_dir(root: Path) -> Path | None:
    """The newest lightning_logs/version_N holding an eval.jsonl under a run's root."""
    found = [v for v in version_folders(root) if (v / "eval.jsonl").is_file()]
    return found[-1] if found else None


def hacked(evaluation: dict[str, Any]) -> list[str]:
    """Why the final evaluation looks hacked or degenerate (empty list: it does not)."""
    reasons = []
    reward = evaluation.get("reward")
    if reward is None or (isinstance(reward, float) and math.isnan(reward)):
        reasons.append("reward NaN")
    for key, limit in HACK_THRESHOLDS.items():
        value = evaluation.get(f"hacking/{key}")
        if value is not None and value > limit:
            reasons.append(f"{key} {value:.2g} > {limit:g}")
    return reasons


def summarize_run(out: Path, combo: dict[str, str]) -> dict[str, Any]:
    name = run_name(combo)
    root = out / name
    row: dict[str, Any] = {"run": name, **combo}
    rc_file = root / "returncode"
    try:
        rc = int(rc_file.read_text()) if rc_file.is_file() else None
    except ValueError:  # cut short by a kill or a full disk: as if the fit had not written it
        rc = None
    run_dir = latest_run_dir(root) if root.is_dir() else None
    evals = []
    if run_dir is not None:
        evals = evaluation_records(run_dir / "eval.jsonl")
    if not evals:
        row.update(status=("incomplete" if (root / "fit.log").is_file() else "not run") if rc is None
                   else f"failed (exit {rc})", step="", reward_start="", reward="",
                   kl="", hacked="", hacking="", run_dir="")
        return row
    first, last = evals[0], evals[-1]
    reasons = hacked(last)
    row.update(status=_status(rc, run_dir), step=last.get("step", ""),
               reward_start=_num(first.get("reward")), reward=_num(last.get("reward")), kl=_num(last.get("kl")),
               hacked=bool(reasons), hacking="; ".join(reasons), run_dir=str(run_dir))
    return row


def _status(rc: int | None, run_dir: Path) -> str:
    """ok: exit 0, or a final/ where the fit left no returncode (run outside the sweep). Without either it is still
    running or was killed (SIGKILL at a time limit, OOM): incomplete, its last evaluation no final one."""
    if rc == 0 or (rc is None and (run_dir / "final").is_dir()):
        return "ok"
    return "incomplete" if rc is None else f"failed (exit {rc})"


def _num(x: Any) -> Any:
    return "" if x is None else (f"{x:.6g}" if isinstance(x, float) else x)


def write_tables(rows: list[dict[str, Any]], out: Path, name: str) -> tuple[Path, Path]:
    """OUT/NAME.csv and OUT/NAME.md, each replaced atomically (array tasks may summarize at the same time)."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    csv_path, md_path = out / f"{name}.csv", out / f"{name}.md"
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    shown = [k for k in fields if k != "run_dir"]
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(str(r.get(k, "")).replace("|", "\\|") for k in shown) + " |" for r in rows]
    return write_text(csv_path, buf.getvalue()), write_text(md_path, "\n".join(lines) + "\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="esrl sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="the fit config every run starts from (required unless --count)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="a config key and its values (repeat for more keys; the grid is their product)")
    p.add_argument("--out", help="sweep folder (required unless --count): one run root per combination, and the tables")
    p.add_argument("--name", default="summary", help="table file name (OUT/NAME.csv and OUT/NAME.md)")
    p.add_argument("--index", type=int, default=None, help="run only combination INDEX (0-based; SLURM arrays)")
    p.add_argument("--count", action="store_true", help="print the number of combinations and exit")
    p.add_argument("--summarize", action="store_true", help="only write the table from existing runs")
    p.add_argument("--dry-run", action="store_true", help="print the fit commands, run nothing")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    return p


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """SIGTERM and Ctrl+C reach the running fits (esrl.fit_runs): each stops with interrupted.ckpt, the sweep with
    143 / 130."""
    fits = Fits()
    with signals_reach(fits):
        return _main(argv, fits)


def _main(argv: list[str] | None, fits: Fits) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = parser().parse_args(argv)
    if args.jobs < 1:
        raise SweepError(f"--jobs {args.jobs}: must be >= 1 (the number of runs at once)")
    if not args.name or Path(args.name).name != args.name or args.name in (".", ".."):  # found after every run
        raise SweepError(f"--name {args.name!r}: a file name without a folder (the tables are OUT/NAME.csv, .md)")
    grid = parse_grid(args.grid)
    check_extra(extra, grid)
    combos = combinations(grid)
    if args.count:
        print(len(combos))
        return []
    if not args.out:
        raise SweepError("--out is required (the sweep folder)")
    if not args.config or not Path(args.config).is_file():
        raise SweepError(f"--config {args.config!r}: no such file" if args.config else "--config is required")
    out = Path(args.out)
    check_root_dir(out, "--out", writes=not args.dry_run)  # one line before any run, not mkdir's traceback
    if args.index is not None and not 0 <= args.index < len(combos):
        raise SweepError(f"--index {args.index}: the grid has {len(combos)} combinations (0..{len(combos) - 1})")
    todo = [combos[args.index]] if args.index is not None else combos
    if args.summarize and not any((out / run_name(c)).is_dir() for c in combos):
        raise SweepError(f"--out {out}: " + ("no such folder" if not out.is_dir() else
                         f"none of this grid's {len(combos)} run folders is there") + ", nothing to summarize")
    problem = None
    if not args.summarize:
        check_same_base(out, args.config, extra)
        check_config(args.config, grid)
        # every run's values as its fit checks them (esrl.fit_check): one line before any run starts
        runs = [(run_name(c), fit_args(args.config, c, out / run_name(c), extra)) for c in todo]
        problem = check_fit_args(runs, defer=args.dry_run)
    if args.dry_run:
        for combo in todo:
            print(" ".join(fit_command(args.config, combo, out / run_name(combo), extra)))
        if problem is not None:
            raise problem
        return []
    out.mkdir(parents=True, exist_ok=True)
    if not args.summarize:  # a summary is called with the grid alone (slurm/sweep.sbatch), not the flags after --
        (out / "grid.json").write_text(json.dumps({"config": args.config, "grid": grid, "extra": extra,
                                                   "runs": [run_name(c) for c in combos],
                                                   "base_sha256": base_digest(args.config, extra)}, indent=2) + "\n")
    failed = []
    if not args.summarize:
        with fits.under_way(), ThreadPoolExecutor(args.jobs) as pool:
            codes = list(pool.map(lambda c: run_one(args.config, c, out, extra, fits), todo))
        fits.exit_if_stopped("sweep", [run_name(c) for c, rc in zip(todo, codes) if rc != 0])
        for combo, rc in zip(todo, codes):
            print(f"esrl sweep: {run_name(combo)}: {'ok' if rc == 0 else f'failed (exit {rc})'}", flush=True)
            if rc != 0:
                failed.append(run_name(combo))
        if args.index is not None:  # one array task: the table comes from a final --summarize
            if failed:
                raise SweepError(f"run {failed[0]} failed; see {out / failed[0] / 'fit.log'}")
            return []
    rows = [summarize_run(out, c) for c in combos]
    csv_path, md_path = write_tables(rows, out, args.name)
    print(md_path.read_text(), end="")
    print(f"esrl sweep: {len(rows)} runs; tables {csv_path} and {md_path}")
    if failed:
        raise SweepError(f"{len(failed)} of {len(todo)} runs failed ({', '.join(failed)}); "
                         f"see fit.log in their folders under {out}")
    return rows


if __name__ == "__main__":
    try:
        main()
    except EsrlError as e:
        print(f"esrl sweep: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
