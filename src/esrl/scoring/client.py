"""HTTPScorer: the Scorer interface over `esrl serve-scorer`, with timeouts, retries and exponential backoff."""

from __future__ import annotations

import json
import time
from typing import Any, Sequence

from esrl.errors import ScorerError
from esrl.scoring.base import Scorer, check_scores
from esrl.scoring.http_errors import RETRY_STATUS, exception_line, response_detail
from esrl.scoring.token import client_token


class OverLimit(ScorerError):
    """The service refused a request as over its limits (HTTP 413)."""


class HTTPScorer(Scorer):
    """Scores through a scorer service (POST {url}/score_batch).

    Args:
        url: the service's base URL, e.g. http://127.0.0.1:8000.
        token: bearer token (default: the file named by ESRL_SCORER_TOKEN_FILE, else the environment variable
            ESRL_SCORER_TOKEN, as `esrl serve-scorer` reads them).
        timeout: seconds per request (connect and read).
        retries: further attempts after a failed one (connection errors, timeouts, 408/425/429/5xx answers).
        backoff: seconds before the first retry; doubled each time, at most `max_backoff`.
        max_items, max_chars: split a batch into requests of at most this many items / characters. Left out, a
            request the service refuses as over its limits (HTTP 413) makes the client read them (GET /health) once
            and split the batch by them.
    Other 4xx answers (a wrong token; over the limits, once the service's own are in use) are not retried. When
    every attempt fails, or the answer is malformed (not JSON, wrong length, non-numbers, NaN), ScorerError names
    the URL and the cause.
    """

    def __init__(self, url: str, token: str | None = None, timeout: float = 60.0, retries: int = 3,
                 backoff: float = 1.0, max_backoff: float = 30.0, max_items: int | None = None,
                 max_chars: int | None = None):
        import httpx

        super().__init__()
        if retries < 0 or timeout <= 0 or backoff < 0:
            raise ValueError("HTTPScorer: retries >= 0, timeout > 0 and backoff >= 0 please")
        if any(limit is not None and limit < 1 for limit in (max_items, max_chars)):
            raise ValueError(f"HTTPScorer: max_items and max_chars must be >= 1 (or None), got {max_items}, "
                             f"{max_chars}")
        self.url = url.rstrip("/")
        self.name = f"scorer {self.url}"
        self.token = client_token(token)  # else ESRL_SCORER_TOKEN_FILE, else ESRL_SCORER_TOKEN
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_items = max_items
        self.max_chars = max_chars
        self._read_service_limits = False
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._client = httpx.Client(timeout=httpx.Timeout(timeout), headers=headers)

    def _request(self, method: str, path: str, payload: Any = None) -> Any:
        import httpx

        url = self.url + path
        cause, verb = "no attempt", "unreachable"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), self.max_backoff))
            try:
                response = self._client.request(method, url, json=payload)
            except httpx.TransportError as e:  # connection refused, timeouts, broken connections
                cause, verb = exception_line(e), "unreachable"
                continue
            if response.status_code in RETRY_STATUS:
                cause, verb = f"HTTP {response.status_code} {response_detail(response)}", "failing"
                continue
            if response.status_code >= 400:
                error = OverLimit if response.status_code == 413 else ScorerError
                raise error(f"scorer {url}: HTTP {response.status_code} {response_detail(response)}")
            try:
                return response.json()
            except (json.JSONDecodeError, ValueError):
                raise ScorerError(f"scorer {url}: the answer is not JSON ({response.text[:80]!r})") from None
        attempts = self.retries + 1
        raise ScorerError(f"scorer {url}: {verb} after {attempts} attempt{'s' * (attempts > 1)} ({cause})")

    def health(self) -> dict[str, Any]:
        answer = self._request("GET", "/health")
        if not isinstance(answer, dict):
            raise ScorerError(f"scorer {self.url}/health: expected a JSON object, got {type(answer).__name__}")
        return answer

    def _chunks(self, prompts: Sequence[str], responses: Sequence[str]) -> list[tuple[int, int]]:
        spans, start, chars = [], 0, 0
        for i, (p, r) in enumerate(zip(prompts, responses)):
            size = len(p) + len(r)
            full = (self.max_items is not None and i - start >= self.max_items) or (
                self.max_chars is not None and i > start and chars + size > self.max_chars)
            if full:
                spans.append((start, i))
                start, chars = i, 0
            chars += size
        spans.append((start, len(prompts)))
        return spans

    def _score(self, prompts: list[str], responses: list[str]) -> tuple[list[float], list[float]]:
        try:
            return self._score_requests(prompts, responses)
        except OverLimit:
            if not self._adopt_service_limits():
                raise
            return self._score_requests(prompts, responses)

    def _adopt_service_limits(self) -> bool:
        """After a request over the service's limits: its max_items and max_chars (GET /health) where lower than the
        client's, once per client. True when the batch now splits otherwise."""
        if self._read_service_limits:
            return False
        self._read_service_limits = True
        health, changed = self.health(), False
        for name in ("max_items", "max_chars"):
            limit, own = health.get(name), getattr(self, name)
            if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1 and (own is None or limit < own):
                setattr(self, name, limit)
                changed = True
        return changed

    def _score_requests(self, prompts: list[str], responses: list[str]) -> tuple[list[float], list[float]]:
        rewards: list[float] = []
        costs: list[float] = []
        for a, b in self._chunks(prompts, responses):
            answer = self._request("POST", "/score_batch", {"prompts": prompts[a:b], "responses": responses[a:b]})
            source = f"scorer {self.url}/score_batch" + (f" (items {a}..{b - 1} of {len(prompts)})" if b - a < len(
                prompts) else "")
            if not isinstance(answer, dict) or "rewards" not in answer or "costs" not in answer:
                raise ScorerError(f"{source}: expected a JSON object with 'rewards' and 'costs', got "
                                  f"{json.dumps(answer)[:80]}")
            r, c = check_scores(answer["rewards"], answer["costs"], b - a, source, offset=a)
            rewards += r
            costs += c
        return rewards, costs

    def close(self) -> None:
        self._client.close()


__all__ = ["HTTPScorer"]
