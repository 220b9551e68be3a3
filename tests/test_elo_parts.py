"""`esrl elo`'s parts: the Bradley-Terry Elo fit against written-out references, the bootstrap, a judge's verdict
read from its answer, and the judge's HTTP client (the tournaments, files and cache: test_elo.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conftest import free_port
from esrl.elo.judge import ChatJudge, JudgeError, parse_verdict
from esrl.elo.rating import ANCHOR, bootstrap_ratings, fit_ratings


def elo_gap(p: float) -> float:
    """The Elo difference at which the stronger side scores p."""
    return 400 * math.log10(p / (1 - p))


# -- the fit ------------------------------------------------------------------------------------------------
def test_two_players_rating_gap_is_the_elo_gap_of_the_win_rate():
    r = fit_ratings(np.array([[0.0, 7.0], [3.0, 0.0]]), prior=0)
    assert r[0] - r[1] == pytest.approx(elo_gap(0.7), abs=1e-6)  # 147.2 Elo
    assert r.mean() == pytest.approx(ANCHOR)


def test_results_drawn_from_known_ratings_give_them_back():
    # Expected scores of ratings 1200/1000/800 over 10 games a pair: the likelihood's stationary point is there.
    truth = np.array([1200.0, 1000.0, 800.0])
    p = 1 / (1 + 10 ** ((truth[None, :] - truth[:, None]) / 400))
    wins = 10 * p * (1 - np.eye(3))
    assert fit_ratings(wins, prior=0) == pytest.approx(truth, abs=1e-6)


def test_symmetric_results_give_equal_ratings():
    assert fit_ratings(np.full((3, 3), 2.0) * (1 - np.eye(3))) == pytest.approx([1000] * 3)
    cycle = np.array([[0, 4, 1], [1, 0, 4], [4, 1, 0]], dtype=float)  # rock, paper, scissors
    assert fit_ratings(cycle, prior=0) == pytest.approx([1000] * 3)


def test_a_model_winning_every_game_ranks_first_and_stays_finite():
    wins = np.array([[0, 6, 6], [0, 0, 3], [0, 3, 0]], dtype=float)
    r = fit_ratings(wins)
    assert np.isfinite(r).all() and r[0] == r.max() and r[0] - r[1] > 300
    assert r[1] == pytest.approx(r[2])
    # The prior is mild: with many games the fit is the plain maximum-likelihood one.
    many = 1000 * np.array([[0.0, 7.0], [3.0, 0.0]])
    assert fit_ratings(many)[0] - fit_ratings(many)[1] == pytest.approx(elo_gap(0.7), abs=0.5)


def test_relabelling_models_relabels_ratings():
    rng = np.random.default_rng(1)
    wins = rng.integers(0, 5, (4, 4)) * (1 - np.eye(4))
    order = [2, 0, 3, 1]
    assert fit_ratings(wins[np.ix_(order, order)]) == pytest.approx(fit_ratings(wins)[order])


def test_bootstrap_is_seeded_and_brackets_the_rating():
    rng = np.random.default_rng(0)
    per_prompt = rng.integers(0, 3, (8, 3, 3)) * (1 - np.eye(3))
    r, low, high = bootstrap_ratings(per_prompt, rounds=300, seed=5)
    again = bootstrap_ratings(per_prompt, rounds=300, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip((r, low, high), again))
    assert (low <= r).all() and (r <= high).all() and (low < high).any()
    # Prompts that all tell the same story leave nothing to resample: the interval is the rating itself.
    same = np.repeat(per_prompt[:1], 8, axis=0)
    r, low, high = bootstrap_ratings(same, rounds=50, seed=0)
    assert np.array_equal(low, r) and np.array_equal(high, r)


# -- verdicts, files, tally ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, verdict", [
    ("A", "A"), (" B.", "B"), ("Response B is better", "B"), ("**A**", "A"), ("(B)", "B"),
    ("The answer to the user's question is A.", "A"), ("a better answer is B", "B"), ("Tie", "tie"),
    ("They are equally helpful", "tie"), ("I cannot decide", None), ("", None), ("ABBA", None),
    # ties that name both letters were once a vote for the first one named
    ("A and B are equally helpful.", "tie"), ("Response A and Response B are tied", "tie"),
    ("Neither A nor B; tie", "tie"), ("Both are about equal, but A is clearer", "A"),
    ("Response B is better than A", "B"),
    # and clear votes that name a tie word are no ties
    ("B. Response A repeats the same error.", "B"), ("Neither is perfect, but B is better than A.", "B"),
    ("A is better; B gives the same answer but wrong.", "A"),
    # a leading letter followed by a comma, a semicolon, a bracket or a dash was once a tie (the other letter named)
    ("B, since A repeats the same mistake.", "B"), ("B (A is equally fluent but unsafe)", "B"),
    ("B - A is equally long but wrong", "B"), ("A; B is equally long but wrong", "A"),
    ("Both A and B are fine.", "tie"), ("A, B: both equally good", "tie"),
])
def test_parse_verdict(text, verdict):
    assert parse_verdict(text) == verdict


# -- the HTTP client ----------------------------------------------------------------------------------------
def test_client_retries_5xx_and_fails_fast_on_4xx():
    import httpx

    answers = [httpx.Response(503, json={"error": {"message": "busy"}})] * 2 + [
        httpx.Response(200, json={"choices": [{"message": {"content": "B"}}]}),
        httpx.Response(401, json={"error": {"message": "Incorrect API key provided"}})]
    seen = []

    def handler(request):
        seen.append(request)
        return answers[len(seen) - 1]

    judge = ChatJudge("http://judge.test/v1", "m", api_key="sk-test", retries=2, backoff=0)
    judge._client = httpx.Client(transport=httpx.MockTransport(handler), headers=judge._client.headers)
    assert judge.ask("helpfulness", "p", "a", "b") == "B" and len(seen) == 3
    body = json.loads(seen[0].content)
    assert seen[0].headers["authorization"] == "Bearer sk-test" and body["temperature"] == 0
    assert body["messages"][1]["content"].startswith("[User prompt]\np\n")
    with pytest.raises(JudgeError, match=r"judge http://judge.test/v1/chat/completions: HTTP 401 Incorrect API"):
        judge.ask("helpfulness", "p", "a", "b")
    assert len(seen) == 4


def test_the_client_says_when_max_tokens_cut_the_answer():
    import httpx

    def handler(request):
        cut = json.loads(request.content)["max_tokens"] < 8
        return httpx.Response(200, json={"choices": [{"message": {"content": "Response A is" if cut else "B"},
                                                      "finish_reason": "length" if cut else "stop"}]})

    for max_tokens, text, cut in ((4, "Response A is", True), (64, "B", False)):
        judge = ChatJudge("http://judge.test/v1", "m", max_tokens=max_tokens)
        judge._client = httpx.Client(transport=httpx.MockTransport(handler))
        answer = judge.ask("helpfulness", "p", "a", "b")
        assert (answer, answer.truncated) == (text, cut)


def test_unreachable_judge_names_the_url_and_attempts():
    port = free_port()  # nothing listens there
    judge = ChatJudge(f"http://127.0.0.1:{port}/v1", "m", retries=1, backoff=0, timeout=5)
    with pytest.raises(JudgeError, match=rf"127.0.0.1:{port}/v1/chat/completions: failed after 2 attempts"):
        judge.ask("helpfulness", "p", "a", "b")
