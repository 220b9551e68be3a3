"""The tournament: every pair of models on every prompt and criterion, judged in both orders, then rated.

A game is one (criterion, prompt, pair of models); it is judged twice, once with each model shown first, and
each judgment gives the model shown as A 1, 1/2 (tie, or an answer naming neither) or 0 points. Summing both
orders cancels the judge's position bias: a judge that always answers "A" makes every game a draw.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from itertools import combinations
from typing import Any, Callable

import numpy as np

from esrl.elo.cache import JudgmentCache
from esrl.elo.files import Tournament
from esrl.elo.judge import JudgeAnswer, JudgeError, PromptTooLong, judgment_key, parse_verdict
from esrl.elo.rating import bootstrap_ratings

POINTS = {"A": 1.0, "B": 0.0, "tie": 0.5, None: 0.5}  # points of the response shown as A


@dataclass(frozen=True)
class Match:
    """One judgment: `first` is shown as response A, `second` as B; key None when both texts are equal."""

    criterion: str
    prompt: int
    first: str
    second: str
    key: str | None


def schedule(t: Tournament, criteria: list[str], judge_model: str) -> list[Match]:
    """Every criterion x prompt x pair, in both orders; equal responses make a tie without asking the judge."""
    matches = []
    for criterion in criteria:
        for k, prompt in enumerate(t.prompts):
            for x, y in combinations(t.models, 2):
                for a, b in ((x, y), (y, x)):
                    ra, rb = t.completions[a][k], t.completions[b][k]
                    key = None if ra == rb else judgment_key(judge_model, criterion, prompt, ra, rb)
                    matches.append(Match(criterion, k, a, b, key))
    return matches


def judge_missing(matches: list[Match], t: Tournament, cache: JudgmentCache, judge: Any, judge_model: str,
                  concurrency: int = 4, progress: Callable[[int, int], None] | None = None) -> dict[str, int]:
    """Ask the judge every judgment the cache lacks (each distinct question once), saving each answer as it
    arrives. Asked again: a cached answer that named neither response, and one that max_tokens cut off when the judge
    now has more (a judge cut off by --max-tokens, then given more, kept its cut answers for good).
    judge.ask(criterion, prompt, response_a, response_b) -> the judge's raw answer (a JudgeAnswer says whether it
    was cut off); progress(done, to_do) is called before the first request and after each answer."""
    max_tokens = getattr(judge, "max_tokens", None)

    def stale(record: dict) -> bool:
        cut = record.get("truncated") and max_tokens is not None and (record.get("max_tokens") or 0) < max_tokens
        return parse_verdict(record["raw"]) is None or bool(cut)

    todo: dict[str, Match] = {}
    for m in matches:
        if m.key is not None and (m.key not in cache or stale(cache[m.key])):
            todo.setdefault(m.key, m)
    distinct = {m.key for m in matches if m.key is not None}
    counts = {"total": len(distinct), "cached": len(distinct) - len(todo), "queried": 0,
              "identical": sum(m.key is None for m in matches)}

    saved: set[Future] = set()

    def ask(m: Match) -> str:
        """The judge's answer; a comparison past its context is no answer (a tie), said in the record, not an end."""
        try:
            return judge.ask(m.criterion, t.prompts[m.prompt], t.completions[m.first][m.prompt],
                             t.completions[m.second][m.prompt])
        except PromptTooLong as e:
            answer = JudgeAnswer("")
            answer.too_long = str(e)
            return answer

    def save(future: Future, m: Match) -> None:
        raw = future.result()
        cache.add({"key": m.key, "judge_model": judge_model, "criterion": m.criterion,
                   "prompt_id": t.prompt_ids[m.prompt], "model_a": m.first, "model_b": m.second,
                   "verdict": parse_verdict(raw), "raw": str(raw), "truncated": bool(getattr(raw, "truncated", False)),
                   "max_tokens": max_tokens, **({"too_long": raw.too_long} if getattr(raw, "too_long", "") else {})})
        saved.add(future)
        counts["queried"] += 1
        if progress:
            progress(counts["queried"], len(todo))

    if progress:
        progress(0, len(todo))
    pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="esrl-judge")
    futures = {pool.submit(ask, m): m for m in todo.values()}
    try:
        for future in as_completed(futures):
            save(future, futures[future])
    except BaseException as e:
        for future in futures:
            future.cancel()
        pool.shutdown(wait=True)
        for future, m in futures.items():  # keep what finished while the others were stopped
            if future.done() and not future.cancelled() and future.exception() is None and future not in saved:
                save(future, m)
        if isinstance(e, JudgeError):
            raise JudgeError(f"{e} ({len(cache.entries)} judgments are saved in {cache.path}: run the same "
                             "command again to resume)") from None
        raise
    finally:
        pool.shutdown(wait=False)
    return counts


def verdict(m: Match, cache: JudgmentCache) -> str | None:
    return "tie" if m.key is None else parse_verdict(cache[m.key]["raw"])


def wins_tensor(matches: list[Match], t: Tournament, criteria: list[str], cache: JudgmentCache) -> np.ndarray:
    """wins[c, k, i, j]: points model i took from model j on prompt k under criterion c (both orders)."""
    index = {name: i for i, name in enumerate(t.models)}
    wins = np.zeros((len(criteria), len(t.prompts), len(t.models), len(t.models)))
    for m in matches:
        c, a, b = criteria.index(m.criterion), index[m.first], index[m.second]
        points = POINTS[verdict(m, cache)]
        wins[c, m.prompt, a, b] += points
        wins[c, m.prompt, b, a] += 1 - points
    return wins


def record(wins: np.ndarray) -> np.ndarray:
    """[games, wins, ties, losses, score] per model from wins[g, i, j] of games g (one criterion and prompt
    each): a game's result is the model's mean points over both orders (above 1/2 a win, 1/2 a tie), its
    score the mean result."""
    n = wins.shape[-1]
    out = np.zeros((n, 5))
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            result = wins[:, i, j] / 2
            out[i] += [len(result), (result > 0.5).sum(), (result == 0.5).sum(), (result < 0.5).sum(), result.sum()]
    out[:, 4] /= np.maximum(out[:, 0], 1)
    return out


def rate(wins: np.ndarray, models: list[str], criteria: list[str], rounds: int, seed: int,
         prior: float = 1.0) -> dict[str, dict[str, dict[str, float]]]:
    """Per criterion and overall (all criteria's games together): rating, 95% interval and record per model."""
    n = len(models)
    # name -> (wins per prompt, for the fit and the resampling; wins per game, for the record)
    tables = {c: (wins[i], wins[i]) for i, c in enumerate(criteria)}
    tables["overall"] = (wins.sum(axis=0), wins.reshape(-1, n, n))
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, (per_prompt, per_game) in tables.items():
        rating, low, high = bootstrap_ratings(per_prompt, rounds, seed, prior=prior)
        stats = record(per_game)
        out[name] = {model: {"rating": round(float(rating[i]), 2), "ci_low": round(float(low[i]), 2),
                             "ci_high": round(float(high[i]), 2), "games": int(stats[i, 0]),
                             "wins": int(stats[i, 1]), "ties": int(stats[i, 2]), "losses": int(stats[i, 3]),
                             "score": round(float(stats[i, 4]), 4)}
                     for i, model in enumerate(models)}
    return out


def judge_stats(matches: list[Match], cache: JudgmentCache) -> dict[str, Any]:
    """Unparsed answers (counted as ties; `too_long` of them past the judge's context) and how often the judge picked
    the response shown first."""
    verdicts = [verdict(m, cache) for m in matches if m.key is not None]
    picks = [v for v in verdicts if v in ("A", "B")]
    too_long = sum(bool(cache[m.key].get("too_long")) for m in matches if m.key is not None)
    return {"unparsed": sum(v is None for v in verdicts), "too_long": too_long,
            "first_position_rate": round(picks.count("A") / len(picks), 4) if picks else None}


__all__ = ["Match", "judge_missing", "judge_stats", "rate", "record", "schedule", "wins_tensor"]
