"""`esrl study`: one YAML -> every (algorithm, grid point, seed) as its own `esrl fit`, then one report.

    esrl study configs/study/conciseness_cpu.yaml            # run what is missing, then OUT/report.md
    esrl study STUDY.yaml --count                            # number of runs (the SLURM array size)
    esrl study STUDY.yaml --index 3                          # run number 3 only (a SLURM array task)
    esrl study STUDY.yaml --report                           # the report from the runs there, runs nothing

A rerun skips finished runs (those with a final/) and resumes interrupted ones from their last checkpoint.
SIGTERM or Ctrl+C stops the running fits after their step with interrupted.ckpt and the study with exit 143 / 130.
On SLURM (slurm/sweep.sbatch with ESRL_TOOL=study; the last task to finish writes the report):
    ESRL_TOOL=study sbatch --array=0-$(( $(esrl study S.yaml --count) - 1 )) slurm/sweep.sbatch S.yaml OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from esrl.errors import EsrlError
from esrl.fit_check import check_fit_args
from esrl.fit_runs import Fits, signals_reach
from esrl.study.config import load_study
from esrl.study.runner import changed_setting, fit_line, plan, resolved_config, run_all, status


class StudyError(EsrlError, RuntimeError):
    """Runs of the study failed; the message names them."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="esrl study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", nargs="?", help="the study YAML (see esrl.study.config.StudyConfig)")
    p.add_argument("--config", default=None, help="the study YAML (instead of the positional argument)")
    p.add_argument("--out", default=None, help="study folder (default: the file's `out`)")
    p.add_argument("--index", type=int, default=None, help="run only run INDEX (0-based; SLURM array tasks)")
    p.add_argument("--count", action="store_true", help="print the number of runs and exit")
    p.add_argument("--report", action="store_true", help="only write the report from the runs there")
    p.add_argument("--summarize", action="store_true",
                   help="write the report only once every run is done (what each SLURM array task does at its end)")
    p.add_argument("--dry-run", action="store_true",
                   help="check every run's config, print each run's state and fit command, run nothing")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (default 1: one after another)")
    return p


def main(argv: list[str] | None = None) -> Any:
    """SIGTERM (kill, SLURM's time limit) and SIGINT (Ctrl+C): passed on to the running fits (esrl.fit_runs), the
    study exits 143 / 130 once they stopped; before any run started, at once."""
    fits = Fits()
    with signals_reach(fits):
        return _main(argv, fits)


def _main(argv: list[str] | None, fits: Fits) -> Any:
    start = time.perf_counter()
    args = parser().parse_args(argv)
    if args.config and args.study and Path(args.config).resolve() != Path(args.study).resolve():  # one was dropped
        raise StudyError(f"two study files, {args.study} and --config {args.config}: give one")
    path = args.config or args.study
    if not path:
        raise StudyError("no study file given: esrl study STUDY.yaml")
    if args.jobs < 1:  # as esrl sweep refuses it (ThreadPoolExecutor's max(1, ...) ran it as 1)
        raise StudyError(f"--jobs {args.jobs}: must be >= 1 (the number of runs at once)")
    study = load_study(path, out=args.out, writes=not (args.count or args.dry_run))
    runs = plan(study)
    if args.count:
        print(len(runs))
        return runs
    if args.index is not None and not 0 <= args.index < len(runs):
        raise StudyError(f"--index {args.index}: the study has {len(runs)} runs (0..{len(runs) - 1})")
    todo = [runs[args.index]] if args.index is not None else runs
    for run in todo:  # finished under other settings: neither skipped nor reported
        changed = changed_setting(study, run)
        if changed:
            raise StudyError(f"{run.root} finished with other settings than the study now gives ({changed}): move "
                             "it away to run it again with them, or restore the study file")
    problem = None
    if not (args.report or args.summarize):
        # Every run still to do as its fit checks it (esrl.fit_check), before the first starts: a bad grid value
        # is one line naming its run, not a fit.log after the runs before it.
        problem = check_fit_args([(run.name, ["--config", yaml.safe_dump(resolved_config(study, run),
                                                                           sort_keys=False)])
                                  for run in todo if status(run) != "done"], defer=args.dry_run)
    if args.dry_run:
        for run in todo:
            print(f"{run.name} ({status(run)}): {fit_line(study, run)}")
        if problem is not None:
            raise problem
        return runs
    failed = [] if (args.report or args.summarize) else run_all(study, todo, args.jobs, fits)
    fits.exit_if_stopped("study", [r.name for r in failed])
    if args.index is not None:
        if failed:
            raise StudyError(f"run {failed[0].name} failed; see {failed[0].root / 'fit.log'}")
        return runs
    if args.summarize and any(status(r) != "done" for r in runs):
        done = sum(status(r) == "done" for r in runs)
        print(f"esrl study: {done} of {len(runs)} runs done; the report waits for all of them")
        return runs
    from esrl.study.report import write_report

    report = write_report(study, runs, wall_s=time.perf_counter() - start)
    print(f"esrl study: report {report}")
    if failed:
        raise StudyError(f"{len(failed)} of {len(todo)} runs failed ({', '.join(r.name for r in failed)}); "
                         f"see fit.log in their folders under {study.out}/runs (rerun to retry them)")
    return runs


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except EsrlError as e:
        print(f"esrl study: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
