"""Elo ratings from pairwise results: a Bradley-Terry fit on the Elo scale, with bootstrap intervals (numpy only).

Why Bradley-Terry and not online Elo: online Elo updates after every game, so its ratings depend on the order
of the games and on the K-factor, and they over-weight the last games. The models compared here do not change
during the tournament, so every game should count the same. The Bradley-Terry maximum-likelihood fit is the
order-free estimate of the very model Elo assumes, P(i beats j) = 1 / (1 + 10^((R_j - R_i) / 400)); LMSYS's
Chatbot Arena moved from online Elo to it for this reason. Ratings are 400 * log10 of the Bradley-Terry
strengths, anchored so that their mean is 1000. A tie counts as half a win for each side.

The plain maximum-likelihood fit diverges when a model wins every game (its rating runs off to infinity, as with
a small tournament or a bootstrap resample of it). `prior` adds that many virtual ties of every model against a
phantom opponent rated at the mean (BayesElo's prior of virtual draws): every rating stays finite, and ratings
backed by many games barely move. prior=0 is the plain maximum-likelihood fit.
"""

from __future__ import annotations

import math

import numpy as np

SCALE = 400 / math.log(10)  # Elo points per natural-log unit of strength
ANCHOR = 1000.0  # mean rating


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * x))


def _log_likelihood(beta: np.ndarray, wins: np.ndarray, prior: float) -> float:
    d = beta[:, None] - beta[None, :]
    value = -(wins * np.logaddexp(0.0, -d)).sum()  # sum of wins * log sigmoid(d)
    return value - prior * 0.5 * (np.logaddexp(0.0, -beta) + np.logaddexp(0.0, beta)).sum()


def fit_ratings(wins: np.ndarray, prior: float = 1.0, tol: float = 1e-10, max_iter: int = 100) -> np.ndarray:
    """Elo ratings (mean 1000) from wins[i, j] = games model i won against model j (a tie adds 1/2 to both).

    Newton's method with step halving on the concave log-likelihood: a handful of iterations. With prior=0 the
    maximum exists when every model both won and lost something against the others (else see the module doc).
    """
    wins = np.asarray(wins, dtype=float)
    if wins.ndim != 2 or wins.shape[0] != wins.shape[1] or (wins < 0).any() or prior < 0:
        raise ValueError("fit_ratings: wins must be a square matrix of non-negative counts, prior >= 0")
    games = wins + wins.T
    beta = np.zeros(len(wins))
    current = _log_likelihood(beta, wins, prior)
    for _ in range(max_iter):
        p = _sigmoid(beta[:, None] - beta[None, :])
        grad = (wins - games * p).sum(axis=1) + prior * (0.5 - _sigmoid(beta))
        w = games * p * p.T
        curvature = np.diag(w.sum(axis=1) + prior * _sigmoid(beta) * _sigmoid(-beta)) - w  # minus the Hessian
        step = np.linalg.lstsq(curvature, grad, rcond=None)[0]  # least squares: singular along 1 when prior=0
        t = 1.0
        while True:
            trial = beta + t * step
            value = _log_likelihood(trial, wins, prior)
            if value >= current - 1e-12 or t < 1e-8:
                break
            t /= 2
        beta, current = trial, value
        if np.abs(t * step).max() < tol:
            break
    return ANCHOR + SCALE * (beta - beta.mean())


def bootstrap_ratings(per_prompt: np.ndarray, rounds: int = 1000, seed: int = 0, level: float = 0.95,
                      prior: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ratings and percentile-bootstrap intervals; per_prompt[k] is the wins matrix of prompt k.

    Prompts, not single games, are resampled: the games on one prompt share its difficulty, so resampling them
    one by one would make the intervals too narrow. The same seed draws the same resamples, so the per-criterion
    and overall intervals of one tournament come from the same resampled prompt sets.
    """
    per_prompt = np.asarray(per_prompt, dtype=float)
    count = len(per_prompt)
    rating = fit_ratings(per_prompt.sum(axis=0), prior)
    if rounds <= 0 or count == 0:
        return rating, rating.copy(), rating.copy()
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(count, np.full(count, 1.0 / count), size=rounds)
    samples = np.stack([fit_ratings(np.tensordot(c.astype(float), per_prompt, axes=1), prior) for c in draws])
    low, high = np.percentile(samples, [50 * (1 - level), 50 * (1 + level)], axis=0)
    return rating, low, high


__all__ = ["ANCHOR", "SCALE", "bootstrap_ratings", "fit_ratings"]
