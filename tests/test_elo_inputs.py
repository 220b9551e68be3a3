"""`esrl elo`'s inputs that once went wrong silently: a criterion given twice, a judge answer holding a Unicode line
separator in the judgment cache."""

from __future__ import annotations

import json

import pytest

from esrl.elo.cache import JudgmentCache
from esrl.elo.cli import parser, run
from esrl.errors import ConfigError


def test_a_criterion_given_twice_is_refused(tmp_path):
    """Every game went to the first copy and the second was rated from none: 1000 for everyone."""
    args = parser().parse_args(["--judge-url", "http://127.0.0.1:9", "--judge-model", "judge", "--completions",
                                str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--out", str(tmp_path / "out"),
                                "--criteria", "helpfulness", "helpfulness"])
    with pytest.raises(ConfigError, match="^--criteria helpfulness helpfulness: a criterion given twice"):
        run(args)
    assert not (tmp_path / "out").exists()


def test_flags_given_twice_add_up():
    """A second --completions replaced the first (then "give at least two models", though two were given); a second
    --criteria likewise, silently."""
    args = parser().parse_args(["--judge-url", "u", "--judge-model", "j", "--completions", "a.jsonl", "--completions",
                                "b.jsonl", "--criteria", "helpfulness", "--criteria", "harmlessness", "--out", "o"])
    assert args.completions == ["a.jsonl", "b.jsonl"] and args.criteria == ["helpfulness", "harmlessness"]


def test_answers_holding_unicode_line_separators_survive_the_cache(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 raw; str.splitlines() cut records there,
    so each rerun asked the judge again and counted damaged lines."""
    path = tmp_path / "judgments.jsonl"
    cache = JudgmentCache(path)
    answers = {"k1": "Yes\u2028really", "k2": "No\u2029", "k3": "a\x85b", "k4": "plain"}
    for key, raw in answers.items():
        cache.add({"key": key, "raw": raw})
    cache.close()
    again = JudgmentCache(path)
    again.close()
    assert {k: r["raw"] for k, r in again.entries.items()} == answers and again.damaged == 0
    assert len(path.read_bytes().split(b"\n")) == len(answers) + 1 and json.loads(path.read_text().split("\n")[0])


def test_a_rerun_asks_again_what_the_judge_answered_unreadably(tmp_path):
    """A judge cut off by --max-tokens (or thinking aloud first) answered naming neither response: cached, those
    ties stayed for good, and a rerun with the judge fixed asked nothing. Unreadable answers are asked again."""
    from test_elo import StubJudge, counts, elo_args, write_files

    specs = write_files(tmp_path / "files", models=("es", "grpo"))
    out = tmp_path / "out"
    first = run(elo_args("http://127.0.0.1:9/v1", specs, out, "--criteria", "helpfulness"),
                judge=StubJudge(lambda a, b: "I cannot decide, maybe."))
    assert first["judgments"]["unparsed"] == 2 * 3
    fixed = StubJudge(lambda a, b: "A")
    again = run(elo_args("http://127.0.0.1:9/v1", specs, out, "--criteria", "helpfulness"), judge=fixed)
    assert fixed.calls == 2 * 3 and counts(again)[:3] == (2 * 3, 0, 2 * 3) and again["judgments"]["unparsed"] == 0
