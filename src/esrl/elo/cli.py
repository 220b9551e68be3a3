"""`esrl elo`: a judge Elo tournament between models' completion files.

    esrl elo --judge-url http://127.0.0.1:8000/v1 --judge-model judge \\
        --completions es=es.jsonl grpo=grpo.jsonl base=base.jsonl --out runs/elo

Each completion file holds one row per prompt: {"prompt": ..., "completion": ...} (or "response"), with an
optional "id"; a run's samples.csv (Evaluation callback) works too. Every pair of models is judged on every
prompt and criterion in both orders by an LLM behind any OpenAI-compatible chat endpoint (vLLM, OpenAI, ...).
Outputs under --out: judgments.jsonl (the cache: a rerun asks only what is missing or unreadable), ratings.json (per criterion
and overall: rating, 95% bootstrap interval, games, wins/ties/losses) and ratings.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from esrl.atomic_files import write_text
from esrl.checkpoints import check_root_dir
from esrl.elo.judge import TEMPLATES, ChatJudge, api_key_from_env
from esrl.errors import ConfigError
from esrl.scoring.token import header_token


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="esrl elo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--judge-url", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--judge-model", required=True, help="the judge's model name at that endpoint")
    p.add_argument("--api-key", default=None,
                   help="bearer token (default: env ESRL_JUDGE_API_KEY, else OPENAI_API_KEY; none for a local server)")
    # action extend: the flag given twice adds to the list (argparse's default kept only the last, silently)
    p.add_argument("--completions", nargs="+", action="extend", required=True, metavar="[NAME=]PATH",
                   help="one completion file per model (.jsonl, or a run's samples.csv); NAME defaults to the stem")
    p.add_argument("--out", required=True, help="output folder (judgments.jsonl, ratings.json, ratings.png)")
    p.add_argument("--criteria", nargs="+", action="extend", choices=list(TEMPLATES),
                   help=f"default: all ({' '.join(TEMPLATES)})")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the prompts (0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resamples")
    p.add_argument("--prior", type=float, default=1.0,
                   help="virtual ties per model against a mean-rated opponent, keeping ratings finite (0: plain MLE)")
    p.add_argument("--max-prompts", type=int, default=None, help="only the first N prompts of the first file")
    p.add_argument("--concurrency", type=int, default=4, help="judge requests in flight")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per judge request")
    p.add_argument("--retries", type=int, default=3, help="further attempts after a failed request (with backoff)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens the judge may answer with")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check(args: argparse.Namespace) -> None:
    for flag, value, low in (("--bootstrap", args.bootstrap, 0), ("--concurrency", args.concurrency, 1),
                             ("--retries", args.retries, 0), ("--max-tokens", args.max_tokens, 1),
                             ("--max-prompts", 1 if args.max_prompts is None else args.max_prompts, 1)):
        if value < low:
            raise ConfigError(f"{flag}: must be >= {low}, got {value}")
    if args.timeout <= 0 or args.prior < 0:
        raise ConfigError("--timeout must be > 0 and --prior >= 0")
    args.criteria = args.criteria or list(TEMPLATES)
    if len(set(args.criteria)) < len(args.criteria):  # every game went to the first copy, the second rated empty
        raise ConfigError(f"--criteria {' '.join(args.criteria)}: a criterion given twice")
    if not args.judge_url.startswith(("http://", "https://")):
        raise ConfigError(f"--judge-url {args.judge_url!r}: expected an http(s):// URL")
    if args.api_key:
        header_token(args.api_key, "--api-key")
    else:
        api_key_from_env()  # the environment's key, checked as --api-key
    check_root_dir(args.out, "--out")  # before any judge call


def run(args: argparse.Namespace, judge: Any = None) -> dict[str, Any]:
    """The whole tournament; `judge` replaces the HTTP judge (anything with .ask(criterion, prompt, a, b))."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from esrl.elo.cache import JudgmentCache
    from esrl.elo.files import line_up
    from esrl.elo.report import plot, print_table
    from esrl.elo.tournament import judge_missing, judge_stats, rate, schedule, wins_tensor

    _check(args)
    tournament = line_up(args.completions, args.max_prompts)
    out = Path(args.out)
    start = time.perf_counter()
    matches = schedule(tournament, args.criteria, args.judge_model)
    cache = JudgmentCache(out / "judgments.jsonl")
    own = judge is None
    if own:
        judge = ChatJudge(args.judge_url, args.judge_model, args.api_key or api_key_from_env(), args.timeout,
                          args.retries, max_tokens=args.max_tokens, concurrency=args.concurrency)
    progress = Progress(TextColumn("judging"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), disable=args.no_progress)
    try:
        with progress:
            task = progress.add_task("judging", total=None)
            counts = judge_missing(matches, tournament, cache, judge, args.judge_model, args.concurrency,
                                   lambda done, todo: progress.update(task, completed=done, total=todo))
    finally:
        cache.close()
        if own:
            judge.close()
    counts.update(judge_stats(matches, cache), damaged_cache_lines=cache.damaged)
    ratings = rate(wins_tensor(matches, tournament, args.criteria, cache), tournament.models, args.criteria,
                   args.bootstrap, args.seed, args.prior)
    summary = {"judge": {"url": args.judge_url, "model": args.judge_model}, "models": tournament.models,
               "criteria": args.criteria, "prompts": len(tournament.prompts), "bootstrap": args.bootstrap,
               "seed": args.seed, "prior": args.prior, "confidence": 0.95, "method": "bradley-terry",
               "ratings": ratings, "judgments": counts, "seconds": round(time.perf_counter() - start, 3)}
    write_text(out / "ratings.json", json.dumps(summary, indent=2, allow_nan=False) + "\n")
    plot(ratings, out / "ratings.png")
    print_table(summary)
    too_long = f", {counts['too_long']} of them past the judge's context" if counts["too_long"] else ""
    print(f"judgments: {counts['total']} distinct, {counts['cached']} cached, {counts['queried']} queried, "
          f"{counts['identical']} identical (ties), {counts['unparsed']} unparsed (ties{too_long}); "
          f"judge picked the first response in {_percent(counts['first_position_rate'])} of its picks")
    print(f"esrl elo: wrote judgments.jsonl, ratings.json and ratings.png to {out}")
    return summary


def _percent(rate: float | None) -> str:
    return "n/a" if rate is None else f"{100 * rate:.0f}%"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import sys

    return run(parser().parse_args(sys.argv[1:] if argv is None else argv))


__all__ = ["main", "parser", "run"]
